-- sub_step.lua: a subscription's time came (its group's schedule): what the worker
-- does now. Expired leases are cleared first (a new wake if work is pending).
-- KEYS: the subscription's (_subs.lua).
-- ARGV: 1 sub_id: id, 2 new_wake_id: a fresh wake id, 3 token: the worker's fresh token
--   (fencing between workers), 4 hold_ms: how long the worker holds a delivery (ms),
--   5 backfill_hold_ms: how long it holds a backfill (ms).
-- Returns one of
--   {'gone'} | {'idle'} | {'wait'}            nothing to do now
--   {'backfill', config}                      link the pattern's existing streams, then
--                                             sub_result 'backfilled' (the wake is looked
--                                             at in the next step)
--   {'deliver', generation, wake_id, config, attempts, streams, base_url}
--                                             POST the webhook, then sub_result
--   {'emit', generation, wake_id, config, streams, attempts}
--                                             write pull-wake events, then sub_result
-- streams: flat {path, types, acked, tail, ...} of the wake's snapshot.
local id, token, hold, backfill_hold = ARGV[1], ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5])
if redis.call('EXISTS', S) == 0 then
  redis.call('ZREM', DUE, id)
  return {'gone'}
end
local now = now_ms()
expire_lease(now, ARGV[2])

local function snapshot()
  local out = {}
  for _, line in ipairs(snapshot_lines()) do
    local value = redis.call('HGET', L, line[1])
    if value then
      local types, acked = link_parts(value)
      out[#out + 1] = line[1]; out[#out + 1] = types; out[#out + 1] = acked; out[#out + 1] = line[2]
    end
  end
  return out
end

local function hold_for_worker()
  redis.call('HSET', S, 'dtoken', token, 'd_until', now + hold)
  schedule(now + hold)
end

-- A backfill no live worker holds: handed out with its own token and hold, beside
-- (never in the way of) the wakes.
if sget('backfill') == '1' and tonumber(sget('bf_until') or '0') <= now then
  redis.call('HSET', S, 'bftoken', token, 'bf_until', now + backfill_hold)
  schedule(now)
  return {'backfill', sget('cfg')}
end
-- A delivery still out, within its worker's hold: its report decides.
local d_until = tonumber(sget('d_until') or '0')
if sget('dtoken') ~= '' and d_until > now then
  schedule(d_until)
  return {'wait'}
end
if sget('wake') == '' and not begin_wake(now, ARGV[2]) then return {'idle'} end
local next_at = tonumber(sget('next_at') or '0')
local lease_until = tonumber(sget('lease_until'))
if sget('type') == 'webhook' then
  if sget('delivered') == '1' then  -- the receiver has it: its callbacks keep the lease
    schedule(lease_until)
    return {'wait'}
  end
  if next_at > now then
    schedule(next_at)
    return {'wait'}
  end
  local streams = snapshot()
  if #streams == 0 then  -- its streams were unlinked meanwhile: never a wake of nothing
    end_wake(now, ARGV[2])
    return {'idle'}
  end
  -- The lease starts as the wake goes out (and again with each retry).
  redis.call('HSET', S, 'lease_until', now + tonumber(sget('ttl')))
  hold_for_worker()
  return {'deliver', sget('gen'), sget('wake'), sget('cfg'), sget('attempts'), streams, sget('base')}
end
if sget('emit') == '1' then
  if next_at > now then
    schedule(next_at)
    return {'wait'}
  end
  local streams = snapshot()
  if #streams == 0 then
    end_wake(now, ARGV[2])
    return {'idle'}
  end
  hold_for_worker()
  return {'emit', sget('gen'), sget('wake'), sget('cfg'), streams, sget('attempts')}
end
if sget('holder') ~= '' and lease_until > now then
  schedule(lease_until)
  return {'wait'}
end
schedule(nil)  -- a wake event is out: a claim comes next
return {'idle'}
