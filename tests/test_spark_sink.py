"""The Spark sink (workers/spark_sink.py) against a real gateway, with a real local Spark
that tries a failed task once more, as a cluster does: a re-run streaming batch and a
retried task store their rows once, while a new write or a new query under the same
``producerId`` is never taken for a repeat; missing streams are created with their
rows' content type (the documented copy example over JSON and byte streams), and rows
that do not fit a stream are refused before anything is created.
"""

from __future__ import annotations

import asyncio
import json
import random
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from .conftest import serving
from .spark_local import BYTES, JSON, activate, append, create, load, local_spark

pytest.importorskip("pyspark", reason="pyspark is in the [test] extra")

from workers import streams_client as client  # noqa: E402
from workers.spark_sink import Appended, WriteOptions, append_rows  # noqa: E402


@pytest.fixture(scope="module")
def spark():
    # local[2,2]: a failed task is tried again (local[N] fails the job at once).
    with local_spark("local[2,2]") as session:
        yield session


@pytest.fixture(scope="module")
async def base(redis_url: str):
    """A gateway on a real port (Spark's workers are other processes), small chunks."""
    async with serving(redis_url, max_chunk_bytes=200) as url:
        yield url


def contents(base: str, path: str) -> list[bytes]:
    """A stream's data as read: a JSON stream's messages, a byte stream's pieces."""
    reader = client.Client(base)
    try:
        stream = reader.info(path)
        assert stream is not None, f"{path}: no such stream"
        return [p.data for p in client.read_range(reader, path, "-1", stream.tail)]
    finally:
        reader.close()


def kind_of(base: str, path: str) -> str | None:
    """A stream's content type; None when there is no such stream."""
    reader = client.Client(base)
    try:
        stream = reader.info(path)
        return None if stream is None else stream.content_type
    finally:
        reader.close()


async def producers(http: aiohttp.ClientSession, base: str, path: str) -> dict[str, int]:
    """A stream's idempotent producers: id -> epoch."""
    async with http.get(f"{base}/__ds/streams/{path}") as r:
        assert r.status == 200, await r.text()
        return {p["id"]: p["epoch"] for p in (await r.json())["producers"]}


def run_query(spark: Any, base: str, frame: Callable[[], Any], checkpoint: str, **options: str) -> Any:
    """``frame()`` into the sink with ``trigger(availableNow=True)``, to its end (in a thread)."""
    activate(spark)
    writer = frame().writeStream.format("durable-streams").option("url", base)
    for key, value in options.items():
        writer = writer.option(key, value)
    query = writer.option("checkpointLocation", checkpoint).trigger(availableNow=True).start()
    query.awaitTermination()
    return query


# --- The sink's appends, without Spark ---


