"""The PySpark data source's reads (workers/spark_*.py) against a real gateway: batch
reads, a streaming query that is stopped and restarted from its checkpoint while appends
go on (every message exactly once, streams archived, deleted and created mid-query),
streams deleted and created again at their paths between runs. The planning rules and
the client's offset accounting are plain functions, tested without Java. The sink:
tests/test_spark_sink.py; the session and shared steps: tests/spark_local.py.
"""

from __future__ import annotations

import asyncio
import json
import random
import uuid
from collections import defaultdict
from typing import Any

import aiohttp
import pytest

from gateway.archive.files import Archive
from gateway.protocol import caching
from gateway.redis_io import keys
from workers.archiver import Archiver, Policy

from .conftest import start_gateway
from .spark_local import BYTES, JSON, activate, append, create, load, local_spark

pytest.importorskip("pyspark", reason="pyspark is in the [test] extra")
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxBytes  # noqa: E402

from workers import streams_client as client  # noqa: E402
from workers.spark_options import ReadOptions  # noqa: E402
from workers.spark_plan import Span, joined, pack, plan_ends, spans  # noqa: E402
from workers.spark_rows import SCHEMA  # noqa: E402
from workers.spark_stream_reader import DurableStreamsStreamReader  # noqa: E402

HOT0 = Policy(hot_bytes=0, hot_ms=0, min_bytes=1 << 20, max_delay_ms=0, file_bytes=1 << 20)
ADMIN, READER = "spark-admin-token-0123456789", "spark-reader-token-012345678"


@pytest.fixture(scope="module")
def spark():
    with local_spark("local[2]") as session:
        yield session


@pytest.fixture(scope="module")
async def base(redis_url: str, archive_dir: str, tmp_path_factory: pytest.TempPathFactory):
    """A gateway on a real port (Spark's workers are other processes) with small chunks
    (so reads cross a batch's end inside a response) and access control on."""
    tokens = tmp_path_factory.mktemp("spark-auth") / "tokens.json"
    tokens.write_text(json.dumps({"tokens": [
        {"name": "admin", "token": ADMIN, "grants": "admin:"},
        {"name": "reader", "token": READER, "grants": "read:sec/"},
    ]}))  # fmt: skip
    server = await start_gateway(
        redis_url, max_chunk_bytes=200, archive_url=archive_dir, auth_tokens_file=str(tokens)
    )
    yield str(server.make_url("/v1/stream"))
    await server.close()


@pytest.fixture(scope="module")
async def admin_http():
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {ADMIN}"}) as session:
        yield session


def value(text: str) -> Any:
    """A message as appended: reads add headers.offset to State Protocol events."""
    message = json.loads(text)
    if isinstance(message, dict) and isinstance(message.get("headers"), dict):
        message["headers"].pop("offset", None)
    return message


def check(rows: list[Any], expected: dict[str, Any], partial: set[str] = frozenset()) -> None:
    """Per stream: rows from the start, contiguous, none twice, exactly the appends (a
    JSON stream: its messages; bytes: their concatenation). ``partial``: a prefix."""
    by_stream = defaultdict(list)
    for row in rows:
        by_stream[row["stream"]].append(row)
    assert set(by_stream) <= set(expected), set(by_stream) - set(expected)
    for path, appended in expected.items():
        got = sorted(by_stream.get(path, []), key=lambda r: r["offset"])
        starts = [r["offset"] for r in got]
        assert len(set(starts)) == len(starts), f"{path}: a row read twice"
        assert not got or got[0]["offset"] == client.ZERO, path
        assert all(a["next_offset"] == b["offset"] for a, b in zip(got, got[1:], strict=False)), path
        if isinstance(appended, bytes):
            assert all(r["text"] is None for r in got)
            data = b"".join(bytes(r["data"]) for r in got)
            assert data == (appended[: len(data)] if path in partial else appended), path
        else:
            messages = [value(r["text"]) for r in got]
            assert [bytes(r["data"]).decode() for r in got] == [r["text"] for r in got]
            assert messages == (appended[: len(messages)] if path in partial else appended), path


