"""Prometheus metrics, served at ``/metrics`` (and by ``archive --metrics-port``).

Under gunicorn every worker is its own process: with the environment variable
``PROMETHEUS_MULTIPROC_DIR`` set (``serve --workers N`` sets it; so does the
Helm chart) each process writes its values to files there and a scrape of any
worker adds them up (prometheus-client's multiprocess mode). Gauges say how
processes combine (``livesum``: the sum over running processes).

Multiprocess mode has no ``process_*`` metrics of its own: ``WorkerProcesses``
reads them from /proc for every live worker at scrape time, labelled
``worker="<slot>"``. The slot is a gunicorn worker's index (0 to N-1, handed out
by gateway/cli/gunicorn_hooks.py, a replacement worker taking the slot of the one
it replaces), not its pid: the label's values stay N however often workers are
restarted, where pids would add a series per restart.

Import this module only after that variable is set: prometheus-client reads
it once, at import.
"""

from __future__ import annotations

import asyncio
import bisect
import glob
import os
import platform
import re
from collections.abc import Callable, Iterable
from typing import Any

import redis
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
from prometheus_client.metrics_core import Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from .. import __version__

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
_FAST = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

REQUESTS = Counter("ds_http_requests_total", "HTTP requests answered", ["route", "method", "status"])
FAST_PATH = Counter(
    "ds_http_fast_path_total",
    "of ds_http_requests_total, the appends answered on the connection itself (http/fastpath.py)",
)
REQUEST_SECONDS = Histogram(
    "ds_http_request_duration_seconds",
    "Time to answer (live routes: how long the response stayed open)",
    ["route", "method"],
    buckets=(*_FAST, 5.0, 10.0, 30.0, 60.0, 120.0),
)
READS_STREAMED = Counter(
    "ds_reads_streamed_total", "Catch-up answers longer than a page, streamed while read (http/catchup.py)"
)
READS_BROKEN = Counter(
    "ds_reads_broken_total",
    "Streamed catch-up answers cut mid-body: the client left (client), took nothing for "
    "--write-timeout (stalled), or a read failed (server: Redis gone, data dropped meanwhile)",
    ["reason"],
)
READ_BUDGET_HELD = Gauge(
    "ds_read_budget_bytes",
    "Read pages held by streamed answers now (--max-inflight-read-bytes)",
    multiprocess_mode="livesum",
)
APPENDS = Counter("ds_appends_total", "Appends acknowledged (POSTs that added data)")
APPENDED_BYTES = Counter("ds_appended_bytes_total", "Bytes of acknowledged appends")
# Per tenant (--tenants), capped: the first --tenant-metrics-top tenants a process serves get a
# label of their own, every other is tenant="other" (features/usage.py); the API ranks them all.
TENANT_REQUESTS = Counter(
    "ds_tenant_requests_total", "Stream requests answered, by tenant and kind", ["tenant", "kind"]
)
TENANT_BYTES_OUT = Counter(
    "ds_tenant_bytes_out_total", "Body bytes sent for stream requests, by tenant", ["tenant"]
)
LIVE_CONNECTIONS = Gauge("ds_live_connections", "Open live reads", ["mode"], multiprocess_mode="livesum")
FANOUT_DELAY = Histogram(
    "ds_fanout_delay_seconds",
    "Time from an append's script (Redis' clock: its acknowledgement follows at once) to a live "
    "reader's response write: one sample per woken reader, one per stream and notice batch for the "
    "readers the pub/sub listener writes to itself (the last one's)",
    buckets=(*_FAST, 5.0, 10.0),
)
SUBSCRIPTIONS = Gauge(
    "ds_pubsub_subscriptions", "Streams this gateway is subscribed to", multiprocess_mode="livesum"
)
REDIS_SECONDS = Histogram(
    "ds_redis_call_duration_seconds",
    "Script calls to Redis (and bulk reads, as read_bulk)",
    ["script"],
    buckets=_FAST,
)
REDIS_ERRORS = Counter(
    "ds_redis_errors_total", "Failed script calls, and appends append.lua caught failing", ["script", "error"]
)
REDIS_RETRIES = Counter(
    "ds_redis_cluster_retries_total",
    "Redis Cluster calls sent again because they did not run: moved, ask, tryagain, clusterdown, unreachable",
    ["reason"],
)

