"""The official client packages, at their DEFAULT options and at volume, against a real gateway.

A gateway is started the way users run it (``python -m gateway serve`` on a free port, default
settings, against the test Redis), then:

* the npm packages, pinned in ``tests/ecosystem/package.json`` (installed here with ``npm ci``
  from the committed lock, once; skipped only without node/npm), through the Node scripts beside
  it, each printing a JSON summary of its checks: ``producer.mjs`` (``@durable-streams/client``
  IdempotentProducer, 100,000 JSON messages, SSE and long-poll readers live), ``appends.mjs``
  (``DurableStream.append`` batching, concurrent 100 B and 1 MiB appends), ``yjs.mjs``
  (``@durable-streams/y-durable-streams``: its YjsServer on the gateway, providers editing through
  several compactions) and ``state.mjs`` (``@durable-streams/state``: MaterializedState and
  StreamDB, and the ``headers.offset`` a server adds to State Protocol events);
* the Python client from PyPI (``durable-streams``, pinned in the ``test`` extra): reads, live
  tails (SSE and long-poll) and concurrent appends.

Run one scenario by hand against any server: ``node tests/ecosystem/yjs.mjs http://HOST:PORT/v1/stream``.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from .conftest import ECOSYSTEM, gateway_process


@pytest.fixture(scope="module")
def streams_url(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``python -m gateway serve`` with its default settings on a free port: its stream base URL."""
    with gateway_process(redis_url, tmp_path_factory.mktemp("ecosystem") / "gateway.log") as url:
        yield url


def run_scenario(node: str, script: str, streams_url: str, timeout: float) -> dict[str, Any]:
    """Run ``tests/ecosystem/<script>`` against the gateway; its summary, asserting it passed."""
    try:
        proc = subprocess.run(
            [node, script, streams_url], cwd=ECOSYSTEM, capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"{script} did not finish in {timeout} s; stderr:\n{_tail(e.stderr)}") from None
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, f"{script} printed no summary (exit {proc.returncode}); stderr:\n{_tail(proc.stderr)}"
    summary: dict[str, Any] = json.loads(lines[-1])
    failures = "\n".join(f"  - {failure}" for failure in summary.get("failures", []))
    assert proc.returncode == 0 and summary.get("ok"), (
        f"{script} failed (exit {proc.returncode}):\n{failures}\n"
        f"checks: {json.dumps(summary.get('checks'), indent=1)}\nstderr:\n{_tail(proc.stderr)}"
    )
    return summary


def _tail(text: str | bytes | None, lines: int = 40) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return "\n".join((text or "").splitlines()[-lines:])


# --- the npm packages ------------------------------------------------------------------------


def test_js_idempotent_producer_100k_json_messages_with_live_readers(node: str, streams_url: str) -> None:
    """IdempotentProducer at its defaults (1 MiB batches, 5 ms linger, 5 in flight) writes
    100,000 JSON messages while an SSE and a long-poll `stream()` reader tail the stream; then it
    closes the stream. Stored once and in order; each reader sees each once, in order, then EOF."""
    summary = run_scenario(node, "producer.mjs", streams_url, timeout=330)
    seen = {mode: reader["seen"] for mode, reader in summary["readers"].items()}
    assert seen == {"sse": 100_000, "long-poll": 100_000}


def test_js_concurrent_appends_small_and_1mib_on_a_byte_stream(node: str, streams_url: str) -> None:
    """DurableStream.append with batching on (its default): concurrent 100-byte and 1 MiB
    appends (15 at a time, as upstream's benchmark), sent together; then close(). Every byte of
    every message stored once, in call order."""
    summary = run_scenario(node, "appends.mjs", streams_url, timeout=330)
    assert summary["bytes"] > 60 * 1024 * 1024
    assert summary["requests"]["largestPostBytes"] > 4 * 1024 * 1024  # batching did combine the 1 MiB appends


def test_yjs_server_and_providers_converge_through_compactions(node: str, streams_url: str) -> None:
    """The package's YjsServer on the gateway, compacting every 1500 bytes; providers editing
    concurrently through several compactions, a late joiner, a client resuming from before the
    first snapshot and a fresh one all converge, with every edit once."""
    summary = run_scenario(node, "yjs.mjs", streams_url, timeout=270)
    assert summary["compactions"] >= 3


