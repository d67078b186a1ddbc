-- read.lua: one consistent look at a stream: its metadata and own entries.
-- ARGV: 1 start: start position (-1: metadata only), 2 budget: byte budget,
--   3 refresh: '1' when this read refreshes a sliding TTL (GET does, HEAD does not),
--   4 inline_bytes: most bytes to return inline (more: the 'bulk' answer of read_from),
--   5 max_entries: most entries to return (bounds the script's work).
-- Returns {'ok', meta, entries[, flag, incarnation]} with entries = {pos, data, ...}
--   from max(start, base); or none, flag 'archived' and the incarnation whose segment
--   set holds that position when it is below the log; or none and flag 'bulk' (see
--   read_from) | {'missing'} | {'gone'}.
local start, budget, inline = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[4])
local now = now_ms()
return with_stream(now, function(m)
  if ARGV[3] == '1' then touch(m, now, math.min(1000, tonumber(m.ttl or 0) * 50)) end
  local found = {{}}
  if start >= 0 then
    local from = math.max(start, tonumber(m.base))
    if from < tonumber(m.tail) then
      -- up to the tail: a large append under way lies beyond it (PEND_MS in _prelude.lua)
      found = read_from(m, from, tonumber(m.tail), budget, m.ctn == 'application/json', tonumber(ARGV[5]), inline)
    end
  end
  return {'ok', flat(m), found[1], found[2], found[3]}
end)
