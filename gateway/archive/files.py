"""The archive's files: Parquet segment files under one root URL.

Storage is any fsspec URL: a local directory (the default) or e.g.
``s3://bucket/prefix`` with s3fs installed. A file appears whole or not at
all: locally it is written aside, fsynced and renamed; object stores put
objects atomically.
"""

from __future__ import annotations

import contextlib
import io
import os
import uuid
from typing import TYPE_CHECKING

import fsspec
from fsspec.implementations.local import LocalFileSystem

if TYPE_CHECKING:
    import pyarrow as pa

# pyarrow is imported where Parquet is read or written, not with this module: a gateway
# whose reads never reach the archive (most) does without its ~50 MB of RSS per process.


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
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        data_bytes = max(1, pc.sum(pc.binary_length(table.column("data"))).as_py() or 1)
        rows = max(1, min(64 * 1024, table.num_rows * row_group_bytes // data_bytes))
        sink = io.BytesIO()
        pq.write_table(table, sink, compression="zstd", row_group_size=rows)
        data = sink.getvalue()
        self.put(file, data)
        return len(data)

    def put(self, file: str, data: bytes) -> None:
        """Write ``data`` as ``file``, durably and whole (see the module)."""
        path = self.path(file)
        if not self.local:
            self.fs.pipe_file(path, data)
            return
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

    def get(self, file: str) -> bytes:
        """A file's bytes; FileNotFoundError when it is gone."""
        return bytes(self.fs.cat_file(self.path(file)))

    def read(self, file: str, columns: list[str] | None = None) -> pa.Table:
        """A segment file's rows; FileNotFoundError when it is gone."""
        import pyarrow.parquet as pq

        return pq.read_table(io.BytesIO(self.fs.cat_file(self.path(file))), columns=columns)

    def row_groups(self, file: str) -> list[int]:
        """The first position of each row group (rows are in position order)."""
        import pyarrow.parquet as pq

        with self.fs.open(self.path(file), "rb") as f:
            meta = pq.ParquetFile(f).metadata
            if meta.num_rows == 0:  # (State compaction dropped every message of its segment)
                return []
            column = meta.schema.names.index("position")
            return [meta.row_group(g).column(column).statistics.min for g in range(meta.num_row_groups)]

    def read_group(self, file: str, group: int, columns: list[str]) -> pa.Table:
        """One row group's rows; FileNotFoundError when the file is gone."""
        import pyarrow.parquet as pq

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
