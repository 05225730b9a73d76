-- stepwarden schema, version 8 (SQLite): the store's own id, random, made once with its schema.

-- Task ids start at 1 in every store, so a task's idempotency key (TASK_ID:STEP_NAME) and trace
-- id are unique only within it: a store made again, or a second store (staging beside prod, a
-- move from SQLite to PostgreSQL) calling the same service, would send keys the service has seen.
-- Request.global_idempotency_key and the trace ids put this id in front (see docs/guarantees.md).
-- One row, forever: `one` keeps it single. (A copy of the file keeps the id: a copy that then runs
-- apart from its original should be given a new one, see docs/deploying.md.)
CREATE TABLE store_identity (
    one INTEGER PRIMARY KEY CHECK (one = 1),
    id  TEXT NOT NULL
);
INSERT INTO store_identity (one, id) VALUES (1, lower(hex(randomblob(8))));
