-- append.lua: POST. Appends that reached a gateway together
-- (gateway/streams/appends.py), to one or more streams: each checked and applied in
-- order exactly as if it came alone (closure, content type, idempotent producer,
-- If-Match, Stream-Expected-Offset and Stream-Seq checks, in that order: see
-- append_one), committed together with its data. A condition is checked against the
-- stream as the appends before it in the call left it. What a stream's appends commit is
-- written once after them (its meta, its producers: stage_commit), and its small appends'
-- entries are stored merged (see MERGE_BYTES): Redis' work is per stream of a call, as
-- far as it can be, not per append.
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
-- ARGV appends: 1 head: the append's fixed fields, joined by '\n' (none holds one: they
--   come from header values): media_type (content type normalized, '' when the body is
--   empty), close ('1' to close after appending), stream_seq (Stream-Seq, '' none),
--   if_match (If-Match, '' none; else as gateway/protocol/conditions.py encodes it, see
--   if_match), expected_offset (Stream-Expected-Offset as a position, '' none), token
--   (a large append's, written in steps: '' none; see PEND_MS in _prelude.lua: this call
--   checks it and marks it under way, and writes its entries, if any, as its first part),
--   total ("<positions> <bytes>" the whole of a large append takes, '' none); or '': the
--   same as the append before it in the call (the common case: each argument costs Redis
--   and Lua a string), 2 producer: "<epoch> <seq> <id>" of an idempotent producer ('' none;
--   also what each entry stores, see add_entries), 3 entry_count: entry count k, 4..
--   entries: the k entries (none = close-only), each as two arguments: the positions it
--   takes, its bytes (add_entries in _prelude.lua; gateway/protocol/entries.py).
-- A stream with subscribers (its links exist) whose tail moved is put in the
-- outbox for the subscription workers (workers/delivery.py), in this script: a
-- crash after it cannot lose the wake; the first such append since the workers
-- last took it also publishes the outbox's name on the wake channel.
-- Publishes (publish() in _prelude.lua) one notice per changed stream on its notify channel:
--   "<old tail> <new tail> <closed 0|1>", plus for small appends
--   " <size>,<size>,...\n<data><data>..." (gateway/protocol/notices.py), a size being an
--   entry's length, or "<length>:<positions>" for a JSON entry of several messages.
-- Each append runs under pcall: an error in one (a corrupt key) is that append's result
-- alone; the batch goes on. A stream's write that fails (a refusal such as OOM or
-- READONLY at the script's first write, a corrupt log) fails every append of that stream
-- in the call that was to be stored with it (fail_stream); other streams' go on. Checks
-- come before writes, and Redis refuses a script's writes only at its first one, so a
-- failed append has written nothing unless the error hit between writes (reported as
-- 'partial'; not seen in practice).
-- Returns one result per append, in ARGV order, except that one result answers a run of
--   plain appends (stored, not closing) to one stream, one after another in ARGV, with
--   answers: their number when more than one (expand_runs in gateway/streams/appends.py).
--   Its tail is where the last of them ended, and each one before ended where the one
--   after it began: that tail less the positions the one after it took.
--   {'ok', tail, closed[, created[, answers]]}  appended / closed (created: the incarnation, for
--                                    the ETag; none when a close-only append found it closed)
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

local function clear(list) for k = #list, 1, -1 do list[k] = nil end end