# The archive worker's. No label per worker: a worker's name (host:pid) is new after
# every restart, so it made a new series each time; the pod's own labels tell pods apart.
ARCHIVED_BYTES = Counter("ds_archive_bytes_total", "Bytes moved from Redis to Parquet by this worker")
ARCHIVE_FILES = Counter("ds_archive_files_total", "Parquet files written by this worker")
# State compaction (workers/compactor.py, docs/compaction.md)
COMPACTION_RUNS = Counter("ds_compaction_runs_total", "Compaction runs finished by this worker")
COMPACTION_DROPPED_BYTES = Counter(
    "ds_compaction_dropped_bytes_total", "Bytes of messages compaction dropped, by this worker"
)
COMPACTION_FOLDED_MESSAGES = Counter(
    "ds_compaction_folded_messages_total", "Messages folded by this worker's compaction runs (again each run)"
)
COMPACTION_BEHIND = Gauge(
    "ds_compaction_behind_seconds",
    "How far behind its lag the last stream this worker compacted was: the age of its oldest "
    "unfolded message minus --compaction-lag-seconds (0: caught up)",
    multiprocess_mode="mostrecent",
)
# The usage meter (workers/meter.py, archive workers with --tenants). Read from Redis:
# every such worker reports the same number: aggregate with max().
METER_BEHIND = Gauge(
    "ds_meter_behind_seconds",
    "How long the oldest metering hour still in Redis has waited past its close (0: none): "
    "usage not yet moved to Parquet",
    multiprocess_mode="mostrecent",
)
# Read from Redis: every worker reports the same cluster-wide number, so sum() over
# workers would multiply it by their count; aggregate with max().
ARCHIVE_DUE = Gauge(
    "ds_archive_due_streams",
    "Streams waiting for a worker, cluster-wide (every worker reports the same number: "
    "aggregate with max(), not sum())",
    multiprocess_mode="mostrecent",
)
# By node: the Redis primary holding the hint keys (named as ds_redis_used_memory_bytes
# names it; one Redis: one series), so a primary whose streams wait shows apart.
ARCHIVE_LAG = Gauge(
    "ds_archive_lag_seconds",
    "How long the longest-waiting stream has waited for a worker, by the Redis primary holding its "
    "archive hint (node; one Redis: its address); every worker reports the same numbers: aggregate "
    "with max() (by node), not sum()",
    ["node"],
    multiprocess_mode="mostrecent",
)

# Write backpressure (gateway/features/backpressure.py). Each gateway process polls Redis on
# its own: a pod is paused if any of its processes is (livemax); the Redis figures are the
# same on every gateway, so aggregate them with max(), not sum().
WRITE_BACKPRESSURE = Gauge(
    "ds_write_backpressure",
    "1 while writes get 503 + Retry-After, by reason: memory (Redis used_memory above --write-pause-memory; "
    "on Redis Cluster some primary's, pausing its streams only) or archive_lag (--write-pause-archive-lag)",
    ["reason"],
    multiprocess_mode="livemax",
)
WRITE_REFUSALS = Counter(
    "ds_write_backpressure_refusals_total",
    "Writes refused (503 + Retry-After) by write backpressure",
    ["reason"],
)
REDIS_USED_MEMORY = Gauge(
    "ds_redis_used_memory_bytes",
    "Redis used_memory of each primary as a gateway last polled it (every gateway reports the same "
    "number: aggregate with max(), not sum())",
    ["node"],
    multiprocess_mode="livemostrecent",
)
REDIS_MAXMEMORY = Gauge(
    "ds_redis_maxmemory_bytes",
    "Redis maxmemory of each primary (0: none) as a gateway last polled it (aggregate with max())",
    ["node"],
    multiprocess_mode="livemostrecent",
)

WRITE_PAUSE_MARK = Gauge(
    "ds_write_pause_mark_bytes",
    "Redis used_memory at which writes pause (--write-pause-memory) for each primary; absent: no mark "
    "(aggregate with max())",
    ["node"],
    multiprocess_mode="livemostrecent",
)
LIVE_CAPACITY = Gauge(
    "ds_live_connections_max",
    "Live reads this process takes (--max-live-connections): sum() over a pod's processes is its capacity",
    multiprocess_mode="livesum",
)
PUBSUB_CONNECTED = Gauge(
    "ds_pubsub_connected",
    "1 while this process' pub/sub connection (each, on a cluster: min()) is subscribed; 0 while it "
    "reconnects and live readers wait for notices",
    multiprocess_mode="livemin",
)
DURABLE = Gauge(
    "ds_redis_durable",
    "1 when every Redis primary keeps an AOF fsynced on every write (appendonly yes, appendfsync always) "
    "as last checked; 0: a crash can lose acknowledged writes",
    multiprocess_mode="livemin",
)

