-- tenant_sweep.lua: gives back what a tenant's streams that ended without a script of
-- theirs held: a stream Redis expired (its keys' deadline) or a soft-deleted one's
-- (workers/tenant_sweep.py walks the tenant's streams with HSCAN, a page a call).
-- KEYS: the tenant's five keys (_tenants.lua), then the meta of each stream checked.
-- ARGV: 1 tenant: its name, 2.. streams: the id of each stream checked (in KEYS order,
--   from KEYS[6]).
-- A stream is given back when its meta is gone (dropped: deleted, expired, or a
-- soft-deleted one whose last fork let it go) or names another tenant (made anew). A
-- soft-deleted stream stays counted while its forks keep its data. The tenant's stored
-- bytes are metered up to now (tenant_save).
-- Returns {released (how many were given back)}.
local now = now_ms()
tenant_bind(1, ARGV[1], now)
local released = 0
TN.dirty = true
for k = 2, #ARGV do
  local meta = KEYS[k + 4]
  local tn = redis.call('HGET', meta, 'tn')
  if tn ~= ARGV[1] and redis.call('HEXISTS', T_OWNED, ARGV[k]) == 1 then
    tenant_release(ARGV[k])
    released = released + 1
  end
end
tenant_saved()
return {released}
