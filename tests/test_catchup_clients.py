"""Issue 41: the official clients read a large stream WHOLE in one catch-up read, hot and archived.

The JS client's documented "read catch-up only" call,
``await (await stream({url, offset: "-1", live: false})).json()``, makes ONE request and takes its
answer as the whole stream; so does the Python client's ``live=False`` ``read_json()`` /
``read_bytes()``. A catch-up answer therefore has to carry everything from its offset to the tail.
Here both clients read a 100,000-message JSON stream and a 200 MiB byte stream from a gateway
started as users start it (``python -m gateway serve``), with ``live: false`` and in their default
mode (which follows the offsets to up to date), and every message and byte must be there, in
order: first with the data in Redis ("hot"), then with all of it moved to Parquet by an archive
worker ("archived", read through the gateway's archive fall-through).

The gateway runs with its defaults (--max-chunk-bytes: 256 MiB, above the byte stream) but
``--archive-url`` (the archive this file writes).

Messages are ``{"i": n, "text": ...}``; bytes a pattern generated from a seed, compared by sha256
(and, on a mismatch, by the first byte that differs). The streams are written fast (POSTs of
10,000 messages and of 8 MiB) and shared by all the reads of a temperature; Node runs once per
temperature (``tests/ecosystem/catchup.mjs``: six reads, a JSON summary).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import random
import subprocess
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from gateway.archive.files import Archive
from gateway.redis_io import keys
from workers.archiver import Archiver, Policy

from .conftest import ECOSYSTEM, gateway_process  # conftest has the `node` fixture (npm ci included)
from .test_ecosystem import _tail

MESSAGES = 100_000
MESSAGES_PER_POST = 10_000
BYTES_CHUNK = 8 * 1024 * 1024
BYTES_CHUNKS = 25  # 200 MiB
BYTES_TOTAL = BYTES_CHUNK * BYTES_CHUNKS
NODE_TIMEOUT = 300


def message(n: int) -> dict[str, Any]:
    """Message ``n``: ~55 bytes of JSON, of varying length (the stream is ~5.7 MB, past 4 MiB)."""
    return {"i": n, "text": f"message {n:06d} " + "x" * (n % 64)}


EXPECTED_MESSAGES = [message(n) for n in range(MESSAGES)]
EXPECTED_MESSAGES_SHA256 = hashlib.sha256(
    json.dumps(EXPECTED_MESSAGES, separators=(",", ":")).encode()
).hexdigest()


def byte_chunk(k: int) -> bytes:
    """The byte stream's k-th 8 MiB: pseudo-random from seed k (a shifted or repeated piece shows)."""
    return random.Random(f"catchup-{k}").randbytes(BYTES_CHUNK)


def _expected_bytes_sha256() -> str:
    digest = hashlib.sha256()
    for k in range(BYTES_CHUNKS):
        digest.update(byte_chunk(k))
    return digest.hexdigest()


@dataclass(frozen=True)
class Streams:
    temperature: str  # "hot" (in Redis) or "archived" (all in Parquet)
    json_url: str
    bytes_url: str
    bytes_sha256: str


# --- fixtures: a gateway, the streams ---------------------------------------------------------


@pytest.fixture(scope="module")
def archive_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("catchup-archive"))


