"""The rows the data source reads (``SCHEMA``, documented in docs/spark-streaming.md), built
as Arrow record batches: much cheaper for Spark than tuples."""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import BinaryType, StringType, StructField, StructType, TimestampType

from .streams_client import Piece

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


@dataclass
class Columns:
    """One record batch of rows (``SCHEMA``) being gathered, column by column."""

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
