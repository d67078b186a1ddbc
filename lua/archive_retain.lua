-- archive_retain.lua: retention. Drops the oldest segments whose newest
-- entry was appended before the cutoff; reads below the new floor get 410. What they
-- held goes back to the stream's tenant (_tenants.lua: tenant_shrink).
-- KEYS: the stream's five (see _prelude.lua), KEYS[6] the lease,
--   KEYS[7] the segment set of incarnation ARGV[2] (keys.segments), KEYS[8..12] the
--   tenant's (keys.tenant_keys) when ARGV[4] names one.
-- ARGV: 1 token: lease token, 2 incarnation: the stream's incarnation,
--   3 cutoff_ms: the cutoff (ms), 4 tenant: the stream's tenant as the worker read it ('' none),
--   5.. sizes: "<start> <bytes>" of each segment whose bytes are not its range (a
--   compacted stream's: the messages dropped before or after it was archived are in it).
-- Returns {'ok', dropped (the dropped members: now garbage, score -2, for the worker to
--   delete)} | {'tenant', name} (the stream's tenant is another than ARGV[4]: nothing
--   changed) | {'lost'} (the lease is not this worker's).
if not holds_lease() then return {'lost'} end
local inc, cutoff = ARGV[2], tonumber(ARGV[3])
local m = incarnation(inc)
if not m then return {'ok', {}} end
if tenant_other(m, ARGV[4]) then return {'tenant', m.tn or ''} end
tenant_bind(8, ARGV[4], now_ms())
local sizes = {}
for i = 5, #ARGV do
  local start, bytes = string.match(ARGV[i], '^(%d+) (%d+)$')
  sizes[start] = tonumber(bytes)
end
local segs = SEGS
local dropped, freed = {}, 0
for _, member in ipairs(redis.call('ZRANGEBYSCORE', segs, 0, '+inf')) do
  local from, to, last = string.match(member, '^(%d+) (%d+) %d+ (%d+)')
  if tonumber(last) >= cutoff then break end
  redis.call('ZADD', segs, -2, member)
  -- never below a snapshot's floor (snapshot_set.lua): the floor only rises
  if tonumber(to) > tonumber(redis.call('HGET', META, 'floor') or '0') then
    redis.call('HSET', META, 'floor', to)
  end
  dropped[#dropped + 1] = member
  freed = freed + (sizes[from] or (tonumber(to) - tonumber(from)))
end
tenant_shrink(freed)
tenant_saved()
return {'ok', dropped}