# --- Pure: offsets, messages, planning ---


def test_json_messages_take_their_stored_positions() -> None:
    token = client.token
    plain = [b'{"a":1}', b'"ccc"', b"[1,2]"]
    body = b"[" + b",".join(plain) + b"]"
    assert client.json_messages(body, 10, 10 + 7 + 5 + 5) == [
        (10, 17, plain[0]), (17, 22, plain[1]), (22, 27, plain[2]),
    ]  # fmt: skip
    # A State Protocol event comes back with headers.offset (the offset after it): its
    # stored form is shorter than what the read returns.
    event = b'{"headers":{"operation":"insert","offset":"' + token(70).encode() + b'"},"v":1}'
    body = b'[{"a":1},' + event + b',"x"]'
    assert client.json_messages(body, 0, 73) == [(0, 7, b'{"a":1}'), (7, 70, event), (70, 73, b'"x"')]
    # An object with headers but no operation/control is an ordinary message.
    other = b'{"headers":{"offset":"' + token(1).encode() + b'"}}'
    assert client.json_messages(b"[" + other + b"]", 5, 5 + len(other)) == [(5, 5 + len(other), other)]
    # Integers past 64 bits (orjson would make floats of them): the server's texts,
    # through its own parser.
    exact = [b'{"big":123456789012345678901234567890}', b'"\xc3\xa9"', b"[1.5,null]"]
    assert client.split_array(b"[" + b",".join(exact) + b"]") == exact
    assert client.split_array(b'[{"a":1}, 2]') == [b'{"a":1}', b"2"]  # spacing: re-encoded as the server does
    assert client.split_array(b"[]") == [] and client.split_array(b"[[]]") == [b"[]"]
    with pytest.raises(client.OffsetMismatch):  # another server's positions
        client.json_messages(b'[{"a":1}]', 0, 9)
    assert client.json_messages(b"[]", 4, 4) == []
    assert client.position(token(12345)) == 12345 and client.start_position("-1") == 0
    assert client.position("0000000000000000_0000000000000042") == 42  # format 0 still reads
    with pytest.raises(ValueError):
        client.position("abc")


def test_an_etag_names_its_incarnation() -> None:
    """HEAD's and reads' ETags carry the stream's creation time: what tells a stream
    created again at a path from the one read before."""
    tag = caching.stream_etag("a%7Bb", "1795326762008", 84, False)
    assert caching.incarnation(tag) == "1795326762008"
    assert caching.incarnation(caching.etag("x", "5", 0, 10, True)) == "5"
    for other in (None, "", '"', "W/" + tag, tag[1:-1], '"abc"', '"1-zz:0:1"', '"1-0123abcd:0"'):
        assert caching.incarnation(other) is None, other


def info(path: str, tail: int, content_type: str = BYTES) -> client.StreamInfo:
    return client.StreamInfo(path, client.token(tail), content_type)


