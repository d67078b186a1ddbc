-- index_add.lua: lists a live stream in its slot's stream index: `durable-streams
-- migrate`'s step to layout v2, for streams made before the index was kept
-- (create.lua and delete.lua keep it since).
-- KEYS: the five stream keys, 6 its slot's stream index (keys.stream_index).
-- ARGV: none.
-- Returns 1 when added now, else 0 (listed already, or no live stream there).
local INDEX = KEYS[6]
local _, status = open_stream(now_ms())
if status ~= 'ok' then return 0 end
return redis.call('ZADD', INDEX, 0, stream_sid())
