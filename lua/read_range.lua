-- read_range.lua: entries of one stream's own log, without state checks.
-- Used for the inherited part of a fork (data below a fork point never
-- changes and is kept while a pinning fork exists, whatever the source's
-- state) and to continue a read past an archived segment.
-- ARGV: 1 start: from position, 2 end: end position (exclusive), 3 budget: byte budget,
--   4 whole: '1' for JSON messages (never cut), 5 max_entries: most entries to return,
--   6 inline_bytes: most bytes to return inline, 7 incarnation: for a fork's inherited
--   range, the incarnation of the ancestor it was made from (its entry in the fork's
--   chain_uids, meta 'uid'), or '?' for a chain written before incarnations were (any,
--   as long as the stream exists); '' for the stream's own log (no check).
-- Returns {entries[, flag, incarnation]}: see read_from; or no entries and flag 'lost':
--   the ancestor is gone, or another stream now holds its path (a weak fork's source
--   was deleted: what the fork inherited from it is gone).
local m, want = load_meta(), ARGV[7] or ''
if want ~= '' and (not m or (want ~= '?' and m.uid ~= want)) then return {{}, 'lost'} end
return read_from(m or {}, tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4] == '1',
  tonumber(ARGV[5]), tonumber(ARGV[6]))
