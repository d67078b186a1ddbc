"""Application snapshots (Ursula's ``/{bucket}/{stream}/snapshot/{offset}``): the blob in
the archive store (files or S3, where the Parquet segments live: large blobs do not
belong in Redis memory), its record in the stream's meta hash (``snap``, ``snap_ct``,
``snap_file``), set by snapshot_set.lua.

Publishing writes the blob first, under a name of its own (``_snapshots/<stream
digest>/<incarnation>-<position>-<random>``: a retry never overwrites a published blob,
and ``_`` keeps Spark and the archiver's file scans away), then records it in one
script, which also raises the stream's floor to it; the blob it replaces is removed
after. A publish the script refuses removes its own blob. Only the latest snapshot is
kept (Ursula's: older ones are gone once replaced).

Known gap: the blob of a stream that expires, or is deleted while forks still read it
(soft delete), stays in the store (an explicit delete of a live stream removes it).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid
from dataclasses import dataclass

from ..archive.files import Archive
from ..protocol import tenants
from ..protocol.errors import ProtocolError
from ..protocol.models import text
from ..redis_io import keys
from ..redis_io.contracts import SNAPSHOT_SET, SnapshotSet, SnapshotSetArgv, status_of
from ..redis_io.outcomes import not_found
from ..redis_io.scripts import Scripts
from ..telemetry.logs import RateLimited

log = logging.getLogger(__name__)
limited = RateLimited(log)


@dataclass(frozen=True)
class Snapshot:
    position: int
    content_type: str
    file: str


@dataclass(frozen=True)
class State:
    """What a snapshot read needs of its stream (from its meta hash)."""

    tail: int
    closed: bool
    created: str
    snapshot: Snapshot | None


class Snapshots:
    def __init__(self, scripts: Scripts, archive: Archive) -> None:
        self.scripts = scripts
        self.archive = archive

    async def state(self, sid: str) -> State:
        """The stream's tail, closure and latest snapshot; 404 when there is no stream."""
        meta = keys.stream_keys(sid)[0]
        fields = ("created", "tail", "closed", "deleted", "exp", "snap", "snap_ct", "snap_file")
        raw = await self.scripts.command(meta, "HMGET", meta, *fields)
        found = dict(zip(fields, (None if v is None else text(v) for v in raw), strict=True))
        expired = found["exp"] is not None and int(found["exp"]) <= time.time() * 1000
        if found["created"] is None or found["deleted"] or expired:
            raise not_found("missing")
        snapshot = None
        if found["snap"] is not None:
            snapshot = Snapshot(int(found["snap"]), found["snap_ct"] or "", found["snap_file"] or "")
        return State(int(found["tail"] or 0), found["closed"] == "1", found["created"], snapshot)

    async def publish(self, sid: str, position: int, content_type: str, data: bytes, tenant: str = "") -> int:
        """Store a snapshot at ``position``; returns the stream's tail. 404 no stream,
        409 stale (a snapshot at or after it exists) or beyond the tail, 410 below what
        is retained, 403 another ``tenant``'s stream."""
        state = await self.state(sid)
        digest = hashlib.sha256(sid.encode("utf-8", "surrogatepass")).hexdigest()[:32]
        file = f"_snapshots/{digest}/{state.created}-{position}-{uuid.uuid4().hex}.snapshot"
        await asyncio.to_thread(self.archive.put, file, data)
        try:
            result = await self.scripts.on_stream(
                SNAPSHOT_SET.name, sid, *SnapshotSetArgv(state.created, position, content_type, file, tenant)
            )
        except Exception:
            # Unanswered: it may have been recorded. Its blob goes only if it surely was not
            # (a stray file at worst, never a record naming a removed blob).
            recorded = await self._recorded(sid)
            if recorded == file:
                return state.tail
            if recorded is not None:
                await self._remove(file)
            raise
        status = status_of(result)
        if status != "ok":
            await self._remove(file)
            if status in ("missing", "gone"):
                raise not_found(status)
            if status == "foreign":
                raise tenants.foreign()
            detail = {"stale": "a snapshot at or after this offset exists", "range": "offset beyond the tail"}
            if status == "trimmed":
                raise ProtocolError(410, "offset below the data still retained")
            raise ProtocolError(409, detail[status])
        done = SnapshotSet(*result)
        if text(done.replaced):
            await self._remove(text(done.replaced))
        return int(text(done.tail)) if done.tail is not None else state.tail

    async def _recorded(self, sid: str) -> str | None:
        """The blob file the stream's meta names now ('' none); None when that cannot be learned."""
        meta = keys.stream_keys(sid)[0]
        try:
            raw = await self.scripts.command(meta, "HGET", meta, "snap_file")
        except Exception:
            return None
        return "" if raw is None else text(raw)

    async def blob(self, snapshot: Snapshot) -> bytes | None:
        """The blob's bytes; None when it was replaced (and removed) meanwhile."""
        try:
            return await asyncio.to_thread(self.archive.get, snapshot.file)
        except FileNotFoundError:
            return None

    async def forget(self, file: str) -> None:
        """Remove a deleted stream's snapshot blob."""
        await self._remove(file)

    async def _remove(self, file: str) -> None:
        """Best effort: the answer about the snapshot (or the stream) stands; a blob left
        behind is a stray file, logged."""
        try:
            await asyncio.to_thread(self.archive.delete, file)
        except Exception as exc:
            limited.log(logging.WARNING, "snapshot-blob", "snapshot blob %s not removed: %s", file, exc)