def test_plan_ends_without_and_with_a_budget() -> None:
    t = client.token
    streams = {"a": info("a", 100), "b": info("b", 50, JSON), "c": info("c", 0), "d": info("d", 30)}
    # No budget: every tail; a new empty stream waits for its first byte; a gone one leaves.
    end, waiting = plan_ends({"d": t(10), "gone": t(5)}, streams, None)
    assert end == {"a": t(100), "b": t(50), "d": t(30)} and waiting == set()
    # Nothing new: the start as it was (Spark then runs no batch).
    assert plan_ends({"a": t(100), "d": t(30)}, {"a": streams["a"], "d": streams["d"]}, 64)[0] == {
        "a": t(100),
        "d": t(30),
    }
    # A budget of 60 over a: 100 (bytes), b: 50 (JSON), d: 20 (bytes from 10). Smallest
    # backlog first, each at most an equal share: d takes 20, b (50 > 40/2) waits, a takes 40.
    end, waiting = plan_ends({"d": t(10)}, streams, 60)
    assert end == {"d": t(30), "a": t(40)} and waiting == {"b"}
    # Next time b goes first, whole (a JSON stream ends on a message boundary: its tail).
    end, waiting = plan_ends({"d": t(30), "a": t(40)}, streams, 60, waiting)
    assert end == {"b": t(50), "d": t(30), "a": t(50)} and waiting == set()
    # Nothing fits: the first in line goes anyway (a soft budget, never a stall).
    end, waiting = plan_ends({}, {"b": streams["b"]}, 10)
    assert end == {"b": t(50)} and waiting == set()
    end, _ = plan_ends({}, {"a": streams["a"], "b": streams["b"]}, 1)
    assert end == {"a": t(1)}
    # A tail below the offset read to: created again, read from its start.
    end, _ = plan_ends({"a": t(500)}, {"a": streams["a"]}, 30)
    assert end == {"a": t(30)}


def test_spans_and_partitions_are_functions_of_the_offsets() -> None:
    t = client.token
    start = {"a": t(10), "b": t(5), "c": t(7), "e": "-1"}
    end = {"a": t(110), "b": t(5), "c": t(3), "d": t(40), "e": t(9)}
    items = spans(start, end)
    assert items == [
        Span("a", t(10), t(110), 100),
        Span("c", "-1", t(3), 3),  # below its start: created again
        Span("d", "-1", t(40), 40),  # new: from the beginning
        Span("e", "-1", t(9), 9),
    ]
    assert spans(start, end, streaming=False)[1] == Span("d", "-1", t(40), 40)  # c: nothing
    assert pack(items, 10_000, overhead=0) == [items]
    parts = pack(items, 60, overhead=5)
    assert parts == [[items[0]], [items[2], items[3]], [items[1]]]  # 45 + 14 fill one of 60
    assert pack(list(reversed(items)), 60, overhead=5) == parts  # deterministic


def test_a_stream_created_again_is_read_from_its_start() -> None:
    """Offsets name the incarnation they were read in (``<offset>@<created>``): a stream
    created again at its path is read from its start whatever its tail, and the batch's
    spans say so from its offsets alone (a re-run reads the same)."""
    t = client.token
    start = {"a": joined(t(500), "1")}

    def now(tail: int, created: str | None = "2") -> dict[str, client.StreamInfo]:
        return {"a": client.StreamInfo("a", t(tail), BYTES, created=created)}

    for tail in (700, 500, 20):  # grown past the old offset, the same size, smaller
        end, _ = plan_ends(start, now(tail), None)
        assert end == {"a": joined(t(tail), "2")}
        assert spans(start, end) == [Span("a", "-1", t(tail), tail, "2")]
    end, _ = plan_ends(start, now(700), 300)  # with a budget: its first 300 bytes
    assert spans(start, end) == [Span("a", "-1", t(300), 300, "2")]
    # Empty yet: the offsets move to it (no rows), so that it is said once, not every poll.
    end, _ = plan_ends(start, now(0), None)
    assert end == {"a": joined(t(0), "2")} and spans(start, end) == []
    assert plan_ends(end, now(0), None)[0] == end
    # The same incarnation: from the offset on.
    end, _ = plan_ends({"a": joined(t(500), "2")}, now(700), None)
    assert spans({"a": joined(t(500), "2")}, end) == [Span("a", t(500), t(700), 200, "2")]
    # No incarnation named (a checkpoint from before; another server): the tail alone.
    assert plan_ends({"a": t(500)}, now(700, None), None)[0] == {"a": t(700)}
    assert spans({"a": t(500)}, {"a": joined(t(700), "2")}) == [Span("a", t(500), t(700), 200, "2")]
    assert plan_ends({"a": t(500)}, now(0, None), None)[0] == {"a": t(0)}  # below: said once
    # A batch read (not streaming) takes the offsets as given.
    assert spans(start, {"a": joined(t(700), "2")}, streaming=False) == [Span("a", t(500), t(700), 200, "2")]
    url = "http://h/v1/stream"
    assert ReadOptions.parse({"url": url, "startingOffsets": json.dumps(start)}).starting == start
    with pytest.raises(ValueError, match="creation time"):
        ReadOptions.parse({"url": url, "startingOffsets": '{"a": "-1@x"}'})


