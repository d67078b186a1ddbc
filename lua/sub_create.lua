-- sub_create.lua: PUT __ds/subscriptions/:id. Creates the subscription, or
-- re-confirms one created with the same configuration (its hash).
-- KEYS: the subscription's (_subs.lua).
-- ARGV: 1 sub_id: id, 2 config: configuration (JSON), 3 config_hash: its hash,
--   4 created_at: created_at (ISO), 5 kind: type, 6 lease_ms: lease ms, 7 pattern: '1'
--   if it has a pattern (existing streams are linked by a worker: 'backfill'),
--   8 base_url: the stream root URL it was created through (callback URLs are built
--   on it), 9.. streams: a group per explicit stream (ARGV streams).
-- ARGV streams: 1 path: the stream's path, 2 tail: its acked offset (its tail now),
--   3 incarnation: its incarnation.
-- Returns {'created'} | {'same'} | {'conflict'}.
local id = ARGV[1]
local hash = sget('hash')
if hash then return {hash == ARGV[3] and 'same' or 'conflict'} end
local now = now_ms()
redis.call('HSET', S, 'id', id, 'cfg', ARGV[2], 'hash', ARGV[3], 'created_at', ARGV[4], 'type', ARGV[5],
  'ttl', ARGV[6], 'gen', '0', 'wake', '', 'holder', '', 'lease_until', '0', 'snap', '', 'status', 'active',
  'attempts', '0', 'next_at', '0', 'delivered', '0', 'dtoken', '', 'emit', '0', 'backfill', ARGV[7],
  'base', ARGV[8], 'created_ms', now)
for i = 9, #ARGV, 3 do redis.call('HSET', L, ARGV[i], link_value('e', ARGV[i + 1], ARGV[i + 2])) end
if ARGV[7] == '1' then schedule(now) end
return {'created'}
