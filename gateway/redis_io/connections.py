"""How a process connects to Redis: for the scripts, one bounded pool per Redis
node that makes callers wait, whose connections pack commands with hiredis
(``connect``); for everything else, a plain redis-py client (``general``), a
``RedisCluster`` on Redis Cluster (``--redis-cluster``), and the nodes a command
must visit on each (``every_node``)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeAlias

import hiredis
import redis.asyncio as aioredis
from redis.asyncio import RedisCluster
from redis.asyncio.cluster import ClusterNode
from redis.asyncio.connection import AbstractConnection
from redis.commands.core import AsyncScript
from redis.connection import HiredisRespSerializer
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

_PACKER = HiredisRespSerializer()


# One subclass per base. Not functools.cache: mypy takes a class for an unhashable argument.
_PACKING: dict[type[AbstractConnection], type[AbstractConnection]] = {}


def _hiredis_packing(base: type[AbstractConnection]) -> type[AbstractConnection]:
    """``base`` packing commands in C. redis-py's asyncio connections pack in Python
    (its sync ones use hiredis): a batch of 32 appends is ~300 arguments, 190 µs to
    pack in Python and 34 µs with hiredis, byte for byte the same. A one-word command
    of str, bytes, int, float and memoryview arguments (every script call) goes to
    hiredis as it is: redis-py's own hiredis packer first copies the arguments through a
    Python generator (~2 µs per append of a batch); anything else (a multi-word command
    name, a bytearray, a bad argument) takes that packer, which converts or refuses it."""
    found = _PACKING.get(base)
    if found is not None:
        return found

    class HiredisPacking(base):  # type: ignore[valid-type,misc]
        def pack_command(self, *args: Any) -> list[bytes]:
            name = args[0]
            if isinstance(name, str) and " " not in name:
                try:
                    return [hiredis.pack_command(args)]
                except TypeError:
                    pass
            return _PACKER.pack(*args)

    HiredisPacking.__name__ = f"HiredisPacking{base.__name__}"
    _PACKING[base] = HiredisPacking
    return HiredisPacking


class NotSent(RedisConnectionError):
    """Redis could not be reached: the command never left this process, so a write
    that failed this way certainly did not happen (safe to retry)."""


# What a failed connection attempt raises: nothing was sent (``NotSent``).
_CONNECT_FAILED = (RedisConnectionError, RedisTimeoutError, OSError, RuntimeError)


class _Pool(aioredis.BlockingConnectionPool):
    """Tells "could not connect" (nothing sent: ``NotSent``) apart from failures
    after a command was sent, whose outcome is unknown (the write may be applied)."""

    async def get_connection(self, *args: Any, **kwargs: Any) -> AbstractConnection:
        try:
            connection = await super().get_connection(*args, **kwargs)
        except _CONNECT_FAILED as exc:
            raise NotSent(str(exc)) from exc
        try:
            await _open(connection)
        except BaseException:
            await self.release(connection)
            raise
        return connection


async def _open(connection: AbstractConnection) -> None:
    """Connect ``connection`` unless it is; again if the server closed or reset it (an idle
    connection closed by a restart would take the next command and fail it as "unknown":
    redis-py's own check misses a plain EOF). ``NotSent`` when that fails."""
    reader = getattr(connection, "_reader", None)
    try:
        if reader is not None and (reader.at_eof() or reader.exception() is not None):
            await connection.disconnect()
        if not connection.is_connected:
            await connection.connect()
    except _CONNECT_FAILED as exc:
        # RuntimeError: uvloop's "unable to perform operation on <transport closed>"
        # when Redis drops the connection during its handshake.
        raise NotSent(str(exc)) from exc


def connect(url: str, max_connections: int, timeout: float = 5.0) -> aioredis.Redis:
    """A client on a pool of at most ``max_connections``. A burst of clients (a
    reconnect herd of SSE readers) queues for a connection (up to 10 s) instead of
    failing with "too many connections". A command unanswered for ``timeout``
    seconds fails (redis-py retries nothing here: a resent append could apply twice)."""
    pool = _Pool.from_url(
        url,
        max_connections=max_connections,
        timeout=10,
        health_check_interval=30,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
    )
    # The URL picks the class (TCP, TLS or Unix socket); it gets the packer on top.
    pool.connection_class = _hiredis_packing(pool.connection_class)
    return aioredis.Redis.from_pool(pool)  # owns the pool: closing the client closes its connections


async def run_script(
    redis: aioredis.Redis, script: AsyncScript, keys: Sequence[Any], args: Sequence[Any]
) -> Any:
    """``script(keys, args)`` on ``redis``'s pool, without redis-py's command layers (its
    Script, evalsha, execute_command's retry wrapper and observability hooks): ~5 µs an
    append on 1,000 streams, where a call carries ~6 appends. What they do that matters
    here is done here too: a connection from the pool (``NotSent`` when none can be had),
    EVALSHA, the reply (an error reply raised), a connection that failed disconnected so
    that it is never reused with an answer in flight, and on NOSCRIPT (Redis restarted and
    forgot the script: it did not run) the script loaded and sent again. No retry
    otherwise: redis-py retries nothing on this pool either (``connect``)."""
    return await _loaded(redis, script, lambda sha: _evalsha(redis, sha, keys, args))


async def _loaded(
    redis: aioredis.Redis, script: AsyncScript, evalsha: Callable[[str], Awaitable[Any]]
) -> Any:
    """``evalsha(script's sha)``; on NOSCRIPT (Redis restarted and forgot the script: it did
    not run) the script loaded and sent again."""
    try:
        return await evalsha(script.sha)
    except NoScriptError:
        script.sha = await redis.script_load(script.script)
        return await evalsha(script.sha)


async def _evalsha(redis: aioredis.Redis, sha: str, keys: Sequence[Any], args: Sequence[Any]) -> Any:
    pool = redis.connection_pool
    connection = await pool.get_connection()
    try:
        return await _evalsha_on(connection, sha, keys, args)
    finally:
        await pool.release(connection)


async def _evalsha_on(
    connection: AbstractConnection, sha: str, keys: Sequence[Any], args: Sequence[Any]
) -> Any:
    """EVALSHA on ``connection``, dropped on a failure once sent (its answer may come yet)."""
    try:
        await connection.send_packed_command(connection.pack_command("EVALSHA", sha, len(keys), *keys, *args))
        return await connection.read_response()
    except (RedisConnectionError, RedisTimeoutError):
        await connection.disconnect()
        raise


class Held:
    """``run_script`` over a connection of its own, for a caller that sends one call at a
    time (an append lane: the batcher has at most one call of a lane in flight). The pool
    costs every call its condition, lock, timeout, connection check and metrics hooks:
    ~35 µs of CPU a call (EVALSHA on one Redis: ~85 µs pooled, ~50 held; docs/benchmarks.md).
    The same outcomes as run_script: ``NotSent`` when no connection can be had (nothing
    sent), the connection dropped on a failure once sent (never reused with an answer in
    flight), a script Redis forgot loaded and sent again. A call while another is in
    flight (not expected) takes the pool. One more connection to Redis per holder, outside
    the pool's --redis-max-connections."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self._redis = redis
        self._connection: AbstractConnection | None = None
        self._busy = False

    async def run_script(self, script: AsyncScript, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        if self._busy:
            return await run_script(self._redis, script, keys, args)
        self._busy = True
        try:
            if self._connection is None:
                self._connection = self._redis.connection_pool.make_connection()
            connection = self._connection
            await _open(connection)
            return await _loaded(self._redis, script, lambda sha: _evalsha_on(connection, sha, keys, args))
        finally:
            self._busy = False

    async def aclose(self) -> None:
        if self._connection is not None:
            await self._connection.disconnect()


class PlainRefused(ResponseError):
    """Redis (or a proxy before it, or the ACL) refused WATCH, HMGET or TIME: plain
    transactions are not to be had here. Nothing was written."""


# What watched_write writes: commands from a hash's fields and Redis's clock (ms), or None.
WatchedWrite = Callable[[list[Any], int], Sequence[Sequence[Any]] | None]


async def watched_write(
    redis: aioredis.Redis, watch: Sequence[str], fields: Sequence[str], commands: WatchedWrite
) -> list[Any] | None:
    """Plain commands made by ``commands`` from the fields of the hash ``watch[0]`` and
    Redis's clock (ms), run in one MULTI/EXEC only if no key of ``watch`` changed since they
    were read (WATCH): their replies, or None when nothing was written (``commands``
    declined, or a key changed). Two round trips on one pooled connection, as run_script
    sends a script (redis-py's pipeline turns a lost connection while watching into a
    WatchError, which would read as "a key changed" though EXEC may have run).

    Raises ``PlainRefused`` when WATCH, HMGET or TIME is refused (nothing written); the
    error of a command refused in the transaction (EXECABORT: nothing written; one failing
    inside it: the others ran, the caller undoes them); a connection error when Redis is
    lost (``NotSent`` before anything was sent), the transaction's outcome then unknown."""
    pool = redis.connection_pool
    connection = await pool.get_connection()
    clean = False  # the connection holds no WATCH, MULTI or unread reply: reusable
    try:
        head = [("WATCH", *watch), ("HMGET", watch[0], *fields), ("TIME",)]
        await connection.send_packed_command(connection.pack_commands(head))
        try:
            await connection.read_response()
            values = await connection.read_response()
            seconds, micros = await connection.read_response()
        except ResponseError as exc:
            raise PlainRefused(str(exc)) from None
        todo = commands(values, int(seconds) * 1000 + int(micros) // 1000)
        if todo is None:
            await connection.send_packed_command(connection.pack_command("UNWATCH"))
            await connection.read_response()
            clean = True
            return None
        await connection.send_packed_command(connection.pack_commands([("MULTI",), *todo, ("EXEC",)]))
        queued: ResponseError | None = None
        for _ in range(len(todo) + 1):  # MULTI's OK, then QUEUED or the refusal of each
            try:
                await connection.read_response()
            except ResponseError as exc:
                queued = queued or exc
        try:
            replies = await connection.read_response()  # EXEC: its replies, or nil (a key changed)
        except ResponseError as exc:  # EXECABORT: a command was refused as it was queued
            clean = True
            raise queued or exc from None
        clean = True
        if replies is None:
            return None
        failed = next((r for r in replies if isinstance(r, ResponseError)), None)
        if failed is not None:
            raise failed
        return list(replies)
    finally:
        if not clean:  # a WATCH, a MULTI or replies may be left on it: never reuse it
            await connection.disconnect()
        await pool.release(connection)


Client: TypeAlias = "aioredis.Redis | RedisCluster"


def general(url: str, *, cluster: bool, **options: Any) -> Client:
    """A redis-py client for commands other than the scripts (checks, hints, the
    archive's bookkeeping: reads and idempotent writes, which redis-py may retry).
    On a cluster ``url`` is one node's (redis-py's ``RedisCluster.from_url``): the
    others are found from it, and a command goes to the node of its key's slot."""
    if cluster:
        return RedisCluster.from_url(url, **options)
    return aioredis.Redis.from_url(url, **options)


async def scan_pages(
    redis: Client, match: str, count: int = 1000, type_: str | None = None
) -> AsyncIterator[list[bytes | str]]:
    """SCAN's keys, a page at a time (empty pages too: a caller counts each as progress).
    On a cluster, every primary's keys, one primary after the other, each with its own
    cursor (a primary that fails over meanwhile is scanned to the end as the replica it
    became: it has the same keys)."""
    for node in await every_node(redis):
        cursor = 0
        while True:
            reply, found = await redis.scan(cursor, match=match, count=count, _type=type_, **node)
            # One Redis answers the next cursor; RedisCluster {node name: cursor}, one node here.
            cursor = int(next(iter(reply.values())) if isinstance(reply, dict) else reply)
            yield found
            if not cursor:
                break


async def server_ms(redis: Client, **target: Any) -> int:
    """Redis' clock in ms (of ``target_nodes`` if given): leases and backups go by it, not by
    this host's, which may be off."""
    found: Any = await redis.time(**target)
    if isinstance(found, dict):  # (RedisCluster: {node: reply})
        found = next(iter(found.values()))
    seconds, micros = found
    return int(seconds) * 1000 + int(micros) // 1000


async def every_node(redis: Client, *, replicas: bool = False) -> list[dict[str, Any]]:
    """The ``target_nodes`` arguments that visit every primary (and every replica, with
    ``replicas``) of a cluster, one after the other; ``[{}]`` on a single Redis."""
    if not isinstance(redis, RedisCluster):
        return [{}]
    # Read the slot map now: a cached one would miss a primary added since (these visits
    # are rare: start-up checks, a reconciliation pass).
    await redis.initialize()
    await redis.nodes_manager.initialize()
    nodes: list[ClusterNode] = redis.get_nodes() if replicas else redis.get_primaries()
    return [{"target_nodes": node} for node in nodes]


def version(release: str) -> tuple[int, int]:
    """A Redis release (``redis_version``, e.g. '7.0.15') as (major, minor)."""
    parts = (release.strip().split(".") + ["0", "0"])[:2]
    return int(parts[0]), int(parts[1])
