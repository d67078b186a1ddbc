-- archive_replace.lua: State compaction of archived segments (workers/compacted_segments.py):
-- one file of the kept rows of consecutive segments replaces them, the same range.
-- 'stage', before the new file is written: it is recorded as garbage (score -2), so a
-- worker that dies before the commit leaves a file the next lease holder deletes.
-- 'commit', once it is written: the new member takes the range, the old ones are garbage.
-- KEYS: the stream's five (see _prelude.lua), KEYS[6] the lease, KEYS[7] the segment set,
--   KEYS[8..12] the tenant's (keys.tenant_keys) when ARGV[9] names one.
-- ARGV: 1 token: lease token, 2 incarnation: the stream's, 3 phase: 'stage' | 'commit',
--   4 new: the replacing member, 5 upto: the 'cto' the run read, 6 barrier: the 'fkmax' it
--   read, 7 dropped_bytes: the bytes of the messages the new file lacks, 8 dropped: how many
--   (counted in the stream's compaction figures, and its ETag generation raised; the bytes
--   go back to its tenant: _tenants.lua), 9 tenant: the stream's tenant as the worker read
--   it ('' none), 10.. old: the committed members replaced, in order.
-- Returns {'ok'} | {'moved'} (a segment, the fold point or a fork point changed: the run
--   plans again) | {'missing'} | {'tenant', name} (the stream's tenant is another than
--   ARGV[9]: nothing changed) | {'lost'} (the lease is not this worker's: nothing changed).
if not holds_lease() then return {'lost'} end
local m = incarnation(ARGV[2])
if not m then return {'missing'} end
if (m.cto or '0') ~= ARGV[5] or (m.fkmax or '0') ~= ARGV[6] then return {'moved'} end
if tenant_other(m, ARGV[9]) then return {'tenant', m.tn or ''} end
for i = 10, #ARGV do
  local score = redis.call('ZSCORE', SEGS, ARGV[i])
  if not score or tonumber(score) < 0 then return {'moved'} end
end
local new = ARGV[4]
if ARGV[3] == 'stage' then
  redis.call('ZADD', SEGS, -2, new)
  return {'ok'}
end
if redis.call('ZSCORE', SEGS, new) ~= '-2' then return {'moved'} end
for i = 10, #ARGV do redis.call('ZADD', SEGS, -2, ARGV[i]) end
redis.call('ZADD', SEGS, string.match(new, '^(%d+)'), new)
redis.call('HSET', META, 'cgen', fmt(tonumber(m.cgen or '0') + 1),
  'cdrop', fmt(tonumber(m.cdrop or '0') + tonumber(ARGV[7])),
  'cdropn', fmt(tonumber(m.cdropn or '0') + tonumber(ARGV[8])))
tenant_bind(8, ARGV[9], now_ms())
tenant_shrink(tonumber(ARGV[7]))
tenant_saved()
return {'ok'}
