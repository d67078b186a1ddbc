"""The Lua scripts, loaded once and called by SHA (their text: lua.py). A script that
Redis has forgotten (a restart, a failover, a node that never had it) is loaded again
and called again: ``NOSCRIPT`` means it did not run.

On one Redis without ``--min-replicas-ack``, a script is one EVALSHA on the
pool (redis-py's Script object). Otherwise it goes through a ``Route``
(routing.py): to the node serving its keys' slot on Redis Cluster, followed on
the same connection, for a write, by ``WAIT`` (or ``WAITAOF``) for the replicas
(``ReplicaAck``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from redis.asyncio import Redis, RedisCluster
from redis.asyncio.client import Pipeline
from redis.commands.core import AsyncScript
from redis.crc import key_slot
from redis.exceptions import NoScriptError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ..protocol.models import text
from ..telemetry import metrics
from . import connections, keys
from .connections import NotSent, WatchedWrite, connect, every_node
from .contracts import SCRIPTS
from .lua import source
from .routing import ClusterRoute, DirectRoute, Queue, Route, did_not_run

log = logging.getLogger(__name__)
# Every script, declared once with its ARGV, its replies and whether it writes: contracts.py
# (tests/test_script_contracts.py checks each against its script's header).
NAMES = tuple(SCRIPTS)


async def timed(name: str, call: Awaitable[Any]) -> Any:
    """A Redis round trip, in the metrics by ``name`` (its script's, or e.g. 'read_bulk')."""
    started = time.perf_counter()
    try:
        return await call
    except Exception as exc:
        metrics.REDIS_ERRORS.labels(name, type(exc).__name__).inc()
        raise
    finally:
        metrics.child(metrics.REDIS_SECONDS, name).observe(time.perf_counter() - started)


class NotReplicated(RedisTimeoutError):
    """``--min-replicas-ack``: the write is on the primary, but fewer replicas than
    required confirmed it in time. Its outcome is unknown to the client: a failover
    now could lose it (an append answers 504, as for a Redis timeout). Counted in
    ``ds_redis_errors_total{error="NotReplicated"}``."""


@dataclass(frozen=True)
class ReplicaAck:
    """Acknowledge a write only once ``replicas`` replicas have it (``WAIT``), or have
    it on disk (``WAITAOF``, Redis 7.2+), within ``timeout_ms``."""

    replicas: int
    timeout_ms: int
    aof: bool = False  # WAITAOF: the servers have it (chosen by Scripts.load)

    def queue(self, pipe: Pipeline) -> None:
        if self.aof:
            pipe.execute_command("WAITAOF", 0, self.replicas, self.timeout_ms)
        else:
            pipe.execute_command("WAIT", self.replicas, self.timeout_ms)

    def confirmed(self, reply: Any) -> int:
        """How many replicas confirmed, from WAIT's or WAITAOF's reply."""
        return int(reply[1]) if self.aof else int(reply)

    def shortfall(self, name: str, reply: Any) -> NotReplicated | None:
        """Why a write that ran is not acknowledged, from its WAIT's reply (cut short: a
        demoted primary; too few replicas in time), or None."""
        if isinstance(reply, Exception):
            missing = NotReplicated(f"{name}: stored, not confirmed by replicas: {reply}")
            missing.__cause__ = reply
            return missing
        if self.confirmed(reply) < self.replicas:
            return NotReplicated(
                f"{name}: {self.confirmed(reply)} of {self.replicas} replicas confirmed "
                f"within {self.timeout_ms} ms (--min-replicas-ack)"
            )
        return None


def replica_ack(replicas: int, timeout_seconds: float) -> ReplicaAck | None:
    """``--min-replicas-ack`` and its timeout, as a ReplicaAck (None: 0, do not wait)."""
    return ReplicaAck(replicas, max(1, round(timeout_seconds * 1000))) if replicas else None


def supports_waitaof(version: str) -> bool:
    """WAITAOF came with Redis 7.2."""
    return connections.version(version) >= (7, 2)


Item = TypeVar("Item")


class Scripts:
    """Every script, registered on one client (and routed by ``route``)."""

    def __init__(
        self,
        redis: Redis | RedisCluster,
        route: Route | None = None,
        *,
        replica_ack: ReplicaAck | None = None,
        answered: Callable[[], None] = lambda: None,
    ) -> None:
        self._redis = redis
        # Told of every script call Redis answered: the fan-out's listener reconnects at once
        # when Redis is back rather than at the end of its pause (live/listener.py).
        self._answered = answered
        self.cluster = isinstance(redis, RedisCluster)
        if self.cluster and route is None:
            raise ValueError("a Redis Cluster needs a ClusterRoute")
        self.route: Route = route or DirectRoute(cast(Redis, redis))
        self.replica_ack = replica_ack
        self._scripts: dict[str, AsyncScript] = {
            n: redis.register_script(source(n, self.cluster)) for n in NAMES
        }
        # One Redis, no replicas to wait for: redis-py's EVALSHA, the shortest path.
        self._direct = not self.cluster and replica_ack is None
        self._held: list[connections.Held] = []  # closed with the client

    @property
    def redis(self) -> Redis | RedisCluster:
        """The client for commands other than scripts."""
        return self._redis

    async def load(self) -> None:
        """Load every script now (on every primary of a cluster), so the first request
        does not pay for it; and see whether the servers have WAITAOF."""
        for script in self._scripts.values():
            script.sha = await self._redis.script_load(script.script)
        if self.replica_ack is not None:
            aof = await self._replicas_confirm_fsyncs()
            if aof != self.replica_ack.aof:
                self.replica_ack = ReplicaAck(self.replica_ack.replicas, self.replica_ack.timeout_ms, aof)
            log.info(
                "writes wait for %d replica(s) to confirm them (%s)",
                self.replica_ack.replicas,
                "WAITAOF: on their disks" if aof else "WAIT: received",
            )

    async def _replicas_confirm_fsyncs(self) -> bool:
        """Whether WAITAOF can be used: every node has it (Redis 7.2+) and writes an AOF (a
        replica without one never confirms, and every write would wait out the timeout).
        On one Redis its replicas cannot be asked: WAIT."""
        if not self.cluster:
            return False
        try:
            for target in await every_node(self._redis, replicas=True):
                version = str((await self._redis.info("server", **target))["redis_version"])
                appendonly = await self._redis.config_get("appendonly", **target)
                if not supports_waitaof(version) or text(appendonly.get("appendonly") or "") != "yes":
                    return False
        except RedisError:  # CONFIG forbidden (managed Redis), a node away: the safe choice
            return False
        return True

    async def aclose(self) -> None:
        """Close the client, the connections held (``hold``) and, on a cluster, the nodes' pools."""
        await self.close_held()
        if isinstance(self.route, ClusterRoute):
            await self.route.aclose()
        await self._redis.aclose()

    async def close_held(self) -> None:
        """Close the connections held (``hold``); a holder used again opens its own anew."""
        for held in self._held:
            with contextlib.suppress(RedisError, OSError):  # closing: its fate is the same
                await held.aclose()

    def hold(self) -> connections.Held | None:
        """A connection of its own for a caller that runs one script at a time (an append
        lane), to pass to ``run``; None where calls take another path (a cluster, replica
        acks: see ``call``)."""
        if not self._direct:
            return None
        held = connections.Held(cast(Redis, self._redis))
        self._held.append(held)
        return held

    def shas(self) -> list[str]:
        return [script.sha for script in self._scripts.values()]

    async def ready(self) -> None:
        """Raise unless Redis answers now. On one Redis it must also hold the scripts (loaded
        again if it lost them, e.g. a restart without persistence); on a cluster any node
        answering is enough: one shard away must not make every gateway unready (its
        streams answer 503)."""
        if isinstance(self._redis, RedisCluster):
            await self._redis.ping(target_nodes=RedisCluster.RANDOM)
            return
        await self._redis.ping()
        if not all(await self._redis.script_exists(*self.shas())):
            await self.load()

    async def call(
        self, name: str, script_keys: list[str], args: Sequence[Any], held: connections.Held | None = None
    ) -> Any:
        """Run a script on the node serving its keys (all of one slot); on one Redis over
        ``held`` if given (``hold``)."""
        script = self._scripts[name]
        if self._direct:
            if held is not None:
                return await held.run_script(script, script_keys, args)
            return await connections.run_script(cast(Redis, self._redis), script, script_keys, args)
        one = [(script_keys, args)]
        replies = await self.route.pipeline(
            script_keys[0], lambda pipe: self._queue(pipe, name, one), raise_on_error=False
        )
        if isinstance(replies[0], NoScriptError):  # it did not run (a node that never had it): send it whole
            replies = await self.route.pipeline(
                script_keys[0], lambda pipe: self._queue(pipe, name, one, by_sha=False), raise_on_error=False
            )
        if isinstance(replies[0], Exception):
            raise replies[0]
        ack = self._ack(name)
        missing = ack.shortfall(name, replies[1]) if ack is not None else None
        if missing is not None:
            raise missing
        return replies[0]

    def _ack(self, name: str) -> ReplicaAck | None:
        """The replicas a script waits for: writes only (``Script.writes``), with --min-replicas-ack."""
        return self.replica_ack if SCRIPTS[name].writes else None

    def _queue(
        self, pipe: Pipeline, name: str, calls: Sequence[tuple[list[str], Sequence[Any]]], by_sha: bool = True
    ) -> None:
        """Script ``name`` once per (keys, args), then the replicas' WAIT (it covers every
        write before it on the connection). ``by_sha`` False: EVAL, which also caches the
        script on that node (on the same connection, after any ASKING)."""
        script = self._scripts[name]
        for script_keys, args in calls:
            if by_sha:
                pipe.evalsha(script.sha, len(script_keys), *script_keys, *args)
            else:
                pipe.eval(cast(str, script.script), len(script_keys), *script_keys, *args)
        ack = self._ack(name)
        if ack is not None:
            ack.queue(pipe)

    async def command(self, key: str, *args: Any) -> Any:
        """One plain command on ``key`` (a read): on a cluster through the route, like the
        scripts (bounded waiting pools, redirects followed), not redis-py's cluster client,
        whose pools fail a burst instead of making it wait."""
        if not self.cluster:
            return await self._redis.execute_command(*args)
        (reply,) = await self.route.pipeline(key, lambda pipe: pipe.execute_command(*args))
        return reply

    async def write_watched(
        self, watch: Sequence[str], fields: Sequence[str], commands: WatchedWrite, name: str
    ) -> list[Any] | None:
        """``connections.watched_write`` (one Redis only, not a cluster), timed as ``name``."""
        redis = cast(Redis, self._redis)
        replies = await timed(name, connections.watched_write(redis, watch, fields, commands))
        self._answered()
        return replies

    async def run(
        self, name: str, script_keys: list[str], args: Sequence[Any], held: connections.Held | None = None
    ) -> Any:
        """Run a script, timed and counted in the metrics (over ``held``: see ``call``)."""
        reply = await timed(name, self.call(name, script_keys, args, held))
        self._answered()
        return reply

    async def run_each(self, name: str, calls: Sequence[tuple[list[str], Sequence[Any]]]) -> list[Any]:
        """Run ``name`` once per (keys, args) of ``calls`` (each call's keys share one slot),
        the calls to one node in one pipeline (one round trip and, with replica acks, one
        WAIT for them all), the nodes in flight together. Returns each call's result in
        order, or the exception it failed with (that call's alone).

        A call the pipeline's node did not run (its slot moved meanwhile, or the node lacks
        the script) is sent again on its own (``call``, redirects followed); a pipeline
        that failed after sending leaves all its calls' outcomes unknown."""
        if len(calls) == 1:
            done = await asyncio.gather(*(self.run(name, k, a) for k, a in calls), return_exceptions=True)
            return list(done)
        ack = self._ack(name)

        def queue(pipe: Pipeline, group: Sequence[int]) -> None:
            self._queue(pipe, name, [calls[i] for i in group])

        def answers(replies: list[Any]) -> list[Any]:
            missing = ack.shortfall(name, replies.pop()) if ack is not None else None
            return [missing if missing and not isinstance(r, Exception) else r for r in replies]

        replies = await self._grouped(
            name,
            [k[0] for k, _ in calls],
            queue,
            answers,
            lambda i: self.run(name, *calls[i]),
        )
        if not all(isinstance(r, BaseException) for r in replies):
            self._answered()
        return replies

    async def command_each(self, commands: Sequence[tuple[str, Sequence[Any]]]) -> list[Any]:
        """Plain commands, each (key, [command, args...]): on one Redis in one pipeline, on
        a cluster one pipeline per node (as ``run_each``). Each command's reply in order,
        or the exception it failed with."""

        def queue(pipe: Pipeline, group: Sequence[int]) -> None:
            for i in group:
                pipe.execute_command(*commands[i][1])

        return await self._grouped(
            "commands",
            [key for key, _ in commands],
            queue,
            lambda replies: replies,
            lambda i: self.command(commands[i][0], *commands[i][1]),
        )

    async def _grouped(
        self,
        name: str,
        first_keys: Sequence[str],
        queue: Callable[[Pipeline, Sequence[int]], None],
        answers: Callable[[list[Any]], list[Any]],
        alone: Callable[[int], Awaitable[Any]],
    ) -> list[Any]:
        """Calls sent by node: ``queue`` puts a group's calls on a pipeline, ``answers``
        turns its replies into the calls' results, ``alone(i)`` sends call i by itself
        (redirects followed) when its node did not run it or is not known now."""
        results: list[Any] = [None] * len(first_keys)

        async def one_by_one(indexes: list[int]) -> None:
            done = await asyncio.gather(*(alone(i) for i in indexes), return_exceptions=True)
            for i, result in zip(indexes, done, strict=True):
                results[i] = result

        async def together(indexes: list[int], send: Callable[[Queue], Awaitable[list[Any]]]) -> None:
            if len(indexes) == 1:
                return await one_by_one(indexes)
            try:
                replies = await timed(name, send(lambda pipe: queue(pipe, indexes)))
            except NotSent:
                return await one_by_one(indexes)  # none was sent
            except Exception as exc:
                for i in indexes:
                    results[i] = exc
                return None
            again = []
            for i, reply in zip(indexes, answers(list(replies)), strict=True):
                if did_not_run(reply) or isinstance(reply, NoScriptError):
                    again.append(i)
                else:
                    results[i] = reply
            if again:
                await one_by_one(again)
            return None

        everything = list(range(len(first_keys)))
        route = self.route
        if not isinstance(route, ClusterRoute):
            await together(everything, lambda q: route.pipeline(first_keys[0], q, raise_on_error=False))
            return results
        by_node: dict[str, list[int]] = {}
        for i, key in enumerate(first_keys):
            try:
                node = await route.node_of(key)
            except NotSent:
                node = ""  # not known now: sent on its own, which waits for the cluster
            by_node.setdefault(node, []).append(i)

        def sender(key: str) -> Callable[[Queue], Awaitable[list[Any]]]:
            return lambda q: route.send_once(key, q)

        await asyncio.gather(
            *(
                one_by_one(ix) if not node else together(ix, sender(first_keys[ix[0]]))
                for node, ix in by_node.items()
            )
        )
        return results

    async def on_stream(self, name: str, sid: str, *args: Any) -> Any:
        """Run a script on one stream's keys (``keys.stream_keys``), timed."""
        return await self.run(name, keys.stream_keys(sid), list(args))

    def by_slot(self, items: Sequence[Item], key: Any) -> list[list[Item]]:
        """``items`` split so that each part's keys (``key(item)``) share a Redis
        Cluster slot, in order within each part; on one Redis, one part."""
        if not self.cluster:
            return [list(items)]
        parts: dict[int, list[Item]] = {}
        for item in items:
            parts.setdefault(key_slot(key(item).encode()), []).append(item)
        return list(parts.values())


def connect_scripts(
    url: str,
    *,
    cluster: bool,
    max_connections: int,
    timeout: float,
    replica_ack: ReplicaAck | None = None,
    answered: Callable[[], None] = lambda: None,
) -> Scripts:
    """The scripts on the Redis at ``url`` (on the cluster ``url`` is a node of),
    through bounded pools (``connections.connect``). Nothing connects until first used.
    ``answered`` is called after every script call Redis answered."""
    if not cluster:
        return Scripts(connect(url, max_connections, timeout), replica_ack=replica_ack, answered=answered)
    redis = RedisCluster.from_url(
        url,
        max_connections=max_connections,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
    )
    route = ClusterRoute(redis, url, max_connections, timeout)
    return Scripts(redis, route, replica_ack=replica_ack, answered=answered)
