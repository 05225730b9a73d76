-- Named queries for the PostgreSQL store (READ COMMITTED). `{now}` is the database clock; parameters are :named.
-- Every transition is conditional: a statement that changes no row means "you lost it".

-- name: claim_tasks
-- MATERIALIZED keeps the planner from re-running the locking subquery per row; SKIP LOCKED lets
-- concurrent schedulers take disjoint batches without waiting on each other.
WITH c AS MATERIALIZED (
    SELECT id FROM tasks
    WHERE locked_by IS NULL AND state IN ('pending', 'compensating') AND run_at <= {now}
    ORDER BY priority DESC, id LIMIT :limit
    FOR UPDATE SKIP LOCKED)
UPDATE tasks t SET locked_by = :me,
                   state = CASE WHEN t.state = 'pending' THEN 'processing' ELSE t.state END,
                   updated_at = {now}
FROM c WHERE t.id = c.id
RETURNING t.id, t.state, t.input, t.priority, t.correlation_id, t.reply_to, t.cancel_requested, t.workflow;

-- name: task_for_update
-- Every transition of a task locks its row first, so its steps change under one lock at a time.
SELECT id, state, input, priority, correlation_id, reply_to, cancel_requested, locked_by, workflow
FROM tasks WHERE id = :task_id FOR UPDATE;

-- name: task_for_sweep
-- The supervisor skips a task another transaction holds (a reply being applied, a paused
-- session): waiting would hold its fenced FOR SHARE on the lease and block its own renewal. The
-- task is still expired at the next sweep.
SELECT id, state, input, priority, correlation_id, reply_to, cancel_requested, locked_by, workflow
FROM tasks WHERE id = :task_id FOR UPDATE SKIP LOCKED;

-- name: claim_requests
WITH c AS MATERIALIZED (
    SELECT id FROM requests
    WHERE state = 'queued' AND agent = :agent AND complete_by > {now}
    ORDER BY priority DESC, id LIMIT :limit
    FOR UPDATE SKIP LOCKED)
UPDATE requests SET state = 'taken', taken_by = :me, taken_at = {now}
FROM c WHERE requests.id = c.id
RETURNING requests.id, task_id, step_idx, attempt, kind, agent, operation, payload, policy,
          idempotency_key, complete_by, complete_by - {now} AS remaining;

-- name: new_replies
SELECT id, request_id, task_id, step_idx, attempt, kind, outcome, result, error, received_at, sent_by
FROM replies WHERE status = 'new' ORDER BY id LIMIT :limit FOR UPDATE SKIP LOCKED;

-- name: lease_holds
-- FOR SHARE: a successor's acquire (an UPDATE of this row) waits until this fenced transaction
-- has committed, so two terms never write at the same time.
SELECT 1 AS ok FROM leases
WHERE name = :name AND holder = :holder AND term = :term AND expires_at > {now} FOR SHARE;

-- name: prune_steps
DELETE FROM steps WHERE task_id IN (SELECT value::bigint FROM jsonb_array_elements_text(:ids::jsonb));

-- name: prune_requests
DELETE FROM requests WHERE task_id IN (SELECT value::bigint FROM jsonb_array_elements_text(:ids::jsonb));

-- name: prune_replies
DELETE FROM replies WHERE task_id IN (SELECT value::bigint FROM jsonb_array_elements_text(:ids::jsonb));

-- name: prune_events
DELETE FROM events WHERE task_id IN (SELECT value::bigint FROM jsonb_array_elements_text(:ids::jsonb));

-- name: prune_messages
DELETE FROM messages WHERE task_id IN (SELECT value::bigint FROM jsonb_array_elements_text(:ids::jsonb));

-- name: prune_tasks
DELETE FROM tasks WHERE id IN (SELECT value::bigint FROM jsonb_array_elements_text(:ids::jsonb));

-- name: prunable_tasks
-- FOR UPDATE re-checks each row as committed: a task an operator retried meanwhile no longer
-- matches and is skipped, so its rows are never deleted under it.
SELECT id FROM tasks
WHERE finished_at IS NOT NULL AND finished_at < {now} - :retention
  AND state IN ('processed', 'compensated', 'cancelled')
ORDER BY finished_at LIMIT :limit
FOR UPDATE SKIP LOCKED;
