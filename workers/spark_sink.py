"""The sink: ``writeStream`` and ``df.write`` append rows (``stream``, ``data``, and
optionally ``content_type``) as idempotent producers, so a retried task or re-run batch
stores its rows once, and a new batch or write is never taken for a repeat
(docs/spark-streaming.md, "The sink")."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from pyspark import TaskContext
from pyspark.sql.datasource import DataSourceStreamWriter, DataSourceWriter, WriterCommitMessage
from pyspark.sql.types import BinaryType, StringType, StructType

from gateway.protocol.errors import ProtocolError
from gateway.protocol.headers import normalize_content_type
from gateway.protocol.jsonmode import split_messages

from .spark_options import base_url, positive_int
from .streams_client import Client, StreamInfo, StreamsError, is_json

log = logging.getLogger("durable_streams.spark")  # one logger for the whole data source


@dataclass(frozen=True)
class WriteOptions:
    url: str
    token: str | None = None
    content_type: str | None = None  # create missing streams with it (rows without a content_type)
    producer_id: str | None = None  # names the producers (default: spark, spark-write-<uuid>)
    max_append_bytes: int = 1 << 20
    max_buffer_bytes: int = 32 << 20
    timeout: float = 30.0

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> WriteOptions:
        url = base_url(options)
        return cls(
            url=url,
            token=options.get("token") or None,
            content_type=options.get("contentType") or None,
            producer_id=options.get("producerId") or None,
            max_append_bytes=positive_int(options, "maxAppendBytes", 1 << 20) or 1 << 20,
            timeout=float(options.get("timeout") or 30),
        )


@dataclass
class Appended(WriterCommitMessage):
    """What one task did: appends stored, appends the server already had (retries), rows."""

    appends: int = 0
    duplicates: int = 0
    rows: int = 0
    streams: int = 0


def _check_schema(schema: StructType) -> bool:
    """Whether the rows carry a ``content_type`` (what a missing stream is created as)."""
    types = {f.name: f.dataType for f in schema.fields}
    if not isinstance(types.get("stream"), StringType):
        raise ValueError("the sink needs a string column `stream` (the stream's path under the url)")
    if not isinstance(types.get("data"), BinaryType | StringType):
        raise ValueError(
            "the sink needs a column `data`, binary or string (a JSON stream: one message a row)"
        )
    if "content_type" in types and not isinstance(types["content_type"], StringType):
        raise ValueError("the sink's column `content_type` must be a string (a media type)")
    return "content_type" in types


_epoch_lock = threading.Lock()
_last_epoch = 0


def write_epoch() -> int:
    """A new producer epoch for one ``df.write``: the clock in microseconds (below the
    protocol's 2^53 until 2255), above any this process gave before, so that each write
    under one ``producerId`` opens a new epoch, later than the last one's."""
    global _last_epoch
    with _epoch_lock:
        _last_epoch = max(time.time_ns() // 1000, _last_epoch + 1)
        return _last_epoch


class _Appender:
    """One task's appends: rows grouped per stream in row order, each group one append
    with the producer's next sequence number for that stream."""

    def __init__(
        self, client: Client, options: WriteOptions, producer_id: str, epoch: int, fenced: str
    ) -> None:
        self.client, self.options = client, options
        self.producer_id, self.epoch, self.fenced = producer_id, epoch, fenced
        self.types: dict[str, str] = {}  # the streams' content types
        self.kinds: dict[str, str] = {}  # the content type the rows for a stream carry
        self.seqs: dict[str, int] = {}
        self.pending: dict[str, list[bytes]] = {}
        self.sizes: dict[str, int] = {}
        self.buffered = 0
        self.done = Appended()

    def _type(self, path: str, items: list[bytes]) -> str:
        if path not in self.types:
            info = self.client.info(path)
            if info is None:
                info = self._create(path, items)
            kind = self.kinds.get(path)
            if kind and normalize_content_type(kind) != normalize_content_type(info.content_type):
                raise StreamsError(
                    f"{path} is {info.content_type}, its rows are {kind}: not appended (a stream's "
                    "content type is fixed when it is created)",
                    409,
                )
            self.types[path] = info.content_type
        return self.types[path]

    def _create(self, path: str, items: list[bytes]) -> StreamInfo:
        """Create a missing stream as its rows say (``content_type``), else as ``contentType``;
        rows that are not JSON texts are refused before a JSON stream is made for them."""
        content_type = self.kinds.get(path) or self.options.content_type
        if not content_type:
            raise StreamsError(
                f"{path}: no such stream (404); give the rows a content_type column, or the "
                "contentType option, to create missing streams",
                404,
            )
        if is_json(content_type):
            try:
                list(split_messages(b"[" + b",".join(items) + b"]", allow_empty_array=False))
            except ProtocolError as exc:
                raise StreamsError(
                    f"{path}: not created as {content_type}: its rows are not JSON texts ({exc}); "
                    "give the rows a content_type column (the source's rows have one)",
                    400,
                ) from None
        reply = self.client.create(path, content_type)
        if reply.status not in (200, 201):
            raise StreamsError(f"creating {path}: {reply.status} {reply.text}", reply.status)
        return StreamInfo(path, reply.header("Stream-Next-Offset") or "",
                          reply.header("Content-Type") or content_type)  # fmt: skip

    def add(self, path: str, data: bytes, content_type: str | None = None) -> None:
        if content_type:
            kind = self.kinds.setdefault(path, content_type)
            if normalize_content_type(kind) != normalize_content_type(content_type):
                raise StreamsError(f"{path}: rows of two content types ({kind}, {content_type})", 409)
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
        content_type = self._type(path, items)
        body = b"[" + b",".join(items) + b"]" if is_json(content_type) else b"".join(items)
        seq = self.seqs.get(path, 0)
        self.seqs[path] = seq + 1
        producer = (self.producer_id, self.epoch, seq)
        reply = self.client.append(path, body, content_type, producer)
        if reply.status == 404 and (self.kinds.get(path) or self.options.content_type):
            self._create(path, items)  # deleted since we looked: create it again
            reply = self.client.append(path, body, content_type, producer)
        if reply.status in (200, 201):
            self.done.appends += 1
        elif reply.status == 204:
            self.done.duplicates += 1
        elif reply.status == 403 and reply.header("Producer-Epoch"):
            raise StreamsError(
                f"{path}: producer {self.producer_id} epoch {self.epoch} is fenced by epoch "
                f"{reply.header('Producer-Epoch')}: {self.fenced}",
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
    client: Client,
    options: WriteOptions,
    rows: Iterable[Any],
    producer_id: str,
    epoch: int,
    *,
    typed: bool = False,
    fenced: str = "a later epoch of this producer already wrote there",
) -> Appended:
    """Append rows (``stream``, ``data``; ``content_type`` too when ``typed``) as producer
    ``producer_id`` in ``epoch``, sequence numbers from 0 per stream. The same rows in the
    same order, appended again with the same id and epoch, are all duplicates (204):
    stored once. ``fenced``: why a later epoch could be there (the 403's message)."""
    appender = _Appender(client, options, producer_id, epoch, fenced)
    for row in rows:
        path, data = row["stream"], row["data"]
        if path is None:
            raise ValueError("a row without a stream path")
        if data is None:
            continue
        kind = row["content_type"] if typed else None
        appender.add(path, data.encode() if isinstance(data, str) else bytes(data), kind)
    appender.flush_all()
    appender.done.streams = len(appender.seqs)
    return appender.done


def _task() -> Any:
    context = TaskContext.get()
    if context is None:
        raise RuntimeError("not in a Spark task")
    return context


class DurableStreamsStreamWriter(DataSourceStreamWriter):
    """``writeStream``: the producer ids, epochs and sequences are in docs/spark-streaming.md."""

    def __init__(self, options: WriteOptions, schema: StructType) -> None:
        self.typed = _check_schema(schema)
        self.options = options

    def write(self, iterator: Iterator[Any]) -> Appended:
        context = _task()
        batch, query = (
            context.getLocalProperty("streaming.sql.batchId"),
            context.getLocalProperty("sql.streaming.queryId"),
        )
        if batch is None or query is None:
            raise RuntimeError("the streaming sink runs in a streaming query's tasks (no batch or query id)")
        # The query id (kept in the checkpoint) in every producer id: batch ids, the epochs,
        # start again at 0 in a new checkpoint, which must not meet the old one's epochs.
        producer = f"{self.options.producer_id or 'spark'}-{query}-p{context.partitionId()}"
        client = Client(self.options.url, self.options.token, self.options.timeout)
        try:
            return append_rows(client, self.options, iterator, producer, int(batch), typed=self.typed,
                               fenced="a later batch of this query already wrote there (two runs of "
                               "one checkpoint at once?)")  # fmt: skip
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
    """``df.write`` (append mode): each task one producer (``producerId`` or this write's
    own id, + partition) in this write's epoch, chosen here, on the driver, once: a retried
    task sends what its first attempt sent (stored once), the next write opens a new epoch."""

    def __init__(self, options: WriteOptions, schema: StructType) -> None:
        self.typed = _check_schema(schema)
        self.options = options
        self.job = options.producer_id or f"spark-write-{uuid.uuid4()}"
        self.epoch = write_epoch()

    def write(self, iterator: Iterator[Any]) -> Appended:
        producer = f"{self.job}-p{_task().partitionId()}"
        client = Client(self.options.url, self.options.token, self.options.timeout)
        try:
            return append_rows(client, self.options, iterator, producer, self.epoch, typed=self.typed,
                               fenced="a write that started later under this producerId already wrote "
                               "there (two writes at once, or this driver's clock is behind)")  # fmt: skip
        finally:
            client.close()
