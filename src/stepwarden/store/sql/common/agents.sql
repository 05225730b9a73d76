-- Agent instances and their shared circuit breakers (AGT3, AGT6); see store/agents.py.
-- Every breaker transition is one conditional UPDATE: the instance whose statement changed the
-- row made the transition (and raises its alert); the others changed nothing.

-- name: agent_breaker_ensure
INSERT INTO agent_breakers (agent, state, failures, threshold, cool_off, opens, changed_at)
VALUES (:agent, 'closed', 0, :threshold, :cool_off, 0, {now})
ON CONFLICT (agent) DO UPDATE SET threshold = excluded.threshold, cool_off = excluded.cool_off;

-- name: agent_instance_upsert
INSERT INTO agent_instances (worker, agent, capacity, inflight, healthy, failures, successes_total,
                             failures_total, started_at, heartbeat_at)
VALUES (:worker, :agent, :capacity, 0, 1, 0, 0, 0, {now}, {now})
ON CONFLICT (worker, agent) DO UPDATE SET capacity = excluded.capacity, heartbeat_at = {now},
    stopped_at = NULL;

-- name: agent_instance_beat
UPDATE agent_instances SET heartbeat_at = {now}, inflight = :inflight, capacity = :capacity
WHERE worker = :worker AND agent = :agent;

-- name: agent_instances_stop
UPDATE agent_instances SET stopped_at = {now}, inflight = 0 WHERE worker = :worker AND stopped_at IS NULL;

-- name: agent_breakers_all
SELECT agent, state, failures, threshold, cool_off, opened_at, opened_by, retry_at, trial_by, reason,
       opens, changed_at, retry_at - {now} AS retry_in, {now} - opened_at - cool_off AS due_for
FROM agent_breakers ORDER BY agent;

-- name: agent_breaker_trial
-- After the cool-off, one instance claims the half-open trial. A trial whose holder never reported
-- (it died) can be claimed again once its own retry_at passes.
UPDATE agent_breakers SET state = 'half_open', trial_by = :me, trial_at = {now},
    retry_at = {now} + :trial_ttl, changed_at = {now}
WHERE agent = :agent AND state IN ('open', 'half_open') AND retry_at <= {now};

-- name: agent_breaker_trial_renew
-- The trial's holder, its call still running, keeps its claim for another trial_ttl.
UPDATE agent_breakers SET retry_at = {now} + :trial_ttl
WHERE agent = :agent AND state = 'half_open' AND trial_by = :me;

-- name: agent_healthy_others
-- A live, healthy instance of the agent other than :me: it may run the trial (see agents.pull).
SELECT 1 AS found FROM agent_instances
WHERE agent = :agent AND worker <> :me AND stopped_at IS NULL AND healthy = 1
  AND heartbeat_at >= {now} - :stale
LIMIT 1;

-- name: agent_breaker_untrial
-- The trial holder found no request to try: the trial is open to anyone again at once.
UPDATE agent_breakers SET state = 'open', trial_by = NULL, retry_at = {now}, changed_at = {now}
WHERE agent = :agent AND state = 'half_open' AND trial_by = :me;

-- name: agent_breaker_fail
-- Count a failure; the failure that reaches the threshold opens the breaker (closed -> open).
UPDATE agent_breakers SET
    failures = failures + 1,
    state = CASE WHEN failures + 1 >= :threshold AND :spread = 1 THEN 'open' ELSE state END,
    opened_at = CASE WHEN failures + 1 >= :threshold AND :spread = 1 THEN {now} ELSE opened_at END,
    opened_by = CASE WHEN failures + 1 >= :threshold AND :spread = 1 THEN :me ELSE opened_by END,
    retry_at = CASE WHEN failures + 1 >= :threshold AND :spread = 1 THEN {now} + :cool_off ELSE retry_at END,
    reason = CASE WHEN failures + 1 >= :threshold AND :spread = 1 THEN :reason ELSE reason END,
    opens = opens + CASE WHEN failures + 1 >= :threshold AND :spread = 1 THEN 1 ELSE 0 END,
    changed_at = CASE WHEN failures + 1 >= :threshold AND :spread = 1 THEN {now} ELSE changed_at END
WHERE agent = :agent AND state = 'closed'
RETURNING state;

-- name: agent_breaker_reset
UPDATE agent_breakers SET failures = 0 WHERE agent = :agent AND state = 'closed' AND failures > 0;

-- name: agent_breaker_close
-- The trial call succeeded: the service is back, for every instance (half_open -> closed).
UPDATE agent_breakers SET state = 'closed', failures = 0, trial_by = NULL, retry_at = NULL,
    changed_at = {now}
WHERE agent = :agent AND state = 'half_open' AND trial_by = :me;

-- name: agent_breaker_reopen
-- The trial call failed: another cool-off (half_open -> open).
UPDATE agent_breakers SET state = 'open', trial_by = NULL, opened_at = {now}, retry_at = {now} + :cool_off,
    reason = :reason, changed_at = {now}
WHERE agent = :agent AND state = 'half_open' AND trial_by = :me;

-- name: agent_instance_ok
UPDATE agent_instances SET successes_total = successes_total + :n, failures = 0, failing_since = NULL,
    last_success_at = {now} - :ago, heartbeat_at = {now}
WHERE worker = :me AND agent = :agent;

-- name: agent_instance_recovered
UPDATE agent_instances SET healthy = 1, probe_at = NULL, unhealthy_since = NULL
WHERE worker = :me AND agent = :agent AND healthy = 0;

-- name: agent_instance_fail
UPDATE agent_instances SET failures = failures + 1, failures_total = failures_total + 1,
    failing_since = COALESCE(failing_since, {now} - :ago), last_failure_at = {now} - :ago,
    last_error = :error, heartbeat_at = {now}
WHERE worker = :me AND agent = :agent
RETURNING failures, failing_since, healthy;

-- name: agent_others_ok
-- Has another live, healthy instance of the agent succeeded since this one began failing, and not
-- failed since? Then the service is up and the fault is on this instance's own path.
SELECT COUNT(*) AS n FROM agent_instances
WHERE agent = :agent AND worker <> :me AND stopped_at IS NULL AND healthy = 1 AND failures = 0
  AND heartbeat_at >= {now} - :stale AND last_success_at >= :since;

-- name: agent_failing_spread
-- How many live instances the agent has, and how many of them are failing now: one instance alone
-- cannot open the breaker for all while others could speak for the service. An instance speaks
-- only if it has called the service lately (within :stale): one that makes no calls (idle, or
-- a version without the operation) would otherwise keep the breaker closed for good while this
-- one's calls fail.
SELECT COUNT(*) AS live, COALESCE(SUM(CASE WHEN failures > 0 THEN 1 ELSE 0 END), 0) AS failing
FROM agent_instances
WHERE agent = :agent AND stopped_at IS NULL AND heartbeat_at >= {now} - :stale
  AND (worker = :me OR (healthy = 1 AND (last_success_at >= {now} - :stale
                                         OR last_failure_at >= {now} - :stale)));

-- name: agent_instance_unhealthy
UPDATE agent_instances SET healthy = 0, unhealthy_since = COALESCE(unhealthy_since, {now}),
    probe_at = {now} + :cool_off
WHERE worker = :me AND agent = :agent;

-- name: agent_instances_all
SELECT worker, agent, capacity, inflight, healthy, failures, successes_total, failures_total,
       last_success_at, last_failure_at, last_error, unhealthy_since, probe_at, started_at,
       heartbeat_at, stopped_at, {now} AS now
FROM agent_instances ORDER BY agent, started_at, worker;
