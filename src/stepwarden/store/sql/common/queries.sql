-- Named queries shared by every dialect (queries.sql); a dialect's own file may override one by name.

-- name: now
SELECT {now} AS now;

-- name: upsert_workflow
INSERT INTO workflows (name, version, definition, registered_by, updated_at)
VALUES (:name, :version, :definition, :by, {now})
ON CONFLICT (name) DO UPDATE SET version = excluded.version, definition = excluded.definition,
    registered_by = excluded.registered_by, updated_at = excluded.updated_at
WHERE excluded.version >= workflows.version;

-- name: get_workflow
SELECT name, version, definition, registered_by FROM workflows WHERE name = :name;

-- name: list_workflows
SELECT name, version, definition, registered_by, updated_at FROM workflows ORDER BY name;

-- name: task_by_key
SELECT id, workflow FROM tasks WHERE idempotency_key = :key;

-- name: insert_task
INSERT INTO tasks (workflow, workflow_version, state, input, correlation_id, idempotency_key,
                   reply_to, priority, run_at, created_at, updated_at)
VALUES (:workflow, :version, 'pending', :input, :correlation_id, :idempotency_key,
        :reply_to, :priority, {now}, {now}, {now})
ON CONFLICT (idempotency_key) DO NOTHING
RETURNING id;

-- name: insert_step
INSERT INTO steps (task_id, idx, name, agent, operation, compensate, budget, policy, on_error, state)
VALUES (:task_id, :idx, :name, :agent, :operation, :compensate, :budget, :policy, :on_error, 'pending');

-- name: steps_reached
-- The steps of a task a forward request of which an agent took (see undo.reached_steps).
SELECT DISTINCT step_idx FROM requests WHERE task_id = :task_id AND kind = 'do' AND taken_by IS NOT NULL;

-- name: steps_of_task
SELECT task_id, idx, name, agent, operation, compensate, budget, policy, on_error, state, attempt,
       failure_count, failure_offset, comp_failures, locked_by, complete_by, result, last_error,
       started_at, finished_at
FROM steps WHERE task_id = :task_id ORDER BY idx;

-- name: start_attempt
-- complete_by is the transaction's database time plus the step's budget, computed by the caller.
UPDATE steps SET state = :state, attempt = attempt + 1, locked_by = :me,
                 complete_by = :complete_by, started_at = COALESCE(started_at, :now)
WHERE task_id = :task_id AND idx = :idx AND attempt = :attempt;

-- name: insert_request
INSERT INTO requests (task_id, step_idx, attempt, kind, agent, operation, payload, policy, idempotency_key,
                      priority, complete_by, state, dispatched_by, dispatched_at)
VALUES (:task_id, :idx, :attempt, :kind, :agent, :operation, :payload, :policy, :key,
        :priority, :complete_by, 'queued', :me, {now});

-- name: task_in_flight
UPDATE tasks SET state = :state, locked_by = :me, complete_by = :complete_by, updated_at = {now}
WHERE id = :task_id;

-- name: finish_task
UPDATE tasks SET state = :state, locked_by = NULL, complete_by = NULL, last_error = :error,
                 updated_at = {now}, finished_at = {now}
WHERE id = :task_id;

-- name: release_task
UPDATE tasks SET state = :state, locked_by = NULL, complete_by = NULL, run_at = {now} + :delay,
                 waiting = CASE WHEN :delay > 0 THEN 1 ELSE 0 END,
                 failure_count = failure_count + :failed, last_error = COALESCE(:error, last_error),
                 updated_at = {now}
WHERE id = :task_id;

-- name: skip_unstarted
UPDATE steps SET state = 'skipped' WHERE task_id = :task_id AND started_at IS NULL AND state = 'pending';

-- name: give_up_started
UPDATE steps SET state = 'failed' WHERE task_id = :task_id AND started_at IS NOT NULL AND state = 'pending';

-- name: insert_reply
-- A deferred write (one executemany per batch on SQLite): no RETURNING, which Python 3.12's
-- sqlite3 refuses in executemany after the first row ("bad parameter or other API misuse").
INSERT INTO replies (request_id, task_id, step_idx, attempt, kind, outcome, result, error, sent_by,
                     received_at)
SELECT id, task_id, step_idx, attempt, kind, :outcome, :result, :error, :me, {now}
FROM requests WHERE id = :request_id;

