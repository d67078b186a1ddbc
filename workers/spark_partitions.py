"""A read's partitions: planned from a batch's offsets on the driver, read on the
executors (one task reads its streams' spans one after the other)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import pyarrow as pa
from pyspark.sql.datasource import InputPartition

from .spark_options import ReadOptions
from .spark_plan import Span, pack, spans
from .spark_rows import Columns
from .streams_client import read_range


class StreamSpans(InputPartition):
    """A partition: streams' spans (path, start, end, incarnation) read one after the
    other by one task."""

    def __init__(self, items: list[Span]) -> None:
        self.spans = [(s.path, s.start, s.end, s.created) for s in items]
        super().__init__(self.spans)


def plan_partitions(
    start: Mapping[str, str], end: Mapping[str, str], options: ReadOptions, streaming: bool = True
) -> list[StreamSpans]:
    """A batch's partitions, from its offsets alone (``spans``, ``pack``)."""
    return [StreamSpans(group) for group in pack(spans(start, end, streaming), options.partition_bytes)]


def read_spans(
    options: ReadOptions, items: Iterable[tuple[str, str, str, str | None]]
) -> Iterator[pa.RecordBatch]:
    """A partition's rows, as Arrow record batches (much cheaper than tuples)."""
    client = options.client()
    try:
        columns = Columns()
        for path, begin, stop, created in items:
            for piece in read_range(client, path, begin, stop, created):
                columns.add(path, piece)
                if columns.full():
                    yield columns.batch()
                    columns = Columns()
        if columns.stream:
            yield columns.batch()
    finally:
        client.close()


def read_partition(options: ReadOptions, partition: InputPartition) -> Iterator[pa.RecordBatch]:
    """A partition's rows, for either reader's ``read``."""
    # No streams: Spark plans one partition of its own (InputPartition(None)).
    return read_spans(options, partition.spans if isinstance(partition, StreamSpans) else [])
