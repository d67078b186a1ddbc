-- archive_commit.lua: the staged file is durable: record it as a segment,
-- move the log's start to its end, and trim the Redis Stream below that.
-- ARGV: 1 incarnation, 2 the pending member (as staged).
-- Returns {'ok', replaced member or ''} (a replaced file is now garbage, score
--   -2, for the worker to delete) | {'missing'} (the stream or its staging is
--   gone: the caller deletes the file it wrote).
local inc, member = ARGV[1], ARGV[2]
local m = load_meta()
if resolve(m, now_ms()) == 'missing' or m.inc ~= inc then return {'missing'} end
local segs = segs_key(inc)
if redis.call('ZSCORE', segs, member) ~= '-1' then return {'missing'} end
local from, to = string.match(member, '^(%d+) (%d+)')
local replaced = redis.call('ZRANGEBYSCORE', segs, from, from)[1]
if replaced then redis.call('ZADD', segs, -2, replaced) end
redis.call('ZADD', segs, from, member)
redis.call('HSET', META, 'arch', to)
redis.call('XTRIM', LOG, 'MINID', eid(tonumber(to)))
return {'ok', replaced or ''}
