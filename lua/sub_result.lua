-- sub_result.lua: what came of the worker's step (sub_step.lua), applied only if
-- the worker still holds it (its token) and the wake is still current: a worker
-- paused past its hold, or a wake ended meanwhile, changes nothing (fencing).
-- KEYS: the subscription's (_subs.lua).
-- ARGV: 1 outcome: 'done' (the webhook answered {"done": true}: its snapshot is acked,
--   spec 7.1) | 'accepted' (2xx: the receiver calls back) | 'failed' (retried after
--   retry_ms) | 'emitted' (pull-wake events written) | 'backfilled', 2 token: the
--   worker's token, 3 generation: generation (backfilled: the subscription's created_ms
--   the worker linked for: a backfill is idempotent, so any pass of this subscription
--   completes it, however long it took), 4 wake_id: wake id, 5 retry_ms: retry delay
--   ms, 6 new_wake_id: a fresh wake id.
-- Returns {'ok', new_wake ('1' if a new wake began, else '0')} | {'fenced'}.
local what, token, gen, wake = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
if redis.call('EXISTS', S) == 0 then return {'fenced'} end
local now = now_ms()
if what == 'backfilled' then
  if sget('created_ms') ~= gen then return {'fenced'} end
  redis.call('HSET', S, 'backfill', '0', 'bftoken', '', 'bf_until', '0')
  schedule(now)  -- the next step puts the schedule right
  return {'ok', '0'}
end
if sget('dtoken') ~= token or sget('gen') ~= gen or sget('wake') ~= wake then return {'fenced'} end
if what == 'failed' then
  local next_at = now + tonumber(ARGV[5])
  redis.call('HSET', S, 'status', 'failed', 'next_at', next_at, 'dtoken', '', 'd_until', '0')
  redis.call('HINCRBY', S, 'attempts', 1)
  schedule(next_at)
  return {'ok', '0'}
end
redis.call('HSET', S, 'status', 'active', 'attempts', '0', 'next_at', '0', 'dtoken', '', 'd_until', '0')
if what == 'done' then
  for _, line in ipairs(snapshot_lines()) do
    local value = redis.call('HGET', L, line[1])
    -- (not a tail of the stream's previous incarnation onto a stream made anew)
    if value and select(3, link_parts(value)) == line[3] then set_acked(line[1], line[2]) end
  end
  return {'ok', end_wake(now, ARGV[6]) and '1' or '0'}
end
if what == 'accepted' then  -- the lease runs from now at least (a slow 2xx is no expired wake)
  local lease_until = math.max(tonumber(sget('lease_until')), now + tonumber(sget('ttl')))
  redis.call('HSET', S, 'delivered', '1', 'lease_until', lease_until)
  schedule(lease_until)
else  -- emitted: a claim comes next (or came already: its lease is scheduled)
  redis.call('HSET', S, 'emit', '0')
  if sget('holder') ~= '' then schedule(tonumber(sget('lease_until'))) else schedule(nil) end
end
return {'ok', '0'}
