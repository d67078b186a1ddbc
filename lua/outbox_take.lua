-- outbox_take.lua: a subscription worker takes streams to look at from an outbox
-- (keys.subs_outbox: stream id -> when due, ms), holding each for a while: a
-- worker that dies leaves them due again for another (at-least-once).
-- KEYS: 1 the outbox.
-- ARGV: 1 most: at most how many, 2 hold_ms: hold ms.
-- Returns {stream_id, recorded_ms}...: each stream id taken, followed by when it was
--   recorded (ms).
local outbox = KEYS[1]
local now = now_ms()
local due = redis.call('ZRANGEBYSCORE', outbox, '-inf', now, 'WITHSCORES', 'LIMIT', 0, tonumber(ARGV[1]))
for i = 1, #due, 2 do redis.call('ZADD', outbox, 'XX', now + tonumber(ARGV[2]), due[i]) end
return due
