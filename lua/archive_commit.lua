-- archive_commit.lua: the staged file is durable: record it as a segment,
-- move the log's start to its end, and trim the Redis Stream below that.
-- KEYS: the stream's five (see _prelude.lua), KEYS[6] the lease,
--   KEYS[7] the segment set of incarnation ARGV[2] (keys.segments).
-- ARGV: 1 token: lease token, 2 incarnation: the stream's incarnation, 3 member: the
--   pending member (as staged).
-- Returns {'ok', replaced (the replaced member, or '')} (a replaced file is now garbage,
--   score -2, for the worker to delete) | {'committed'} (already recorded: a retried
--   call whose first reply was lost; the file must stay) | {'missing'} (the
--   stream or its staging is gone) | {'lost'} (the lease is not this
--   worker's: another may be redoing the same file; nothing changed).
if not holds_lease() then return {'lost'} end
local inc, member = ARGV[2], ARGV[3]
if not incarnation(inc) then return {'missing'} end
local segs = SEGS
local score = redis.call('ZSCORE', segs, member)
if score and tonumber(score) >= 0 then return {'committed'} end
if score ~= '-1' then return {'missing'} end
local from, to = string.match(member, '^(%d+) (%d+)')
local replaced = redis.call('ZRANGEBYSCORE', segs, from, from)[1]
if replaced then redis.call('ZADD', segs, -2, replaced) end
redis.call('ZADD', segs, from, member)
redis.call('HSET', META, 'arch', to)
redis.call('XTRIM', LOG, 'MINID', eid(tonumber(to)))
return {'ok', replaced or ''}
