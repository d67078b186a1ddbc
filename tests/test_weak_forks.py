"""Weak forks (``CreateSpec.pin_source=False``), through the Store: a fork made by
someone who may only read its source never blocks the source's path. The source
is deleted (or expires) as if unforked; the weak fork keeps its own data, and its
reads of what it inherited answer 410, never another stream's data. Pinning forks
keep the protocol's semantics (soft delete, 409 on re-create), weak forks or not.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from gateway.archive.cold import ColdReader
from gateway.archive.files import Archive
from gateway.protocol import offsets
from gateway.protocol.errors import ProtocolError
from gateway.protocol.headers import Expiry
from gateway.protocol.models import CreateSpec, Meta
from gateway.redis_io import keys
from gateway.redis_io.scripts import Scripts
from gateway.streams.forks import Forks
from gateway.streams.reads import Reads
from gateway.streams.store import Store

TEXT = "text/plain"


@pytest.fixture(params=["inline", "bulk"])
async def store(request: pytest.FixtureRequest, redis: aioredis.Redis, tmp_path) -> AsyncIterator[Store]:
    """A Store as the app builds one; "bulk": byte reads past 0 bytes take the XRANGE path."""
    cold = ColdReader(Archive(str(tmp_path / "archive")), 1 << 20)
    inline = 1 << 20 if request.param == "inline" else 0
    scripts = Scripts(redis)
    yield Store(scripts, cold, max_chunk_bytes=1000, read_inline_bytes=inline)
    await scripts.close_held()  # (the client is the fixture's)


def parts(redis: aioredis.Redis, tmp_path) -> tuple[Scripts, Reads, Forks]:
    """The Store's parts on their own, for the steps its verbs do not expose."""
    scripts = Scripts(redis)
    reads = Reads(scripts, ColdReader(Archive(str(tmp_path / "archive")), 1 << 20), 1000, 0)
    return scripts, reads, Forks(scripts, reads, 1000)


def name() -> str:
    return keys.stream_id(f"weak-{uuid.uuid4().hex[:10]}")


async def make(
    store: Store, sid: str, *data: bytes, content_type: str = TEXT, ttl_seconds: int | None = None
) -> Meta:
    entries = tuple((len(d), d) for d in data)
    created, meta = await store.create(
        sid, CreateSpec(content_type, Expiry(ttl_seconds=ttl_seconds), entries=entries)
    )
    assert created
    return meta


async def fork(
    store: Store, sid: str, src: str, at: int | None = None, *, pin: bool, ttl: int | None = None
) -> tuple[bool, Meta]:
    spec = CreateSpec(
        None,
        Expiry(ttl_seconds=ttl),
        fork_from=src,
        fork_offset=None if at is None else offsets.encode(at),
        pin_source=pin,
    )
    return await store.create(sid, spec)


async def append(store: Store, sid: str, data: bytes, media_type: str = TEXT) -> None:
    await store.append(sid, media_type, [(len(data), data)], close=False, stream_seq=None, producer=None)


async def read(store: Store, sid: str, start: int) -> bytes:
    """Everything from ``start`` to the tail, chunk by chunk (a 410 raises)."""
    out = b""
    for _ in range(100):
        chunk = await store.read(sid, start)
        out += b"".join(data for _, data in chunk.entries)
        if chunk.up_to_date:
            return out
        assert chunk.end > start, "a read that makes no progress"
        start = chunk.end
    raise AssertionError("never up to date")


async def gone(store: Store, sid: str, start: int) -> ProtocolError:
    """The 410 a read of an inherited range whose source is gone must answer."""
    with pytest.raises(ProtocolError) as info:
        await store.read(sid, start)
    assert info.value.status == 410, info.value.message
    assert "inherited" in info.value.message
    return info.value


async def exists(redis: aioredis.Redis, sid: str) -> int:
    return await redis.exists(*keys.stream_keys(sid)[:4])


async def forks_of(redis: aioredis.Redis, sid: str) -> set[bytes]:
    return await redis.smembers(keys.stream_keys(sid)[3])  # type: ignore[misc]


