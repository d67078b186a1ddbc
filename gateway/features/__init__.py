"""The side features' state in Redis, one module each: ``subscriptions.py`` (webhook and
pull-wake subscriptions), ``listing.py`` (the stream index and its pages), ``buckets.py``,
``snapshots.py`` (application snapshots), ``hints.py`` (which streams grew, for the
archive workers), ``backpressure.py`` (pausing writes before Redis is full),
``ratelimit.py`` (token buckets) and ``stats.py`` (the console's live overview).

Each feature is three modules named alike, one per layer: its rules in
``gateway/protocol/<feature>.py`` (pure), its Redis state here, its routes in
``gateway/http/<feature>.py``.
"""
