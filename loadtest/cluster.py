"""One Redis against a Redis Cluster: appends/s, p99, and the Redis CPU of every node.

    python -m loadtest.cluster [--seconds 5] [--rounds 3] [--scenarios ...] [--setups ...]
    python -m loadtest.compare --cluster [the same options]

Setups (``--setups`` picks some), each one gateway process (``ours``):

* ``one``: on an embedded redis-server (Unix socket, AOF fsync always), as
  ``loadtest.compare`` runs it;
* ``one-replica``: on a redis-server over loopback TCP with one replica
  (``REPLICAOF``; both AOF fsync always); ``one-replica-ack``: the same with
  ``--min-replicas-ack 1``;
* ``cluster``: on a Redis Cluster of 3 primaries and 3 replicas
  (``tests/cluster.py``: loopback, AOF fsync always), ``--redis-cluster``;
  ``cluster-ack``: the same with ``--min-replicas-ack 1``.

Everything starts first and stays up; the append scenarios (wrk, as in
``loadtest.appends``) then run interleaved: for each round and scenario every
setup in turn, the order rotated each time, so that a shared machine's drift
spreads over all of them. Around each run every node of the setup is read
(``INFO cpu``: used_cpu_sys + used_cpu_user; ``INFO commandstats``: calls;
``LATENCY LATEST``: the longest AOF fsync) and so is the gateway's CPU (/proc).
After each run its streams are deleted, replicas are waited for and every AOF
rewritten (automatic rewrites are off, so that none lands inside a run).

Writes ``<out>.json`` (every run, and the summary), ``<out>.md`` (two tables:
appends per setup; Redis CPU per node per 1,000 appends and its share) and
``<out>.png``. Everything runs on this machine: a cluster of six redis-servers
competes with the gateway and the load generator for the same cores, so this
shows how load splits over shards and what replica acks cost, not a scale-out.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import redis

from gateway.cli.embedded import EmbeddedRedis

from .appends import run_appends, scenario
from .servers import Running, free_port, start, use_uvloop

# key: (column title, Redis deployment, --min-replicas-ack)
SETUPS: dict[str, tuple[str, str, int]] = {
    "one": ("one Redis", "one", 0),
    "one-replica": ("one Redis + replica", "pair", 0),
    "one-replica-ack": ("one Redis + replica, ack 1", "pair", 1),
    "cluster": ("cluster 3+3", "cluster", 0),
    "cluster-ack": ("cluster 3+3, ack 1", "cluster", 1),
}
DEFAULT_SCENARIOS = ("64w-1000s-100B", "64w-1s-100B", "8w-64s-64KiB")
SCRIPT_COMMANDS = ("cmdstat_evalsha", "cmdstat_eval", "cmdstat_evalsha_ro", "cmdstat_eval_ro")


@dataclass(eq=False)
class RedisNode:
    label: str  # "one", "primary", "replica", "primary A", "replica A", ...
    role: str  # "primary" or "replica"
    client: redis.Redis
    primary: RedisNode | None = None  # a replica's


@dataclass
class NodeDelta:
    role: str
    cpu_seconds: float
    calls: int
    script_calls: int
    wait_calls: int
    longest_fsync_ms: int


def _sample(node: RedisNode) -> tuple[float, int, int, int]:
    """CPU seconds, commands, script calls and WAITs the node has served so far."""
    cpu = node.client.info("cpu")
    stats = node.client.info("commandstats")
    calls = sum(int(v["calls"]) for v in stats.values())
    scripts = sum(int(stats[c]["calls"]) for c in SCRIPT_COMMANDS if c in stats)
    waits = sum(int(stats[c]["calls"]) for c in ("cmdstat_wait", "cmdstat_waitaof") if c in stats)
    return float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"]), calls, scripts, waits


def cores() -> int:
    return sum(1 for line in Path("/proc/stat").read_text().splitlines() if line[:3] == "cpu") - 1


def machine_busy_percent(seconds: float) -> float:
    """How busy the machine is without us (other work on a shared machine), over ``seconds``."""
    before = _machine_busy()
    time.sleep(seconds)
    busy, total = (now - then for now, then in zip(_machine_busy(), before, strict=True))
    return 100 * cores() * busy / max(1, total)


def _machine_busy() -> tuple[int, int]:
    """(busy, total) jiffies of all cores so far (/proc/stat)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


