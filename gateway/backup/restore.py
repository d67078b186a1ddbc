"""``durable-streams restore``: a backup (take.py) written into an empty deployment, of the
same shape or the other (one Redis to a Cluster and back: plan.py renames what depends on it).

Nothing is written before the whole backup checked out (its seal, every part's size and
SHA-256) and the target was found empty; a restore that fails part way removes what it wrote
(``RESTORE`` without ``REPLACE`` never overwrites), so it can simply be run again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..redis_io import keys
from ..redis_io.connections import Client, scan_pages
from . import bundle, plan

Say = Callable[[str], None]
_BATCH = 500  # commands pipelined together


class NotEmpty(bundle.BackupError):
    pass


async def _ensure_empty(redis: Client, backup_layout: int | None) -> bool:
    """Refuse a target holding data of ours, or another layout stamp than the backup's.
    Returns whether it holds the stamp already (then the backup's is not written)."""
    async for page in scan_pages(redis, "*", count=1000):
        for raw in page:
            name = raw.decode("utf-8", "surrogateescape") if isinstance(raw, bytes) else raw
            if plan.holds_data(name):
                raise NotEmpty(
                    f"the target Redis holds our keys already ({name!r}, ...): restore needs an empty one"
                )
    stamp = await redis.get(keys.LAYOUT)
    if stamp is not None and int(stamp) != backup_layout:
        raise NotEmpty(
            f"the target Redis is stamped key layout v{int(stamp)}, the backup is v{backup_layout}: restore "
            "into an empty Redis, then run `durable-streams migrate`"
        )
    return stamp is not None


async def restore_backup(redis: Client, cluster: bool, folder: Path, say: Say) -> dict[str, Any]:
    """Restore the backup in ``folder`` into the empty deployment behind ``redis``."""
    started = time.monotonic()
    manifest = bundle.read_manifest(folder)
    bundle.check_files(folder, manifest)
    stamped = await _ensure_empty(redis, manifest["source"]["layout"])
    written: list[bytes] = []
    now_ms = int(time.time() * 1000)
    expired = 0
    try:
        batch: list[tuple[bytes, int, bytes]] = []
        for key, expiry, payload in bundle.records(folder, manifest):
            if 0 <= expiry <= now_ms:  # its time passed since the backup: it would be gone
                expired += 1
                continue
            name = key.decode("utf-8", "surrogateescape")
            if stamped and name == keys.LAYOUT:  # (the same stamp: _ensure_empty)
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
    except Exception:
        say(f"restore: failed after {len(written)} keys: removing them")
        await _remove(redis, written)
        raise
    # The index was read after the streams were taken: every restored stream listed in it.
    added = await _index(redis, cluster, [k for k in written if k.endswith(b"}:meta")])
    streams = len(manifest["streams"])
    say(
        f"restore: {len(written)} keys ({streams} streams, {expired} expired since the backup), "
        f"{members} listed members, {added} index entries mended, in {time.monotonic() - started:.1f} s"
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
    added, touched = 0, set()
    async with redis.pipeline(transaction=False) as pipe:
        for family in plan.Listed:
            for member, score in listed.get(family.value, []):
                key = plan.listed_key(family, member, cluster)
                if key not in touched:  # (to remove if the restore fails: the target had none)
                    touched.add(key)
                    written.append(key.encode("utf-8", "surrogatepass"))
                pipe.zadd(key, {member: score})
                added += 1
                if added % _BATCH == 0:
                    await pipe.execute()
        await pipe.execute()
    return added


async def _index(redis: Client, cluster: bool, metas: list[bytes]) -> int:
    added = 0
    for first in range(0, len(metas), _BATCH):
        async with redis.pipeline(transaction=False) as pipe:
            for meta in metas[first : first + _BATCH]:
                name = meta.decode("utf-8", "surrogateescape")
                if plan.is_stream_meta(name):
                    sid = keys.key_stream_id(name)
                    pipe.zadd(keys.stream_index(sid, cluster), {sid: 0}, nx=True)
            added += sum(int(n) for n in await pipe.execute())
    return added


async def _remove(redis: Client, written: list[bytes]) -> None:
    for first in range(0, len(written), _BATCH):
        async with redis.pipeline(transaction=False) as pipe:
            for key in written[first : first + _BATCH]:
                pipe.delete(key)
            await pipe.execute()
