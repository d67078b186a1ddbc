-- outbox_done.lua: a stream's subscriptions were told of its tail `seen`: it leaves
-- the outbox, unless it moved since (then it is due again at once).
-- KEYS: 1 the outbox, 2 the stream's meta.
-- ARGV: 1 stream_id: stream id, 2 seen: the tail seen ('' the stream was gone: a stream
--   that is still gone, soft-deleted or expired, leaves too).
-- Returns 1 if it left the outbox.
local outbox, meta = KEYS[1], KEYS[2]
local m = redis.call('HMGET', meta, 'tail', 'deleted', 'exp')
local gone = not m[1] or m[2] or (m[3] and tonumber(m[3]) <= now_ms())
if (ARGV[2] == '' and gone) or (ARGV[2] ~= '' and not gone and m[1] == ARGV[2]) then
  redis.call('ZREM', outbox, ARGV[1])
  return 1
end
redis.call('ZADD', outbox, now_ms(), ARGV[1])
return 0
