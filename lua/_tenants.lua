-- _tenants.lua: tenants' quotas and usage (docs/tenants.md), put after the prelude of
-- the scripts that store or free data for a tenant (gateway/redis_io/lua.py). A call made
-- for a tenant (its name an ARGV, '' none: nothing here acts) passes its five keys just
-- before the outbox (keys.tenant_keys), bound by tenant_bind:
--   its hash: quota overrides 'q.<quota>' and usage 'u.streams', 'u.stored_bytes',
--     'u.written_bytes' (in the period that starts at 'u.period_start', Unix seconds),
--     'u.stored_at' (ms: the stored bytes are metered as byte-seconds up to then);
--   the defaults' hash ('q.<quota>'); the tenants' index (a set of names);
--   its streams (a hash: stream id -> the bytes stored for the tenant in it);
--   the meter of the gateway's hour (a hash: '<tenant> <counter>' -> count, what
--     workers/meter.py moves to Parquet).
-- The check and the write are one script, so writers on any number of gateways never pass
-- a quota, not by one byte. A stream belongs to the tenant that made it (meta 'tn'); one
-- made while tenants were off is taken by the first tenant that writes it (its bytes from
-- then on count). Another tenant's stream is not written: 'foreign'.
local TN = nil  -- the bound tenant (a table), nil for a call made for none
local T_KEY, T_DEFAULTS, T_INDEX, T_OWNED, T_METER  -- its keys, once bound

local function tenant_bind(k, name, now)
  if not name or name == '' or name == '-' then return end
  T_KEY, T_DEFAULTS, T_INDEX, T_OWNED, T_METER = KEYS[k], KEYS[k + 1], KEYS[k + 2], KEYS[k + 3], KEYS[k + 4]
  local t = {name = name, appends = 0, bytes_in = 0, created = 0, deleted = 0,
    grown = {}}  -- stream id -> bytes stored in it by this call, added to T_OWNED at the end
  local own = redis.call('HMGET', T_KEY, 'q.streams', 'q.stored_bytes', 'q.written_bytes',
    'q.written_period_seconds', 'u.streams', 'u.stored_bytes', 'u.written_bytes', 'u.period_start',
    'u.stored_at')
  local def = redis.call('HMGET', T_DEFAULTS, 'q.streams', 'q.stored_bytes', 'q.written_bytes',
    'q.written_period_seconds')
  local function quota(i) local v = own[i] or def[i]; return v and tonumber(v) or nil end
  t.q_streams, t.q_stored, t.q_written = quota(1), quota(2), quota(3)
  local period = quota(4) or 86400
  t.period_start = math.floor(now / 1000 / period) * period
  t.streams, t.stored = tonumber(own[5] or '0'), tonumber(own[6] or '0')
  t.written = 0  -- a new period starts from nothing written
  if tonumber(own[8] or '-1') == t.period_start then t.written = tonumber(own[7] or '0') end
  t.now, t.stored_before, t.stored_at = now, t.stored, tonumber(own[9] or now)
  TN = t
end

-- nil when the bound tenant may store `bytes` more (and hold one stream more:
-- `new_stream`), else the refusal {'quota', name, limit, usage, asked}.
local function tenant_refuses(bytes, new_stream)
  if not TN then return nil end
  if new_stream and TN.q_streams and TN.streams + 1 > TN.q_streams then
    return {'quota', 'streams', fmt(TN.q_streams), fmt(TN.streams), '1'}
  end
  if bytes > 0 and TN.q_stored and TN.stored + bytes > TN.q_stored then
    return {'quota', 'stored_bytes', fmt(TN.q_stored), fmt(TN.stored), fmt(bytes)}
  end
  if bytes > 0 and TN.q_written and TN.written + bytes > TN.q_written then
    return {'quota', 'written_bytes', fmt(TN.q_written), fmt(TN.written), fmt(bytes)}
  end
  return nil
end

-- Whether the stream `m` is another tenant's than the bound one (then it is not written).
local function tenant_foreign(m)
  return TN ~= nil and m.tn ~= nil and m.tn ~= TN.name
end

-- The stream (META's) and what was stored for it before (`stored`) leave the bound tenant
-- (deleted, expired, made anew, ...): given back. Nothing when the tenant holds no such stream.
local function tenant_release(sid)
  if not TN then return end
  local bytes = redis.call('HGET', T_OWNED, sid)
  if not bytes then return end
  redis.call('HDEL', T_OWNED, sid)
  TN.streams, TN.stored = math.max(0, TN.streams - 1), math.max(0, TN.stored - tonumber(bytes))
  TN.deleted = TN.deleted + 1
  TN.dirty = true
end

-- A stream made while tenants were off (no 'tn') becomes the bound tenant's when it first
-- stores something for it, after that append's checks passed (tenant_refuses counted it as
-- a new stream): from then on its bytes count.
local function tenant_adopt(m)
  local sid = stream_sid()
  tenant_release(sid)  -- an earlier stream of this name it still held (expired, not swept yet)
  m.tn = TN.name
  redis.call('HSET', META, 'tn', TN.name)
  redis.call('HSET', T_OWNED, sid, '0')
  TN.streams, TN.created = TN.streams + 1, TN.created + 1
  TN.dirty = true
