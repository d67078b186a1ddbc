-- due_take.lua: a subscription worker takes subscriptions whose time came from a
-- group's schedule (keys.sub_keys [4]: id -> when, ms), holding each for a while
-- (sub_step.lua then says what is due; a worker that dies leaves it due again).
-- KEYS: 1 the schedule.
-- ARGV: 1 most: at most how many, 2 hold_ms: hold ms.
-- Returns the subscription ids taken.
local due_key = KEYS[1]
local now = now_ms()
local due = redis.call('ZRANGEBYSCORE', due_key, '-inf', now, 'LIMIT', 0, tonumber(ARGV[1]))
for _, id in ipairs(due) do redis.call('ZADD', due_key, 'XX', now + tonumber(ARGV[2]), id) end
return due
