"""A real Redis Cluster on loopback for tests: 3 primaries and 3 replicas.

Started from ``redis-server`` binaries (no Docker), joined with ``redis-cli
--cluster create``, each node durable like production (AOF fsynced on every
write). Tests get handles to break it on purpose: kill, pause, fail over, and
move a hash slot while clients write (the resharding steps of the Redis
Cluster spec). Needs Redis 7+ (sharded pub/sub); ``cluster_unavailable()``
says why not, for a ``pytest.skip``.

Every wait is bounded and, when it gives up, says what it last saw and shows
the tail of each node's log.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.crc import key_slot
from redis.retry import Retry

from gateway.cli.embedded import find_redis_server

Role = Literal["primary", "replica", "down"]
SLOTS = 16384
HOST = "127.0.0.1"


class ClusterError(RuntimeError):
    """The cluster did not get where it was asked to go (the message has the nodes' log tails)."""


@dataclass(eq=False)  # one object per node, compared by identity: its role changes
class Node:
    port: int
    pid: int | None  # None while killed
    role: Role  # as the cluster last agreed; "down" after kill() until restart()
    id: str = ""  # the cluster node id (kept in nodes-<port>.conf across restarts)

    def __repr__(self) -> str:
        return f"Node({self.port}, {self.role})"


@dataclass(frozen=True)
class _Seen:
    """One line of CLUSTER NODES: how one node sees another."""

    role: Literal["primary", "replica"]
    primary_id: str | None
    slots: frozenset[int]
    flags: frozenset[str]


def _redis_version(binary: str) -> tuple[int, int]:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    found = re.search(r"v=(\d+)\.(\d+)", out)
    return (int(found[1]), int(found[2])) if found else (0, 0)


def _binaries() -> tuple[str, str]:
    """redis-server and a redis-cli: the one beside it first (same release), else from PATH."""
    server = find_redis_server()
    beside = Path(server).with_name("redis-cli")
    cli = str(beside) if beside.exists() else shutil.which("redis-cli")
    if cli is None:
        raise RuntimeError(f"no redis-cli beside {server} nor on PATH")
    return server, cli


def cluster_unavailable() -> str | None:
    """Why a cluster cannot be started here (for pytest.skip), or None."""
    try:
        server, _ = _binaries()
    except RuntimeError as e:
        return str(e)
    version = _redis_version(server)
    if version < (7, 0):
        # Sharded pub/sub (SSUBSCRIBE/SPUBLISH), which the cluster mode will use, came in 7.0.
        return f"Redis Cluster tests need redis-server >= 7.0; {server} is {version[0]}.{version[1]}"
    return None


def _port_pair_free(port: int) -> bool:
    """The port and its cluster bus port (port + 10000) can both be bound now."""
    if port + 10000 > 65535:
        return False
    for p in (port, port + 10000):
        with socket.socket() as s:
            try:
                s.bind((HOST, p))
            except OSError:
                return False
    return True


def _pick_port(taken: set[int]) -> int:
    from .conftest import free_port  # not at the top: conftest imports this module

    for _ in range(1000):
        port = free_port()
        if port + 10000 <= 65535 and not {port, port + 10000} & taken and _port_pair_free(port):
            return port
    raise ClusterError("no free port whose cluster bus port (+10000) is free too")


def _connect(port: int, decode: bool = True, timeout: float = 5) -> redis.Redis:
    # No retries: redis-py 8 retries a failed command 3 times with backoff (seconds, for a
    # stopped node); here the caller's wait loop decides.
    return redis.Redis(
        host=HOST,
        port=port,
        socket_timeout=timeout,
        socket_connect_timeout=2,
        decode_responses=decode,
        retry=Retry(NoBackoff(), 0),
    )


def _parse_nodes(text: str) -> dict[str, _Seen]:
    """CLUSTER NODES: <id> <ip:port@bus> <flags> <primary|-> <ping> <pong> <epoch> <link> <slot>..."""
    seen: dict[str, _Seen] = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 8:
            continue
        flags = frozenset(fields[2].split(","))
        slots: set[int] = set()
        for item in fields[8:]:
            if item.startswith("["):  # [slot->-id] / [slot-<-id]: migrating/importing, own line only
                continue
            first, _, last = item.partition("-")
            slots.update(range(int(first), int(last or first) + 1))
        seen[fields[0]] = _Seen(
            role="primary" if "master" in flags else "replica",
            primary_id=None if fields[3] == "-" else fields[3],
            slots=frozenset(slots),
            flags=flags,
        )
    return seen


class Cluster:
    def __init__(self, directory: Path, server: str, cli: str, node_timeout_ms: int) -> None:
        self.directory = directory
        self.server = server
        self.cli = cli
        self.node_timeout_ms = node_timeout_ms
        self.nodes: list[Node] = []
        self._processes: dict[int, subprocess.Popen[bytes]] = {}  # by port
        self._paused: set[int] = set()
        self._following: dict[str, str] = {}  # replica id -> primary id, as last agreed

    # -- addresses and clients ------------------------------------------------------------

    @property
    def seed_url(self) -> str:
        """One node's URL, redis-py style: ``RedisCluster.from_url(seed_url)`` discovers the rest
        (the first node's: if a test killed it, use ``startup_nodes``)."""
        return f"redis://{HOST}:{self.nodes[0].port}"

    url = seed_url

    @property
    def startup_nodes(self) -> list[ClusterNode]:
        """Every running node (fresh objects: a RedisCluster keeps connection state in them)."""
        return [ClusterNode(HOST, n.port) for n in self.nodes if n.pid is not None]

    def client(self, **options: object) -> RedisCluster:
        """A sync cluster client (follows MOVED and ASK); close it when done."""
        return RedisCluster(startup_nodes=self.startup_nodes, **options)  # type: ignore[arg-type]

    def connect(self, node: Node, decode: bool = True, timeout: float = 5) -> redis.Redis:
        """A plain connection to one node (no redirects followed: to ask that node itself;
        no retries either)."""
        return _connect(node.port, decode=decode, timeout=timeout)

    # -- topology -------------------------------------------------------------------------

    @property
    def primaries(self) -> list[Node]:
        return [n for n in self.nodes if n.role == "primary"]

    @property
    def replicas(self) -> list[Node]:
        return [n for n in self.nodes if n.role == "replica"]

    def node(self, node_id: str) -> Node:
        return next(n for n in self.nodes if n.id == node_id)

    def replica_of(self, primary: Node) -> Node:
        """The one replica of a primary (as last agreed)."""
        found = [self.node(r) for r, p in self._following.items() if p == primary.id]
        if len(found) != 1:
            raise ClusterError(f"{primary} has replicas {found}, not one")
        return found[0]

    def slot_owner(self, slot: int) -> Node:
        """The primary serving a slot, asked now of a running node."""
        asked = self._live()[0]
        with self.connect(asked) as c:
            seen = _parse_nodes(c.execute_command("CLUSTER", "NODES"))
        for node_id, s in seen.items():
            if s.role == "primary" and slot in s.slots:
                return self.node(node_id)
        raise ClusterError(f"{asked} knows no owner of slot {slot}")

    def primary_of(self, key: str | bytes) -> Node:
        """The primary serving a key (keys with the same {hash tag} share it)."""
        return self.slot_owner(key_slot(key.encode() if isinstance(key, str) else key))

    # -- faults ---------------------------------------------------------------------------

    def kill(self, node: Node) -> None:
        """SIGKILL: no shutdown (acknowledged writes are on disk anyway: appendfsync always).
        The cluster notices after node-timeout; ``wait_healthy()`` returns once the replica
        took over."""
        self._resume_if_paused(node)
        process = self._processes.pop(node.port)
        process.kill()
        process.wait()
        node.pid, node.role = None, "down"

    def restart(self, node: Node) -> None:
        """Start a killed node again on its port and directory (same id; it reloads its AOF and
        rejoins, as the replica of whoever took its slots). Then ``wait_healthy()``."""
        if node.pid is not None:
            raise ClusterError(f"{node} is running")
        self._start_process(node.port)
        node.pid = self._processes[node.port].pid

    def pause(self, node: Node) -> None:
        """SIGSTOP: alive but silent (a stalled VM, a long GC); the cluster may fail it over."""
        os.kill(self._processes[node.port].pid, signal.SIGSTOP)
        self._paused.add(node.port)

    def resume(self, node: Node) -> None:
        os.kill(self._processes[node.port].pid, signal.SIGCONT)
        self._paused.discard(node.port)

    def _resume_if_paused(self, node: Node) -> None:
        if node.port in self._paused:
            self.resume(node)

    def heal(self, timeout: float = 30) -> None:
        """Resume paused nodes, restart killed ones, and wait until the cluster is healthy:
        whole again (roles may have moved)."""
        for node in self.nodes:
            if node.pid is None:
                self.restart(node)
            self._resume_if_paused(node)
        self.wait_healthy(timeout, what="healing")

    def failover(self, replica: Node, timeout: float = 30) -> None:
        """A coordinated manual failover (CLUSTER FAILOVER on the replica: its primary stops
        writes, the replica catches up, then takes over; nothing acknowledged is lost). Returns
        once the replica is a primary, the old primary its replica, and the cluster healthy."""
        if replica.role != "replica":
            raise ClusterError(f"{replica} is not a replica")
        old = self.node(self._following[replica.id])
        with self.connect(replica) as c:
            c.execute_command("CLUSTER", "FAILOVER")

        def done() -> str | None:
            if replica.role != "primary" or self._following.get(old.id) != replica.id:
                return f"{replica} not yet the primary of {old}"
            return None

        self.wait_healthy(timeout, also=done, what=f"failover to {replica}")

    # -- resharding -----------------------------------------------------------------------

    def migrate_slot(self, slot: int, to_node: Node, batch: int = 100, timeout: float = 30) -> int:
        """Move a hash slot and its keys to another primary while clients go on using it; how
        many keys were moved. The steps of the Redis Cluster spec (CLUSTER SETSLOT docs):

        1. target IMPORTING, then source MIGRATING: in that order, so that when the source
           starts answering ASK for keys it lacks, the target already accepts them (after ASKING);
        2. MIGRATE the keys in batches (each batch atomic: a key is on one node at a time; the
           source keeps serving keys it still has, so a write lands wherever the key is);
        3. SETSLOT NODE on the target first (it must own the slot before the source sends
           clients there with MOVED), then the source, then the other primaries (gossip would
           tell them too, later).

        A primary that gives away its last slot becomes a replica (cluster-allow-replica-migration).
        """
        source = self.slot_owner(slot)
        if source is to_node:
            return 0
        if to_node.role != "primary":
            raise ClusterError(f"{to_node} is not a primary")
        moved = 0
        with self.connect(to_node, decode=False) as target, self.connect(source, decode=False) as src:
            target.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source.id)
            src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", to_node.id)
            # No new key can appear on the source now (it answers ASK for a missing key), so
            # once GETKEYSINSLOT is empty it stays empty.
            while keys := src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, batch):
                self._migrate(src, to_node, keys)
                moved += len(keys)
            for node in [to_node, source, *(p for p in self.primaries if p not in (to_node, source))]:
                with self.connect(node) as c:
                    c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", to_node.id)

        def owned() -> str | None:
            # After the health check every running node agrees, so one view is enough.
            return None if self.slot_owner(slot) is to_node else f"slot {slot} not yet on {to_node}"

        self.wait_healthy(timeout, also=owned, what=f"slot {slot} to {to_node}")
        return moved

    def _migrate(self, src: redis.Redis, to_node: Node, keys: list[bytes]) -> None:
        command = ["MIGRATE", HOST, to_node.port, "", 0, 5000]
        for attempt in range(3):
            try:
                # REPLACE only on a retry: after an IOERR the target may hold a copy, but the
                # source's is the one clients have been writing (they reach the target only for
                # keys the source lacks). A first-attempt BUSYKEY is a bug: let it raise.
                src.execute_command(*command, *(["REPLACE"] if attempt else []), "KEYS", *keys)
                return
            except redis.ResponseError as e:
                if "IOERR" not in str(e) or attempt == 2:
                    raise

    # -- health ---------------------------------------------------------------------------

    def _live(self) -> list[Node]:
        """Nodes that answer: running and not paused."""
        return [n for n in self.nodes if n.pid is not None and n.port not in self._paused]

    def _health(self) -> str | None:
        """None when: every running node says cluster_state:ok, they all see the same topology
        (roles, primaries, slots) with nobody flagged failing, running primaries cover all
        16384 slots (a just-killed primary still does until its failure is noticed), and every
        replica's link to its primary is up. What is wrong, otherwise. Roles are updated."""
        live = self._live()
        ids = {n.id for n in live}
        agreed: dict[str, _Seen] | None = None
        for node in live:
            with self.connect(node) as c:
                info = c.execute_command("CLUSTER", "INFO")
                if "cluster_state:ok" not in info:
                    return f"{node}: cluster_state not ok"
                seen = _parse_nodes(c.execute_command("CLUSTER", "NODES"))
            if not ids <= set(seen):
                return f"{node} does not know {ids - set(seen)}"
            view = {i: s for i, s in seen.items() if i in ids}
            failing = [i for i, s in view.items() if s.flags & {"fail", "fail?", "handshake", "noaddr"}]
            if failing:
                return f"{node} sees {[self.node(i) for i in failing]} failing"
            # Compared without flags (they hold "myself") and only over running nodes.
            view = {i: _Seen(s.role, s.primary_id, s.slots, frozenset()) for i, s in view.items()}
            if agreed is None:
                agreed = view
            elif view != agreed:
                return f"{node} and {live[0]} disagree on the topology"
        if agreed is None:
            return "no running node"
        covered = sum(len(s.slots) for s in agreed.values() if s.role == "primary")
        if covered != SLOTS:
            return f"running primaries serve {covered} of {SLOTS} slots"
        for node in live:
            if agreed[node.id].role == "replica":
                with self.connect(node) as c:
                    replication = c.info("replication")
                # A node mid-failover may answer as a primary still (no link fields yet): not there.
                link = replication.get("master_link_status")
                syncing = replication.get("master_sync_in_progress")
                if link != "up" or syncing:
                    return f"{node}: link to its primary not up (or still syncing)"
        for node in live:
            node.role = agreed[node.id].role
        self._following = {i: s.primary_id for i, s in agreed.items() if s.primary_id}
        return None

    def wait_healthy(
        self, timeout: float = 30, also: Callable[[], str | None] | None = None, what: str = "healthy cluster"
    ) -> None:
        """Until ``_health()`` (and then ``also``) finds nothing wrong."""

        def check() -> str | None:
            return self._health() or (also() if also else None)

        self._wait(what, check, timeout)

    def _wait(self, what: str, check: Callable[[], str | None], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                problem = check()
            except (redis.RedisError, OSError) as e:  # a node restarting, loading, or just killed
                problem = f"{type(e).__name__}: {e}"
            if problem is None:
                return
            if time.monotonic() > deadline:
                raise ClusterError(f"{what}: still not there after {timeout:.0f} s: {problem}\n{self.logs()}")
            time.sleep(0.05)

    def logs(self, lines: int = 15) -> str:
        """The tail of every node's log, for error messages."""
        parts = []
        for node in self.nodes:
            log = self._dir(node.port) / "redis.log"
            tail = log.read_text(errors="replace").splitlines()[-lines:] if log.exists() else ["(no log)"]
            parts.append(f"--- {node} log:\n" + "\n".join(tail))
        return "\n".join(parts)

    # -- processes ------------------------------------------------------------------------

    def _dir(self, port: int) -> Path:
        return self.directory / f"node-{port}"

    def _start_process(self, port: int, timeout: float = 30) -> None:
        """Start one redis-server and wait until it answers PING."""
        directory = self._dir(port)
        directory.mkdir(parents=True, exist_ok=True)
        command = [
            self.server,
            "--port", str(port),
            "--bind", HOST,
            "--cluster-enabled", "yes",
            "--cluster-config-file", f"nodes-{port}.conf",  # in --dir
            "--cluster-node-timeout", str(self.node_timeout_ms),
            "--appendonly", "yes",
            "--appendfsync", "always",
            "--save", "",
            # A replica's full sync starts at once (the default waits 5 s for more replicas to
            # share one transfer: there is only ever one per primary here).
            "--repl-diskless-sync-delay", "0",
            "--dir", str(directory),
            "--logfile", str(directory / "redis.log"),
            "--daemonize", "no",
        ]  # fmt: skip
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL)
        self._processes[port] = process
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if process.poll() is not None:
                del self._processes[port]
                log = directory / "redis.log"
                tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
                raise ClusterError(f"redis-server on port {port} exited with {process.returncode}:\n{tail}")
            try:
                with _connect(port, timeout=1) as c:
                    if c.ping():
                        return
            except redis.BusyLoadingError:
                deadline = time.monotonic() + timeout  # a long AOF: loading is progress
            except (redis.ConnectionError, redis.TimeoutError):
                pass
            time.sleep(0.05)
        raise ClusterError(f"redis-server on port {port} did not answer in {timeout:.0f} s")

    def start(self) -> None:
        taken: set[int] = set()
        for _ in range(6):
            for attempt in range(3):
                port = _pick_port(taken)
                try:
                    self._start_process(port)
                    break
                except ClusterError as e:  # someone took the port since we looked: another one
                    if "Address already in use" not in str(e) or attempt == 2:
                        raise
                    shutil.rmtree(self._dir(port), ignore_errors=True)
            taken |= {port, port + 10000}
            with _connect(port) as c:
                node_id = c.execute_command("CLUSTER", "MYID")
            self.nodes.append(Node(port, self._processes[port].pid, "primary", node_id))
        # The first three become primaries, the last three their replicas (redis-cli's choice of
        # which replica for which primary; on one host it warns, harmlessly, about anti-affinity).
        created = subprocess.run(
            [self.cli, "--cluster", "create", *(f"{HOST}:{n.port}" for n in self.nodes)]
            + ["--cluster-replicas", "1", "--cluster-yes"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if created.returncode != 0:
            output = created.stdout + created.stderr
            raise ClusterError(f"redis-cli --cluster create failed:\n{output}\n{self.logs()}")
        self.wait_healthy(60, what="cluster creation")

    def stop(self) -> None:
        """Terminate every node (resumed first: a stopped process cannot act on SIGTERM), wait,
        and remove their directories."""
        for port in list(self._paused):
            os.kill(self._processes[port].pid, signal.SIGCONT)
        self._paused.clear()
        for process in self._processes.values():
            process.terminate()
        for process in self._processes.values():
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._processes.clear()
        for node in self.nodes:
            node.pid, node.role = None, "down"
            shutil.rmtree(self._dir(node.port), ignore_errors=True)


@contextlib.contextmanager
def start_cluster(directory: os.PathLike[str], node_timeout_ms: int = 2000) -> Iterator[Cluster]:
    """A healthy 3+3 cluster with its nodes' files under ``directory``; stopped on exit.
    Raises RuntimeError where ``cluster_unavailable()`` has a reason."""
    reason = cluster_unavailable()
    if reason:
        raise RuntimeError(reason)
    server, cli = _binaries()
    cluster = Cluster(Path(directory).resolve(), server, cli, node_timeout_ms)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
