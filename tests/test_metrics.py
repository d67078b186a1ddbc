"""/metrics: Prometheus exposition of what the gateway does."""

from __future__ import annotations

import asyncio
import os
import platform
import signal
import subprocess
import sys
import time
import urllib.request
from typing import Any

import redis as redis_py
from prometheus_client.parser import text_string_to_metric_families

from gateway import __version__
from gateway.archive.files import Archive
from gateway.redis_io import keys
from gateway.telemetry import metrics
from workers.archiver import Archiver, Policy

from .conftest import free_port, wait_ready


async def scrape(http, gateway: str) -> dict[tuple[str, tuple], float]:
    base = gateway.split("/v1/stream")[0]
    async with http.get(f"{base}/metrics") as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        text = await r.text()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def test_requests_appends_live_and_redis_are_counted(http, gateway, url):
    before = await scrape(http, gateway)
    async with http.put(url, headers={"Content-Type": "text/plain"}) as r:
        assert r.status == 201
    for _ in range(3):
        async with http.post(url, data=b"12345", headers={"Content-Type": "text/plain"}) as r:
            assert r.status == 204
    async with http.post(url, data=b"[1]", headers={"Content-Type": "application/json"}) as r:
        assert r.status == 409
    async with http.get(gateway.split("/v1/stream")[0] + "/no/such/page") as r:
        assert r.status == 404
    sse = await http.get(url, params={"offset": "now", "live": "sse"})
    await sse.content.readline()
    try:
        for _ in range(50):
            after = await scrape(http, gateway)
            if value(after, "ds_live_connections", mode="sse") >= 1:
                break
            await asyncio.sleep(0.05)
        assert value(after, "ds_live_connections", mode="sse") >= 1
        assert value(after, "ds_pubsub_subscriptions") >= 1
    finally:
        sse.close()

    def grew(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert grew("ds_appends_total") == 3 and grew("ds_appended_bytes_total") == 15
    assert grew("ds_http_requests_total", route="stream", method="POST", status="204") == 3
    assert grew("ds_http_requests_total", route="stream", method="POST", status="409") == 1
    assert grew("ds_http_requests_total", route="stream", method="PUT", status="201") == 1
    assert grew("ds_http_requests_total", route="other", method="GET", status="404") == 1
    assert grew("ds_redis_call_duration_seconds_count", script="append") == 4
    assert grew("ds_http_request_duration_seconds_count", route="stream", method="POST") == 4
    # No stream path ever becomes a label (cardinality).
    assert not any(url.rsplit("/", 1)[1] in str(key) for key in after)


async def test_fanout_delay_is_sampled_for_parked_and_woken_readers(http, gateway, url) -> None:
    """A parked SSE reader (the listener writes to it) and a long-poll reader (woken, it
    reads and answers) each add a sample of ds_fanout_delay_seconds, near zero here."""
    kind = {"Content-Type": "text/plain"}
    async with http.put(url, headers=kind) as r:
        assert r.status == 201
    before = await scrape(http, gateway)
    sse = await http.get(url, params={"offset": "now", "live": "sse"})
    await sse.content.readline()
    poll = asyncio.create_task(http.get(url, params={"offset": "now", "live": "long-poll"}))
    try:
        await asyncio.sleep(0.5)  # both registered and waiting (the SSE one parked)
        async with http.post(url, data=b"hello", headers=kind) as r:
            assert r.status == 204
        async with await poll as r:
            assert r.status == 200 and await r.read() == b"hello"
        count_name = "ds_fanout_delay_seconds_count"
        for _ in range(50):
            after = await scrape(http, gateway)
            count = value(after, count_name) - value(before, count_name)
            if count >= 2:
                break
            await asyncio.sleep(0.05)
        assert count >= 2
        total = value(after, "ds_fanout_delay_seconds_sum") - value(before, "ds_fanout_delay_seconds_sum")
        assert 0 <= total < 5
    finally:
        sse.close()


def _families(text: str) -> dict[str, Any]:
    return {family.name: family for family in text_string_to_metric_families(text)}


async def test_build_info_is_one(http, gateway) -> None:
    samples = await scrape(http, gateway)
    labels = {"version": __version__, "python": platform.python_version(), "redis_py": redis_py.__version__}
    assert value(samples, "ds_build_info", **labels) == 1
    assert [key for key in samples if key[0] == "ds_build_info"] == [
        ("ds_build_info", tuple(sorted(labels.items())))
    ]


async def test_archive_metrics_carry_no_worker_label(http, gateway, url, redis, archive_dir) -> None:
    """A label per worker name (host:pid) made a new series at every restart; the
    cluster-wide gauges say how to aggregate them (max, not sum)."""
    async with http.put(url, data=b"x" * 100, headers={"Content-Type": "text/plain"}) as r:
        assert r.status == 201
    worker = Archiver(redis, Archive(archive_dir), Policy(hot_bytes=0, hot_ms=0, min_bytes=0, max_delay_ms=0))
    await worker.archive_stream(keys.stream_id(url.split("/v1/stream/", 1)[1]))
    await worker.work_once(limit=0)  # reports the backlog
    base = gateway.split("/v1/stream")[0]
    async with http.get(f"{base}/metrics") as r:
        families = _families(await r.text())
    for name in ("ds_archive_bytes", "ds_archive_files", "ds_archive_due_streams", "ds_archive_lag_seconds"):
        assert families[name].samples, name
        allowed = {"node"} if name == "ds_archive_lag_seconds" else set()  # the lag: by Redis primary
        samples = [s for s in families[name].samples if not s.name.endswith("_created")]
        assert all(set(s.labels) <= allowed for s in samples), name
    options = redis.connection_pool.connection_kwargs  # named as ds_redis_used_memory_bytes names nodes
    nodes = {s.labels["node"] for s in families["ds_archive_lag_seconds"].samples}
    assert f"{options['host']}:{options['port']}" in nodes
    assert sum(s.value for s in families["ds_archive_bytes"].samples if s.name.endswith("_total")) >= 100
    for name in ("ds_archive_due_streams", "ds_archive_lag_seconds"):
        assert "max()" in families[name].documentation and "not sum()" in families[name].documentation


def _scrape_sync(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return _families(r.read().decode())


def _workers_of(proc: subprocess.Popen) -> set[int]:
    children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    return {int(pid) for pid in children}


def _by_worker(families: dict[str, Any], name: str) -> dict[str, float]:
    return {s.labels["worker"]: s.value for s in families[name].samples}


def test_gunicorn_workers_report_process_metrics_and_one_build(tmp_path, redis_url: str) -> None:
    """Under gunicorn (multiprocess mode): process_* per worker, labelled by a slot that a
    replacement worker inherits (bounded labels across restarts), and one ds_build_info."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DURABLE_STREAMS_", "PROMETHEUS_"))}
    log = tmp_path / "serve.log"
    with log.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "serve", "--port", str(port), "--redis-url", redis_url,
             "--workers", "2"],
            env=env, stderr=err,
        )  # fmt: skip
    try:
        wait_ready(port, proc)
        deadline = time.monotonic() + 30
        while len(_workers_of(proc)) < 2:
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        for _ in range(4):  # whichever worker answers reports both
            families = _scrape_sync(port)
            (build,) = families["ds_build_info"].samples
            assert build.value == 1 and set(build.labels) == {"version", "python", "redis_py"}
            for name in ("process_resident_memory_bytes", "process_cpu_seconds", "process_open_fds",
                         "process_start_time_seconds"):  # fmt: skip
                assert set(_by_worker(families, name)) == {"0", "1"}, name
        started = _by_worker(families, "process_start_time_seconds")
        assert all(value > 0 for value in _by_worker(families, "process_resident_memory_bytes").values())

        before = _workers_of(proc)
        os.kill(min(before), signal.SIGKILL)  # gunicorn starts a replacement
        while len(_workers_of(proc)) < 2 or _workers_of(proc) == before:
            assert time.monotonic() < deadline + 30, log.read_text()
            time.sleep(0.1)
        wait_ready(port, proc)
        for _ in range(50):
            families = _scrape_sync(port)
            now = _by_worker(families, "process_start_time_seconds")
            if set(now) == {"0", "1"} and now != started:
                break
            time.sleep(0.2)
        assert set(now) == {"0", "1"} and now != started  # the replacement took the dead worker's slot
        assert not any("pid" in s.labels for f in families.values() for s in f.samples)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(40)


def test_a_worker_file_not_sized_yet_does_not_fail_the_scrape(tmp_path, monkeypatch) -> None:
    """A worker creates its metrics file, then sizes it: a scrape in between (or after a
    worker killed in between, for good) used to fail whole (prometheus/client_python#1199)."""
    from prometheus_client.mmap_dict import MmapedDict, mmap_key

    live = MmapedDict(str(tmp_path / "counter_101.db"))
    live.write_value(mmap_key("ds_test", "ds_test_total", [], [], "help"), 3.0, 0.0)
    live.close()
    (tmp_path / "counter_102.db").touch()  # a worker that never got further
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    body, _ = metrics.render()
    assert b"ds_test_total 3.0" in body
