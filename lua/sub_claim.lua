-- sub_claim.lua: POST __ds/subscriptions/:id/claim (pull-wake, spec 7.2): a worker
-- takes the lease of the subscription's wake (one begins if work is pending).
-- KEYS: the subscription's (_subs.lua).
-- ARGV: 1 worker: the worker's name, 2 new_wake_id: a fresh wake id, 3.. streams: per
--   linked stream its tail read just before, a group each (ARGV streams; so the claim
--   sees every append acknowledged before it, not only what the worker has told it of).
-- ARGV streams: 1 path: the stream's path, 2 tail: its tail, 3 incarnation: its
--   incarnation.
-- Returns {'missing'} | {'wrong_type'} | {'busy', holder, generation} | {'idle'}
--   (no pending work) | {'claimed', generation, wake_id, lease_ms, streams (flat
--   {path, types, acked, tail, ...})}.
if redis.call('EXISTS', S) == 0 then return {'missing'} end
if sget('type') ~= 'pull-wake' then return {'wrong_type'} end
local now = now_ms()
expire_lease(now, ARGV[2])
for i = 3, #ARGV, 3 do observe(ARGV[i], ARGV[i + 1], ARGV[i + 2]) end
if sget('holder') ~= '' then return {'busy', sget('holder'), sget('gen')} end
if sget('wake') == '' and not begin_wake(now, ARGV[2]) then return {'idle'} end
-- The claim covers everything pending now, not only the wake's first snapshot.
local pend = redis.call('HGETALL', P)
if #pend == 0 then  -- its streams were acked or unlinked since: the wake ends
  end_wake(now, ARGV[2])
  return {'idle'}
end
local snap, out = {}, {}
for i = 1, #pend, 2 do
  local path, tail = pend[i], pend[i + 1]
  local types, acked, inc = link_parts(redis.call('HGET', L, path) or 'g|-1|')
  snap[#snap + 1] = path .. '\t' .. tail .. '\t' .. inc
  out[#out + 1] = path; out[#out + 1] = types; out[#out + 1] = acked; out[#out + 1] = tail
end
local ttl = tonumber(sget('ttl'))
redis.call('HSET', S, 'holder', ARGV[1], 'lease_until', now + ttl, 'emit', '0', 'snap', table.concat(snap, '\n'))
schedule(now + ttl)
return {'claimed', sget('gen'), sget('wake'), sget('ttl'), out}
