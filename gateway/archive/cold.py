"""Cold reads: the gateway reading archived entries from segment files."""

from __future__ import annotations

import asyncio
import bisect
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the row groups it loads are pyarrow's (and numpy's): archive/files.py imports
    import numpy as np  # pyarrow when a file is read, so a gateway whose reads stay in Redis
    import pyarrow as pa  # holds neither (~50 MB of RSS per process)

from ..concurrency.singleflight import SingleFlight
from ..protocol.models import Entry
from .files import Archive
from .segments import Segment, take

ANY_TIME = float("-inf")  # files never change: any load in flight will do


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
    first = max(int(loaded.positions.searchsorted(start, side="right")) - 1, 0)
    # Entries that start before start + budget, plus one (a JSON message may overrun).
    last = int(loaded.positions.searchsorted(start + max(budget, 0), side="left")) + 1
    last = min(last, first + max_entries + 1, len(loaded.positions))
    positions = loaded.positions[first:last].tolist()
    window = list(zip(positions, loaded.data.slice(first, last - first).to_pylist(), strict=True))
    return take(window, start, hi, budget, whole, max_entries)
