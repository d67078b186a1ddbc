-- create.lua: PUT. Creates the stream, or answers for an existing one.
-- ARGV: 1 content_type: content type as given, 2 media_type: content type normalized,
--   3 ttl_seconds: TTL seconds ('' none), 4 expires_at_ms: Expires-At in ms ('' none),
--   5 expires_at: Expires-At as given, 6 closed: '1' to create closed,
--   7 fork_source: fork source id ('' not a fork), 8 given_offset: fork offset the
--   client gave ('' none: not compared), 9 fork_offset: fork offset to record,
--   10 fork_sub_offset: fork sub-offset, 11 base: base position (where this stream's
--   own log starts: the fork point, else 0), 12 chain: fork read chain (JSON: the ranges
--   inherited, [[ancestor id, from, to], ...], oldest first), 13 chain_uids: the
--   incarnation of each of those ancestors (JSON: [their meta 'uid', ...], recorded as
--   'chain_uids'; a fork made before incarnations were has none), 14 source_uid: the
--   source's incarnation (its 'uid', recorded as 'src_uid'; '' not a fork), 15 weak: '1'
--   for a weak fork (recorded as 'weak': not in its source's FORKS, see fork_ref.lua),
--   16 workers_alive: '1' when a subscription worker runs (the new stream goes in the
--   outbox, to be matched; else only if it has links), 17 wake_channel: the channel that
--   wakes subscription workers, 18 if_match: If-Match ('' none; else as for append.lua:
--   the prelude's if_match), 19 compaction: 'state' for a stream compacted by key
--   (recorded as 'cmp', docs/compaction.md), '' none, 20 compaction_asked: '1' when the
--   PUT said (an existing stream must then say the same; else a policy decided),
--   21 gaps: '1' for a fork whose inherited part may have gaps (a compacted ancestor;
--   recorded as 'gaps'), 22 tenant: the tenant it is made for ('' none; recorded as 'tn':
--   _tenants.lua), 23.. entries: initial entries (pairs: the positions each takes, its
--   bytes; see add_entries).
-- KEYS: the five stream keys, 6 its subscription links, 7 its slot's stream index
--   (keys.stream_index: the stream is listed there while it lives), 8 the created last
--   given at this path (keys.stream_born), 9-13 its tenant's keys when it has one
--   (_tenants.lua), then its slot's outbox.
-- Publishes 'created' on the stream's notify channel when it makes the stream.
-- Returns {'created', meta} | {'exists', meta} | {'conflict', source (the existing
--   stream's source id, or '')} | {'precondition_failed', tail, created} (If-Match names
--   another state; tail and created '' when there is no stream: it is not made)
--   | {'quota', quota, limit, usage, asked} (a tenant's quota refuses it: not made)
--   | {'foreign'} (the stream exists and is another tenant's).
local ct, ctn, ttl, exp_at, expires, closed = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local src, fork_off, fork_sub, base, chain = ARGV[7], ARGV[8], ARGV[10], ARGV[11], ARGV[12]
local chain_uids, src_uid, weak = ARGV[13], ARGV[14], ARGV[15]
WAKE = ARGV[17]
local INDEX = KEYS[7]
local now = now_ms()
tenant_bind(9, ARGV[22], now)
local m, status = open_stream(now)
if status == 'gone' then return {'conflict', m.src or ''} end
if status == 'ok' and tenant_foreign(m) then return {'foreign'} end
-- If-Match here, in the script that creates: a delete just before cannot let it make one.
if ARGV[18] ~= '' then
  if status ~= 'ok' then return {'precondition_failed', '', ''} end
  if not if_match(m, ARGV[18]) then return {'precondition_failed', m.tail, m.created} end
end
if status == 'ok' then
  local same = m.ctn == ctn and (m.ttl or '') == ttl and (m.expires or '') == expires
    and (m.closed or '0') == closed and (m.src or '') == src
    and (fork_off == '' or m.fork_off == fork_off) and (m.fork_sub or '0') == fork_sub
    -- a fork of another stream at the same path is not the same fork (one made
    -- before incarnations were recorded has none: its source is pinned, so the same)
    and (m.src_uid == nil or m.src_uid == src_uid)
    and (ARGV[20] ~= '1' or (m.cmp or '') == ARGV[19])
  if same then
    touch(m, now, 0)
    redis.call('ZADD', INDEX, 0, stream_sid())  -- a stream made before the index: listed now
    return {'exists', flat(m)}
  end
  return {'conflict', m.src or ''}
end

-- An earlier stream of this name the tenant still holds is gone (it expired): given back.
tenant_release(stream_sid())
local size = 0
for k = 23, #ARGV, 2 do size = size + tonumber(ARGV[k]) end  -- (the positions: as offsets count)
local refusal = tenant_refuses(size, true)
if refusal then
  tenant_saved()
  return refusal
end

-- 'created' names the incarnation (ETags, If-Match, live readers): one made at this path in
-- the same millisecond as the last (or with the clock stepped back) takes a later one.
local BORN = KEYS[8]
local created = math.max(now, tonumber(redis.call('GET', BORN) or '0') + 1)
redis.call('SET', BORN, fmt(created), 'PX', BORN_MS)
m = {ct = ct, ctn = ctn, base = base, tail = base, created = fmt(created)}
if ttl ~= '' then m.ttl = ttl; m.exp = fmt(now + tonumber(ttl) * 1000) end
if expires ~= '' then m.expires = expires; m.exp = exp_at end
if src ~= '' then
  m.src = src; m.fork_off = ARGV[9]; m.fork_sub = fork_sub
  m.chain = chain; m.chain_uids = chain_uids; m.src_uid = src_uid
  if weak == '1' then m.weak = '1' end
end
if ARGV[19] ~= '' then m.cmp = ARGV[19] end
if ARGV[21] == '1' then m.gaps = '1' end
if TN then m.tn = TN.name end
m.tail = fmt(add_entries(m, 23, #ARGV, now))
if closed == '1' then m.closed = '1' end
redis.call('HSET', META, unpack(flat(m)))
redis.call('ZADD', INDEX, 0, stream_sid())
if m.exp then apply_expiry(m) end
record_for_subscribers(ARGV[16] == '1')
-- Readers of an earlier stream of this name may still wait on the channel: one that expired
-- announces nothing. Unparsable, the notice makes them read Redis (gateway/live/channels.py).
publish('created')
tenant_charge(size, true)
tenant_saved()
return {'created', flat(m)}
