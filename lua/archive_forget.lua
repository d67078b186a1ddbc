-- archive_forget.lua: files the worker has deleted leave the segment set
-- (garbage, a failed staging, or every file of a dead incarnation; an empty
-- set is gone with them).
-- KEYS: the stream's five (see _prelude.lua), KEYS[6] the lease,
--   KEYS[7] the segment set of incarnation ARGV[2] (keys.segments).
-- ARGV: 1 token: lease token, 2 incarnation: the segment set's incarnation,
--   3.. members: the members to remove.
-- Returns {'ok', number removed} | {'lost'} (the lease is not this worker's).
if not holds_lease() then return {'lost'} end
return {'ok', redis.call('ZREM', SEGS, unpack(ARGV, 3))}
