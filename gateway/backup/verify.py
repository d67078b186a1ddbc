"""``durable-streams verify``: a running deployment (or a restore) compared with a backup's
manifest, every difference said.

For each stream the backup holds: it is there, the same incarnation, its bytes up to the
backup's tail the same (a digest of what catch-up reads return), its content type, floor, TTL,
closed state, producers and subscription links the same; a soft-deleted one still soft-deleted
(or gone: its forks let it go). What a live deployment does on its own since the backup is not a
difference but with ``exact`` (comparing a restore with its backup): a stream that grew (its
producers, closed state and links moving on with it), retention raising a floor, a stream whose
TTL passed, a stream the backup does not hold. Every subscription the backup holds must be
there with the same configuration (its state, links and pending deliveries move with every
delivery: compared with ``exact``), and the archive files the backup names must exist.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..archive.files import Archive
from ..protocol.errors import ProtocolError
from ..protocol.models import text
from ..redis_io import keys
from ..redis_io.connections import Client, scan_pages
from ..streams.reads import Reads
from . import Say, bundle, digest, plan

GREW, MOVED_ON = "grew", "moved on"  # (not differences, but with exact)


async def verify_backup(
    redis: Client, reads: Reads, archive: Archive, folder: Path, exact: bool, say: Say
) -> list[str]:
    """The differences between the deployment and the backup in ``folder`` (none: it matches)."""
    manifest = bundle.read_manifest(folder)
    bundle.check_files(folder, manifest)
    # First, alone: a RedisCluster client's first commands, sent at once, race its start-up
    # (redis-py: "'NoneType' object has no attribute 'writelines'"); this one starts it.
    streams, subscriptions = await _ours(redis)
    problems: list[str] = []
    counts = {GREW: 0, MOVED_ON: 0}
    todo: Iterator[tuple[str, dict[str, Any]]] = iter(manifest["streams"].items())

    async def worker() -> None:
        for sid, was in todo:
            found = await _compare(redis, reads, sid, was, exact)
            if found in counts:
                counts[found] += 1
            elif found:
                problems.append(f"{keys.path_of(sid)}: {found}")

    await asyncio.gather(*(worker() for _ in range(digest.AT_ONCE)))
    problems.sort()
    if exact:
        problems += [
            f"{keys.path_of(sid)}: not in the backup" for sid in sorted(streams - set(manifest["streams"]))
        ]
    problems += _subscriptions(subscriptions, manifest, exact)
    present = set(archive.files())
    problems += [f"archive file missing: {f}" for f in manifest["archive"]["files"] if f not in present]
    for line in problems:
        say(line)
    said = [f"{counts[GREW]} grew since the backup"] if counts[GREW] else []
    said += [f"{counts[MOVED_ON]} trimmed, expired or let go since"] if counts[MOVED_ON] else []
    say(
        f"verify: {len(manifest['streams'])} streams, {len(problems)} difference(s)"
        + "".join(f", {s}" for s in said)
    )
    return problems


def _subscriptions(now: dict[str, dict[str, str]], manifest: dict[str, Any], exact: bool) -> list[str]:
    """Each subscription the backup holds: there, configured the same (and, with ``exact``, in
    the same state); with ``exact``, none it lacks. A backup from before per-subscription
    summaries: their number, with ``exact``."""
    was: dict[str, dict[str, str]] | None = manifest.get("subscription_states")
    if was is None:
        count = manifest.get("subscriptions", len(now))
        return [f"{len(now)} subscriptions, the backup has {count}"] if exact and count != len(now) else []
    problems = []
    for sub, then in sorted(was.items()):
        found = now.get(sub)
        if found is None:
            problems.append(f"subscription {sub}: missing")
            continue
        parts = ("config", "state", "links", "pending") if exact else ("config",)
        differs = [part for part in parts if found[part] != then[part]]
        if differs:
            problems.append(f"subscription {sub}: changed ({', '.join(differs)})")
    if exact:
        problems += [f"subscription {sub}: not in the backup" for sub in sorted(set(now) - set(was))]
    return problems


async def _compare(redis: Client, reads: Reads, sid: str, was: dict[str, Any], exact: bool) -> str:
    """'' the same; GREW or MOVED_ON (what a live deployment does on its own); else what differs."""
    expired = 0 < was.get("expires_ms", -1) <= time.time() * 1000
    try:
        meta = await reads.head(sid)
    except ProtocolError as exc:
        if exc.status == 410 and was.get("deleted"):
            return ""  # soft-deleted then, soft-deleted now
        if exc.status == 404 and (expired or was.get("deleted")) and not exact:
            return MOVED_ON  # its TTL passed, or its forks let it go
        return "missing" if exc.status == 404 else f"unreadable ({exc.status})"
    if was.get("deleted"):
        return "soft-deleted in the backup, readable now"
    producers, links = keys.stream_keys(sid)[2], keys.stream_subs(sid)
    now = digest.summary(meta, await redis.hgetall(producers), await redis.hgetall(links))
    if now["created"] != was["created"]:
        return "another incarnation (deleted and created again since the backup)"
    if now["tail"] < was["tail"]:
        return f"shorter: tail {now['tail']}, the backup's {was['tail']}"
    grown, trimmed = now["tail"] > was["tail"], now["floor"] > was["floor"]
    moving = ("closed", "producers", "subscriptions") if grown else ("subscriptions",)
    differs = []
    for field in ("content_type", "floor", "ttl", "expires_at", "closed", "producers", "subscriptions"):
        if now[field] == was[field] or (not exact and (field in moving or (field == "floor" and trimmed))):
            continue
        differs.append(f"{field} {now[field]!r}, the backup's {was[field]!r}")
    if grown and exact:
        differs.append(f"tail {now['tail']}, the backup's {was['tail']}")
    if was.get("content") is not None and not trimmed:
        try:
            content = await digest.content_digest(reads, sid, was["created"], was["floor"], was["tail"])
        except digest.Changed as exc:
            content = f"unreadable ({exc})"
        if content != was["content"]:
            differs.append("its bytes up to the backup's tail differ")
    if differs:
        return "; ".join(differs)
    return GREW if grown else MOVED_ON if trimmed else ""


async def _ours(redis: Client) -> tuple[set[str], dict[str, dict[str, str]]]:
    """The streams (ids) and the subscriptions (by id: digest.subscription_summary) the
    deployment holds now."""
    streams: set[str] = set()
    states: list[str] = []
    async for page in scan_pages(redis, f"{keys.PREFIX}:{{*", count=1000):
        for raw in page:
            name = plan.key_text(raw)
            if plan.is_stream_meta(name):
                streams.add(keys.key_stream_id(name))
            elif plan.is_subscription_state(name):
                states.append(name)
    subscriptions: dict[str, dict[str, str]] = {}
    for name in states:  # (its links and pending set: the same name but the part letter)
        head, _, sub = name.partition("}:s:")
        state = await redis.hgetall(name)
        links = await redis.hgetall(f"{head}}}:l:{sub}")
        pending = await redis.hgetall(f"{head}}}:p:{sub}")
        found = state.get(b"id", state.get("id", sub))
        subscriptions[text(found)] = digest.subscription_summary(state, links, pending)
    return streams, subscriptions
