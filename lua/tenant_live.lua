-- tenant_live.lua: a live read (SSE, long-poll) of a tenant takes a lease, unless the
-- tenant's live connections across the fleet are at its quota (docs/tenants.md). Leases
-- that ended (a gateway killed with connections open stops renewing them) are dropped
-- first, so its connections leave the count within the lease (features/tenant_live.py).
-- KEYS: 1 the tenant's hash (keys.tenant: quota 'q.live_connections'), 2 the defaults
--   (keys.TENANT_DEFAULTS), 3 its live leases (keys.tenant_live: member -> end, ms).
-- ARGV: 1 member: the lease's name ('<process>:<n>'), 2 lease_ms: how long it lasts
--   unless renewed.
-- Returns {'ok', usage (the leases held, this one included)}
--   | {'quota', quota, limit, usage, asked} (refused: no lease taken).
local now = now_ms()
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
local usage = redis.call('ZCARD', KEYS[3])
local limit = redis.call('HGET', KEYS[1], 'q.live_connections') or redis.call('HGET', KEYS[2], 'q.live_connections')
if limit and usage + 1 > tonumber(limit) then
  return {'quota', 'live_connections', limit, fmt(usage), '1'}
end
redis.call('ZADD', KEYS[3], now + tonumber(ARGV[2]), ARGV[1])
redis.call('PEXPIRE', KEYS[3], tonumber(ARGV[2]) * 2)  -- a tenant's leases all ended: the key goes
return {'ok', fmt(usage + 1)}
