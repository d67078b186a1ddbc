-- append.lua: POST. Append (and/or close) with Stream-Seq and idempotent
-- producer checks, committed together with the data.
-- ARGV: 1 request content type normalized ('' when the body is empty),
--   2 '1' to close after appending, 3 Stream-Seq ('' none), 4 producer id
--   ('' none), 5 producer epoch, 6 producer seq, 7 largest append (bytes)
--   whose data rides along in the notice, 8.. entries (none = close-only).
-- Publishes on the notify channel "<old tail> <new tail> <closed 0|1>", plus
--   for small appends " <len>,<len>,...\n<data><data>..." (gateway/notices.py).
-- Returns {status, ...}:
--   {'ok', tail, closed}            appended / closed
--   {'dup', tail, closed, epoch, seq} producer retry, already applied
--   {'closed', tail}                the stream is closed (409)
--   {'ct_mismatch'} {'seq_regress'} {'bad_epoch_seq'}
--   {'stale_epoch', epoch}  {'seq_gap', expected, received}
--   {'missing'} {'gone'}
local ctn, close, sseq, pid = ARGV[1], ARGV[2] == '1', ARGV[3], ARGV[4]
local has_data = #ARGV >= 8
local now = now_ms()
local m = load_meta()
local status = resolve(m, now)
if status ~= 'ok' then return {status} end

local tuple = nil
if pid ~= '' then tuple = pid .. '\n' .. ARGV[5] .. '\n' .. ARGV[6] end
if m.closed then
  if tuple and m.closed_by == tuple then return {'dup', m.tail, '1', ARGV[5], ARGV[6]} end
  if close and not has_data then touch(m, now, 0); return {'ok', m.tail, '1'} end
  return {'closed', m.tail}
end
if has_data and ctn ~= m.ctn then return {'ct_mismatch'} end

local epoch, seq = tonumber(ARGV[5]), tonumber(ARGV[6])
if tuple then
  local state = redis.call('HGET', PROD, pid)
  if state then
    local cur, last = string.match(state, '^(%d+):(%d+)$')
    cur, last = tonumber(cur), tonumber(last)
    if epoch < cur then return {'stale_epoch', fmt(cur)} end
    if epoch == cur then
      if seq <= last then return {'dup', m.tail, '0', ARGV[5], fmt(last)} end
      if seq ~= last + 1 then return {'seq_gap', fmt(last + 1), ARGV[6]} end
    elseif seq ~= 0 then
      return {'bad_epoch_seq'}
    end
  elseif seq ~= 0 then
    return {'seq_gap', '0', ARGV[6]}
  end
end
if sseq ~= '' and m.seq and not bytes_less(m.seq, sseq) then return {'seq_regress'} end

local old_tail = m.tail
local fields = {'tail', fmt(add_entries(m, 8, now, tuple and (ARGV[5] .. ' ' .. ARGV[6] .. ' ' .. pid)))}
if sseq ~= '' then fields[#fields + 1] = 'seq'; fields[#fields + 1] = sseq end
if close then
  fields[#fields + 1] = 'closed'; fields[#fields + 1] = '1'
  if tuple then fields[#fields + 1] = 'closed_by'; fields[#fields + 1] = tuple end
end
redis.call('HSET', META, unpack(fields))
if tuple then redis.call('HSET', PROD, pid, ARGV[5] .. ':' .. ARGV[6]) end
touch(m, now, 0)
if m.exp and not m.ttl then apply_expiry(m) end
local notice = old_tail .. ' ' .. fields[2] .. (close and ' 1' or ' 0')
if has_data and tonumber(fields[2]) - tonumber(old_tail) <= tonumber(ARGV[7]) then
  local lengths = {}
  for i = 8, #ARGV do lengths[#lengths + 1] = #ARGV[i] end
  notice = notice .. ' ' .. table.concat(lengths, ',') .. '\n' .. table.concat(ARGV, '', 8)
end
redis.call('PUBLISH', CHANNEL, notice)
return {'ok', fields[2], close and '1' or '0'}
