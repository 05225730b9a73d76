-- stepwarden schema, version 9 (SQLite): two index entries fewer in every submission and event.

-- Only tasks that have a correlation id are in its index. Most tasks have none, and each one still
-- took an entry of NULL: an index page more in every submission's commit (about 5 % of a SQLite
-- submission's time, measured). Every read by correlation id compares it with a value, which
-- implies IS NOT NULL, so it still searches the index.
DROP INDEX tasks_correlation;
CREATE INDEX tasks_correlation ON tasks (correlation_id) WHERE correlation_id IS NOT NULL;

-- No index of events by kind. Every read of events goes by task (events_task) or by id (the
-- metrics' tail, the history's "since"), and the one GROUP BY kind over all of them (the metrics'
-- totals when a process starts) reads them all either way. Each of a task's events (five for a
-- one-step task) paid an entry in it: about 5 % of a SQLite submission's time, measured.
DROP INDEX events_kind;