class NodeMeter:
    """Read around one run: every node's counters, the machine's CPU, the wall time."""

    def __init__(self, nodes: Sequence[RedisNode]) -> None:
        self.nodes = nodes
        self.deltas: dict[str, NodeDelta] = {}
        self.machine_busy_percent = 0.0  # of all cores: 200 = both of 2 busy
        self.seconds = 0.0

    def __enter__(self) -> NodeMeter:
        for node in self.nodes:
            node.client.execute_command("LATENCY", "RESET")
        self._before = {node.label: _sample(node) for node in self.nodes}
        self._machine = _machine_busy()
        self._started = time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.monotonic() - self._started
        busy, total = (now - then for now, then in zip(_machine_busy(), self._machine, strict=True))
        self.machine_busy_percent = 100 * cores() * busy / max(1, total)
        for node in self.nodes:
            after = _sample(node)
            before = self._before[node.label]
            events = {e[0].decode(): int(e[3]) for e in node.client.execute_command("LATENCY", "LATEST")}
            self.deltas[node.label] = NodeDelta(
                role=node.role,
                cpu_seconds=round(after[0] - before[0], 4),
                calls=after[1] - before[1],
                script_calls=after[2] - before[2],
                wait_calls=after[3] - before[3],
                longest_fsync_ms=events.get("aof-fsync-always", 0),
            )


# -- the Redis deployments ----------------------------------------------------------------


class _Replica(EmbeddedRedis):
    """A redis-server like the embedded one (AOF fsync always), replica of ``primary_port``."""

    def __init__(self, data_dir: Path, port: int, primary_port: int) -> None:
        super().__init__(data_dir, port=port)
        self.primary_port = primary_port

    def command(self) -> list[str]:
        return [*super().command(), "--replicaof", "127.0.0.1", str(self.primary_port)]


