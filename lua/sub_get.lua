-- sub_get.lua: GET __ds/subscriptions/:id. Read only.
-- KEYS: the subscription's (_subs.lua).
-- ARGV: none.
-- Returns {} when there is none, else {state, links} (each flat).
local state = redis.call('HGETALL', S)
if #state == 0 then return {} end
return {state, redis.call('HGETALL', L)}
