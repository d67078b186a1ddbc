-- stream_subs.lua: what the subscription worker needs of a stream it found in an
-- outbox (workers/delivery.py): whether it lives, its tail and incarnation, and
-- the subscriptions linked to it. Read only.
-- KEYS: 1 the stream's meta, 2 its links (keys.stream_subs: subscription id ->
--   'e' | 'g' | 'eg', plus field '_inc': the incarnation last matched against
--   the patterns).
-- ARGV: none.
-- Returns {state, tail, incarnation, links}: state 'ok' | 'missing' | 'gone', tail
--   ('' unless ok), incarnation (meta 'created', '' unless ok), links flat
--   (id, types, ...).
local meta, links = KEYS[1], KEYS[2]
local m = redis.call('HMGET', meta, 'tail', 'created', 'deleted', 'exp')
local state = 'ok'
if not m[1] then
  state = 'missing'
elseif m[3] or (m[4] and tonumber(m[4]) <= now_ms()) then
  state = 'gone'
end
if state ~= 'ok' then return {state, '', '', redis.call('HGETALL', links)} end
return {state, m[1], m[2], redis.call('HGETALL', links)}
