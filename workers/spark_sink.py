"""The sink: ``writeStream`` and ``df.write`` append rows (``stream``, ``data``) as
idempotent producers, so a retried task or re-run batch stores its rows once
(docs/spark-streaming.md, "Exactly once")."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from pyspark import TaskContext
from pyspark.sql.datasource import DataSourceStreamWriter, DataSourceWriter, WriterCommitMessage
from pyspark.sql.types import BinaryType, StringType, StructType

from .spark_options import base_url, positive_int
from .streams_client import Client, StreamInfo, StreamsError, is_json

log = logging.getLogger("durable_streams.spark")  # one logger for the whole data source


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
    """``writeStream``: the producer ids, epochs and sequences are in docs/spark-streaming.md."""

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
