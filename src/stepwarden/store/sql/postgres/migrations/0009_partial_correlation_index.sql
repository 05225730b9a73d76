-- stepwarden schema, version 9 (PostgreSQL): only tasks that have a correlation id are in its index.

-- Most tasks have none, and each one still took an entry of NULL: an index entry more in every
-- submission. Every read by correlation id compares it with a value, which implies IS NOT NULL,
-- so it still searches the index. (events_kind stays: the metrics' totals at a process's start
-- read events by kind.)
-- The new index is built first, under CREATE INDEX's SHARE lock (writes to tasks wait, reads go
-- on), and the old one dropped after it: DROP INDEX takes an ACCESS EXCLUSIVE lock on the table
-- until the migration commits, which would have stopped reads of tasks for the whole build.
CREATE INDEX tasks_correlation_partial ON tasks (correlation_id) WHERE correlation_id IS NOT NULL;
DROP INDEX tasks_correlation;
ALTER INDEX tasks_correlation_partial RENAME TO tasks_correlation;
