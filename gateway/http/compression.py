"""Streaming compressors for the content codings of --compression (protocol/encodings.py
says which answers get one). Levels chosen for speed over ratio: a catch-up read should
go at the speed of the wire, and on a realistic JSON stream (docs/benchmarks.md) zstd at
level 1 compresses ~24x at ~1 GB/s, brotli at quality 4 ~25x at ~160 MB/s and gzip at
level 1 ~14x at ~390 MB/s a core (level 6: 16x at 110 MB/s). All three release the GIL
while they work, so a large page is compressed in a thread beside the event loop."""

from __future__ import annotations

import zlib
from typing import Protocol

import brotli
import zstandard

ZSTD_LEVEL = 1
BROTLI_QUALITY = 4
GZIP_LEVEL = 1


class Compressor(Protocol):
    def compress(self, data: bytes) -> bytes: ...
    def flush(self) -> bytes: ...


class _Brotli:
    def __init__(self) -> None:
        self._c = brotli.Compressor(quality=BROTLI_QUALITY)

    def compress(self, data: bytes) -> bytes:
        return self._c.process(data)

    def flush(self) -> bytes:
        return self._c.finish()


def compressor(coding: str) -> Compressor:
    """A fresh compressor for one answer in ``coding`` (a name from config.CODINGS)."""
    if coding == "gzip":
        return zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, 16 + zlib.MAX_WBITS)  # 16+: a gzip wrapper
    if coding == "zstd":
        return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compressobj()
    if coding == "br":
        return _Brotli()
    raise ValueError(f"no compressor for {coding!r}")
