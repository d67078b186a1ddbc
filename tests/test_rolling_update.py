"""A rolling update behind a real nginx that no client sees.

nginx proxies as an ingress does: HTTP/1.1 with keep-alive connections to the upstreams
(``keepalive``, ``proxy_http_version 1.1``, ``proxy_set_header Connection ""``), unbuffered,
and ``proxy_next_upstream`` at nginx's defaults, so a POST it already sent is never retried:
a gateway that closes a keep-alive connection nginx is about to reuse shows as a 502.

Three gateway processes (one of them ``--workers 2``, under gunicorn) are replaced one after
another as a Deployment with ``maxSurge`` does: a new one starts and joins the upstreams, then
the old one gets SIGTERM and, a moment later, leaves them. The upstreams change by rewriting
nginx's upstream block and ``nginx -s reload``, as an endpoint controller does on a change of
the Service's endpoints (the Service drops a terminating pod at once; the controller's update
lands a little later, which the gap between SIGTERM and the reload stands for). nginx's passive
health checks (``max_fails``) would only stop sending to a gateway after real requests failed,
which is what Kubernetes' endpoints spare clients.

Meanwhile writers append through nginx and SSE readers follow the streams through it,
reconnecting from their last offset whenever a response ends. Nothing a client sees may fail:
no 502, 503 or reset on any append or read; every acknowledged append is stored exactly once;
every reader gets every byte once, in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.client import HTTPConnection
from pathlib import Path

import aiohttp
import pytest

from loadtest.sse_client import sse_lines

from .conftest import free_port, read_all
from .faults.harness import GatewayProc

DELAY = 1.5  # --shutdown-delay-seconds of the gateways here (the chart's is longer: its probes)
PROPAGATION = 0.4  # SIGTERM to the upstream change, as an ingress controller takes to see it
# Streams as (writers, SSE readers, seconds between one writer's appends): busy ones, about
# 300 appends/s in all on a small machine, and a quiet one whose readers mostly wait (as most
# do): every gateway holds dozens of live responses when its SIGTERM comes.
STREAMS = [(4, 15, 0.01), (4, 15, 0.01), (4, 15, 0.01), (1, 45, 0.2)]

NGINX_CONF = """\
{user}
worker_processes 1;
pid {root}/nginx.pid;
error_log {root}/error.log notice;
events {{ worker_connections 1024; }}
http {{
    log_format upstream '$request_method $status $upstream_addr $upstream_status $request_time';
    access_log {root}/access.log upstream;
    client_body_temp_path {root}/tmp/body;
    proxy_temp_path {root}/tmp/proxy;
    fastcgi_temp_path {root}/tmp/fastcgi;
    uwsgi_temp_path {root}/tmp/uwsgi;
    scgi_temp_path {root}/tmp/scgi;
    include {root}/upstream.conf;
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://gateways;
            # What ingress-nginx does (and the chart asks of it): keep-alive to the upstreams,
            # nothing buffered. proxy_next_upstream stays at its default: no retried POSTs.
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header Host $http_host;
            proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_read_timeout 120s;
        }}
    }}
}}
"""


def nginx_binary() -> str:
    found = shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None
    )
    if found is None:
        pytest.skip("needs an nginx binary (Debian: apt-get install nginx; .ci/run installs it)")
    return found


class Nginx:
    """An nginx of the test's own, on loopback, its upstreams rewritten and reloaded."""

    def __init__(self, root: Path) -> None:
        self.binary = nginx_binary()
        self.root = root
        self.port = free_port()
        (root / "tmp").mkdir(parents=True)
        user = "user root;" if os.geteuid() == 0 else ""  # workers must reach the test's 0700 dirs
        (root / "nginx.conf").write_text(NGINX_CONF.format(user=user, root=root, port=self.port))
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _command(self, *extra: str) -> list[str]:
        return [self.binary, "-p", str(self.root), "-c", str(self.root / "nginx.conf"),
                "-e", str(self.root / "error.log"), *extra]  # fmt: skip

    def upstreams(self, ports: list[int]) -> None:
        servers = "".join(f"    server 127.0.0.1:{port};\n" for port in ports)
        (self.root / "upstream.conf").write_text(f"upstream gateways {{\n{servers}    keepalive 32;\n}}\n")

    def start(self, ports: list[int]) -> None:
        self.upstreams(ports)
        self.process = subprocess.Popen(self._command("-g", "daemon off;"), stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.error_log()
            try:
                with urllib.request.urlopen(f"{self.base}/readyz", timeout=1):
                    return
            except urllib.error.HTTPError:
                return  # nginx answers: its upstreams' answer does not matter here
            except OSError:
                time.sleep(0.05)
        raise AssertionError(f"nginx did not start:\n{self.error_log()}")

    def reload(self, ports: list[int]) -> None:
        """New upstreams, as an endpoint controller writes them (nginx -s reload)."""
        self.upstreams(ports)
        subprocess.run(self._command("-s", "reload"), check=True, timeout=10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()  # nginx's fast shutdown: nothing to wait for here
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def error_log(self) -> str:
        with contextlib.suppress(OSError):
            return (self.root / "error.log").read_text(errors="replace")[-3000:]
        return ""

    def upstream_errors(self) -> list[str]:
        """What nginx said of requests an upstream failed (a refused connect is retried)."""
        with contextlib.suppress(OSError):
            lines = (self.root / "error.log").read_text(errors="replace").splitlines()
            return [line for line in lines if "[error]" in line and "Connection refused" not in line]
        return []


# The delay as a variable, not a flag: the same test runs against an older server
# (tests/faults/harness.py: DS_FAULT_SERVER_ROOT) to show what it fixes.
GATEWAY_ENV = {"DURABLE_STREAMS_SHUTDOWN_DELAY_SECONDS": str(DELAY)}


@contextlib.contextmanager
def gateways_behind_nginx(
    root: Path, redis_url: str, *, flags: list[str] | None = None, command: list[str] | None = None,
    cwd: str | None = None, env: dict[str, str] | None = None,
) -> Iterator[tuple[Nginx, list[GatewayProc]]]:  # fmt: skip
    """Three gateways behind nginx; the list is theirs and their replacements' (all stopped here).
    ``flags`` go to each of them; ``command``, ``cwd``, ``env``: another build's (GatewayProc)."""
    logs = root / "logs"
    logs.mkdir()
    # One of them under gunicorn: its master passes SIGTERM on to the workers.
    each: list[list[str]] = [[], ["--workers", "2"], []]
    their_env = {**GATEWAY_ENV, **(env or {})}
    gateways = [
        GatewayProc(f"old{i}", redis_url, logs, [*f, *(flags or [])], their_env, command, cwd)
        for i, f in enumerate(each)
    ]
    nginx = Nginx(root / "nginx")
    try:
        for gw in gateways:
            gw.start()
        for gw in gateways:
            gw.start_ready()
        nginx.start([gw.port for gw in gateways])
        yield nginx, gateways
    finally:
        nginx.stop()
        for gw in gateways:
            with contextlib.suppress(Exception):
                gw.terminate(DELAY + 15)


def readiness(port: int) -> int:
    """A gateway's /readyz status; 0: it does not listen (any more)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


@dataclass
class Rollout:
    readiness: list[int] = field(default_factory=list)  # each old gateway's, just after its SIGTERM
    exits: list[int | None] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)  # from each SIGTERM to that gateway's exit


async def roll(
    nginx: Nginx, gateways: list[GatewayProc], redis_url: str, *, flags: list[str] | None = None
) -> Rollout:
    """Replace every gateway in turn, as a Deployment with maxSurge does: the new one starts and
    joins the upstreams; the old one gets SIGTERM and leaves them PROPAGATION later. The new
    ones run this venv's gateway, with ``flags``."""
    done = Rollout()
    live = list(gateways)
    for i, old in enumerate(list(gateways)):
        new = GatewayProc(f"new{i}", redis_url, old.log_path.parent, list(flags or []), GATEWAY_ENV)
        gateways.append(new)
        await asyncio.to_thread(new.start_ready)
        live.append(new)
        await asyncio.to_thread(nginx.reload, [gw.port for gw in live])
        await asyncio.sleep(0.5)  # the new one takes its share of requests
        signalled = time.monotonic()
        old.signal(signal.SIGTERM)
        await asyncio.sleep(0.1)
        done.readiness.append(await asyncio.to_thread(readiness, old.port))
        await asyncio.sleep(PROPAGATION - 0.1)
        live.remove(old)
        await asyncio.to_thread(nginx.reload, [gw.port for gw in live])
        assert old.process is not None
        with contextlib.suppress(subprocess.TimeoutExpired):
            await asyncio.to_thread(old.process.wait, DELAY + 15)
        done.exits.append(old.process.poll())
        done.seconds.append(time.monotonic() - signalled)
    return done


RECORD = "{writer:02d}:{seq:07d};"  # fixed width: a stream's records split back apart
RECORD_BYTES = len(RECORD.format(writer=0, seq=0))


@dataclass
class Stream:
    url: str
    writers: int
    pause: float  # seconds between one writer's appends
    gots: list[bytearray]  # what each reader got
    acked: list[str] = field(default_factory=list)
    tried: set[str] = field(default_factory=set)


async def write(
    http: aiohttp.ClientSession, stream: Stream, writer: int, stop: asyncio.Event, failures: list[str]
) -> None:
    seq = 0
    while not stop.is_set():
        record = RECORD.format(writer=writer, seq=seq)
        seq += 1
        stream.tried.add(record)
        try:
            async with http.post(stream.url, data=record, headers={"Content-Type": "text/plain"}) as r:
                body = await r.read()
                if r.status == 204:
                    stream.acked.append(record)
                else:
                    failures.append(f"append {record}: {r.status} {body[:100]!r}")
        except aiohttp.ClientError as exc:
            failures.append(f"append {record}: {type(exc).__name__}: {exc}")
        await asyncio.sleep(stream.pause)


async def follow(http: aiohttp.ClientSession, url: str, got: bytearray, failures: list[str]) -> int:
    """Read the stream over SSE to its end, resuming at the last control event's offset
    whenever a response ends; data counts once its control event came. Returns the number
    of responses it took."""
    offset, responses = "-1", 0
    while True:
        responses += 1
        pending = bytearray()
        try:
            async with http.get(url, params={"offset": offset, "live": "sse"}) as r:
                if r.status != 200:
                    failures.append(f"read at {offset}: {r.status} {(await r.read())[:100]!r}")
                    await asyncio.sleep(0.05)
                    continue
                async for event, data in sse_lines(r):
                    if event == "data":
                        pending.extend(data.encode())
                    elif event == "control":
                        control = json.loads(data)
                        got.extend(pending)
                        pending.clear()
                        offset = control["streamNextOffset"]
                        if control.get("streamClosed"):
                            return responses
        except aiohttp.ClientError as exc:
            failures.append(f"read at {offset}: {type(exc).__name__}: {exc}")
            await asyncio.sleep(0.05)


async def test_a_rolling_update_behind_nginx_shows_clients_nothing(tmp_path: Path, redis_url: str) -> None:
    write_failures: list[str] = []
    read_failures: list[str] = []
    with gateways_behind_nginx(tmp_path, redis_url) as (nginx, gateways):
        # A new connection for every request between clients and nginx: a reload closes nginx's
        # idle client connections, a race of nginx's own (ingress-nginx changes endpoints
        # without reloading). Between nginx and the gateways, keep-alive as in production.
        connector = aiohttp.TCPConnector(force_close=True, limit=0)
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
            streams = [
                Stream(f"{nginx.base}/v1/stream/rolling-{uuid.uuid4().hex[:8]}-{i}", writers, pause,
                       [bytearray() for _ in range(readers)])
                for i, (writers, readers, pause) in enumerate(STREAMS)
            ]  # fmt: skip
            for stream in streams:
                async with http.put(stream.url, headers={"Content-Type": "text/plain"}) as r:
                    assert r.status == 201, r.status
            readers = [asyncio.create_task(follow(http, stream.url, got, read_failures))
                       for stream in streams for got in stream.gots]  # fmt: skip
            stop = asyncio.Event()
            writers = [asyncio.create_task(write(http, stream, w, stop, write_failures))
                       for stream in streams for w in range(stream.writers)]  # fmt: skip
            try:
                await asyncio.sleep(1.0)  # readers connected, keep-alive connections pooled
                rollout = await roll(nginx, gateways, redis_url)
                await asyncio.sleep(1.0)  # steady traffic on the new gateways alone
            finally:
                stop.set()
                await asyncio.gather(*writers, return_exceptions=True)
            for stream in streams:
                async with http.post(stream.url, headers={"Stream-Closed": "true"}) as r:
                    assert r.status == 204, r.status
            try:
                responses = await asyncio.wait_for(asyncio.gather(*readers), 30)
            finally:
                for task in readers:
                    task.cancel()
            stored = [await read_all(http, stream.url) for stream in streams]

    said = "\n".join(nginx.upstream_errors()[:5])  # e.g. "recv() failed (104: Connection reset by peer)"
    assert not write_failures, f"{len(write_failures)} appends failed: {write_failures[:5]}\n{said}"
    assert not read_failures, f"{len(read_failures)} reads failed: {read_failures[:10]}"
    for stream, data in zip(streams, stored, strict=True):
        records = [data[i : i + RECORD_BYTES].decode() for i in range(0, len(data), RECORD_BYTES)]
        assert len(records) == len(set(records)), "a record stored twice"
        assert set(records) <= stream.tried
        assert set(stream.acked) <= set(records), "an acknowledged append is missing"
        # It really ran under load, through the whole rollout: the slow stream's one writer
        # appends ~5 times a second for the ~10 s a rollout takes (50 exactly in one run).
        assert len(stream.acked) >= 20 * stream.writers, len(stream.acked)
        for got in stream.gots:
            assert bytes(got) == data  # every byte once, in order, across reconnects
    # Not ready at once; SSE responses ended (their readers reconnected, through nginx,
    # elsewhere); each gateway stopped once its delay and drain were over.
    assert rollout.readiness == [503, 503, 503]
    assert min(responses) >= 2
    assert rollout.exits == [0, 0, 0]
    assert all(DELAY <= seconds < DELAY + 5 for seconds in rollout.seconds), rollout.seconds


@pytest.mark.parametrize("workers", [1, 2])
def test_sigterm_serves_on_not_ready_with_connection_close_then_drains(
    tmp_path: Path, redis_url: str, workers: int
) -> None:
    """Without a proxy: after SIGTERM the gateway answers on a keep-alive connection opened
    before, and on new ones, each time with Connection: close; /readyz is 503; an SSE response
    ends at once with its resume offset; the process exits 0 once the delay and drain are over."""
    gw = GatewayProc("gw", redis_url, tmp_path, ["--workers", str(workers)], GATEWAY_ENV)
    path = f"/v1/stream/drain-{uuid.uuid4().hex[:8]}"
    try:
        gw.start_ready()
        kept = HTTPConnection("127.0.0.1", gw.port, timeout=5)
        kept.request("PUT", path, headers={"Content-Type": "text/plain"})
        created = kept.getresponse()
        created.read()
        assert created.status == 201 and created.getheader("Connection") != "close"
        sse = HTTPConnection("127.0.0.1", gw.port, timeout=5)
        sse.request("GET", f"{path}?offset=-1&live=sse")
        events = sse.getresponse()
        assert events.status == 200
        assert b"upToDate" in events.readline() + events.readline() + events.readline()
        signalled = time.monotonic()
        gw.signal(signal.SIGTERM)
        rest = events.read()  # to the end of the response
        assert time.monotonic() - signalled < DELAY
        assert b"event: control" in rest and b"streamNextOffset" in rest
        deadline = time.monotonic() + 2
        while readiness(gw.port) != 503:  # each worker process on its own SIGTERM
            assert time.monotonic() < deadline
            time.sleep(0.02)
        kept.request("POST", path, body=b"a", headers={"Content-Type": "text/plain"})
        appended = kept.getresponse()
        appended.read()
        assert (appended.status, appended.getheader("Connection")) == (204, "close")
        fresh = HTTPConnection("127.0.0.1", gw.port, timeout=5)
        fresh.request("POST", path, body=b"b", headers={"Content-Type": "text/plain"})
        appended = fresh.getresponse()
        appended.read()
        assert (appended.status, appended.getheader("Connection")) == (204, "close")
        assert time.monotonic() - signalled < DELAY  # all of it within the delay
        assert gw.process is not None
        assert gw.process.wait(DELAY + 15) == 0, gw.log_tail()
        assert time.monotonic() - signalled >= DELAY
    finally:
        gw.terminate(DELAY + 15)
