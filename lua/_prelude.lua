-- _prelude.lua: helpers shared by every script here. gateway/redis_io/lua.py
-- puts this text in front of each script before it is loaded, so helpers are
-- written once. Every script gets the same KEYS, all of one stream (one hash tag;
-- append.lua gets them for several streams and binds each in turn):
--   KEYS[1] meta (hash)   KEYS[2] log (stream)   KEYS[3] producers (hash)
--   KEYS[4] forks (set)   KEYS[5] notify channel (a name, never stored)
-- archive_*.lua also get KEYS[6], the stream's archive lease (a string: the
-- holding worker's token) and the caller's token as ARGV[1]; all but the
-- read-only archive_named refuse to act unless the two match (fencing). Those
-- that use the segment set get it as KEYS[7] (SEGS): its name holds the
-- incarnation (ARGV[2]), and every key a script touches is in KEYS, so the
-- scripts run unchanged on Redis Cluster. No script builds a key name.
-- Archived data lives in Parquet; its segment list is the sorted set
-- SEGS (see gateway/archive/segments.py): score = first position, member =
-- "<from> <to> <first ms> <last ms> <file>"; score -1 marks a file being
-- written (pending), -2 a replaced file still to delete. Meta field 'arch' is
-- where the Redis log starts (everything below is in files), 'floor' where
-- retained data starts, 'inc' the incarnation the segment keys are named by.
-- Forks: 'uid' names this incarnation in its forks' chains (set by fork_ref.lua
-- when first forked); a fork has 'src', 'chain' and 'chain_uids' (what it
-- reads from which ancestor incarnation), 'src_uid', and 'weak' if it does
-- not pin its source (gateway/streams/forks.py). FORKS holds pinning forks only.
-- Positions are byte positions in the stream; the log entry that starts at
-- position P has the id "P-1" (0-0 is not a valid stream id).
local META, LOG, PROD, FORKS, CHANNEL, SEGS = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[7]
-- Subscriptions (create.lua, append.lua): the stream's links (keys.stream_subs), its
-- slot's outbox (the last key) and the channel that wakes the workers (ARGV).
local SUBS, OUTBOX, WAKE = KEYS[6], KEYS[#KEYS], ''
-- How notices go out: on Redis Cluster, sharded pub/sub (SPUBLISH reaches only the
-- slot's shard, where the stream's readers subscribe: gateway/live/fanout.py),
-- except on Redis < 7 (no sharded pub/sub, and no REDIS_VERSION_NUM); else PUBLISH.
-- CLUSTER is set by gateway/redis_io/lua.py for the scripts of a cluster.
local CLUSTER = false --[[cluster]]
local function publish(notice)
  if CLUSTER and redis.REDIS_VERSION_NUM then
    redis.call('SPUBLISH', CHANNEL, notice)
  else
    redis.call('PUBLISH', CHANNEL, notice)
  end
end

local function fmt(n) return string.format('%.0f', n) end
-- A position (an integer below 2^53) as text: '%d' costs Lua ~40% less than fmt's '%.0f',
-- on every append's path (its tail; its entry's id, eid, likewise).
local function pos_text(n) return string.format('%d', n) end
local function eid(pos) return string.format('%d-1', pos) end
local function epos(id) return tonumber(string.match(id, '^(%d+)')) end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function load_meta()
  local raw = redis.call('HGETALL', META)
  if #raw == 0 then return nil end
  local m = {}
  for i = 1, #raw, 2 do m[raw[i]] = raw[i + 1] end
  return m
end

