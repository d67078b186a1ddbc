"""Where a stream's commands go: the one Redis, or the Redis Cluster node serving
the stream's hash slot.

``Route.pipeline(key, queue)`` sends the commands ``queue`` puts on a pipeline
in one round trip, on one connection, to the node serving ``key``'s slot. One
connection matters twice: an ``ASKING`` must come on the connection of the
command it lets through, and ``WAIT`` counts the replicas that have this
connection's writes (``--min-replicas-ack``, see scripts.py).

On a cluster (``ClusterRoute``) redirects are followed here, not by redis-py's
``RedisCluster``, because a write must never be sent twice: redis-py's cluster
client resends a command whose connection failed after it was sent (an append
could be stored twice), sends ``ASKING`` on a pooled connection of its own
(the command may go on another, and bounce), and fails a burst of requests
instead of making them wait for a connection. Here each node gets the bounded,
waiting pool of ``client.connect`` (``NotSent`` when nothing left this
process), and only answers that say the command did not run are retried:

- ``MOVED`` (the slot lives elsewhere now: resharding done, or a failover): the
  slot map is updated, the commands go to the new owner;
- ``ASK`` (the slot is being moved and the keys are at the target already):
  sent again to the target, after ``ASKING``;
- ``TRYAGAIN`` (the slot is being moved and the keys are split between the two
  nodes; every script hits this, as a stream's notify channel is never a
  stored key) and ``CLUSTERDOWN``: wait a little, ask again;
- nothing sent (``NotSent``: the node is down): the slot map is refreshed, and
  the commands go to whoever serves the slot now (a replica promoted).

All within ``timeout`` seconds; after that the last such error is raised as
``NotSent`` (nothing was applied: 503, retry). A failure after sending (the
connection dropped, no answer) is raised as it is: the outcome is unknown, and
the slot map is refreshed for the next call.

The slot map itself is redis-py's (``RedisCluster.nodes_manager``): it reads
``CLUSTER SLOTS`` from the seed nodes and follows ``MOVED``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Protocol
from urllib.parse import urlsplit, urlunsplit

from redis.asyncio import Redis, RedisCluster
from redis.asyncio.client import Pipeline
from redis.asyncio.cluster import ClusterNode
from redis.crc import key_slot
from redis.exceptions import (
    AskError,
    ClusterDownError,
    MovedError,
    RedisClusterException,
    RedisError,
    SlotNotCoveredError,
    TryAgainError,
)

from ..telemetry import metrics
from ..telemetry.logs import RateLimited
from .connections import NotSent, connect

log = logging.getLogger(__name__)
limited = RateLimited(log, every=30.0)

Queue = Callable[[Pipeline], object]  # puts commands on a pipeline
_NOT_RUN = (MovedError, AskError, TryAgainError, ClusterDownError)  # answers of commands that did not run
_REASONS = {MovedError: "moved", AskError: "ask", TryAgainError: "tryagain", ClusterDownError: "clusterdown"}
_REFRESH_SECONDS = 0.2  # at most one slot map refresh per this long (a failover makes every call ask)


def did_not_run(reply: Any) -> bool:
    """Whether a reply says its command did not run (redirected, or the slot is moving)."""
    return isinstance(reply, _NOT_RUN)


class Route(Protocol):
    """Sends commands for one key's slot, on one connection."""

    async def pipeline(
        self, key: str, queue: Queue, *, transaction: bool = False, raise_on_error: bool = True
    ) -> list[Any]: ...


class DirectRoute:
    """One Redis: every key's commands go to the one pool."""

    def __init__(self, redis: Redis) -> None:
        self.redis = redis

    async def pipeline(
        self, key: str, queue: Queue, *, transaction: bool = False, raise_on_error: bool = True
    ) -> list[Any]:
        async with self.redis.pipeline(transaction=transaction) as pipe:
            queue(pipe)
            return await pipe.execute(raise_on_error=raise_on_error)


def node_url(seed_url: str, host: str, port: int) -> str:
    """The seed URL pointed at another node: same scheme, credentials, TLS options."""
    parts = urlsplit(seed_url)
    credentials = parts.netloc.rpartition("@")[0]
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    netloc = f"{credentials}@{address}" if credentials else address
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


