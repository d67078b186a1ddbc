"""Redis I/O: the clients, key names, the Lua scripts and what their answers mean.

``connections.py`` makes the Redis clients (bounded pools; the helpers that visit every
node of a cluster), ``routing.py`` sends a stream's commands to the node serving its
slot (following cluster redirects), ``scripts.py`` runs the Lua scripts through it (with
``WAIT``/``WAITAOF`` for ``--min-replicas-ack``), ``lua.py`` finds their sources, and
``keys.py`` names every key. ``outcomes.py`` turns script answers and Redis failures into
protocol errors; ``limits.py`` holds the bounds on what one request makes Redis do.
``durability.py`` checks Redis' persistence and eviction policy, ``layout.py`` the
version of the key layout (and migrates it), and ``preflight.py`` runs those checks at
start, waiting (with backoff) for a Redis that is not there yet.

Nothing here knows HTTP or the stream operations built on top (``gateway/streams``).
"""