# 1 per process group (a pod): "max" over its processes, so sum() over pods counts the
# pods running each build, however many workers each has.
# The subscription delivery worker's (durable-streams deliver)
WEBHOOK_DELIVERIES = Counter(
    "ds_webhook_deliveries_total",
    'Webhook deliveries by outcome: done (answered {"done": true}), accepted (2xx: the receiver '
    "calls back), failed (an error status, a timeout, unreachable: retried), rejected (its address "
    "failed the SSRF rules at delivery: retried)",
    ["outcome"],
)
WEBHOOK_SECONDS = Histogram(
    "ds_webhook_delivery_seconds",
    "Time from sending a webhook to its answer",
    buckets=(*_FAST, 5.0, 10.0, 30.0),
)
WAKES = Counter("ds_subscription_wakes_total", "Wakes sent (webhooks) or written (pull-wake)", ["type"])
WAKE_LAG = Histogram(
    "ds_subscription_wake_lag_seconds",
    "Time from an append recording a wake (the stream's outbox entry) to its subscriptions being told",
    buckets=(*_FAST, 5.0, 10.0, 30.0, 60.0),
)
SUBSCRIPTIONS_DUE = Gauge(
    "ds_subscriptions_due",
    "Subscriptions this worker took from the schedules in its last pass (deliveries, retries, expired "
    "leases): at the batch size, a backlog",
    multiprocess_mode="max",
)
BUILD_INFO = Gauge(
    "ds_build_info",
    "This server's build: always 1 (sum() counts the pods running each version)",
    ["version", "python", "redis_py"],
    multiprocess_mode="max",
)


def publish_build_info() -> None:
    """Set ds_build_info in this process (after a fork too: each process writes its own file)."""
    BUILD_INFO.labels(__version__, platform.python_version(), redis.__version__).set(1)


# -- process metrics of gunicorn's workers ------------------------------------------

_WORKER_FILE = re.compile(r"worker-(\d+)\.pid")


def register_worker(slot: int) -> None:
    """Record that this process is the worker in ``slot`` (a gunicorn hook calls it after
    the fork), for ``WorkerProcesses`` in whichever worker answers a scrape."""
    folder = os.environ.get(MULTIPROC_ENV)
    if not folder:
        return
    path = os.path.join(folder, f"worker-{slot}.pid")
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)  # whole or not at all: a scrape may read it now


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _constant(pid: int) -> Callable[[], int]:
    return lambda: pid


