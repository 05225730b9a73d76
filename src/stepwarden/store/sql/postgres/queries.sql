-- Named queries for the PostgreSQL store (READ COMMITTED). `{now}` is the database clock; parameters are :named.
-- Every transition is conditional: a statement that changes no row means "you lost it".

-- name: claim_tasks
-- MATERIALIZED keeps the planner from re-running the locking subquery per row; SKIP LOCKED lets
-- concurrent schedulers take disjoint batches without waiting on each other.
-- The best :limit of the ready tasks and of the waiting ones now due, each read from its own index
-- (the waiting ones by when they are due: those not due yet are not read), in one priority order;
-- a row one of them locked and the order left out stays unclaimed until this transaction ends.
-- A ready task (waiting = 0) is claimable whatever the clock says: its run_at was the time it
-- became ready, and a step of the database's clock back (NTP, a resumed virtual machine) left it
-- in the future, and every task ready before the step unclaimed for as long as the step.
WITH ready AS MATERIALIZED (
    SELECT id, priority FROM tasks
    WHERE locked_by IS NULL AND state IN ('pending', 'compensating') AND waiting = 0
    ORDER BY priority DESC, id LIMIT :limit
    FOR UPDATE SKIP LOCKED),
due AS MATERIALIZED (
    SELECT id, priority FROM tasks
    WHERE locked_by IS NULL AND state IN ('pending', 'compensating') AND waiting = 1
      AND run_at <= {now}
    ORDER BY priority DESC, id LIMIT :limit
    FOR UPDATE SKIP LOCKED),
c AS (SELECT id FROM (SELECT * FROM ready UNION ALL SELECT * FROM due) u
      ORDER BY priority DESC, id LIMIT :limit)
UPDATE tasks t SET locked_by = :me,
                   state = CASE WHEN t.state = 'pending' THEN 'processing' ELSE t.state END,
                   waiting = 0, updated_at = {now}
FROM c WHERE t.id = c.id
RETURNING t.id, t.state, t.input, t.priority, t.correlation_id, t.reply_to, t.cancel_requested, t.workflow,
          {now} AS now;

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

-- name: agent_request_waiting
-- A queued request of the agent, of the operations :ops, that has waited :waited seconds or more:
-- an unhealthy instance's probe may take a breaker's trial left untaken (see agents.pull).
SELECT 1 AS found FROM requests
WHERE state = 'queued' AND agent = :agent AND complete_by > {now} AND dispatched_at <= {now} - :waited
  AND operation IN (SELECT jsonb_array_elements_text(:ops::jsonb))
LIMIT 1;

-- name: claim_agent_requests
-- Queued requests of one agent, in claim order, for an agent instance's pull or the take of its
-- reservation in a reply batch or a scheduler round: only the operations it has (`:ops`, a JSON
-- array), so that a worker of another version (a rolling deploy) leaves the others' requests
-- queued.
WITH c AS MATERIALIZED (
    SELECT id FROM requests
    WHERE state = 'queued' AND agent = :agent AND complete_by > {now}
      AND operation IN (SELECT jsonb_array_elements_text(:ops::jsonb))
    ORDER BY priority DESC, id LIMIT :limit
    FOR UPDATE SKIP LOCKED)
UPDATE requests SET state = 'taken', taken_by = :me, taken_at = {now}
FROM c WHERE requests.id = c.id
RETURNING requests.id, task_id, step_idx, attempt, kind, agent, operation, payload, policy,
          idempotency_key, complete_by, complete_by - {now} AS remaining;

-- name: new_replies_with_tasks
-- The batch's new replies (SKIP LOCKED: another scheduler's batch is left to it) and the
-- transaction's own (`:own`, JSON: not in the table, id NULL, `n` their order), each with its
-- task, the tasks locked in id order (no deadlocks). One statement, so that the steps
-- (steps_of_new_replies) come in the same round trip, read after the locks are held. It leaves
-- the ids of the tasks it locked in a transaction-local setting for that statement; the
-- setting's CTE is a one-time filter, evaluated (with the locks) before any row is returned.
WITH r AS MATERIALIZED (
    SELECT id, request_id, task_id, step_idx, attempt, kind, outcome, result, error, received_at, sent_by,
           NULL::bigint AS n
    FROM replies WHERE status = 'new' ORDER BY id LIMIT :limit FOR UPDATE SKIP LOCKED),
