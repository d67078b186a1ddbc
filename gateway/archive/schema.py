"""The archive's Parquet schema, defined once: the archive worker writes it, the
gateway's cold reader reads it, the Spark job (``workers/analytics.py``) analyses it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from ..protocol import offsets
from ..protocol.entries import messages
from ..protocol.headers import JSON_CONTENT_TYPE, is_text, normalize_content_type

SCHEMA_VERSION = "1"
SCHEMA = pa.schema(
    [
        pa.field("stream", pa.string(), nullable=False),  # the stream's path
        pa.field("incarnation", pa.string(), nullable=False),  # differs once a path is deleted and reused
        pa.field("offset", pa.string(), nullable=False),  # the entry's Stream offset
        pa.field("next_offset", pa.string(), nullable=False),  # the offset after it
        pa.field("position", pa.int64(), nullable=False),  # byte position the offset names
        pa.field("content_type", pa.string(), nullable=False),
        pa.field("data", pa.binary(), nullable=False),  # the bytes as appended (a JSON stream: one message)
        pa.field("text", pa.string()),  # UTF-8 text of text/* and JSON streams, else null
        pa.field("append_time", pa.timestamp("ms", tz="UTC"), nullable=False),
        pa.field("producer_id", pa.string()),  # idempotent producer headers, when the append had them
        pa.field("producer_epoch", pa.int64()),
        pa.field("producer_seq", pa.int64()),
    ],
    metadata={"durable_streams.schema_version": SCHEMA_VERSION},
)


@dataclass(frozen=True)
class Row:
    """One log entry as the worker read it from Redis (a JSON stream's: one or more
    messages, see protocol/entries.py; a file holds one row per message)."""

    position: int
    data: bytes
    append_ms: int
    producer: tuple[str, int, int] | None = None  # id, epoch, seq
    size: int = -1  # the positions it takes (-1: its length; less for a group of messages)

    @property
    def end(self) -> int:
        return self.position + (len(self.data) if self.size < 0 else self.size)

    def messages(self) -> list[Row]:
        """A JSON entry's messages, one row each."""
        split = messages(self.position, self.data)
        return [Row(pos, data, self.append_ms, self.producer) for pos, data in split]


def to_table(stream: str, incarnation: str, content_type: str, rows: list[Row]) -> pa.Table:
    text = is_text(content_type)
    if normalize_content_type(content_type) == JSON_CONTENT_TYPE:
        rows = [message for row in rows for message in row.messages()]

    def decoded(data: bytes) -> str | None:
        try:
            return data.decode() if text else None
        except UnicodeDecodeError:
            return None

    columns: dict[str, Any] = {
        "stream": [stream] * len(rows),
        "incarnation": [incarnation] * len(rows),
        "offset": [offsets.encode(r.position) for r in rows],
        "next_offset": [offsets.encode(r.position + len(r.data)) for r in rows],
        "position": [r.position for r in rows],
        "content_type": [content_type] * len(rows),
        "data": [r.data for r in rows],
        "text": [decoded(r.data) for r in rows],
        "append_time": [r.append_ms for r in rows],
        "producer_id": [r.producer[0] if r.producer else None for r in rows],
        "producer_epoch": [r.producer[1] if r.producer else None for r in rows],
        "producer_seq": [r.producer[2] if r.producer else None for r in rows],
    }
    return pa.table(columns, schema=SCHEMA)
