-- fleet_join.lua: a gateway's or worker's lease in the fleet registry, taken or renewed,
-- only while the layouts in Redis are ones its build reads (redis_io/fleet.py). One script
-- with layout_switch.lua's: no member joins between `migrate --finish`'s look and its switch.
-- A few ended leases are dropped on the way (members killed outright never leave).
-- KEYS: 1 the layout written (keys.LAYOUT), 2 the oldest layout in the data (keys.LAYOUT_OLDEST), 3 the registry (keys.FLEET), 4 the restore marker (keys.RESTORING).
-- ARGV: 1 member: its id, 2 record: its record (a JSON object; `until` and `writes` set here), 3 reads_from: the oldest layout its build reads, 4 reads_to: the newest, 5 writes: the layout it writes now (0: none yet), 6 lease_ms: the lease.
-- Returns {'ok', layout, oldest} | {'refused', layout, oldest} (not a layout its build
--   reads: the member is out of the registry; layout 0: none stamped) | {'restoring', layout,
--   oldest} (`durable-streams restore` is writing into this Redis).
local layout = tonumber(redis.call('GET', KEYS[1]) or '0')
local oldest = tonumber(redis.call('GET', KEYS[2]) or '0')
if oldest == 0 then oldest = layout end
if redis.call('EXISTS', KEYS[4]) == 1 then
  redis.call('HDEL', KEYS[3], ARGV[1])
  return {'restoring', layout, oldest}
end
if layout == 0 or oldest < tonumber(ARGV[3]) or layout > tonumber(ARGV[4]) then
  redis.call('HDEL', KEYS[3], ARGV[1])
  return {'refused', layout, oldest}
end
local now = now_ms()  -- (_prelude.lua)
local some = redis.call('HRANDFIELD', KEYS[3], 3, 'WITHVALUES')
for i = 1, #some, 2 do
  if cjson.decode(some[i + 1])['until'] < now then redis.call('HDEL', KEYS[3], some[i]) end
end
local record = cjson.decode(ARGV[2])
record['until'] = now + tonumber(ARGV[6])
-- What it writes from this reply on: never above what Redis holds (a failover that lost the
-- switch sends it back), 0 (a first join) what Redis holds.
local writes = tonumber(ARGV[5])
if writes == 0 or writes > layout then writes = layout end
record['writes'] = writes
redis.call('HSET', KEYS[3], ARGV[1], cjson.encode(record))
return {'ok', layout, oldest}
