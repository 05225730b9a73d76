-- stepwarden schema, version 4: telling a dead worker from a slow one, and pruning finished tasks.

-- Where a worker runs, so a supervisor on the same host (and PID namespace) can see at once that
-- its process is gone, instead of waiting for its heartbeat to go stale.
ALTER TABLE workers ADD COLUMN host_key TEXT;
ALTER TABLE workers ADD COLUMN pid INTEGER;
ALTER TABLE workers ADD COLUMN proc_start TEXT;

-- The steps a dead worker's agents had taken: found by owner, not by scanning requests.
CREATE INDEX requests_taken ON requests (taken_by) WHERE state = 'taken';

-- The leader prunes finished tasks oldest first, in bounded batches.
CREATE INDEX tasks_finished ON tasks (finished_at) WHERE finished_at IS NOT NULL;
