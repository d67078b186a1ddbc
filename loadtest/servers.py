"""Start the servers a benchmark compares, on loopback ports of their own.

``ours``: our gateway (one process) on an embedded Redis with AOF fsync on
every write; ``ours-2workers``: the same with ``--workers 2`` (gunicorn).
``reference``: the npm reference server, file-backed (its durable mode);
``reference-memory``: the same in memory.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
KINDS = ("ours", "ours-auth", "ours-auth-rl", "ours-2workers", "reference", "reference-memory")
# ``ours-auth``: access control on (a static bearer token with every request); ``ours-auth-rl``:
# also a rate limit on every request, set too high to refuse (one token bucket per request).
TOKEN = "loadtest-admin-token-0123456789"


def client_headers(kind: str) -> dict[str, str]:
    """What a load generator sends with every request to a server of this kind."""
    return {"Authorization": f"Bearer {TOKEN}"} if kind.startswith("ours-auth") else {}


@dataclass
class Running:
    name: str
    base_url: str  # up to and including the stream prefix
    pid: int  # the process serving HTTP, for CPU and memory readings
    data_dir: str = ""


def use_uvloop() -> None:
    """The load generators run on uvloop when it is there (it is a dependency of ours)."""
    try:
        import uvloop
    except ImportError:
        return
    uvloop.install()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, proc: subprocess.Popen, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            urllib.request.urlopen(url, timeout=1)
            return
        except urllib.error.HTTPError:
            return  # it answers
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"no answer from {url}")


def ensure_node_packages() -> None:
    """loadtest/package.json's packages (the reference server, the official client)."""
    installed = HERE / "node_modules" / "@durable-streams"
    if not all((installed / name).exists() for name in ("server", "client")):
        subprocess.run(
            ["npm", "install", "--no-package-lock", "--no-audit", "--no-fund"], cwd=HERE, check=True
        )


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


@contextlib.contextmanager
def archive_worker(server: Running, *extra_args: str) -> Iterator[subprocess.Popen]:
    """An archive worker beside ``ours`` (its embedded Redis, its data dir)."""
    with worker(server, "archive", *extra_args) as proc:
        yield proc


@contextlib.contextmanager
def worker(server: Running, command: str, *extra_args: str) -> Iterator[subprocess.Popen]:
    """A worker (``archive``, ``deliver``) beside ``ours`` (its embedded Redis, its data dir)."""
    cmd = [sys.executable, "-m", "gateway", command, "--data-dir", server.data_dir,
           "--log-level", "warning", *extra_args]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    try:
        yield proc
    finally:
        _stop(proc)


@contextlib.contextmanager
def start(kind: str, *extra_args: str) -> Iterator[Running]:
    port = free_port()
    data_dir = tempfile.mkdtemp(prefix=f"ds-bench-{kind}-")
    if kind.startswith("ours"):
        options = ["--workers", "2"] if kind == "ours-2workers" else []
        if kind.startswith("ours-auth"):
            tokens = Path(data_dir, "tokens.json")
            tokens.write_text(json.dumps({"tokens": [{"name": "bench", "token": TOKEN, "grants": "admin:"}]}))
            options += ["--auth-tokens-file", str(tokens)]
        if kind == "ours-auth-rl":
            options += ["--rate-limits", "write:=10000000/s read:=10000000/s"]
        cmd = [sys.executable, "-m", "gateway", "serve", "--port", str(port), "--data-dir", data_dir,
               "--log-level", "warning", *options, *extra_args]  # fmt: skip
        check = f"http://127.0.0.1:{port}/healthz"
    elif kind.startswith("reference"):
        ensure_node_packages()
        cmd = ["node", "reference-server.mjs", str(port)] + ([data_dir] if kind == "reference" else [])
        check = f"http://127.0.0.1:{port}/v1/stream/__probe"
    else:
        raise ValueError(f"unknown server {kind!r}; one of {KINDS}")
    # Ours always gets a fresh embedded Redis, whatever Redis the environment names.
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DURABLE_STREAMS_REDIS_URL")}
    proc = subprocess.Popen(
        cmd, cwd=None if kind.startswith("ours") else HERE, stdout=subprocess.DEVNULL, env=env
    )
    try:
        _wait_http(check, proc)
        yield Running(kind, f"http://127.0.0.1:{port}/v1/stream", proc.pid, data_dir)
    finally:
        _stop(proc)
        shutil.rmtree(data_dir, ignore_errors=True)


_CPUS = sorted(os.sched_getaffinity(0))  # what this process may use before any pin() narrowed it