class ClusterRoute:
    """A Redis Cluster: commands go to the primary serving the key's slot (see the module)."""

    def __init__(
        self,
        cluster: RedisCluster,
        seed_url: str,
        max_connections: int,
        timeout: float,
    ) -> None:
        self.cluster = cluster
        self._seed_url = seed_url
        self._max_connections = max_connections
        self._timeout = timeout
        self._callbacks: dict[str, Callable[..., Any]] = {}
        self._clients: dict[str, Redis] = {}
        self._refreshing: asyncio.Task[None] | None = None
        self._refreshed_at = -1e9
        self._ready = False
        self._stale: asyncio.Task[None] | None = None  # a refresh after an unanswered call

    def set_response_callback(self, command: str, callback: Callable[..., Any]) -> None:
        """Parse ``command``'s replies with ``callback`` on every node's client (as
        ``Redis.set_response_callback``; e.g. raw XRANGE for bulk reads)."""
        self._callbacks[command] = callback
        for client in self._clients.values():
            client.set_response_callback(command, callback)

    def client(self, host: str, port: int) -> Redis:
        """This process's pool for one node (made on first use, kept)."""
        name = f"{host}:{port}"
        client = self._clients.get(name)
        if client is None:
            url = node_url(self._seed_url, host, port)
            client = self._clients[name] = connect(url, self._max_connections, self._timeout)
            for command, callback in self._callbacks.items():
                client.set_response_callback(command, callback)
        return client

    async def _owner(self, slot: int) -> ClusterNode:
        if not self._ready:
            try:
                await self.cluster.initialize()
            except (RedisError, RedisClusterException, OSError) as exc:  # nobody answered: nothing sent
                raise NotSent(f"redis cluster: {exc}") from exc
            self._ready = True
        try:
            return self.cluster.nodes_manager.get_node_from_slot(slot)
        except SlotNotCoveredError as exc:  # a failover under way: nobody serves it yet
            await self.refresh()
            raise NotSent(str(exc)) from exc

    async def refresh(self) -> None:
        """Read the slot map again (one refresh at a time, at most one per 0.2 s)."""
        loop = asyncio.get_running_loop()
        if self._refreshing is None:
            if loop.time() - self._refreshed_at < _REFRESH_SECONDS:
                return
            self._refreshing = loop.create_task(self._refresh())
        try:
            await asyncio.shield(self._refreshing)
        except Exception as exc:  # the next call tries again
            limited.log(logging.WARNING, "refresh", "redis cluster slot map not refreshed: %s", exc)

    async def _refresh(self) -> None:
        try:
            async with asyncio.timeout(self._timeout):  # a call waits for it: bounded like one
                await self.cluster.nodes_manager.initialize()
            self._ready = True
        finally:
            self._refreshed_at = asyncio.get_running_loop().time()
            self._refreshing = None

    async def pipeline(
        self, key: str, queue: Queue, *, transaction: bool = False, raise_on_error: bool = True
    ) -> list[Any]:
        loop = asyncio.get_running_loop()
        slot = key_slot(key.encode())
        deadline = loop.time() + self._timeout
        asking: tuple[str, int] | None = None
        pause, redirected = 0.005, 0
        while True:
            error: Exception
            try:
                replies = await self._send(slot, asking, queue, transaction)
            except _NOT_RUN as exc:  # a transaction's: raised at EXEC (none of it ran)
                error = exc
            except NotSent as exc:  # the node is away: whoever serves the slot now may answer
                error = exc
                await self.refresh()
            except Exception:  # sent, no answer: outcome unknown; the map may be stale
                self._stale = asyncio.get_running_loop().create_task(self.refresh())
                raise
            else:
                if not (replies and isinstance(replies[0], _NOT_RUN)):
                    if raise_on_error:
                        for reply in replies:
                            if isinstance(reply, Exception):
                                raise reply
                    return replies
                error = replies[0]
            asking = None
            metrics.REDIS_RETRIES.labels(_REASONS.get(type(error), "unreachable")).inc()
            redirected += 1
            if loop.time() + pause > deadline:
                if isinstance(error, NotSent):
                    raise error
                raise NotSent(f"redis cluster: {error}") from error
            if isinstance(error, MovedError):
                await self.cluster.nodes_manager.move_slot(error)
                if redirected == 1:
                    continue  # the new owner answers at once; bounced again: pause below
            elif isinstance(error, AskError) and not transaction:
                asking = (error.host, error.port)
                continue
            # TRYAGAIN, CLUSTERDOWN, ASK inside a transaction (no ASKING before MULTI:
            # wait for the move to end), nobody reachable, moved again: wait, ask again.
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.1)
            if isinstance(error, (ClusterDownError, MovedError)):
                await self.refresh()

    async def node_of(self, key: str) -> str:
        """The name of the node serving ``key``'s slot, as this process last learned it."""
        return (await self._owner(key_slot(key.encode()))).name

    async def send_once(self, key: str, queue: Queue) -> list[Any]:
        """One round trip to the node serving ``key``'s slot, nothing retried: the commands
        may be for several slots of that node (``Scripts.run_each``), so the caller sends
        again, one by one, those whose answer says they did not run (``did_not_run``).
        NotSent: none was sent; any other exception: the outcome of all is unknown."""
        try:
            return await self._send(key_slot(key.encode()), None, queue, False)
        except NotSent:
            await self.refresh()
            raise
        except Exception:
            self._stale = asyncio.get_running_loop().create_task(self.refresh())
            raise

    async def _send(
        self, slot: int, asking: tuple[str, int] | None, queue: Queue, transaction: bool
    ) -> list[Any]:
        """One round trip: to ``asking`` (after ASKING) or to the slot's owner."""
        if asking is not None:
            client = self.client(*asking)
        else:
            node = await self._owner(slot)
            client = self.client(node.host, int(node.port))
        async with client.pipeline(transaction=transaction) as pipe:
            if asking is not None:
                pipe.execute_command("ASKING")
            queue(pipe)
            replies = await pipe.execute(raise_on_error=False)
        return replies[1:] if asking is not None else replies

    async def aclose(self) -> None:
        for task in (self._refreshing, self._stale):
            if task is not None:
                task.cancel()
        for client in self._clients.values():
            await client.aclose()
        self._clients.clear()
