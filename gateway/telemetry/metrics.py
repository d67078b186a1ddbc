"""Prometheus metrics, served at ``/metrics`` (and by ``archive --metrics-port``).

Under gunicorn every worker is its own process: with the environment variable
``PROMETHEUS_MULTIPROC_DIR`` set (``serve --workers N`` sets it; so does the
Helm chart) each process writes its values to files there and a scrape of any
worker adds them up (prometheus-client's multiprocess mode). Gauges say how
processes combine (``livesum``: the sum over running processes).

Import this module only after that variable is set: prometheus-client reads
it once, at import.
"""

from __future__ import annotations

import os
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
_FAST = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

REQUESTS = Counter("ds_http_requests_total", "HTTP requests answered", ["route", "method", "status"])
REQUEST_SECONDS = Histogram(
    "ds_http_request_duration_seconds",
    "Time to answer (live routes: how long the response stayed open)",
    ["route", "method"],
    buckets=(*_FAST, 5.0, 10.0, 30.0, 60.0, 120.0),
)
APPENDS = Counter("ds_appends_total", "Appends acknowledged (POSTs that added data)")
APPENDED_BYTES = Counter("ds_appended_bytes_total", "Bytes of acknowledged appends")
LIVE_CONNECTIONS = Gauge("ds_live_connections", "Open live reads", ["mode"], multiprocess_mode="livesum")
SUBSCRIPTIONS = Gauge(
    "ds_pubsub_subscriptions", "Streams this gateway is subscribed to", multiprocess_mode="livesum"
)
REDIS_SECONDS = Histogram(
    "ds_redis_call_duration_seconds",
    "Script calls to Redis (and bulk reads, as read_bulk)",
    ["script"],
    buckets=_FAST,
)
REDIS_ERRORS = Counter("ds_redis_errors_total", "Failed script calls", ["script", "error"])

# The archive worker's.
ARCHIVED_BYTES = Counter("ds_archive_bytes_total", "Bytes moved from Redis to Parquet", ["worker"])
ARCHIVE_FILES = Counter("ds_archive_files_total", "Parquet files written", ["worker"])
ARCHIVE_DUE = Gauge(
    "ds_archive_due_streams", "Streams waiting for a worker", ["worker"], multiprocess_mode="max"
)
ARCHIVE_LAG = Gauge(
    "ds_archive_lag_seconds",
    "How long the longest-waiting stream has waited for a worker",
    ["worker"],
    multiprocess_mode="max",
)


_children: dict[tuple, Any] = {}


def child(metric: Any, *labels: str) -> Any:
    """``metric.labels(*labels)``, remembered: the hot paths skip prometheus-client's
    label validation and lock on every request (label sets here are few and fixed)."""
    key = (id(metric), *labels)
    found = _children.get(key)
    if found is None:
        found = _children[key] = metric.labels(*labels)
    return found


_request_children: dict[tuple[str, str, int], tuple[Any, Any]] = {}


def observe_request(route: str, method: str, status: int, seconds: float) -> None:
    """One answered request: its count and duration (children found with one lookup)."""
    key = (route, method, status)
    found = _request_children.get(key)
    if found is None:
        found = _request_children[key] = (
            REQUESTS.labels(route, method, str(status)),
            REQUEST_SECONDS.labels(route, method),
        )
    found[0].inc()
    found[1].observe(seconds)


def render() -> tuple[bytes, str]:
    """The exposition text of this process, or of all processes in multiprocess mode."""
    if os.environ.get(MULTIPROC_ENV):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry), CONTENT_TYPE_LATEST
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST
