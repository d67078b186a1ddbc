-- sub_result.lua: what came of the worker's step (sub_step.lua), applied only if
-- the worker still holds it (its token) and the wake is still current: a worker
-- paused past its hold, or a wake ended meanwhile, changes nothing (fencing).
-- KEYS: the subscription's (_subs.lua).
-- ARGV: 1 what: 'done' (the webhook answered {"done": true}: its snapshot is acked,
--   spec 7.1) | 'accepted' (2xx: the receiver calls back) | 'failed' (retried after
--   ARGV 5 ms) | 'emitted' (pull-wake events written) | 'backfilled', 2 the
--   worker's token, 3 generation, 4 wake id, 5 retry delay ms, 6 a fresh wake id.
-- Returns {'ok', '1' if a new wake began | '0'} | {'fenced'}.
local what, token, gen, wake = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
if redis.call('EXISTS', S) == 0 or sget('dtoken') ~= token then return {'fenced'} end
local now = now_ms()
local id = sget('id')
if what == 'backfilled' then
  redis.call('HSET', S, 'backfill', '0', 'dtoken', '')
  redis.call('ZADD', DUE, now, id)
  return {'ok', '0'}
end
if sget('gen') ~= gen or sget('wake') ~= wake then return {'fenced'} end
if what == 'failed' then
  local next_at = now + tonumber(ARGV[5])
  redis.call('HSET', S, 'status', 'failed', 'next_at', next_at, 'dtoken', '')
  redis.call('HINCRBY', S, 'attempts', 1)
  redis.call('ZADD', DUE, next_at, id)
  return {'ok', '0'}
end
redis.call('HSET', S, 'status', 'active', 'attempts', '0', 'next_at', '0', 'dtoken', '')
if what == 'done' then
  for line in string.gmatch(sget('snap') or '', '[^\n]+') do
    local path, tail = string.match(line, '^(.*)\t(.*)$')
    if redis.call('HEXISTS', L, path) == 1 then set_acked(path, tail) end
  end
  return {'ok', end_wake(now, ARGV[6]) and '1' or '0'}
end
if what == 'accepted' then
  redis.call('HSET', S, 'delivered', '1')
  redis.call('ZADD', DUE, sget('lease_until'), id)
else  -- emitted: the claim comes next
  redis.call('HSET', S, 'emit', '0')
  redis.call('ZREM', DUE, id)
end
return {'ok', '0'}
