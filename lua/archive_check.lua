-- archive_check.lua: is this incarnation's archive still needed? Its stream
-- exists (or is soft-deleted with forks reading it) under the same
-- incarnation. A dead incarnation never lives again (ids are random).
-- ARGV: 1 incarnation.
-- Returns {'live'} | {'dead'}.
local m = load_meta()
if resolve(m, now_ms()) == 'missing' or m.inc ~= ARGV[1] then return {'dead'} end
return {'live'}
