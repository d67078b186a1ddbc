"""``durable-streams doctor``: is this Redis (and archive location) fit for the gateway?

One line per check, ``ok``, ``warn`` or ``fail`` and what to fix: the Redis version,
persistence, eviction, round-trip latency, cluster mode against --redis-cluster, the
key layout version, and the archive location. Exit code 0 when nothing fails, else 1.

The judgements are the gateway's own (gateway/redis_io: durability, layout), called
here rather than restated, so doctor and a starting gateway never disagree. It only
reads: unlike a starting gateway it never stamps the key layout version.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import fsspec
from redis.exceptions import ResponseError

from .. import config
from ..redis_io import connections as redis_client
from ..redis_io import durability, fleet, keys, layout
from ..redis_io.preflight import reason
from .embedded import redis_url_or_running

PINGS = 5
SLOW_PING_MS = 5.0  # a p50 above this: every append waits on several round trips to Redis
FSYNC_FIX = "CONFIG SET appendonly yes; CONFIG SET appendfsync always (and both in redis.conf)"


@dataclass(frozen=True)
class Finding:
    level: str  # ok, warn, fail
    check: str
    text: str

    def line(self) -> str:
        return f"{self.level:<5} {self.check}: {self.text}"


def register(commands: argparse._SubParsersAction[Any]) -> None:
    parser = commands.add_parser(
        "doctor",
        help="check that Redis (and the archive location) are set up for the gateway",
        description="Connect to Redis and print a checklist: version, persistence, eviction, latency, "
        "cluster mode, key layout, archive location; each line ok, warn or fail with what to fix. "
        "Exit code 0 when nothing fails, else 1. Without --redis-url it uses the embedded Redis of a "
        "`durable-streams serve` on the same --data-dir.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    config.add_arguments(parser, config.taken_by("doctor"))
    parser.set_defaults(main=main)


def main(args: argparse.Namespace) -> int:
    settings = config.from_namespace(args)
    findings = asyncio.run(_redis_findings(settings)) + [archive_finding(settings.archive_location)]
    for finding in findings:
        print(finding.line(), flush=True)
    failed = [f for f in findings if f.level == "fail"]
    if failed:
        print(f"doctor: {len(failed)} check(s) failed", file=sys.stderr)
        return 1
    return 0


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def _redis_findings(settings: config.Settings) -> list[Finding]:
    try:
        url = redis_url_or_running(settings.redis_url, settings.data_dir)
    except RuntimeError as exc:
        return [Finding("fail", "redis", str(exc))]
    timeout = settings.redis_timeout
    options = {"socket_timeout": timeout, "socket_connect_timeout": timeout}
    # A plain client first: it can ask any node whether it is a cluster node, which a
    # cluster client cannot do on a single Redis (it fails to start).
    node = redis_client.general(url, cluster=False, **options)
    try:
        try:
            server = await node.info("server")
            cluster_info = await node.info("cluster")
        except Exception as exc:  # unreachable, refused, bad password: nothing else can be checked
            return [Finding("fail", "redis", f"cannot use {_redacted(url)}: {reason(exc)}")]
        findings = [version_finding(_text(server.get("redis_version", "0")))]
        enabled = bool(int(cluster_info.get("cluster_enabled", 0)))
        findings.append(cluster_finding(enabled, settings.redis_cluster))
        findings.append(await latency_finding(node))
        if enabled and settings.redis_cluster:
            whole = redis_client.general(url, cluster=True, **options)
            try:
                findings += await _data_findings(whole)
            finally:
                await whole.aclose()
        else:
            findings += await _data_findings(node)
        return findings
    finally:
        await node.aclose()


def _redacted(url: str) -> str:
    """The URL without a password, for output that may land in a ticket."""
    if "@" not in url:
        return url
    scheme, _, rest = url.partition("://")
    return f"{scheme}://***@{rest.rsplit('@', 1)[1]}"


async def _data_findings(redis: redis_client.Client) -> list[Finding]:
    findings = []
    for check in (persistence_findings, eviction_findings, layout_finding, fleet_finding):
        try:
            found = await check(redis)
        except Exception as exc:  # one check's failure is its line, the others still run
            found = [Finding("fail", check.__name__.split("_")[0], reason(exc))]
        findings += found if isinstance(found, list) else [found]
    return findings


def version_finding(release: str) -> Finding:
    major, minor = redis_client.version(release)
    if (major, minor) >= (7, 0):
        return Finding("ok", "version", f"Redis {release}")
    if (major, minor) >= (6, 2):
        return Finding(
            "warn", "version", f"Redis {release} works; 7+ recommended (faster scripts, sharded pub/sub)"
        )
    return Finding("fail", "version", f"Redis {release} is too old: 6.2 or later needed, 7+ recommended")


def cluster_finding(enabled: bool, flag: bool) -> Finding:
    if enabled == flag:
        mode = "Redis Cluster, --redis-cluster given" if enabled else "single Redis (not a cluster)"
        return Finding("ok", "cluster", mode)
    if enabled:
        return Finding("fail", "cluster", "this Redis is a cluster node: give --redis-cluster")
    return Finding("fail", "cluster", "--redis-cluster given, but this Redis is not a cluster node: drop it")


async def latency_finding(redis: redis_client.Client) -> Finding:
    times = []
    for _ in range(PINGS):
        start = time.perf_counter()
        await redis.ping()
        times.append((time.perf_counter() - start) * 1000)
    p50, worst = statistics.median(times), max(times)
    text = f"{PINGS} PINGs: p50 {p50:.2f} ms, max {worst:.2f} ms"
    if p50 > SLOW_PING_MS:
        return Finding(
            "warn", "latency", f"{text}: every append waits on Redis; run it closer to the gateways"
        )
    return Finding("ok", "latency", text)


def _on(node: str) -> str:
    return f" on {node}" if node else ""


async def persistence_findings(redis: redis_client.Client) -> list[Finding]:
    try:
        nodes = await durability.node_config(redis, "append*")
    except ResponseError as exc:  # managed Redis often forbids CONFIG
        return [Finding("warn", "persistence", f"cannot read it ({exc}): make sure appendfsync is always")]
    findings = []
    for node, settings in nodes:
        appendonly, appendfsync = settings.get("appendonly", ""), settings.get("appendfsync", "")
        problem = durability.assess(appendonly, appendfsync)
        if problem is None:
            text = f"appendonly={appendonly} appendfsync={appendfsync}{_on(node)}"
            findings.append(Finding("ok", "persistence", text))
        else:  # the gateway runs (it refuses only with --require-durable), but can lose writes
            findings.append(Finding("warn", "persistence", f"{problem}{_on(node)}; fix: {FSYNC_FIX}"))
    return findings


async def eviction_findings(redis: redis_client.Client) -> list[Finding]:
    try:
        nodes = await durability.node_config(redis, "maxmemory-policy")
    except ResponseError as exc:
        return [
            Finding("warn", "eviction", f"cannot read it ({exc}): make sure maxmemory-policy is noeviction")
        ]
    findings = []
    for node, settings in nodes:
        policy = settings.get("maxmemory-policy", "unknown")
        problem = durability.assess_eviction(policy)
        if problem is None:
            findings.append(Finding("ok", "eviction", f"maxmemory-policy={policy}{_on(node)}"))
        else:  # Redis would delete acknowledged streams under memory pressure
            findings.append(Finding("fail", "eviction", f"{problem}{_on(node)}"))
    return findings


async def layout_finding(redis: redis_client.Client) -> Finding:
    raw = await redis.get(keys.LAYOUT)  # read only: the first gateway to start stamps it
    if raw is None:
        return Finding("ok", "layout", f"no version yet: the first gateway sets v{layout.CURRENT}")
    text = _text(raw)
    if not text.isdigit() or int(text) < 1:
        return Finding("fail", "layout", f"{keys.LAYOUT} holds {text!r}, not a key layout version")
    problem = layout.verdict(int(text), oldest=await layout.oldest_held(redis, int(text)))
    if problem:
        return Finding("fail", "layout", problem)
    return Finding("ok", "layout", f"v{text}, this build's")


async def fleet_finding(redis: redis_client.Client) -> Finding:
    """Who runs (the fleet registry), and whether a rolling layout change waits for --finish."""
    members = await fleet.members(redis)
    raw = await redis.get(keys.LAYOUT)
    written = int(_text(raw)) if raw is not None and _text(raw).isdigit() else None
    builds = sorted({f"{m.build} (reads v{m.reads[0]}-v{m.reads[1]})" for m in members})
    who = f"{len(members)} live process(es)" + (f": {', '.join(builds)}" if builds else "")
    finish = "`durable-streams migrate --finish`"
    if written is not None and await layout.oldest_held(redis, written) < written:
        return Finding("warn", "fleet", f"{who}; a layout change is half done: run {finish}")
    if written is not None and members and all(m.reads[1] > written for m in members):
        return Finding("warn", "fleet", f"{who}; all read v{written + 1}: {finish} switches to it")
    return Finding("ok", "fleet", who)


def archive_finding(location: str) -> Finding:
    """Where archive workers write and gateways read old data: usable from here?"""
    protocol, path = fsspec.core.split_protocol(location)
    if protocol in (None, "file", "local"):
        return _local_archive(path)
    if protocol in ("s3", "s3a") and importlib.util.find_spec("s3fs") is None:
        return Finding("fail", "archive", f"{location} needs s3fs: pip install 'durable-streams-redis[s3]'")
    try:
        fsspec.get_filesystem_class(protocol)
    except (ImportError, ValueError) as exc:
        return Finding("fail", "archive", f"{location}: {exc}")
    return Finding(
        "ok", "archive", f"{location}: {protocol} support installed (the bucket was not contacted)"
    )


def _local_archive(path: str) -> Finding:
    folder = os.path.abspath(path)
    if not os.path.isdir(folder):
        parent = folder
        while not os.path.isdir(parent):
            parent = os.path.dirname(parent)
        if os.access(parent, os.W_OK):
            return Finding("warn", "archive", f"{folder} does not exist yet (the archive worker creates it)")
        return Finding("fail", "archive", f"{folder} does not exist and {parent} is not writable")
    try:  # a real write: permissions alone miss read-only mounts
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".doctor-"):
            pass
    except OSError as exc:
        return Finding("fail", "archive", f"{folder} is not writable: {exc}")
    return Finding("ok", "archive", f"{folder} exists and is writable")
