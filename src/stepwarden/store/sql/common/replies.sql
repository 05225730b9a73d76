-- Named queries shared by every dialect (replies.sql); a dialect's own file may override one by name.

-- name: reply_unsequenced
SELECT 1 AS found FROM messages WHERE queue = :queue AND seq IS NULL LIMIT 1;

-- name: reply_after
SELECT 1 AS found FROM messages WHERE queue = :queue AND seq > :after LIMIT 1;

-- name: reply_queue_lock
INSERT INTO reply_queues (queue, last_seq) VALUES (:queue, 0)
ON CONFLICT (queue) DO UPDATE SET last_seq = reply_queues.last_seq
RETURNING last_seq;

-- name: reply_queue_advance
-- To the highest position given, not base + the rows positioned: on PostgreSQL a message deleted
-- (pruned) while reply_sequence waited for its row lock is skipped by it, leaving a gap between
-- the positions it did give, so base + n would hand out a position already taken.
UPDATE reply_queues
SET last_seq = (SELECT max(seq) FROM messages WHERE queue = :queue)
WHERE queue = :queue;

-- name: reply_read
SELECT seq, id, queue, task_id, correlation_id, kind, body, created_at FROM messages
WHERE queue = :queue AND seq > :after ORDER BY seq LIMIT :limit;

-- name: reply_cursor
SELECT position FROM reply_cursors WHERE queue = :queue AND consumer = :consumer;

-- name: reply_cursor_create
INSERT INTO reply_cursors (queue, consumer, position, created_at)
VALUES (:queue, :consumer, 0, {now})
ON CONFLICT (queue, consumer) DO NOTHING;

-- name: reply_ack
UPDATE reply_cursors SET position = :position, acked_at = {now}
WHERE queue = :queue AND consumer = :consumer AND position < :position;

-- name: reply_cursors_of_queue
SELECT queue, consumer, position, created_at, acked_at FROM reply_cursors
WHERE queue = :queue ORDER BY consumer;

-- name: task_messages
SELECT seq, id, queue, task_id, correlation_id, kind, body, created_at FROM messages
WHERE task_id = :task_id AND id > :after ORDER BY id;

-- name: task_reply_state
SELECT reply_to, state FROM tasks WHERE id = :task_id;