o AS MATERIALIZED (
    SELECT NULL::bigint AS id, q.id AS request_id, q.task_id, q.step_idx, q.attempt, q.kind, v.outcome,
           v.result, v.error, {now} AS received_at, :me::text AS sent_by, v.n
    FROM ROWS FROM (jsonb_to_recordset(:own::jsonb) AS (request_id bigint, outcome text, result text,
                                                         error text))
         WITH ORDINALITY AS v(request_id, outcome, result, error, n)
    JOIN requests q ON q.id = v.request_id
    WHERE q.id = ANY (ARRAY(SELECT (e->>'request_id')::bigint FROM jsonb_array_elements(:own::jsonb) e))),
a AS (SELECT * FROM r UNION ALL SELECT * FROM o),
t AS MATERIALIZED (
    SELECT id, state, input, priority, correlation_id, reply_to, cancel_requested, locked_by, workflow
    FROM tasks WHERE id IN (SELECT task_id FROM a) ORDER BY id FOR UPDATE),
b AS MATERIALIZED (
    SELECT set_config('stepwarden.batch', COALESCE(json_agg(id)::text, '[]'), true) AS ids FROM t)
SELECT a.id, a.request_id, a.task_id, a.step_idx, a.attempt, a.kind, a.outcome, a.result, a.error,
       a.received_at, a.sent_by, a.n, {now} AS now,
       t.id AS t_id, t.state AS t_state, t.input AS t_input, t.priority AS t_priority,
       t.correlation_id AS t_correlation_id, t.reply_to AS t_reply_to,
       t.cancel_requested AS t_cancel_requested, t.locked_by AS t_locked_by, t.workflow AS t_workflow
FROM a LEFT JOIN t ON t.id = a.task_id
WHERE (SELECT ids FROM b) IS NOT NULL;

-- name: steps_of_new_replies
-- Sent with new_replies_with_tasks, after it: the steps of exactly the tasks it locked (their
-- ids from its transaction-local setting; none if it found no reply).
SELECT task_id, idx, name, agent, operation, compensate, budget, policy, on_error, state, attempt,
       failure_count, failure_offset, comp_failures, locked_by, complete_by, result, last_error,
       started_at, finished_at
FROM steps WHERE task_id = ANY (ARRAY(SELECT value::bigint FROM jsonb_array_elements_text(
    COALESCE(NULLIF(current_setting('stepwarden.batch', true), ''), '[]')::jsonb)))
ORDER BY task_id, idx;

-- name: notify_requests_left
-- The new-requests hint of a transaction that also took requests for its worker's own slots:
-- sent after that take, and only if requests it could not take are still waiting (not expired).
SELECT pg_notify(:channel, '') WHERE EXISTS (
    SELECT 1 FROM requests
    WHERE state = 'queued' AND agent = ANY (:agents::text[]) AND complete_by > {now});

-- name: lease_holds
-- FOR SHARE: a successor's acquire (an UPDATE of this row) waits until this fenced transaction
-- has committed, so two terms never write at the same time. The holder's own renewal (an UPDATE
-- too) waits as well: a fenced transaction must never wait long on anything (see
-- leader_lock_timeout, request_for_sweep).
SELECT 1 AS ok FROM leases
WHERE name = :name AND holder = :holder AND term = :term AND expires_at > {now} FOR SHARE;

-- name: leader_lock_timeout
-- Sent (pipelined, no round trip of its own) before lease_holds by every transaction of a
-- leader's own work (supervision.leader_fence): its FOR SHARE on the lease row holds up the
-- holder's renewal, and the heartbeat queued behind it on the lease lane, for as long as the
-- transaction runs. Its statements take rows with SKIP LOCKED instead of waiting for them; this
-- is the net under any wait that is missed: 1 s, where the session's own limit is 10 s, well
-- inside the 3 s a renewal has before the trust window ends with the default lease settings
-- (ttl - margin - renew_every) and the 3 s after which a silent worker is presumed dead. A wait
-- that runs out fails the transaction (nothing written): the next round tries again.
SELECT set_config('lock_timeout', '1s', true);

