"""A PySpark data source for Durable Streams: batch and streaming reads, and a sink.

PySpark 4's Python Data Source API (``pyspark.sql.datasource``), so no JVM connector:
register the class once per session and use the format ``durable-streams``::

    import os, sys
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # Spark's Python workers import this module
    from pyspark.sql import SparkSession, functions as F
    from workers.spark_source import DurableStreamsDataSource

    spark = SparkSession.builder.getOrCreate()
    spark.dataSource.register(DurableStreamsDataSource)
    url = "http://127.0.0.1:4437/v1/stream"

    # Batch: every stream under orders/ from its start to its tail now.
    df = spark.read.format("durable-streams").option("url", url).option("prefix", "orders/").load()
    df.groupBy("stream").count().show()

    # Streaming, exactly once into Parquet (or any exactly-once sink), up to 64 MiB a batch.
    events = (spark.readStream.format("durable-streams").option("url", url)
              .option("prefix", "orders/").option("maxBytesPerTrigger", 64 << 20).load())
    events.writeStream.format("parquet").option("path", "out/").option("checkpointLocation", "ck/").start()

    # Sink: each row (stream, data) appended once, even when a batch is retried.
    (events.select(F.concat(F.lit("copy/"), "stream").alias("stream"), "data")
        .writeStream.format("durable-streams").option("url", url)
        .option("contentType", "application/json").option("checkpointLocation", "ck-copy/").start())

Rows (``SCHEMA``): ``stream`` (the path under ``url``), ``offset`` and ``next_offset`` (the
protocol offsets the row spans: read from ``offset`` and the row comes first; resume from
``next_offset``), ``content_type``, ``data`` (binary), ``text`` (a JSON message's text, else
null) and ``append_time`` (null: reads do not carry it; the archive's Parquet files do). A
JSON stream (``application/json``) gives one row per message, with the offsets of that
message (the archive's offsets too); any other stream gives its bytes in order, in pieces
as read (a chunk, up to the server's ``--max-chunk-bytes``, cut at a batch's end): append
boundaries are not visible to readers, and concatenating a stream's pieces by offset gives
its bytes.

Options (reads): ``url`` (required; the streams' base URL), ``prefix`` (streams listed
through ``GET {url}/__ds/streams``, default: all) or ``paths`` (comma-separated or a JSON
array), ``token`` (sent as ``Authorization: Bearer``; Spark redacts options named like
it), ``startingOffsets`` (``earliest``, default; ``latest``; or JSON ``{path: offset}``,
unnamed streams from their start), ``endingOffsets`` (batch: ``latest``, or JSON
``{path: offset}``: those streams up to there),
``maxBytesPerTrigger`` (streaming: bytes a micro-batch plans, shared between the
streams; soft for JSON streams, which only end on a message boundary: see ``plan_ends``),
``partitionBytes`` (bytes a partition reads, default 8 MiB: streams are packed into
partitions, at most 256 a partition, a stream never split across two),
``minPollIntervalMs`` (reuse a listing this long, default 200: Spark asks for the latest
offsets every 10 ms when idle) and ``timeout`` (seconds per HTTP request, default 30;
connection errors, 429 and 5xx are retried with backoff). Sink options: ``url``, ``token``,
``contentType`` (create missing streams with it), ``producerId``, ``maxAppendBytes``.

**Streaming offsets and exactly-once.** A Spark offset is ``{path: protocol offset}``.
``latestOffset`` lists the streams (one request per 1,000) or HEADs the named ones and
plans each stream's end: its tail (``Stream-Next-Offset``) or less under
``maxBytesPerTrigger``. A stream not in the start offset joins from its beginning (-1)
once it holds data; a stream that is gone (listing and HEAD agree: 404/410) leaves the
offsets with a warning. A micro-batch reads, per stream, from its start to exactly its
planned end (``streams_client.read_range``: the last response is cut by position), so a
batch's rows are a function of its (start, end) offsets alone: Spark writes those offsets
ahead of the batch, re-runs an unfinished batch with the same ones after a restart, and
with an exactly-once sink (files, Delta, this sink) every message comes out once. Deleted
or expired streams (404/410 while reading) end their range with a warning, never an
error; data dropped by retention before it was read is logged and skipped (410 with
``Stream-Earliest-Offset``). A stream whose tail went below the planned start was deleted
and created again: it is read again from its beginning (a recreated stream that has
already grown past the old offset cannot be told apart: avoid reusing paths under a
running query). Reads below Redis' hot window come from the archive through the gateway,
with the same bytes and offsets.

**The sink's idempotent producers.** Each task of micro-batch ``b`` appends as
``Producer-Id: spark-<query id>-p<partition>`` (``producerId`` option: another prefix than
``spark-<query id>``), ``Producer-Epoch: b``, and ``Producer-Seq`` 0, 1, 2, ... counting
that task's appends to each stream (producer state is per stream and producer id). The
query id survives restarts from a checkpoint; batch ids grow by one per batch, so a new
batch opens a new epoch at sequence 0 (the protocol's rule), and a task re-run for the
same batch (a retry, a speculative copy, or a restart whose last batch had not been
committed) sends the same (id, epoch, seq) for the same appends: the server answers 204
(duplicate) for the ones it has and stores the rest once. Sequence numbers have no gaps
(each append takes the next; a retry resends, never skips), and epochs never go back
(a batch runs after the previous one committed). Rows are grouped into appends
deterministically (per stream, in row order, up to ``maxAppendBytes``, default 1 MiB),
which is what makes a re-run's appends the same: **a re-run batch must hand each
partition the same rows in the same order**, which Spark's replay gives for replayable
sources (this one, Kafka, files) and deterministic plans; a plan with a non-deterministic
shuffle before the sink, or a changed query restarted on the old checkpoint, can break it.
On a JSON stream each row is one message (``data``: a JSON text); on others its bytes are
appended as they are. A stream that does not exist is created with ``contentType`` when
that option is given (else the task fails with 404). Appends are visible as soon as they
are made, before Spark commits the batch.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
from pyspark import TaskContext
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    DataSourceStreamWriter,
    DataSourceWriter,
    InputPartition,
    WriterCommitMessage,
)
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxBytes,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import BinaryType, StringType, StructField, StructType, TimestampType

from .streams_client import (
    BEGINNING,
    Client,
    Piece,
    StreamInfo,
    StreamsError,
    is_json,
    position,
    read_range,
    start_position,
    token,
)

log = logging.getLogger("durable_streams.spark")

NAME = "durable-streams"
SCHEMA = StructType(
    [
        StructField("stream", StringType(), False),  # the stream's path under the url
        StructField("offset", StringType(), False),  # where this row starts
        StructField("next_offset", StringType(), False),  # where the next row starts
        StructField("content_type", StringType(), False),
        StructField("data", BinaryType(), False),  # bytes: a piece of a byte stream, or a JSON message
        StructField("text", StringType(), True),  # a JSON message's text (null for other streams)
        StructField("append_time", TimestampType(), True),  # null: reads do not carry it
    ]
)
ARROW_SCHEMA = to_arrow_schema(SCHEMA, timezone="UTC")
ROWS_PER_BATCH = 4096
BYTES_PER_BATCH = 8 << 20
MAX_SPANS_PER_PARTITION = 256  # streams a partition reads at most (see pack)


# --- Options ---


def _offsets_option(text: str | None, keywords: tuple[str, ...]) -> str | dict[str, str]:
    """``earliest``/``latest`` or a JSON object of path -> offset."""
    value = (text or keywords[0]).strip()
    if value.lower() in keywords:
        return value.lower()
    try:
        doc = json.loads(value)
    except json.JSONDecodeError:
        raise ValueError(
            f"expected {' or '.join(keywords)} or a JSON object of path -> offset: {value!r}"
        ) from None
    if not isinstance(doc, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in doc.items()
    ):
        raise ValueError(f"expected a JSON object of path -> offset (strings): {value!r}")
    for offset in doc.values():
        start_position(offset)  # -1 or this server's offset, else ValueError
    return doc


def _paths_option(text: str) -> list[str]:
    text = text.strip()
    if text.startswith("["):
        paths = json.loads(text)
        if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
            raise ValueError("paths: a JSON array of strings, or paths separated by commas")
    else:
        paths = [p.strip() for p in text.split(",")]
    return sorted({p.strip("/") for p in paths if p.strip("/")})


def _int(options: Mapping[str, str], name: str, default: int | None) -> int | None:
    value = options.get(name)
    if value in (None, ""):
        return default
    number = int(str(value))
    if number <= 0:
        raise ValueError(f"{name} must be positive: {value!r}")
    return number


def _base_url(options: Mapping[str, str]) -> str:
    """The ``url`` option (Spark's ``load(path)``/``save(path)`` as ``path``): required."""
    url = options.get("url") or options.get("path")
    if not url:
        raise ValueError(
            'the "url" option is required: the streams\' base URL, e.g. http://host:4437/v1/stream'
        )
    return url


@dataclass(frozen=True)
class ReadOptions:
    url: str
    token: str | None = None
    prefix: str = ""
    paths: tuple[str, ...] | None = None  # explicit streams instead of a prefix
    starting: str | dict[str, str] = "earliest"
    ending: str | dict[str, str] = "latest"
    max_bytes_per_trigger: int | None = None
    partition_bytes: int = 8 << 20
    poll_ms: int = 200
    timeout: float = 30.0

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> ReadOptions:
        url = _base_url(options)
        if options.get("prefix") and options.get("paths"):
            raise ValueError('give "prefix" or "paths", not both')
        paths = options.get("paths")
        return cls(
            url=url,
            token=options.get("token") or None,
            prefix=options.get("prefix") or "",
            paths=tuple(_paths_option(paths)) if paths else None,
            starting=_offsets_option(options.get("startingOffsets"), ("earliest", "latest")),
            ending=_offsets_option(options.get("endingOffsets"), ("latest",)),
            max_bytes_per_trigger=_int(options, "maxBytesPerTrigger", None),
            partition_bytes=_int(options, "partitionBytes", 8 << 20) or 8 << 20,
            poll_ms=int(options.get("minPollIntervalMs") or 200),
            timeout=float(options.get("timeout") or 30),
        )

    def client(self) -> Client:
        return Client(self.url, self.token, self.timeout)


def discover(client: Client, options: ReadOptions) -> dict[str, StreamInfo]:
    """The streams a query reads, by path: the named ones that exist, or the listing."""
    if options.paths is not None:
        found = {path: client.info(path) for path in options.paths}
        return {path: info for path, info in found.items() if info is not None}
    return {info.path: info for info in client.list_streams(options.prefix)}


# --- Planning (pure) ---


@dataclass(frozen=True)
class Span:
    """One stream's part of a batch: [start, end), ``size`` bytes (positions)."""

    path: str
    start: str  # an offset, or -1
    end: str
    size: int


def spans(start: Mapping[str, str], end: Mapping[str, str], streaming: bool = True) -> list[Span]:
    """What a batch from ``start`` to ``end`` reads, per stream. A function of the two
    offsets alone, so a re-run batch reads the same: a stream missing from ``start``
    reads from -1, and so, when ``streaming``, does one whose end is below its start
    (created again: ``plan_ends``)."""
    out = []
    for path in sorted(end):
        stop = end[path]
        begin = start.get(path, BEGINNING)
        if begin == stop:
            continue
        first, last = start_position(begin), position(stop)
        if last < first and streaming:
            begin, first = BEGINNING, 0
        if last > first:
            out.append(Span(path, begin, stop, last - first))
    return out


def pack(items: Sequence[Span], partition_bytes: int, overhead: int | None = None) -> list[list[Span]]:
    """Spans packed into partitions of about ``partition_bytes`` (first fit, largest
    first; each span also counts ``overhead``, by default 1/256 of a partition, for its
    requests: thousands of small streams spread over several tasks, at most 256 a task).
    Deterministic: same spans, same partitions."""
    if overhead is None:
        overhead = max(partition_bytes // MAX_SPANS_PER_PARTITION, 1)
    bins: list[tuple[int, list[Span]]] = []
    for span in sorted(items, key=lambda s: (-s.size, s.path)):
        cost = span.size + overhead
        for i, (used, members) in enumerate(bins):
            if used + cost <= partition_bytes:
                members.append(span)
                bins[i] = (used + cost, members)
                break
        else:
            bins.append((cost, [span]))
    return [sorted(members, key=lambda s: s.path) for _, members in bins]


def plan_ends(
    start: Mapping[str, str],
    streams: Mapping[str, StreamInfo],
    budget: int | None,
    favored: Iterable[str] = (),
) -> tuple[dict[str, str], set[str]]:
    """Each stream's end for the next micro-batch, and the JSON streams left waiting.

    Without a budget, every stream's tail. With one (``maxBytesPerTrigger``), the
    budget is shared out like water: streams with the smallest backlogs first, each
    taking at most an equal share of what is left. A byte stream can end anywhere, so
    it takes its share exactly; a JSON stream can only end on a message boundary, and
    only tails are known to be one, so it goes whole when its backlog fits its share,
    and otherwise waits, ahead of the others next time (``favored``), when it goes
    whole even past the budget. A batch that would admit nothing admits the smallest
    waiting JSON stream: the budget is soft, never a stall.

    Streams in ``start`` but not in ``streams`` are gone and left out; new streams join
    (from -1) once they hold data.
    """
    favored = set(favored)
    end: dict[str, str] = {}
    todo: list[tuple[str, int, int, StreamInfo]] = []  # path, start position, backlog, info
    for path, info in sorted(streams.items()):
        tail = position(info.tail)
        begin = start.get(path)
        if begin is None and tail == 0:
            continue  # empty: joins with its first byte
        first = 0 if begin is None else start_position(begin)
        if tail < first:
            log.warning("%s: tail %s is below its offset %s: created again? read from its start", path,
                        info.tail, begin)  # fmt: skip
            first = 0
        if tail == first:
            if begin is not None:
                end[path] = begin
            continue
        todo.append((path, first, tail - first, info))
    if budget is None:
        end.update({path: info.tail for path, _, _, info in todo})
        return dict(sorted(end.items())), set()

    order = sorted(todo, key=lambda item: (item[0] not in favored, item[2], item[0]))
    remaining, waiting = budget, []
    for i, (path, first, backlog, info) in enumerate(order):
        share = max(remaining, 0) // (len(order) - i)
        if info.json:
            take = backlog if backlog <= share or path in favored else 0
        else:
            take = min(backlog, share)
        if take:
            end[path] = info.tail if take == backlog else token(first + take)
            remaining -= take
        else:
            waiting.append((path, first, backlog, info))
            if path in start:
                end[path] = start[path]
    if remaining == budget and waiting:  # nothing admitted: the first in line goes anyway
        path, first, backlog, info = waiting.pop(0)
        take = backlog if info.json else min(backlog, budget)
        end[path] = info.tail if take == backlog else token(first + take)
    return dict(sorted(end.items())), {path for path, _, _, info in waiting if info.json}


# --- Reading partitions (on executors) ---


class StreamSpans(InputPartition):
    """A partition: streams' spans read one after the other by one task."""

    def __init__(self, items: list[Span]) -> None:
        super().__init__([(s.path, s.start, s.end) for s in items])
        self.spans = [(s.path, s.start, s.end) for s in items]


@dataclass
class _Columns:
    stream: list[str] = field(default_factory=list)
    offset: list[str] = field(default_factory=list)
    next_offset: list[str] = field(default_factory=list)
    content_type: list[str] = field(default_factory=list)
    data: list[bytes] = field(default_factory=list)
    text: list[str | None] = field(default_factory=list)
    size: int = 0

    def add(self, path: str, piece: Piece) -> None:
        self.stream.append(path)
        self.offset.append(piece.offset)
        self.next_offset.append(piece.next_offset)
        self.content_type.append(piece.content_type)
        self.data.append(piece.data)
        self.text.append(piece.data.decode("utf-8", "replace") if piece.json else None)
        self.size += len(piece.data)

    def full(self) -> bool:
        return len(self.stream) >= ROWS_PER_BATCH or self.size >= BYTES_PER_BATCH

    def batch(self) -> pa.RecordBatch:
        count = len(self.stream)
        arrays = [
            pa.array(self.stream, pa.string()),
            pa.array(self.offset, pa.string()),
            pa.array(self.next_offset, pa.string()),
            pa.array(self.content_type, pa.string()),
            pa.array(self.data, pa.binary()),
            pa.array(self.text, pa.string()),
            pa.nulls(count, pa.timestamp("us", tz="UTC")),
        ]
        return pa.RecordBatch.from_arrays(arrays, schema=ARROW_SCHEMA)


def read_spans(options: ReadOptions, items: Iterable[tuple[str, str, str]]) -> Iterator[pa.RecordBatch]:
    """A partition's rows, as Arrow record batches (much cheaper than tuples)."""
    client = options.client()
    try:
        columns = _Columns()
        for path, begin, stop in items:
            for piece in read_range(client, path, begin, stop):
                columns.add(path, piece)
                if columns.full():
                    yield columns.batch()
                    columns = _Columns()
        if columns.stream:
            yield columns.batch()
    finally:
        client.close()


def _partitions(
    start: Mapping[str, str], end: Mapping[str, str], options: ReadOptions, streaming: bool = True
) -> list[StreamSpans]:
    return [StreamSpans(group) for group in pack(spans(start, end, streaming), options.partition_bytes)]


class DurableStreamsReader(DataSourceReader):
    """``spark.read``: the streams from ``startingOffsets`` to ``endingOffsets`` (default:
    from their start to their tails when the query is planned)."""

    def __init__(self, options: ReadOptions) -> None:
        self.options = options

    def partitions(self) -> Sequence[InputPartition]:
        options = self.options
        if options.starting == "latest":
            raise ValueError("startingOffsets=latest reads nothing in a batch query")
        start = options.starting if isinstance(options.starting, dict) else {}
        if isinstance(options.ending, dict):
            end = options.ending
        else:
            client = options.client()
            try:
                end = {path: info.tail for path, info in discover(client, options).items()}
            finally:
                client.close()
        return _partitions(start, end, options, streaming=False)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        # No streams: Spark plans one partition of its own (InputPartition(None)).
        return read_spans(self.options, partition.spans if isinstance(partition, StreamSpans) else [])


class DurableStreamsStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """``spark.readStream``: see the module's docstring for offsets and exactly-once."""

    def __init__(self, options: ReadOptions) -> None:
        if options.ending != "latest":
            raise ValueError("endingOffsets is for batch queries")
        self.options = options
        self._client: Client | None = None
        self._target: dict[str, StreamInfo] | None = None  # Trigger.AvailableNow: tails at its start
        self._favored: set[str] = set()
        self._listed: tuple[float, dict[str, StreamInfo]] | None = None

    def __getstate__(self) -> dict[str, Any]:  # what executors get: no connection, no caches
        return {"options": self.options, "_client": None, "_target": None, "_favored": set(), "_listed": None}

    def _connection(self) -> Client:
        if self._client is None:
            self._client = self.options.client()
        return self._client

    def _streams(self, start: Mapping[str, str]) -> dict[str, StreamInfo]:
        now = time.monotonic()
        if self._listed is not None and now - self._listed[0] < self.options.poll_ms / 1000:
            streams = self._listed[1]
        else:
            client = self._connection()
            streams = discover(client, self.options)
            if self.options.paths is None:
                # Not listed: gone, or not visible for a moment? HEAD says (once: a gone
                # stream leaves the offsets).
                for path in sorted(set(start) - set(streams)):
                    info = client.info(path)
                    if info is None:
                        log.warning("%s: deleted or expired (404/410): no longer read", path)
                    else:
                        streams[path] = info
            else:
                for path in sorted(set(start) - set(streams)):
                    log.warning("%s: deleted or expired (404/410): no longer read", path)
            self._listed = (now, streams)
        if self._target is not None:  # AvailableNow: nothing past the tails it started with
            capped = {}
            for path, target in self._target.items():
                info = streams.get(path)
                if info is not None:
                    capped[path] = target if position(target.tail) <= position(info.tail) else info
            streams = capped
        return streams

    def initialOffset(self) -> dict[str, str]:
        starting = self.options.starting
        if isinstance(starting, dict):
            return dict(sorted(starting.items()))
        if starting == "latest":
            streams = discover(self._connection(), self.options)
            return {path: info.tail for path, info in sorted(streams.items()) if position(info.tail) > 0}
        return {}

    def getDefaultReadLimit(self) -> ReadLimit:
        limit = self.options.max_bytes_per_trigger
        return ReadMaxBytes(limit) if limit else ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        self._listed = None
        self._target = dict(self._streams({}))

    def latestOffset(self, start: dict[str, str], limit: ReadLimit) -> dict[str, str]:
        try:
            streams = self._streams(start)
        except StreamsError as exc:
            if exc.status not in (0, 429) and exc.status < 500:
                raise  # refused (401, 403, 404 for the listing...): the query stops, saying why
            log.warning("could not list the streams (%s): no new data this time", exc)
            return start
        budget = limit.max_bytes if isinstance(limit, ReadMaxBytes) else None
        end, self._favored = plan_ends(start, streams, budget, self._favored)
        # Spark compares offsets as JSON text: keys in one order (sorted), and the start
        # itself when nothing moved (no batch then).
        return start if end == start else end

    def reportLatestOffset(self) -> dict[str, str] | None:
        return {path: info.tail for path, info in self._listed[1].items()} if self._listed else None

    def partitions(self, start: dict[str, str], end: dict[str, str]) -> Sequence[InputPartition]:
        return _partitions(start, end, self.options)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        # No streams: Spark plans one partition of its own (InputPartition(None)).
        return read_spans(self.options, partition.spans if isinstance(partition, StreamSpans) else [])

    def commit(self, end: dict[str, str]) -> None:
        pass  # nothing to release: the server keeps every offset readable

    def stop(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


# --- Writing ---


@dataclass(frozen=True)
class WriteOptions:
    url: str
    token: str | None = None
    content_type: str | None = None  # create missing streams with it
    producer_id: str | None = None  # prefix of the producer ids (default: spark-<query id>)
    max_append_bytes: int = 1 << 20
    max_buffer_bytes: int = 32 << 20
    timeout: float = 30.0

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> WriteOptions:
        url = _base_url(options)
        return cls(
            url=url,
            token=options.get("token") or None,
            content_type=options.get("contentType") or None,
            producer_id=options.get("producerId") or None,
            max_append_bytes=_int(options, "maxAppendBytes", 1 << 20) or 1 << 20,
            timeout=float(options.get("timeout") or 30),
        )


@dataclass
class Appended(WriterCommitMessage):
    """What one task did: appends stored, appends the server already had (retries), rows."""

    appends: int = 0
    duplicates: int = 0
    rows: int = 0
    streams: int = 0


def _check_schema(schema: StructType) -> None:
    types = {f.name: f.dataType for f in schema.fields}
    if not isinstance(types.get("stream"), StringType):
        raise ValueError("the sink needs a string column `stream` (the stream's path under the url)")
    if not isinstance(types.get("data"), BinaryType | StringType):
        raise ValueError(
            "the sink needs a column `data`, binary or string (a JSON stream: one message a row)"
        )


class _Appender:
    """One task's appends: rows grouped per stream in row order, each group one append
    with the producer's next sequence number for that stream."""

    def __init__(self, client: Client, options: WriteOptions, producer_id: str, epoch: int) -> None:
        self.client, self.options = client, options
        self.producer_id, self.epoch = producer_id, epoch
        self.types: dict[str, str] = {}
        self.seqs: dict[str, int] = {}
        self.pending: dict[str, list[bytes]] = {}
        self.sizes: dict[str, int] = {}
        self.buffered = 0
        self.done = Appended()

    def _type(self, path: str) -> str:
        if path not in self.types:
            info = self.client.info(path)
            if info is None:
                info = self._create(path)
            self.types[path] = info.content_type
        return self.types[path]

    def _create(self, path: str) -> StreamInfo:
        if not self.options.content_type:
            raise StreamsError(
                f"{path}: no such stream (404); give contentType to create missing streams", 404
            )
        reply = self.client.create(path, self.options.content_type)
        if reply.status not in (200, 201):
            raise StreamsError(f"creating {path}: {reply.status} {reply.text}", reply.status)
        return StreamInfo(path, reply.header("Stream-Next-Offset") or "", reply.header("Content-Type") or
                          self.options.content_type)  # fmt: skip

    def add(self, path: str, data: bytes) -> None:
        size = self.sizes.get(path, 0)
        if size and size + len(data) > self.options.max_append_bytes:
            self.flush(path)
        self.pending.setdefault(path, []).append(data)
        self.sizes[path] = self.sizes.get(path, 0) + len(data)
        self.buffered += len(data)
        self.done.rows += 1
        if self.buffered > self.options.max_buffer_bytes:
            self.flush_all()

    def flush_all(self) -> None:
        for path in sorted(self.pending):
            self.flush(path)

    def flush(self, path: str) -> None:
        items = self.pending.pop(path, None)
        if not items:
            return
        self.buffered -= self.sizes.pop(path, 0)
        content_type = self._type(path)
        body = b"[" + b",".join(items) + b"]" if is_json(content_type) else b"".join(items)
        seq = self.seqs.get(path, 0)
        self.seqs[path] = seq + 1
        producer = (self.producer_id, self.epoch, seq)
        reply = self.client.append(path, body, content_type, producer)
        if reply.status == 404 and self.options.content_type:  # deleted since we looked: create it again
            self._create(path)
            reply = self.client.append(path, body, content_type, producer)
        if reply.status in (200, 201):
            self.done.appends += 1
        elif reply.status == 204:
            self.done.duplicates += 1
        elif reply.status == 403 and reply.header("Producer-Epoch"):
            raise StreamsError(
                f"{path}: producer {self.producer_id} epoch {self.epoch} is fenced by epoch "
                f"{reply.header('Producer-Epoch')}: a later batch of this query already wrote there "
                "(two queries on one checkpoint, or a batch id reused?)",
                403,
            )
        elif reply.status == 409 and reply.header("Producer-Expected-Seq"):
            raise StreamsError(
                f"{path}: producer {self.producer_id} epoch {self.epoch}: sequence gap (expected "
                f"{reply.header('Producer-Expected-Seq')}, sent {seq}): rows differ from the first run",
                409,
            )
        else:
            raise StreamsError(f"appending to {path}: {reply.status} {reply.text}", reply.status)


def append_rows(
    client: Client, options: WriteOptions, rows: Iterable[Any], producer_id: str, epoch: int
) -> Appended:
    """Append rows (``stream``, ``data``) as producer ``producer_id`` in ``epoch``,
    sequence numbers from 0 per stream. The same rows in the same order, appended again
    with the same id and epoch, are all duplicates (204): stored once."""
    appender = _Appender(client, options, producer_id, epoch)
    for row in rows:
        path, data = row["stream"], row["data"]
        if path is None:
            raise ValueError("a row without a stream path")
        if data is None:
            continue
        appender.add(path, data.encode() if isinstance(data, str) else bytes(data))
    appender.flush_all()
    appender.done.streams = len(appender.seqs)
    return appender.done


def _task() -> Any:
    context = TaskContext.get()
    if context is None:
        raise RuntimeError("not in a Spark task")
    return context


class DurableStreamsStreamWriter(DataSourceStreamWriter):
    """``writeStream``: see the module's docstring for the producer ids, epochs and sequences."""

    def __init__(self, options: WriteOptions, schema: StructType) -> None:
        _check_schema(schema)
        self.options = options

    def write(self, iterator: Iterator[Any]) -> Appended:
        context = _task()
        batch, query = (
            context.getLocalProperty("streaming.sql.batchId"),
            context.getLocalProperty("sql.streaming.queryId"),
        )
        if batch is None or query is None:
            raise RuntimeError("the streaming sink runs in a streaming query's tasks (no batch or query id)")
        producer = f"{self.options.producer_id or 'spark-' + query}-p{context.partitionId()}"
        client = Client(self.options.url, self.options.token, self.options.timeout)
        try:
            return append_rows(client, self.options, iterator, producer, int(batch))
        finally:
            client.close()

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        done = [m for m in messages if isinstance(m, Appended)]
        rows, appends = sum(m.rows for m in done), sum(m.appends for m in done)
        duplicates = sum(m.duplicates for m in done)
        log.info(
            "batch %s: %d rows, %d appends, %d duplicates (a re-run)", batchId, rows, appends, duplicates
        )

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        log.warning("batch %s aborted: its appends so far stay; its re-run stores the rest once", batchId)


class DurableStreamsWriter(DataSourceWriter):
    """``df.write`` (append mode): each task one producer (this write's id + partition),
    so a retried task stores its rows once."""

    def __init__(self, options: WriteOptions, schema: StructType) -> None:
        _check_schema(schema)
        self.options = options
        self.job = options.producer_id or f"spark-write-{uuid.uuid4()}"

    def write(self, iterator: Iterator[Any]) -> Appended:
        producer = f"{self.job}-p{_task().partitionId()}"
        client = Client(self.options.url, self.options.token, self.options.timeout)
        try:
            return append_rows(client, self.options, iterator, producer, 0)
        finally:
            client.close()


# --- The data source ---


class DurableStreamsDataSource(DataSource):
    """Durable Streams for Spark: ``spark.dataSource.register(DurableStreamsDataSource)``,
    then ``format("durable-streams")``. See the module's docstring."""

    @classmethod
    def name(cls) -> str:
        return NAME

    def schema(self) -> StructType:
        return SCHEMA

    def reader(self, schema: StructType) -> DataSourceReader:
        return DurableStreamsReader(ReadOptions.parse(self.options))

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return DurableStreamsStreamReader(ReadOptions.parse(self.options))

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        if overwrite:
            raise ValueError("streams are append-only: use mode('append')")
        return DurableStreamsWriter(WriteOptions.parse(self.options), schema)

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        if overwrite:
            raise ValueError("streams are append-only: use outputMode('append')")
        return DurableStreamsStreamWriter(WriteOptions.parse(self.options), schema)


def register(spark: Any) -> None:
    """``spark.dataSource.register(DurableStreamsDataSource)``."""
    spark.dataSource.register(DurableStreamsDataSource)
