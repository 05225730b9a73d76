-- stepwarden schema, version 5: one index fewer on the busiest insert.

-- Every state change writes an event, and no query reads events by kind (a task's history is read
-- by task, the metrics' tail by id), so the index on (kind, id) only cost each insert a write.
DROP INDEX IF EXISTS events_kind;
