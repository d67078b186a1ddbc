-- read_range.lua: entries of one stream's own log, without state checks.
-- Used for the inherited part of a fork (data below a fork point never
-- changes and is kept while the fork exists, whatever the source's state)
-- and to continue a read past an archived segment.
-- ARGV: 1 from position, 2 end position (exclusive), 3 byte budget,
--   4 '1' for JSON messages (never cut), 5 most entries to return, 6 most
--   bytes to return inline.
-- Returns {entries, segment[, 'bulk']}: see read_from.
local m = load_meta() or {}
return read_from(m, tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4] == '1', tonumber(ARGV[5]),
  tonumber(ARGV[6]))
