"""Live fan-out: waking a process' live readers (long-poll, SSE) from Redis pub/sub.

``fanout.py`` is the entry point (``Fanout.watch`` registers a reader); ``channels.py``
holds one channel's waiting readers and what a notice does for them (including writing
small appends to a parked reader's ``Sink`` itself; the sinks are the HTTP layer's);
``listener.py`` is one pub/sub connection and its task; on Redis Cluster ``shards.py``
routes channels to ``shard_listener.py``, one sharded pub/sub connection per shard primary.
``timers.py`` is the one timer wheel every waiting reader's timeout is on.

Only the HTTP layer uses this package; it writes nothing to sockets of its own.
"""