-- name: request_for_sweep
-- The request of an expired attempt, locked before the supervisor re-checks the attempt, or
-- skipped: `held` when another transaction holds it. That is most likely the agent's reply
-- being recorded right now (request_replied); waiting for it would hold the fenced FOR SHARE on
-- the lease, and with it the leader's own renewal, for as long as that transaction takes, and
-- then expire an attempt whose reply came in time, since the re-check ran before the wait. The
-- attempt is left to the next sweep, which sees the reply if it committed.
WITH mine AS MATERIALIZED (
    SELECT id FROM requests WHERE task_id = :task_id AND step_idx = :idx AND attempt = :attempt
    FOR UPDATE SKIP LOCKED)
SELECT EXISTS (SELECT 1 FROM requests WHERE task_id = :task_id AND step_idx = :idx AND attempt = :attempt
                                        AND id <> ALL (ARRAY(SELECT id FROM mine))) AS held;

-- name: prune_steps
DELETE FROM steps WHERE task_id = ANY (ARRAY(SELECT value::bigint FROM jsonb_array_elements_text(:ids::jsonb)));

-- name: prune_requests
DELETE FROM requests WHERE task_id = ANY (ARRAY(SELECT value::bigint FROM jsonb_array_elements_text(:ids::jsonb)));

-- name: prune_replies
-- SKIP LOCKED: the prune holds its tasks, and a reply batch locks a reply before its task, so
-- waiting here for a reply could be a deadlock. A reply committed since prune_held_tasks and
-- already locked by a batch is left: that batch finds the task gone and deletes the reply.
DELETE FROM replies WHERE id = ANY (ARRAY(
    SELECT id FROM replies
    WHERE task_id = ANY (ARRAY(SELECT value::bigint FROM jsonb_array_elements_text(:ids::jsonb)))
    FOR UPDATE SKIP LOCKED));

-- name: prune_held_tasks
-- The tasks among :ids (locked by this prune) with a reply, a request or a message that another
-- transaction holds: a reply batch that locked a late reply and now waits for its task (waiting
-- for the reply would be a deadlock), a reply-queue reader numbering the task's messages
-- (reply_sequence), an agent's late write to its request. The prune leaves them for a later
-- round instead of waiting: it is fenced, and its FOR SHARE on the lease would hold up the
-- leader's own renewal for as long as it waited. The rows of the other tasks stay locked by it
-- until it deletes them.
WITH mine_r AS MATERIALIZED (
    SELECT id FROM replies
    WHERE task_id = ANY (ARRAY(SELECT value::bigint FROM jsonb_array_elements_text(:ids::jsonb)))
    FOR UPDATE SKIP LOCKED),
mine_q AS MATERIALIZED (
    SELECT id FROM requests
    WHERE task_id = ANY (ARRAY(SELECT value::bigint FROM jsonb_array_elements_text(:ids::jsonb)))
    FOR UPDATE SKIP LOCKED),
mine_m AS MATERIALIZED (
    SELECT id FROM messages
    WHERE task_id = ANY (ARRAY(SELECT value::bigint FROM jsonb_array_elements_text(:ids::jsonb)))
    FOR UPDATE SKIP LOCKED)
SELECT task_id FROM replies
WHERE task_id = ANY (ARRAY(SELECT value::bigint FROM jsonb_array_elements_text(:ids::jsonb)))
  AND id <> ALL (ARRAY(SELECT id FROM mine_r))
UNION
SELECT task_id FROM requests
WHERE task_id = ANY (ARRAY(SELECT value::bigint FROM jsonb_array_elements_text(:ids::jsonb)))
  AND id <> ALL (ARRAY(SELECT id FROM mine_q))
UNION
SELECT task_id FROM messages
WHERE task_id = ANY (ARRAY(SELECT value::bigint FROM jsonb_array_elements_text(:ids::jsonb)))
  AND id <> ALL (ARRAY(SELECT id FROM mine_m));

-- name: prune_events
-- Counted by kind in the same statement (exactly the rows deleted): the prune adds them to
-- event_totals in the same transaction, so the metrics' totals never go down.
WITH gone AS (
    DELETE FROM events
    WHERE task_id = ANY (ARRAY(SELECT value::bigint FROM jsonb_array_elements_text(:ids::jsonb)))
    RETURNING kind)
