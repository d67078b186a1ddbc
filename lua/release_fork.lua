-- release_fork.lua: run on a source when one of its forks is gone (deleted,
-- or its creation failed). The last release of a deleted or expired source
-- removes it; the caller then releases that source's own source.
-- ARGV: 1 fork: the fork's id, 2 source_uid: the source incarnation (meta 'uid') the
--   fork was made from ('' for a fork made before incarnations were recorded: this one).
--   Another incarnation at the path (the fork's source was removed, then a new
--   stream created there: the fork was weak) is not the fork's: nothing is done.
--   A weak fork is not in FORKS: its release removes nothing, and collects only
--   a source that is already dead (expired, not yet resolved).
-- Returns {'collected', source (the source's own source id, or ''), source_uid (the
--   incarnation of it this source was made from, or '')} | {'kept'}.
local now = now_ms()
local m = load_meta()
if m and ARGV[2] ~= '' and m.uid ~= ARGV[2] then return {'kept'} end
redis.call('SREM', FORKS, ARGV[1])
if not m or redis.call('SCARD', FORKS) > 0 then return {'kept'} end
if m.deleted or (m.exp and now >= tonumber(m.exp)) then
  drop()
  return {'collected', m.src or '', m.src_uid or ''}
end
apply_expiry(m)
return {'kept'}
