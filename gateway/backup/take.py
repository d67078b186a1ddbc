"""``durable-streams backup``: a consistent backup of a live deployment, without stopping it.

The cut: every key of one stream (meta, log, producers, forks, links, segment sets: one hash
tag) is taken by one script (lua/backup_keys.lua), and so is every subscription's state, so
each is exactly as it was at one moment after the backup began: every append acknowledged
before ``taken_ms`` is in it; later ones may be. What links two of them (a fork and its source,
a subscription and a stream, the outboxes and schedules) is not taken at one moment: a restore
wakes every subscription and subscribed stream once, and makes every source's record of its
forks match the forks restored, to make up for that (restore.py). The
deployment's shape-dependent sorted sets (index, outboxes, schedules, hints) are read as they
are after the dumps (plan.py).

The blip: a script holds its Redis (one primary of a Cluster) while it serializes its keys,
and the calls of a round run back to back: a write to that primary waits for them, about the
time DUMP takes for what those streams hold in Redis (the archive bounds it). A round is up to
``_CALLS_PER_ROUND`` calls, fewer after one that held a large stream (about
``_BYTES_PER_ROUND`` serialized a round, by its largest; growing back at most twofold a
round); docs/operations.md, Backups, measures it.

Then each stream's bytes up to its tail at the cut are read as a catch-up read would and
digested (digest.py), for ``verify``.
"""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from ..archive.segments import Segment
from ..protocol.models import Meta, text
from ..redis_io import durability, keys
from ..redis_io.connections import Client, every_node, scan_pages, server_ms
from ..redis_io.contracts import BACKUP_KEYS, BackupKeysArgv, KeyDumped
from ..redis_io.scripts import Scripts
from ..streams.reads import Reads
from . import Say, bundle, digest, plan

_CALLS_PER_ROUND = 50  # script calls pipelined together (each one stream's or subscription's keys)
# ...and about this many bytes serialized per round: a round's calls run back to back on their
# Redis, so rounds of large streams are made smaller (the blip: docs/operations.md, Backups).
_BYTES_PER_ROUND = 8 << 20

Group = tuple[str, str | None]  # (hash tag, or a key's whole name; subscription id, or None)


async def _scan(redis: Client, say: Say) -> tuple[dict[Group, set[bytes]], dict[bytes, plan.Listed]]:
    """Our keys, dumped ones by group (a stream's together, a subscription's together, a key
    without a tag alone), listed ones apart."""
    groups: dict[Group, set[bytes]] = defaultdict(set)
    listed: dict[bytes, plan.Listed] = {}
    async for page in scan_pages(redis, "*", count=2000):
        for raw in page:
            key = raw if isinstance(raw, bytes) else raw.encode()
            if not key.startswith((b"ds:", b"{ds:")):
                continue  # (another application's, in a shared Redis)
            name = plan.key_text(key)
            try:
                name.encode()
            except UnicodeEncodeError:
                say(f"  skipped {key!r}: not a name this deployment makes")
                continue
            what = plan.kind(name)
            if isinstance(what, plan.Listed):
                listed[key] = what
            elif what is plan.Kind.DUMPED:
                tag = plan.tag_of(name)
                groups[f"{{{tag}}}" if tag is not None else name, plan.subscription_of(name)].add(key)
    return groups, listed


def _serialized(reply: Any) -> int:
    """Bytes one call serialized (its reply: value, then two more items, per key)."""
    if not isinstance(reply, list):
        return 0
    return sum(len(reply[i] or b"") for i in range(0, len(reply), 3))


def _next_round(calls: int, sizes: list[int]) -> int:
    """How many calls the next round holds: about _BYTES_PER_ROUND, sized by this round's
    largest call (the scan's order mixes small and large streams, and a mean hides a large one),
    and at most twice this round (a round of small ones says little of the next: after a round
    sized for large streams, rounds grow back 2x, 4x, ... of it)."""
    largest = max(sizes, default=0)
    fits = _BYTES_PER_ROUND // largest if largest else _CALLS_PER_ROUND
    return max(1, min(_CALLS_PER_ROUND, 2 * calls, fits))


