-- rate_limit.lua: take tokens from a token bucket (--rate-limits; shared by
-- every gateway, so it runs on Redis' clock, never a caller's).
-- KEYS[1] the bucket (keys.rate_bucket; not a stream's key: the prelude's
-- names for KEYS[1..5] go unused): a hash of 't' (tokens) and 'ts' (when they
-- were counted, ms), expiring once the bucket would be full again, so an idle
-- bucket is simply a missing key, which counts as full.
-- ARGV: 1 rate (tokens per second), 2 burst (the bucket's size), both > 0;
-- 3 cost (tokens to take; default 1).
-- Returns {1, 0} taken, or {0, retry_after_ms}: nothing taken, and the cost
-- will be there in that many ms (unless others take tokens meanwhile).
-- A cost above the burst takes a full bucket (it could never be there, and
-- the caller would wait forever); a negative cost counts as 0. A refusal
-- writes nothing, so a flood of refused requests costs Redis no writes.
local BUCKET = KEYS[1]
local rate, burst, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3] or '1')
local function usable(n) return n and n > 0 and n < math.huge end
if not (usable(rate) and usable(burst) and cost and cost == cost) then
  return redis.error_reply('ERR rate_limit: rate and burst must be positive numbers, cost a number')
end
cost = math.max(0, math.min(cost, burst))
-- The longest expiry set: a bucket refilling slower than this counts as full
-- after this long idle (about ten years: a limit nobody would notice).
local MAX_TTL_MS = 315360000000

local now = now_ms()
local state = redis.call('HMGET', BUCKET, 't', 'ts')
local tokens, last = tonumber(state[1]), tonumber(state[2])
if not tokens or not last then
  tokens, last = burst, now
end
-- A clock that went back (a failover to a server with another clock) adds no
-- tokens, and takes none: the bucket goes on from now.
local elapsed = math.max(0, now - last)
tokens = math.min(burst, math.max(0, tokens) + elapsed * rate / 1000)

if tokens < cost then
  return {0, math.max(1, math.ceil((cost - tokens) * 1000 / rate))}
end
if cost > 0 then
  tokens = tokens - cost
  redis.call('HSET', BUCKET, 't', string.format('%.17g', tokens), 'ts', fmt(now))
  local full_ms = math.ceil((burst - tokens) * 1000 / rate)
  redis.call('PEXPIRE', BUCKET, math.max(1, math.min(full_ms, MAX_TTL_MS)))
end
return {1, 0}
