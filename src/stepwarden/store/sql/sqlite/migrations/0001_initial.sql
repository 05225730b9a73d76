-- stepwarden schema, version 1 (SQLite). Times are seconds since the epoch (REAL), read from
-- sw_now(): the database's clock on SQLite is the host's wall clock.

CREATE TABLE workflows (
    name          TEXT PRIMARY KEY,
    version       INTEGER NOT NULL,
    definition    TEXT NOT NULL,
    registered_by TEXT,
    updated_at    REAL NOT NULL
);

CREATE TABLE tasks (
    id               INTEGER PRIMARY KEY AUTOINCREMENT,
    workflow         TEXT NOT NULL,
    workflow_version INTEGER NOT NULL,
    state            TEXT NOT NULL,
    input            TEXT NOT NULL,
    correlation_id   TEXT,
    idempotency_key  TEXT UNIQUE,
    reply_to         TEXT,
    priority         INTEGER NOT NULL DEFAULT 0,
    failure_count    INTEGER NOT NULL DEFAULT 0,
    locked_by        TEXT,
    complete_by      REAL,
    run_at           REAL NOT NULL,
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    last_error       TEXT,
    created_at       REAL NOT NULL,
    updated_at       REAL NOT NULL,
    finished_at      REAL
);
-- The claim reads only unlocked pending/compensating tasks, in priority order.
CREATE INDEX tasks_claimable ON tasks (priority DESC, id)
    WHERE locked_by IS NULL AND state IN ('pending', 'compensating');
CREATE INDEX tasks_state ON tasks (state, id);
CREATE INDEX tasks_correlation ON tasks (correlation_id);

CREATE TABLE steps (
    task_id        INTEGER NOT NULL REFERENCES tasks (id),
    idx            INTEGER NOT NULL,
    name           TEXT NOT NULL,
    agent          TEXT NOT NULL,
    operation      TEXT NOT NULL,
    compensate     TEXT,
    budget         REAL NOT NULL,
    policy         TEXT NOT NULL,
    on_error       TEXT NOT NULL,
    state          TEXT NOT NULL,
    attempt        INTEGER NOT NULL DEFAULT 0,
    failure_count  INTEGER NOT NULL DEFAULT 0,
    failure_offset INTEGER NOT NULL DEFAULT 0,
    comp_failures  INTEGER NOT NULL DEFAULT 0,
    locked_by      TEXT,
    complete_by    REAL,
    result         TEXT,
    last_error     TEXT,
    started_at     REAL,
    finished_at    REAL,
    PRIMARY KEY (task_id, idx)
) WITHOUT ROWID;
-- The supervisor's scan: only in-flight attempts, ordered by deadline.
CREATE INDEX steps_inflight ON steps (complete_by)
    WHERE state IN ('running', 'compensating') AND complete_by IS NOT NULL;

-- One row per attempt: the request message to the agent, and what became of it.
CREATE TABLE requests (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    task_id         INTEGER NOT NULL,
    step_idx        INTEGER NOT NULL,
    attempt         INTEGER NOT NULL,
    kind            TEXT NOT NULL,
    agent           TEXT NOT NULL,
    operation       TEXT NOT NULL,
    payload         TEXT NOT NULL,
    policy          TEXT NOT NULL,
    idempotency_key TEXT NOT NULL,
    priority        INTEGER NOT NULL,
    complete_by     REAL NOT NULL,
    state           TEXT NOT NULL,
    dispatched_by   TEXT NOT NULL,
    dispatched_at   REAL NOT NULL,
    taken_by        TEXT,
    taken_at        REAL,
    outcome         TEXT,
    finished_at     REAL,
    UNIQUE (task_id, step_idx, attempt)
);
CREATE INDEX requests_queued ON requests (agent, priority DESC, id) WHERE state = 'queued';

CREATE TABLE replies (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    request_id  INTEGER NOT NULL,
    task_id     INTEGER NOT NULL,
    step_idx    INTEGER NOT NULL,
    attempt     INTEGER NOT NULL,
    kind        TEXT NOT NULL,
    outcome     TEXT NOT NULL,
    result      TEXT,
    error       TEXT,
    sent_by     TEXT NOT NULL,
    received_at REAL NOT NULL,
    status      TEXT NOT NULL DEFAULT 'new',
    applied_by  TEXT,
    applied_at  REAL
);
CREATE INDEX replies_new ON replies (id) WHERE status = 'new';
CREATE INDEX replies_attempt ON replies (task_id, step_idx, attempt);

CREATE TABLE events (
    id       INTEGER PRIMARY KEY AUTOINCREMENT,
    task_id  INTEGER,
    step_idx INTEGER,
    attempt  INTEGER,
    kind     TEXT NOT NULL,
    actor    TEXT,
    detail   TEXT,
    at       REAL NOT NULL
);
CREATE INDEX events_task ON events (task_id, id);
CREATE INDEX events_kind ON events (kind, id);

CREATE TABLE messages (
    id             INTEGER PRIMARY KEY AUTOINCREMENT,
    queue          TEXT NOT NULL,
    task_id        INTEGER NOT NULL,
    correlation_id TEXT,
    kind           TEXT NOT NULL,
    body           TEXT NOT NULL,
    created_at     REAL NOT NULL
);
CREATE INDEX messages_queue ON messages (queue, id);

CREATE TABLE alerts (
    id         INTEGER PRIMARY KEY AUTOINCREMENT,
    kind       TEXT NOT NULL,
    task_id    INTEGER,
    step       TEXT,
    message    TEXT NOT NULL,
    created_at REAL NOT NULL,
    acked_at   REAL,
    acked_by   TEXT
);

CREATE TABLE leases (
    name        TEXT PRIMARY KEY,
    holder      TEXT,
    term        INTEGER NOT NULL,
    expires_at  REAL NOT NULL,
    acquired_at REAL,
    renewed_at  REAL
);

-- Every term ever granted, so overlaps can be checked from the store's own records.
CREATE TABLE lease_terms (
    name        TEXT NOT NULL,
    term        INTEGER NOT NULL,
    holder      TEXT NOT NULL,
    acquired_at REAL NOT NULL,
    ended_at    REAL,
    PRIMARY KEY (name, term)
);

CREATE TABLE workers (
    id           TEXT PRIMARY KEY,
    roles        TEXT NOT NULL,
    agents       TEXT NOT NULL,
    started_at   REAL NOT NULL,
    heartbeat_at REAL NOT NULL,
    stopped_at   REAL,
    breakers     TEXT
);
