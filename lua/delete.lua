-- delete.lua: DELETE. Removes the stream, or soft-deletes it while forks
-- still read its data (reads of its own URL then answer 410). Only pinning
-- forks count (FORKS, see fork_ref.lua): a stream with weak forks alone is
-- removed, and their reads of what they inherited from it answer 410.
-- KEYS: the five stream keys, 6 its subscription links, 7 its slot's stream index
--   (it leaves the listing, soft-deleted too), 8 its slot's outbox: a stream with
--   subscribers goes in the outbox, so the workers drop its glob links (spec 6.1: a
--   deleted stream leaves the pattern's; explicit links stay).
-- ARGV: 1 wake_channel: the channel that wakes subscription workers.
-- Returns {'deleted', source (its source id, or ''), source_uid (the source
--   incarnation, meta 'src_uid', or ''), snapshot_file (its snapshot's blob file,
--   gateway/features/snapshots.py, or '')} | {'soft'} | {'missing'} | {'gone'}.
WAKE = ARGV[1]
local INDEX = KEYS[7]
return with_stream(now_ms(), function(m)
  publish('deleted')
  redis.call('ZREM', INDEX, stream_sid())
  record_for_subscribers(false)
  if redis.call('SCARD', FORKS) > 0 then
    redis.call('HSET', META, 'deleted', '1')
    apply_expiry(m)
    return {'soft'}
  end
  drop()
  return {'deleted', m.src or '', m.src_uid or '', m.snap_file or ''}
end)
