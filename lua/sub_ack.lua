-- sub_ack.lua: a wake's holder acks, heartbeats, finishes or releases it (spec 7.1
-- callback, 7.2 ack and release), fenced by generation and wake id (spec 7.3).
-- KEYS: the subscription's (_subs.lua).
-- ARGV: 1 mode: 'callback' (webhook) | 'ack' | 'release' (pull-wake),
--   2 generation: generation, 3 wake_id: wake id, 4 done: '1' done, 5 new_wake_id: a
--   fresh wake id, 6.. acks: a group per ack (ARGV acks).
-- ARGV acks: 1 path: the stream's path, 2 offset: the offset acked, 3 tail: the
--   stream's tail read just before ('' unknown).
-- Acks are checked before any applies: an unlinked stream, an offset below the
-- acked one or beyond the tail fails the request whole ('invalid_offset').
-- Without done (and not a release) the lease is extended (heartbeat).
-- Returns {'missing'} | {'wrong_type'} | {'fenced'} | {'invalid_offset', why}
--   | {'ok', new_wake ('1' if a new wake began, else '0')}.
if redis.call('EXISTS', S) == 0 then return {'missing'} end
local mode = ARGV[1]
if (mode == 'callback') ~= (sget('type') == 'webhook') then return {'wrong_type'} end
local now = now_ms()
expire_lease(now, ARGV[5])
local wake = sget('wake')
if wake == '' or wake ~= ARGV[3] or sget('gen') ~= ARGV[2] then return {'fenced'} end
if mode ~= 'callback' and sget('holder') == '' then return {'fenced'} end
for i = 6, #ARGV, 3 do
  local value = redis.call('HGET', L, ARGV[i])
  if not value then return {'invalid_offset', 'ack names a stream the subscription does not link'} end
  local _, acked = link_parts(value)
  if bytes_less(ARGV[i + 1], acked) then return {'invalid_offset', 'ack offset regresses the acked offset'} end
  if ARGV[i + 2] ~= '' and bytes_less(ARGV[i + 2], ARGV[i + 1]) then
    return {'invalid_offset', 'ack offset is beyond the stream tail'}
  end
end
for i = 6, #ARGV, 3 do set_acked(ARGV[i], ARGV[i + 1]) end
if mode == 'callback' then  -- the receiver has the wake: no retry is due
  redis.call('HSET', S, 'status', 'active', 'attempts', '0', 'next_at', '0')
end
if mode == 'release' or ARGV[4] == '1' then
  return {'ok', end_wake(now, ARGV[5]) and '1' or '0'}
end
local lease_until = now + tonumber(sget('ttl'))
redis.call('HSET', S, 'lease_until', lease_until)
if sget('delivered') == '1' or sget('holder') ~= '' then schedule(lease_until) end
return {'ok', '0'}
