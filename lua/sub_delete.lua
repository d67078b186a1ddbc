-- sub_delete.lua: DELETE __ds/subscriptions/:id. Its state goes at once: callbacks,
-- acks and releases of its wakes then fail and move no cursor. Its streams' side
-- of the links is cleaned by the worker when they next wake it (stream_link.lua).
-- KEYS: the subscription's (_subs.lua).
-- ARGV: 1 sub_id: id.
-- Returns 1 if it existed, else 0.
if redis.call('EXISTS', S) == 0 then return 0 end
redis.call('DEL', S, L, P)
redis.call('ZREM', DUE, ARGV[1])
return 1