def _wait(what: str, ready: Callable[[], bool], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not after {timeout:.0f} s")
        time.sleep(0.05)


@contextlib.contextmanager
def replicated_pair(directory: Path) -> Iterator[tuple[str, list[RedisNode]]]:
    """A redis-server on a loopback port and its replica: (the primary's URL, the two nodes)."""
    primary = EmbeddedRedis(directory / "primary", port=free_port())
    primary.start()
    try:
        replica = _Replica(directory / "replica", free_port(), primary.port)
        replica.start()
        try:
            nodes = [RedisNode("primary", "primary", redis.Redis("127.0.0.1", primary.port))]
            nodes.append(RedisNode("replica", "replica", redis.Redis("127.0.0.1", replica.port), nodes[0]))
            _wait(
                "replica in sync", lambda: nodes[1].client.info("replication")["master_link_status"] == "up"
            )
            yield primary.url, nodes
        finally:
            replica.stop()
    finally:
        primary.stop()


@contextlib.contextmanager
def redis_cluster(directory: Path) -> Iterator[tuple[str, list[RedisNode]]]:
    """tests/cluster.py's 3+3 cluster (node timeout 15 s, Redis' default: a run on a busy
    machine must not fail a node over): (a seed URL, primaries A-C, then their replicas)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root, for tests.cluster
    from tests.cluster import start_cluster

    with start_cluster(directory, node_timeout_ms=15000) as cluster:
        nodes: list[RedisNode] = []
        for letter, node in zip("ABC", cluster.primaries, strict=True):
            primary = RedisNode(f"primary {letter}", "primary", cluster.connect(node, decode=False))
            replica = cluster.replica_of(node)
            nodes.append(primary)
            nodes.append(
                RedisNode(f"replica {letter}", "replica", cluster.connect(replica, decode=False), primary)
            )
        nodes.sort(key=lambda n: n.role != "primary")  # primaries first, then replicas, in order
        yield cluster.seed_url, nodes


def prepare(nodes: Sequence[RedisNode]) -> None:
    """No automatic AOF rewrite (each run is followed by one instead), fsync stalls logged."""
    for node in nodes:
        node.client.config_set("auto-aof-rewrite-percentage", 0)
        node.client.config_set("latency-monitor-threshold", 5)


def roles_as_started(nodes: Sequence[RedisNode]) -> bool:
    """No failover happened: every node still has the role it started with."""
    expected = {"primary": "master", "replica": "slave"}
    return all(n.client.info("replication")["role"] == expected[n.role] for n in nodes)


def settle(nodes: Sequence[RedisNode]) -> None:
    """After a run: its streams deleted, replicas caught up, every AOF rewritten (small again)."""
    for node in nodes:
        if node.role == "primary":
            pipe = node.client.pipeline(transaction=False)
            for key in node.client.scan_iter(match="ds:{*", count=1000):
                pipe.delete(key)
            pipe.execute()
    for node in nodes:
        if node.primary is not None:
            replica, primary = node.client, node.primary.client

            def caught_up(replica: redis.Redis = replica, primary: redis.Redis = primary) -> bool:
                target = primary.info("replication")["master_repl_offset"]
                return replica.info("replication")["slave_repl_offset"] >= target

            _wait(f"{node.label} caught up", caught_up)
    for node in nodes:
        with contextlib.suppress(redis.ResponseError):  # one already under way
            node.client.bgrewriteaof()

    def rewritten() -> bool:
        for node in nodes:
            info = node.client.info("persistence")
            if info["aof_rewrite_in_progress"] or info["aof_rewrite_scheduled"]:
                return False
        return True

    _wait("AOF rewrites", rewritten, timeout=300)


# -- runs ---------------------------------------------------------------------------------


@dataclass
class Run:
    setup: str
    scenario: str
    round: int
    appends_per_second: float
    appends: int
    mean_ms: float
    p50_ms: float
    p99_ms: float
    errors: dict[str, int]
    gateway_cpu_seconds: float | None
    machine_busy_percent: float
    seconds: float
    roles_unchanged: bool
    nodes: dict[str, NodeDelta] = field(default_factory=dict)


def run_once(
    setup: str, name: str, round_: int, gateway: Running, nodes: Sequence[RedisNode], seconds: float
) -> Run:
    meter = NodeMeter(nodes)
    r = asyncio.run(run_appends(gateway.base_url, "ours", name, seconds, gateway.pid, measure=lambda: meter))
    load_seconds = max(1, round(seconds))  # wrk's -d, over which its rate is counted
    run = Run(
        setup=setup,
        scenario=name,
        round=round_,
        appends_per_second=r.appends_per_second,
        appends=round(r.appends_per_second * load_seconds),
        mean_ms=r.mean_ms,
        p50_ms=r.p50_ms,
        p99_ms=r.p99_ms,
        errors=r.errors,
        gateway_cpu_seconds=None
        if r.server_cpu_percent is None
        else round(r.server_cpu_percent / 100 * load_seconds, 3),
        machine_busy_percent=round(meter.machine_busy_percent, 1),
        seconds=round(meter.seconds, 2),
        roles_unchanged=roles_as_started(nodes),
        nodes=meter.deltas,
    )
    settle(nodes)
    return run


def by_load(nodes: dict[str, NodeDelta]) -> dict[str, NodeDelta]:
    """Several primaries renamed by load, busiest first: "primary 1", "primary 2", ..., each
    replica after its primary ("replica 1": the busiest primary's). Each run writes to new
    streams, which land on any shard: a one-stream scenario loads A in one round and C in the
    next, so summed by name the shares would describe the rounds, not the split."""
    primaries = [label for label, d in nodes.items() if d.role == "primary"]
    if len(primaries) < 2:
        return nodes
    primaries.sort(key=lambda label: -nodes[label].cpu_seconds)
    out = {f"primary {rank}": nodes[label] for rank, label in enumerate(primaries, 1)}
    for rank, label in enumerate(primaries, 1):
        replica = label.replace("primary", "replica")
        if replica in nodes:
            out[f"replica {rank}"] = nodes[replica]
    return out


def summarize(runs: Sequence[Run]) -> dict:
    """Per scenario and setup: median rate and p99 over the rounds; CPU per 1,000 appends
    from the sums over the rounds (ms of CPU per 1,000 appends = µs per append), by node,
    several primaries ranked by load in each run (``by_load``)."""
    out: dict[str, dict[str, dict]] = {}
    for run in runs:
        ranked = Run(**{**run.__dict__, "nodes": by_load(run.nodes)})
        out.setdefault(run.scenario, {}).setdefault(run.setup, {"runs": []})["runs"].append(ranked)
    for name, by_setup in out.items():
        size = scenario(name)[2]
        for setup, entry in by_setup.items():
            rs: list[Run] = entry.pop("runs")
            appends = sum(r.appends for r in rs) or 1
            per_1k = 1e6 / appends  # seconds -> ms per 1,000 appends
            redis_cpu = sum(d.cpu_seconds for r in rs for d in r.nodes.values())
            nodes = {}
            for label, first in rs[0].nodes.items():
                cpu = sum(r.nodes[label].cpu_seconds for r in rs)
                nodes[label] = {
                    "role": first.role,
                    "cpu_ms_per_1k": round(cpu * per_1k, 2),
                    "share": round(cpu / redis_cpu, 3) if redis_cpu else 0.0,
                    "calls_per_1k": round(sum(r.nodes[label].calls for r in rs) * 1000 / appends, 1),
                    "script_calls_per_1k": round(
                        sum(r.nodes[label].script_calls for r in rs) * 1000 / appends, 1
                    ),
                    "wait_calls_per_1k": round(
                        sum(r.nodes[label].wait_calls for r in rs) * 1000 / appends, 1
                    ),
                    "longest_fsync_ms": max(r.nodes[label].longest_fsync_ms for r in rs),
                }
            gateway = [r.gateway_cpu_seconds for r in rs if r.gateway_cpu_seconds is not None]
            errors: Counter[str] = Counter()
            for r in rs:
                errors.update(r.errors)
            entry.update(
                title=SETUPS[setup][0],
                rounds=len(rs),
                appends_per_second=round(statistics.median(r.appends_per_second for r in rs)),
                appends_per_second_each=[r.appends_per_second for r in rs],
                mb_per_second=round(statistics.median(r.appends_per_second for r in rs) * size / 1e6, 1),
                p99_ms=round(statistics.median(r.p99_ms for r in rs), 2),
                p99_ms_each=[r.p99_ms for r in rs],
                p50_ms=round(statistics.median(r.p50_ms for r in rs), 2),
                gateway_cpu_ms_per_1k=round(sum(gateway) * per_1k, 1) if gateway else None,
                redis_cpu_ms_per_1k=round(redis_cpu * per_1k, 2),
                machine_busy_percent=round(statistics.median(r.machine_busy_percent for r in rs)),
                errors=dict(errors),
                roles_unchanged=all(r.roles_unchanged for r in rs),
                nodes=nodes,
            )
    return out


# -- output -------------------------------------------------------------------------------


def scenario_title(name: str) -> str:
    writers, streams, size, _ = scenario(name)
    body = f"{size // 1024} KiB" if size >= 1024 else f"{size} B"
    where = "one stream" if streams == 1 else f"{streams:,} streams"
    return f"{writers} writers, {where}, {body}"


def _ms(value: float) -> str:
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def _rate(entry: dict, name: str) -> str:
    if scenario(name)[2] >= 1024:
        return f"{entry['appends_per_second']:,}/s = {entry['mb_per_second']:g} MB/s"
    return f"{entry['appends_per_second']:,}/s"


def table(summary: dict, setups: Sequence[str]) -> str:
    titles = [SETUPS[s][0] for s in setups]
    lines = ["| appends, median of rounds | " + " | ".join(titles) + " |", "|---|" + "---:|" * len(setups)]
    for name, by_setup in summary.items():
        cells = []
        for s in setups:
            e = by_setup[s]
            errors = sum(e["errors"].values())
            extra = f" (+{errors:,} errors)" if errors else ""
            cells.append(f"{_rate(e, name)}, p99 {_ms(e['p99_ms'])} ms{extra}")
        lines.append(f"| {scenario_title(name)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _nodes_cell(entry: dict, role: str) -> str:
    nodes = [(label, n) for label, n in entry["nodes"].items() if n["role"] == role]
    if not nodes:
        return "–"
    if len(nodes) == 1:
        n = nodes[0][1]
        return f"{n['cpu_ms_per_1k']:.1f} ({100 * n['share']:.0f}%)"
    return " · ".join(f"{n['cpu_ms_per_1k']:.1f} ({100 * n['share']:.0f}%)" for _, n in nodes)


def _calls_cell(entry: dict) -> str:
    nodes = [(label, n) for label, n in entry["nodes"].items() if n["role"] == "primary"]
    if len(nodes) == 1:
        return f"{nodes[0][1]['script_calls_per_1k']:.0f}"
    return " · ".join(f"{n['script_calls_per_1k']:.0f}" for _, n in nodes)


def cpu_table(summary: dict, setups: Sequence[str]) -> str:
    lines = [
        "| scenario | setup | gateway CPU, ms per 1,000 appends | Redis CPU, all nodes "
        "| primaries, busiest first (share of Redis CPU) | their replicas (share) "
        "| script calls per 1,000 appends, per primary | machine busy, all cores |",
        "|---|---|---:|---:|---|---|---|---:|",
    ]
    for name, by_setup in summary.items():
        for s in setups:
            e = by_setup[s]
            gateway = "–" if e["gateway_cpu_ms_per_1k"] is None else f"{e['gateway_cpu_ms_per_1k']:.0f}"
            lines.append(
                f"| {scenario_title(name)} | {e['title']} | {gateway} | {e['redis_cpu_ms_per_1k']:.0f} "
                f"| {_nodes_cell(e, 'primary')} | {_nodes_cell(e, 'replica')} | {_calls_cell(e)} "
                f"| {e['machine_busy_percent']}% |"
            )
    return "\n".join(lines) + "\n"


def plot(summary: dict, setups: Sequence[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary)
    fig, axes = plt.subplots(2, len(names), figsize=(4.6 * len(names), 7.5), squeeze=False)
    blues = ["#1f4e99", "#3f7fd0", "#8fb8ee"]
    oranges = ["#b35900", "#e8871e", "#f5c27a"]
    x = list(range(len(setups)))
    labels = [SETUPS[s][0].replace(", ", ",\n").replace(" + ", " +\n") for s in setups]
    for column, name in enumerate(names):
        rate_ax, cpu_ax = axes[0][column], axes[1][column]
        entries = [summary[name][s] for s in setups]
        rates = [e["appends_per_second"] for e in entries]
        low = [r - min(e["appends_per_second_each"]) for r, e in zip(rates, entries, strict=True)]
        high = [max(e["appends_per_second_each"]) - r for r, e in zip(rates, entries, strict=True)]
        rate_ax.bar(x, rates, color="#5a8f5a", yerr=[low, high], capsize=3)
        for i, e in enumerate(entries):
            rate_ax.annotate(f"p99\n{_ms(e['p99_ms'])} ms", (i, 0), ha="center", va="bottom", color="white",
                             fontsize=8, xytext=(0, 4), textcoords="offset points")  # fmt: skip
        rate_ax.set_title(scenario_title(name), fontsize=10)
        rate_ax.set_ylabel("appends/s (median, min-max of rounds)")
        rate_ax.set_ylim(0, max(max(e["appends_per_second_each"]) for e in entries) * 1.2)
        bottoms = [0.0] * len(setups)
        seen: set[str] = set()
        for i, e in enumerate(entries):
            primaries = [(lb, n) for lb, n in e["nodes"].items() if n["role"] == "primary"]
            replicas = [(lb, n) for lb, n in e["nodes"].items() if n["role"] == "replica"]
            for group, colors in ((primaries, blues), (replicas, oranges)):
                for k, (label, n) in enumerate(group):
                    tag = label if len(group) > 1 else f"{n['role']} 1"  # one Redis: its primary is 1
                    legend = None if tag in seen else tag
                    cpu_ax.bar(i, n["cpu_ms_per_1k"], bottom=bottoms[i], color=colors[k % 3],
                               edgecolor="white", linewidth=0.5, label=legend)  # fmt: skip
                    seen.add(tag)
                    bottoms[i] += n["cpu_ms_per_1k"]
        cpu_ax.set_ylabel("Redis CPU ms per 1,000 appends, by node")
        for ax in (rate_ax, cpu_ax):
            ax.set_xticks(x, labels, fontsize=7)
            ax.grid(True, axis="y", alpha=0.3)
        if column == len(names) - 1:
            cpu_ax.legend(fontsize=7)
    fig.suptitle("One Redis vs a 3+3 Redis Cluster, all on one 2-core machine (one gateway process)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


# -- main ---------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.cluster",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--seconds", type=float, default=5.0, help="seconds per run (wrk)")
    parser.add_argument("--rounds", type=int, default=3, help="every scenario on every setup this many times")
    parser.add_argument(
        "--scenarios", default=",".join(DEFAULT_SCENARIOS), help="names of loadtest/appends.py"
    )
    parser.add_argument("--setups", default=",".join(SETUPS), help=f"comma list of {', '.join(SETUPS)}")
    parser.add_argument(
        "--warmup-seconds", type=float, default=1.0, help="a first run per setup, not counted"
    )
    parser.add_argument("--out", default="loadtest/results/cluster")
    parser.add_argument("--from-json", type=Path, help="no run: the tables and plot again, from this JSON")
    args = parser.parse_args(argv)
    if args.from_json:
        write(*load(args.from_json), Path(args.out))
        return
    setups = args.setups.split(",")
    names = args.scenarios.split(",")
    for name in names:
        scenario(name)  # a KeyError now, not after the start-up
    use_uvloop()
    runs: list[Run] = []
    idle = machine_busy_percent(2.0)
    print(f"machine busy before starting: {idle:.0f}% (of {100 * cores()}%)", flush=True)
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ds-cluster-bench-") as folder, contextlib.ExitStack() as stack:
        deployments: dict[str, tuple[str, list[RedisNode]]] = {}
        needed = {SETUPS[s][1] for s in setups}
        if "pair" in needed:
            deployments["pair"] = stack.enter_context(replicated_pair(Path(folder, "pair")))
        if "cluster" in needed:
            deployments["cluster"] = stack.enter_context(redis_cluster(Path(folder, "cluster")))
        gateways: dict[str, tuple[Running, list[RedisNode]]] = {}
        for setup in setups:
            _, where, ack = SETUPS[setup]
            options: list[str] = []
            if where != "one":
                options += ["--redis-url", deployments[where][0]]
            if where == "cluster":
                options.append("--redis-cluster")
            if ack:
                options += ["--min-replicas-ack", str(ack)]
            server = stack.enter_context(start("ours", *options))
            if where == "one":
                socket = Path(server.data_dir, "redis.sock")
                nodes = [RedisNode("one", "primary", redis.Redis(unix_socket_path=str(socket)))]
            else:
                nodes = deployments[where][1]
            gateways[setup] = (server, nodes)
        for nodes in {id(n): n for _, n in gateways.values()}.values():  # each deployment once
            prepare(nodes)
            for node in nodes:
                stack.callback(node.client.close)
        print(f"started {', '.join(setups)} in {time.monotonic() - began:.0f} s", flush=True)
        if args.warmup_seconds:
            for setup, (server, nodes) in gateways.items():
                run_once(setup, names[0], -1, server, nodes, args.warmup_seconds)
        for round_ in range(args.rounds):
            for i, name in enumerate(names):
                shift = (round_ + i) % len(setups)
                for setup in setups[shift:] + setups[:shift]:
                    server, nodes = gateways[setup]
                    run = run_once(setup, name, round_, server, nodes, args.seconds)
                    runs.append(run)
                    cpu = " ".join(f"{lb}={d.cpu_seconds:.2f}s" for lb, d in run.nodes.items())
                    fsync = max(d.longest_fsync_ms for d in run.nodes.values())
                    warn = "" if run.roles_unchanged else "  ROLES CHANGED (a failover?)"
                    print(f"round {round_} {name:<15} {setup:<16} {run.appends_per_second:>9,.0f}/s "
                          f"p99 {run.p99_ms:>6} ms errors {run.errors} "
                          f"machine {run.machine_busy_percent:.0f}% longest fsync {fsync} ms | {cpu}{warn}",
                          flush=True)  # fmt: skip
    config = {"seconds": args.seconds, "rounds": args.rounds, "scenarios": names, "setups": setups,
              "wall_seconds": round(time.monotonic() - began), "machine_busy_before_percent": round(idle),
              "cores": cores()}  # fmt: skip
    write(runs, config, Path(args.out))


def load(path: Path) -> tuple[list[Run], dict]:
    """The runs and settings a previous run wrote (``--from-json``)."""
    document = json.loads(path.read_text())
    runs = []
    for r in document["runs"]:
        nodes = {label: NodeDelta(**d) for label, d in r.pop("nodes").items()}
        runs.append(Run(**r, nodes=nodes))
    return runs, document["config"]


def write(runs: list[Run], config: dict, out: Path) -> None:
    """``<out>.json`` (settings, summary, runs), ``<out>.md`` (the tables), ``<out>.png``."""
    setups = config["setups"]
    summary = summarize(runs)
    out.parent.mkdir(parents=True, exist_ok=True)
    document = {"config": config, "summary": summary, "runs": [asdict(r) for r in runs]}
    out.with_suffix(".json").write_text(json.dumps(document, indent=2) + "\n")
    text = (
        table(summary, setups)
        + f"\nRedis CPU: ms of CPU (used_cpu_sys + used_cpu_user, INFO cpu) per 1,000 appends, summed"
        f" over the {config['rounds']} rounds, and each node's share of all the setup's Redis CPU;"
        " on the cluster, primaries ranked by load in each run (busiest first: a run's streams land on"
        " any shard), each replica after its primary. Script calls: EVALSHA per 1,000 appends on"
        " each primary (INFO commandstats). Gateway CPU likewise (/proc). Machine busy: all cores, of"
        f" {100 * config['cores']}% (before the run, without it:"
        f" {config['machine_busy_before_percent']}%).\n\n" + cpu_table(summary, setups)
    )
    out.with_suffix(".md").write_text(text)
    plot(summary, setups, out.with_suffix(".png"))
    print(text)
    print(f"wrote {out}.json, .md, .png")


if __name__ == "__main__":
    main()