SELECT kind, COUNT(*) AS n FROM gone GROUP BY kind;

-- name: prune_taskless_events
-- Events with no task (leases, breakers, instances) by age, counted by kind as prune_events.
WITH gone AS (
    DELETE FROM events WHERE id IN (
        SELECT id FROM events WHERE task_id IS NULL AND at < {now} - :retention ORDER BY at LIMIT :limit)
    RETURNING kind)
SELECT kind, COUNT(*) AS n FROM gone GROUP BY kind;

-- name: prune_unread_messages
-- The messages about to be pruned that a named consumer of their reply queue has not read (past
-- its cursor, or not yet given a position): what a consumer lagging by more than the retention
-- loses, for the leader's warning.
SELECT c.queue, c.consumer, c.position, COUNT(*) AS n FROM messages m
JOIN reply_cursors c ON c.queue = m.queue
WHERE m.task_id = ANY (ARRAY(SELECT value::bigint FROM jsonb_array_elements_text(:ids::jsonb)))
  AND (m.seq IS NULL OR m.seq > c.position)
GROUP BY c.queue, c.consumer, c.position ORDER BY c.queue, c.consumer;

-- name: prune_messages
DELETE FROM messages WHERE task_id = ANY (ARRAY(SELECT value::bigint FROM jsonb_array_elements_text(:ids::jsonb)));

-- name: prune_tasks
DELETE FROM tasks WHERE id = ANY (ARRAY(SELECT value::bigint FROM jsonb_array_elements_text(:ids::jsonb)));

-- name: prune_alert_deliveries
DELETE FROM alert_deliveries WHERE alert_id = ANY (ARRAY(SELECT value::bigint FROM jsonb_array_elements_text(:ids::jsonb)));

-- name: prune_alerts
DELETE FROM alerts WHERE id = ANY (ARRAY(SELECT value::bigint FROM jsonb_array_elements_text(:ids::jsonb)));

-- name: prunable_alerts
-- As the common query, locked: an alert a sink's delivery holds (FOR KEY SHARE, alert_hold) is
-- skipped this round, and a delivery that comes after waits and then finds the alert gone.
SELECT id FROM alerts a
WHERE created_at < {now} - :retention
  AND (acked_at IS NOT NULL
       OR (a.task_id IS NOT NULL AND NOT EXISTS (SELECT 1 FROM tasks t WHERE t.id = a.task_id)))
ORDER BY created_at LIMIT :limit
FOR UPDATE SKIP LOCKED;

-- name: prunable_tasks
-- FOR UPDATE re-checks each row as committed: a task an operator retried meanwhile no longer
-- matches and is skipped, so its rows are never deleted under it.
SELECT id FROM tasks
WHERE finished_at IS NOT NULL AND finished_at < {now} - :retention
  AND state IN ('processed', 'compensated', 'cancelled')
ORDER BY finished_at LIMIT :limit
FOR UPDATE SKIP LOCKED;

-- name: steps_of_tasks
-- Every list of ids is written `= ANY (ARRAY(...))`: for `IN (SELECT ... jsonb_array_elements)`
-- the planner guesses 100 ids and hash-joins over a scan of the whole table.
SELECT task_id, idx, name, agent, operation, compensate, budget, policy, on_error, state, attempt,
       failure_count, failure_offset, comp_failures, locked_by, complete_by, result, last_error,
       started_at, finished_at
FROM steps WHERE task_id = ANY (ARRAY(SELECT value::bigint FROM jsonb_array_elements_text(:ids::jsonb))) ORDER BY task_id, idx;

