"""The gunicorn worker the gateway runs in: aiohttp's uvloop worker, its signal handlers
installed once its loop runs.

Why: aiohttp's worker installs them (``loop.add_signal_handler``) before the app is loaded
and before the loop runs, and uvloop drops a signal that comes in that window (asyncio's own
loop delivers it once it runs). A SIGTERM that reached a booting worker then was lost: the
worker served on until the master killed it at the graceful timeout (``--shutdown-delay-
seconds`` + ``--shutdown-seconds``, 35 s by default): on Kubernetes, a pod killed at the end
of its grace period. Until its loop runs, the worker keeps ``post_fork``'s default handlers
(gunicorn_hooks.py): it serves nobody yet, so such a signal ends it at once.
"""

from __future__ import annotations

from aiohttp.worker import GunicornUVLoopWebWorker


class Worker(GunicornUVLoopWebWorker):
    def init_signals(self) -> None:
        # (the first callback the loop runs: before the app's startup, which installs
        # lifecycle.drain's SIGTERM handler over aiohttp's)
        self.loop.call_soon(super().init_signals)
