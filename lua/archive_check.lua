-- archive_check.lua: is this incarnation's archive still needed? Its stream
-- exists (or is soft-deleted with forks reading it) under the same
-- incarnation. A dead incarnation never lives again (ids are random).
-- Fenced: reconciliation asks it under the stream's lease, then removes.
-- KEYS: the stream's five (see _prelude.lua), KEYS[6] the lease,
--   KEYS[7] the segment set of incarnation ARGV[2] (unused).
-- ARGV: 1 token: lease token, 2 incarnation: the incarnation asked about.
-- Returns {'live'} | {'dead'} | {'lost'} (the lease is not this worker's).
if not holds_lease() then return {'lost'} end
if not incarnation(ARGV[2]) then return {'dead'} end
return {'live'}
