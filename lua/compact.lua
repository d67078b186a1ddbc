-- compact.lua: one step of a compaction run on a compacted stream (docs/compaction.md;
-- workers/compactor.py folds, this applies): deletes the entries of dropped messages
-- (one message an entry in such a stream: add_entries), fenced by the archive lease.
-- A run's steps apply its drops in the order the fold gave them (any prefix of them
-- leaves a stream every reader materializes alike); its last step moves 'cto'.
-- KEYS: the stream's five (see _prelude.lua), KEYS[6] the lease, KEYS[7] its fold record
--   (keys.fold: a hash, position -> ms when that kept delete was folded, and 'created':
--   the incarnation it belongs to; it outlives a deleted stream only until it expires),
--   KEYS[8..12] the tenant's (keys.tenant_keys) when ARGV[12] names one.
-- ARGV: 1 token: lease token, 2 created: the incarnation the run read, 3 upto: the 'cto'
--   it read, 4 barrier: the 'fkmax' it read (a fork since: this run stops), 5 to: where the
--   run folds up to, 6 last: '1' for its last step, 7 dropped_bytes: the bytes of the
--   messages this step drops, 8 tombstones: deletes folded by this run, a share of them a
--   step, "<position>:<ms> ..." ('' none), 9 keep_ms: how long the
--   fold record lives, 10 forget: positions of archived deletes dropped (the run replaced
--   their segments), "<position> ..." ('' none), 11 deep: on a deep run's last step (it
--   folded the archive: workers/compacted_segments.py) "<to> <kept bytes> <now ms> <0|1>":
--   where it folded to, the bytes it kept, when it ran and whether it kept a delete past its
--   retention (the newest folded, or kept for a grouped entry), for pacing the next ('' none),
--   12 tenant: the stream's tenant as the worker read it ('' none; the bytes dropped go back
--   to it: _tenants.lua), 13.. positions: the dropped messages' positions.
-- Returns {'ok', deleted (entries deleted)} | {'moved'} (the stream changed under the run:
--   plan again) | {'missing'} | {'tenant', name} (the stream's tenant is another than
--   ARGV[12]: nothing changed) | {'lost'} (the lease is not this worker's: nothing changed).
if not holds_lease() then return {'lost'} end
local FOLD = KEYS[7]
local m, status = open_stream(now_ms())
if status ~= 'ok' or m.created ~= ARGV[2] then return {'missing'} end
local to = tonumber(ARGV[5])
-- never a stream without the setting; never past a fork point newer than the run's
if not m.cmp or (m.cto or '0') ~= ARGV[3] or (m.fkmax or '0') ~= ARGV[4] or to > tonumber(m.tail) then
  return {'moved'}
end
local low = math.max(tonumber(m.arch or m.base), tonumber(m.fkmax or '0'))
for i = 13, #ARGV do
  local pos = tonumber(ARGV[i])
  if pos < low or pos >= to then return {'moved'} end
end
if tenant_other(m, ARGV[12]) then return {'tenant', m.tn or ''} end
tenant_bind(8, ARGV[12], now_ms())
if redis.call('HGET', FOLD, 'created') ~= m.created then
  redis.call('DEL', FOLD)
  redis.call('HSET', FOLD, 'created', m.created)
end
local deleted = 0
for i = 13, #ARGV do
  deleted = deleted + redis.call('XDEL', LOG, eid(tonumber(ARGV[i])))
end
if #ARGV >= 13 then redis.call('HDEL', FOLD, unpack(ARGV, 13)) end
for pos in string.gmatch(ARGV[10], '%d+') do redis.call('HDEL', FOLD, pos) end
local fields = {'cnext', ARGV[5]}
if deleted > 0 then
  m.cgen = fmt(tonumber(m.cgen or '0') + 1)
  fields = {'cnext', ARGV[5], 'cgen', m.cgen,
    'cdrop', fmt(tonumber(m.cdrop or '0') + tonumber(ARGV[7])),
    'cdropn', fmt(tonumber(m.cdropn or '0') + deleted)}
  tenant_shrink(tonumber(ARGV[7]))
end
for pos, ms in string.gmatch(ARGV[8], '(%d+):(%d+)') do redis.call('HSET', FOLD, pos, ms) end
if ARGV[6] == '1' then
  redis.call('HDEL', META, 'cnext')
  fields[1], fields[2] = 'cto', ARGV[5]
  fields[#fields + 1] = 'cat'
  fields[#fields + 1] = fmt(now_ms())
  local cac, cak, cdt, ckw = string.match(ARGV[11], '^(%d+) (%d+) (%d+) (%d)$')
  if cac then
    for _, v in ipairs({'cac', cac, 'cak', cak, 'cdt', cdt, 'ckw', ckw}) do fields[#fields + 1] = v end
  end
end
redis.call('HSET', META, unpack(fields))
redis.call('PEXPIRE', FOLD, ARGV[9])
tenant_saved()
return {'ok', deleted}