async def test_appends_retried_are_stored_once(http, base) -> None:
    """The same rows again as the same producer and epoch are all duplicates; the next
    epoch (the next batch) appends anew."""
    name = f"dup-{uuid.uuid4().hex[:8]}"
    await create(http, f"{base}/{name}/b", BYTES)
    options = WriteOptions(base, content_type=JSON, max_append_bytes=40)
    rows = [{"stream": f"{name}/j", "data": json.dumps({"n": n})} for n in range(30)]
    rows += [{"stream": f"{name}/b", "data": bytes([n]) * 7} for n in range(10)]
    random.Random(4).shuffle(rows)

    def write(epoch: int, batch: list[dict[str, Any]]) -> Appended:
        writer = client.Client(base)
        try:
            return append_rows(writer, options, batch, "test-producer", epoch)
        finally:
            writer.close()

    first = await asyncio.to_thread(write, 7, rows)
    assert first.rows == 40 and first.duplicates == 0 and first.appends > 2 and first.streams == 2
    again = await asyncio.to_thread(write, 7, rows)  # a re-run of the batch
    assert again.appends == 0 and again.duplicates == first.appends
    half = await asyncio.to_thread(write, 7, rows[: len(rows) // 2])  # a retry that died halfway before
    assert half.appends == 0
    more = [{"stream": f"{name}/j", "data": '"late"'}]
    assert (await asyncio.to_thread(write, 8, more)).appends == 1
    got = await asyncio.to_thread(contents, base, f"{name}/j")
    assert [json.loads(m) for m in got] == [
        json.loads(r["data"]) for r in rows if r["stream"].endswith("/j")
    ] + ["late"]


async def test_rows_content_types(http, base) -> None:
    """Rows with a content_type create missing streams as that; rows that do not fit a
    stream (another content type; not JSON for a JSON stream to be made) are refused
    before anything is appended or created."""
    name = f"kinds-{uuid.uuid4().hex[:8]}"

    def write(options: WriteOptions, rows: list[dict[str, Any]], typed: bool = True) -> Appended:
        writer = client.Client(base)
        try:
            return append_rows(writer, options, rows, "kinds", 0, typed=typed)
        finally:
            writer.close()

    plain = WriteOptions(base, max_append_bytes=30)
    rows = [{"stream": f"{name}/j", "data": f'{{"n":{n}}}', "content_type": JSON} for n in range(5)]
    rows += [{"stream": f"{name}/b", "data": b"x" * 20, "content_type": BYTES} for _ in range(3)]
    done = await asyncio.to_thread(write, plain, rows)
    assert done.rows == 8 and done.appends > 2
    assert await asyncio.to_thread(kind_of, base, f"{name}/j") == JSON
    assert await asyncio.to_thread(kind_of, base, f"{name}/b") == BYTES
    assert await asyncio.to_thread(contents, base, f"{name}/j") == [f'{{"n":{n}}}'.encode() for n in range(5)]
    assert b"".join(await asyncio.to_thread(contents, base, f"{name}/b")) == b"x" * 60

    # Bytes for an existing JSON stream: refused, nothing appended.
    wrong = {"stream": f"{name}/j", "data": b"\x00", "content_type": BYTES}
    with pytest.raises(client.StreamsError, match="content type") as refused:
        await asyncio.to_thread(write, plain, [wrong])
    assert refused.value.status == 409
    assert len(await asyncio.to_thread(contents, base, f"{name}/j")) == 5
    with pytest.raises(client.StreamsError, match="two content types"):
        await asyncio.to_thread(write, plain, [rows[0], {**rows[0], "content_type": BYTES}])

    # Rows without a content type, contentType JSON, bytes that are not JSON: refused
    # before the stream is made (it was made empty, then the append failed with 400).
    as_json = WriteOptions(base, content_type=JSON)
    with pytest.raises(client.StreamsError, match="not JSON texts"):
        await asyncio.to_thread(write, as_json, [{"stream": f"{name}/raw", "data": b"\x01\x02"}], False)
    assert await asyncio.to_thread(kind_of, base, f"{name}/raw") is None
    # Without either: 404, saying what to give.
    with pytest.raises(client.StreamsError, match="content_type column") as missing:
        await asyncio.to_thread(write, plain, [{"stream": f"{name}/none", "data": b"1"}], False)
    assert missing.value.status == 404


# --- Spark ---


async def test_named_producer_writes_are_never_taken_for_repeats(spark, http, base) -> None:
    """``df.write`` under one ``producerId``, three times with different rows: each write
    a new epoch, all rows stored (before: the second and third were answered as
    duplicates of the first, epoch 0 again, and Spark said success). The third write's
    task fails once after its first appends and is tried again: stored once."""
    name = f"daily-{uuid.uuid4().hex[:8]}"
    target, missing = f"{name}/events", f"{name}/late"
    producer = f"loader-{name}"
    epochs: list[int] = []
    await create(http, f"{base}/{target}", JSON)  # no contentType: a missing stream is a 404

    def write(numbers: range, partitions: int, also: str | None = None) -> None:
        activate(spark)
        rows = [(target, json.dumps({"n": n})) for n in numbers] + ([(also, '"last"')] if also else [])
        data = spark.sparkContext.parallelize(rows, partitions)
        if also:
            data = data.mapPartitions(fail_first_attempt(base, also))
        frame = spark.createDataFrame(data, "stream string, data string")
        (frame.write.format("durable-streams").mode("append").option("url", base)
         .option("producerId", producer).option("maxAppendBytes", "40").save())  # fmt: skip

    async def numbers() -> list[int]:
        return [json.loads(m)["n"] for m in await asyncio.to_thread(contents, base, target)]

    await asyncio.to_thread(write, range(0, 10), 2)
    epochs.append(max((await producers(http, base, target)).values()))
    await asyncio.to_thread(write, range(10, 20), 2)
    ids = await producers(http, base, target)
    assert set(ids) == {f"{producer}-p0", f"{producer}-p1"}  # the name, one producer a partition
    assert min(ids.values()) > epochs[0]  # the second write: a later epoch
    assert sorted(await numbers()) == list(range(20))

    # One partition, rows in order; its first attempt appends to the target, then fails
    # on the stream its retry creates (404: flushed last, by path: events before late).
    await asyncio.to_thread(write, range(20, 40), 1, missing)
    got = await numbers()
    assert sorted(got[:20]) == list(range(20)) and got[20:] == list(range(20, 40))  # once, in order
    assert await asyncio.to_thread(contents, base, missing) == [b'"last"']


def fail_first_attempt(base: str, missing: str) -> Callable[[Any], Any]:
    """A step of the write's task that passes its rows on; a retry first creates the
    stream ``missing``, so the first attempt fails on it (404) after appending the rest."""

    def step(rows: Any) -> Any:
        from pyspark import TaskContext

        context = TaskContext.get()
        if context is not None and context.attemptNumber() > 0:
            maker = client.Client(base)
            maker.create(missing, JSON)
            maker.close()
        yield from rows

    return step


async def test_queries_under_one_producer_id_do_not_collide(spark, http, base, tmp_path) -> None:
    """Two streaming queries (two checkpoints) with the same ``producerId`` into one
    stream: batch ids, the epochs, start at 0 in each, so the second query's rows were
    answered as duplicates of the first's; with the query id in the producer ids both
    are stored."""
    from pyspark.sql import functions as F

    name = f"twoq-{uuid.uuid4().hex[:8]}"
    target = f"{name}/merged"
    await create(http, f"{base}/{target}", JSON)
    for source in ("one", "two"):
        await create(http, f"{base}/{name}/{source}", JSON)
        for n in range(5):
            await append(http, f"{base}/{name}/{source}", JSON, json.dumps({source: n}).encode())

    def copy(source: str) -> str:
        def frame() -> Any:
            events = load(spark, base, None, stream=True, paths=f"{name}/{source}")
            return events.select(F.lit(target).alias("stream"), "data")

        query = run_query(spark, base, frame, str(tmp_path / source), producerId="merger")
        return query.id

    first = await asyncio.to_thread(copy, "one")
    second = await asyncio.to_thread(copy, "two")
    got = [json.loads(m) for m in await asyncio.to_thread(contents, base, target)]
    assert got == [{"one": n} for n in range(5)] + [{"two": n} for n in range(5)]
    assert set(await producers(http, base, target)) == {f"merger-{first}-p0", f"merger-{second}-p0"}


async def test_sink_stores_a_rerun_batch_once(spark, http, base, tmp_path) -> None:
    """A copy job (this source into this sink, a named producer) over several batches;
    then, as if it had crashed after the sink's appends of its last batch but before
    Spark recorded the batch, its commit is removed and the query restarted: the batch
    runs again, the server answers its appends as duplicates, and the copies hold
    everything once."""
    from pyspark.sql import functions as F

    name = f"sink-{uuid.uuid4().hex[:8]}"
    sources = {f"{name}/in/j1": JSON, f"{name}/in/j2": JSON, f"{name}/in/b": BYTES}
    for path, kind in sources.items():
        await create(http, f"{base}/{path}", kind)
        for n in range(25):
            body = (
                json.dumps({"n": n, "s": path[-2:]}).encode()
                if kind == JSON
                else bytes([n]) * (n % 9 + 1) * 10
            )
            await append(http, f"{base}/{path}", kind, body)
    await create(http, f"{base}/{name}/out/b", BYTES)  # the JSON ones: made by the sink
    checkpoint = str(tmp_path / "checkpoint")

    def frame() -> Any:
        events = load(spark, base, None, stream=True, prefix=f"{name}/in/", maxBytesPerTrigger=400,
                      partitionBytes=300)  # fmt: skip
        return events.select(
            F.concat(F.lit(f"{name}/out/"), F.substring_index("stream", "/", -1)).alias("stream"), "data"
        )

    def run() -> tuple[str, list[int]]:
        query = run_query(spark, base, frame, checkpoint, contentType=JSON, maxAppendBytes="120",
                          producerId="copier")  # fmt: skip
        return query.id, [p["batchId"] for p in query.recentProgress if p["numInputRows"] > 0]

    query_id, ran = await asyncio.to_thread(run)
    assert len(ran) >= 3, ran
    last = max(ran)
    commits = Path(checkpoint) / "commits"
    assert max(int(f.name) for f in commits.iterdir() if f.name.isdigit()) == last  # no empty batch after
    (commits / str(last)).unlink()
    (commits / f".{last}.crc").unlink(missing_ok=True)
    again_id, again = await asyncio.to_thread(run)
    assert again_id == query_id and again == [last]

    for path, kind in sources.items():
        copy = path.replace("/in/", "/out/")
        original = await asyncio.to_thread(contents, base, path)
        copied = await asyncio.to_thread(contents, base, copy)
        if kind == JSON:
            assert copied == original  # message for message
        else:
            assert b"".join(copied) == b"".join(original)
        epochs = await producers(http, base, copy)
        assert epochs and all(p.startswith(f"copier-{query_id}-p") for p in epochs)
        assert max(epochs.values()) <= last


async def test_the_documented_copy_runs_on_json_and_byte_streams(spark, http, base, tmp_path) -> None:
    """docs/spark-streaming.md's copy, as written, over a prefix holding a JSON and a byte
    stream: each copy is made with its source's content type and holds what it does
    (before: every copy was made JSON, and the byte stream's failed with 400, an empty
    JSON stream left behind). Without the content_type column, rows that are not JSON
    are refused before a JSON stream is made for them."""
    from pyspark.sql import functions as F

    prefix = f"orders-{uuid.uuid4().hex[:8]}/"
    sources = {f"{prefix}events": JSON, f"{prefix}raw": BYTES}
    for path, kind in sources.items():
        await create(http, f"{base}/{path}", kind)
        for n in range(12):
            body = json.dumps({"order": n}).encode() if kind == JSON else bytes(range(n, n + 40))
            await append(http, f"{base}/{path}", kind, body)

    def copy(checkpoint: str, typed: bool) -> Any:
        def frame() -> Any:
            events = load(spark, base, None, stream=True, prefix=prefix)
            columns = ["data", "content_type"] if typed else ["data"]
            return events.select(F.concat(F.lit("copy/"), "stream").alias("stream"), *columns)

        options = {} if typed else {"contentType": JSON}
        return run_query(spark, base, frame, checkpoint, **options)

    query = await asyncio.to_thread(copy, str(tmp_path / "copy"), True)
    assert query.exception() is None
    for path, kind in sources.items():
        assert await asyncio.to_thread(kind_of, base, f"copy/{path}") == kind
        original = await asyncio.to_thread(contents, base, path)
        copied = await asyncio.to_thread(contents, base, f"copy/{path}")
        if kind == BYTES:  # pieces as read: compare the bytes
            original, copied = [b"".join(original)], [b"".join(copied)]
        assert copied == original

    # The copy as the docs had it: every missing stream made JSON.
    for path in sources:
        async with http.delete(f"{base}/copy/{path}") as r:
            assert r.status == 204
    with pytest.raises(Exception, match="not JSON texts"):  # the query stops, saying why
        await asyncio.to_thread(copy, str(tmp_path / "untyped"), False)
    assert await asyncio.to_thread(kind_of, base, f"copy/{prefix}raw") is None  # nothing left behind
