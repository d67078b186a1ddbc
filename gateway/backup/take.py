"""``durable-streams backup``: a consistent backup of a live deployment, without stopping it.

The cut: every key of one hash tag (a stream's meta, log, producers, forks, links, segment
sets; a subscription's state) is taken by one script (lua/backup_keys.lua), so each stream is
exactly as it was at one moment, after the backup began: every append acknowledged before
``taken_ms`` is in it; later ones may be. The deployment's shape-dependent sorted sets (index,
outboxes, schedules, hints) are read as they are after that (plan.py): a restore mends the
index, and the workers' passes the rest.

The blip: a script holds its Redis (one primary) while it serializes one stream's keys, so a
write to any stream on that primary waits that long: about the time DUMP takes for what the
stream holds in Redis (docs/operations.md, Backups, measures it); the archive bounds that.

Then each stream's bytes up to its tail at the cut are read as a catch-up read would and
digested (``digest.py``), for ``verify``.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..archive.segments import Segment
from ..protocol.models import Meta, text
from ..redis_io import keys
from ..redis_io.connections import Client, every_node, scan_pages
from ..redis_io.contracts import BACKUP_KEYS, KeyDumped
from ..redis_io.scripts import Scripts
from ..streams.reads import Reads
from . import bundle, digest, plan

Say = Callable[[str], None]
_CALLS_PER_ROUND = 200  # script calls pipelined together (each one tag's keys)
_DIGESTS_AT_ONCE = 32


def decoded(key: bytes | str) -> str:
    """A key's name as text, as keys.py encodes it (lone surrogates passed through); a name
    that is not UTF-8 at all (another application's, in a shared Redis) with its bytes escaped."""
    if isinstance(key, str):
        return key
    try:
        return key.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        return key.decode("utf-8", "surrogateescape")


async def _scan(redis: Client) -> tuple[dict[tuple[str, str | None], set[bytes]], dict[bytes, plan.Listed]]:
    """Our keys, dumped ones by (hash tag, subscription), listed ones apart."""
    by_tag: dict[tuple[str, str | None], set[bytes]] = defaultdict(set)
    listed: dict[bytes, plan.Listed] = {}
    async for page in scan_pages(redis, "*", count=2000):
        for raw in page:
            key = raw if isinstance(raw, bytes) else raw.encode()
            name = decoded(key)
            if not plan.ours(name):
                continue
            what = plan.kind(name)
            if isinstance(what, plan.Listed):
                listed[key] = what
            elif what is plan.Kind.DUMPED:
                # A stream's keys together; a subscription's (one group's tag holds many: all of
                # them on one Redis); a key without a tag alone.
                tag, sub = plan.tag_of(name), plan.subscription_of(name)
                by_tag[f"{{{tag}}}" if tag is not None else name, sub].add(key)
    return by_tag, listed


def _with_stream_keys(tag: str, found: set[bytes]) -> list[bytes]:
    """A stream's keys as found, and every one it may have: one created between the scan and
    the dump (its producers, say) must not be missing from a dump that has what it records."""
    names = set(found)
    if any(plan.is_stream_meta(decoded(k)) for k in found):
        sid = tag[1:-1]
        extra = [*keys.stream_keys(sid)[:4], keys.stream_subs(sid), keys.stream_born(sid)]
        names.update(k.encode("utf-8", "surrogatepass") for k in extra)
    return sorted(names)


class _Taking:
    def __init__(self, scripts: Scripts, writer: bundle.Writer) -> None:
        self.scripts = scripts
        self.writer = writer
        self.streams: dict[str, dict[str, Any]] = {}
        self.metas: dict[str, Meta] = {}  # as dumped: the digests read from them
        self.segment_sets: list[bytes] = []

    async def dump(self, groups: list[list[bytes]]) -> None:
        for first in range(0, len(groups), _CALLS_PER_ROUND):
            round_ = groups[first : first + _CALLS_PER_ROUND]
            # (keys as text: the scripts' routing hashes text; Redis gets it as UTF-8 again)
            calls: list[tuple[list[str], list[Any]]] = [([decoded(k) for k in group], []) for group in round_]
            replies = await self.scripts.run_each(BACKUP_KEYS.name, calls)
            again: list[list[bytes]] = []
            for group, reply in zip(round_, replies, strict=True):
                if isinstance(reply, BaseException):
                    raise reply
                missing = self._take(group, reply)
                if missing:
                    again.append(sorted({*group, *missing}))
            if again:  # a segment set the scan had not seen: the whole tag again, with it
                await self.dump(again)

    def _take(self, group: list[bytes], reply: list[Any]) -> list[bytes]:
        """Records of one tag's dump; the summary of its stream. Returns keys it lacked."""
        dumped = [KeyDumped(*reply[i : i + 3]) for i in range(0, len(reply), 3)]
        by_name = dict(zip((decoded(k) for k in group), dumped, strict=True))
        meta_name = next((n for n in by_name if plan.is_stream_meta(n)), None)
        if meta_name is not None and by_name[meta_name].payload is not None:
            sid = keys.key_stream_id(meta_name)
            flat = by_name[meta_name].fields
            meta = Meta.parse(sid, flat)
            inc = next((text(flat[i + 1]) for i in range(0, len(flat), 2) if text(flat[i]) == "inc"), None)
            segs = keys.segments(sid, inc) if inc else None  # (the archive's incarnation id)
            if segs is not None and segs not in by_name:
                return [segs.encode("utf-8", "surrogatepass")]
            producers, links = keys.stream_keys(sid)[2], keys.stream_subs(sid)
            self.metas[sid] = meta
            self.streams[sid] = digest.summary(
                meta,
                by_name[producers].fields if producers in by_name else [],
                by_name[links].fields if links in by_name else [],
            )
        for key, item in zip(group, dumped, strict=True):
            if item.payload is None:
                continue
            self.writer.add(key, int(item.expiry), item.payload)
            if ":segs:" in decoded(key) and decoded(key).startswith(f"{keys.PREFIX}:{{"):
                self.segment_sets.append(key)
        return []


async def _listed(redis: Client, found: dict[bytes, plan.Listed]) -> dict[str, list[list[Any]]]:
    out: dict[str, list[list[Any]]] = {family.value: [] for family in plan.Listed}
    for key, family in found.items():
        async for member, score in redis.zscan_iter(key, count=1000):
            out[family.value].append([decoded(member), score])
    return out


async def _archive_files(redis: Client, sets: list[bytes]) -> list[str]:
    """The files the backed-up segment sets name (the archive itself is not copied)."""
    files: set[str] = set()
    for key in sets:
        async for member, _ in redis.zscan_iter(key, count=1000):
            try:
                files.add(Segment.parse(member).file)
            except (ValueError, IndexError):
                continue
    return sorted(files)


async def _digests(reads: Reads, streams: dict[str, dict[str, Any]], metas: dict[str, Meta], say: Say) -> int:
    """Each stream's content digest, a few at once; one that changed meanwhile has none."""
    gate = asyncio.Semaphore(_DIGESTS_AT_ONCE)
    changed = 0

    async def one(sid: str, s: dict[str, Any]) -> None:
        nonlocal changed
        async with gate:
            try:
                s["content"] = await digest.content_digest(
                    reads, sid, s["created"], s["floor"], s["tail"], metas[sid]
                )
            except digest.Changed as exc:
                s["content"] = None
                changed += 1
                say(f"  {keys.path_of(sid)}: changed while backed up ({exc}): its bytes are not digested")

    await asyncio.gather(*(one(sid, s) for sid, s in streams.items()))
    return changed


async def take_backup(
    scripts: Scripts, redis: Client, reads: Reads, folder: Path, archive_location: str, say: Say
) -> dict[str, Any]:
    """Back the deployment behind ``scripts``/``redis`` up into ``folder``; the manifest."""
    writer = bundle.Writer(folder)
    started = time.monotonic()
    seconds, micros = await redis.time() if not scripts.cluster else await _cluster_time(redis)
    taken_ms = int(seconds) * 1000 + int(micros) // 1000
    info = await redis.info("server")
    version = info.get("redis_version") if isinstance(info, dict) and "redis_version" in info else None
    if version is None and isinstance(info, dict):  # RedisCluster: {node: info}
        version = next((v.get("redis_version") for v in info.values() if isinstance(v, dict)), None)
    layout = await redis.get(keys.LAYOUT)
    by_tag, listed_keys = await _scan(redis)
    groups = [
        _with_stream_keys(tag, found) if tag[0] == "{" and sub is None else sorted(found)
        for (tag, sub), found in by_tag.items()
    ]
    say(f"backup: {len(groups)} key groups, {len(listed_keys)} listed sets")
    taking = _Taking(scripts, writer)
    await taking.dump(groups)
    dumped_s = time.monotonic() - started
    listed = await _listed(redis, listed_keys)
    files = await _archive_files(redis, taking.segment_sets)
    changed = await _digests(reads, taking.streams, taking.metas, say)
    total = sum(s["tail"] - s["floor"] for s in taking.streams.values())
    manifest = writer.finish(
        {
            "taken_ms": taken_ms,
            "finished_ms": taken_ms + int((time.monotonic() - started) * 1000),
            "source": {
                "cluster": scripts.cluster,
                "primaries": len(await every_node(redis)),
                "redis_version": text(version) if version else None,
                "layout": int(layout) if layout is not None else None,
            },
            "archive": {"location": archive_location, "files": files},
            "streams": taking.streams,
            "stream_bytes": total,
            "changed_while_taken": changed,
            "dump_seconds": round(dumped_s, 3),
        },
        listed,
    )
    say(
        f"backup: {len(taking.streams)} streams ({total} bytes), {manifest['records']} keys, "
        f"{len(files)} archive files named, in {time.monotonic() - started:.1f} s: {folder}"
    )
    return manifest


async def _cluster_time(redis: Client) -> Any:
    (node,) = (await every_node(redis))[:1]
    reply = await redis.time(**node)
    return next(iter(reply.values())) if isinstance(reply, dict) else reply
