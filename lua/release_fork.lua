-- release_fork.lua: run on a source when one of its forks is gone (deleted,
-- or its creation failed). The last release of a deleted or expired source
-- removes it; the caller then releases that source's own source.
-- ARGV: 1 the fork's id.
-- Returns {'collected', source's own source id or ''} | {'kept'}.
local now = now_ms()
redis.call('SREM', FORKS, ARGV[1])
local m = load_meta()
if not m or redis.call('SCARD', FORKS) > 0 then return {'kept'} end
if m.deleted or (m.exp and now >= tonumber(m.exp)) then
  drop()
  return {'collected', m.src or ''}
end
apply_expiry(m)
return {'kept'}