def test_options_are_checked() -> None:
    parse = ReadOptions.parse
    with pytest.raises(ValueError, match="url"):
        parse({})
    with pytest.raises(ValueError, match="not both"):
        parse({"url": "http://h/v1/stream", "prefix": "a/", "paths": "a/b"})
    with pytest.raises(ValueError):
        parse({"url": "http://h/v1/stream", "startingOffsets": '{"a": "12"}'})
    options = parse({"url": "http://h/v1/stream", "paths": "b, a/x,", "startingOffsets": "LATEST"})
    assert options.paths == ("a/x", "b") and options.starting == "latest"
    assert parse({"url": "http://h/v1/stream", "paths": '["x,y"]'}).paths == ("x,y",)
    with pytest.raises(ValueError, match="base URL"):
        client.Client("h:4437/v1/stream")


# --- The client against the gateway ---


async def test_read_range_cuts_exactly_at_the_planned_end(admin_http, base, redis, archive_dir) -> None:
    name = f"cut-{uuid.uuid4().hex[:8]}"
    pieces = [bytes([n % 3]) * (n % 5 + 2) for n in range(90)]  # repeating data: overlaps are ambiguous
    await create(admin_http, f"{base}/{name}/b", BYTES)
    await create(admin_http, f"{base}/{name}/j", JSON)
    for n, piece in enumerate(pieces):
        await append(admin_http, f"{base}/{name}/b", BYTES, piece)
        await append(admin_http, f"{base}/{name}/j", JSON, json.dumps({"n": n, "p": "x" * (n % 4)}).encode())
    data = b"".join(pieces)
    reader = client.Client(base, ADMIN)

    def read(path: str, start: str, end: str) -> list[client.Piece]:
        return list(client.read_range(reader, path, start, end))

    tail = len(data)
    for first, last in [(0, tail), (0, 1), (3, 150), (150, 151), (7, tail - 1), (170, 172), (190, 350)]:
        got = await asyncio.to_thread(read, f"{name}/b", client.token(first), client.token(last))
        assert b"".join(p.data for p in got) == data[first:last], (first, last)
        assert got[0].offset == client.token(first) and got[-1].next_offset == client.token(last)
    got = await asyncio.to_thread(read, f"{name}/b", "-1", client.token(tail))
    assert b"".join(p.data for p in got) == data and len(got) > 1  # chunks of 200

    messages = await asyncio.to_thread(read, f"{name}/j", "-1", client.token(10**6))
    assert [json.loads(p.data)["n"] for p in messages] == list(range(90))
    middle = messages[25].offset
    upper = await asyncio.to_thread(read, f"{name}/j", middle, messages[40].offset)
    assert upper == messages[25:40]

    # Archived (hot window 0), then more appends: reads are the same, across the boundary.
    archiver = Archiver(redis, Archive(archive_dir), HOT0)
    await archiver.archive_stream(keys.stream_id(f"{name}/j"))
    await archiver.archive_stream(keys.stream_id(f"{name}/b"))
    assert archiver.files_written == 2
    await append(admin_http, f"{base}/{name}/b", BYTES, b"tail")
    assert await asyncio.to_thread(read, f"{name}/j", "-1", client.token(10**6)) == messages
    got = await asyncio.to_thread(read, f"{name}/b", client.token(3), client.token(tail + 2))
    assert b"".join(p.data for p in got) == (data + b"tail")[3 : tail + 2]

    # Gone: no rows, no error.
    assert await asyncio.to_thread(read, f"{name}/none", "-1", client.token(10)) == []
    reader.close()


