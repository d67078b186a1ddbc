-- backup_keys.lua: one hash tag's keys (a stream's, or a subscription group's) as they are at
-- one moment, for `durable-streams backup` (gateway/backup/take.py). Reads only.
-- KEYS: the keys, all of one hash tag (one Cluster slot).
-- ARGV: none.
-- Returns {payload, expiry, fields}...: for each key, in KEYS' order, its value as DUMP
--   serializes it (false: gone), its absolute expiry in ms (PEXPIRETIME: -1 none, -2 gone)
--   and a hash's HGETALL (for the manifest's summary of a stream), else {}.
local out = {}
for _, key in ipairs(KEYS) do
  local fields = {}
  if redis.call('TYPE', key).ok == 'hash' then fields = redis.call('HGETALL', key) end
  out[#out + 1] = redis.call('DUMP', key)
  out[#out + 1] = redis.call('PEXPIRETIME', key)
  out[#out + 1] = fields
end
return out
