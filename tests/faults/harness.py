"""Real processes to break: a redis-server, gateways and archive workers.

Everything listens on 127.0.0.1 only. Each process logs to a file of its own in
the test's directory (the tail goes into failure messages). Processes are only
ever signalled by their own pid; a stopped (SIGSTOP) process is continued
before it is terminated, so teardown never hangs on it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from gateway.cli.embedded import EmbeddedRedis

from ..conftest import free_port

_SCRIPT = Path(sys.executable).with_name("durable-streams")  # this venv's entry point
GATEWAY_CMD = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "gateway"]
# Run the server processes from another checkout of the project (e.g. an older commit, to
# see which defects the suite catches there): its root directory, put first on PYTHONPATH.
SERVER_ROOT = os.environ.get("DS_FAULT_SERVER_ROOT", "")


def tail(path: Path, limit: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-limit:]
    except OSError:
        return ""


class RedisProc:
    """redis-server on its own port and directory: AOF, ``appendfsync always``.

    ``restart`` starts it again on the same directory and port (it replays its AOF).
    """

    def __init__(self, directory: Path) -> None:
        self.server = EmbeddedRedis(directory, port=free_port())
        self.paused = False
        self.starts = 0

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def pid(self) -> int | None:
        p = self.server.process
        return p.pid if p is not None and p.poll() is None else None

    def start(self, timeout: float = 30.0) -> None:
        self.server.start(timeout)
        self.paused = False
        self.starts += 1

    def kill(self) -> None:
        """SIGKILL: no shutdown, no final flush."""
        self.resume()
        self.server.kill()

    def pause(self) -> None:
        if self.pid is not None:
            os.kill(self.pid, signal.SIGSTOP)
            self.paused = True

    def resume(self) -> None:
        if self.paused and self.pid is not None:
            os.kill(self.pid, signal.SIGCONT)
        self.paused = False

    def stop(self) -> None:
        self.resume()
        self.server.stop()

    def log_tail(self) -> str:
        return tail(self.server.data_dir / "redis.log")


class ServiceProc:
    """A ``durable-streams`` subprocess (``serve`` or ``archive``): this venv's, or ``command``
    (e.g. an earlier build's: tests/old_builds.py) run in ``cwd``."""

    def __init__(
        self, name: str, args: list[str], log_dir: Path, env: dict[str, str] | None = None,
        command: list[str] | None = None, cwd: str | None = None,
    ) -> None:  # fmt: skip
        self.name = name
        self.args = args
        self.command = command or GATEWAY_CMD
        self.cwd = cwd or (None if command else SERVER_ROOT or None)  # SERVER_ROOT: for GATEWAY_CMD only
        self.log_path = log_dir / f"{name}.log"
        self.env = {**os.environ, **(env or {})}
        if SERVER_ROOT and not command:
            self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [SERVER_ROOT, self.env.get("PYTHONPATH")]))
        self.process: subprocess.Popen[bytes] | None = None
        self.paused = False
        self.starts = 0

    @property
    def pid(self) -> int | None:
        p = self.process
        return p.pid if p is not None and p.poll() is None else None

    @property
    def running(self) -> bool:
        return self.pid is not None

    def start(self) -> None:
        assert not self.running, f"{self.name} is already running"
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== start {self.starts} at {time.time():.3f}\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                [*self.command, *self.args], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=self.env, cwd=self.cwd,
            )  # fmt: skip
        self.paused = False
        self.starts += 1

    def signal(self, signum: int) -> None:
        if self.pid is not None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.paused = False

    def pause(self) -> None:
        self.signal(signal.SIGSTOP)
        self.paused = self.running

    def resume(self) -> None:
        if self.paused:
            self.signal(signal.SIGCONT)
        self.paused = False

    def terminate(self, timeout: float = 15.0) -> int | None:
        """SIGTERM (after SIGCONT), then SIGKILL after ``timeout``; the exit status."""
        if self.process is None:
            return None
        self.resume()
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def log_tail(self) -> str:
        return tail(self.log_path)


