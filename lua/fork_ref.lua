-- fork_ref.lua: run on a fork's source before the fork is created. Records
-- the fork (a set, so retries count once) and pins the source's data.
-- ARGV: 1 the fork's id.
-- Returns {'ok', source meta} | {'missing'} | {'gone'}.
return with_stream(now_ms(), function(m)
  redis.call('SADD', FORKS, ARGV[1])
  apply_expiry(m)
  return {'ok', flat(m)}
end)
