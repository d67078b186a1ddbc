"""Stream operations over Redis: the Store the HTTP handlers call.

``store.py`` is the facade (create, append, read, delete, and the side features' verbs);
``appends.py`` batches appends into append.lua calls (large ones in steps), ``reads.py``
reads hot (Redis), cold (the archive) and bulk (plain XRANGE), ``forks.py`` creates and
releases forks, ``registry.py`` writes the ``__registry__`` stream of creates and deletes.
"""
