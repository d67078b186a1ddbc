"""Bounds on what one request makes Redis do (README, "Every request is bounded"),
in one place: the storage modules and the tests import them from here."""

# Concurrent append round trips per process. Fewer lanes, larger batches, and each call has a
# fixed cost in the gateway whatever it carries: on 1,000 streams at 64 writers, four lanes made
# calls of ~6 appends and cost 103 µs of gateway CPU an append; two lanes 83, one 73 (p99 alike).
# Measured again with appends answered on the connection: the append layer alone (no HTTP) 19.5
# µs an append with one lane, 23.5 with two, 29.7 with four, and the most appends/s with one.
APPEND_LANES = 1
# On a Redis Cluster a lane's batch is split by slot into calls to several nodes at once; two
# lanes let one batch's calls go while another's slowest node still answers.
CLUSTER_APPEND_LANES = 2
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
# A larger append goes alone, in steps (scripts) of at most this many stored bytes: Redis
# takes ~2.5 ms per MiB appended in a script (its AOF and the copies), and a script runs
# alone on Redis, so each stays within ~5 ms however large the body (streams/appends.py).
STEP_BYTES = 1024 * 1024
# How long an append waits behind a large append to its stream before it gets 503.
BUSY_WAIT_SECONDS = 10.0
