"""gunicorn settings for the gateway (``durable-streams serve --workers N`` uses them).

Run gunicorn directly with an external Redis:

    DURABLE_STREAMS_REDIS_URL=redis://redis:6379/0 DURABLE_STREAMS_WORKERS=4 \\
        gunicorn -c python:gateway.cli.gunicorn_conf gateway.http.app:app_from_env

Sizing: one worker per core is the usual start; each worker holds one pub/sub
connection and a small Redis pool, and serves thousands of idle SSE/long-poll
connections. Each connection is a file descriptor: raise ``ulimit -n`` to
(expected connections per worker x 1.2) or more.

Metrics: set ``PROMETHEUS_MULTIPROC_DIR`` to an empty, writable directory so
``/metrics`` on any worker reports all workers (see gateway/telemetry/metrics.py).
"""

import math
import os

_env = os.environ.get
_host = _env("DURABLE_STREAMS_HOST", "127.0.0.1")
bind = [f"{_host}:{_env('DURABLE_STREAMS_PORT', '4437')}"]
if int(_env("DURABLE_STREAMS_ADMIN_PORT", "0")):  # /metrics and health on their own port
    bind.append(f"{_host}:{_env('DURABLE_STREAMS_ADMIN_PORT')}")
workers = int(_env("DURABLE_STREAMS_WORKERS", "1"))
worker_class = "aiohttp.GunicornUVLoopWebWorker"
# On SIGTERM, live responses end at once (SSE with a final control event,
# long-polls with their empty answer); in-flight writes get this long to finish.
graceful_timeout = math.ceil(float(_env("DURABLE_STREAMS_SHUTDOWN_SECONDS", "30")))
timeout = 60  # a worker silent this long is restarted
# Idle connections, and request heads still arriving (aiohttp's keep-alive timer runs
# from the connection's start), are closed after this; longer than common LB idle timeouts.
keepalive = math.ceil(float(_env("DURABLE_STREAMS_KEEPALIVE_SECONDS", "75")))
accesslog = None


def on_starting(server) -> None:
    """Metrics files of an earlier run would be counted as if alive: start clean."""
    folder = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if folder and os.path.isdir(folder):
        for name in os.listdir(folder):
            if name.endswith(".db"):
                os.remove(os.path.join(folder, name))


def child_exit(server, worker) -> None:
    """A dead worker's live gauges must stop counting."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(worker.pid)
