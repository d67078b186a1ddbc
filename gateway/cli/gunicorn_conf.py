"""gunicorn settings for the gateway (``durable-streams serve --workers N`` uses them).

Run gunicorn directly with an external Redis:

    DURABLE_STREAMS_REDIS_URL=redis://redis:6379/0 DURABLE_STREAMS_WORKERS=4 \\
        gunicorn -c python:gateway.cli.gunicorn_conf gateway.http.app:app_from_env

Sizing: one worker per core is the usual start; each worker holds one pub/sub
connection and a small Redis pool, and serves thousands of idle SSE/long-poll
connections. Each connection is a file descriptor: ``serve`` raises its soft
``ulimit -n`` to the hard one (containerd 2 gives containers a soft 1024); run
directly, raise it yourself to (expected connections per worker x 1.2) or more.

Metrics: set ``PROMETHEUS_MULTIPROC_DIR`` to an empty, writable directory so
``/metrics`` on any worker reports all workers (see gateway/telemetry/metrics.py).

Logs: gunicorn's own lines go through the root logger, so ``--log-format json``
makes them JSON too; a worker that refuses to start (``OneLineError``) is one
line, not a traceback.
"""

import itertools
import logging
import math
import os
from typing import Any

from gunicorn import glogging

from gateway import config
from gateway.telemetry import logs

_settings = config.from_env()  # run directly, gunicorn gets its settings here (a bad one: one line)
bind = [f"{_settings.host}:{_settings.port}"]
if _settings.admin_port:  # /metrics and health on their own port
    bind.append(f"{_settings.host}:{_settings.admin_port}")
workers = _settings.workers
worker_class = "aiohttp.GunicornUVLoopWebWorker"
# On SIGTERM, live responses end at once (SSE with a final control event,
# long-polls with their empty answer); in-flight writes get this long to finish.
graceful_timeout = math.ceil(_settings.shutdown_seconds)
timeout = 60  # a worker silent this long is restarted
# Idle connections, and request heads still arriving (aiohttp's keep-alive timer runs
# from the connection's start), are closed after this; longer than common LB idle timeouts.
keepalive = math.ceil(_settings.keepalive_seconds)
loglevel = _settings.log_level
accesslog = None  # the gateway writes its own (--access-log): with redacted signatures
# gunicorn 25+ opens a control socket under $XDG_RUNTIME_DIR or $HOME/.gunicorn: nothing here
# uses it (signals do), and in a container $HOME is often read-only or absent.
control_socket_disable = True


class Logs(glogging.Logger):
    """gunicorn's logger, writing through the root logger (``--log-format``), which is set
    up here when gunicorn runs without the command line (which sets it up first)."""

    def setup(self, cfg: Any) -> None:
        super().setup(cfg)
        if not logging.getLogger().handlers:
            logs.configure(_settings.log_level, _settings.log_format)
        for handler in list(self.error_log.handlers):
            self.error_log.removeHandler(handler)
        self.error_log.propagate = True
        self.error_log.addFilter(logs.ONE_LINE)


logger_class = Logs


def on_starting(server: Any) -> None:
    """Metrics files of an earlier run would be counted as if alive: start clean."""
    folder = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if folder and os.path.isdir(folder):
        for name in os.listdir(folder):
            if name.endswith(".db") or (name.startswith("worker-") and name.endswith(".pid")):
                os.remove(os.path.join(folder, name))


def pre_fork(server: Any, worker: Any) -> None:
    """The new worker's slot: the lowest that no live worker holds, so a replacement takes
    the slot of the worker it replaces (the ``worker`` label of process metrics stays
    within 0..N-1 across restarts; a pid would add a label value per restart)."""
    taken = {getattr(w, "slot", None) for w in server.WORKERS.values()}
    worker.slot = next(i for i in itertools.count() if i not in taken)


def post_fork(server: Any, worker: Any) -> None:
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from gateway.telemetry import metrics

        metrics.register_worker(worker.slot)


def child_exit(server: Any, worker: Any) -> None:
    """A dead worker's live gauges must stop counting."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(worker.pid)
