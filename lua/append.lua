-- append.lua: POST. Appends that reached a gateway together
-- (gateway/streams/appends.py), to one or more streams: each checked and applied in
-- order exactly as if it came alone (closure, content type, idempotent producer,
-- If-Match, Stream-Expected-Offset and Stream-Seq checks, in that order: see
-- append_one), committed together with its data. A condition is checked against the
-- stream as the appends before it in the call left it.
-- KEYS: the five stream keys (_prelude.lua) of each stream and its subscription
--   links (keys.stream_subs), one stream after another, then the outbox of the
--   slot (keys.subs_outbox). On Redis Cluster every stream of a call hashes to
--   one slot: the gateway splits a batch by slot (gateway/streams/appends.py).
-- ARGV: 1 notice_bytes: largest amount of appended bytes that rides along in a notice,
--   2 wake_channel: the channel that wakes subscription workers,
--   3 tenant: the tenant the appends are made for ('' none; else its five keys come
--   before the outbox: _tenants.lua), 4.. streams: per stream (in KEYS order), a group
--   (ARGV streams).
-- ARGV streams: 1 append_count: its number of appends, 2.. appends: that many appends,
--   a group each (ARGV appends).
-- ARGV appends: 1 media_type: content type normalized ('' when the body is empty),
--   2 close: '1' to close after appending, 3 stream_seq: Stream-Seq ('' none),
--   4 producer_id: producer id ('' none), 5 producer_epoch: producer epoch,
--   6 producer_seq: producer seq, 7 if_match: If-Match ('' none; else as
--   gateway/protocol/conditions.py encodes it, see if_match),
--   8 expected_offset: Stream-Expected-Offset as a position ('' none),
--   9 token: the token of a large append written in steps ('' none: see PEND_MS in
--   _prelude.lua; this call checks it and marks it under way, and writes its entries, if
--   any, as its first part), 10 total: "<positions> <bytes>" the whole of it takes (a
--   large append's; '' none), 11 entry_count: entry count k, 12.. entries: the k entries (none =
--   close-only), each as two arguments: the positions it takes, its bytes (add_entries
--   in _prelude.lua; gateway/protocol/entries.py).
-- A stream with subscribers (its links exist) whose tail moved is put in the
-- outbox for the subscription workers (workers/delivery.py), in this script: a
-- crash after it cannot lose the wake; the first such append since the workers
-- last took it also publishes the outbox's name on the wake channel.
-- Publishes (publish() in _prelude.lua) one notice per changed stream on its notify channel:
--   "<old tail> <new tail> <closed 0|1>", plus for small appends
--   " <size>,<size>,...\n<data><data>..." (gateway/protocol/notices.py), a size being an
--   entry's length, or "<length>:<positions>" for a JSON entry of several messages.
-- Each append runs under pcall: an error in one (a corrupt key, a refusal such
-- as OOM or READONLY at its first write) is that append's result alone; the
-- batch goes on. Checks come before writes, and Redis refuses a script's writes
-- only at its first one, so a failed append has written nothing unless the
-- error hit between its writes (reported as 'partial'; not seen in practice).
-- Returns one result per append, in ARGV order:
--   {'ok', tail, closed[, created]}  appended / closed (created: the incarnation, for the
--                                    ETag; none when a close-only append found it closed)
--   {'pending', tail, one_each}     a large append's first part is written (append_part.lua goes
--                                    on); one_each: '1' when its parts store a message an entry
--                                    (a compacted stream: add_entries)
--   {'busy', until}                 a large append is under way (until: ms): send again later
--   {'dup', tail, closed, epoch, seq} producer retry, already applied
--   {'closed', tail}                the stream is closed (409)
--   {'precondition_failed', tail, created}  If-Match does not match (412)
--   {'offset_conflict', tail, created}      the tail is not Stream-Expected-Offset (409)
--   {'seq_regress', tail, created}          Stream-Seq does not increase (409)
--   {'quota', quota, limit, usage, asked}  a tenant's quota refuses it (_tenants.lua)
--   {'foreign'}                     the stream is another tenant's
--   {'ct_mismatch'} {'bad_epoch_seq'}
--   {'stale_epoch', epoch}  {'seq_gap', expected, received}
--   {'missing'} {'gone'}
--   {'error', written, message}  failed; written 'none': nothing written, else 'partial'
local now = now_ms()
local now_text = fmt(now)
local notice_bytes = tonumber(ARGV[1])
local results = {}
WAKE = ARGV[2]
local tenant_keys = ARGV[3] == '' and 0 or 5
tenant_bind(#KEYS - 5, ARGV[3], now)

local function error_text(e)
  if type(e) == 'table' then return tostring(e.err or e.msg or '?') end
  return tostring(e)
end

-- The stream whose keys are bound now (append_stream) and what its appends did. Kept
-- here, not in closures made per stream: a call carries appends to up to hundreds of
-- streams, one each as often as not, and the closures with the notice's tables cost
-- ~2 of the ~13 µs of Lua such an append took (docs/benchmarks.md, fifth round).
local m  -- its meta (load_meta)
local changed  -- an append changed it: its notice goes out
local appended  -- ARGV indices of the entries appended (their sizes), for the notice
local writing  -- an append has stored something: an error after it is 'partial'
local function mark_writing() writing = true end

-- An entry's size in a notice: its length, or "<length>:<positions>" when it takes
-- other positions than bytes (a JSON entry of several messages).
local function notice_size(index)
  local data, took = ARGV[index + 1], ARGV[index]
  if #data == tonumber(took) then return #data end
  return #data .. ':' .. took
end

-- After a stream's appends: move its deadline and publish what changed.
local function finish_stream(old_tail, was_closed)
  touch(m, now, 0)
  if m.exp and not m.ttl then apply_expiry(m) end  -- a new log key needs the deadline too
  if m.tail ~= old_tail or m.closed ~= was_closed then
    local notice = old_tail .. ' ' .. m.tail .. (m.closed and ' 1' or ' 0') .. ' t' .. now_text
    if #appended > 0 and tonumber(m.tail) - tonumber(old_tail) <= notice_bytes then
      if #appended == 1 then  -- the common case, without the tables
        notice = notice .. ' ' .. notice_size(appended[1]) .. '\n' .. ARGV[appended[1] + 1]
      else
        local sizes, datas = {}, {}
        for k, index in ipairs(appended) do
          sizes[k], datas[k] = notice_size(index), ARGV[index + 1]
        end
        notice = notice .. ' ' .. table.concat(sizes, ',') .. '\n' .. table.concat(datas)
      end
    end
    publish(notice)
    record_for_subscribers(false)
  end
end

-- One append to the stream `m`: its checks, then its entries and commit.
local function append_one(ctn, close, sseq, pid, ep, sq, im, eo, token, total, first, last)
  if m.pend then return {'busy', m.pend_until} end  -- behind a large append this call began
  local has_data = last >= first or token ~= ''  -- a large append begins without its data
  local tuple = nil
  if pid ~= '' then tuple = pid .. '\n' .. ep .. '\n' .. sq end
  if m.closed then
    if tuple and m.closed_by == tuple then return {'dup', m.tail, '1', ep, sq} end
    if close and not has_data then changed = true; return {'ok', m.tail, '1'} end
    return {'closed', m.tail}
  end
  if has_data and ctn ~= m.ctn then return {'ct_mismatch'} end
  if tuple then
    local epoch, seq = tonumber(ep), tonumber(sq)
    local state = redis.call('HGET', PROD, pid)
    if state then
      local cur, prev = string.match(state, '^(%d+):(%d+)$')
      cur, prev = tonumber(cur), tonumber(prev)
      if epoch < cur then return {'stale_epoch', fmt(cur)} end
      if epoch == cur then
        if seq <= prev then return {'dup', m.tail, '0', ep, fmt(prev)} end
        if seq ~= prev + 1 then return {'seq_gap', fmt(prev + 1), sq} end
      elseif seq ~= 0 then
        return {'bad_epoch_seq'}
      end
    elseif seq ~= 0 then
      return {'seq_gap', '0', sq}
    end
  end
  -- The conditions come after the producer checks, so a producer's retry of an append
  -- that was stored is its duplicate (204) though the tail has moved since; and before
  -- Stream-Seq, as upstream orders If-Match (412 before 409).
  if im ~= '' and not if_match(m, im) then return {'precondition_failed', m.tail, m.created} end
  if eo ~= '' and eo ~= m.tail then return {'offset_conflict', m.tail, m.created} end
  if sseq ~= '' and m.seq and not bytes_less(m.seq, sseq) then
    return {'seq_regress', m.tail, m.created}
  end
  local size, adopt = 0, false  -- the bytes it stores, for its tenant's quotas
  if TN then
    if token ~= '' then  -- (as offsets count them: a JSON entry's messages, not the '\n's between)
      size = tonumber(string.match(total, '^(%d+)'))
    else
      for k = first, last, 2 do size = size + tonumber(ARGV[k]) end
    end
    adopt = has_data and not m.tn  -- made while tenants were off: it becomes this tenant's
    local refusal = tenant_refuses(size, adopt)
    if refusal then return refusal end
  end

  local tail = add_entries(m, first, last, now, tuple and (ep .. ' ' .. sq .. ' ' .. pid), mark_writing)
  if token ~= '' then  -- a large append's first part: beyond the tail, not committed
    m.pend = token
    -- (its tenant is charged, and checked again, when the last part commits it: pend_tb)
    redis.call('HSET', META, 'pend', token, 'pend_at', fmt(tail), 'pend_tb', fmt(size),
      'pend_to', fmt(tonumber(m.tail) + tonumber(string.match(total, '^%d+'))), 'pend_until', fmt(now + PEND_MS))
    return {'pending', m.tail, m.cmp and '1' or '0'}
  end
  commit(m, tail, sseq, close, tuple, pid, ep, sq)
  if TN and has_data then
    if adopt then tenant_adopt(m) end
    tenant_charge(size, false)
    TN.appends = TN.appends + 1
  end
  -- Its entries ride the notice only once committed: one whose commit failed (an error
  -- after its XADDs, 'partial') must not reach readers beside the appends that did.
  for i = first, last, 2 do appended[#appended + 1] = i end
  changed = true
  return {'ok', m.tail, close and '1' or '0', m.created}
end

-- Every append of the stream gets the same `result`; returns the ARGV index after them.
local function answer_all(i, count, result)
  i = i + 1
  for _ = 1, count do
    results[#results + 1] = result
    i = i + 11 + 2 * tonumber(ARGV[i + 10])
  end
  return i
end

-- The appends of the stream whose keys are bound now; `i` indexes its count in ARGV.
-- Returns the ARGV index after its last append.
local function append_stream(i)
  local count = tonumber(ARGV[i])
  local ok, status
  ok, m, status = pcall(open_stream, now)
  if not ok or status ~= 'ok' then  -- every append of the stream learns of it
    return answer_all(i, count, ok and {status} or {'error', 'none', error_text(m)})
  end
  if m.pend and (now < tonumber(m.pend_until) or not roll_back(m)) then
    -- a large append is under way (or its leftovers still being dropped): all wait
    return answer_all(i, count, {'busy', m.pend_until})
  end
  if tenant_foreign(m) then return answer_all(i, count, {'foreign'}) end
  local old_tail, was_closed = m.tail, m.closed
  changed, appended = false, {}
  i = i + 1
  for _ = 1, count do
    local first = i + 11
    local last = first + 2 * tonumber(ARGV[i + 10]) - 1
    writing = false
    local result
    ok, result = pcall(append_one, ARGV[i], ARGV[i + 1] == '1', ARGV[i + 2], ARGV[i + 3], ARGV[i + 4],
      ARGV[i + 5], ARGV[i + 6], ARGV[i + 7], ARGV[i + 8], ARGV[i + 9], first, last)
    if not ok then
      result = {'error', writing and 'partial' or 'none', error_text(result)}
      redis.log(redis.LOG_WARNING, 'append failed: ' .. result[3])
    end
    results[#results + 1] = result
    i = last + 1
  end
  if not changed then return i end
  local e
  ok, e = pcall(finish_stream, old_tail, was_closed)
  if not ok then redis.log(redis.LOG_WARNING, 'after appending: ' .. error_text(e)) end
  return i
end

local i = 4
for k = 0, (#KEYS - 1 - tenant_keys) / 6 - 1 do
  META, LOG, PROD, FORKS, CHANNEL, SUBS = KEYS[6 * k + 1], KEYS[6 * k + 2], KEYS[6 * k + 3], KEYS[6 * k + 4],
    KEYS[6 * k + 5], KEYS[6 * k + 6]
  i = append_stream(i)
end
tenant_saved()
return results