end

-- An archive worker's call (retention, compaction) names the stream's tenant as it read the
-- meta ('' none; '-' none counted: a Redis Cluster's, where tenants are off): whether that is
-- not the stream's now (adopted since: tenant_adopt). Then the call changes nothing and
-- answers {'tenant', name}: the worker calls again with it.
local function tenant_other(m, name)
  return name ~= '-' and (m.tn or '') ~= name
end

-- `bytes` the stream (META's) no longer stores for the bound tenant (retention dropped
-- them, compaction dropped messages): given back, never more than the stream holds for it.
local function tenant_shrink(bytes)
  if not TN or bytes <= 0 then return end
  local sid = stream_sid()
  local held = tonumber(redis.call('HGET', T_OWNED, sid) or '0')
  local back = math.min(bytes, held)
  if back <= 0 then return end
  redis.call('HSET', T_OWNED, sid, fmt(held - back))
  TN.stored = math.max(0, TN.stored - back)
  TN.dirty = true
end

-- `bytes` stored for the bound tenant in the stream (META's), `new_stream` its first.
local function tenant_charge(bytes, new_stream)
  if not TN then return end
  if new_stream then
    redis.call('HSET', T_OWNED, stream_sid(), fmt(bytes))
    TN.streams, TN.created = TN.streams + 1, TN.created + 1
  elseif bytes > 0 then  -- (once a call per stream: a batch holds many appends to one)
    local sid = stream_sid()
    TN.grown[sid] = (TN.grown[sid] or 0) + bytes
  end
  TN.stored, TN.written, TN.bytes_in = TN.stored + bytes, TN.written + bytes, TN.bytes_in + bytes
  TN.dirty = true
end

-- What the bound tenant was charged so far in this call, for tenant_undo (nil: none bound).
local function tenant_mark()
  if not TN then return nil end
  return {TN.stored, TN.written, TN.bytes_in, TN.appends, TN.grown[stream_sid()] or false}
end

-- The stream's (META's) writes failed after their charges (append.lua fail_stream): back to
-- the `mark`. An adoption stays: its writes (meta 'tn', the tenant's streams) were made.
local function tenant_undo(mark)
  if not mark then return end
  TN.stored, TN.written, TN.bytes_in, TN.appends = mark[1], mark[2], mark[3], mark[4]
  TN.grown[stream_sid()] = mark[5] or nil
end

-- At the end of a call: the usage written back, the meter counted (once a call). The bytes
-- stored until now are metered as byte-seconds (whole seconds; the rest carried over) in
-- the hour of the call: every change, and the sweep (tenant_sweep.lua), accrues them.
-- Called under pcall (tenant_saved): the writes it accounts for are committed already, and
-- their client must hear so; a failure here is logged.
local function tenant_save()
  if not TN or not TN.dirty then return end
  local seconds = math.max(0, math.floor((TN.now - TN.stored_at) / 1000))
  local stored_at = math.min(TN.now, TN.stored_at + seconds * 1000)
  redis.call('HSET', T_KEY, 'u.streams', fmt(TN.streams), 'u.stored_bytes', fmt(TN.stored),
    'u.written_bytes', fmt(TN.written), 'u.period_start', fmt(TN.period_start), 'u.stored_at', fmt(stored_at))
  for sid, bytes in pairs(TN.grown) do redis.call('HINCRBY', T_OWNED, sid, fmt(bytes)) end
  TN.grown = {}
  if TN.created > 0 then redis.call('SADD', T_INDEX, TN.name) end  -- (listed from its first stream)
  local counts = {appends = TN.appends, bytes_in = TN.bytes_in, streams_created = TN.created,
    streams_deleted = TN.deleted, stored_byte_seconds = TN.stored_before * seconds}
  for counter, n in pairs(counts) do
    if n > 0 then redis.call('HINCRBY', T_METER, TN.name .. ' ' .. counter, fmt(n)) end
  end
  TN.dirty = false
end

local function tenant_saved()
  local ok, e = pcall(tenant_save)
  if not ok then
    redis.log(redis.LOG_WARNING, 'tenant usage not saved: ' .. tostring(type(e) == 'table' and e.err or e))
  end
end
