"""Bounds on what one request makes Redis do (README, "Every request is bounded"),
in one place: the storage modules and the tests import them from here."""

APPEND_LANES = 4  # concurrent append round trips per process
# One script call copies at most this many log entries (~5 µs each in Lua) ...
MAX_SCRIPT_ENTRIES = 1000
# ... one read response (a plain XRANGE, for bulk reads) at most this many ...
MAX_READ_ENTRIES = 16384
# ... a batch of appends adds at most this many (one large append still goes alone) ...
MAX_BATCH_ENTRIES = 512
# ... a fork's sub-offset counts at most this many JSON messages, and a fork
# reads through at most this many ancestors (one round trip each).
MAX_FORK_SUB_MESSAGES = 65536
MAX_FORK_DEPTH = 64
