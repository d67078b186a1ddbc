-- sub_note.lua: the worker tells a subscription the tails of its streams that grew
-- (from the outboxes); what is above a stream's acked offset is pending, and an idle
-- subscription with pending work gets a new wake (spec 7).
-- KEYS: the subscription's (_subs.lua).
-- ARGV: 1 new_wake_id: a fresh wake id (used if a wake begins), 2.. streams: a group
--   per stream (ARGV streams).
-- ARGV streams: 1 path: the stream's path, 2 tail: its tail, 3 incarnation: its
--   incarnation (a stream created anew starts over: its acked offset goes back to -1).
-- Returns {'gone'} (no such subscription) | {'ok', types... (per stream, '' not linked)}.
if redis.call('EXISTS', S) == 0 then return {'gone'} end
local now = now_ms()
expire_lease(now, ARGV[1])
local out = {'ok'}
for i = 2, #ARGV, 3 do out[#out + 1] = observe(ARGV[i], ARGV[i + 1], ARGV[i + 2]) or '' end
if sget('wake') == '' and sget('holder') == '' then begin_wake(now, ARGV[1]) end
return out