-- name: submit_task
-- A whole submission in one statement (SUB1): the task, its steps, its `received` event and
-- status message, and the wake-up hint. A repeated idempotency key inserts nothing and returns
-- no row (SUB3); the caller then reads the existing task. The message's body is the text every
-- other message gets (Python's JSON encoder, as on SQLite) around the task's new id: the caller
-- encodes the rest (:received_tail), so a consumer reading the rows sees one format.
-- The hint is skipped when another submission, due at once, made in the last second and not
-- touched since (claimed, released, retried), is still waiting among the first 8 in claim order
-- (one short index read): its hint woke the schedulers (or, skipped, the one before it did),
-- and a scheduler that claims anything runs another round after its gather window
-- (SchedulerSettings, 5 ms), which sees this one. A task made claimable otherwise (an operator's
-- retry, a retry whose back-off ran out) is no such sign. Under load this spares the schedulers
-- a wake-up, and the server a NOTIFY, per submission. Never inside a caller's transaction
-- (:may_skip false): what is waiting now may be claimed long before that commits.
-- The read is tasks_claimable's predicate exactly (`waiting = 0` with it): without it the
-- planner could not use the partial index and sorted every pending task, in every submission.
WITH t AS (
    INSERT INTO tasks (workflow, workflow_version, state, input, correlation_id, idempotency_key,
                       reply_to, priority, run_at, created_at, updated_at)
    VALUES (:workflow, :version, 'pending', :input, :correlation_id, :idempotency_key,
            :reply_to, :priority, {now}, {now}, {now})
    ON CONFLICT (idempotency_key) DO NOTHING
    RETURNING id),
s AS (
    INSERT INTO steps (task_id, idx, name, agent, operation, compensate, budget, policy, on_error, state)
    SELECT t.id, x.idx, x.name, x.agent, x.operation, x.compensate, x.budget, x.policy, x.on_error,
           'pending'
    FROM t, jsonb_to_recordset(:steps::jsonb) AS x(idx int, name text, agent text, operation text,
                                                   compensate text, budget float8, policy text,
                                                   on_error text)),
e AS (
    INSERT INTO events (task_id, kind, detail, at) SELECT t.id, 'received', :detail, {now} FROM t),
m AS (
    INSERT INTO messages (queue, task_id, correlation_id, kind, body, created_at)
    SELECT :reply_to::text, t.id, :correlation_id::text, 'received',
           '{"task_id": ' || t.id || :received_tail::text, {now}
    FROM t WHERE :reply_to::text IS NOT NULL)
-- `hint` is evaluated for the NOTIFY it may send; its value means nothing.
SELECT id, (SELECT pg_notify('stepwarden_tasks', '') WHERE NOT (:may_skip::boolean AND EXISTS (
    SELECT 1 FROM (SELECT state, created_at, updated_at, run_at FROM tasks
                   WHERE locked_by IS NULL AND state IN ('pending', 'compensating') AND waiting = 0
                   ORDER BY priority DESC, id LIMIT 8) AS waiting
    WHERE state = 'pending' AND created_at = updated_at AND run_at = created_at
      AND created_at > {now} - 1.0))) AS hint
FROM t;

-- name: prune_workers
-- As the common query, with the rows taken SKIP LOCKED: the prune is fenced, and a worker that
-- comes back after the retention (its heartbeat holding its row) must not hold up the leader.
DELETE FROM workers WHERE id IN (
    SELECT id FROM workers
    WHERE heartbeat_at < {now} - :retention
      AND id NOT IN (SELECT taken_by FROM requests WHERE state = 'taken' AND taken_by IS NOT NULL)
    LIMIT :limit
    FOR UPDATE SKIP LOCKED);

-- name: prune_agent_instances
-- As the common query, row by row and SKIP LOCKED, as prune_workers.
DELETE FROM agent_instances WHERE (worker, agent) IN (
    SELECT worker, agent FROM agent_instances
    WHERE heartbeat_at < {now} - :retention AND worker NOT IN (SELECT id FROM workers)
    LIMIT :limit
    FOR UPDATE SKIP LOCKED);

-- name: fence_idle_limit
-- For the rest of an application's fenced block (tx.fence): its session may sit idle in the
-- transaction only for what is left of the term's trust (:ms), or less if it was set lower. The
-- fence share-locks the lease row until the block ends, and a successor's acquire waits for it:
-- a leader paused inside the block (SIGSTOP, a partition) kept every successor out for the
-- callers' 60 s limit, not the lease's TTL.
SELECT set_config('idle_in_transaction_session_timeout',
                  LEAST(CASE WHEN setting::bigint > 0 THEN setting::bigint ELSE :ms END, :ms)::text,
                  true) AS limit_ms
FROM pg_settings WHERE name = 'idle_in_transaction_session_timeout';
