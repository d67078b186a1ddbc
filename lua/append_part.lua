-- append_part.lua: the next step of a large append that append.lua began (see PEND_MS
-- in _prelude.lua): its entries go on beyond the tail, where no read looks; the last
-- step commits them all at once, as append.lua commits an append (the tail moves, with
-- the append's Stream-Seq, close and producer state; a notice without data; subscribers).
-- KEYS: the five stream keys, its subscription links (keys.stream_subs), its tenant's five
--   keys when it has one (_tenants.lua), its slot's outbox.
-- ARGV: 1 token: the writer's token, 2 step: 'part' | 'last' | 'abort' (drop what was
--   written), 3 close: '1' to close, 4 stream_seq: Stream-Seq ('' none),
--   5 producer_id: producer id ('' none), 6 producer_epoch: producer epoch,
--   7 producer_seq: producer seq, 8 wake_channel: the channel that wakes subscription
--   workers, 9 tenant: the tenant it is made for ('' none), 10.. entries: entries (pairs:
--   the positions each takes, its bytes; as append.lua's).
-- The last step checks the tenant's quotas again (another append may have used them
-- since append.lua's check) and charges it (meta pend_tb): refused, nothing is stored.
-- Returns {'ok', tail, closed, created} (committed) | {'more'} | {'lost'} (this append
--   is no longer under way: rolled back after PEND_MS of silence, or aborted, or its
--   parts at the last step do not end at pend_to)
--   | {'quota', quota, limit, usage, asked} (rolled back: append.lua's refusal)
--   | {'missing'} | {'gone'}
WAKE = ARGV[8]
local token, step, close, sseq, pid, ep, sq = ARGV[1], ARGV[2], ARGV[3] == '1', ARGV[4], ARGV[5], ARGV[6], ARGV[7]
local now = now_ms()
tenant_bind(#KEYS - 5, ARGV[9], now)
local reply = with_stream(now, function(m)
  if m.pend ~= token then return {'lost'} end
  if step == 'abort' or now >= tonumber(m.pend_until) then
    roll_back(m)  -- the rest, if any, goes with the next append that finds it
    return {'lost'}
  end
  local tuple = nil
  if pid ~= '' then tuple = pid .. '\n' .. ep .. '\n' .. sq end
  local old_tail = m.tail
  m.tail = m.pend_at  -- add_entries writes at the tail: this append's next position
  local at = add_entries(m, 10, #ARGV, now, tuple and (ep .. ' ' .. sq .. ' ' .. pid))
  if step ~= 'last' then
    redis.call('HSET', META, 'pend_at', fmt(at), 'pend_until', fmt(now + PEND_MS))
    return {'more'}
  end
  if at ~= tonumber(m.pend_to) then  -- a part missing (lost to a failover, ...): not this append
    m.tail = old_tail  -- (what roll_back drops is what lies beyond it)
    roll_back(m)
    return {'lost'}
  end
  local size = tonumber(m.pend_tb or '0')
  local adopt = TN ~= nil and not m.tn  -- made while tenants were off (tenant_adopt)
  local refusal = tenant_refuses(size, adopt)
  if refusal then
    m.tail = old_tail
    roll_back(m)
    return refusal
  end
  redis.call('HDEL', META, unpack(PEND_FIELDS))
  commit(m, at, sseq, close, tuple, pid, ep, sq)
  if TN then
    if adopt then tenant_adopt(m) end
    tenant_charge(size, false)
    TN.appends = TN.appends + 1
  end
  touch(m, now, 0)
  if m.exp and not m.ttl then apply_expiry(m) end  -- a new log key needs the deadline too
  publish(old_tail .. ' ' .. m.tail .. (close and ' 1' or ' 0') .. ' t' .. fmt(now))
  record_for_subscribers(false)
  return {'ok', m.tail, close and '1' or '0', m.created}
end)
tenant_saved()
return reply
