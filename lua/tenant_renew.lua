-- tenant_renew.lua: a gateway renews the live leases it holds for one tenant
-- (features/tenant_live.py), on Redis' clock as tenant_live.lua takes them, and adds back
-- any that lapsed meanwhile (a Redis outage longer than a lease): its connections count
-- again. A lease given back while a renewal was on its way may come back for one lease
-- at most (counted once too many, never too few).
-- KEYS: 1 the tenant's live leases (keys.tenant_live).
-- ARGV: 1 lease_ms: how long they last from now, 2.. members: the leases.
-- Returns {renewed (how many)}.
local ends = now_ms() + tonumber(ARGV[1])
for k = 2, #ARGV do redis.call('ZADD', KEYS[1], ends, ARGV[k]) end
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[1]) * 2)
return {#ARGV - 1}
