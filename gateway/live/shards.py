"""Live-read wake-ups on a Redis Cluster: one pub/sub connection per shard
primary, each channel subscribed on the primary serving its hash slot.

On a cluster the scripts publish a notice with SPUBLISH (Redis 7+), which
reaches only the subscribers of the shard owning the channel's slot (on Redis
6.2 with PUBLISH, which every node hears). Each primary's connection is a
``ShardListener`` (``shard_listener.py``: sharded pub/sub, or classic on 6.2).

The slot map is redis-py's (``RedisCluster.nodes_manager``). A channel leaves
its node when:

- the node says it no longer holds it: Redis 7 pushes ``sunsubscribe`` when a
  slot moves away (resharding, or the node was demoted by a failover), and
  answers an SSUBSCRIBE for a slot it does not serve with ``-MOVED``;
- a refresh of the slot map puts its slot elsewhere. The map is refreshed
  after either of the above, after a node's connection fails (the node may
  have died: a failover follows), and every 30 s (Redis 6.2 says nothing when
  a slot moves).

The channel is then unconfirmed (``Channel.unconfirm``) until the
confirmation from its new node, which wakes its readers to re-read, as after a
reconnect: nothing published while it was not subscribed can be missed. A
node that just gave a channel up is not trusted with it again for a few
seconds, whatever the refreshed map says: the node asked may not have heard of
the change yet (a demoted primary would even accept the SSUBSCRIBE, as a
replica). Refreshes are bounded and paced (backoff) while trouble lasts; each
node's listener is its own task, so a node that stops answering holds up
nobody else.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

from redis.cluster import PRIMARY
from redis.exceptions import SlotNotCoveredError

from ..concurrency import backoff
from ..concurrency.cancelling import raise_if_cancelled
from ..telemetry.logs import RateLimited
from .channels import Channel
from .listener import UNREACHABLE
from .shard_listener import ShardListener, slot_of

if TYPE_CHECKING:
    from redis.asyncio import RedisCluster

log = logging.getLogger(__name__)
limited = RateLimited(log, every=30.0)
_DISTRUST_SECONDS = 3.0  # how long a node that gave a channel up gets no say on it
# Between slot map refreshes while trouble lasts: at most half a second, as a failover's
# new primary is found by a refresh, and its readers wait for it.
_PAUSE_MIN, _PAUSE_MAX = 0.05, 0.5
# The slot map is re-read this often without trouble too: Redis 6.2 tells subscribers
# nothing of a slot move (its PUBLISH reaches every node, so nothing is lost meanwhile).
_CHECK_SECONDS = 30.0


class Shards:
    """Channels routed to the listener of the primary serving their slot."""

    def __init__(self, cluster: RedisCluster, channels: dict[str, Channel], health_seconds: float) -> None:
        self._cluster = cluster
        self._channels = channels  # the fan-out's: every registered channel
        self._health = health_seconds
        self._listeners: dict[str, ShardListener] = {}  # by node name
        self._retired: set[asyncio.Task[None]] = set()  # listeners of former primaries, ending
        self._unrouted: set[str] = set()  # registered, on no listener: waiting for the slot map
        self._gave_up: dict[str, tuple[str, float]] = {}  # channel -> the node that dropped it, when
        self._stale = asyncio.Event()  # the slot map needs refreshing
        self._ready = False  # a slot map is known
        self._refreshed = float("-inf")  # loop time of the last refresh
        self._pause = _PAUSE_MIN

    # -- what the fan-out wants -----------------------------------------------------------

    def add(self, name: str, channel: Channel) -> None:
        if self._ready:
            self._route(name)
        else:
            self._unrouted.add(name)

    def reachable(self, node: str | None = None) -> None:
        """That node answered another connection (None: some node did): its listener, if
        waiting to reconnect, tries now."""
        listeners = self._listeners.values() if node is None else [self._listeners.get(node)]
        for listener in listeners:
            if listener is not None:
                listener.reachable()

    def forget(self, name: str) -> None:
        self._unrouted.discard(name)
        self._gave_up.pop(name, None)
        for listener in self._listeners.values():
            if name in listener.channels:
                listener.forget(name)
                return

    # -- routing --------------------------------------------------------------------------

    def _route(self, name: str) -> None:
        """Hand a channel to the listener of its slot's primary (started if need be)."""
        channel = self._channels.get(name)
        if channel is None:  # forgotten meanwhile
            self._unrouted.discard(name)
            return
        try:
            node = self._cluster.nodes_manager.get_node_from_slot(slot_of(name))
        except SlotNotCoveredError:
            node = None
        gave_up = self._gave_up.get(name)
        if node is not None and gave_up is not None and gave_up[0] == node.name:
            if asyncio.get_running_loop().time() - gave_up[1] < _DISTRUST_SECONDS:
                node = None  # the map is older than what that node told us
        if node is None:
            self._unrouted.add(name)
            self._stale.set()
            return
        self._gave_up.pop(name, None)
        self._unrouted.discard(name)
        listener = self._listeners.get(node.name)
        if listener is None:
            listener = self._listeners[node.name] = ShardListener(
                node, self._health, self._dropped, self._stale.set
            )
            listener.task = asyncio.create_task(listener.run(), name=f"fanout {node.name}")
        listener.add(name, channel)

    def _dropped(self, listener: ShardListener, names: list[str]) -> None:
        now = asyncio.get_running_loop().time()
        for name in names:
            self._gave_up[name] = (listener.node, now)
        self._unrouted.update(names)
        self._stale.set()

    def _reroute(self) -> None:
        """After a refresh: move every channel whose slot is now elsewhere, route the
        waiting ones, and stop the listeners of nodes that are no longer primaries."""
        manager = self._cluster.nodes_manager
        for listener in self._listeners.values():
            moved: list[str] = []
            for slot, names in listener.by_slot.items():
                try:
                    owner = manager.get_node_from_slot(slot).name
                except SlotNotCoveredError:
                    owner = None
                if owner != listener.node:
                    moved += names
            if moved:
                listener.release(moved)
                self._unrouted.update(moved)
        for name in list(self._unrouted):
            self._route(name)
        primaries = {node.name for node in manager.get_nodes_by_server_type(PRIMARY)}
        for name in [name for name, listener in self._listeners.items() if name not in primaries]:
            listener = self._listeners[name]
            if not listener.channels and listener.task is not None:
                listener.task.cancel()  # its connection closes as the task ends
                self._retired.add(listener.task)
                listener.task.add_done_callback(self._retired.discard)
                del self._listeners[name]

    # -- the slot map ---------------------------------------------------------------------

    async def _initialize(self) -> None:
        """Until the cluster answers: the first slot map (tried as often as a listener
        tries to reconnect: the readers registered meanwhile wait for it)."""
        failures = 0
        while True:
            try:
                async with asyncio.timeout(self._health):
                    await self._cluster.initialize()
                return
            except Exception as exc:
                raise_if_cancelled()  # closing, the cancellation lost inside redis-py
                seconds = backoff.delay(failures, first=UNREACHABLE[0], cap=UNREACHABLE[1])
                failures += 1
                message = "redis cluster not reachable (%r); retrying in %.2fs"
                limited.log(logging.WARNING, "initialize", message, exc, seconds)
            await asyncio.sleep(seconds)

    async def _refresh(self) -> bool:
        """Read the slot map again (paced: refreshes come in bursts while a node fails)."""
        loop = asyncio.get_running_loop()
        since = loop.time() - self._refreshed
        self._pause = _PAUSE_MIN if since > 2 * _PAUSE_MAX else min(self._pause * 2, _PAUSE_MAX)
        if since < self._pause:
            await asyncio.sleep(self._pause - since)
        self._stale.clear()  # what goes wrong from here on asks for another refresh
        self._refreshed = loop.time()
        try:
            async with asyncio.timeout(self._health):
                await self._cluster.nodes_manager.initialize()
        except Exception as exc:
            raise_if_cancelled()  # closing, the cancellation lost inside redis-py
            limited.log(logging.WARNING, "refresh", "redis cluster slot map not refreshed (%r)", exc)
            return False
        return True

    def _reroute_or_retry(self) -> None:
        """``_reroute``; a bug in it must not end the routing every reader depends on:
        logged, and tried again after the next refresh."""
        try:
            self._reroute()
        except Exception:
            log.exception("redis cluster: routing pub/sub channels failed; trying again")
            self._stale.set()

    async def run(self) -> None:
        try:
            await self._initialize()
            self._ready = True
            self._reroute_or_retry()
            while True:
                raise_if_cancelled()  # redis-py may have answered all the same: see cancelling.py
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(_CHECK_SECONDS):
                        await self._stale.wait()
                if await self._refresh():
                    self._reroute_or_retry()
                else:
                    self._stale.set()
        finally:
            self._ready = False  # closing: a late registration starts no listener
            tasks = [listener.task for listener in self._listeners.values() if listener.task is not None]
            tasks += self._retired
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