async def test_listing_needs_a_credential(base) -> None:
    def listed(token: str | None) -> list[str]:
        return [s.path for s in client.Client(base, token).list_streams("sec/")]

    with pytest.raises(client.StreamsError) as failed:
        await asyncio.to_thread(listed, None)
    assert failed.value.status == 401
    assert isinstance(await asyncio.to_thread(listed, READER), list)


async def test_stream_reader_plans(admin_http, base) -> None:
    """The stream reader's driver side without Spark: starting offsets, new streams
    joining, AvailableNow's target, a gone stream leaving the offsets."""
    name = f"plan-{uuid.uuid4().hex[:8]}"
    for path in ("a", "b"):
        await create(admin_http, f"{base}/{name}/{path}", BYTES)
        await append(admin_http, f"{base}/{name}/{path}", BYTES, b"0123456789")
    await create(admin_http, f"{base}/{name}/empty", JSON)
    make = DurableStreamsStreamReader

    def reader(**options: str) -> Any:
        return make(ReadOptions.parse({"url": base, "token": ADMIN, "prefix": f"{name}/", **options}))

    everything = ReadAllAvailable()
    head = client.Client(base, ADMIN)
    created = {}
    for path in ("a", "b", "c"):
        if path == "c":
            await create(admin_http, f"{base}/{name}/c", BYTES)
        stream = await asyncio.to_thread(head.info, f"{name}/{path}")
        assert stream is not None and stream.created is not None  # from HEAD's ETag
        created[path] = stream.created
    head.close()

    def at(path: str, pos: int) -> str:
        """A planned offset: the listing's created_at_ms is the incarnation HEAD's ETag names."""
        return joined(client.token(pos), created[path])

    latest = await asyncio.to_thread(lambda: reader(startingOffsets="latest").initialOffset())
    assert latest == {f"{name}/a": at("a", 10), f"{name}/b": at("b", 10)}  # not the empty ones
    assert await asyncio.to_thread(lambda: reader().initialOffset()) == {}
    now = reader(minPollIntervalMs="0")
    await asyncio.to_thread(now.prepareForTriggerAvailableNow)
    await append(admin_http, f"{base}/{name}/a", BYTES, b"more")
    await append(admin_http, f"{base}/{name}/c", BYTES, b"new")
    assert await asyncio.to_thread(now.latestOffset, {}, everything) == latest  # what was there
    live = reader(minPollIntervalMs="0", maxBytesPerTrigger="12")
    assert live.getDefaultReadLimit() == ReadMaxBytes(12)
    end = await asyncio.to_thread(live.latestOffset, {}, ReadMaxBytes(12))
    # Smallest backlog first, each at most an equal share of what is left: c 3, b 4, a 5.
    assert end == {f"{name}/a": at("a", 5), f"{name}/b": at("b", 4), f"{name}/c": at("c", 3)}
    assert await asyncio.to_thread(live.latestOffset, end, everything) == {
        f"{name}/a": at("a", 14),
        f"{name}/b": at("b", 10),
        f"{name}/c": at("c", 3),
    }
    async with admin_http.delete(f"{base}/{name}/b") as r:
        assert r.status == 204
    assert await asyncio.to_thread(live.latestOffset, end, everything) == {
        f"{name}/a": at("a", 14),
        f"{name}/c": at("c", 3),
    }
    parts = live.partitions(end, {f"{name}/a": at("a", 14), f"{name}/c": at("c", 3)})
    assert [p.spans for p in parts] == [[(f"{name}/a", client.token(5), client.token(14), created["a"])]]
    stranger = make(ReadOptions.parse({"url": base, "prefix": f"{name}/"}))
    with pytest.raises(client.StreamsError):  # no credential: 401 stops the query
        await asyncio.to_thread(stranger.latestOffset, {}, everything)


