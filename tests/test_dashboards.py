"""The Grafana dashboard (helm/durable-streams/files/dashboards/) queries only metrics the
processes export: a gateway, an archive worker and a delivery worker run as an install runs
them, a workload goes through, and every metric name in every panel's PromQL must be one of
theirs (a renamed metric would otherwise leave a panel silently empty)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from .conftest import free_port, read_all, wait_ready

DASHBOARDS = Path(__file__).resolve().parents[1] / "helm" / "durable-streams" / "files" / "dashboards"
_METRIC = re.compile(r"\b((?:ds|process)_[a-z0-9_]+)\b")
_TYPE = re.compile(r"^# TYPE (\S+) (\w+)$", re.M)
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)[{ ]", re.M)


def queried() -> dict[str, set[str]]:
    """Metric names by the panel that queries them, over every dashboard."""
    found: dict[str, set[str]] = {}
    for path in sorted(DASHBOARDS.glob("*.json")):
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel.get("targets", []):
                for name in _METRIC.findall(target["expr"]):
                    found.setdefault(name, set()).add(f"{path.name}: {panel['title']}")
    return found


def exported(text: str) -> set[str]:
    """Every series name an exposition can hold: samples, and for each declared family the
    names its type gives it (a labelled metric with no series yet is declared all the same)."""
    names = set(_SAMPLE.findall(text))
    for name, kind in _TYPE.findall(text):
        names.add(name)
        if kind == "histogram":
            names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
        elif kind == "counter" and not name.endswith("_total"):
            names.add(f"{name}_total")
    return names


@contextmanager
def process(args: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "gateway", *args], stdout=out, stderr=out, env=env)
    try:
        yield proc
    finally:
        proc.terminate()
        proc.wait(30)


def scrape(port: int, seconds: float = 30) -> str:
    deadline = time.monotonic() + seconds
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                return r.read().decode()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


async def test_every_panel_queries_an_exported_metric(redis_url: str, http, tmp_path: Path) -> None:
    port, archive_port, deliver_port = free_port(), free_port(), free_port()
    archive = ["--redis-url", redis_url, "--archive-url", str(tmp_path / "archive")]
    with ExitStack() as stack:
        gateway = stack.enter_context(
            process(["serve", "--port", str(port), "--redis-url", redis_url], tmp_path / "gateway.log")
        )
        stack.enter_context(
            process(
                [
                    "archive",
                    *archive,
                    "--metrics-port",
                    str(archive_port),
                    "--archive-hot-bytes",
                    "0",
                    "--archive-hot-seconds",
                    "0",
                    "--archive-interval",
                    "0.2",
                ],
                tmp_path / "archive.log",
            )  # fmt: skip
        )
        stack.enter_context(
            process(
                ["deliver", "--redis-url", redis_url, "--metrics-port", str(deliver_port)],
                tmp_path / "deliver.log",
            )
        )
        wait_ready(port, gateway)
        url = f"http://127.0.0.1:{port}/v1/stream/dash-{uuid.uuid4().hex[:8]}"
        async with http.put(url, headers={"Content-Type": "text/plain"}) as r:
            assert r.status == 201
        for n in range(20):
            async with http.post(url, data=b"x%d" % n, headers={"Content-Type": "text/plain"}) as r:
                assert r.status == 204
        async with http.get(url, params={"offset": "-1", "live": "long-poll"}) as r:
            assert r.status == 200
        assert len(await read_all(http, url)) > 0
        texts = [scrape(p) for p in (port, archive_port, deliver_port)]
    names = set().union(*(exported(t) for t in texts))
    wanted = queried()
    missing = {name: sorted(panels) for name, panels in wanted.items() if name not in names}
    assert not missing, f"panels query metrics no process exports: {missing}"
    assert len(wanted) > 25  # the panels were read at all
