-- index_set.lua: the pattern index (keys.SUBS_INDEX: subscription id -> pattern) and
-- its version (raised on every change: workers and gateways reload it then).
-- KEYS: 1 the index, 2 its version.
-- ARGV: 1 sub_id: subscription id, 2 pattern: its pattern ('' to remove).
-- Returns the version.
local index, version = KEYS[1], KEYS[2]
if ARGV[2] == '' then
  if redis.call('HDEL', index, ARGV[1]) == 0 then return tonumber(redis.call('GET', version) or '0') end
else
  if redis.call('HGET', index, ARGV[1]) == ARGV[2] then return tonumber(redis.call('GET', version) or '0') end
  redis.call('HSET', index, ARGV[1], ARGV[2])
end
return redis.call('INCR', version)
