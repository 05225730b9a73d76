-- stepwarden schema, version 5: the records that outlive their tasks are pruned too.

-- Events with no task (leases taken, breakers opened, instances gone unhealthy) are pruned by age:
-- read oldest first, touching only the rows past the retention.
CREATE INDEX events_taskless ON events (at) WHERE task_id IS NULL;

-- An alert's deliveries, found by the alert: pruned with it, and listed with it (`alerts`).
CREATE INDEX alert_deliveries_alert ON alert_deliveries (alert_id);
