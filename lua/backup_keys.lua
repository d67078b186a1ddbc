-- backup_keys.lua: one hash tag's keys (a stream's, or a subscription's) as they are at one
-- moment, for `durable-streams backup` (gateway/backup/take.py). Reads only.
-- KEYS: the keys, all of one hash tag (one Cluster slot).
-- ARGV: 1 reads: a letter per key, in KEYS' order: 'h' its HGETALL too (a stream's meta,
--   producers, links: the manifest's summary), 'z' its ZRANGE with scores (a segment set:
--   the archive files it names), '-' its value alone.
-- Returns {payload, expiry, fields}...: for each key, in KEYS' order, its value as DUMP
--   serializes it (false: gone), its absolute expiry in ms (-1 none, -2 gone; from PTTL and
--   the server's clock: PEXPIRETIME needs Redis 7) and what ARGV 1 asked for, else {}.
local out, now = {}, now_ms()
for i, key in ipairs(KEYS) do
  local read, fields = string.sub(ARGV[1], i, i), {}
  if read == 'h' then fields = redis.call('HGETALL', key)
  elseif read == 'z' then fields = redis.call('ZRANGE', key, 0, -1, 'WITHSCORES') end
  local ttl = redis.call('PTTL', key)
  out[#out + 1] = redis.call('DUMP', key)
  out[#out + 1] = ttl >= 0 and now + ttl or ttl
  out[#out + 1] = fields
end
return out
