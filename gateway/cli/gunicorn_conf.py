"""gunicorn settings from the environment, for running the gateway under gunicorn directly.

``durable-streams serve --workers N`` does not read this file: it uses gunicorn_hooks.py with
the settings it parsed itself (so a flag wins over a bad ``DURABLE_STREAMS_*`` variable).

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

import math

from gateway import config

from . import gunicorn_hooks
from .gunicorn_hooks import (  # noqa: F401  (gunicorn reads these names from this module)
    Logs,
    accesslog,
    child_exit,
    control_socket_disable,
    logger_class,
    on_starting,
    post_fork,
    pre_fork,
    timeout,
    worker_class,
)

_settings = config.from_env()  # run directly, gunicorn gets its settings here (a bad one: one line)
bind = [f"{_settings.host}:{_settings.port}"]
if _settings.admin_port:  # /metrics and health on their own port
    bind.append(f"{_settings.host}:{_settings.admin_port}")
workers = _settings.workers
# On SIGTERM, workers fail readiness and end live responses at once (SSE with a final control
# event, long-polls with their empty answer), serve on with Connection: close for
# --shutdown-delay-seconds, then in-flight writes get --shutdown-seconds to finish.
graceful_timeout = gunicorn_hooks.graceful_timeout(_settings)
# Idle connections, and request heads still arriving (aiohttp's keep-alive timer runs
# from the connection's start), are closed after this; longer than common LB idle timeouts.
keepalive = math.ceil(_settings.keepalive_seconds)
loglevel = _settings.log_level
