-- archive_replace.lua: State compaction of an archived segment (workers/compacted_segments.py):
-- a file holding the segment's kept rows replaces the segment's file, the same range.
-- 'stage', before the new file is written: it is recorded as garbage (score -2), so a
-- worker that dies before the commit leaves a file the next lease holder deletes.
-- 'commit', once it is written: the new member takes the range, the old one is garbage.
-- KEYS: the stream's five (see _prelude.lua), KEYS[6] the lease, KEYS[7] the segment set.
-- ARGV: 1 token: lease token, 2 incarnation, 3 phase: 'stage' | 'commit', 4 old: the
--   committed member replaced, 5 new: the replacing member, 6 upto: the 'cto' the run read,
--   7 barrier: the 'fkmax' it read, 8 dropped_bytes, 9 dropped: the messages the new file
--   lacks (counted in the stream's compaction figures, and its ETag generation raised).
-- Returns {'ok'} | {'moved'} (the segment, the fold point or a fork point changed: the run
--   plans again) | {'missing'} | {'lost'} (the lease is not this worker's: nothing changed).
if not holds_lease() then return {'lost'} end
local m = incarnation(ARGV[2])
if not m then return {'missing'} end
local old, new = ARGV[4], ARGV[5]
local score = redis.call('ZSCORE', SEGS, old)
if not score or tonumber(score) < 0 or (m.cto or '0') ~= ARGV[6] or (m.fkmax or '0') ~= ARGV[7] then
  return {'moved'}
end
if ARGV[3] == 'stage' then
  redis.call('ZADD', SEGS, -2, new)
  return {'ok'}
end
if redis.call('ZSCORE', SEGS, new) ~= '-2' then return {'moved'} end
redis.call('ZADD', SEGS, -2, old)
redis.call('ZADD', SEGS, score, new)
redis.call('HSET', META, 'cgen', fmt(tonumber(m.cgen or '0') + 1),
  'cdrop', fmt(tonumber(m.cdrop or '0') + tonumber(ARGV[8])),
  'cdropn', fmt(tonumber(m.cdropn or '0') + tonumber(ARGV[9])))
return {'ok'}