@pytest.fixture(scope="module")
def catchup_gateway(
    redis_url: str, archive_root: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """``python -m gateway serve``, default settings but the archive:
    its stream base URL."""
    log = tmp_path_factory.mktemp("catchup") / "gateway.log"
    with gateway_process(redis_url, log, "--archive-url", archive_root) as url:
        yield url


def _request(method: str, url: str, content_type: str, body: bytes | None = None) -> int:
    req = urllib.request.Request(url, data=body, method=method, headers={"Content-Type": content_type})
    with urllib.request.urlopen(req, timeout=120) as r:
        r.read()
        return r.status


def _write_streams(base: str, name: str) -> tuple[str, str]:
    """The JSON stream (POSTs of 10,000 messages) and the byte stream (POSTs of 8 MiB)."""
    json_url, bytes_url = f"{base}/{name}-json", f"{base}/{name}-bytes"
    assert _request("PUT", json_url, "application/json") == 201
    for start in range(0, MESSAGES, MESSAGES_PER_POST):
        batch = json.dumps(EXPECTED_MESSAGES[start : start + MESSAGES_PER_POST]).encode()
        assert _request("POST", json_url, "application/json", batch) in (200, 204)
    assert _request("PUT", bytes_url, "application/octet-stream") == 201
    for k in range(BYTES_CHUNKS):
        assert _request("POST", bytes_url, "application/octet-stream", byte_chunk(k)) in (200, 204)
    return json_url, bytes_url


def _sid(url: str) -> str:
    return keys.stream_id(url.split("/v1/stream/", 1)[1])


async def _log_lengths(redis_url: str, urls: list[str]) -> list[int]:
    client = aioredis.Redis.from_url(redis_url)
    try:
        return [await client.xlen(keys.stream_keys(_sid(url))[1]) for url in urls]
    finally:
        await client.aclose()


async def _archive_all(redis_url: str, archive_root: str, urls: list[str]) -> None:
    """Every byte of the streams moved to Parquet by an archive worker (hot window 0)."""
    client = aioredis.Redis.from_url(redis_url)
    try:
        archiver = Archiver(client, Archive(archive_root), Policy(hot_bytes=0, hot_ms=0, max_delay_ms=0))
        for url in urls:
            await archiver.archive_stream(_sid(url))
    finally:
        await client.aclose()


@pytest.fixture(scope="module")
def bytes_sha256() -> str:
    return _expected_bytes_sha256()


@pytest.fixture(scope="module", params=["hot", "archived"])
def streams(request: pytest.FixtureRequest, catchup_gateway: str, redis_url: str, archive_root: str,
            bytes_sha256: str) -> Iterator[Streams]:  # fmt: skip
    """The two streams, written once per temperature; "archived": then all moved to Parquet.
    Deleted afterwards (the session's Redis is not left holding 200 MiB)."""
    temperature: str = request.param
    json_url, bytes_url = _write_streams(catchup_gateway, f"catchup-{temperature}-{uuid.uuid4().hex[:12]}")
    try:
        if temperature == "archived":
            asyncio.run(_archive_all(redis_url, archive_root, [json_url, bytes_url]))
            assert asyncio.run(_log_lengths(redis_url, [json_url, bytes_url])) == [0, 0], "not all archived"
            assert any(Path(archive_root).rglob("*.parquet"))
        yield Streams(temperature, json_url, bytes_url, bytes_sha256)
    finally:
        for url in (json_url, bytes_url):
            with contextlib.suppress(OSError):
                _request("DELETE", url, "application/octet-stream")


def _check_temperature(streams: Streams, redis_url: str) -> None:
    lengths = asyncio.run(_log_lengths(redis_url, [streams.json_url, streams.bytes_url]))
    if streams.temperature == "hot":
        assert all(lengths), f"the hot streams are no longer in Redis: {lengths}"
    else:
        assert lengths == [0, 0], f"the archived streams have entries in Redis again: {lengths}"


# --- the JS client -----------------------------------------------------------------------------

JS_READS = [
    "json live:false .json()",
    "json default .json()",
    "json default subscribeJson until upToDate",
    "bytes live:false .body()",
    "bytes default .body()",
    "bytes default subscribeBytes until upToDate",
]


@pytest.fixture(scope="module")
def js_reads(node: str, streams: Streams) -> dict[str, Any]:  # noqa: F811
    """``catchup.mjs`` run once on this temperature's streams: what each of its reads returned."""
    expected = {
        "messages": MESSAGES,
        "messagesSha256": EXPECTED_MESSAGES_SHA256,
        "bytes": BYTES_TOTAL,
        "bytesSha256": streams.bytes_sha256,
    }
    try:
        proc = subprocess.run(
            [node, "catchup.mjs", streams.json_url, streams.bytes_url, json.dumps(expected)],
            cwd=ECOSYSTEM, capture_output=True, text=True, timeout=NODE_TIMEOUT,
        )  # fmt: skip
    except subprocess.TimeoutExpired as e:
        raise AssertionError(
            f"catchup.mjs did not finish in {NODE_TIMEOUT} s; stderr:\n{_tail(e.stderr)}"
        ) from None
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, f"catchup.mjs printed no summary (exit {proc.returncode}); stderr:\n{_tail(proc.stderr)}"
    summary: dict[str, Any] = json.loads(lines[-1])
    assert set(summary.get("reads", {})) == set(JS_READS), (
        f"catchup.mjs did not finish its reads: {summary.get('failures')}\nstderr:\n{_tail(proc.stderr)}"
    )
    return summary["reads"]


@pytest.mark.parametrize("read", JS_READS)
def test_js_client_reads_the_whole_stream(
    js_reads: dict[str, Any], streams: Streams, redis_url: str, read: str
) -> None:
    """@durable-streams/client 0.2.7: `live: false` `.json()`/`.body()` (one request, the README's
    "read catch-up only"), the default mode's `.json()`/`.body()`, and a default-mode subscriber
    cancelled once up to date, each return every message (in order) / every byte of the stream."""
    _check_temperature(streams, redis_url)
    got = js_reads[read]
    assert "error" not in got, got["error"]
    if read.startswith("json"):
        assert (got["messages"], got["firstOutOfOrder"]) == (MESSAGES, -1), (
            f"{streams.temperature}: {got['messages']} of {MESSAGES} messages "
            f"(last i={got['lastI']}, first out of order at {got['firstOutOfOrder']}) "
            f"in {got['catchUpRequests']} catch-up request(s)"
        )
        assert got["messagesSha256"] == EXPECTED_MESSAGES_SHA256, (
            "every message there, in order, but not as written"
        )
    else:
        assert got["bytes"] == BYTES_TOTAL, (
            f"{streams.temperature}: {got['bytes']} of {BYTES_TOTAL} bytes "
            f"in {got['catchUpRequests']} catch-up request(s)"
        )
        assert got["bytesSha256"] == streams.bytes_sha256, "as many bytes as written, but other bytes"
    if "live:false" in read:
        assert got["catchUpRequests"] == 1 and got["liveRequests"] == 0  # the client's one request
    if "subscribe" in read:
        assert got["sawUpToDate"]


# --- the Python client (PyPI durable-streams 0.1.0) ---------------------------------------------


def _first_difference(data: bytes) -> str:
    """Where ``data`` first differs from the byte stream as written."""
    for k in range(BYTES_CHUNKS):
        want, got = byte_chunk(k), data[k * BYTES_CHUNK : (k + 1) * BYTES_CHUNK]
        if got != want:
            at = next(
                (i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
                min(len(got), len(want)),
            )
            return f"first difference at byte {k * BYTES_CHUNK + at:,}"
    return f"{len(data) - BYTES_TOTAL:,} bytes more than written"


def _check_bytes(streams: Streams, data: bytes, how: str) -> None:
    if len(data) == BYTES_TOTAL and hashlib.sha256(data).hexdigest() == streams.bytes_sha256:
        return
    raise AssertionError(
        f"{how}, {streams.temperature}: {len(data):,} of {BYTES_TOTAL:,} bytes; {_first_difference(data)}"
    )


def _check_messages(streams: Streams, items: list[Any], how: str) -> None:
    if items == EXPECTED_MESSAGES:
        return
    at = next((n for n, (a, b) in enumerate(zip(items, EXPECTED_MESSAGES, strict=False)) if a != b), None)
    raise AssertionError(
        f"{how}, {streams.temperature}: {len(items):,} of {MESSAGES:,} messages"
        + (f"; message {at} differs: {items[at]!r}" if at is not None else "")
    )


def _py_json_live_false_read_json(url: str) -> list[Any]:
    from durable_streams import stream

    with stream(url, offset="-1", live=False) as res:
        return res.read_json()


def _py_json_default_read_json(url: str) -> list[Any]:
    from durable_streams import stream

    with stream(url, offset="-1") as res:
        return res.read_json()


def _py_json_live_false_iter_json(url: str) -> list[Any]:
    from durable_streams import stream

    with stream(url, offset="-1", live=False) as res:
        return list(res.iter_json())  # live=False iteration ends by itself at up to date


def _py_json_default_batches_until_up_to_date(url: str) -> list[Any]:
    from durable_streams import stream

    items: list[Any] = []
    with stream(url, offset="-1") as res:
        for batch in res.iter_json_batches():  # one batch per response; it would go live next
            items.extend(batch)
            if res.up_to_date:
                break
    return items


def _py_bytes_live_false_read_bytes(url: str) -> bytes:
    from durable_streams import stream

    with stream(url, offset="-1", live=False) as res:
        return res.read_bytes()


def _py_bytes_default_read_bytes(url: str) -> bytes:
    from durable_streams import stream

    with stream(url, offset="-1") as res:
        return res.read_bytes()


def _py_bytes_live_false_iter(url: str) -> bytes:
    from durable_streams import stream

    with stream(url, offset="-1", live=False) as res:
        return b"".join(res)


PY_READS: dict[str, Callable[[str], Any]] = {
    "json live=False read_json()": _py_json_live_false_read_json,
    "json default read_json()": _py_json_default_read_json,
    "json live=False iter_json()": _py_json_live_false_iter_json,
    "json default iter_json_batches() until up_to_date": _py_json_default_batches_until_up_to_date,
    "bytes live=False read_bytes()": _py_bytes_live_false_read_bytes,
    "bytes default read_bytes()": _py_bytes_default_read_bytes,
    "bytes live=False iteration": _py_bytes_live_false_iter,
}


@pytest.mark.parametrize("read", PY_READS)
def test_python_client_reads_the_whole_stream(streams: Streams, redis_url: str, read: str) -> None:
    """durable-streams 0.1.0: `live=False` `read_json()`/`read_bytes()` (one request: the client
    stops after the first answer), its iteration (which follows the offsets to up to date), and
    the default mode (`read_json()`/`read_bytes()` follow to up to date; batches until
    `up_to_date`), each return every message (in order) / every byte."""
    _check_temperature(streams, redis_url)
    if read.startswith("json"):
        _check_messages(streams, PY_READS[read](streams.json_url), read)
    else:
        _check_bytes(streams, PY_READS[read](streams.bytes_url), read)
