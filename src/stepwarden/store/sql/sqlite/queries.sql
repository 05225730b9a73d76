-- Named queries for the SQLite store. `{now}` is the database clock; parameters are :named.
-- Every transition is conditional: a statement that changes no row means "you lost it".

-- name: claim_tasks
-- The best :limit of the ready tasks and of the waiting ones now due, each read from its own index
-- (the waiting ones by when they are due: those not due yet are not read), in one priority order.
-- A ready task (waiting = 0) is claimable whatever the clock says: its run_at was the time it
-- became ready, and a step of the database's clock back (NTP, a resumed virtual machine) left it
-- in the future, and every task ready before the step unclaimed for as long as the step.
UPDATE tasks SET locked_by = :me,
                 state = CASE WHEN state = 'pending' THEN 'processing' ELSE state END,
                 waiting = 0, updated_at = {now}
WHERE id IN (SELECT id FROM (
                 SELECT id, priority FROM (
                     SELECT id, priority FROM tasks INDEXED BY tasks_claimable
                     WHERE locked_by IS NULL AND state IN ('pending', 'compensating') AND waiting = 0
                     ORDER BY priority DESC, id LIMIT :limit)
                 UNION ALL
                 SELECT id, priority FROM (
                     SELECT id, priority FROM tasks INDEXED BY tasks_waiting
                     WHERE locked_by IS NULL AND state IN ('pending', 'compensating') AND waiting = 1
                       AND run_at <= {now}
                     ORDER BY priority DESC, id LIMIT :limit))
             ORDER BY priority DESC, id LIMIT :limit)
RETURNING id, state, input, priority, correlation_id, reply_to, cancel_requested, workflow,
          {now} AS now;

-- name: task_for_update
SELECT id, state, input, priority, correlation_id, reply_to, cancel_requested, locked_by, workflow
FROM tasks WHERE id = :task_id;

-- name: task_for_sweep
SELECT id, state, input, priority, correlation_id, reply_to, cancel_requested, locked_by, workflow
FROM tasks WHERE id = :task_id;

-- name: claim_agent_requests
-- Queued requests of one agent, in claim order, for an agent instance's pull or the take of its
-- reservation in a reply batch or a scheduler round: only the operations it has (`:ops`, a JSON
-- array), so that a worker of another version (a rolling deploy) leaves the others' requests
-- queued.
UPDATE requests SET state = 'taken', taken_by = :me, taken_at = {now}
WHERE id IN (SELECT id FROM requests INDEXED BY requests_queued
             WHERE state = 'queued' AND agent = :agent
               AND complete_by > {now}
               AND operation IN (SELECT value FROM json_each(:ops))
             ORDER BY priority DESC, id LIMIT :limit)
RETURNING id, task_id, step_idx, attempt, kind, agent, operation, payload, policy, idempotency_key,
          complete_by, complete_by - {now} AS remaining;

-- name: agent_request_waiting
-- A queued request of the agent, of the operations :ops, that has waited :waited seconds or more:
-- an unhealthy instance's probe may take a breaker's trial left untaken (see agents.pull).
SELECT 1 AS found FROM requests INDEXED BY requests_queued
WHERE state = 'queued' AND agent = :agent AND complete_by > {now} AND dispatched_at <= {now} - :waited
  AND operation IN (SELECT value FROM json_each(:ops))
LIMIT 1;

