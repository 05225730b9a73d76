-- stepwarden schema, version 9 (SQLite): only tasks that have a correlation id are in its index.

-- Most tasks have none, and each one still took an entry of NULL: an index page more in every
-- submission's commit (about 5 % of a SQLite submission's time, measured). Every read by
-- correlation id compares it with a value, which implies IS NOT NULL, so it still searches the
-- index. (events_kind stays: the metrics' totals at a process's start read events by kind.)
DROP INDEX tasks_correlation;
CREATE INDEX tasks_correlation ON tasks (correlation_id) WHERE correlation_id IS NOT NULL;
