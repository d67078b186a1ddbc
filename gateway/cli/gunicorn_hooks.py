"""gunicorn's hooks and fixed settings for the gateway, without reading the environment.

``serve --workers N`` takes them from here with its own parsed settings (so a flag wins over a
bad ``DURABLE_STREAMS_*`` variable); ``gunicorn_conf.py`` adds the environment's settings for
running gunicorn directly.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import signal
from typing import Any, Final

from gunicorn import glogging

from gateway import config
from gateway.cli import allocator
from gateway.telemetry import logs

worker_class = "gateway.cli.gunicorn_worker.Worker"  # aiohttp's uvloop worker (see that module)
timeout = 60  # a worker silent this long is restarted
accesslog = None  # the gateway writes its own (--access-log): with redacted signatures
# gunicorn 25+ opens a control socket under $XDG_RUNTIME_DIR or $HOME/.gunicorn: nothing here
# uses it (signals do), and in a container $HOME is often read-only or absent.
control_socket_disable = True
# What ``serve`` copies into gunicorn's configuration (a setting older gunicorns lack is skipped).
FIXED = ("worker_class", "timeout", "accesslog", "control_socket_disable", "logger_class",
         "on_starting", "pre_fork", "post_fork", "child_exit")  # fmt: skip


class Logs(glogging.Logger):
    """gunicorn's logger, writing through the root logger (``--log-format``), which is set
    up here when gunicorn runs without the command line (which sets it up first)."""

    def setup(self, cfg: Any) -> None:
        super().setup(cfg)
        if not logging.getLogger().handlers:
            settings = config.from_env()
            logs.configure(settings.log_level, settings.log_format)
        for handler in list(self.error_log.handlers):
            self.error_log.removeHandler(handler)
        self.error_log.propagate = True
        self.error_log.addFilter(logs.ONE_LINE)


logger_class = Logs


def graceful_timeout(settings: config.Settings) -> int:
    """gunicorn's graceful_timeout (whole seconds): the master kills workers still running this
    long after its SIGTERM, which they spend serving on (--shutdown-delay-seconds), then draining
    (--shutdown-seconds)."""
    return math.ceil(settings.shutdown_delay_seconds + settings.shutdown_seconds)


# The signals that stop a worker, and whether this process forks workers with them defaulted.
_STOPS: Final = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT)
_forking_defaulted = False


def _forks_with_stops_defaulted() -> None:
    """A fork starts with the master's handlers, which only queue a signal in the fork's copy
    of the master's state: a SIGTERM that reached a worker while it booted was lost, and it
    served on until the master killed it at the graceful timeout (35 s). From the fork on, until
    the worker installs its own handlers (aiohttp's, once its loop runs: gunicorn_worker.py),
    such a signal ends it at once: booting, it serves nobody yet. Blocked while the master
    forks, so none falls between the fork and the child's first instruction."""
    global _forking_defaulted
    if _forking_defaulted:  # (once per process: at-fork handlers cannot be removed)
        return
    _forking_defaulted = True

    def child() -> None:
        for signum in _STOPS:
            signal.signal(signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOPS)  # one that came meanwhile: now

    os.register_at_fork(
        before=lambda: signal.pthread_sigmask(signal.SIG_BLOCK, _STOPS),
        after_in_parent=lambda: signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOPS),
        after_in_child=child,
    )


def on_starting(server: Any) -> None:
    """Workers are forked with the stop signals defaulted; metrics files of an earlier run
    would be counted as if alive: start clean."""
    _forks_with_stops_defaulted()
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
    allocator.keep_freed_memory()  # (as `serve` does before it forks: for gunicorn run directly)
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from gateway.telemetry import metrics

        metrics.register_worker(worker.slot)


def child_exit(server: Any, worker: Any) -> None:
    """A dead worker's live gauges must stop counting."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(worker.pid)
