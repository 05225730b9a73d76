-- Named queries shared by every dialect (alerts.sql); a dialect's own file may override one by name.

-- name: alert_get
SELECT id, kind, task_id, step, message, created_at, acked_at, acked_by FROM alerts WHERE id = :id;

-- name: alert_ack
UPDATE alerts SET acked_at = {now}, acked_by = :by WHERE id = :id AND acked_at IS NULL;

-- name: alert_sink_register
INSERT INTO alert_sinks (name, since, created_at) VALUES (:name, {now}, {now})
ON CONFLICT (name) DO NOTHING;

-- name: alerts_due
-- The undelivered alerts of a sink whose retry time has come: raised since the sink was first
-- configured, and not older than the age limit.
SELECT a.id, a.kind, a.task_id, a.step, a.message, a.created_at, a.acked_at, a.acked_by,
       COALESCE(d.attempts, 0) AS attempts
FROM alert_sinks s
JOIN alerts a ON a.created_at >= s.since
LEFT JOIN alert_deliveries d ON d.sink = s.name AND d.alert_id = a.id
WHERE s.name = :sink AND a.created_at >= {now} - :max_age
  AND d.delivered_at IS NULL AND d.gave_up_at IS NULL
  AND (d.next_attempt_at IS NULL OR d.next_attempt_at <= {now})
ORDER BY a.id LIMIT :limit;

-- name: alert_delivered
-- The leader's records (alert_delivered, alert_failed, alert_expired) each follow lease_holds in the
-- same transaction (alerts.Fence, LEAD4): a deposed leader's record raises LostOwnership and writes
-- nothing, so it cannot give up an alert its successor would still deliver.
INSERT INTO alert_deliveries (sink, alert_id, attempts, delivered_at, delivered_by, updated_at)
VALUES (:sink, :alert_id, 1, {now}, :me, {now})
ON CONFLICT (sink, alert_id) DO UPDATE SET attempts = alert_deliveries.attempts + 1,
    next_attempt_at = NULL, delivered_at = excluded.delivered_at, delivered_by = excluded.delivered_by,
    updated_at = excluded.updated_at;

-- name: alert_failed
-- A give-up has no next attempt (it showed one after the give-up, which a script read as a retry
-- still coming).
INSERT INTO alert_deliveries (sink, alert_id, attempts, next_attempt_at, gave_up_at, last_error,
                              delivered_by, updated_at)
VALUES (:sink, :alert_id, 1, CASE WHEN :give_up THEN NULL ELSE {now} + :delay END,
        CASE WHEN :give_up THEN {now} END, :error, :me, {now})
ON CONFLICT (sink, alert_id) DO UPDATE SET attempts = alert_deliveries.attempts + 1,
    next_attempt_at = excluded.next_attempt_at, gave_up_at = excluded.gave_up_at,
    last_error = excluded.last_error, delivered_by = excluded.delivered_by,
    updated_at = excluded.updated_at;

-- name: alerts_expired
-- The alerts a sink has not delivered and no longer tries (older than the age limit), each to get
-- its give-up recorded: else `alerts` shows a retry time long past, as if one were still coming.
-- PostgreSQL holds them against the prune as alert_hold does (see its override).
SELECT a.id FROM alert_sinks s
JOIN alerts a ON a.created_at >= s.since
LEFT JOIN alert_deliveries d ON d.sink = s.name AND d.alert_id = a.id
WHERE s.name = :sink AND a.created_at < {now} - :max_age
  AND d.delivered_at IS NULL AND d.gave_up_at IS NULL
ORDER BY a.id LIMIT :limit;

-- name: alert_expired
-- The give-up of an alert past the age limit; the error of its last attempt, if any, is kept.
INSERT INTO alert_deliveries (sink, alert_id, attempts, gave_up_at, last_error, delivered_by, updated_at)
VALUES (:sink, :alert_id, 0, {now}, :error, :me, {now})
ON CONFLICT (sink, alert_id) DO UPDATE SET next_attempt_at = NULL, gave_up_at = excluded.gave_up_at,
    last_error = excluded.last_error || COALESCE('; last attempt: ' || alert_deliveries.last_error, ''),
    delivered_by = excluded.delivered_by, updated_at = excluded.updated_at;

-- name: alert_hold
-- The alert a delivery is about to record, if it still exists (the leader's prune may have deleted
-- it meanwhile: a delivery row must not outlive its alert). PostgreSQL also locks it against the
-- prune (see its override).
SELECT id FROM alerts WHERE id = :alert_id;
