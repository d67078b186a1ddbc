-- sub_step.lua: a subscription's time came (its group's schedule): what the worker
-- does now. Expired leases are cleared first (a new wake if work is pending).
-- KEYS: the subscription's (_subs.lua).
-- ARGV: 1 id, 2 a fresh wake id, 3 the worker's fresh token (fencing between workers),
--   4 how long the worker holds it (ms) while it delivers, 5 while it backfills.
-- Returns one of
--   {'gone'} | {'idle'} | {'wait'}            nothing to do now
--   {'backfill', cfg}                         link the pattern's existing streams, then sub_result 'backfilled'
--   {'deliver', gen, wake, cfg, attempts, streams, base}   POST the webhook, then sub_result
--   {'emit', gen, wake, cfg, streams}         write pull-wake events, then sub_result
-- streams: flat {path, types, acked, tail, ...} of the wake's snapshot.
local id, token, hold = ARGV[1], ARGV[3], tonumber(ARGV[4])
if redis.call('EXISTS', S) == 0 then
  redis.call('ZREM', DUE, id)
  return {'gone'}
end
local now = now_ms()
expire_lease(now, ARGV[2])

local function snapshot()
  local out = {}
  for line in string.gmatch(sget('snap') or '', '[^\n]+') do
    local path, tail = string.match(line, '^(.*)\t(.*)$')
    local value = redis.call('HGET', L, path)
    if value then
      local types, acked = link_parts(value)
      out[#out + 1] = path; out[#out + 1] = types; out[#out + 1] = acked; out[#out + 1] = tail
    end
  end
  return out
end

local function hold_for_worker(ms)
  redis.call('HSET', S, 'dtoken', token)
  redis.call('ZADD', DUE, now + (ms or hold), id)
end

if sget('backfill') == '1' then
  hold_for_worker(tonumber(ARGV[5]))
  return {'backfill', sget('cfg')}
end
if sget('wake') == '' then
  if not begin_wake(now, ARGV[2]) then
    redis.call('ZREM', DUE, id)
    return {'idle'}
  end
end
local next_at = tonumber(sget('next_at') or '0')
if sget('type') == 'webhook' then
  local lease_until = tonumber(sget('lease_until'))
  if sget('delivered') == '1' then  -- the receiver has it: its callbacks keep the lease
    redis.call('ZADD', DUE, lease_until, id)
    return {'wait'}
  end
  if next_at > now then
    redis.call('ZADD', DUE, next_at, id)
    return {'wait'}
  end
  -- The lease starts as the wake goes out (and again with each retry).
  redis.call('HSET', S, 'lease_until', now + tonumber(sget('ttl')))
  hold_for_worker()
  return {'deliver', sget('gen'), sget('wake'), sget('cfg'), sget('attempts'), snapshot(), sget('base')}
end
if sget('emit') == '1' then
  if next_at > now then
    redis.call('ZADD', DUE, next_at, id)
    return {'wait'}
  end
  hold_for_worker()
  return {'emit', sget('gen'), sget('wake'), sget('cfg'), snapshot()}
end
local lease_until = tonumber(sget('lease_until'))
if sget('holder') ~= '' and lease_until > now then
  redis.call('ZADD', DUE, lease_until, id)
  return {'wait'}
end
redis.call('ZREM', DUE, id)  -- a wake event is out: a claim comes next
return {'idle'}