-- name: new_replies_with_tasks
-- The batch's new replies and the transaction's own (`:own`, JSON: not in the table, id NULL,
-- `n` their order), each with its task (SQLite's single writer is the lock).
SELECT r.id, r.request_id, r.task_id, r.step_idx, r.attempt, r.kind, r.outcome, r.result, r.error,
       r.received_at, r.sent_by, r.n, {now} AS now,
       t.id AS t_id, t.state AS t_state, t.input AS t_input, t.priority AS t_priority,
       t.correlation_id AS t_correlation_id, t.reply_to AS t_reply_to,
       t.cancel_requested AS t_cancel_requested, t.locked_by AS t_locked_by, t.workflow AS t_workflow
FROM (SELECT id, request_id, task_id, step_idx, attempt, kind, outcome, result, error, received_at,
             sent_by, NULL AS n
      FROM (SELECT * FROM replies WHERE status = 'new' ORDER BY id LIMIT :limit)
      UNION ALL
      SELECT NULL, q.id, q.task_id, q.step_idx, q.attempt, q.kind, json_extract(o.value, '$.outcome'),
             json_extract(o.value, '$.result'), json_extract(o.value, '$.error'), {now}, :me, o.key
      FROM json_each(:own) o JOIN requests q ON q.id = json_extract(o.value, '$.request_id')) r
LEFT JOIN tasks t ON t.id = r.task_id;

-- name: steps_of_new_replies
SELECT task_id, idx, name, agent, operation, compensate, budget, policy, on_error, state, attempt,
       failure_count, failure_offset, comp_failures, locked_by, complete_by, result, last_error,
       started_at, finished_at
FROM steps WHERE task_id IN (
    SELECT task_id FROM (SELECT task_id FROM replies WHERE status = 'new' ORDER BY id LIMIT :limit)
    UNION ALL
    SELECT q.task_id FROM json_each(:own) o JOIN requests q ON q.id = json_extract(o.value, '$.request_id'))
ORDER BY task_id, idx;

-- name: lease_holds
SELECT 1 AS ok FROM leases
WHERE name = :name AND holder = :holder AND term = :term AND expires_at > {now};

-- name: prune_steps
DELETE FROM steps WHERE task_id IN (SELECT value FROM json_each(:ids));

-- name: prune_requests
DELETE FROM requests WHERE task_id IN (SELECT value FROM json_each(:ids));

-- name: prune_replies
DELETE FROM replies WHERE task_id IN (SELECT value FROM json_each(:ids));

-- name: prune_events
-- One row per event deleted (SQLite cannot group what RETURNING gives): the prune adds them, by
-- kind, to event_totals in the same transaction, so the metrics' totals never go down.
DELETE FROM events WHERE task_id IN (SELECT value FROM json_each(:ids)) RETURNING kind, 1 AS n;

-- name: prune_unread_messages
-- The messages about to be pruned that a named consumer of their reply queue has not read (past
-- its cursor, or not yet given a position): what a consumer lagging by more than the retention
-- loses, for the leader's warning.
SELECT c.queue, c.consumer, c.position, COUNT(*) AS n FROM messages m
JOIN reply_cursors c ON c.queue = m.queue
WHERE m.task_id IN (SELECT value FROM json_each(:ids)) AND (m.seq IS NULL OR m.seq > c.position)
GROUP BY c.queue, c.consumer, c.position ORDER BY c.queue, c.consumer;

-- name: prune_messages
DELETE FROM messages WHERE task_id IN (SELECT value FROM json_each(:ids));

-- name: prune_tasks
DELETE FROM tasks WHERE id IN (SELECT value FROM json_each(:ids));

-- name: prune_taskless_events
-- As the common query, through events_taskless: without statistics SQLite's planner takes
-- events_task and sorts every task-less event, young ones too, at each prune round.
DELETE FROM events WHERE id IN (
    SELECT id FROM events INDEXED BY events_taskless
    WHERE task_id IS NULL AND at < {now} - :retention ORDER BY at LIMIT :limit)
RETURNING kind, 1 AS n;

-- name: prune_alert_deliveries
DELETE FROM alert_deliveries WHERE alert_id IN (SELECT value FROM json_each(:ids));

-- name: prune_alerts
DELETE FROM alerts WHERE id IN (SELECT value FROM json_each(:ids));

-- name: steps_of_tasks
SELECT task_id, idx, name, agent, operation, compensate, budget, policy, on_error, state, attempt,
       failure_count, failure_offset, comp_failures, locked_by, complete_by, result, last_error,
       started_at, finished_at
FROM steps WHERE task_id IN (SELECT value FROM json_each(:ids)) ORDER BY task_id, idx;

-- name: prunable_tasks
-- As the common query, read through tasks_finished: without statistics (the store runs no
-- ANALYZE) SQLite's planner took tasks_state and sorted every finished task at each prune round,
-- under the write lock (0.25 s a round with a million finished tasks inside their retention).
SELECT id FROM tasks INDEXED BY tasks_finished
WHERE finished_at IS NOT NULL AND finished_at < {now} - :retention
  AND state IN ('processed', 'compensated', 'cancelled')
ORDER BY finished_at LIMIT :limit;
