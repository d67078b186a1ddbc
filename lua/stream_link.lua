-- stream_link.lua: a stream's side of its subscription links (keys.stream_subs), kept
-- by whoever links or unlinks it on the subscription's side
-- (gateway/features/subscriptions.py, workers/delivery.py); append.lua and create.lua
-- look at it to know the stream has subscribers.
-- KEYS: 1 the stream's links.
-- ARGV: 1 incarnation: the incarnation matched against the patterns ('' leave as is),
--   2.. links: a group per subscription (ARGV links).
-- ARGV links: 1 sub_id: subscription id, 2 types: its link types 'e' | 'g' | 'eg', ''
--   to unlink.
-- Returns the number of links left.
local links = KEYS[1]
if ARGV[1] ~= '' then redis.call('HSET', links, '_inc', ARGV[1]) end
for i = 2, #ARGV, 2 do
  if ARGV[i + 1] == '' then
    redis.call('HDEL', links, ARGV[i])
  else
    redis.call('HSET', links, ARGV[i], ARGV[i + 1])
  end
end
local left = redis.call('HLEN', links)
if left == 1 and redis.call('HEXISTS', links, '_inc') == 1 then
  redis.call('DEL', links)  -- no subscriber left: appends stop recording wakes
  left = 0
end
return left
