-- Reply queues (SCH8): positions in commit order, and durable cursors per (queue, consumer).
--
-- Message ids are not commit order on PostgreSQL (two transactions take ids 10 and 11 and commit
-- 11 first), so a cursor on ids could pass a message that commits later. Instead a reader gives
-- the committed, unpositioned messages of a queue their positions (`seq`), in id order, holding
-- the queue's row in reply_queues: positions are handed out one reader at a time, each seeing
-- all committed before it, so a position is never given to a message older than one already read.
-- The messages of one task are in id order (each transition locks the task first), so positions
-- keep every task's order.

-- name: reply_sequence
UPDATE messages SET seq = :base + n.rn
FROM (SELECT id, row_number() OVER (ORDER BY id) AS rn FROM messages
      WHERE queue = :queue AND seq IS NULL ORDER BY id LIMIT :limit) AS n
WHERE messages.id = n.id;