local function flat(m)
  local out = {}
  for k, v in pairs(m) do out[#out + 1] = k; out[#out + 1] = v end
  return out
end

-- The segment set is left behind when a stream goes: the archive worker
-- finds it (index ds:archive:segsets), removes its files, then the key
-- (workers/archiver.py).
-- UNLINK: a long log is freed in the background, not inside this script.
local function drop() redis.call('UNLINK', META, LOG, PROD, FORKS) end

-- Redis expiry frees an idle expired stream's memory by itself; a stream that
-- forks still read from must outlive its deadline, so it is made persistent.
local function apply_expiry(m)
  if m.exp and redis.call('SCARD', FORKS) == 0 then
    for _, key in ipairs({META, LOG, PROD, FORKS}) do redis.call('PEXPIREAT', key, m.exp) end
  else
    for _, key in ipairs({META, LOG, PROD, FORKS}) do redis.call('PERSIST', key) end
  end
end

-- 'ok', 'missing', or 'gone' (soft-deleted: kept only for its forks' reads).
-- An expired stream is dropped, or soft-deleted while forks read from it.
local function resolve(m, now)
  if not m then return 'missing' end
  if m.deleted then return 'gone' end
  if m.exp and now >= tonumber(m.exp) then
    if redis.call('SCARD', FORKS) > 0 then
      redis.call('HSET', META, 'deleted', '1')
      return 'gone'
    end
    drop()
    return 'missing'
  end
  return 'ok'
end

-- "Open the stream" (every script whose stream must exist starts so): its meta
-- (nil when missing) and its state, resolved as above.
local function open_stream(now)
  local m = load_meta()
  return m, resolve(m, now)
end

-- The answer of a script on a live stream: body(m), or {'missing'} / {'gone'}.
local function with_stream(now, body)
  local m, status = open_stream(now)
  if status ~= 'ok' then return {status} end
  return body(m)
end

-- Archive scripts: whether the caller's token (ARGV[1]) holds the lease (KEYS[6]).
local function holds_lease() return redis.call('GET', KEYS[6]) == ARGV[1] end

-- The stream's meta while it exists (soft-deleted included) under incarnation
-- `inc`; nil once that incarnation is dead (the stream gone or created anew).
local function incarnation(inc)
  local m, status = open_stream(now_ms())
  if status == 'missing' or m.inc ~= inc then return nil end
  return m
end

-- Sliding TTL: move the deadline to now + TTL. Reads pass a min_step so a
-- stream read many times a second is not rewritten (and fsynced) each time.
local function touch(m, now, min_step)
  if not m.ttl then return end
  local exp = now + tonumber(m.ttl) * 1000
  if m.exp and exp - tonumber(m.exp) < min_step then return end
  m.exp = fmt(exp)
  redis.call('HSET', META, 'exp', m.exp)
  apply_expiry(m)
end

-- Byte-wise "a < b" (Lua's own string compare follows the server's locale).
local function bytes_less(a, b)
  local n = math.min(#a, #b)
  for i = 1, n do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then return x < y end
  end
  return #a < #b
end

-- The own-log data covering positions [from, hi) (hi = nil: no bound) as a
-- flat list {pos, data, pos, data, ...}, at most `budget` bytes and
-- `max_entries` pieces. Byte entries are cut to fit, since an offset may fall
-- inside an entry. JSON (whole = true): an entry holds one or more messages
-- joined by '\n' (gateway/protocol/entries.py), each at the entry's position
-- plus the lengths of those before it; messages are never cut: one that
-- starts before `from` is skipped and the last one may overrun the budget.
local function collect(from, hi, budget, whole, max_entries)
  local out, total = {}, 0
  local last, pieces = 0, 0  -- the latest entry's size, and how many pieces it gave
  local function add(pos, data)
    pieces = pieces + 1
    if hi and pos + #data > hi then data = string.sub(data, 1, hi - pos) end
    if not whole and total + #data > budget then data = string.sub(data, 1, budget - total) end
    out[#out + 1] = fmt(pos)
    out[#out + 1] = data
    total = total + #data
    return total >= budget or #out >= 2 * max_entries
  end
  -- An entry's data from `from` on (and below `hi`): true once the read is full.
  local function add_entry(pos, data)
    last, pieces = #data, 0
    if not whole then
      if pos < from then return add(from, string.sub(data, from - pos + 1)) end
      return add(pos, data)
    end
    if not string.find(data, '\n', 1, true) then return pos >= from and add(pos, data) end
    local i = 1
    while true do
      local j = string.find(data, '\n', i, true)
      local message = string.sub(data, i, (j or 0) - 1)
      if hi and pos >= hi then return true end
      if pos >= from and add(pos, message) then return true end
      if not j then return false end
      pos, i = pos + #message, j + 1
    end
  end
  if budget <= 0 or (hi and from >= hi) then return out end
  local prev = redis.call('XREVRANGE', LOG, eid(from), '-', 'COUNT', 1)[1]
  if prev and epos(prev[1]) + #prev[2][2] > from and add_entry(epos(prev[1]), prev[2][2]) then return out end
  local cursor = '(' .. eid(from)
  while true do
    -- Fetch about as many entries as the rest of the budget (and of the pieces) holds
    -- at the size of the latest one: copying entries into Lua that the read will not
    -- use costs more than the read (large entries), and one at a time is slow (small).
    local count = 8
    if last > 0 then
      count = math.floor((budget - total) / last) + 1
      if pieces > 0 then count = math.min(count, math.floor((max_entries - #out / 2) / pieces) + 1) end
      count = math.max(1, math.min(512, count))
    end
    local batch = redis.call('XRANGE', LOG, cursor, '+', 'COUNT', count)
    if #batch == 0 then return out end
    for _, e in ipairs(batch) do
      local pos = epos(e[1])
      if hi and pos >= hi then return out end
      if add_entry(pos, e[2][2]) then return out end
    end
    cursor = '(' .. batch[#batch][1]
  end
end

-- What a read from `from` finds first: {}, 'archived' and the incarnation
-- when `from` is archived (the caller finds the segment in the incarnation's
-- segment set, reads its file, then continues: the set's name is not known
-- before this script looks, so it cannot be in KEYS); {} and 'bulk' when it would return
-- more than `inline` bytes (the caller fetches them with a plain XRANGE and, for JSON,
-- splits the messages itself: copying megabytes into Lua and back, or splitting
-- thousands of messages in Lua, costs Redis several times what XRANGE does); else the
-- log's entries.
local function read_from(m, from, hi, budget, whole, max_entries, inline)
  if m.arch and from < tonumber(m.arch) then
    return {{}, 'archived', m.inc or ''}
  end
  local stop = hi or tonumber(m.tail)
  if stop and math.min(stop, from + budget) - from > inline then
    return {{}, 'bulk'}
  end
  return {collect(from, hi, budget, whole, max_entries)}
end

-- If-Match (append.lua, create.lua) against the stream `m`:
-- `spec` is '*' (the stream exists, as it does here), or items '<created>:<tail>:<closed>'
-- separated by spaces, an empty created or closed matching any (a bare offset names the
-- tail alone); '!' matches nothing. Strings compare exactly: the gateway sends created
-- as an ETag names it and the tail as fmt() writes it.
local function if_match(m, spec)
  if spec == '*' then return true end
  local closed = m.closed and '1' or '0'
  for created, tail, c in string.gmatch(spec, '(%d*):(%d+):([01]?)') do
    if tail == m.tail and (created == '' or created == m.created) and (c == '' or c == closed) then
      return true
    end
  end
  return false
end

-- This stream's id (the hash tag of its key names): how indexes and outboxes name it.
local function stream_sid() return string.sub(META, #'ds:{' + 1, -#'}:meta' - 1) end

-- A stream with subscription links (SUBS, keys.stream_subs), or any new stream when
-- `always`, goes in its slot's OUTBOX (keys.subs_outbox) for the subscription
-- workers; the first time since they took it, the outbox's name goes out on the
-- WAKE channel (PUBLISH: on Redis Cluster it reaches every node's subscribers).
local function record_for_subscribers(always)
  if not always and redis.call('EXISTS', SUBS) == 0 then return end
  if redis.call('ZADD', OUTBOX, 'NX', now_ms(), stream_sid()) == 1 and WAKE ~= '' then
    redis.call('PUBLISH', WAKE, OUTBOX)
  end
end

-- Append entries at the tail: ARGV[first..last] holds pairs (the positions the
-- entry takes, its bytes): a JSON entry is one or more messages joined by '\n' and
-- takes their length without the separators, a byte entry its length
-- (gateway/protocol/entries.py). Returns the new tail. Each entry keeps its
-- append time (`now`, ms: a number or its text) and, from an idempotent producer, "<epoch> <seq> <id>" (the
-- archive's producer columns). `wrote`, if given, is called once the first entry
-- is stored: a refusal (OOM, READONLY, MISCONF) comes at that first write, before
-- anything is stored. A compacted stream (m.cmp, docs/compaction.md) stores one message an
-- entry: compaction drops messages by deleting entries (lua/compact.lua).
local function add_entries(m, first, last, now, producer, wrote)
  local pos = tonumber(m.tail)
  local function add(at, data)
    if producer then
      redis.call('XADD', LOG, eid(at), 'd', data, 't', now, 'p', producer)
    else
      redis.call('XADD', LOG, eid(at), 'd', data, 't', now)
    end
  end
  for i = first, last, 2 do
    local data = ARGV[i + 1]
    if m.cmp and string.find(data, '\n', 1, true) then
      local at, from = pos, 1
      while true do
        local j = string.find(data, '\n', from, true)
        local message = string.sub(data, from, (j or 0) - 1)
        add(at, message)
        if not j then break end
        at, from = at + #message, j + 1
      end
    else
      add(pos, data)
    end
    if wrote and i == first then wrote() end
    pos = pos + tonumber(ARGV[i])
  end
  return pos
end

-- Commit appended data: the tail moves to `tail`, with the append's Stream-Seq ('' none),
-- close, and idempotent producer (`tuple` "<id>\n<epoch>\n<seq>", nil none), in `m` and in
-- `staged` ({meta = fields, prod = producers' states}), what save_staged writes: append.lua
-- stages a stream's appends and writes them once (one HSET each, not one an append).
local function stage_commit(m, staged, tail, sseq, close, tuple, pid, ep, sq)
  m.tail = pos_text(tail)
  staged.meta.tail = m.tail
  if sseq ~= '' then m.seq = sseq; staged.meta.seq = sseq end
  if close then
    m.closed, staged.meta.closed = '1', '1'
    if tuple then m.closed_by, staged.meta.closed_by = tuple, tuple end
  end
  if tuple then staged.prod[pid] = ep .. ':' .. sq end
end

-- The producers first: should their key be refused (corrupt), the tail has not moved.
local function save_staged(staged)
  if next(staged.prod) then redis.call('HSET', PROD, unpack(flat(staged.prod))) end
  local fields = staged.meta
  if fields.seq or fields.closed then
    redis.call('HSET', META, unpack(flat(fields)))
  elseif fields.tail then  -- the common case, without the table
    redis.call('HSET', META, 'tail', fields.tail)
  end
end

local function commit(m, tail, sseq, close, tuple, pid, ep, sq)
  local staged = {meta = {}, prod = {}}
  stage_commit(m, staged, tail, sseq, close, tuple, pid, ep, sq)
  save_staged(staged)
end

-- A large append is written in steps, each bounded (append.lua begins it after its
-- checks, append_part.lua goes on and commits): its entries lie beyond the tail, where
-- no read looks, until the last step moves the tail. META fields while it is under way:
-- pend (the writer's token), pend_at (where its next part goes), pend_to (the tail once
-- committed), pend_tb (the bytes its tenant is charged at the commit), pend_until (ms: each step moves it PEND_MS on; a writer silent past it is
-- gone). Meanwhile other appends wait ('busy'). On a single Redis the gateway writes the
-- parts between with plain commands doing what an append_part.lua 'part' step does, in a
-- MULTI/EXEC under WATCH of META and LOG (gateway/redis_io/parts.py): its data never passes
-- through Lua, which hashes every string argument whole (~1.2 ms per MiB).
local PEND_MS = 5000  -- gateway/redis_io/parts.py has it too
-- How long create.lua remembers the created it gave (keys.stream_born): well past one
-- millisecond and any clock step back worth guarding; short, as it is one key per stream made.
local BORN_MS = 2000
local PEND_FIELDS = {'pend', 'pend_at', 'pend_to', 'pend_until', 'pend_tb'}

-- Drop what an unfinished large append wrote beyond the tail, a bounded amount per call
-- (XRANGE copies the data into the script). Returns true once nothing is left.
local function roll_back(m)
  local budget, cursor = 4 * 1024 * 1024, eid(tonumber(m.tail))
  while budget > 0 do
    local e = redis.call('XRANGE', LOG, cursor, '+', 'COUNT', 1)[1]
    if not e then
      -- XADD takes only ids above the highest it ever added: back to just below the tail
      if redis.call('EXISTS', LOG) == 1 then redis.call('XSETID', LOG, fmt(tonumber(m.tail)) .. '-0') end
      redis.call('HDEL', META, unpack(PEND_FIELDS))
      m.pend, m.pend_at, m.pend_to, m.pend_until = nil, nil, nil, nil
      return true
    end
    redis.call('XDEL', LOG, e[1])
    budget = budget - #e[2][2]
    cursor = '(' .. e[1]
  end
  return false
end
