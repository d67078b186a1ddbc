"""``durable-streams restore``: a backup (take.py) written into an empty deployment, of the
same shape or the other (one Redis to a Cluster and back: plan.py renames what depends on it).

Nothing is written before the whole backup checked out (its seal, every part's size and
SHA-256), the target was found empty, with no worker running on it and a Redis as new as the
backup's (DUMP payloads do not load into an older one). A restore stopped part way (an error,
Ctrl-C, SIGTERM) removes what it wrote (``RESTORE`` without ``REPLACE`` never overwrites), so it
can simply be run again; one killed outright leaves keys: empty the target, then run it again.

Then every restored stream is listed in the index, and every subscription and subscribed stream
is due at once: the links between them, their outboxes and schedules were not taken at one
moment (take.py), and a wake too many costs a delivery worker one look.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ..protocol.models import text
from ..redis_io import fleet, keys, layout
from ..redis_io.connections import Client, scan_pages, version
from ..streams.forks import Forks
from . import Say, bundle, plan
from .take import bulk_limit, redis_version

_BATCH = 500  # commands pipelined together


class NotEmpty(bundle.BackupError):
    pass


async def _unfinished(redis: Client, seal: str, say: Say) -> None:
    """A restore of this backup killed outright (SIGKILL, OOM) left its marker and what it
    wrote on a target that was empty (it checked): remove that, so this run starts clean. A
    marker of another backup: refuse (that target is not ours to empty)."""
    marker = await redis.get(keys.RESTORING)
    if marker is None:
        return
    if text(marker) != seal:
        raise NotEmpty(
            "the target holds a restore of another backup that did not finish "
            f"({keys.RESTORING}: {text(marker)[:12]}...): empty the target first"
        )
    leftover = [
        raw if isinstance(raw, bytes) else raw.encode("utf-8", "surrogatepass")
        async for page in scan_pages(redis, "*", count=1000)
        for raw in page
        if plan.holds_data(plan.key_text(raw)) or plan.key_text(raw) == keys.LAYOUT
    ]
    say(f"restore: a restore of this backup did not finish here: removing the {len(leftover)} keys it wrote")
    await _remove(redis, leftover)
    await redis.delete(keys.RESTORING)


async def _nobody_running(redis: Client) -> None:
    """Refuse a target with a gateway or worker running on it (before anything is removed)."""
    for alive, who in ((keys.ARCHIVE_WORKER_ALIVE, "archive"), (keys.SUBS_WORKER_ALIVE, "delivery")):
        if await redis.exists(alive):
            raise NotEmpty(
                f"{who} workers run on the target: stop them (and the gateways) while it is restored"
            )
    running = await fleet.members(redis)
    if running:
        raise NotEmpty(
            f"{len(running)} gateway(s)/worker(s) run on the target ({running[0].describe()}, ...; "
            "`durable-streams fleet` lists them): stop them while it is restored"
        )


async def _check_target(redis: Client, manifest: dict[str, Any]) -> bool:
    """Refuse a target holding data of ours, another layout stamp than the backup's, an older
    Redis, or one that cannot take the backup's largest value. Returns whether it is stamped
    already (the backup's stamp is then not written)."""
    async for page in scan_pages(redis, "*", count=1000):
        for raw in page:
            name = plan.key_text(raw)
            if plan.holds_data(name):
                raise NotEmpty(
                    f"the target Redis holds data of ours ({name!r}, ...): restore needs an empty one"
                )
    stamp, source = await redis.get(keys.LAYOUT), manifest["source"]
    if stamp is not None and int(stamp) != source["layout"]:
        raise NotEmpty(
            f"the target Redis is stamped key layout v{int(stamp)}, the backup is v{source['layout']}: "
            "restore into an empty Redis, then run `durable-streams migrate`"
        )
    largest, limit = manifest.get("largest", {}), await bulk_limit(redis)
    if limit is not None and largest.get("bytes", 0) > limit:
        raise NotEmpty(
            f"the backup holds a value of {largest['bytes']} bytes ({largest['key']!r}), over the target's "
            f"proto-max-bulk-len ({limit}): raise it on the target (CONFIG SET proto-max-bulk-len) first"
        )
    mine = await redis_version(redis) or "0"
    if source.get("redis_version") and version(mine) < version(source["redis_version"]):
        raise NotEmpty(f"the target runs Redis {mine}, the backup was taken from {source['redis_version']}: "
                       "its values load only into a Redis as new or newer")  # fmt: skip
    return stamp is not None


async def restore_backup(
    redis: Client, forks: Forks, cluster: bool, folder: Path, say: Say
) -> dict[str, Any]:
    """Restore the backup in ``folder`` into the empty deployment behind ``redis``
    (``forks``: the fork records' rules, on the same deployment's scripts)."""
    started = time.monotonic()
    manifest = bundle.read_manifest(folder)
    bundle.check_files(folder, manifest)
    seal = (folder / bundle.SEAL).read_text().strip()
    await _nobody_running(redis)
    busy = "another restore is running into this target"
    try:
        async with layout.locked(redis, 30.0, keys.RESTORING_LEASE, busy):
            return await _restore_all(redis, forks, cluster, folder, manifest, seal, say, started)
    except layout.Mismatch as exc:
        raise NotEmpty(str(exc)) from None


async def _restore_all(
    redis: Client, forks: Forks, cluster: bool, folder: Path, manifest: dict[str, Any], seal: str, say: Say,
    started: float,
) -> dict[str, Any]:  # fmt: skip
    await _unfinished(redis, seal, say)
    stamped = await _check_target(redis, manifest)
    await redis.set(keys.RESTORING, seal)  # (gateways and workers refuse to start while it is there)
    written: list[bytes] = []
    now_ms = int(time.time() * 1000)
    expired = 0
    try:
        batch: list[tuple[bytes, int, bytes]] = []
        for key, expiry, payload in bundle.records(folder, manifest):
            if 0 <= expiry <= now_ms:  # its time passed since the backup: it would be gone
                expired += 1
                continue
            name = plan.key_text(key)
            if stamped and name == keys.LAYOUT:  # (the same stamp: _check_target)
                continue
            target = plan.restored_name(name, cluster)
            batch.append(
                (key if target == name else target.encode("utf-8", "surrogatepass"), expiry, payload)
            )
            if len(batch) >= _BATCH:
                await _restore(redis, batch, written)
                batch = []
        await _restore(redis, batch, written)
        members = await _add_listed(redis, cluster, bundle.listed(folder), written)
        await reconcile_forks(redis, forks, written, say)
        listed, woken = await _mend(redis, cluster, manifest, written, now_ms)
    except BaseException:  # (Ctrl-C and SIGTERM too: asyncio cancels)
        say(f"restore: stopped after {len(written)} keys: removing them")
        await _remove(redis, written)
        await redis.delete(keys.RESTORING)
        raise
    await redis.delete(keys.RESTORING)
    streams = len(manifest["streams"])
    say(
        f"restore: {len(written)} keys ({streams} streams, {expired} keys expired since the backup), "
        f"{members} listed members, {listed} streams listed, {woken} subscriptions and streams due, "
        f"in {time.monotonic() - started:.1f} s"
    )
    return {"keys": len(written), "expired": expired, "streams": streams}


async def _restore(redis: Client, batch: list[tuple[bytes, int, bytes]], written: list[bytes]) -> None:
    """RESTORE a batch of records; their keys noted first (removed again if it fails)."""
    if not batch:
        return
    written += [key for key, _, _ in batch]
    async with redis.pipeline(transaction=False) as pipe:
        for key, expiry, payload in batch:
            if expiry > 0:
                pipe.restore(key, expiry, payload, absttl=True)
            else:
                pipe.restore(key, 0, payload)
        await pipe.execute()


async def _add_listed(
    redis: Client, cluster: bool, listed: dict[str, list[list[Any]]], written: list[bytes]
) -> int:
    adds = [
        (plan.listed_key(family, member, cluster), member, score)
        for family in plan.Listed
        for member, score in listed.get(family.value, [])
    ]
    await _zadd(redis, adds, written)
    return len(adds)


async def reconcile_forks(redis: Client, forks: Forks, written: list[bytes], say: Say) -> None:
    """Streams are taken one at a time: a fork made or deleted while the backup ran can leave a
    source counting a fork the backup lacks (it would never be collected) or a pinning fork
    its source does not count (the source could be collected under it). Each source's record
    is made to match the forks restored, as the gateway's own rules do (``Forks``)."""
    names = {plan.key_text(key) for key in written}
    restored = {keys.key_stream_id(name) for name in names if plan.is_stream_meta(name)}
    for sid in sorted(restored):
        record = keys.stream_keys(sid)[3]
        if record not in names:
            continue
        uid = text(await redis.hget(keys.stream_keys(sid)[0], "uid") or b"")
        for member in sorted(text(m) for m in await redis.smembers(record)):
            await forks.release_unless_forked(member, sid, uid)  # (may collect a soft-deleted source)
    for sid in sorted(restored):
        src, src_uid, weak = await redis.hmget(keys.stream_keys(sid)[0], "src", "src_uid", "weak")
        if src is None or weak is not None:
            continue
        source = text(src)
        there = await redis.exists(keys.stream_keys(source)[0])
        present = await redis.hget(keys.stream_keys(source)[0], "uid")
        if not there or (src_uid is not None and present != src_uid):
            say(f"restore: fork {sid!r}: its source {source!r} was deleted while the backup ran (and it "
                "after it was taken): what it inherits answers 410: delete it")  # fmt: skip
        elif not await redis.sismember(keys.stream_keys(source)[3], sid):
            await redis.sadd(keys.stream_keys(source)[3], sid)


async def _mend(
    redis: Client, cluster: bool, manifest: dict[str, Any], written: list[bytes], now_ms: int
) -> tuple[int, int]:
    """Every restored stream in the index (soft-deleted ones are not listed), every
    subscription and subscribed stream due now. Returns how many of each."""
    index: list[tuple[str, str, float]] = []
    wake: list[tuple[str, str, float]] = []
    streams = manifest["streams"]
    for key in list(written):
        name = plan.key_text(key)
        if plan.is_stream_meta(name):
            sid = keys.key_stream_id(name)
            if not streams.get(sid, {}).get("deleted"):
                index.append((keys.stream_index(sid, cluster), sid, 0))
        elif name.endswith("}:subs") and name == keys.stream_subs(keys.key_stream_id(name)):
            sid = keys.key_stream_id(name)
            wake.append((keys.subs_outbox(sid, cluster), sid, now_ms))
        elif plan.is_subscription_state(name):
            sub = (await redis.hget(key, "id")) or b""
            if sub:
                wake.append((keys.sub_keys(plan.key_text(sub), cluster)[3], plan.key_text(sub), now_ms))
    await _zadd(redis, index + wake, written)
    return len(index), len(wake)


async def _zadd(redis: Client, adds: list[tuple[str, str, float]], written: list[bytes]) -> None:
    """ZADD NX each (key, member, score); the keys noted (the target had none of them)."""
    seen = set(written)
    for first in range(0, len(adds), _BATCH):
        async with redis.pipeline(transaction=False) as pipe:
            for key, member, score in adds[first : first + _BATCH]:
                raw = key.encode("utf-8", "surrogatepass")
                if raw not in seen:
                    seen.add(raw)
                    written.append(raw)
                pipe.zadd(key, {member: score}, nx=True)
            await pipe.execute()


async def _remove(redis: Client, written: list[bytes]) -> None:
    for first in range(0, len(written), _BATCH):
        async with redis.pipeline(transaction=False) as pipe:
            for key in written[first : first + _BATCH]:
                pipe.delete(key)
            await pipe.execute()