def test_state_protocol_materializers_and_event_offsets(node: str, streams_url: str) -> None:
    """@durable-streams/state: MaterializedState (catch-up, live SSE, live long-poll) and
    StreamDB match what was written; every event read carries headers.offset, the same whichever
    way it was read, and reading from it continues right after that event."""
    summary = run_scenario(node, "state.mjs", streams_url, timeout=210)
    assert summary["events"] > 300


# --- the Python client (PyPI durable-streams) --------------------------------------------------


def test_python_client_reads_tails_and_appends(streams_url: str) -> None:
    """The Python client at its defaults: `DurableStream.create`, concurrent `append` calls from
    16 threads (batched by the client while one request is in flight), two live readers from the
    start (SSE and the default long-poll), a catch-up read, `head`, `close` of a byte stream."""
    from durable_streams import DurableStream, stream

    url = f"{streams_url}/eco-python-{uuid.uuid4().hex[:12]}"
    writers, per_writer = 16, 250
    total = writers * per_writer
    handle = DurableStream.create(url, content_type="application/json")
    seen: dict[str, list[Any]] = {"sse": [], "auto": []}
    responses: dict[str, Any] = {}

    def tail(mode: str) -> None:
        live: Any = "sse" if mode == "sse" else "auto"
        with stream(url, offset="-1", live=live) as res:
            responses[mode] = res
            for item in res.iter_json():
                seen[mode].append(item)
                if len(seen[mode]) >= total:
                    return

    readers = [threading.Thread(target=tail, args=(mode,), daemon=True) for mode in seen]
    for reader in readers:
        reader.start()

    def write(w: int) -> list[str]:
        return [handle.append({"w": w, "n": n}).next_offset for n in range(per_writer)]

    with ThreadPoolExecutor(writers) as pool:
        offsets = list(pool.map(write, range(writers)))
    for reader in readers:
        reader.join(60)
    for mode, res in responses.items():
        if len(seen[mode]) < total:
            with contextlib.suppress(Exception):
                res.close()

    with stream(url) as res:  # the default live mode ("auto"): read_json() follows the offsets to up-to-date
        stored = res.read_json()  # (live=False reads one response only, however much more there is)
    assert len(stored) == total
    assert {(m["w"], m["n"]) for m in stored} == {(w, n) for w in range(writers) for n in range(per_writer)}
    for w in range(writers):  # each writer waited for its append: its messages are in its order
        assert [m["n"] for m in stored if m["w"] == w] == list(range(per_writer))
        assert offsets[w] == sorted(offsets[w])
    for mode, items in seen.items():
        assert items == stored, f"{mode} reader: {len(items)} of {total} messages, or another order"
    head = handle.head()
    assert head.exists and head.offset == max(max(o) for o in offsets)
    handle.close()

    raw = DurableStream.create(f"{url}-bytes", content_type="application/octet-stream")
    chunks = [bytes([n % 256]) * 1000 for n in range(200)]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(raw.append, chunks))
    with raw.stream() as res:
        data = res.read_bytes()
    assert len(data) == 200_000
    assert sorted(data[i * 1000 : (i + 1) * 1000] for i in range(200)) == sorted(chunks)  # each once, whole
    raw.close()


def test_python_client_concurrent_1mib_appends(streams_url: str) -> None:
    """Concurrent 1 MiB appends through the Python client (8 threads): its batching sends the
    ones that queue up behind a request in flight together, as one body of several MiB."""
    from durable_streams import DurableStream

    url = f"{streams_url}/eco-python-large-{uuid.uuid4().hex[:12]}"
    handle = DurableStream.create(url, content_type="application/octet-stream")
    chunks = [bytes([n]) * (1024 * 1024) for n in range(24)]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(handle.append, chunks))
    assert all(r.next_offset for r in results)
    with handle.stream() as res:
        data = res.read_bytes()
    assert len(data) == 24 * 1024 * 1024
    pieces = [data[i * 1024 * 1024 : (i + 1) * 1024 * 1024] for i in range(24)]
    assert sorted(pieces) == sorted(chunks)  # each once, whole (threads race for the order)
    handle.close()