class GatewayProc(ServiceProc):
    """``durable-streams serve`` on a fixed port (kept across restarts)."""

    def __init__(
        self, name: str, redis_url: str, log_dir: Path, flags: list[str] | None = None,
        env: dict[str, str] | None = None, command: list[str] | None = None, cwd: str | None = None,
    ) -> None:  # fmt: skip
        self.port = free_port()
        args = ["serve", "--host", "127.0.0.1", "--port", str(self.port), "--redis-url", redis_url,
                "--log-level", "warning", *(flags or [])]  # fmt: skip
        super().__init__(name, args, log_dir, env, command, cwd)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base}/readyz", timeout=2) as r:
                return r.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def start_ready(self, timeout: float = 30.0) -> None:
        """Start, and wait for /readyz. A gateway that exits while starting (its Redis was
        away at that moment) is started again until ``timeout``."""
        deadline = time.monotonic() + timeout
        if not self.running:
            self.start()
        while time.monotonic() < deadline:
            if self.ready():
                return
            if not self.running:
                time.sleep(0.2)
                self.start()
            time.sleep(0.05)
        raise RuntimeError(f"gateway {self.name} not ready after {timeout}s; log:\n{self.log_tail()}")

    def wait_ready(self, timeout: float = 30.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.ready():
                return True
            time.sleep(0.05)
        return False


FILE_SYNC_SYSCALLS = {74, 75, 82}  # x86-64: fsync, fdatasync, rename


def in_syscall(pid: int, numbers: set[int]) -> bool:
    """Whether any thread of ``pid`` is blocked in one of the system calls ``numbers``
    (/proc/<pid>/task/<tid>/syscall: Linux only; False where unreadable)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/syscall") as f:
                first = f.read().split(" ", 1)[0]
        except OSError:
            continue
        if first.lstrip("-").isdigit() and int(first) in numbers:
            return True
    return False


class ArchiveProc(ServiceProc):
    """``durable-streams archive``, archiving everything as soon as it can."""

    def __init__(
        self, name: str, redis_url: str, archive_dir: Path, log_dir: Path, lease_seconds: float,
        env: dict[str, str] | None = None, command: list[str] | None = None, cwd: str | None = None,
    ) -> None:  # fmt: skip
        args = ["archive", "--redis-url", redis_url, "--archive-url", str(archive_dir),
                "--archive-hot-bytes", "0", "--archive-hot-seconds", "0", "--archive-min-bytes", "16384",
                "--archive-max-delay", "0", "--archive-interval", "0.1", "--archive-file-bytes", "16384",
                "--archive-lease-seconds", str(lease_seconds), "--log-level", "warning"]  # fmt: skip
        super().__init__(name, args, log_dir, env, command, cwd)
        self.lease_seconds = lease_seconds

    def pause_mid_write(self, within: float) -> bool:
        """SIGSTOP the worker the moment it is caught syncing or renaming a file (writing an
        archive file: after it staged the range, before it commits it). Polls for up to
        ``within`` seconds; False (and not stopped) if it was never caught."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            pid = self.pid
            if pid is None:
                return False
            if in_syscall(pid, FILE_SYNC_SYSCALLS):
                self.pause()
                return True
            time.sleep(0.0002)
        return False


class Cluster:
    """One Redis, some gateways, some archive workers, sharing one archive directory."""

    def __init__(
        self,
        root: Path,
        *,
        gateways: int = 2,
        archivers: int = 2,
        gateway_flags: list[str] | None = None,
        gateway_env: dict[str, str] | None = None,
        lease_seconds: float = 2.0,
    ) -> None:
        self.root = root
        self.logs = root / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.archive_dir = root / "archive"
        self.archive_dir.mkdir(exist_ok=True)
        self.redis = RedisProc(root / "redis")
        flags = ["--archive-url", str(self.archive_dir), *(gateway_flags or [])]
        self.gateways = [
            GatewayProc(f"gateway{i}", self.redis.url, self.logs, flags, gateway_env) for i in range(gateways)
        ]
        self.archivers = [
            ArchiveProc(f"archiver{i}", self.redis.url, self.archive_dir, self.logs, lease_seconds)
            for i in range(archivers)
        ]

    def start(self) -> None:
        self.redis.start()
        for gw in self.gateways:
            gw.start()
        for gw in self.gateways:
            gw.start_ready()
        for worker in self.archivers:
            worker.start()

    def stop(self) -> None:
        for proc in [*self.archivers, *self.gateways]:
            with contextlib.suppress(Exception):
                proc.terminate(10)
        with contextlib.suppress(Exception):
            self.redis.stop()

    def live_gateways(self) -> list[GatewayProc]:
        return [gw for gw in self.gateways if gw.running] or list(self.gateways)

    def logs_tail(self, limit: int = 1500) -> str:
        parts = [f"--- redis ---\n{self.redis.log_tail()[-limit:]}"]
        for proc in [*self.gateways, *self.archivers]:
            parts.append(f"--- {proc.name} ---\n{proc.log_tail()[-limit:]}")
        return "\n".join(parts)


@contextlib.contextmanager
def cluster(root: Path, **options: object) -> Iterator[Cluster]:
    c = Cluster(root, **options)  # type: ignore[arg-type]
    try:
        c.start()
        yield c
    finally:
        c.stop()