-- A count argument as a number: nearly always '1', which compares as a pointer (Lua interns
-- strings), where tonumber costs ~1k instructions (glibc's strtod), twice an append.
local function count_of(text) if text == '1' then return 1 end return tonumber(text) end

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
-- (Its tables are made once and emptied for each stream: a call holds up to hundreds of
-- streams, and each table made is one more for Lua's collector.)
local appended = {}  -- ARGV indices of the entries appended (their sizes), for the notice
local writing  -- an append has stored something: an error after it is 'partial'
local stream_wrote  -- something of the stream's went in during this call (see lost)
local function mark_writing() writing, stream_wrote = true, true end
-- What its appends committed (stage_commit), written once after them (save_staged).
-- An append's checks read `m` and `staged.prod`, so each sees the ones before it.
local staged = {meta = {}, prod = {}}
local tail_n  -- m.tail as a number

-- Small appends to a stream in one call are stored together: their entries joined into
-- entries of up to MERGE_BYTES (a JSON stream's messages joined by '\n', at most
-- MERGE_MESSAGES: the bounds of gateway/protocol/entries.py), one XADD for many appends,
-- not one each (the XADDs, their propagation to the AOF and replicas, and their memory were
-- most of what Redis spent per append on one stream: docs/benchmarks.md). Entries are not
-- append boundaries to readers: reads cut byte entries anywhere and split JSON ones into
-- messages. An idempotent producer's append (its entries carry the producer), a large
-- append's and a compacted stream's (a message an entry) are written as they come, after
-- what was merged before them.
local MERGE_BYTES, MERGE_MESSAGES = 65536, 1024
-- The stream's entries not written yet: at (position), datas, took, bytes, messages.
local merged = {datas = {}}
local lost  -- a write of the stream's failed (flush, save_staged): its appends in this call fail

local function write_merged()
  local datas = merged.datas
  local data = #datas == 1 and datas[1] or table.concat(datas, merged.json and '\n' or '')
  redis.call('XADD', LOG, eid(merged.at), 'd', data, 't', now_text)
end

local function flush()
  if #merged.datas == 0 then return end
  local ok, e = pcall(write_merged)
  if not ok then lost = error_text(e); error(e) end
  stream_wrote = true
  clear(merged.datas)
  merged.at, merged.took, merged.bytes, merged.messages = merged.at + merged.took, 0, 0, 0
end

-- An append's entries ARGV[first..last], committed at the tail `from`, merged.
local function merge_entries(from, first, last)
  if #merged.datas == 0 then merged.at = from end
  for k = first, last, 2 do
    local data = ARGV[k + 1]
    local took, messages = #data, 0
    if merged.json then
      took = tonumber(ARGV[k])
      messages = #data - took + 1
    end
    local size = #data + (merged.json and 1 or 0)  -- (with its '\n')
    if merged.bytes + size > MERGE_BYTES or merged.messages + messages > MERGE_MESSAGES then flush() end
    merged.datas[#merged.datas + 1] = data
    merged.took, merged.bytes = merged.took + took, merged.bytes + size
    merged.messages = merged.messages + messages
  end
end

-- An entry's size in a notice: its length, or "<length>:<positions>" when it takes
-- other positions than bytes (a JSON entry of several messages). A byte entry takes its
-- length: the positions argument is its size as it is (no number made into text again).
local function notice_size(index)
  local data, took = ARGV[index + 1], ARGV[index]
  if not merged.json or #data == tonumber(took) then return took end
  return #data .. ':' .. took
end

-- After a stream's appends: move its deadline and publish what changed.
local function finish_stream(old_tail, old_n, was_closed)
  touch(m, now, 0)
  if m.exp and not m.ttl then apply_expiry(m) end  -- a new log key needs the deadline too
  if m.tail ~= old_tail or m.closed ~= was_closed then
    local notice = old_tail .. ' ' .. m.tail .. (m.closed and ' 1' or ' 0') .. ' t' .. now_text
    if #appended > 0 and tail_n - old_n <= notice_bytes then
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

-- The head in force (ARGV appends' 1: '' repeats the one before), parsed once each.
local head_text, head
local function head_of(text)
  if text ~= '' and text ~= head_text then
    local ctn, close, sseq, im, eo, token, total =
      string.match(text, '^(.-)\n(.-)\n(.-)\n(.-)\n(.-)\n(.-)\n(.-)$')
    head_text = text
    head = {ctn = ctn, close = close == '1', sseq = sseq, im = im, eo = eo, token = token, total = total}
  end
  return head
end

-- What append_one answers for a plain append (stored, not closing): the stream's plain
-- appends one after another share one result, a run (Returns, append_stream). A result per
-- append, turned into RESP and read by the gateway, was ~14% of what Redis spent per append
-- on one stream (docs/benchmarks.md).
local PLAIN = {}

-- One append to the stream `m`: its checks, then its entries and commit.
local function append_one(h, producer, first, last)
  local ctn, close, sseq, im, eo, token, total = h.ctn, h.close, h.sseq, h.im, h.eo, h.token, h.total
  if m.pend then return {'busy', m.pend_until} end  -- behind a large append this call began
  local has_data = last >= first or token ~= ''  -- a large append begins without its data
  local tuple, pid, ep, sq = nil, nil, nil, nil
  if producer ~= '' then
    ep, sq, pid = string.match(producer, '^(%d+) (%d+) (.*)$')
    tuple = pid .. '\n' .. ep .. '\n' .. sq
  end
  if m.closed then
    if tuple and m.closed_by == tuple then return {'dup', m.tail, '1', ep, sq} end
    if close and not has_data then changed = true; return {'ok', m.tail, '1'} end
    return {'closed', m.tail}
  end
  if has_data and ctn ~= m.ctn then return {'ct_mismatch'} end
  if tuple then
    local epoch, seq = tonumber(ep), tonumber(sq)
    local state = staged.prod[pid] or redis.call('HGET', PROD, pid)
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

  local from, tail = tail_n, nil
  local merging = not tuple and token == '' and not m.cmp
  if merging then  -- (a byte entry takes its length: no tonumber)
    tail = from
    if merged.json then
      for k = first, last, 2 do tail = tail + tonumber(ARGV[k]) end
    else
      for k = first + 1, last, 2 do tail = tail + #ARGV[k] end
    end
  else
    flush()  -- (what was merged before it goes first)
    tail = add_entries(m, first, last, now_text, tuple and producer, mark_writing)
  end
  if token ~= '' then  -- a large append's first part: beyond the tail, not committed
    m.pend = token
    -- (its tenant is charged, and checked again, when the last part commits it: pend_tb)
    redis.call('HSET', META, 'pend', token, 'pend_at', fmt(tail), 'pend_tb', fmt(size),
      'pend_to', fmt(tonumber(m.tail) + tonumber(string.match(total, '^%d+'))), 'pend_until', fmt(now + PEND_MS))
    return {'pending', m.tail, m.cmp and '1' or '0'}
  end
  stage_commit(m, staged, tail, sseq, close, tuple, pid, ep, sq)
  tail_n = tail
  if merging then  -- (committed: stored with the stream's, so an error after this is 'partial')
    writing = true
    merge_entries(from, first, last)
  end
  if TN and has_data then
    if adopt then tenant_adopt(m) end
    tenant_charge(size, false)
    TN.appends = TN.appends + 1
  end
  -- Its entries ride the notice only once committed: one whose commit failed (an error
  -- after its XADDs, 'partial') must not reach readers beside the appends that did.
  for i = first, last, 2 do appended[#appended + 1] = i end
  changed = true
  if close then return {'ok', m.tail, '1', m.created} end
  return PLAIN
end

-- The next `n` appends, from ARGV index `i`, all answered `result`; returns the index after them.
local function answer_each(i, n, result)
  for _ = 1, n do
    results[#results + 1] = result
    head_of(ARGV[i])  -- (the next append's '' may repeat it)
    i = i + 3 + 2 * count_of(ARGV[i + 2])
  end
  return i
end

-- Every append of the stream gets the same `result`; returns the ARGV index after them.
local function answer_all(i, count, result) return answer_each(i + 1, count, result) end

-- A write of the stream's failed (`lost`): its state as its appends in this call left it is
-- not stored, so every one of them fails, whatever it was answered (a refusal or a producer's
-- duplicate was decided against that state too): the `done` ones answered so far (their
-- results from results[first_result] on: a run answers several with one) and the `remaining`
-- ones from ARGV index `i`, each with 'none' when nothing of the stream's went in, else
-- 'partial' (not seen in practice: Redis refuses a script's writes only at its first); what
-- they were charged to their tenant (`charged`, tenant_mark) is taken back. Returns the index
-- after them.
local function fail_stream(first_result, done, i, remaining, charged)
  local failure = {'error', stream_wrote and 'partial' or 'none', lost}
  redis.log(redis.LOG_WARNING, 'append failed: ' .. lost)
  for k = #results, first_result, -1 do results[k] = nil end
  for _ = 1, done do results[#results + 1] = failure end
  tenant_undo(charged)
  return answer_each(i, remaining, failure)
end

-- The appends of the stream whose keys are bound now; `i` indexes its count in ARGV.
-- Returns the ARGV index after its last append.
local function append_stream(i)
  local count = count_of(ARGV[i])
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
  tail_n = tonumber(m.tail)
  local old_n = tail_n
  changed = false
  clear(appended)
  local fields, states = staged.meta, staged.prod
  fields.tail, fields.seq, fields.closed, fields.closed_by = nil, nil, nil, nil  -- (all stage_commit sets)
  if next(states) then for id in pairs(states) do states[id] = nil end end
  clear(merged.datas)
  merged.took, merged.bytes, merged.messages, merged.json = 0, 0, 0, m.ctn == 'application/json'
  lost, stream_wrote = nil, false
  local first_result, charged = #results + 1, tenant_mark()
  local run  -- the result answering the plain appends just before (PLAIN), if any
  i = i + 1
  for n = 1, count do
    local first = i + 3
    local last = first + 2 * count_of(ARGV[i + 2]) - 1
    writing = false
    local result
    ok, result = pcall(append_one, head_of(ARGV[i]), ARGV[i + 1], first, last)
    if not ok then
      result = {'error', writing and 'partial' or 'none', error_text(result)}
      redis.log(redis.LOG_WARNING, 'append failed: ' .. result[3])
    end
    if result == PLAIN and run then
      run[2], run[5] = m.tail, (run[5] or 1) + 1
    else
      if result == PLAIN then
        result = {'ok', m.tail, '0', m.created}
        run = m.created and result  -- (answers goes fifth: not without a created before it)
      else
        run = nil
      end
      results[#results + 1] = result
    end
    i = last + 1
    if lost then return fail_stream(first_result, n, i, count - n, charged) end
  end
  local e
  ok, e = pcall(flush)
  if ok then ok, e = pcall(save_staged, staged) end  -- (fails only with a corrupt producers key)
  if not ok then
    lost = lost or error_text(e)
    return fail_stream(first_result, count, i, 0, charged)
  end
  if not changed then return i end
  ok, e = pcall(finish_stream, old_tail, old_n, was_closed)
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