async def test_a_weak_fork_never_blocks_its_source(store: Store, redis: aioredis.Redis) -> None:
    src, weak = name(), name()
    await make(store, src, b"hello", b" world")
    created, meta = await fork(store, weak, src, 5, pin=False)
    assert created and meta.base == 5
    await append(store, weak, b" there")
    assert await read(store, weak, offsets.BEGINNING) == b"hello there"  # inherited, while the source is
    assert await forks_of(redis, src) == set()  # recorded nowhere on the source

    await store.delete(src)  # not soft-deleted: removed for good
    assert await exists(redis, src) == 0
    with pytest.raises(ProtocolError) as info:
        await store.head(src)
    assert info.value.status == 404

    # The path is free at once; the new stream's data never shows through the weak fork.
    await make(store, src, b"HELLO", b" WORLD")
    for start in (offsets.BEGINNING, 0, 2, 4):
        error = await gone(store, weak, start)
    assert offsets.encode(5) in error.message  # says where the fork's own data starts
    assert await read(store, weak, 5) == b" there"  # the fork's own data, from its base
    assert await read(store, weak, 7) == b"here"
    assert (await store.read(weak, None)).meta.tail == 11  # now
    assert (await store.head(weak)).tail == 11
    await append(store, weak, b"!")
    assert await read(store, weak, 5) == b" there!"
    assert await read(store, src, 0) == b"HELLO WORLD"

    # The new source's own pinning fork; then deleting the weak fork leaves both alone.
    pinned = name()
    await fork(store, pinned, src, 5, pin=True)
    assert await forks_of(redis, src) == {pinned.encode()}
    await store.delete(weak)
    assert await exists(redis, weak) == 0
    assert await forks_of(redis, src) == {pinned.encode()}
    assert await read(store, src, 0) == b"HELLO WORLD"
    assert await read(store, pinned, 0) == b"HELLO"
    await store.delete(src)  # still pinned by its own fork: soft-deleted
    assert (await redis.hget(keys.stream_keys(src)[0], "deleted")) == b"1"
    assert await read(store, pinned, 0) == b"HELLO"
    await store.delete(pinned)
    assert await exists(redis, src) == 0


async def test_json_weak_fork_answers_410_not_an_empty_read(store: Store, redis: aioredis.Redis) -> None:
    src, weak = name(), name()
    json_type = "application/json"
    await make(store, src, b"1", b"2", b"3", content_type=json_type)
    await fork(store, weak, src, pin=False)
    await append(store, weak, b"4", json_type)
    assert (await store.read(weak, 0)).body() == b"[1,2,3,4]"
    await store.delete(src)
    await make(store, src, b"10", b"20", b"30", content_type=json_type)
    await gone(store, weak, 0)
    assert (await store.read(weak, 3)).body() == b"[4]"


async def test_pinning_forks_keep_the_protocols_semantics_beside_weak_ones(
    store: Store, redis: aioredis.Redis
) -> None:
    src, pinned, weak = name(), name(), name()
    await make(store, src, b"abcdef")
    await fork(store, pinned, src, 3, pin=True)
    await fork(store, weak, src, 4, pin=False)
    assert await forks_of(redis, src) == {pinned.encode()}

    await store.delete(src)  # soft-deleted: the pinning fork holds it
    for call in (store.head(src), store.read(src, 0), store.delete(src)):
        with pytest.raises(ProtocolError) as info:
            await call
        assert info.value.status == 410
    with pytest.raises(ProtocolError) as info:
        await make(store, src, b"new")
    assert info.value.status == 409
    with pytest.raises(ProtocolError) as info:  # nor may a soft-deleted stream be forked, weakly or not
        await fork(store, name(), src, pin=False)
    assert info.value.status == 409
    assert await read(store, pinned, 0) == b"abc"
    assert await read(store, weak, 0) == b"abcd"  # the data is kept: weak forks read it too

    await store.delete(pinned)  # the last pinning fork: the source is collected
    assert await exists(redis, src) == 0
    await gone(store, weak, 0)
    await make(store, src, b"ABCDEF")
    await gone(store, weak, 0)
    assert await read(store, weak, 4) == b""