def _with_stream_keys(tag: str, found: set[bytes]) -> list[bytes]:
    """A stream's keys as found, and every one it may have: one created between the scan and
    the dump (its producers, say) must not be missing from a dump that has what it records."""
    names = set(found)
    if any(plan.is_stream_meta(plan.key_text(k)) for k in found):
        sid = tag[1:-1]
        extra = [*keys.stream_keys(sid)[:4], keys.stream_subs(sid), keys.stream_born(sid)]
        names.update(k.encode("utf-8", "surrogatepass") for k in extra)
    return sorted(names)


def _reads(names: list[str]) -> str:
    """What the script returns besides each key's value (its ARGV 1)."""
    out = []
    for name in names:
        stream_hash = plan.is_stream_meta(name) or name.endswith(("}:prod", "}:subs"))
        stream_hash = stream_hash or plan.subscription_part(name) is not None
        out.append("z" if plan.is_segment_set(name) else "h" if stream_hash else "-")
    return "".join(out)


class _Taking:
    def __init__(self, scripts: Scripts, writer: bundle.Writer) -> None:
        self.scripts = scripts
        self.writer = writer
        self.streams: dict[str, dict[str, Any]] = {}
        self.metas: dict[str, Meta] = {}  # as dumped: the digests read from them
        self.files: set[str] = set()  # archive files the dumped segment sets name, committed
        self.subscriptions = 0
        self.calls = _CALLS_PER_ROUND  # script calls in the next round (fewer for large streams)
        self.subscription_states: dict[str, dict[str, str]] = {}  # by id: digest.subscription_summary

    async def dump(self, groups: list[list[bytes]]) -> None:
        first = 0
        while first < len(groups):
            round_ = groups[first : first + self.calls]
            first += len(round_)
            calls: list[tuple[list[str], list[Any]]] = []
            for group in round_:
                # (keys as text: the scripts' routing hashes text; Redis gets it as UTF-8 again)
                names = [plan.key_text(k) for k in group]
                calls.append((names, [*BackupKeysArgv(_reads(names))]))
            replies = await self.scripts.run_each(BACKUP_KEYS.name, calls)
            self.calls = _next_round(len(round_), [_serialized(reply) for reply in replies])
            again: list[list[bytes]] = []
            for group, reply in zip(round_, replies, strict=True):
                if isinstance(reply, BaseException):
                    raise reply
                missing = self._take(group, reply)
                if missing:
                    again.append(sorted({*group, *missing}))
            if again:  # a segment set the scan had not seen: the whole stream again, with it
                await self.dump(again)

    def _take(self, group: list[bytes], reply: list[Any]) -> list[bytes]:
        """Records of one group's dump; the summary of its stream. Returns keys it lacked."""
        dumped = [KeyDumped(*reply[i : i + 3]) for i in range(0, len(reply), 3)]
        by_name = dict(zip((plan.key_text(k) for k in group), dumped, strict=True))
        meta_name = next((n for n in by_name if plan.is_stream_meta(n)), None)
        if meta_name is not None and by_name[meta_name].payload is not None:
            sid = keys.key_stream_id(meta_name)
            fields = _fields(by_name[meta_name].fields)
            if "inc" in fields and keys.segments(sid, fields["inc"]) not in by_name:
                return [keys.segments(sid, fields["inc"]).encode("utf-8", "surrogatepass")]
            meta = Meta.parse(sid, by_name[meta_name].fields)
            producers, links = keys.stream_keys(sid)[2], keys.stream_subs(sid)
            self.metas[sid] = meta
            self.streams[sid] = digest.summary(
                meta,
                by_name[producers].fields if producers in by_name else [],
                by_name[links].fields if links in by_name else [],
                deleted=fields.get("deleted") == "1",
                expires_ms=int(by_name[meta_name].expiry),
            )
            if fields.get("snap_file"):  # an application snapshot's blob, in the archive
                self.files.add(fields["snap_file"])
        for name, item in by_name.items():
            if plan.is_segment_set(name):
                flat = item.fields
                for i in range(0, len(flat), 2):
                    if float(flat[i + 1]) >= 0:  # committed (-1 being written, -2 to delete)
                        self.files.add(Segment.parse(flat[i]).file)
            elif plan.is_subscription_state(name) and item.payload is not None:
                self.subscriptions += 1
                parts = {plan.subscription_part(n): by_name[n].fields for n in by_name}
                state = _fields(item.fields)
                self.subscription_states[state.get("id", name)] = digest.subscription_summary(
                    item.fields, parts.get("l", []), parts.get("p", [])
                )
        for key, item in zip(group, dumped, strict=True):
            if item.payload is not None:
                self.writer.add(key, int(item.expiry), item.payload)
        return []


