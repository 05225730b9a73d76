-- PostgreSQL's own alert queries (alerts.sql), replacing the common ones of the same name.

-- name: alert_hold
-- As the common query, locked until the delivery commits: the prune (prunable_alerts, FOR UPDATE
-- SKIP LOCKED) passes this alert by, or, if it locked the alert first, this waits for it and then
-- finds the alert gone.
SELECT id FROM alerts WHERE id = :alert_id FOR KEY SHARE;
