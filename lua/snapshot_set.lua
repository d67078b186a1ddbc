-- snapshot_set.lua: publishes an application snapshot (Ursula's PUT .../snapshot/{offset})
-- whose blob the gateway has written to the archive store already. Data below it is no
-- longer the application's to replay: the stream's floor moves up to it (reads below
-- answer 410; -1 starts there), as retention's does.
-- KEYS: the five stream keys (see _prelude.lua).
-- ARGV: 1 created: the incarnation the blob was written for (meta 'created'),
--   2 position: the snapshot's position, 3 content_type: its content type, 4 file: its
--   blob's file (in the archive store), 5 tenant: the publishing request's ('' none): another
--   tenant's stream gets no snapshot (docs/tenants.md).
-- Returns {'ok', replaced (the replaced snapshot's file, or ''), tail} | {'missing'} |
--   {'gone'} | {'stale', position (the newer, or same, snapshot's)} | {'range', tail}
--   (beyond the tail) | {'trimmed', floor} (below what is retained) | {'foreign'}.
local pos = tonumber(ARGV[2])
return with_stream(now_ms(), function(m)
  if m.created ~= ARGV[1] then return {'missing'} end  -- deleted and made again meanwhile
  if (ARGV[5] or '') ~= '' and m.tn and m.tn ~= ARGV[5] then return {'foreign'} end
  if pos > tonumber(m.tail) then return {'range', m.tail} end
  if m.snap and pos <= tonumber(m.snap) then return {'stale', m.snap} end
  if pos < tonumber(m.floor or '0') then return {'trimmed', m.floor} end
  local old = m.snap_file or ''
  redis.call('HSET', META, 'snap', ARGV[2], 'snap_ct', ARGV[3], 'snap_file', ARGV[4], 'floor', ARGV[2])
  return {'ok', old, m.tail}
end)
