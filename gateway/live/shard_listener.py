"""The pub/sub connection to one Redis Cluster shard primary (a ``Listener``,
``listener.py``), serving the channels of the slots that node serves
(``shards.py`` routes them).

On Redis 7+ it uses sharded pub/sub (SSUBSCRIBE, ``smessage``), as the scripts
SPUBLISH there; on 6.2 classic SUBSCRIBE, as they PUBLISH (which every node
hears). Which one is asked of the node with ``INFO server`` once per
connection. The node gives channels up by itself: a ``sunsubscribe`` push
when their slot moves away (resharding, or a failover demoted the node), a
``-MOVED`` answer to an SSUBSCRIBE for a slot it does not serve; those
channels are unconfirmed and handed back (``on_dropped``) to be routed anew.
Our own SUNSUBSCRIBEs are counted, so their answers are not taken for the
node's own.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.exceptions import AskError, ResponseError

from ..redis_io.connections import version
from .channels import Channel
from .listener import CLASSIC, SHARDED, SUBSCRIBE_BATCH, Command, Dialect, Listener

if TYPE_CHECKING:
    from collections.abc import Callable

    from redis.asyncio.cluster import ClusterNode
    from redis.asyncio.connection import AbstractConnection


def slot_of(name: str) -> int:
    return key_slot(name.encode())


def _version(info: Any) -> tuple[int, int]:
    """``redis_version`` from an ``INFO server`` reply."""
    text = info.decode() if isinstance(info, bytes) else str(info)
    for line in text.splitlines():
        if line.startswith("redis_version:"):
            return version(line.split(":", 1)[1])
    return (0, 0)


class ShardListener(Listener):
    """The connection to one shard primary and the channels of its slots."""

    def __init__(
        self,
        node: ClusterNode,
        health_seconds: float,
        on_dropped: Callable[[ShardListener, list[str]], None],
        on_lost: Callable[[], None],
    ) -> None:
        super().__init__({}, self._connect, health_seconds, label=f"pub/sub {node.name}")
        self.node = node.name
        self._connection_class = node.connection_class
        self._connection_kwargs = dict(node.connection_kwargs)
        self._on_dropped = on_dropped  # the node gave these channels up: route them anew
        self._on_lost = on_lost  # the connection failed: is the node still a primary?
        self.by_slot: dict[int, set[str]] = {}  # this listener's channels by hash slot
        self._unanswered: dict[str, int] = {}  # SUNSUBSCRIBEs sent and not yet answered
        self.task: asyncio.Task[None] | None = None

    def _connect(self) -> AbstractConnection:
        # Like the single Redis' (fanout.py): no socket timeout, no retries; ours bound it.
        options = {**self._connection_kwargs, "socket_timeout": None, "retry": Retry(NoBackoff(), 0)}
        return self._connection_class(**options)

    def add(self, name: str, channel: Channel) -> None:
        self.by_slot.setdefault(slot_of(name), set()).add(name)
        super().add(name, channel)

    def forget(self, name: str) -> None:
        self._unindex(name)
        super().forget(name)

    def release(self, names: list[str]) -> None:
        """Stop serving these channels (their slots are elsewhere now), unconfirmed. Redis 7
        dropped them (or will) with the slot; a Redis 6.2 node keeps them: unsubscribe."""
        for name in names:
            channel = self.channels.pop(name, None)
            if channel is None:
                continue
            self._unindex(name)
            if name in self._unsent:
                self._unsent.discard(name)
            elif self._dialect is not SHARDED:
                self._leaving.append(name)
                self._nudge()
            channel.unconfirm()

    def _unindex(self, name: str) -> None:
        slot = slot_of(name)
        names = self.by_slot.get(slot)
        if names is not None:
            names.discard(name)
            if not names:
                del self.by_slot[slot]

    def _dropped(self, names: list[str]) -> None:
        """The node no longer serves these channels."""
        mine = [name for name in names if name in self.channels]
        if mine:
            self.release(mine)
            self._on_dropped(self, mine)

    # -- the pub/sub flavour, per connection ----------------------------------------------

    async def _handshake(self, connection: AbstractConnection) -> Dialect:
        await connection.send_command("INFO", "server", check_health=False)
        release = _version(await connection.read_response())
        return SHARDED if release >= (7, 0) else CLASSIC

    def _begin(self) -> None:
        super()._begin()
        self._unanswered = {}

    def _lost(self) -> None:
        super()._lost()
        self._on_lost()

    def _subscribing(self, names: list[str]) -> list[Command]:
        if self._dialect is not SHARDED:
            return super()._subscribing(names)
        return self._per_slot(self._dialect.subscribe, names)

    def _unsubscribing(self, names: list[str]) -> list[Command]:
        if self._dialect is not SHARDED:
            return super()._unsubscribing(names)
        for name in names:  # to tell their answers from the node's own sunsubscribe
            self._unanswered[name] = self._unanswered.get(name, 0) + 1
        return self._per_slot(self._dialect.unsubscribe, names)

    @staticmethod
    def _per_slot(command: str, names: list[str]) -> list[Command]:
        """Sharded commands name channels of one slot only (else CROSSSLOT)."""
        grouped: dict[int, list[str]] = {}
        for name in names:
            grouped.setdefault(slot_of(name), []).append(name)
        return [
            (command, *group[i : i + SUBSCRIBE_BATCH])
            for group in grouped.values()
            for i in range(0, len(group), SUBSCRIBE_BATCH)
        ]

    def _unsubscribed(self, name: str) -> None:
        if self._dialect is not SHARDED:
            return  # only ever the answer to our UNSUBSCRIBE
        count = self._unanswered.pop(name, 0)
        if count > 1:
            self._unanswered[name] = count - 1
        if not count:  # the node's own: the slot moved away
            self._dropped([name])

    def _refused(self, error: ResponseError) -> None:
        if self._dialect is not SHARDED or not isinstance(error, AskError):  # MOVED is an AskError
            raise error  # CLUSTERDOWN and the like: reconnect once the map is refreshed
        # An SSUBSCRIBE or SUNSUBSCRIBE for a slot this node does not serve. No answer
        # will come for the SUNSUBSCRIBEs of that slot.
        for name in [name for name in self._unanswered if slot_of(name) == error.slot_id]:
            del self._unanswered[name]
        self._dropped(list(self.by_slot.get(error.slot_id, ())))
