-- stepwarden schema, version 2 (PostgreSQL): reply-queue cursors (SCH8) and alert delivery (OPS4).

-- A message's position in its queue, in commit order: given by the first reader after the message
-- committed (see replies.sql), so a consumer's cursor can never pass a message that commits later.
ALTER TABLE messages ADD COLUMN seq BIGINT;
CREATE UNIQUE INDEX messages_seq ON messages (queue, seq);
CREATE INDEX messages_unsequenced ON messages (queue, id) WHERE seq IS NULL;
CREATE INDEX messages_task ON messages (task_id, id);

-- One row per queue: the last position given, and the lock that serialises the sequencers.
CREATE TABLE reply_queues (
    queue    TEXT PRIMARY KEY,
    last_seq BIGINT NOT NULL
);

-- A named consumer's durable cursor: every message up to `position` is acknowledged.
CREATE TABLE reply_cursors (
    queue      TEXT NOT NULL,
    consumer   TEXT NOT NULL,
    position   BIGINT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    acked_at   DOUBLE PRECISION,
    PRIMARY KEY (queue, consumer)
);

-- The alert sinks workers have configured, and from when on they receive alerts.
CREATE TABLE alert_sinks (
    name       TEXT PRIMARY KEY,
    since      DOUBLE PRECISION NOT NULL,
    created_at DOUBLE PRECISION NOT NULL
);

-- The delivery outbox: what became of each alert at each sink.
CREATE TABLE alert_deliveries (
    sink            TEXT NOT NULL,
    alert_id        BIGINT NOT NULL,
    attempts        INTEGER NOT NULL,
    next_attempt_at DOUBLE PRECISION,
    delivered_at    DOUBLE PRECISION,
    gave_up_at      DOUBLE PRECISION,
    last_error      TEXT,
    delivered_by    TEXT,
    updated_at      DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (sink, alert_id)
);
CREATE INDEX alerts_created ON alerts (created_at);
