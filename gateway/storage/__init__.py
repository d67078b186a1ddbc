"""Streams stored in Redis: key names, the Lua scripts, the client, and the
Store the HTTP handlers call.

``store.py`` is the facade (create, delete, and the entry points below);
``appends.py`` batches appends into append.lua calls, ``reads.py`` reads hot
(Redis), cold (the archive) and bulk (plain XRANGE), ``forks.py`` creates and
releases forks, ``outcomes.py`` turns script answers and Redis failures into
protocol errors. ``limits.py`` holds the bounds on what one request makes Redis
do. ``fanout.py`` wakes live readers from pub/sub (``channels.py``: what a
notice does for a channel's readers; ``listener.py``: one pub/sub connection and
its task; on Redis Cluster ``shards.py`` routes channels to ``shard_listener.py``,
one sharded pub/sub connection per shard primary). ``client.py`` makes the Redis
clients, ``routing.py`` sends a stream's commands to the node serving its slot
(following cluster redirects) and ``scripts.py`` runs the Lua scripts through it
(with ``WAIT`` for ``--min-replicas-ack``). ``hints.py`` tells archive workers which
streams grew; ``durability.py`` checks Redis' persistence and eviction policy,
``layout.py`` the version of the key layout, and ``preflight.py`` runs those
checks at start, waiting (with backoff) for a Redis that is not there yet.
"""
