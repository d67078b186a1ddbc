-- layout_switch.lua: `migrate --finish` raises the layout written, from one layout to the
-- next, only while its migration lock is held and if every member whose lease runs reads
-- the next one (redis_io/fleet.py); the oldest layout in the data stays where it was until
-- the rest is rewritten, then (expected == to) is dropped by this script too. Ended leases'
-- records are dropped on the way.
-- KEYS: 1 the layout written (keys.LAYOUT), 2 the oldest layout in the data (keys.LAYOUT_OLDEST), 3 the registry (keys.FLEET), 4 the migration lock (keys.LAYOUT_LOCK).
-- ARGV: 1 expected: the layout it must find, 2 to: the next one, 3 token: the lock's token.
-- Returns {'ok'} | {'moved', layout} (Redis holds another layout, or the lock is not ours:
--   layout -1) | {'behind', records...} (the live members that do not read `to`: their JSON
--   records).
if redis.call('GET', KEYS[4]) ~= ARGV[3] then return {'moved', -1} end
local layout = tonumber(redis.call('GET', KEYS[1]) or '0')
if layout ~= tonumber(ARGV[2]) and layout ~= tonumber(ARGV[1]) then return {'moved', layout} end
if ARGV[1] == ARGV[2] then  -- the contract ran: no older layout is left in the data
  redis.call('DEL', KEYS[2])
  return {'ok'}
end
if layout ~= tonumber(ARGV[1]) then return {'moved', layout} end
local now = now_ms()  -- (_prelude.lua)
local behind = {'behind'}
local members = redis.call('HGETALL', KEYS[3])
for i = 1, #members, 2 do
  local record = cjson.decode(members[i + 1])
  if record['until'] < now then
    redis.call('HDEL', KEYS[3], members[i])
  elseif record['reads'][2] < tonumber(ARGV[2]) then
    behind[#behind + 1] = members[i + 1]
  end
end
if #behind > 1 then return behind end
if redis.call('EXISTS', KEYS[2]) == 0 then redis.call('SET', KEYS[2], layout) end
redis.call('SET', KEYS[1], ARGV[2])
return {'ok'}
