-- PostgreSQL's own alert queries (alerts.sql), replacing the common ones of the same name.

-- name: alert_hold
-- As the common query, locked until the delivery commits: the prune (prunable_alerts, FOR UPDATE
-- SKIP LOCKED) passes this alert by, or, if it locked the alert first, this waits for it and then
-- finds the alert gone.
SELECT id FROM alerts WHERE id = :alert_id FOR KEY SHARE;

-- name: alerts_expired
-- As the common query, each alert held as alert_hold holds it, until its give-up is recorded.
SELECT a.id FROM alert_sinks s
JOIN alerts a ON a.created_at >= s.since
LEFT JOIN alert_deliveries d ON d.sink = s.name AND d.alert_id = a.id
WHERE s.name = :sink AND a.created_at < {now} - :max_age
  AND d.delivered_at IS NULL AND d.gave_up_at IS NULL
ORDER BY a.id LIMIT :limit
FOR KEY SHARE OF a;