# --- Spark ---


async def test_batch_reads(spark, admin_http, base) -> None:
    name = f"sec/batch-{uuid.uuid4().hex[:8]}"
    expected: dict[str, Any] = {f"{name}/j": [], f"{name}/b": b""}
    await create(admin_http, f"{base}/{name}/j", JSON)
    await create(admin_http, f"{base}/{name}/b", BYTES)
    await create(admin_http, f"{base}/{name}/empty", JSON)
    for n in range(40):
        messages = [{"n": n, "big": 2**70 + n}] if n % 3 else [{"n": n}, [n, "pair"]]
        await append(
            admin_http, f"{base}/{name}/j", JSON, json.dumps(messages if n % 3 == 0 else messages[0]).encode()
        )
        expected[f"{name}/j"] += messages
        piece = bytes([n % 4]) * (n + 1)
        await append(admin_http, f"{base}/{name}/b", BYTES, piece)
        expected[f"{name}/b"] += piece

    def read(**options: Any) -> list[Any]:
        return load(spark, base, READER, **options).collect()

    frame = await asyncio.to_thread(load, spark, base, READER, prefix=f"{name}/", partitionBytes=300)
    assert frame.schema == SCHEMA
    assert await asyncio.to_thread(lambda: frame.rdd.getNumPartitions()) == 2  # a stream each (300 B max)
    rows = await asyncio.to_thread(frame.collect)
    check(rows, expected)
    assert all(
        r["append_time"] is None and r["content_type"] == JSON for r in rows if r["stream"].endswith("/j")
    )
    # Explicit paths (one missing: nothing, no error); offsets from a row of the first read.
    rows = await asyncio.to_thread(read, paths=f"{name}/j, {name}/missing")
    check(rows, {f"{name}/j": expected[f"{name}/j"]})
    ordered = sorted(rows, key=lambda r: r["offset"])
    between = {
        "startingOffsets": {f"{name}/j": ordered[10]["offset"]},
        "endingOffsets": {f"{name}/j": ordered[20]["offset"]},
    }
    rows = await asyncio.to_thread(read, paths=f"{name}/j", **{k: json.dumps(v) for k, v in between.items()})
    assert sorted((r["offset"], r["text"]) for r in rows) == [
        (r["offset"], r["text"]) for r in ordered[10:20]
    ]
    # The reader's token reads sec/ only: elsewhere its listing is empty.
    assert await asyncio.to_thread(read, prefix="sq-") == []

    # df.write: a stream made with contentType, one message a row.
    def write() -> None:
        activate(spark)
        frame = spark.createDataFrame(
            [(f"{name}/w", json.dumps({"w": n})) for n in range(5)], "stream string, data string"
        )
        frame.write.format("durable-streams").mode("append").option("url", base).option(
            "token", ADMIN
        ).option("contentType", JSON).save()

    await asyncio.to_thread(write)
    rows = await asyncio.to_thread(read, paths=f"{name}/w")
    assert sorted(json.loads(r["text"])["w"] for r in rows) == list(range(5))