class WorkerProcesses(Collector):
    """process_* of every live worker, labelled with its slot; read from /proc when scraped."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self._collectors: dict[int, ProcessCollector] = {}

    def workers(self) -> dict[str, int]:
        """Slot -> pid of the live workers: a slot's file names the process that holds it
        now, a sibling of this one (same parent: a pid reused by an unrelated process is
        not taken for a dead worker's). Alone (no gunicorn), this process is slot 0."""
        found: dict[str, int] = {}
        try:
            names = os.listdir(self.folder)
        except OSError:
            names = []
        me, parent = os.getpid(), os.getppid()
        for name in names:
            m = _WORKER_FILE.fullmatch(name)
            if m is None:
                continue
            try:
                with open(os.path.join(self.folder, name)) as f:
                    pid = int(f.read().strip())
            except (OSError, ValueError):
                continue
            if pid == me or _parent(pid) == parent:
                found[m.group(1)] = pid
        return found or {"0": me}

    def collect(self) -> Iterable[Metric]:
        families: dict[str, Metric] = {}
        workers = self.workers()
        for pid in set(self._collectors) - set(workers.values()):
            del self._collectors[pid]  # a worker that is gone
        for slot, pid in sorted(workers.items(), key=lambda item: int(item[0])):
            collector = self._collectors.get(pid)
            if collector is None:
                collector = self._collectors[pid] = ProcessCollector(pid=_constant(pid), registry=None)
            for family in collector.collect():
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(family.name, family.documentation, family.type)
                for sample in family.samples:
                    merged.add_sample(sample.name, {**sample.labels, "worker": slot}, sample.value)
        return list(families.values())


_worker_processes: WorkerProcesses | None = None


_children: dict[tuple, Any] = {}


def child(metric: Any, *labels: str) -> Any:
    """``metric.labels(*labels)``, remembered: the hot paths skip prometheus-client's
    label validation and lock on every request (label sets here are few and fixed)."""
    key = (id(metric), *labels)
    found = _children.get(key)
    if found is None:
        found = _children[key] = metric.labels(*labels)
    return found


class RequestTally:
    """ds_http_requests_total and ds_http_request_duration_seconds, tallied here in plain
    Python and added to prometheus-client's values in bulk: before every render (a scrape
    of this process sees every request answered before it), at most a second after a
    request (what another worker's scrape reads in multiprocess mode, and what is left at
    exit: ``flush`` from the app's cleanup). prometheus-client takes a lock per value and
    walks the histogram's buckets in Python on every call: ~1.8 µs a request, against
    ~0.3 µs for a tally (measured at 10k appends/s).

    The bulk add writes the histogram child's ``_sum`` and ``_buckets`` (one value per
    upper bound, not cumulative: its own ``observe`` increments the first bucket whose
    bound is at least the amount), which prometheus-client has kept since 0.4; a test
    checks the exposition against ``observe``'s (tests/test_request_tally.py)."""

    FLUSH_SECONDS = 1.0

    def __init__(self, counter: Counter, histogram: Histogram, fast: Counter) -> None:
        self._counter, self._histogram, self._fast_counter = counter, histogram, fast
        self._fast = 0  # requests answered by http/fastpath.py since the last flush
        self._bounds: list[float] = list(histogram._upper_bounds)
        # (route, method, status) -> [count, sum of seconds, one count per bucket]
        self._pending: dict[tuple[str, str, int], list[Any]] = {}
        self._children: dict[tuple[str, str, int], tuple[Any, Any]] = {}
        self._timer_loop: asyncio.AbstractEventLoop | None = None  # where a flush is due, if any
        self._shared = bool(os.environ.get(MULTIPROC_ENV))  # other processes render our values

    def observe(self, route: str, method: str, status: int, seconds: float) -> None:
        key = (route, method, status)
        found = self._pending.get(key)
        if found is None:  # a key's first request since the last flush
            found = self._pending[key] = [0, 0.0, [0] * len(self._bounds)]
            if self._shared and key not in self._children:
                # Multiprocess mode, its first in this process: added now, so that the series
                # exists at once for any worker's scrape (as when each request was observed).
                self._add(found, seconds)
                self.flush()
                return
            self._flush_soon()
        self._add(found, seconds)

    def observe_fast(self, route: str, method: str, status: int, seconds: float) -> None:
        """``observe``, for a request answered by http/fastpath.py."""
        self._fast += 1
        self.observe(route, method, status, seconds)

    def _add(self, found: list[Any], seconds: float) -> None:
        found[0] += 1
        found[1] += seconds
        found[2][bisect.bisect_left(self._bounds, seconds)] += 1  # the last bound is +Inf

    def _flush_soon(self) -> None:
        """A flush within FLUSH_SECONDS on the running loop (one due on a loop that has
        since closed, as in tests, does not count). Never cancelled: one due after a
        render's flush adds what came since."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no event loop (a script): render() and cleanup flush
            return
        if self._timer_loop is not loop:
            self._timer_loop = loop
            loop.call_later(self.FLUSH_SECONDS, self._flush_due)

    def _flush_due(self) -> None:
        self._timer_loop = None
        self.flush()

    def flush(self) -> None:
        """Add what was tallied to the prometheus-client values."""
        pending, self._pending = self._pending, {}
        if self._fast:
            self._fast_counter.inc(self._fast)
            self._fast = 0
        for key, (count, total, buckets) in pending.items():
            found = self._children.get(key)
            if found is None:
                route, method, status = key
                found = self._children[key] = (
                    self._counter.labels(route, method, str(status)),
                    self._histogram.labels(route, method),
                )
            found[0].inc(count)
            histogram = found[1]
            histogram._sum.inc(total)
            for value, n in zip(histogram._buckets, buckets, strict=True):
                if n:
                    value.inc(n)


_requests = RequestTally(REQUESTS, REQUEST_SECONDS, FAST_PATH)
observe_request = _requests.observe  # one answered request: its count and duration
observe_fast_request = _requests.observe_fast  # the same, answered by http/fastpath.py
flush_requests = _requests.flush


class _WorkerFiles(multiprocess.MultiProcessCollector):
    """prometheus_client's collector of the workers' metric files, skipping a file still
    empty: a worker creates its file, then sizes it, and a scrape between the two (a worker
    starting) failed whole with a 500; one killed between the two would have failed every
    scrape after it (prometheus/client_python#1199). Such a file holds nothing yet."""

    def __init__(self, registry: CollectorRegistry, folder: str) -> None:
        super().__init__(registry, folder)
        self.folder = folder

    def collect(self) -> Iterable[Metric]:
        files = []
        for path in glob.glob(os.path.join(self.folder, "*.db")):
            try:
                if os.path.getsize(path) > 0:
                    files.append(path)
            except OSError:  # gone meanwhile (a dead worker's, cleaned up)
                continue
        return self.merge(files, accumulate=True)


def render() -> tuple[bytes, str]:
    """The exposition text of this process, or of all processes in multiprocess mode."""
    global _worker_processes
    flush_requests()
    folder = os.environ.get(MULTIPROC_ENV)
    if folder:
        registry = CollectorRegistry()
        _WorkerFiles(registry, folder)
        if _worker_processes is None or _worker_processes.folder != folder:
            _worker_processes = WorkerProcesses(folder)
        registry.register(_worker_processes)
        return generate_latest(registry), CONTENT_TYPE_LATEST
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST
