-- sub_links.lua: links streams to a subscription, or unlinks them (spec 6.4): explicit
-- links (the API) and glob links (the worker: new streams matching the pattern,
-- and the pattern's existing streams after creation).
-- KEYS: the subscription's (_subs.lua).
-- ARGV: 1 op: 'add' | 'remove', 2 kind: link type 'e' | 'g', 3.. streams: per stream:
--   path, its tail, incarnation (its meta 'created', ms) (remove: the path alone). A new
--   explicit link starts at the tail (spec 6.4); a new glob link at -1 (before the
--   first byte) if the stream was made after the subscription, else at the tail (6.2).
-- An added stream already linked keeps its cursor and gains the type; a removed
-- type leaves the other (a glob link stays when the explicit one goes).
-- Returns {'missing'} | {'ok', types... (the types left per stream, '' unlinked)}.
if redis.call('EXISTS', S) == 0 then return {'missing'} end
local op, kind = ARGV[1], ARGV[2]
local step = op == 'add' and 3 or 1
local out = {'ok'}
for i = 3, #ARGV, step do
  local path = ARGV[i]
  local value = redis.call('HGET', L, path)
  local types, acked, inc = '', '', ''
  if value then types, acked, inc = link_parts(value) end
  if op == 'add' then
    if not value then
      acked, inc = ARGV[i + 1], ARGV[i + 2]
      if kind == 'g' and (tonumber(inc) or 0) > tonumber(sget('created_ms') or '0') then acked = '-1' end
    end
    if not string.find(types, kind, 1, true) then
      types = (kind == 'e') and ('e' .. types) or (types .. 'g')
    end
    redis.call('HSET', L, path, link_value(types, acked, inc))
  elseif value then
    types = string.gsub(types, kind, '')
    if types == '' then
      redis.call('HDEL', L, path)
      redis.call('HDEL', P, path)
    else
      redis.call('HSET', L, path, link_value(types, acked, inc))
    end
  end
  out[#out + 1] = types
end
return out
