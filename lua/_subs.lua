-- _subs.lua: helpers of the subscription scripts (sub_*.lua), put after the
-- prelude in front of each (gateway/redis_io/lua.py). Every sub_* script
-- gets one subscription's keys (gateway/redis_io/keys.py sub_keys, one hash tag):
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
local ZERO = '0000000000000001_0000000000000000'  -- offsets.ZERO: an empty stream's tail

local function sget(field) return redis.call('HGET', S, field) end

local function link_parts(value)
  local types, acked, inc = string.match(value, '^([eg]*)|([^|]*)|(.*)$')
  return types, acked, inc
end

local function link_value(types, acked, inc) return types .. '|' .. acked .. '|' .. inc end

-- The subscription's next time in its group's schedule: `at` (ms, nil: nothing due),
-- or sooner the end of a backfill's hold (a worker that died while backfilling
-- leaves it to another). Every change to the schedule goes through here.
local function schedule(at)
  if sget('backfill') == '1' then
    local hold = tonumber(sget('bf_until') or '0')
    if at == nil or hold < at then at = hold end
  end
  if at == nil then
    redis.call('ZREM', DUE, sget('id'))
  else
    redis.call('ZADD', DUE, at, sget('id'))
  end
end

-- A new wake: the next generation over everything pending now (its snapshot:
-- "path\ttail\tincarnation" lines). Webhooks are due for delivery at once (or at
-- the retry time a failing receiver was given); pull-wake writes its wake events
-- first ('emit').
local function begin_wake(now, wake_id)
  local pend = redis.call('HGETALL', P)
  if #pend == 0 then
    schedule(nil)
    return false
  end
  local snap = {}
  for i = 1, #pend, 2 do
    local value = redis.call('HGET', L, pend[i])
    if value then
      snap[#snap + 1] = pend[i] .. '\t' .. pend[i + 1] .. '\t' .. select(3, link_parts(value))
    else  -- (not linked any more: nothing to deliver, never a wake of nothing)
      redis.call('HDEL', P, pend[i])
    end
  end
  if #snap == 0 then
    schedule(nil)
    return false
  end
  local gen = redis.call('HINCRBY', S, 'gen', 1)
  redis.call('HSET', S, 'wake', wake_id, 'snap', table.concat(snap, '\n'), 'delivered', '0', 'dtoken', '',
    'd_until', '0', 'lease_until', '0')
  if sget('type') == 'webhook' then
    schedule(math.max(now, tonumber(sget('next_at') or '0')))
  else
    redis.call('HSET', S, 'emit', '1')
    schedule(now)
  end
  return gen
end

-- Clears the wake in flight and its lease; starts the next wake if work is pending.
local function end_wake(now, wake_id)
  redis.call('HSET', S, 'wake', '', 'holder', '', 'lease_until', '0', 'snap', '', 'delivered', '0',
    'dtoken', '', 'd_until', '0', 'emit', '0')
  return begin_wake(now, wake_id) ~= false
end

-- A lease past its time is cleared (spec 7.3) before anything else looks at the
-- state; returns whether one was. Not while a webhook POST is still out (within its
-- worker's hold): its answer decides, and a second POST would race it.
local function expire_lease(now, wake_id)
  local until_ms = tonumber(sget('lease_until') or '0')
  if until_ms == 0 or until_ms > now or (sget('wake') or '') == '' then return false end
  if sget('dtoken') ~= '' and sget('delivered') ~= '1' and tonumber(sget('d_until') or '0') > now then
    return false
  end
  end_wake(now, wake_id)
  return true
end

-- The wake's snapshot as {path, tail, incarnation} triples.
local function snapshot_lines()
  local out = {}
  for line in string.gmatch(sget('snap') or '', '[^\n]+') do
    local path, tail, inc = string.match(line, '^(.-)\t([^\t]*)\t?([^\t]*)$')
    out[#out + 1] = {path, tail, inc}
  end
  return out
end

-- A linked stream's tail as seen now: pending if above the acked offset (a stream
-- created anew starts over at -1). Returns its link types, or nil if not linked.
local function observe(path, tail, inc)
  local value = redis.call('HGET', L, path)
  if not value then return nil end
  local types, acked, linc = link_parts(value)
  -- Only a newer incarnation starts over: a read from before a delete and re-create,
  -- or of a stream gone (''), must not roll the link back.
  if inc == '' or (linc ~= '' and tonumber(inc) <= tonumber(linc) and inc ~= linc) then return types end
  if linc ~= inc then
    acked = '-1'
    redis.call('HSET', L, path, link_value(types, acked, inc))
    redis.call('HDEL', P, path)
  end
  -- (a stream linked before its first byte, still empty, has nothing pending)
  if bytes_less(acked, tail) and not (acked == '-1' and tail == ZERO) then
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
