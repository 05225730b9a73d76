-- stepwarden schema, version 7 (PostgreSQL): metrics counters that miss nothing and never go down (OPS6).

-- The transaction that wrote each event and reply (pg_current_xact_id(), as a number). A row takes
-- its id when it is inserted but appears only when its transaction commits, which may be long
-- after rows with higher ids (a caller's app.transaction() block, a transaction waiting out
-- lock_timeout): an id cannot tell the metrics reader whether a row below it may still appear.
-- Every transaction below a snapshot's xmin has ended, so the rows whose xact_id is below it are
-- final, visible now or never (see metrics/tally.py). Added and then given its default, so the
-- table is not rewritten: the rows written before keep NULL, and all of them are final.
ALTER TABLE events ADD COLUMN xact_id BIGINT;
ALTER TABLE events ALTER COLUMN xact_id SET DEFAULT (pg_current_xact_id()::text::bigint);
CREATE INDEX events_xact ON events (xact_id, id);
ALTER TABLE replies ADD COLUMN xact_id BIGINT;
ALTER TABLE replies ALTER COLUMN xact_id SET DEFAULT (pg_current_xact_id()::text::bigint);
CREATE INDEX replies_xact ON replies (xact_id, id);

-- The events the leader's prune deleted, by kind, added in the transaction that deletes them: the
-- metrics' totals are this plus the events still stored, so a prune never lowers them.
CREATE TABLE event_totals (
    kind   TEXT PRIMARY KEY,
    pruned BIGINT NOT NULL
);
