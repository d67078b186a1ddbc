"""The Parquet archive: its schema, its storage, and the cold reader.

The schema is defined here once: the archive worker writes it, the gateway
reads it for cold reads, the Spark job analyses it. Storage is any fsspec
URL: a local directory (the default) or e.g. ``s3://bucket/prefix`` with
s3fs installed. A file appears whole or not at all: locally it is written
aside, fsynced and renamed; object stores put objects atomically.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import io
import os
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from . import offsets
from .headers import is_text
from .segments import Entry, Segment, take
from .singleflight import SingleFlight

SCHEMA_VERSION = "1"
ANY_TIME = float("-inf")  # files never change: any load in flight will do
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
    """One log entry as the worker read it from Redis."""

    position: int
    data: bytes
    append_ms: int
    producer: tuple[str, int, int] | None = None  # id, epoch, seq


def to_table(stream: str, incarnation: str, content_type: str, rows: list[Row]) -> pa.Table:
    text = is_text(content_type)

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


class Archive:
    """Files under one root URL."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.fs, self.root = fsspec.core.url_to_fs(url)
        self.local = isinstance(self.fs, LocalFileSystem)

    def path(self, file: str) -> str:
        return f"{self.root.rstrip('/')}/{file}"

    def write(self, file: str, table: pa.Table, row_group_bytes: int = 4 << 20) -> int:
        """Write a segment file durably; returns its size in bytes. Row groups hold about
        ``row_group_bytes`` of data each: a cold read fetches and decodes one at a time."""
        data_bytes = max(1, pc.sum(pc.binary_length(table.column("data"))).as_py() or 1)
        rows = max(1, min(64 * 1024, table.num_rows * row_group_bytes // data_bytes))
        sink = io.BytesIO()
        pq.write_table(table, sink, compression="zstd", row_group_size=rows)
        data = sink.getvalue()
        path = self.path(file)
        if not self.local:
            self.fs.pipe_file(path, data)
            return len(data)
        folder, name = os.path.split(path)
        os.makedirs(folder, exist_ok=True)
        # Unique per write, not per process: two pods (both PID 1) may write one name at once
        # (a worker that lost its lease and its successor). Spark skips dot files.
        temp = os.path.join(folder, f".{name}.{uuid.uuid4().hex}.tmp")
        try:
            with open(temp, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            os.replace(temp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp)
            raise
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # the rename itself survives a crash
        finally:
            os.close(dir_fd)
        return len(data)

    def read(self, file: str, columns: list[str] | None = None) -> pa.Table:
        """A segment file's rows; FileNotFoundError when it is gone."""
        return pq.read_table(io.BytesIO(self.fs.cat_file(self.path(file))), columns=columns)

    def row_groups(self, file: str) -> list[int]:
        """The first position of each row group (rows are in position order)."""
        with self.fs.open(self.path(file), "rb") as f:
            meta = pq.ParquetFile(f).metadata
            column = meta.schema.names.index("position")
            return [meta.row_group(g).column(column).statistics.min for g in range(meta.num_row_groups)]

    def read_group(self, file: str, group: int, columns: list[str]) -> pa.Table:
        """One row group's rows; FileNotFoundError when the file is gone."""
        with self.fs.open(self.path(file), "rb") as f:
            return pq.ParquetFile(f).read_row_group(group, columns=columns)

    def delete(self, file: str) -> None:
        try:
            self.fs.rm_file(self.path(file))
        except FileNotFoundError:
            pass

    def files(self) -> list[str]:
        """Every committed-looking file (``*.parquet``, not hidden), relative to the root."""
        root = self.root.rstrip("/")
        found = self.fs.find(root) if self.fs.exists(root) else []
        names = [p[len(root) + 1 :] for p in found]
        return sorted(n for n in names if n.endswith(".parquet") and not os.path.basename(n).startswith("."))


@dataclass(frozen=True)
class _Loaded:
    positions: np.ndarray
    data: pa.Array
    nbytes: int


class ColdReader:
    """Reads entries from segment files for the gateway, one row group (~4 MiB) at a
    time, keeping recently used row groups decoded in memory (an LRU bounded in
    bytes): a catch-up reader goes through a file chunk by chunk, so each row
    group is fetched once, and the first chunk does not wait for the whole file."""

    def __init__(self, archive: Archive, cache_bytes: int) -> None:
        self.archive = archive
        self.cache_bytes = cache_bytes
        self._cache: OrderedDict[tuple[str, int], _Loaded] = OrderedDict()
        self._cached = 0
        self._groups: OrderedDict[str, list[int]] = OrderedDict()  # file -> first position per group
        self._loads: SingleFlight[Any] = SingleFlight()

    async def take(
        self, segment: Segment, start: int, hi: int | None, budget: int, whole: bool, max_entries: int
    ) -> list[Entry]:
        groups = await self._row_groups(segment.file)
        group = max(bisect.bisect_right(groups, start) - 1, 0)
        out: list[Entry] = []
        pos = start
        while group < len(groups) and budget > 0 and max_entries > 0:
            loaded = await self._load(segment.file, group)
            got = _take_from(loaded, pos, hi, budget, whole, max_entries)
            if not got:
                if whole and group + 1 < len(groups):  # a JSON read from inside this group's last message
                    group += 1
                    pos = groups[group]
                    continue
                break
            out += got
            budget -= sum(len(d) for _, d in got)
            max_entries -= len(got)
            pos = got[-1][0] + len(got[-1][1])
            group += 1
            if group < len(groups) and pos < groups[group]:
                break  # stopped inside this group: budget, entry count or ``hi``
        return out

    async def _row_groups(self, file: str) -> list[int]:
        groups = self._groups.get(file)
        if groups is None:
            groups = await self._loads.run(
                ("groups", file), lambda: asyncio.to_thread(self.archive.row_groups, file), ANY_TIME
            )
            self._groups[file] = groups
            if len(self._groups) > 10_000:
                self._groups.popitem(last=False)
        return groups

    async def _load(self, file: str, group: int) -> _Loaded:
        key = (file, group)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        loaded = await self._loads.run(key, lambda: asyncio.to_thread(self._read, file, group), ANY_TIME)
        if key not in self._cache:
            self._cache[key] = loaded
            self._cached += loaded.nbytes
            while self._cached > self.cache_bytes and len(self._cache) > 1:
                _, old = self._cache.popitem(last=False)
                self._cached -= old.nbytes
        return loaded

    def _read(self, file: str, group: int) -> _Loaded:
        table = self.archive.read_group(file, group, columns=["position", "data"])
        data = table.column("data").combine_chunks()
        positions = table.column("position").to_numpy()
        return _Loaded(positions, data, table.nbytes)


def _take_from(
    loaded: _Loaded, start: int, hi: int | None, budget: int, whole: bool, max_entries: int
) -> list[Entry]:
    """``segments.take`` over one decoded row group, converting only the rows it needs."""
    first = max(int(np.searchsorted(loaded.positions, start, side="right")) - 1, 0)
    # Entries that start before start + budget, plus one (a JSON message may overrun).
    last = int(np.searchsorted(loaded.positions, start + max(budget, 0), side="left")) + 1
    last = min(last, first + max_entries + 1, len(loaded.positions))
    positions = loaded.positions[first:last].tolist()
    window = list(zip(positions, loaded.data.slice(first, last - first).to_pylist(), strict=True))
    return take(window, start, hi, budget, whole, max_entries)
