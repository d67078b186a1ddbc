-- stream_info.lua: what the listing shows of one stream it found in its index, and
-- the index mended: a stream gone (expired, deleted outside delete.lua) leaves it.
-- Reads only otherwise: no sliding TTL is refreshed (listing is not reading).
-- KEYS: the five stream keys, 6 its slot's stream index (keys.stream_index).
-- ARGV: 1 producers: how many idempotent producers to return at most (0: none).
-- Returns {'ok', meta, last_ms (time of the last entry in the Redis log, ms, or ''),
--   producer_count (how many producers it has), producers (flat {id, 'epoch:seq', ...}:
--   HGETALL when they fit, else one HSCAN page)} | {'missing'} | {'gone'} (both: taken
--   out of the index).
local INDEX = KEYS[6]
local most = tonumber(ARGV[1] or '0')
local m, status = open_stream(now_ms())
if status ~= 'ok' then
  redis.call('ZREM', INDEX, stream_sid())
  return {status}
end
local last = redis.call('XREVRANGE', LOG, '+', '-', 'COUNT', 1)[1]
local at = ''
if last then
  for i = 1, #last[2], 2 do
    if last[2][i] == 't' then at = last[2][i + 1] end
  end
end
local count, producers = 0, {}
if most > 0 then
  count = redis.call('HLEN', PROD)
  if count <= most then
    producers = redis.call('HGETALL', PROD)
  else
    producers = redis.call('HSCAN', PROD, 0, 'COUNT', most)[2]
  end
end
return {'ok', flat(m), at, count, producers}
