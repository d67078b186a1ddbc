-- archive_retain.lua: retention. Drops the oldest segments whose newest
-- entry was appended before the cutoff; reads below the new floor get 410.
-- ARGV: 1 incarnation, 2 cutoff (ms).
-- Returns the dropped members, now garbage (score -2) for the worker to delete.
local inc, cutoff = ARGV[1], tonumber(ARGV[2])
local m = load_meta()
if resolve(m, now_ms()) == 'missing' or m.inc ~= inc then return {} end
local segs = segs_key(inc)
local dropped = {}
for _, member in ipairs(redis.call('ZRANGEBYSCORE', segs, 0, '+inf')) do
  local to, last = string.match(member, '^%d+ (%d+) %d+ (%d+)')
  if tonumber(last) >= cutoff then break end
  redis.call('ZADD', segs, -2, member)
  redis.call('HSET', META, 'floor', to)
  dropped[#dropped + 1] = member
end
return dropped
