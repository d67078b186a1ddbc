-- archive_named.lua: which of these files must stay? Asked before every file
-- delete, so no worker deletes a file a read may need: one named by a
-- committed or staged segment of a live incarnation (a staged file is being
-- written, or rewritten, by the lease holder). Read-only and not fenced: a
-- worker that lost its lease asks it before deleting a file it wrote late.
-- KEYS: the stream's five (see _prelude.lua), KEYS[6] the lease (unused),
--   KEYS[7] the segment set of incarnation ARGV[2] (keys.segments).
-- ARGV: 1 token: lease token (unused), 2 incarnation: the files' incarnation,
--   3.. files: the files asked about.
-- Returns the files to keep (none when the incarnation is dead: its stream
--   is gone, so no read reaches its files).
if not incarnation(ARGV[2]) then return {} end
local named = {}
for _, member in ipairs(redis.call('ZRANGEBYSCORE', SEGS, -1, '+inf')) do
  named[string.match(member, '^%S+ %S+ %S+ %S+ (.*)$')] = true
end
local keep = {}
for i = 3, #ARGV do
  if named[ARGV[i]] then keep[#keep + 1] = ARGV[i] end
end
return keep
