"""``durable-streams verify``: a running deployment (or a restore) compared with a backup's
manifest, every difference said.

For each stream the backup holds: it is there, the same incarnation, its bytes up to the
backup's tail the same (a digest of what catch-up reads return), its content type, floor,
TTL, closed state, producers and subscription links the same. A stream that only grew since
(appends after the backup; its producers moved on with them) is a difference with
``exact`` only (comparing a restore with its backup, nothing may differ); so is a stream the
backup does not hold. The archive files the backup's segment sets name must exist.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..archive.files import Archive
from ..protocol.errors import ProtocolError
from ..redis_io import keys
from ..redis_io.connections import Client, scan_pages
from ..streams.reads import Reads
from . import bundle, digest

Say = Callable[[str], None]
AT_ONCE = 32  # streams compared at once


async def verify_backup(
    redis: Client, reads: Reads, archive: Archive, folder: Path, exact: bool, say: Say
) -> list[str]:
    """The differences between the deployment and the backup in ``folder`` (none: it matches)."""
    manifest = bundle.read_manifest(folder)
    bundle.check_files(folder, manifest)
    problems: list[str] = []
    grew = 0
    gate = asyncio.Semaphore(AT_ONCE)

    async def one(sid: str, was: dict[str, Any]) -> None:
        nonlocal grew
        async with gate:
            found = await _compare(redis, reads, sid, was, exact)
        if found == "grew":
            grew += 1
        elif found:
            problems.append(f"{keys.path_of(sid)}: {found}")

    await asyncio.gather(*(one(sid, was) for sid, was in manifest["streams"].items()))
    problems.sort()
    if exact:
        extra = await _streams_not_in(redis, manifest["streams"])
        problems += [f"{keys.path_of(sid)}: not in the backup" for sid in extra]
    present = set(archive.files())
    missing = [f for f in manifest["archive"]["files"] if f not in present]
    problems += [f"archive file missing: {f}" for f in missing]
    for line in problems:
        say(line)
    say(
        f"verify: {len(manifest['streams'])} streams, {len(problems)} difference(s)"
        + (f", {grew} grew since the backup" if grew else "")
    )
    return problems


async def _compare(redis: Client, reads: Reads, sid: str, was: dict[str, Any], exact: bool) -> str:
    """'' same; 'grew' only appended to since; else what differs."""
    try:
        meta = await reads.head(sid)
    except ProtocolError as exc:
        return "missing" if exc.status == 404 else f"unreadable ({exc.status})"
    producers, links = keys.stream_keys(sid)[2], keys.stream_subs(sid)
    now = digest.summary(meta, await redis.hgetall(producers), await redis.hgetall(links))
    if now["created"] != was["created"]:
        return "another incarnation (deleted and created again since the backup)"
    if now["tail"] < was["tail"]:
        return f"shorter: tail {now['tail']}, the backup's {was['tail']}"
    differs = [
        f"{field} {now[field]!r}, the backup's {was[field]!r}"
        for field in ("content_type", "floor", "ttl", "expires_at", "subscriptions")
        if now[field] != was[field]
    ]
    grown = now["tail"] > was["tail"]
    for field in ("closed", "producers"):  # both move on with appends after the backup
        if now[field] != was[field] and (exact or not grown):
            differs.append(f"{field} {now[field]!r}, the backup's {was[field]!r}")
    if grown and exact:
        differs.append(f"tail {now['tail']}, the backup's {was['tail']}")
    if was.get("content") is not None:
        try:
            content = await digest.content_digest(reads, sid, was["created"], was["floor"], was["tail"])
        except digest.Changed as exc:
            content = f"unreadable ({exc})"
        if content != was["content"]:
            differs.append("its bytes up to the backup's tail differ")
    if differs:
        return "; ".join(differs)
    return "grew" if grown else ""


async def _streams_not_in(redis: Client, streams: dict[str, Any]) -> list[str]:
    extra: list[str] = []
    async for page in scan_pages(redis, keys.META_PATTERN, count=1000):
        for raw in page:
            name = raw.decode("utf-8", "surrogateescape") if isinstance(raw, bytes) else raw
            sid = keys.key_stream_id(name)
            if sid not in streams:
                extra.append(sid)
    return sorted(extra)
