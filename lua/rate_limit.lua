-- rate_limit.lua: take tokens from token buckets (--rate-limits; shared by
-- every gateway, so it runs on Redis' clock, never a caller's). One call takes
-- for every request a gateway process had waiting (gateway/features/ratelimit.py
-- batches them), in order; the same bucket may appear more than once.
-- KEYS[i] a bucket (keys.rate_bucket; not a stream's key: the prelude's names
-- for KEYS[1..5] go unused): a hash of 't' (tokens) and 'ts' (when they were
-- counted, ms), expiring once the bucket would be full again, so an idle
-- bucket is simply a missing key, which counts as full.
-- ARGV: 1.. takes: a group per key, in KEYS order (ARGV takes).
-- ARGV takes: 1 rate: tokens per second, 2 burst: the bucket's size (both > 0),
--   3 cost: tokens to take.
-- Returns one number per key: 0 taken, or the ms until the cost will be there
-- (nothing taken; unless others take tokens meanwhile).
-- A cost above the burst takes a full bucket (it could never be there, and
-- the caller would wait forever); a negative cost counts as 0. A refusal
-- writes nothing, so a flood of refused requests costs Redis no writes.
-- Buckets are not written to the AOF or sent to replicas: they are cheap to
-- lose (a restart or failover refills them), and a write kept out of the AOF
-- needs no fsync, which with appendfsync always would cost every limited
-- request a second one (its append has its own).
redis.set_repl(redis.REPL_NONE)
local function usable(n) return n and n > 0 and n < math.huge end
-- The longest expiry set: a bucket refilling slower than this counts as full
-- after this long idle (about ten years: a limit nobody would notice).
local MAX_TTL_MS = 315360000000
local now = now_ms()

local function take(bucket, rate, burst, cost)
  cost = math.max(0, math.min(cost, burst))
  local state = redis.call('HMGET', bucket, 't', 'ts')
  local tokens, last = tonumber(state[1]), tonumber(state[2])
  if not tokens or not last then
    tokens, last = burst, now
  end
  -- A clock that went back (a failover to a server with another clock) adds no
  -- tokens, and takes none: the bucket goes on from now.
  local elapsed = math.max(0, now - last)
  tokens = math.min(burst, math.max(0, tokens) + elapsed * rate / 1000)
  if tokens < cost then
    return math.max(1, math.ceil((cost - tokens) * 1000 / rate))
  end
  if cost > 0 then
    tokens = tokens - cost
    redis.call('HSET', bucket, 't', string.format('%.17g', tokens), 'ts', fmt(now))
    local full_ms = math.ceil((burst - tokens) * 1000 / rate)
    redis.call('PEXPIRE', bucket, math.max(1, math.min(full_ms, MAX_TTL_MS)))
  end
  return 0
end

local out = {}
for i, bucket in ipairs(KEYS) do
  local rate, burst, cost = tonumber(ARGV[3 * i - 2]), tonumber(ARGV[3 * i - 1]), tonumber(ARGV[3 * i])
  if not (usable(rate) and usable(burst) and cost and cost == cost) then
    return redis.error_reply('ERR rate_limit: rate and burst must be positive numbers, cost a number')
  end
  out[i] = take(bucket, rate, burst, cost)
end
return out
