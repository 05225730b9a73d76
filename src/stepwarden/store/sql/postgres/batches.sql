-- Set-based forms of the hot path's writes: `x__many` does what `x` does, for every object of the
-- JSON array `:rows` (each with `x`'s parameters), in ONE statement. PgTx sends a transaction's
-- deferred writes of one query this way: a statement costs a message exchange and a plan
-- execution whether it changes one row or fifty. Inserts keep the array's order (ids, as in the
-- one-by-one form); updates are used only when no two objects name the same row. Each update and
-- join also names its rows by `= ANY (ARRAY(...))` of their keys: the planner guesses 100 rows for
-- jsonb_to_recordset and would otherwise scan the whole table (cost growing with its size) where
-- an index reaches the few rows meant.

-- name: start_attempt__many
UPDATE steps s SET state = v.state, attempt = s.attempt + 1, locked_by = v.me,
                   complete_by = v.complete_by, started_at = COALESCE(s.started_at, v.now)
FROM jsonb_to_recordset(:rows::jsonb) AS v(task_id bigint, idx int, attempt int, state text, me text,
                                           complete_by float8, now float8)
WHERE s.task_id = ANY (ARRAY(SELECT (e->>'task_id')::bigint FROM jsonb_array_elements(:rows::jsonb) e))
  AND s.task_id = v.task_id AND s.idx = v.idx AND s.attempt = v.attempt;

-- name: insert_request__many
INSERT INTO requests (task_id, step_idx, attempt, kind, agent, operation, payload, policy, idempotency_key,
                      priority, complete_by, state, dispatched_by, dispatched_at)
SELECT task_id, idx, attempt, kind, agent, operation, payload, policy, key,
       priority, complete_by, 'queued', me, {now}
FROM ROWS FROM (jsonb_to_recordset(:rows::jsonb) AS (task_id bigint, idx int, attempt int, kind text,
                                                      agent text, operation text, payload text,
                                                      policy text, key text, priority int,
                                                      complete_by float8, me text))
     WITH ORDINALITY AS v(task_id, idx, attempt, kind, agent, operation, payload, policy, key, priority,
                          complete_by, me, n)
ORDER BY n;

-- name: task_in_flight__many
UPDATE tasks t SET state = v.state, locked_by = v.me, complete_by = v.complete_by, updated_at = {now}
FROM jsonb_to_recordset(:rows::jsonb) AS v(task_id bigint, state text, me text, complete_by float8)
WHERE t.id = ANY (ARRAY(SELECT (e->>'task_id')::bigint FROM jsonb_array_elements(:rows::jsonb) e)) AND t.id = v.task_id;

-- name: finish_task__many
UPDATE tasks t SET state = v.state, locked_by = NULL, complete_by = NULL, last_error = v.error,
                   updated_at = {now}, finished_at = {now}
FROM jsonb_to_recordset(:rows::jsonb) AS v(task_id bigint, state text, error text)
WHERE t.id = ANY (ARRAY(SELECT (e->>'task_id')::bigint FROM jsonb_array_elements(:rows::jsonb) e)) AND t.id = v.task_id;

-- name: mark_reply__many
UPDATE replies r SET status = v.status, applied_by = v.me, applied_at = {now}
FROM jsonb_to_recordset(:rows::jsonb) AS v(id bigint, status text, me text)
WHERE r.id = ANY (ARRAY(SELECT (e->>'id')::bigint FROM jsonb_array_elements(:rows::jsonb) e)) AND r.id = v.id AND r.status = 'new';

-- name: finish_request__many
UPDATE requests r SET outcome = v.outcome, finished_at = {now},
                      state = CASE WHEN r.state = 'taken' THEN 'replied' ELSE r.state END
FROM jsonb_to_recordset(:rows::jsonb) AS v(task_id bigint, idx int, attempt int, outcome text)
WHERE r.task_id = ANY (ARRAY(SELECT (e->>'task_id')::bigint FROM jsonb_array_elements(:rows::jsonb) e))
  AND r.task_id = v.task_id AND r.step_idx = v.idx AND r.attempt = v.attempt AND r.outcome IS NULL;

-- name: complete_step__many
UPDATE steps s SET state = v.state, result = v.result, locked_by = NULL, complete_by = NULL,
                   finished_at = {now}
FROM jsonb_to_recordset(:rows::jsonb) AS v(task_id bigint, idx int, attempt int, state text,
                                           expect text, result text)
WHERE s.task_id = ANY (ARRAY(SELECT (e->>'task_id')::bigint FROM jsonb_array_elements(:rows::jsonb) e))
  AND s.task_id = v.task_id AND s.idx = v.idx AND s.attempt = v.attempt AND s.state = v.expect;

-- name: insert_reply__many
INSERT INTO replies (request_id, task_id, step_idx, attempt, kind, outcome, result, error, sent_by,
                     received_at)
SELECT q.id, q.task_id, q.step_idx, q.attempt, q.kind, v.outcome, v.result, v.error, v.me, {now}
FROM ROWS FROM (jsonb_to_recordset(:rows::jsonb) AS (request_id bigint, outcome text, result text,
                                                      error text, me text))
     WITH ORDINALITY AS v(request_id, outcome, result, error, me, n)
JOIN requests q ON q.id = v.request_id
WHERE q.id = ANY (ARRAY(SELECT (e->>'request_id')::bigint FROM jsonb_array_elements(:rows::jsonb) e))
ORDER BY v.n;

-- name: insert_applied_reply__many
INSERT INTO replies (request_id, task_id, step_idx, attempt, kind, outcome, result, error, sent_by,
                     received_at, status, applied_by, applied_at)
SELECT request_id, task_id, idx, attempt, kind, outcome, result, error, me, received_at, status, me,
       {now}
FROM ROWS FROM (jsonb_to_recordset(:rows::jsonb) AS (request_id bigint, task_id bigint, idx int,
                                                      attempt int, kind text, outcome text,
                                                      result text, error text, received_at float8,
                                                      status text, me text))
     WITH ORDINALITY AS v(request_id, task_id, idx, attempt, kind, outcome, result, error, received_at,
                          status, me, n)
ORDER BY n;

-- name: request_replied__many
UPDATE requests r SET state = 'replied'
FROM jsonb_to_recordset(:rows::jsonb) AS v(request_id bigint)
WHERE r.id = ANY (ARRAY(SELECT (e->>'request_id')::bigint FROM jsonb_array_elements(:rows::jsonb) e)) AND r.id = v.request_id AND r.state = 'taken';

-- name: insert_event__many
INSERT INTO events (task_id, step_idx, attempt, kind, actor, detail, at)
SELECT task_id, idx, attempt, kind, actor, detail, {now}
FROM ROWS FROM (jsonb_to_recordset(:rows::jsonb) AS (task_id bigint, idx int, attempt int, kind text,
                                                      actor text, detail text))
     WITH ORDINALITY AS v(task_id, idx, attempt, kind, actor, detail, n)
ORDER BY n;

-- name: insert_message__many
INSERT INTO messages (queue, task_id, correlation_id, kind, body, created_at)
SELECT queue, task_id, correlation_id, kind, body, {now}
FROM ROWS FROM (jsonb_to_recordset(:rows::jsonb) AS (queue text, task_id bigint, correlation_id text,
                                                      kind text, body text))
     WITH ORDINALITY AS v(queue, task_id, correlation_id, kind, body, n)
ORDER BY n;
