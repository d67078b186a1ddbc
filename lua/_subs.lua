-- _subs.lua: helpers of the subscription scripts (sub_*.lua), put after the
-- prelude in front of each (gateway/storage/scripts.py). Every sub_* script
-- gets one subscription's keys (gateway/storage/keys.py sub_keys, one hash tag):
--   KEYS[1] state (hash)  KEYS[2] links (hash)  KEYS[3] pending (hash)
--   KEYS[4] its group's due schedule (sorted set: subscription id -> ms)
-- state: cfg (JSON), hash, created_at (ISO), created_ms (Redis' clock, as streams'
--   'created': the backfill links streams made after it at -1, others at their tail), type ('webhook'|'pull-wake'), ttl
--   (lease ms), id, gen (wake generation), wake (wake id, '' none), holder
--   (pull-wake worker, '' none), lease_until (ms, 0 none), snap (the wake's
--   snapshot "path\ttail\n..."), status ('active'|'failed'), attempts, next_at
--   (ms: next webhook attempt), delivered ('1': the receiver took this wake),
--   dtoken (the delivering worker's token: fencing between workers), emit
--   ('1': a pull-wake event is still to be written), backfill ('1': the
--   pattern's existing streams are still to be linked).
-- links: stream path -> "<types>|<acked offset>|<stream incarnation>", types
--   'e' (explicit), 'g' (glob) or 'eg'. pending: path -> the latest tail seen
--   above its acked offset (offsets compare as strings: fixed width; '-1' is
--   below every offset).
local S, L, P, DUE = KEYS[1], KEYS[2], KEYS[3], KEYS[4]

local function sget(field) return redis.call('HGET', S, field) end

local function link_parts(value)
  local types, acked, inc = string.match(value, '^([eg]*)|([^|]*)|(.*)$')
  return types, acked, inc
end

local function link_value(types, acked, inc) return types .. '|' .. acked .. '|' .. inc end

-- A new wake: the next generation over everything pending now. Webhooks are
-- due for delivery at once; pull-wake writes its wake events first ('emit').
local function begin_wake(now, wake_id)
  local pend = redis.call('HGETALL', P)
  if #pend == 0 then return false end
  local snap = {}
  for i = 1, #pend, 2 do snap[#snap + 1] = pend[i] .. '\t' .. pend[i + 1] end
  local gen = redis.call('HINCRBY', S, 'gen', 1)
  redis.call('HSET', S, 'wake', wake_id, 'snap', table.concat(snap, '\n'), 'delivered', '0', 'dtoken', '')
  if sget('type') == 'webhook' then
    local next_at = tonumber(sget('next_at') or '0')
    redis.call('HSET', S, 'lease_until', '0')
    redis.call('ZADD', DUE, math.max(now, next_at), sget('id'))
  else
    redis.call('HSET', S, 'emit', '1', 'lease_until', '0')
    redis.call('ZADD', DUE, now, sget('id'))
  end
  return gen
end

-- Clears the wake in flight and its lease; starts the next wake if work is pending.
local function end_wake(now, wake_id)
  redis.call('HSET', S, 'wake', '', 'holder', '', 'lease_until', '0', 'snap', '', 'delivered', '0',
    'dtoken', '', 'emit', '0')
  redis.call('ZREM', DUE, sget('id'))
  return begin_wake(now, wake_id) ~= false
end

-- A lease past its time is cleared (spec 7.3) before anything else looks at the
-- state; returns whether one was.
local function expire_lease(now, wake_id)
  local until_ms = tonumber(sget('lease_until') or '0')
  if until_ms > 0 and until_ms <= now and (sget('wake') or '') ~= '' then
    end_wake(now, wake_id)
    return true
  end
  return false
end

-- A linked stream's tail as seen now: pending if above the acked offset (a stream
-- created anew starts over at -1). Returns its link types, or nil if not linked.
local function observe(path, tail, inc)
  local value = redis.call('HGET', L, path)
  if not value then return nil end
  local types, acked, linc = link_parts(value)
  if linc ~= inc then
    acked = '-1'
    redis.call('HSET', L, path, link_value(types, acked, inc))
    redis.call('HDEL', P, path)
  end
  if bytes_less(acked, tail) then
    local seen = redis.call('HGET', P, path)
    if not seen or bytes_less(seen, tail) then redis.call('HSET', P, path, tail) end
  end
  return types
end

-- Acked offset `offset` on `path` (already checked): the link moves, and the
-- path stops pending once nothing above the offset was seen.
local function set_acked(path, offset)
  local types, acked, inc = link_parts(redis.call('HGET', L, path))
  if bytes_less(acked, offset) then redis.call('HSET', L, path, link_value(types, offset, inc)) end
  local seen = redis.call('HGET', P, path)
  if seen and not bytes_less(offset, seen) then redis.call('HDEL', P, path) end
end