async def test_streaming_reads_every_message_once_across_restarts(
    spark, admin_http, base, redis, archive_dir, tmp_path
) -> None:
    """50 streams while appends go on: a query is stopped and restarted from its checkpoint;
    meanwhile streams are archived (hot window 0), one is deleted and one created. Its
    Parquet output (an exactly-once sink) holds every message once."""
    prefix = f"sq-{uuid.uuid4().hex[:8]}/"
    paths = [f"{prefix}s{i:02d}" for i in range(50)]
    kinds = {path: BYTES if i % 5 == 4 else JSON for i, path in enumerate(paths)}
    expected: dict[str, Any] = {path: b"" if kind == BYTES else [] for path, kind in kinds.items()}
    live, lock, rng, count = set(paths), asyncio.Lock(), random.Random(31), [0]

    async def add(path: str) -> None:
        async with lock:
            if path not in live:
                return
            count[0] += 1
            n = count[0]
            if kinds[path] == BYTES:
                body = bytes([n % 5]) * rng.randint(1, 60)  # repeating bytes
                await append(admin_http, f"{base}/{path}", BYTES, body)
                expected[path] += body
                return
            if n % 7 == 0:
                messages: list[Any] = [{"n": n}, {"n": n, "pair": True}]
                body = json.dumps(messages).encode()
            elif n % 11 == 0:
                messages = [{"headers": {"operation": "insert"}, "value": {"n": n}}]  # State Protocol
                body = json.dumps(messages[0]).encode()
            else:
                messages = [{"n": n, "pad": "x" * (n % 30)}]
                body = json.dumps(messages[0]).encode()
            await append(admin_http, f"{base}/{path}", JSON, body)
            expected[path] += messages

    for path in paths:
        await create(admin_http, f"{base}/{path}", kinds[path])
    for _ in range(3):
        for path in paths:
            await add(path)
    stop = asyncio.Event()

    async def appends() -> None:
        while not stop.is_set():
            for path in rng.sample(sorted(live), 8):
                await add(path)
            await asyncio.sleep(0.05)

    writer = asyncio.create_task(appends())
    out, checkpoint = str(tmp_path / "out"), str(tmp_path / "checkpoint")

    def start() -> Any:
        frame = load(
            spark, base, ADMIN, stream=True, prefix=prefix, maxBytesPerTrigger=3000, partitionBytes=1500
        )
        return (
            frame.writeStream.format("parquet")
            .option("path", out)
            .option("checkpointLocation", checkpoint)
            .start()
        )

    async def batches(query: Any, wanted: int) -> list[Any]:
        """Wait until ``wanted`` batches with rows are done."""
        for _ in range(900):
            progress = await asyncio.to_thread(lambda: query.recentProgress)
            assert query.exception() is None, query.exception()
            if sum(1 for p in progress if p["numInputRows"] > 0) >= wanted:
                return progress
            await asyncio.sleep(0.3)
        raise AssertionError("the query made no progress")

    archiver = Archiver(redis, Archive(archive_dir), HOT0)
    archived = [paths[3], paths[4]]  # one JSON, one byte stream
    query = await asyncio.to_thread(start)
    await batches(query, 1)
    for path in archived:  # mid-query: part already read from Redis, the rest comes from Parquet
        await archiver.archive_stream(keys.stream_id(path))
    async with lock:  # one stream goes, one comes
        live.discard(paths[9])
        async with admin_http.delete(f"{base}/{paths[9]}") as r:
            assert r.status == 204
        late = f"{prefix}s50"
        kinds[late], expected[late] = JSON, []
        await create(admin_http, f"{base}/{late}", JSON)
        live.add(late)
    await batches(query, 4)
    await asyncio.to_thread(query.stop)
    assert query.exception() is None
    first = await asyncio.to_thread(lambda: query.recentProgress)

    for path in archived:  # appends went on: more of them archived before the restart
        await archiver.archive_stream(keys.stream_id(path))
    await asyncio.sleep(0.5)
    query = await asyncio.to_thread(start)  # the same checkpoint
    second = await batches(query, 2)
    assert second[0]["batchId"] >= first[-1]["batchId"] + 1  # resumed, not started over
    stop.set()
    await writer
    await asyncio.to_thread(query.processAllAvailable)
    await asyncio.to_thread(query.stop)

    rows = await asyncio.to_thread(lambda: [r.asDict() for r in spark.read.parquet(out).collect()])
    check(rows, expected, partial={paths[9]})  # the deleted one: what was read before it went
    assert sum(len(v) for v in expected.values() if isinstance(v, list)) > 300

    # The archived streams: their rows have the archive's offsets.
    files = Archive(archive_dir)
    for path in archived:
        table = pa_concat([files.read(f) for f in files.files()], path)
        assert table, f"{path} was not archived"
        mine = {(r["offset"], r["next_offset"]) for r in rows if r["stream"] == path}
        if kinds[path] == JSON:
            assert set(table) <= mine
        else:
            assert min(table)[0] == client.ZERO