def add_pin_option(parser: argparse.ArgumentParser) -> None:
    """``--pin`` (``pin``), for the benchmarks that start servers."""
    parser.add_argument(
        "--pin",
        action="store_true",
        help="each server on one CPU of its own; the load generator and ours' Redis on the others",
    )


def pin(server: Running) -> str:
    """One core for the server, the rest of the machine for everything else: its process
    tree (every thread, gunicorn workers; threads and children made later inherit it) on
    the first CPU this process may use; the caller (the load generator, and wrk, which it
    starts later) and ours' embedded Redis on the others. What a server does per core,
    with Redis and the load off its core (``--pin`` of compare, appends and fanout). Returns what
    went where, to print."""
    cpus = _CPUS
    if len(cpus) < 2:
        raise SystemExit("--pin needs at least two CPUs")
    mine, rest = {cpus[0]}, set(cpus[1:])
    redis = _descendants(server.pid, redis=True)
    _set_affinity([os.getpid()], rest)
    _set_affinity(_descendants(server.pid), mine)
    _set_affinity(redis, rest)
    others = ("the load generator and Redis" if redis else "the load generator") + " on CPU "
    return f"{server.name} on CPU {cpus[0]}; {others}{','.join(map(str, sorted(rest)))}"


def _set_affinity(pids: list[int], cpus: set[int]) -> None:
    """Every thread of the processes on ``cpus`` (sched_setaffinity sets one thread's)."""
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").glob("*"):
            with contextlib.suppress(ProcessLookupError):  # a thread that just ended
                os.sched_setaffinity(int(task.name), cpus)


def _proc_text(path: str) -> str:
    """A /proc file's text, or "" when its process or thread has just gone (threads of a
    measured process come and go: executor threads, workers restarting)."""
    try:
        return Path(path).read_text()
    except (FileNotFoundError, ProcessLookupError):
        return ""


def _descendants(pid: int, redis: bool = False) -> list[int]:
    """A process and its children, recursively (gunicorn workers; not the embedded Redis),
    or (``redis``) the embedded Redis among them."""
    out = [] if redis else [pid]
    for task in Path(f"/proc/{pid}/task").glob("*"):
        for child in _proc_text(f"{task}/children").split():
            if "redis" not in _proc_text(f"/proc/{child}/cmdline"):
                out += _descendants(int(child), redis)
            elif redis:
                out.append(int(child))
    return out


def _cpu_seconds(pids: list[int]) -> float:
    """The processes' CPU seconds; one gone since it was listed counts nothing."""
    total = 0
    for pid in pids:
        stat = _proc_text(f"/proc/{pid}/stat")
        if stat:
            fields = stat.rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime + stime
    return total / os.sysconf("SC_CLK_TCK")


def _rss_kib(pid: int) -> int:
    for line in _proc_text(f"/proc/{pid}/status").splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _machine_seconds() -> tuple[float, float]:
    """All CPUs' seconds since boot, and the idle ones among them (/proc/stat)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(fields[:8]) / os.sysconf("SC_CLK_TCK"), (fields[3] + fields[4]) / os.sysconf("SC_CLK_TCK")


class ProcessMeter:
    """CPU seconds (of the process and its workers; of its embedded Redis, if any; of the
    machine left idle) and resident memory (Linux /proc)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._redis = _descendants(pid, redis=True)
        self._cpu0, self._redis0 = self.cpu_seconds(), _cpu_seconds(self._redis)
        self._machine0 = _machine_seconds()
        self.peak_rss_mb = self.rss_mb()

    def cpu_seconds(self) -> float:
        return _cpu_seconds(_descendants(self.pid))

    def redis_cpu_used(self) -> float | None:
        """The embedded Redis's CPU seconds since the start (None: no embedded Redis)."""
        return _cpu_seconds(self._redis) - self._redis0 if self._redis else None

    def idle_share(self) -> float:
        """The machine's CPU time left idle since the start, as a share of all of it."""
        total, idle = (now - then for now, then in zip(_machine_seconds(), self._machine0, strict=True))
        return idle / total if total else 0.0

    def rss_mb(self) -> float:
        """Resident memory of the process and its workers (gunicorn's master alone is
        little of it), the embedded Redis not counted; one gone meanwhile counts nothing."""
        return sum(_rss_kib(pid) for pid in _descendants(self.pid)) / 1024

    def sample(self) -> None:
        self.peak_rss_mb = max(self.peak_rss_mb, self.rss_mb())

    def cpu_used(self) -> float:
        return self.cpu_seconds() - self._cpu0