async def test_a_source_with_only_weak_forks_expires(store: Store, redis: aioredis.Redis) -> None:
    src, weak, held, pinned = name(), name(), name(), name()
    await make(store, src, b"short-lived", ttl_seconds=1)
    await fork(store, weak, src, 5, pin=False, ttl=60)
    await make(store, held, b"held", ttl_seconds=1)
    await fork(store, pinned, held, pin=True, ttl=60)  # for contrast: this one is kept
    await append(store, weak, b"+own")
    await asyncio.sleep(1.3)
    assert await exists(redis, src) == 0  # Redis expired it by itself
    assert await redis.ttl(keys.stream_keys(held)[0]) == -1  # made persistent by its fork
    with pytest.raises(ProtocolError) as info:
        await store.head(held)
    assert info.value.status == 410  # soft-deleted
    await gone(store, weak, 0)
    assert await read(store, weak, 5) == b"+own"
    await make(store, src, b"another one")
    await gone(store, weak, 0)
    assert await read(store, pinned, 0) == b"held"
    await store.delete(pinned)
    assert await exists(redis, held) == 0


async def test_chains_through_weak_forks(store: Store, redis: aioredis.Redis) -> None:
    # root <- weak (weak, at 2) <- grand (pinning, of the weak fork, at 4)
    root, weak, grand = name(), name(), name()
    await make(store, root, b"0123456789")
    await fork(store, weak, root, 2, pin=False)
    await append(store, weak, b"ab")
    await fork(store, grand, weak, 4, pin=True)
    await append(store, grand, b"XY")
    assert await read(store, grand, 0) == b"01abXY"
    await store.delete(root)  # held by no pinning fork
    assert await exists(redis, root) == 0
    await make(store, root, b"ZZZZZZZZZZ")
    await gone(store, grand, 0)  # inherited through the weak fork: gone with the root
    await gone(store, grand, 1)
    assert await read(store, grand, 2) == b"abXY"  # the weak fork's own range is held by grand
    await store.delete(weak)  # soft-deleted: grand pins it
    assert await read(store, grand, 2) == b"abXY"
    await store.delete(grand)  # collects the weak fork, and only its own incarnation of root
    assert await exists(redis, weak) == 0
    assert await read(store, root, 0) == b"ZZZZZZZZZZ"

    async def three() -> tuple[str, str, str]:
        """top <- mid (pinning, at 3, then "DEF") <- leaf (weak, at 6)."""
        top, mid, leaf = name(), name(), name()
        await make(store, top, b"abcdef")
        await fork(store, mid, top, 3, pin=True)
        await append(store, mid, b"DEF")
        await fork(store, leaf, mid, 6, pin=False)
        return top, mid, leaf

    # deleting mid collects top too
    top, mid, leaf = await three()
    await append(store, leaf, b"!")
    await store.delete(top)  # soft: mid pins it
    assert await read(store, leaf, 0) == b"abcDEF!"
    await store.delete(mid)  # only a weak fork: removed, and releases top, which goes too
    assert await exists(redis, mid) == 0 and await exists(redis, top) == 0
    await gone(store, leaf, 0)
    await gone(store, leaf, 4)
    assert await read(store, leaf, 6) == b"!"

    # a weak fork of a pinning fork whose own source stays: what is still there is read,
    # up to the range that is gone, and a read there is 410
    top, mid, leaf = await three()
    await store.delete(mid)
    assert await read(store, top, 0) == b"abcdef"
    chunk = await store.read(leaf, 0)
    assert b"".join(d for _, d in chunk.entries) == b"abc" and not chunk.up_to_date
    await gone(store, leaf, 3)


async def test_re_creating_a_fork_neither_pins_nor_unpins_wrongly(
    store: Store, redis: aioredis.Redis
) -> None:
    src, weak, pinned = name(), name(), name()
    await make(store, src, b"abcdef")
    assert (await fork(store, weak, src, 3, pin=False))[0]
    # The same PUT again, by someone who could write the source: 200, and the fork stays weak.
    assert not (await fork(store, weak, src, 3, pin=True))[0]
    assert await forks_of(redis, src) == set()
    with pytest.raises(ProtocolError) as info:  # another configuration: 409, still not pinned
        await fork(store, weak, src, 2, pin=True)
    assert info.value.status == 409
    assert await forks_of(redis, src) == set()
    # A failed weak PUT at a pinning fork's path leaves its record alone.
    await fork(store, pinned, src, 3, pin=True)
    for at in (2, 99):  # 409 (another configuration), 400 (beyond the tail)
        with pytest.raises(ProtocolError):
            await fork(store, pinned, src, at, pin=False)
        with pytest.raises(ProtocolError):
            await fork(store, pinned, src, at, pin=True)
    assert await forks_of(redis, src) == {pinned.encode()}
    await store.delete(pinned)
    # A failed PUT leaves alone a record it did not add: here another request's, whose
    # fork is not created yet (its record comes first, see forks.py).
    racing = name()
    await redis.sadd(keys.stream_keys(src)[3], racing)
    for pin in (False, True):
        with pytest.raises(ProtocolError) as info:
            await fork(store, racing, src, 99, pin=pin)
        assert info.value.status == 400
    assert await forks_of(redis, src) == {racing.encode()}
    await fork(store, racing, src, 3, pin=True)
    await store.delete(racing)
    # A PUT of the weak fork after its source was made anew: not the same fork (409), no record left.
    await store.delete(src)
    await make(store, src, b"abcdef")
    with pytest.raises(ProtocolError) as info:
        await fork(store, weak, src, 3, pin=True)
    assert info.value.status == 409
    assert await forks_of(redis, src) == set()