def pa_concat(tables: list[Any], path: str) -> list[tuple[str, str]]:
    """(offset, next_offset) of a stream's archived rows."""
    out = []
    for table in tables:
        for row in table.select(["stream", "offset", "next_offset"]).to_pylist():
            if row["stream"] == path:
                out.append((row["offset"], row["next_offset"]))
    return out


async def test_streams_created_again_are_read_from_their_start(spark, admin_http, base, tmp_path) -> None:
    """Streams deleted and created again at their paths between two runs of a query (from
    its checkpoint, ``trigger(availableNow=True)``): one grown past the offset read to,
    one of the same size, one smaller. Each is read again from its start, by prefix (the
    listing's ``created_at_ms``) and by paths (HEAD's ``ETag``). Before, only a tail
    below the offset was noticed: the others were read on from the old offset."""
    name = f"sec/again-{uuid.uuid4().hex[:8]}"
    first: dict[str, Any] = {f"{name}/j": [{"old": n} for n in range(3)], f"{name}/b": b"o" * 30,
                             f"{name}/same": b"s" * 20, f"{name}/less": b"l" * 20}  # fmt: skip
    second: dict[str, Any] = {f"{name}/j": [{"new": n} for n in range(6)], f"{name}/b": b"n" * 50,
                              f"{name}/same": b"t" * 20, f"{name}/less": b"m" * 5}  # fmt: skip

    async def fill(streams: dict[str, Any]) -> None:
        for path, data in streams.items():
            kind = BYTES if isinstance(data, bytes) else JSON
            await create(admin_http, f"{base}/{path}", kind)
            for body in [data] if kind == BYTES else [json.dumps(m).encode() for m in data]:
                await append(admin_http, f"{base}/{path}", kind, body)

    def run(mode: str) -> list[dict[str, Any]]:
        options = {"prefix": f"{name}/"} if mode == "prefix" else {"paths": ",".join(first)}
        out = str(tmp_path / mode)
        query = (
            load(spark, base, READER, stream=True, **options)
            .writeStream.format("parquet")
            .option("path", out)
            .option("checkpointLocation", f"{out}-checkpoint")
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination()
        return [r.asDict() for r in spark.read.parquet(out).collect()]

    def key(row: dict[str, Any]) -> tuple[str, str, bytes]:
        return row["stream"], row["offset"], bytes(row["data"])

    await fill(first)
    before = {mode: await asyncio.to_thread(run, mode) for mode in ("prefix", "paths")}
    for rows in before.values():
        check(rows, first)
    reader = client.Client(base, ADMIN)
    old = await asyncio.to_thread(reader.info, f"{name}/b")
    for path in first:
        async with admin_http.delete(f"{base}/{path}") as r:
            assert r.status == 204
    await fill(second)
    new = await asyncio.to_thread(reader.info, f"{name}/b")
    assert old is not None and new is not None and old.created != new.created

    # A range planned in the old incarnation ends where the new one answers: no rows.
    def read(created: str | None) -> list[client.Piece]:
        return list(client.read_range(reader, f"{name}/b", "-1", client.token(30), created))

    assert await asyncio.to_thread(read, old.created) == []
    assert b"".join(p.data for p in await asyncio.to_thread(read, new.created)) == b"n" * 30
    reader.close()

    for mode, earlier in before.items():
        rows = await asyncio.to_thread(run, mode)
        seen = {key(r) for r in earlier}
        check([r for r in rows if key(r) not in seen], second)
        assert len(rows) == len(earlier) + len([r for r in rows if key(r) not in seen]), mode  # none twice
