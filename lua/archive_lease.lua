-- archive_lease.lua: keep or give up the stream's archive lease, only while it
-- is still this worker's (a worker paused past its lease must not extend or
-- delete the lease another worker now holds). The worker takes the lease with
-- a plain SET NX PX; every other archive script is fenced by it.
-- KEYS: the stream's five (see _prelude.lua), KEYS[6] the lease.
-- ARGV: 1 token: lease token, 2 hold_ms: milliseconds to hold it from now (0: release it).
-- Returns {'ok'} | {'lost'} (the lease expired or is another worker's).
if not holds_lease() then return {'lost'} end
if tonumber(ARGV[2]) > 0 then
  redis.call('PEXPIRE', KEYS[6], ARGV[2])
else
  redis.call('DEL', KEYS[6])
end
return {'ok'}
