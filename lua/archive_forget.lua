-- archive_forget.lua: files the worker has deleted leave the segment set
-- (garbage, a failed staging, or every file of a dead incarnation; an empty
-- set is gone with them).
-- ARGV: 1 incarnation, 2.. members.
-- Returns the number of members removed.
return redis.call('ZREM', segs_key(ARGV[1]), unpack(ARGV, 2))
