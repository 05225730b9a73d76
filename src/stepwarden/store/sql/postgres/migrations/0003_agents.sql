-- stepwarden schema, version 3 (PostgreSQL): agent instances and shared circuit breakers (AGT3, AGT6).

-- One circuit breaker per agent, shared by every instance of it: the store holds its state, so
-- when the remote service fails the breaker opens for all instances at once. Every change is a
-- conditional UPDATE (closed -> open, open -> half_open by one trial holder, half_open -> closed
-- or open), so exactly one instance wins each transition. Times are on the database clock.
CREATE TABLE agent_breakers (
    agent      TEXT PRIMARY KEY,
    state      TEXT NOT NULL,
    failures   INTEGER NOT NULL,
    threshold  INTEGER NOT NULL,
    cool_off   DOUBLE PRECISION NOT NULL,
    opened_at  DOUBLE PRECISION,
    opened_by  TEXT,
    retry_at   DOUBLE PRECISION,
    trial_by   TEXT,
    trial_at   DOUBLE PRECISION,
    reason     TEXT,
    opens      INTEGER NOT NULL,
    changed_at DOUBLE PRECISION NOT NULL
);

-- One row per agent per worker: its capacity, what it runs, and its own health. An instance whose
-- calls fail while another live instance's succeed marks itself unhealthy (its own network path)
-- and stops pulling the agent's requests until probe_at.
CREATE TABLE agent_instances (
    worker          TEXT NOT NULL,
    agent           TEXT NOT NULL,
    capacity        INTEGER NOT NULL,
    inflight        INTEGER NOT NULL,
    healthy         INTEGER NOT NULL,
    failures        INTEGER NOT NULL,
    failing_since   DOUBLE PRECISION,
    successes_total INTEGER NOT NULL,
    failures_total  INTEGER NOT NULL,
    last_success_at DOUBLE PRECISION,
    last_failure_at DOUBLE PRECISION,
    last_error      TEXT,
    unhealthy_since DOUBLE PRECISION,
    probe_at        DOUBLE PRECISION,
    started_at      DOUBLE PRECISION NOT NULL,
    heartbeat_at    DOUBLE PRECISION NOT NULL,
    stopped_at      DOUBLE PRECISION,
    PRIMARY KEY (worker, agent)
);
CREATE INDEX agent_instances_agent ON agent_instances (agent, last_success_at);
