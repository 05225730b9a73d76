-- stepwarden schema, version 6 (PostgreSQL): tasks waiting out a back-off stay out of the claim's way.

-- A task released with a delay (a failed attempt's back-off, the "wait" escalation) is waiting
-- until its run_at. The claim read every waiting task of the claimable index, in priority order,
-- to find the due ones: an outage of one service made every round read all of its waiting tasks.
-- Waiting tasks now have an index of their own, by when they are due; the claim reads its due end.
ALTER TABLE tasks ADD COLUMN waiting INTEGER NOT NULL DEFAULT 0;
UPDATE tasks SET waiting = 1
WHERE locked_by IS NULL AND state IN ('pending', 'compensating') AND run_at > extract(epoch from statement_timestamp())::float8;
DROP INDEX tasks_claimable;
CREATE INDEX tasks_claimable ON tasks (priority DESC, id)
    WHERE locked_by IS NULL AND state IN ('pending', 'compensating') AND waiting = 0;
CREATE INDEX tasks_waiting ON tasks (run_at)
    WHERE locked_by IS NULL AND state IN ('pending', 'compensating') AND waiting = 1;
