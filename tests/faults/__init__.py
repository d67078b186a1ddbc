"""The fault-injection suite: real processes, real Redis, black-box over HTTP.

What it runs (each module's docstring has the details):

* ``test_chaos.py``: two gateways, two archive workers and a redis-server (AOF,
  ``appendfsync always``) under concurrent writers (plain and idempotent
  producers) and live readers (SSE, long-poll), while a seeded schedule SIGKILLs
  and SIGSTOPs Redis, gateways and archive workers; ``history.py`` then checks
  every acknowledged append is present exactly once and in per-writer order,
  refused ones absent, unknown ones at most once, every reader got a prefix of
  the stream (every byte once, in order), and live readers got appends promptly;
* ``test_bad_input_battery.py``: ~100 malformed requests sent raw (non-UTF-8
  headers, extreme expiries, deep/odd JSON, gzip bombs, bad Host, smuggling,
  long paths, ...) beside legitimate appends: each gets a 4xx, stores nothing,
  and never fails anyone else's request;
* ``test_slow_clients.py``: trickled bodies and heads are cut off; SSE clients
  that never read do not hold up SIGTERM;
* ``test_history.py``: the checker itself, on hand-made histories.

Run (CI mode, about 2-3 minutes on 2 cores; part of the normal ``pytest``)::

    .venv/bin/python -m pytest tests/faults

Environment:

* ``DS_FAULT_SEED=<n>``: replay a run's fault schedule and workload choices (every
  run prints its seed, and every failure message names it);
* ``DS_FAULT_SOAK=1``: soak mode for release checks: ``test_chaos`` runs
  ``DS_FAULT_SOAK_SECONDS`` (default 1800) with 12 streams, 72 writers, 4 live
  readers per stream plus 6 waves of late ones, and a fault every 2-15 s (a few
  hundred in all); the other tests run as in CI. For example::

      DS_FAULT_SOAK=1 DS_FAULT_SOAK_SECONDS=3600 .venv/bin/python -m pytest tests/faults -x

* ``DS_FAULT_SERVER_ROOT=<dir>``: run the server processes from another checkout
  (e.g. ``git archive <commit> | tar -x -C <dir>``) to see what the suite finds there.

At the end a summary line (operations, acknowledged, unknown, faults by kind,
bad inputs, lost, duplicated) is printed, and written as JSON to pytest's
temporary directory (its path is printed too).
"""
