-- stepwarden schema, version 7 (SQLite): metrics counters that never go down (OPS6).

-- The events the leader's prune deleted, by kind, added in the transaction that deletes them: the
-- metrics' totals are this plus the events still stored, so a prune never lowers them. (SQLite
-- commits one writer at a time in id order, so it needs no writer transaction id on its rows as
-- PostgreSQL does: see metrics/tally.py.)
CREATE TABLE event_totals (
    kind   TEXT PRIMARY KEY,
    pruned INTEGER NOT NULL
);
