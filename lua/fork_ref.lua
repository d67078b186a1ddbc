-- fork_ref.lua: run on a fork's source before the fork is created (and on the
-- ancestors of an old chain, see 'stamp').
-- ARGV: 1 fork: the fork's id, 2 how: 'pin' records the fork in FORKS (a set, so
--   retries count once), which holds the source's data: deleted or expired, the
--   source is only soft-deleted while FORKS is not empty; 'weak' records
--   nothing (a weak fork holds nothing: the source goes as if unforked, and the
--   fork's chain names this incarnation, so its reads refuse whatever holds the
--   path later); 'stamp' only gives the stream an incarnation id, soft-deleted
--   included (the ancestors of a chain recorded before incarnations were),
--   3 uid: a fresh incarnation id: stored as meta 'uid' if the stream has none yet
--   (uid is set once, the first time a stream is forked, and names this
--   incarnation in its forks' chains; a stream at the same path later gets
--   another), 4 anchor: the position Stream-Fork-Offset names (-1: none, the tail),
--   5 tenant: the forking request's tenant ('' none: docs/tenants.md): a stream of another
--   tenant is not forked (a fork holds its source's data, which stays counted to its
--   owner), nothing changed.
-- A compacted stream (docs/compaction.md) records its tail as 'fkmax': compaction drops
-- nothing below the newest fork point from then on (lua/compact.lua), so a fork's inherited
-- part stays as it was at its fork point; the fork must start at or past where compaction
-- has dropped messages so far: one whose anchor is below is refused here, before 'fkmax'
-- moves (gateway/streams/forks.py checks the fork point, at or after the anchor, again).
-- Returns {'ok', meta (the source's), added ('1' if this call added the fork to FORKS,
--   else '0')} | {'missing'} | {'gone'} (never for 'stamp') | {'compacted', floor} (the
--   anchor is in the compacted part, below floor: nothing changed) | {'foreign'}.
local how, now = ARGV[2], now_ms()
local m, status = open_stream(now)
if status == 'missing' or (status == 'gone' and how ~= 'stamp') then return {status} end
if how ~= 'stamp' and (ARGV[5] or '') ~= '' and m.tn and m.tn ~= ARGV[5] then return {'foreign'} end
local anchor = tonumber(ARGV[4])
if m.cmp and how ~= 'stamp' then
  local floor = math.max(tonumber(m.cto or '0'), tonumber(m.cnext or '0'))
  if anchor >= tonumber(m.base) and anchor < floor then return {'compacted', fmt(floor)} end
end
if not m.uid then
  m.uid = ARGV[3]
  redis.call('HSET', META, 'uid', m.uid)
end
-- (an anchor past the tail is refused by the caller: 400)
if m.cmp and how ~= 'stamp' and anchor <= tonumber(m.tail) and tonumber(m.tail) > tonumber(m.fkmax or '0') then
  m.fkmax = m.tail
  redis.call('HSET', META, 'fkmax', m.tail)
end
local added = 0
if how == 'pin' then
  added = redis.call('SADD', FORKS, ARGV[1])
  apply_expiry(m)
end
return {'ok', flat(m), tostring(added)}
