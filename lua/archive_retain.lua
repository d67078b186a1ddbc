-- archive_retain.lua: retention. Drops the oldest segments whose newest
-- entry was appended before the cutoff; reads below the new floor get 410.
-- KEYS: the stream's five (see _prelude.lua), KEYS[6] the lease,
--   KEYS[7] the segment set of incarnation ARGV[2] (keys.segments).
-- ARGV: 1 token: lease token, 2 incarnation: the stream's incarnation,
--   3 cutoff_ms: the cutoff (ms).
-- Returns {'ok', dropped (the dropped members: now garbage, score -2, for the worker to
--   delete)} | {'lost'} (the lease is not this worker's).
if not holds_lease() then return {'lost'} end
local inc, cutoff = ARGV[2], tonumber(ARGV[3])
if not incarnation(inc) then return {'ok', {}} end
local segs = SEGS
local dropped = {}
for _, member in ipairs(redis.call('ZRANGEBYSCORE', segs, 0, '+inf')) do
  local to, last = string.match(member, '^%d+ (%d+) %d+ (%d+)')
  if tonumber(last) >= cutoff then break end
  redis.call('ZADD', segs, -2, member)
  -- never below a snapshot's floor (snapshot_set.lua): the floor only rises
  if tonumber(to) > tonumber(redis.call('HGET', META, 'floor') or '0') then
    redis.call('HSET', META, 'floor', to)
  end
  dropped[#dropped + 1] = member
end
return {'ok', dropped}