async def test_a_late_release_leaves_a_new_incarnations_fork_alone(
    store: Store, redis: aioredis.Redis, tmp_path
) -> None:
    """A weak fork is deleted, and before its release runs (another step), the source is
    made anew and a pinning fork created at the same path: the release must not drop it."""
    src, child = name(), name()
    await make(store, src, b"abcdef")
    await fork(store, child, src, 3, pin=False)
    await store.delete(src)
    await make(store, src, b"ABCDEF")
    # delete.lua alone: no release yet
    scripts, _, forks = parts(redis, tmp_path)
    result = await scripts.run("delete", store.keys_with_subscribers(child), [keys.SUBS_WAKE_CHANNEL])
    assert result[0] == b"deleted"
    await fork(store, child, src, 3, pin=True)  # a pinning fork at the same path, of the new source
    await forks.release(child, result[1].decode(), result[2].decode())  # the late release
    assert await forks_of(redis, src) == {child.encode()}
    await store.delete(src)
    assert (await redis.hget(keys.stream_keys(src)[0], "deleted")) == b"1"  # soft: still pinned
    assert await read(store, child, 0) == b"ABC"


async def test_bulk_reads_check_the_ancestors_incarnation(
    store: Store, redis: aioredis.Redis, tmp_path
) -> None:
    _, reads, _ = parts(redis, tmp_path)
    src = name()
    await make(store, src, b"abcdef")
    await fork(store, name(), src, pin=False)
    old = (await store.head(src)).uid
    assert old
    assert await reads.bulk(src, 0, 6, None, incarnation=old) == [(0, b"abcdef")]
    await store.delete(src)
    await make(store, src, b"ABCDEF")
    assert await reads.bulk(src, 0, 6, None, incarnation=old) is None
    assert await reads.bulk(src, 0, 6, None) == [(0, b"ABCDEF")]  # its own read: no check


async def test_chains_from_before_incarnations(store: Store, redis: aioredis.Redis) -> None:
    """Forks made before incarnations were recorded: no 'uid' on the source, no
    'chain_uids' or 'src_uid' on the fork (all such forks pin)."""
    src, old_fork = name(), name()
    await make(store, src, b"abcdef")
    await fork(store, old_fork, src, 3, pin=True)
    await append(store, old_fork, b"DEF")
    src_meta, fork_meta = keys.stream_keys(src)[0], keys.stream_keys(old_fork)[0]
    await redis.hdel(src_meta, "uid")
    await redis.hdel(fork_meta, "chain_uids", "src_uid")
    assert json.loads(await redis.hget(fork_meta, "chain")) == [[src, 0, 3]]  # type: ignore[arg-type]
    assert (await store.head(old_fork)).chain == ((src, 0, 3, "?"),)
    assert await read(store, old_fork, 0) == b"abcDEF"

    # A weak fork of it names the ancestors by incarnation (given one now), so once they are
    # gone, a new stream at their path does not show through.
    leaf = name()
    await fork(store, leaf, old_fork, 5, pin=False)
    uid = (await redis.hget(src_meta, "uid") or b"").decode()
    assert uid and (await store.head(leaf)).chain[0] == (src, 0, 3, uid)
    assert await read(store, leaf, 0) == b"abcDE"
    await store.delete(src)  # soft: the old fork pins it
    await store.delete(old_fork)  # a legacy release: collects the source
    assert await exists(redis, src) == 0 and await exists(redis, old_fork) == 0
    await make(store, src, b"ABCDEF")
    await gone(store, leaf, 0)
    await gone(store, leaf, 4)
