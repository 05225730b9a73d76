-- stepwarden schema, version 9 (PostgreSQL): only tasks that have a correlation id are in its index.

-- Most tasks have none, and each one still took an entry of NULL: an index page more in every
-- submission's commit (about 5 % of a SQLite submission's time, measured). Every read by
-- correlation id compares it with a value, which implies IS NOT NULL, so it still uses the index.
-- The index is rebuilt holding the table's lock: on a store with millions of tasks, migrate at a
-- quiet time (docs/deploying.md).
DROP INDEX tasks_correlation;
CREATE INDEX tasks_correlation ON tasks (correlation_id) WHERE correlation_id IS NOT NULL;
