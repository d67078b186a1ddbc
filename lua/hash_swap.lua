-- hash_swap.lua: sets hash fields that still hold the value the caller read, as one
-- step (`durable-streams migrate`'s step to layout v3 rewrites offsets kept in
-- subscription hashes: a delivery worker that changed a field meanwhile wins).
-- KEYS: 1 the hash.
-- ARGV: 1.. swaps: a group per field (ARGV swaps).
-- ARGV swaps: 1 field: the field, 2 read: the value read, 3 new: the new value.
-- Returns how many fields were set.
local set = 0
for i = 1, #ARGV, 3 do
  if redis.call('HGET', KEYS[1], ARGV[i]) == ARGV[i + 1] then
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 2])
    set = set + 1
  end
end
return set
