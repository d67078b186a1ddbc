-- delete.lua: DELETE. Removes the stream, or soft-deletes it while forks
-- still read its data (reads of its own URL then answer 410). Only pinning
-- forks count (FORKS, see fork_ref.lua): a stream with weak forks alone is
-- removed, and their reads of what they inherited from it answer 410.
-- KEYS: the five stream keys, 6 its subscription links, 7 its slot's stream index
--   (it leaves the listing, soft-deleted too), 8 its slot's outbox: a stream with
--   subscribers goes in the outbox, so the workers drop its glob links (spec 6.1: a
--   deleted stream leaves the pattern's; explicit links stay).
--   Then its tenant's five keys when the call is made for one (_tenants.lua), its
--   slot's outbox last.
-- ARGV: 1 wake_channel: the channel that wakes subscription workers, 2 tenant: the tenant
--   the call is made for ('' none): its stream's bytes and place are given back once the
--   stream is dropped (a soft-deleted one stays counted while its forks keep its data:
--   the sweep gives it back once the last fork let it go), and another tenant's stream is
--   not deleted.
-- Returns {'deleted', source (its source id, or ''), source_uid (the source
--   incarnation, meta 'src_uid', or ''), snapshot_file (its snapshot's blob file,
--   gateway/features/snapshots.py, or '')} | {'soft'} | {'missing'} | {'gone'} | {'foreign'}.
WAKE = ARGV[1]
local INDEX = KEYS[7]
local now = now_ms()
tenant_bind(8, ARGV[2], now)
local reply = with_stream(now, function(m)
  if tenant_foreign(m) then return {'foreign'} end
  publish('deleted')
  redis.call('ZREM', INDEX, stream_sid())
  record_for_subscribers(false)
  if redis.call('SCARD', FORKS) > 0 then
    redis.call('HSET', META, 'deleted', '1')
    apply_expiry(m)
    return {'soft'}
  end
  drop()
  tenant_release(stream_sid())
  return {'deleted', m.src or '', m.src_uid or '', m.snap_file or ''}
end)
if reply[1] == 'missing' then tenant_release(stream_sid()) end  -- it expired: given back now
tenant_saved()
return reply
