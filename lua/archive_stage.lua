-- archive_stage.lua: the archive worker names the file it is about to write,
-- before writing it, so a worker that crashes is retried with the same range
-- and file name (the file is overwritten, never duplicated).
-- KEYS: the stream's five (see _prelude.lua), KEYS[6] the lease,
--   KEYS[7] the segment set of incarnation ARGV[2] (keys.segments).
-- ARGV: 1 token: lease token, 2 incarnation: the stream's incarnation (or a fresh one
--   if it has none), 3 start: from, 4 end: to, 5 first_ms: first append ms,
--   6 last_ms: last append ms, 7 file: the file. `start` is where the log starts
--   (meta arch, else base), or the start of the last segment, which the new file then
--   replaces (merging small files).
-- Returns {'ok'} | {'busy', pending member} | {'moved'} (state changed under
--   the worker: plan again) | {'missing'} | {'lost'} (the lease is not this
--   worker's).
if not holds_lease() then return {'lost'} end
local inc, from, to = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local m, status = open_stream(now_ms())
if status == 'missing' then return {'missing'} end
if m.inc and m.inc ~= inc then return {'moved'} end
local segs = SEGS
local pending = redis.call('ZRANGEBYSCORE', segs, -1, -1)[1]
if pending then return {'busy', pending} end
local start = tonumber(m.arch or m.base)
if to > tonumber(m.tail) or to <= start then return {'moved'} end
if from ~= start then
  local last = redis.call('ZRANGEBYSCORE', segs, from, from)[1]
  if not last or tonumber(string.match(last, '^%d+ (%d+)')) ~= start then return {'moved'} end
end
if not m.inc then redis.call('HSET', META, 'inc', inc) end
redis.call('ZADD', segs, -1, table.concat({ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7]}, ' '))
return {'ok'}
