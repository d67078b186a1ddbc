"""A gateway under gunicorn (``serve --workers N``) stops within its grace period whenever the
SIGTERM comes, a worker still booting included.

Found in a fresh-clone CI run: test_logging's ``--workers 2`` gateway, SIGTERM'd right after
its first answers, did not exit in 30 s (its graceful timeout is 35 s). Two windows lost a
worker's SIGTERM: from the fork until the worker's first hook (the master's handlers caught it
in the fork; ``--log-level info`` logs "Booting worker" in that window), and from aiohttp's
``init_signals`` until the worker's loop ran (uvloop drops a signal that comes then). Now the
stop signals are defaulted in the fork (gunicorn_hooks.py) until the running loop installs
aiohttp's handlers (gunicorn_worker.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from .conftest import free_port, terminate, wait_ready

# A worker as gunicorn makes it, up to the moment before its loop runs (the fork's default
# handlers: gunicorn_hooks.on_starting; then init_signals), signalled then; then its loop runs.
_BOOTING = textwrap.dedent(
    """
    import asyncio, os, signal, sys, time
    import uvloop
    from aiohttp.worker import GunicornUVLoopWebWorker
    from gateway.cli.gunicorn_worker import Worker

    cls = Worker if sys.argv[1] == "ours" else GunicornUVLoopWebWorker
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT):  # (as forked)
        signal.signal(signum, signal.SIG_DFL)
    worker = cls.__new__(cls)
    worker.alive = True
    worker.loop = uvloop.new_event_loop()
    asyncio.set_event_loop(worker.loop)
    worker.init_signals()
    if sys.argv[2] == "booting":
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)

    async def run():
        if sys.argv[2] == "running":
            await asyncio.sleep(0.05)
            os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(20):
            if not worker.alive:
                return
            await asyncio.sleep(0.05)

    worker.loop.run_until_complete(run())
    print("stopping" if not worker.alive else "serving on")
    """
)


def _worker(cls: str, when: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _BOOTING, cls, when], capture_output=True, text=True, timeout=60
    )


def test_a_sigterm_while_a_worker_boots_ends_it() -> None:
    lost = _worker("aiohttp", "booting")  # the case as it was: the signal dropped
    assert (lost.returncode, lost.stdout.strip()) == (0, "serving on"), lost.stderr
    ours = _worker("ours", "booting")
    assert ours.returncode == -signal.SIGTERM, (ours.stdout, ours.stderr)


def test_a_sigterm_once_the_worker_runs_is_aiohttps_graceful_stop() -> None:
    ours = _worker("ours", "running")
    assert (ours.returncode, ours.stdout.strip()) == (0, "stopping"), ours.stderr


# A master (its own SIGTERM handler, as gunicorn's arbiter has) forks a worker and signals it
# at once; the worker does not install handlers of its own for a while (it boots).
_FORKING = textwrap.dedent(
    """
    import os, signal, sys, time
    from gateway.cli import gunicorn_hooks

    signal.signal(signal.SIGTERM, lambda *_: None)  # the master's: it only takes note
    if sys.argv[1] == "hooks":
        gunicorn_hooks.on_starting(None)
    pid = os.fork()
    if pid == 0:
        time.sleep(3)
        os._exit(3)  # served on
    os.kill(pid, signal.SIGTERM)
    _, status = os.waitpid(pid, 0)
    mine = signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN)
    blocked = signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    print(os.waitstatus_to_exitcode(status), mine, blocked)
    """
)


def test_a_worker_signalled_as_it_is_forked_stops() -> None:
    """Between the fork and the worker's own handlers, the master's caught the signal in
    the fork and it was lost; forked with the stop signals defaulted (and blocked in the
    master while it forks), it ends the worker at once, and the master keeps its own."""
    for how, expected in (("plain", "3 True False"), ("hooks", f"{-signal.SIGTERM} True False")):
        done = subprocess.run(
            [sys.executable, "-c", _FORKING, how], capture_output=True, text=True, timeout=60
        )
        assert done.stdout.strip() == expected, (how, done.stdout, done.stderr)


def _children(pid: int) -> set[int]:
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        found.update(int(child) for child in text)
    return found


def _serve(redis_url: str, tmp_path: Path) -> tuple[subprocess.Popen[bytes], int]:
    """``serve --workers 2`` (a 1 s shutdown delay), its stderr in tmp_path/serve.log."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DURABLE_STREAMS_") and k != "REDIS_URL"}
    with (tmp_path / "serve.log").open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "serve", "--port", str(port), "--redis-url", redis_url,
             "--workers", "2", "--shutdown-delay-seconds", "1"],
            env=env, stderr=log,
        )  # fmt: skip
    return proc, port


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs /proc (Linux)")
@pytest.mark.parametrize("after", [0.0, 0.3])
def test_serve_stops_within_its_grace_when_signalled_as_workers_boot(
    redis_url: str, tmp_path: Path, after: float
) -> None:
    """SIGTERM to ``serve --workers 2`` moments after its workers were forked (booting): it
    exits, well before the graceful timeout (5 + 30 s) that killed a worker that lost it.
    (Where the two windows fall in a boot varies: the tests above hit them directly.)"""
    proc, _ = _serve(redis_url, tmp_path)
    try:
        deadline = time.monotonic() + 60
        while len(_children(proc.pid)) < 2 and time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            time.sleep(0.01)
        time.sleep(after)
        proc.send_signal(signal.SIGTERM)
        proc.wait(25)
    finally:
        terminate(proc)


def test_serve_still_drains_when_signalled_after_boot(redis_url: str, tmp_path: Path) -> None:
    """The deferred handlers change nothing for a worker that runs: SIGTERM drains (exit 0)."""
    proc, port = _serve(redis_url, tmp_path)
    try:
        wait_ready(port, proc)
        time.sleep(1.0)  # both workers up
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(25) == 0
    assert "SIGTERM: not ready" in (tmp_path / "serve.log").read_text()