-- name: insert_applied_reply
-- A reply applied in the transaction that received it (a worker's own): written once, settled,
-- received when the batch read it (the time checked against complete-by), applied now.
INSERT INTO replies (request_id, task_id, step_idx, attempt, kind, outcome, result, error, sent_by,
                     received_at, status, applied_by, applied_at)
VALUES (:request_id, :task_id, :idx, :attempt, :kind, :outcome, :result, :error, :me, :received_at,
        :status, :me, {now});

-- name: request_replied
UPDATE requests SET state = 'replied' WHERE id = :request_id AND state = 'taken';

-- name: mark_reply
UPDATE replies SET status = :status, applied_by = :me, applied_at = {now}
WHERE id = :id AND status = 'new';

-- name: delete_reply
-- A reply whose task is gone (pruned while the reply waited for it): nothing would read it, and
-- no later prune would find it by its task.
DELETE FROM replies WHERE id = :id;

-- name: finish_request
-- A reply applied in the transaction that records it (a worker's own): the request is also
-- marked replied here, one row version instead of two.
UPDATE requests SET outcome = :outcome, finished_at = {now},
                    state = CASE WHEN state = 'taken' THEN 'replied' ELSE state END
WHERE task_id = :task_id AND step_idx = :idx AND attempt = :attempt AND outcome IS NULL;

-- name: expire_request
UPDATE requests SET state = 'expired', outcome = 'expired', finished_at = {now}
WHERE task_id = :task_id AND step_idx = :idx AND attempt = :attempt AND outcome IS NULL;

-- name: complete_step
UPDATE steps SET state = :state, result = :result, locked_by = NULL, complete_by = NULL,
                 finished_at = {now}
WHERE task_id = :task_id AND idx = :idx AND attempt = :attempt AND state = :expect;

-- name: fail_step
UPDATE steps SET state = :state, locked_by = NULL, complete_by = NULL, last_error = :error,
                 failure_count = failure_count + :fwd, comp_failures = comp_failures + :comp,
                 finished_at = CASE WHEN :final THEN {now} ELSE finished_at END
WHERE task_id = :task_id AND idx = :idx AND attempt = :attempt AND state = :expect
RETURNING failure_count, failure_offset, comp_failures;

-- name: expired_steps
-- The attempts past complete-by with no reply waiting to be applied, the waiting reply looked for
-- by its attempt: one probe of replies_attempt per expired step. Its status is written
-- `(status || '') = 'new'` here and in still_expired, orphaned_steps and still_orphaned so that it
-- does NOT match the condition of the partial index replies_new: PostgreSQL chose to read every
-- new reply for each expired step (an anti-join whose inner side is all of replies_new, planned
-- while the store was empty or new replies were few), expired x unapplied replies: 0.5 s for 200
-- expired steps with 20,000 replies waiting, just when the schedulers have fallen behind. A
-- partial index of new replies by attempt does not help: believing new replies are few, the
-- planner reads replies_new anyway. SQLite probes replies_attempt either way.
SELECT s.task_id, s.idx, s.attempt, s.state, s.complete_by
FROM steps s
WHERE s.state IN ('running', 'compensating') AND s.complete_by IS NOT NULL AND s.complete_by < {now}
  AND NOT EXISTS (SELECT 1 FROM replies r
                  WHERE r.task_id = s.task_id AND r.step_idx = s.idx AND r.attempt = s.attempt
                    AND (r.status || '') = 'new')
ORDER BY s.complete_by LIMIT :limit;

-- name: request_of_attempt
SELECT state, agent, operation FROM requests WHERE task_id = :task_id AND step_idx = :idx AND attempt = :attempt;

-- name: agent_instance_live
SELECT 1 AS found FROM agent_instances
WHERE agent = :agent AND stopped_at IS NULL AND heartbeat_at >= {now} - :silent
LIMIT 1;

-- name: still_expired
SELECT 1 AS ok FROM steps s
WHERE s.task_id = :task_id AND s.idx = :idx AND s.attempt = :attempt
  AND s.state IN ('running', 'compensating') AND s.complete_by < {now}
  AND NOT EXISTS (SELECT 1 FROM replies r
                  WHERE r.task_id = s.task_id AND r.step_idx = s.idx AND r.attempt = s.attempt
                    AND (r.status || '') = 'new');

-- name: insert_event
INSERT INTO events (task_id, step_idx, attempt, kind, actor, detail, at)
VALUES (:task_id, :idx, :attempt, :kind, :actor, :detail, {now});

-- name: insert_message
INSERT INTO messages (queue, task_id, correlation_id, kind, body, created_at)
VALUES (:queue, :task_id, :correlation_id, :kind, :body, {now});

-- name: insert_alert
INSERT INTO alerts (kind, task_id, step, message, created_at)
VALUES (:kind, :task_id, :step, :message, {now})
RETURNING id;

-- name: lease_acquire
INSERT INTO leases (name, holder, term, expires_at, acquired_at, renewed_at)
VALUES (:name, :holder, 1, {now} + :ttl, {now}, {now})
ON CONFLICT (name) DO UPDATE SET holder = excluded.holder, term = leases.term + 1,
    expires_at = excluded.expires_at, acquired_at = excluded.acquired_at, renewed_at = excluded.renewed_at
WHERE leases.holder IS NULL OR leases.expires_at <= excluded.acquired_at
RETURNING term, expires_at;

-- name: lease_renew
UPDATE leases SET expires_at = {now} + :ttl, renewed_at = {now}
WHERE name = :name AND holder = :holder AND term = :term AND expires_at > {now}
RETURNING term, expires_at;

-- name: lease_resign
-- The holder's name stays as a record of who led last; the lease is free because it has expired.
UPDATE leases SET expires_at = {now}
WHERE name = :name AND holder = :holder AND term = :term;

-- name: term_begin
INSERT INTO lease_terms (name, term, holder, acquired_at) VALUES (:name, :term, :holder, {now});

-- name: term_end
UPDATE lease_terms SET ended_at = {now} WHERE name = :name AND term = :term AND ended_at IS NULL;

-- name: list_leases
SELECT name, holder, term, expires_at, acquired_at, renewed_at, expires_at > {now} AS active
FROM leases ORDER BY name;

-- name: list_terms
SELECT name, term, holder, acquired_at, ended_at FROM lease_terms ORDER BY name, term;

-- name: worker_upsert
INSERT INTO workers (id, roles, agents, started_at, heartbeat_at, host_key, pid, proc_start)
VALUES (:id, :roles, :agents, {now}, {now}, :host_key, :pid, :proc_start)
ON CONFLICT (id) DO UPDATE SET heartbeat_at = {now}, stopped_at = NULL;

-- name: worker_beat
-- A worker that was presumed dead and turns out alive clears its stop mark by beating again.
UPDATE workers SET heartbeat_at = {now}, breakers = :breakers, stopped_at = NULL WHERE id = :id;

-- name: owners_in_flight
-- The workers whose agents hold taken requests: the only ones whose death strands a step.
SELECT w.id, w.host_key, w.pid, w.proc_start, w.heartbeat_at, w.stopped_at, {now} AS now
FROM workers w WHERE w.id IN (SELECT taken_by FROM requests WHERE state = 'taken');

-- name: lease_holder
SELECT l.term, w.id, w.host_key, w.pid, w.proc_start, w.heartbeat_at, w.stopped_at, {now} AS now
FROM leases l JOIN workers w ON w.id = l.holder
WHERE l.name = :name AND l.expires_at > {now};

-- name: lease_take
-- Take a lease from a holder presumed dead before it expires: conditional on that holder and
-- term, so of several successors exactly one wins, and the old term's writes are fenced out.
UPDATE leases SET holder = :holder, term = term + 1, expires_at = {now} + :ttl, acquired_at = {now},
                  renewed_at = {now}
WHERE name = :name AND holder = :dead AND term = :term
RETURNING term, expires_at;

-- name: worker_still_silent
-- Checked again in the rescue's own transaction: a worker judged dead by its heartbeat's age may
-- have beaten since (its transactions waited on the same lock as the supervisor's).
SELECT 1 AS found FROM workers
WHERE id = :worker AND (stopped_at IS NOT NULL OR heartbeat_at < {now} - :silent_for);

-- name: orphaned_steps
-- In-flight attempts whose request a (presumed) dead worker had taken and not answered.
SELECT s.task_id, s.idx, s.attempt, s.state, s.complete_by
FROM requests r JOIN steps s ON s.task_id = r.task_id AND s.idx = r.step_idx AND s.attempt = r.attempt
WHERE r.state = 'taken' AND r.taken_by = :worker AND s.state IN ('running', 'compensating')
  AND NOT EXISTS (SELECT 1 FROM replies p
                  WHERE p.task_id = s.task_id AND p.step_idx = s.idx AND p.attempt = s.attempt
                    AND (p.status || '') = 'new')
ORDER BY s.task_id, s.idx LIMIT :limit;

-- name: requests_taken_by
-- What a worker holds in the store, for its agent to compare with what it runs (requests_taken
-- index). Past complete-by an attempt is the supervisor's, whoever holds it.
SELECT id FROM requests WHERE state = 'taken' AND taken_by = :me AND complete_by > {now} ORDER BY id;

-- name: still_orphaned
SELECT 1 AS ok
FROM requests r JOIN steps s ON s.task_id = r.task_id AND s.idx = r.step_idx AND s.attempt = r.attempt
WHERE s.task_id = :task_id AND s.idx = :idx AND s.attempt = :attempt
  AND r.state = 'taken' AND r.taken_by = :worker AND s.state IN ('running', 'compensating')
  AND NOT EXISTS (SELECT 1 FROM replies p
                  WHERE p.task_id = s.task_id AND p.step_idx = s.idx AND p.attempt = s.attempt
                    AND (p.status || '') = 'new');

-- name: worker_stop
UPDATE workers SET stopped_at = {now} WHERE id = :id;

-- name: prunable_tasks
-- Finished tasks past their retention, oldest first. `error` tasks are kept: they wait for an
-- operator. PostgreSQL locks them (see its override) so a concurrent retry wins or waits.
SELECT id FROM tasks
WHERE finished_at IS NOT NULL AND finished_at < {now} - :retention
  AND state IN ('processed', 'compensated', 'cancelled')
ORDER BY finished_at LIMIT :limit;

-- name: prune_workers
-- Workers silent past the retention; one still holding taken steps stays until they are rescued.
DELETE FROM workers WHERE id IN (
    SELECT id FROM workers
    WHERE heartbeat_at < {now} - :retention
      AND id NOT IN (SELECT taken_by FROM requests WHERE state = 'taken' AND taken_by IS NOT NULL)
    LIMIT :limit);

-- name: prune_agent_instances
-- The agent instances of pruned workers: their health and counts describe no process any more.
DELETE FROM agent_instances WHERE worker IN (
    SELECT worker FROM agent_instances
    WHERE heartbeat_at < {now} - :retention AND worker NOT IN (SELECT id FROM workers)
    LIMIT :limit);

-- name: add_event_totals
-- The events a prune deleted (prune_events, prune_taskless_events: each dialect's counts what it
-- deletes), by kind, in the same transaction: the metrics' totals are event_totals plus the
-- events stored, so a prune never lowers them (metrics/tally.py).
INSERT INTO event_totals (kind, pruned) VALUES (:kind, :n)
ON CONFLICT (kind) DO UPDATE SET pruned = event_totals.pruned + excluded.pruned;

-- name: prune_lease_terms
-- Terms that ended past the retention; the term in force (no end yet) is always kept.
DELETE FROM lease_terms WHERE (name, term) IN (
    SELECT name, term FROM lease_terms WHERE ended_at < {now} - :retention LIMIT :limit);

-- name: prunable_alerts
-- Alerts past the retention that need no one any more: acknowledged, or their task is gone
-- (pruned when it finished). An unacknowledged alert of a task that still exists (an error
-- waiting for an operator) is kept, however old, and so is an unacknowledged alert of no task
-- (a breaker that opened): "its task is gone" held for it vacuously, and it was pruned unread.
-- PostgreSQL locks them (see its override).
SELECT id FROM alerts a
WHERE created_at < {now} - :retention
  AND (acked_at IS NOT NULL
       OR (a.task_id IS NOT NULL AND NOT EXISTS (SELECT 1 FROM tasks t WHERE t.id = a.task_id)))
ORDER BY created_at LIMIT :limit;

-- name: fleet_roles
-- Whether a live worker runs the scheduler role, and the supervisor role (the worker's fleet
-- check: a fleet started without one waited in silence). The LIKE patterns are parameters: a
-- percent sign in the text of a query is a placeholder's to psycopg.
SELECT
  EXISTS (SELECT 1 FROM workers WHERE stopped_at IS NULL AND heartbeat_at >= {now} - :silent
          AND (',' || roles || ',') LIKE :scheduler) AS scheduler,
  EXISTS (SELECT 1 FROM workers WHERE stopped_at IS NULL AND heartbeat_at >= {now} - :silent
          AND (',' || roles || ',') LIKE :supervisor) AS supervisor;

-- name: fleet_unclaimed
-- A task ready more than :late seconds ago that no scheduler has claimed: a ready one, or one
-- whose back-off ended (only a scheduler clears its waiting mark), each read by its own index.
SELECT (EXISTS (SELECT 1 FROM tasks WHERE locked_by IS NULL AND state IN ('pending', 'compensating')
                AND waiting = 0 AND run_at < {now} - :late)
     OR EXISTS (SELECT 1 FROM tasks WHERE locked_by IS NULL AND state IN ('pending', 'compensating')
                AND waiting = 1 AND run_at < {now} - :late)) AS found;

-- name: fleet_overdue
-- An attempt more than :late seconds past its complete-by, which only a supervisor rescues.
SELECT EXISTS (SELECT 1 FROM steps WHERE state IN ('running', 'compensating')
               AND complete_by IS NOT NULL AND complete_by < {now} - :late) AS found;
