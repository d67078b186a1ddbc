"""The fan-out benchmark's subscribers count right (``loadtest/fanout.py``), in both
implementations: Python's in-process protocols and Go's ``loadtest/ssegen``, built here
(Go is installed by .ci/run). A small run against a gateway: every subscriber connected,
every message delivered once, latencies present; then a run whose subscribers the server
cycles (a short SSE cycle) must still count each message once, across reconnects."""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from loadtest import fanout

from .conftest import serving

GENERATORS = [
    "python",
    pytest.param("go", marks=pytest.mark.skipif(shutil.which("go") is None, reason="no Go toolchain")),
]


@pytest.mark.parametrize("generator", GENERATORS)
async def test_every_subscriber_counts_every_message_once(redis_url: str, generator: str) -> None:
    async with serving(redis_url) as base:
        result = await fanout.run_one(base, "ours", 20, 20.0, 1.0, 64, None, generator)
    assert (result.connected, result.messages) == (20, 20)
    assert (result.lost, result.duplicated, result.subscribers_missing_data) == (0, 0, 0)
    assert 0 <= result.ack_p50_ms <= result.ack_p99_ms
    assert 0 <= result.p50_ms <= result.p99_ms <= result.max_ms
    assert result.generator == generator and not math.isnan(result.generator_cpu_percent)


@pytest.mark.parametrize("generator", GENERATORS)
async def test_reconnected_subscribers_resume_at_their_offset(redis_url: str, generator: str) -> None:
    async with serving(redis_url, sse_cycle_seconds=0.5) as base:
        result = await fanout.run_one(base, "ours", 10, 20.0, 2.0, 64, None, generator)
    assert result.reconnects >= 10  # each was cycled at least once
    assert (result.lost, result.duplicated) == (0, 0)


@pytest.mark.parametrize("generator", GENERATORS)
async def test_subscribers_refused_are_counted_not_connected(redis_url: str, generator: str) -> None:
    """A subscribe the server answers other than 200 (here 503: past its live-connection
    limit) is no subscriber: not counted connected, counted refused, tried again."""
    async with serving(redis_url, max_live_connections=3) as base:
        url = f"{base}/refused-{generator}"
        await asyncio.to_thread(fanout._http, "PUT", url)
        parts = urlsplit(url)
        assert parts.hostname and parts.port
        kind = fanout.GENERATORS[generator]
        async with kind(6, parts.hostname, parts.port, parts.path, connect_seconds=1.5) as subs:
            connected = await subs.connect()
            subs.begin()
            delivered = await subs.finish({}, {})
    assert connected == 3
    assert delivered["refused"] >= 6  # the other three, each at least twice in 1.5 s


def test_process_meter_survives_threads_and_children_going() -> None:
    """The meter walks /proc while the measured process's threads and children come and go
    (the Python generator measures itself, its executor threads ending): one gone between
    listing and reading counts nothing rather than failing the run (a CI run once did)."""
    import subprocess
    import threading
    import time

    from loadtest import servers

    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            worker = threading.Thread(target=sum, args=(range(2_000),))
            worker.start()
            worker.join()

    gone = subprocess.Popen(["true"])
    gone.wait()
    assert servers._cpu_seconds([gone.pid]) == 0.0 and servers._proc_text(f"/proc/{gone.pid}/stat") == ""
    churner = threading.Thread(target=churn)
    churner.start()
    try:
        meter = servers.ProcessMeter(os.getpid())
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            assert meter.cpu_used() >= 0.0
    finally:
        stop.set()
        churner.join()
    assert meter.cpu_used() > 0.0


def test_process_meter_counts_the_memory_of_workers_too() -> None:
    """RSS of a server is its whole process tree (gunicorn's workers hold the connections,
    not its master), the embedded Redis excepted: a parent whose child holds 64 MiB reads
    at least that much more than the parent alone."""
    import subprocess
    import sys

    from loadtest import servers

    child = "b = bytearray(64 << 20); b[::4096] = b'x' * len(b[::4096]); print(1, flush=True); input()"
    parent = (
        "import subprocess, sys; c = subprocess.Popen([sys.executable, '-c', sys.argv[1]],"
        " stdin=subprocess.PIPE, stdout=subprocess.PIPE); c.stdout.readline(); print(1, flush=True);"
        " sys.stdin.readline(); c.stdin.close(); c.wait()"
    )
    with subprocess.Popen(
        [sys.executable, "-c", parent, child], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as proc:
        assert proc.stdout is not None and proc.stdin is not None
        proc.stdout.readline()  # the child holds its 64 MiB
        alone = servers._rss_kib(proc.pid) / 1024
        assert servers.ProcessMeter(proc.pid).rss_mb() >= alone + 60
        proc.stdin.close()


PIN_PROBE = """
import json, os, sys
from pathlib import Path
from loadtest import servers

def cpus(pids):
    return sorted({c for p in pids for t in Path(f"/proc/{p}/task").glob("*")
                   for c in os.sched_getaffinity(int(t.name))})

with servers.start("ours") as server:
    said = servers.pin(server)
    print(json.dumps({"said": said, "server": cpus(servers._descendants(server.pid)),
                      "redis": cpus(servers._descendants(server.pid, redis=True)),
                      "generator": cpus([os.getpid()])}))
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="--pin needs two CPUs")
def test_pin_gives_the_server_a_core_and_the_rest_the_others() -> None:
    """``--pin`` (compare, appends, fanout): every thread of the server on one CPU; the load
    generator (so wrk, which it starts) and ours' embedded Redis on the others. Run in a
    process of its own: pinning the test process would pin the rest of the suite."""
    import subprocess
    import sys

    first, *rest = sorted(os.sched_getaffinity(0))
    out = subprocess.run(
        [sys.executable, "-c", PIN_PROBE], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen["server"] == [first]
    assert seen["redis"] == rest and seen["generator"] == rest
    assert seen["said"].startswith(f"ours on CPU {first};")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="--pin needs two CPUs")
def test_fanout_pin_runs_the_server_on_a_core_of_its_own(tmp_path: Path) -> None:
    """``loadtest.fanout --pin``: the server pinned as above (it says where), the run
    itself unchanged: every subscriber gets every message once."""
    import subprocess
    import sys

    first = sorted(os.sched_getaffinity(0))[0]
    args = ["--servers", "ours", "--subscribers", "5", "--rate", "10", "--duration", "1", "--pin"]
    out = subprocess.run(
        [sys.executable, "-m", "loadtest.fanout", *args, "--generator", "python", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    ).stdout
    assert f"ours on CPU {first};" in out
    (row,) = json.loads((tmp_path / "fanout.json").read_text())
    assert (row["connected"], row["messages"], row["lost"], row["duplicated"]) == (5, 10, 0, 0)