def _fields(flat: list[Any]) -> dict[str, str]:
    return {text(flat[i]): text(flat[i + 1]) for i in range(0, len(flat), 2)}


async def _listed(redis: Client, found: dict[bytes, plan.Listed]) -> dict[str, list[list[Any]]]:
    out: dict[str, list[list[Any]]] = {family.value: [] for family in plan.Listed}
    for key, family in found.items():
        async for member, score in redis.zscan_iter(key, count=1000):
            out[family.value].append([plan.key_text(member), score])
    return out


async def bulk_limit(redis: Client) -> int | None:
    """The largest value a RESTORE may carry (``proto-max-bulk-len``; the smallest of a Cluster's
    nodes); None where CONFIG is not allowed (managed services)."""
    try:
        found = await durability.node_config(redis, "proto-max-bulk-len")
    except Exception:  # noqa: BLE001 (refused by an ACL or a managed service: not known)
        return None
    limits = [int(config["proto-max-bulk-len"]) for _, config in found if "proto-max-bulk-len" in config]
    if len(limits) < len(found):
        return None
    return min(limits) if limits else None


async def redis_version(redis: Client, **target: Any) -> str | None:
    """The Redis version ``redis`` (or the ``target_nodes`` given) runs."""
    info = await redis.info("server", **target)
    if "redis_version" not in info:  # (RedisCluster: {node: reply})
        info = next(iter(info.values()))
    version = info.get("redis_version")
    return text(version) if version else None


async def _server(redis: Client, cluster: bool) -> tuple[int, str | None]:
    """The server's clock (ms) and Redis version (of a primary, on a Cluster)."""
    target = (await every_node(redis))[0] if cluster else {}
    return await server_ms(redis, **target), await redis_version(redis, **target)


async def take_backup(
    scripts: Scripts, redis: Client, reads: Reads, folder: Path, archive_location: str, say: Say
) -> dict[str, Any]:
    """Back the deployment behind ``scripts``/``redis`` up into ``folder``; the manifest."""
    writer = bundle.Writer(folder)
    started = time.monotonic()
    taken_ms, version = await _server(redis, scripts.cluster)
    layout = await redis.get(keys.LAYOUT)
    found, listed_keys = await _scan(redis, say)
    groups = [
        _with_stream_keys(tag, found_) if tag[0] == "{" and sub is None else sorted(found_)
        for (tag, sub), found_ in found.items()
    ]
    say(f"backup: {len(groups)} streams, subscriptions and keys; {len(listed_keys)} listed sets")
    taking = _Taking(scripts, writer)
    await taking.dump(groups)
    dumped_s = time.monotonic() - started
    listed = await _listed(redis, listed_keys)
    changed = await digest.digest_all(reads, taking.streams, taking.metas, say)
    total = sum(s["tail"] - s["floor"] for s in taking.streams.values() if not s["deleted"])
    manifest = writer.finish(
        {
            "taken_ms": taken_ms,
            "finished_ms": taken_ms + int((time.monotonic() - started) * 1000),
            "source": {
                "cluster": scripts.cluster,
                "primaries": len(await every_node(redis)),
                "redis_version": version,
                "layout": int(layout) if layout is not None else None,
            },
            "archive": {"location": archive_location, "files": sorted(taking.files)},
            "streams": taking.streams,
            "subscriptions": taking.subscriptions,
            "subscription_states": taking.subscription_states,
            "stream_bytes": total,
            "changed_while_taken": changed,
            "dump_seconds": round(dumped_s, 3),
        },
        listed,
    )
    limit = await bulk_limit(redis)
    if limit is not None and manifest["largest"]["bytes"] > limit:
        say(
            f"backup: WARNING: {manifest['largest']['key']!r} serializes to {manifest['largest']['bytes']} "
            f"bytes, over this Redis' proto-max-bulk-len ({limit}): a target restores it only with a "
            "larger proto-max-bulk-len (archive workers keep streams' Redis parts far smaller)"
        )
    say(
        f"backup: {len(taking.streams)} streams ({total} bytes), {taking.subscriptions} subscriptions, "
        f"{manifest['records']} keys, {len(taking.files)} archive files named, "
        f"in {time.monotonic() - started:.1f} s: {folder}"
    )
    return manifest
