"""Sharing work between concurrent coroutines, without I/O of its own.

``batching.py`` (group commit: calls that arrive while one runs go together in
the next) and ``singleflight.py`` (identical concurrent calls share one run).
Used by storage (batched appends, shared live reads) and by the archive's
cold reader (shared file loads). ``backoff.py``: how long to wait before trying
again (a process waiting for Redis). ``ready.py``: a value already known, for
callers that await one (the request handlers' fast paths).
"""
