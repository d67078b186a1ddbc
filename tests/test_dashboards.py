"""The Grafana dashboards (helm/durable-streams/files/dashboards/) render from real metrics.

A gateway, an archive worker and a delivery worker run as an install runs them, a real
Prometheus (Debian's ``prometheus`` package; .ci/run installs it) scrapes them every second
while a workload goes through, and then every panel's PromQL is evaluated through Prometheus'
HTTP API as Grafana would (its variables substituted as Grafana substitutes them): every
query must be valid and every panel must show data. The workload makes the series that only
exist on trouble too: a webhook to an address that refuses (failed deliveries), a Redis error
and the 5xx it answers. Without Prometheus that test skips; the cheaper checks remain: every
metric name a panel queries is one the processes export (a renamed metric would otherwise
leave a panel silently empty), and the JSON is one Grafana imports as meant (unique ids,
gridPos, datasource references through the dashboard's datasource variable)."""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from redis.asyncio import Redis

from gateway.redis_io import keys

from .conftest import free_port, read_all, terminate, wait_ready
from .webhooks import LOOPBACK, finish, receiver

DASHBOARDS = Path(__file__).resolve().parents[1] / "helm" / "durable-streams" / "files" / "dashboards"
_METRIC = re.compile(r"\b((?:ds|process)_[a-z0-9_]+)\b")
_TYPE = re.compile(r"^# TYPE (\S+) (\w+)$", re.M)
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)[{ ]", re.M)
# Grafana's template variable syntaxes: $name, ${name}, ${name:format}, [[name]], [[name:format]].
_VARIABLE = re.compile(r"\$\{(\w+)(?::[\w]+)?\}|\$(\w+)|\[\[(\w+)(?::[\w]+)?\]\]")

SCRAPE = 1  # seconds: Prometheus' scrape_interval here, and the "Scrape interval" of Grafana's data source
MAX_DATA_POINTS = 1000  # Grafana's default for a panel about 1000 pixels wide
# The labels a Prometheus Operator scrape (the chart's ServiceMonitor) gives each process' series.
NAMESPACE, FULLNAME = "streams", "ds-durable-streams"
SERVICES = {"gateway": f"{FULLNAME}-admin", "archive": f"{FULLNAME}-archive-metrics",
            "deliver": f"{FULLNAME}-deliver-metrics"}  # fmt: skip
# Panels that may be empty after the workload, each with why (the workload cannot make their
# series): none today. A panel listed here must exist.
MAY_BE_EMPTY: dict[str, str] = {}


def dashboards() -> dict[str, dict[str, Any]]:
    return {path.name: json.loads(path.read_text()) for path in sorted(DASHBOARDS.glob("*.json"))}


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, those inside a collapsed row too (Grafana keeps them in the row's own list)."""
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def queried() -> dict[str, set[str]]:
    """Metric names by the panel that queries them, over every dashboard."""
    found: dict[str, set[str]] = {}
    for name, dashboard in dashboards().items():
        for panel in panels(dashboard):
            for target in panel.get("targets", []):
                for metric in _METRIC.findall(target["expr"]):
                    found.setdefault(metric, set()).add(f"{name}: {panel['title']}")
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


# -- the processes, Prometheus and the workload ------------------------------------------------


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "REDIS_URL" and not k.startswith("DURABLE_STREAMS_")}


@contextmanager
def process(args: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", *args], stdout=out, stderr=out, env=_clean_env()
        )
    try:
        yield proc
    finally:
        terminate(proc, 30)


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


def api(base: str, path: str, **params: str) -> Any:
    """A Prometheus HTTP API call's answer (its JSON, errors included: a 400 is an answer)."""
    url = f"{base}{path}?{urllib.parse.urlencode(params)}"
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as exc:  # 400/422: a bad query, said in the body
        return json.loads(exc.read())


@contextmanager
def prometheus(binary: str, ports: dict[str, int]) -> Iterator[str]:
    """A Prometheus scraping the processes' /metrics every SCRAPE seconds with the labels a
    ServiceMonitor scrape gives (namespace, service, pod): its base URL. Its folder (config,
    TSDB, log) is removed and the process ended after the block."""
    with tempfile.TemporaryDirectory(prefix="ds-prometheus-") as folder:
        config = {
            "global": {"scrape_interval": f"{SCRAPE}s", "scrape_timeout": f"{SCRAPE}s"},
            "scrape_configs": [
                {
                    "job_name": SERVICES[name],
                    "static_configs": [
                        {
                            "targets": [f"127.0.0.1:{port}"],
                            "labels": {
                                "namespace": NAMESPACE,
                                "service": SERVICES[name],
                                "pod": f"{FULLNAME}-{name}-0",
                            },
                        }
                    ],
                }
                for name, port in ports.items()
            ],
        }
        Path(folder, "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
        port = free_port()
        log = Path(folder, "prometheus.log")
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [
                    binary,
                    f"--config.file={folder}/prometheus.yml",
                    f"--storage.tsdb.path={folder}/data",
                    f"--web.listen-address=127.0.0.1:{port}",
                    "--log.level=warn",
                ],
                stdout=out,
                stderr=out,
                stdin=subprocess.DEVNULL,
            )
        try:
            base = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 30
            while True:
                assert proc.poll() is None, f"prometheus exited: {log.read_text()}"
                try:
                    with urllib.request.urlopen(f"{base}/-/ready", timeout=1) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                assert time.monotonic() < deadline, f"prometheus not ready: {log.read_text()}"
                time.sleep(0.1)
            yield base
        finally:
            terminate(proc, 10)


def scraped_after(base: str, moment: float, targets: int, seconds: float = 30) -> float:
    """Until Prometheus holds a successful scrape of every target taken after ``moment``
    (its first scrapes come some seconds after it starts: it applies targets every 5 s);
    returns when the latest of those scrapes was taken."""
    deadline = time.monotonic() + seconds
    while True:
        # timestamp() of a selector: when its last sample was scraped (of an expression such
        # as up == 1 it would be the query's own time)
        found = api(base, "/api/v1/query", query="timestamp(up) and up == 1")["data"]["result"]
        taken = [float(s["value"][1]) for s in found]
        if len(taken) == targets and min(taken) > moment:
            return max(taken)
        if time.monotonic() > deadline:
            raise AssertionError(f"prometheus has no scrape of every target after {moment}: {found}")
        time.sleep(0.2)


async def workload(http: aiohttp.ClientSession, base: str, redis_url: str) -> list[str]:
    """Requests, appends, live reads, archiving, webhook deliveries that finish and that fail,
    a Redis error and its 5xx. Returns the subscriptions it made (to delete)."""
    tag = uuid.uuid4().hex[:8]
    prefix = f"dash-{tag}"
    async with receiver(finish) as box:
        refused = f"http://127.0.0.1:{free_port()}/hook"  # nothing listens: failed deliveries, retried
        subs = [f"dash-done-{tag}", f"dash-failing-{tag}"]
        for sub, target in zip(subs, (box.url, refused), strict=True):
            config = {"type": "webhook", "pattern": f"{prefix}/*", "webhook": {"url": target}}
            async with http.put(f"{base}/__ds/subscriptions/{sub}", json=config) as r:
                assert r.status == 201, await r.text()
        # A Redis error (ds_redis_errors_total) answered 5xx: a read of a stream whose log key
        # something else made a string (WRONGTYPE in the read script).
        broken = f"{prefix}-broken"  # not one the subscriptions match
        async with http.put(f"{base}/{broken}", data=b"x", headers={"Content-Type": "text/plain"}) as r:
            assert r.status == 201
        log_key = keys.stream_keys(keys.stream_id(broken))[1]
        async with Redis.from_url(redis_url) as redis:
            await redis.set(log_key, "not a stream")
            async with http.get(f"{base}/{broken}", params={"offset": "-1"}) as r:
                assert r.status >= 500, (r.status, await r.text())
            await redis.delete(log_key)
        async with http.delete(f"{base}/{broken}") as r:
            assert r.status == 204, await r.text()
        url = f"{base}/{prefix}/s"
        async with http.put(url, headers={"Content-Type": "text/plain"}) as r:
            assert r.status == 201
        # Live readers the appends reach (the fan-out delay): one parked on SSE, written to by
        # the pub/sub listener, and a long-poll woken by the first append.
        sse = await http.get(url, params={"offset": "now", "live": "sse"})
        await sse.content.readline()
        waiting = asyncio.create_task(http.get(url, params={"offset": "now", "live": "long-poll"}))
        await asyncio.sleep(0.3)
        for n in range(20):
            async with http.post(url, data=b"x%d" % n, headers={"Content-Type": "text/plain"}) as r:
                assert r.status == 204
            await asyncio.sleep(0.05)  # spread over a couple of scrapes
        async with await waiting as r:
            assert r.status == 200
        sse.close()
        async with http.get(url, params={"offset": "-1", "live": "long-poll"}) as r:
            assert r.status == 200
        assert len(await read_all(http, url)) > 0
        await box.wait_for(1, timeout=20)  # a delivery answered done
    return subs


def counted(port: int, *samples: str, seconds: float = 20) -> None:
    """Until a process' /metrics has these samples (a delivery is counted once its answer is
    read, a moment after the receiver saw it)."""
    deadline = time.monotonic() + seconds
    while not all(sample in (text := scrape(port)) for sample in samples):
        assert time.monotonic() < deadline, f"not in /metrics of :{port}: {samples}\n{text}"
        time.sleep(0.1)


async def announced(redis_url: str, seconds: float = 30) -> None:
    """Until both workers have told Redis they run: before that a gateway records no new
    stream for the subscriptions (and sends no archive hint), and the first wake would wait
    for a backfill."""
    deadline = time.monotonic() + seconds
    async with Redis.from_url(redis_url) as redis:
        while await redis.exists(keys.SUBS_WORKER_ALIVE, keys.ARCHIVE_WORKER_ALIVE) < 2:
            assert time.monotonic() < deadline, "the workers did not announce themselves"
            await asyncio.sleep(0.05)


@dataclass
class Stack:
    ports: dict[str, int]  # each process' metrics port
    texts: list[str]  # their /metrics after the workload
    prometheus: str | None  # its base URL; None: not installed
    started: float  # when the workload started (unix time)


@pytest.fixture(scope="module")
async def stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    """The three processes, scraped by Prometheus (when installed) from before the workload
    to after it, for this module's tests."""
    logs = tmp_path_factory.mktemp("dashboards")
    ports = {name: free_port() for name in SERVICES}
    binary = shutil.which("prometheus")
    with ExitStack() as running:
        # Prometheus first: its first scrape comes some seconds after it starts, meanwhile
        # the processes start. Stopped first too (the second callback): a gateway that is
        # told to stop waits for the open connections, Prometheus' keep-alive one among them.
        scraper = ExitStack()
        running.callback(scraper.close)
        prom = scraper.enter_context(prometheus(binary, ports)) if binary else None
        allow = ["--webhook-allow", LOOPBACK]
        redis = ["--redis-url", redis_url]
        # No load balancer to wait for when the gateway is told to stop.
        serve = ["serve", "--port", str(ports["gateway"]), *redis, *allow, "--shutdown-delay-seconds", "0"]
        gateway = running.enter_context(process(serve, logs / "gateway.log"))
        archive = ["archive", *redis, "--archive-url", str(logs / "archive"), "--metrics-port",
                   str(ports["archive"]), "--archive-hot-bytes", "0", "--archive-hot-seconds", "0",
                   "--archive-interval", "0.2"]  # fmt: skip
        running.enter_context(process(archive, logs / "archive.log"))
        deliver = ["deliver", *redis, "--metrics-port", str(ports["deliver"]), *allow,
                   "--deliver-poll-seconds", "0.05"]  # fmt: skip
        running.enter_context(process(deliver, logs / "deliver.log"))
        running.callback(scraper.close)
        await asyncio.to_thread(wait_ready, ports["gateway"], gateway)
        await announced(redis_url)
        if prom:  # every process scraped once before the workload: rates see it happen
            await asyncio.to_thread(scraped_after, prom, 0, len(ports))
        started = time.time()
        base = f"http://127.0.0.1:{ports['gateway']}/v1/stream"
        async with aiohttp.ClientSession() as http:
            subs = await workload(http, base, redis_url)
            outcomes = [f'ds_webhook_deliveries_total{{outcome="{o}"}}' for o in ("done", "failed")]
            await asyncio.to_thread(counted, ports["deliver"], *outcomes)
            texts = [scrape(port) for port in ports.values()]
            if prom:  # and twice after it: a series born in the workload has two samples, a rate
                scraped = await asyncio.to_thread(scraped_after, prom, time.time(), len(ports))
                await asyncio.to_thread(scraped_after, prom, scraped, len(ports))
            try:
                yield Stack(ports, texts, prom, started)
            finally:  # the failing subscription would go on being retried by later tests' workers
                for sub in subs:
                    async with http.delete(f"{base}/__ds/subscriptions/{sub}") as r:
                        assert r.status in (200, 204, 404), await r.text()


# -- the tests -----------------------------------------------------------------------------


def test_every_panel_queries_an_exported_metric(stack: Stack) -> None:
    names = set().union(*(exported(t) for t in stack.texts))
    wanted = queried()
    missing = {name: sorted(panels) for name, panels in wanted.items() if name not in names}
    assert not missing, f"panels query metrics no process exports: {missing}"
    assert len(wanted) > 25  # the panels were read at all


def test_dashboards_import_as_meant() -> None:
    """What Grafana's import needs: unique panel ids (a duplicate is renumbered or overwrites a
    panel), a gridPos on the 24-column grid with no two panels on one spot, every datasource
    reference through the dashboard's datasource variable (a fixed uid breaks on every other
    Grafana), every target with its own refId and every variable a query uses defined."""
    for name, dashboard in dashboards().items():
        variables = {v["name"]: v for v in dashboard.get("templating", {}).get("list", [])}
        sources = [v for v in variables if variables[v]["type"] == "datasource"]
        assert len(sources) == 1, f"{name}: one datasource variable, not {sources}"
        reference = {"type": "prometheus", "uid": f"${{{sources[0]}}}"}
        seen: dict[int, str] = {}
        spots: dict[tuple[int, int], str] = {}
        for panel in panels(dashboard):
            title = f"{name}: {panel.get('title')!r}"
            assert isinstance(panel.get("id"), int) and panel["id"] > 0, title
            assert panel["id"] not in seen, f"{title} has the id of {seen.get(panel['id'])}"
            seen[panel["id"]] = title
            grid = panel.get("gridPos")
            assert grid and all(isinstance(grid.get(k), int) for k in "hwxy"), f"{title}: gridPos {grid}"
            assert grid["w"] > 0 and grid["h"] > 0 and grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, title
            for x in range(grid["x"], grid["x"] + grid["w"]):
                for y in range(grid["y"], grid["y"] + grid["h"]):
                    assert (x, y) not in spots, f"{title} overlaps {spots[(x, y)]}"
                    spots[(x, y)] = title
            if panel["type"] == "row":
                assert not panel.get("targets"), title
                continue
            assert panel.get("datasource") == reference, f"{title}: datasource {panel.get('datasource')}"
            targets = panel.get("targets", [])
            assert targets, f"{title} queries nothing"
            assert len({t["refId"] for t in targets}) == len(targets), f"{title}: refIds repeat"
            for target in targets:
                assert target.get("datasource") == reference, f"{title} {target['refId']}: datasource"
                used = {next(g for g in m.groups() if g) for m in _VARIABLE.finditer(target["expr"])}
                unknown = {v for v in used if not v.startswith("__") and v not in variables}
                assert not unknown, f"{title} uses undefined variables {unknown}"


def grafana_variables(dashboard: dict[str, Any], start: float, end: float) -> dict[str, str]:
    """What Grafana puts for each variable in a query over [start, end]: the interval is the
    range over the panel's data points, at least the data source's scrape interval;
    $__rate_interval is max($__interval + scrape interval, 4 x scrape interval); a template
    variable is its "All" (allValue, else a regex of every value: ``.*`` matches them all)
    when it has one, else its current value."""
    seconds = max(1, round(end - start))
    interval = max(SCRAPE, round(seconds / MAX_DATA_POINTS))
    values = {
        "__interval": f"{interval}s",
        "__interval_ms": str(interval * 1000),
        "__rate_interval": f"{max(interval + SCRAPE, 4 * SCRAPE)}s",
        "__range": f"{seconds}s",
        "__range_s": str(seconds),
        "__range_ms": str(seconds * 1000),
    }
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable["type"] == "datasource":
            continue  # in datasource references only (test_dashboards_import_as_meant)
        if variable.get("includeAll") or variable.get("multi"):
            values[variable["name"]] = variable.get("allValue") or ".*"
        else:
            current = variable.get("current", {}).get("value") or variable.get("query")
            assert isinstance(current, str), f"no value for ${variable['name']}: teach this test"
            values[variable["name"]] = current
    return values


def substitute(expr: str, values: dict[str, str]) -> str:
    def one(match: re.Match[str]) -> str:
        name = next(g for g in match.groups() if g)
        return values.get(name, match.group(0))

    return _VARIABLE.sub(one, expr)


def has_data(answer: dict[str, Any]) -> bool:
    """A range query's answer holds a point Grafana draws (NaN is no point: e.g. a quantile of
    a histogram that observed nothing)."""
    return any(
        not math.isnan(float(value)) for series in answer["data"]["result"] for _, value in series["values"]
    )


def test_every_panel_renders_from_real_metrics(stack: Stack) -> None:
    """Every target of every panel, as Grafana's time series panels query it (query_range over
    the dashboard's time range, step $__interval), is valid PromQL; every panel has data."""
    if stack.prometheus is None:
        pytest.skip("needs prometheus on PATH (Debian's prometheus package; .ci/run installs it)")
    start, end = stack.started - 10, time.time()
    invalid: list[str] = []
    empty: list[str] = []
    titles: set[str] = set()
    for name, dashboard in dashboards().items():
        values = grafana_variables(dashboard, start, end)
        for panel in panels(dashboard):
            if panel["type"] == "row":
                continue
            title = f"{name}: {panel['title']}"
            titles.add(panel["title"])
            shown = False
            for target in panel["targets"]:
                expr = substitute(target["expr"], values)
                assert "$" not in expr and "[[" not in expr, f"{title}: a variable left in {expr}"
                answer = api(
                    stack.prometheus,
                    "/api/v1/query_range",
                    query=expr,
                    start=f"{start:.3f}",
                    end=f"{end:.3f}",
                    step=values["__interval"],
                )
                if answer.get("status") != "success":
                    invalid.append(f"{title} {target['refId']}: {expr}: {answer.get('error')}")
                elif has_data(answer):
                    shown = True
            if not shown and panel["title"] not in MAY_BE_EMPTY:
                empty.append(title)
    assert not invalid, "queries Prometheus refuses:\n" + "\n".join(invalid)
    assert not empty, "panels with no data after the workload:\n" + "\n".join(empty)
    assert set(MAY_BE_EMPTY) <= titles, f"allowed empty, yet no such panel: {set(MAY_BE_EMPTY) - titles}"
    assert len(titles) > 20  # the panels were read at all
