"""The version of the key layout in Redis, and the steps from one to the next.

``keys.LAYOUT`` holds an integer: which key names and value formats the data in
this Redis uses (1: today's, ``keys.py``). A build knows the layouts up to
``CURRENT``; at start every gateway and worker reads the version (``check``):

* none yet: the first process sets it (SET NX, so concurrent starts agree):
  ``CURRENT`` on an empty Redis, ``PRE_VERSIONING`` (1) when our keys are there
  already (an install from before the marker existed);
* equal: go on;
* higher: the data was migrated by a newer build: refuse to start (an old build
  would misread it), the gateways and workers must be upgraded;
* lower: refuse to start until ``durable-streams migrate`` (``migrate`` below)
  has brought the data up: a new build must not read or write an old layout.

A layout change ships as a step in ``STEPS`` (``STEPS[v]`` turns layout v into
v + 1) and a higher ``CURRENT``. ``migrate`` runs the steps in order under a
lock (one migration at a time) and raises the version after each, so an
interrupted migration resumes at the step it was in: each step must be safe
to run again.

Those steps are *offline*: every process of the older build must be stopped first. From
layout v3 on, a change *rolls* instead (expand -> migrate -> contract, ``migration.py``): a
build reads the layouts from ``OLDEST_READ`` to ``CURRENT`` and writes the one Redis holds,
``keys.LAYOUT_OLDEST`` says which older layout may still be in the data, and the fleet
registry (``fleet.py``) tells ``migrate --finish`` when every live process reads the next one.

v1 -> v2: the stream index (``keys.STREAM_INDEX``, read by the listing) lists the
streams made before create.lua kept it.
v2 -> v3: JSON messages are stored in grouped entries and offsets minted in format 1
(``protocol/entries.py``, ``protocol/offsets.py``); subscriptions' kept offsets are rewritten.
v3 -> v4 (rolling, ``migration.ROLLING``): compacted streams' logs may have gaps where
compaction dropped messages (``COMPACTING``); nothing to rewrite.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

from redis.asyncio import RedisCluster
from redis.exceptions import WatchError

from ..protocol import offsets
from ..telemetry.logs import OneLineError
from . import keys
from .connections import Client, every_node, scan_pages
from .contracts import HASH_SWAP, INDEX_ADD, HashSwap
from .lua import source

CURRENT = 4  # the newest layout this build reads and writes
# The oldest layout this build reads (and writes, while Redis holds it): a rolling change to
# CURRENT leaves it one below, so this build runs beside the one before until the switch.
OLDEST_READ = 3
# From this layout on, compacted streams may lose messages (docs/compaction.md): the archive
# workers compact only once every live process reads the gaps that leaves (v3 -> v4 rolls).
COMPACTING = 4
PRE_VERSIONING = 1  # the layout of data written before the marker existed
LOCK_SECONDS = 60.0  # the migration lock's expiry, renewed every third of it while steps run

Step = Callable[[Client], Awaitable[object]]


async def index_streams(redis: Client) -> int:
    """List every stream in the stream index (GET __ds/streams), those made before it too.
    Returns how many were missing there."""
    added = 0
    cluster = isinstance(redis, RedisCluster)
    sha = await redis.script_load(source(INDEX_ADD.name, cluster))  # on every primary of a cluster
    async for page in scan_pages(redis, keys.META_PATTERN):
        if not page:
            continue
        async with redis.pipeline(transaction=False) as pipe:  # a page's keys in one round trip (per node)
            for key in page:
                sid = keys.key_stream_id(key.decode() if isinstance(key, bytes) else key)
                pipe.evalsha(sha, 6, *keys.stream_keys(sid), keys.stream_index(sid, cluster))
            added += sum(int(n) for n in await pipe.execute())
    return added


def _format_1(value: str) -> str:
    """A link's or a pending entry's value with its format-0 offset (if any) as minted now."""
    head, sep, token = value.partition("|")  # links: "<types>|<acked offset>|<incarnation>"
    if sep:
        token, bar, rest = token.partition("|")
        return head + sep + _format_1(token) + bar + rest
    if len(value) == 33 and value.startswith("0" * 16 + "_") and value[17:].isdigit():
        return offsets.encode(min(int(value[17:]), offsets.MAX_POSITION))
    return value


async def offsets_as_minted_now(redis: Client) -> int:
    """Offsets kept by subscriptions (links' acked offsets, pending tails) and forks' recorded
    fork offsets rewritten as minted since layout v3 (format 1, protocol/offsets.py): scripts
    compare them as strings (a fork PUT again must match its record). Layout v3 also stores a
    JSON body's messages in grouped entries (protocol/entries.py), which builds before it
    would misread: they refuse to start on it. Returns how many offsets were rewritten."""
    swapped = 0
    sha = await redis.script_load(source(HASH_SWAP.name, isinstance(redis, RedisCluster)))
    async for page in scan_pages(redis, keys.META_PATTERN):
        if not page:
            continue
        async with redis.pipeline(transaction=False) as pipe:
            for key in page:
                pipe.hget(key, "fork_off")
            forks = await pipe.execute()
        for key, value in zip(page, forks, strict=True):
            old = value.decode() if isinstance(value, bytes) else value
            if old and _format_1(old) != old:
                swapped += int(await redis.evalsha(sha, 1, key, *HashSwap("fork_off", old, _format_1(old))))
    for kind in ("l", "p"):
        async for page in scan_pages(redis, f"{keys.PREFIX}:{{subs.*}}:{kind}:*"):
            for key in page:
                found = await redis.hgetall(key)
                swaps: list[str] = []
                for field, value in found.items():
                    old = value.decode() if isinstance(value, bytes) else value
                    new = _format_1(old)
                    if new != old:
                        swaps += HashSwap(field.decode() if isinstance(field, bytes) else field, old, new)
                if swaps:
                    swapped += int(await redis.evalsha(sha, 1, key, *swaps))
    return swapped


# STEPS[v]: turns layout v into v + 1 (its docstring says what, for migrate's output).
STEPS: dict[int, Step] = {1: index_streams, 2: offsets_as_minted_now}


class Mismatch(OneLineError):
    """Redis holds a layout this build must not use: do not start."""


def _version(raw: bytes | str) -> int:
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    try:
        version = int(text)
    except ValueError:
        version = 0
    if version < 1:
        raise Mismatch(f"{keys.LAYOUT} holds {text!r}, not a key layout version (a whole number from 1)")
    return version


SCAN_PAGES = 100  # at most this many SCAN pages (of 1,000) look for keys of ours at start


async def _has_our_keys(redis: Client) -> bool:
    """Whether any key of ours is there (on any primary of a cluster). SCAN stops at the
    first one found, but on a Redis shared with many keys of others it could walk them
    all at every start: after SCAN_PAGES pages, say yes (the safe answer: at worst this
    build asks for `migrate`, it never takes old data for new)."""
    for target in await every_node(redis):
        if not await redis.dbsize(**target):
            continue
        cursor, pages = 0, 0
        while True:
            cursor, found = await redis.scan(cursor, match=f"{keys.PREFIX}:*", count=1000, **target)
            if isinstance(cursor, dict):  # a cluster's SCAN answers {node: cursor}, even for one node
                (cursor,) = cursor.values()
            for key in found:
                name = key.decode() if isinstance(key, bytes) else key
                if name not in (keys.LAYOUT, keys.LAYOUT_LOCK, keys.LAYOUT_OLDEST, keys.FLEET):
                    return True
            pages += 1
            if not cursor:
                break
            if pages >= SCAN_PAGES:
                return True
    return False


async def stamp(redis: Client, current: int = CURRENT) -> int:
    """The layout version Redis holds, first set if there is none."""
    raw = await redis.get(keys.LAYOUT)
    if raw is None:
        # While the data of installs from before the marker is today's layout, nothing to look for.
        old = current != PRE_VERSIONING and await _has_our_keys(redis)
        initial = PRE_VERSIONING if old else current
        await redis.set(keys.LAYOUT, initial, nx=True)  # a concurrent start may have set it first
        raw = await redis.get(keys.LAYOUT)
        if raw is None:  # deleted in between (someone is resetting this Redis): try at the next start
            return initial
    return _version(raw)


def verdict(
    found: int, current: int = CURRENT, *, oldest: int | None = None, oldest_read: int = OLDEST_READ
) -> str | None:
    """None when a build that reads layouts ``oldest_read``..``current`` may use a Redis
    whose data is written in layout ``found`` (and may still hold ``oldest``: a rolling
    change not finished)."""
    oldest_read = min(oldest_read, current)
    oldest = found if oldest is None else min(oldest, found)
    if found > current:
        return (
            f"Redis holds key layout v{found}; this build understands up to v{current}: "
            "upgrade the gateways/workers"
        )
    if oldest < oldest_read and found >= oldest_read:
        return (
            f"Redis still holds data of key layout v{oldest}, which this build no longer reads: "
            f"finish that change first (`durable-streams migrate --finish` of a build that reads v{oldest})"
        )
    if found < oldest_read:
        return (
            f"Redis holds key layout v{found}; this build needs v{current}: run "
            "`durable-streams migrate` (of this build) first"
        )
    return None


async def oldest_held(redis: Client, found: int) -> int:
    """The oldest layout the data may still hold: ``found`` unless a rolling change is
    under way (``keys.LAYOUT_OLDEST``)."""
    raw = await redis.get(keys.LAYOUT_OLDEST)
    return found if raw is None else min(_version(raw), found)


async def check(redis: Client, current: int = CURRENT, oldest_read: int = OLDEST_READ) -> int:
    """At start: the version Redis holds (stamped if new); Mismatch unless this build reads
    it (and whatever older layout a rolling change left in the data)."""
    found = await stamp(redis, current)
    problem = verdict(found, current, oldest=await oldest_held(redis, found), oldest_read=oldest_read)
    if problem is not None:
        raise Mismatch(problem)
    return found


async def migrate(
    redis: Client,
    say: Callable[[str], None],
    *,
    current: int = CURRENT,
    steps: Mapping[int, Step] = STEPS,
    lock_seconds: float = LOCK_SECONDS,
) -> int:
    """Bring the layout up to ``current`` with offline steps, one at a time, under the lock;
    ``say`` reports each step. Returns the version now held. Mismatch if Redis holds a newer
    layout, if a step is missing, or if another migration holds the lock."""
    found = await stamp(redis, current)
    if found > current:
        raise Mismatch(verdict(found, current) or "")
    if found == current:
        say(f"layout v{current} is current")
        return found
    async with locked(redis, lock_seconds) as token:
        found = await stamp(redis, current)  # again, under the lock: another run may have moved it
        if found > current:
            raise Mismatch(verdict(found, current) or "")
        while found < current:
            step = steps.get(found)
            if step is None:
                raise Mismatch(f"this build has no step from layout v{found} to v{found + 1}")
            say(f"layout v{found} -> v{found + 1}: {summary(step)}")
            await step(redis)
            found = await _raise_version(redis, token, found + 1)
    say(f"layout v{found} is current")
    return found


def summary(step: Callable[..., object]) -> str:
    """A step's first docstring line (or its name), for migrate's output."""
    return (step.__doc__ or step.__name__).strip().splitlines()[0]


@contextlib.asynccontextmanager
async def locked(
    redis: Client, lock_seconds: float = LOCK_SECONDS, key: str = keys.LAYOUT_LOCK, busy: str = ""
) -> AsyncIterator[str]:
    """The migration lock (one migration at a time; or another lock ``key``, Mismatch saying
    ``busy`` when held), renewed while held; its token."""
    token = uuid.uuid4().hex
    if not await redis.set(key, token, nx=True, px=int(lock_seconds * 1000)):
        raise Mismatch(busy or f"another migration is running ({key} is held); try again later")
    renewal = asyncio.create_task(_renew(redis, key, token, lock_seconds))
    try:
        yield token
    finally:
        renewal.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await renewal
        await _release(redis, key, token)


async def _raise_version(redis: Client, token: str, version: int) -> int:
    """Set the version, only while the lock is still ours (a stalled migration whose lock
    expired must not overwrite the work of the one that took over)."""
    async with redis.pipeline(transaction=True) as pipe:
        try:
            await pipe.watch(keys.LAYOUT_LOCK, keys.LAYOUT)
            held = await pipe.get(keys.LAYOUT_LOCK)
            if (held.decode() if isinstance(held, bytes) else held) != token:
                raise Mismatch("the migration lock expired during a step; run the migration again")
            if await pipe.get(keys.LAYOUT) not in (str(version - 1), str(version - 1).encode()):
                raise Mismatch("the key layout changed under the migration; run it again")
            pipe.multi()
            pipe.set(keys.LAYOUT, version)
            await pipe.execute()
        except WatchError:
            raise Mismatch("the migration lock changed hands during a step; run it again") from None
    return version


async def _renew(redis: Client, key: str, token: str, seconds: float) -> None:
    while True:
        await asyncio.sleep(seconds / 3)
        with contextlib.suppress(Exception):  # a failed renewal shows when the version is raised
            held = await redis.get(key)
            if (held.decode() if isinstance(held, bytes) else held) == token:
                await redis.pexpire(key, int(seconds * 1000))


async def _release(redis: Client, key: str, token: str) -> None:
    """Delete the lock if it is still ours."""
    with contextlib.suppress(Exception):  # it expires anyway
        async with redis.pipeline(transaction=True) as pipe:
            await pipe.watch(key)
            held = await pipe.get(key)
            if (held.decode() if isinstance(held, bytes) else held) == token:
                pipe.multi()
                pipe.delete(key)
                await pipe.execute()
