"""One command, one table: every scenario against ours and the reference server.

    python -m loadtest.compare [--seconds 5] [--read-mb 256] [--servers ours,reference,reference-memory]
    python -m loadtest.compare --cluster [options of loadtest/cluster.py]
    python -m loadtest.compare --subscriptions [options of loadtest/subscriptions.py]

Starts each server in turn (ours: one gateway process on an embedded Redis
with AOF fsync always; ``reference``: the npm server file-backed, its durable
mode; ``reference-memory``: the same in memory), runs the append scenarios,
the catch-up read and the end-to-end latency scenario against it, and writes
``loadtest/results/comparison.json``, ``comparison.md`` (the README's table) and
``comparison.png`` (append rate and p99 latency by number of writers).
Servers run one at a time, so they never compete for the machine.

``--cluster`` runs ``loadtest/cluster.py`` instead (the rest of the command line
is its): ours on one Redis against ours on a 3+3 Redis Cluster, with and
without ``--min-replicas-ack 1``, with the Redis CPU of every node.

``--subscriptions`` runs ``loadtest/subscriptions.py`` instead (the rest of the
command line is its): appends beside 10,000 non-matching pattern subscriptions
against none, and webhook delivery (throughput, append-to-webhook latency), ours
against the reference server.

For ours it also records the longest AOF fsync Redis waited for during the
run (Redis' latency monitor): with ``appendfsync always`` a slow disk stalls
every write, and one stall of ~100 ms is enough to move a 5 s run's p99.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import asdict
from pathlib import Path

import redis

from . import latency
from .appends import SCENARIOS, run_appends, run_read
from .servers import KINDS, Running, add_pin_option, pin, start, use_uvloop

CURVE = ("1w-1s-100B", "8w-1s-100B", "64w-1s-100B")  # one stream, 100 B, by writers


BASELINE = "reference-memory"  # what ratios are against: the npm reference server in memory


def cell_append(r: dict, baseline: dict | None = None) -> str:
    rate = f"{r['appends_per_second']:,.0f}/s"
    if baseline and baseline is not r and baseline["appends_per_second"]:
        rate += f" ({r['appends_per_second'] / baseline['appends_per_second']:.2f}x)"
    if r["scenario"].endswith("KiB"):
        return f"{rate} = {r['mb_per_second']} MB/s"
    errors = sum(r["errors"].values())
    extra = f" (+{errors:,} errors)" if errors else ""
    return f"{rate}, p99 {r['p99_ms']} ms{cpu_text(r)}{extra}"


def cpu_text(r: dict) -> str:
    """The server's CPU per append (µs), its Redis's (+), and the machine left idle."""
    cpu, redis, idle = (r.get(k) for k in ("server_cpu_us_per_append", "redis_cpu_us_per_append",
                                            "machine_idle_percent"))  # fmt: skip
    if not cpu:
        return ""
    redis_text = f" + {redis:,.0f} Redis" if redis else ""
    idle_text = f", {idle:.0f}% idle" if idle is not None else ""
    return f", {cpu:,.0f}{redis_text} µs CPU{idle_text}"


def table(results: dict[str, dict]) -> str:
    servers = list(results)
    lines = ["| scenario | " + " | ".join(servers) + " |", "|---|" + "---:|" * len(servers)]
    for scenario in SCENARIOS:
        base = results[BASELINE]["appends"][scenario] if BASELINE in results else None
        row = [cell_append(results[s]["appends"][scenario], base) for s in servers]
        lines.append(f"| appends {scenario} | " + " | ".join(row) + " |")
    if all("read" in results[s] for s in servers):
        row = [f"{results[s]['read']['mb_per_second']} MB/s" for s in servers]
        lines.append(f"| {results[servers[0]]['read']['scenario']}, one client | " + " | ".join(row) + " |")
    for reader in ("sse", "long-poll"):
        row = []
        for s in servers:
            m = results[s]["latency"][reader]
            row.append(
                f"p50 {m['ack_p50_ms']} / p99 {m['ack_p99_ms']} ms ({m['send_p50_ms']} / {m['send_p99_ms']})"
            )
        rate = results[servers[0]]["latency"]["rate"]
        lines.append(f"| ack→{reader} reader at {rate:.0f}/s (send→) | " + " | ".join(row) + " |")
    pinned = [results[s]["pinned"] for s in servers if results[s].get("pinned")]
    if pinned:
        lines.append("\nPinned (`--pin`): " + "; ".join(pinned) + ".")
    return "\n".join(lines) + "\n"


def plot(results: dict[str, dict], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:  # the numbers are written already; the picture needs `pip install matplotlib`
        print(f"no matplotlib: {path} not drawn")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    def label(value: float, _: int) -> str:
        return f"{value:,.0f}" if value >= 1 else f"{value:g}"

    def some(value: float, _: int) -> str:  # minor ticks: 2 and 5 of each decade, or they overlap
        return label(value, _) if f"{value:.0e}"[0] in "25" else ""

    fig, (rate_ax, p99_ax) = plt.subplots(1, 2, figsize=(10, 4.2))
    for server, result in results.items():
        rows = [result["appends"][name] for name in CURVE if name in result["appends"]]
        writers = [int(r["scenario"].split("w-", 1)[0]) for r in rows]
        rate_ax.plot(writers, [r["appends_per_second"] for r in rows], marker="o", label=server)
        p99_ax.plot(writers, [r["p99_ms"] for r in rows], marker="o", label=server)
    for ax, title in ((rate_ax, "successful appends/s"), (p99_ax, "p99 append latency, ms")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks([1, 8, 64], ["1", "8", "64"])
        ax.yaxis.set_major_formatter(FuncFormatter(label))
        ax.yaxis.set_minor_formatter(FuncFormatter(some))
        ax.set_xlabel("concurrent writers, one stream, 100 B")
        ax.set_ylabel(title)
        ax.grid(True, which="both", alpha=0.3)
    p99_ax.axhline(10, color="grey", linestyle=":", linewidth=1)
    rate_ax.legend()
    fig.suptitle("Durable Streams appends, one run on one machine")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


class FsyncStalls:
    """The longest AOF fsync of ours' embedded Redis while the block runs, in ms."""

    def __init__(self, server: Running) -> None:
        self.socket = Path(server.data_dir) / "redis.sock"
        self.longest_ms: int | None = None

    def _redis(self) -> redis.Redis:
        return redis.Redis(unix_socket_path=str(self.socket))

    def __enter__(self) -> FsyncStalls:
        if self.socket.exists():
            with self._redis() as r:
                r.config_set("latency-monitor-threshold", 5)
                r.execute_command("LATENCY", "RESET")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.socket.exists():
            with self._redis() as r:
                events = {e[0].decode(): e[3] for e in r.execute_command("LATENCY", "LATEST")}
            self.longest_ms = int(events.get("aof-fsync-always", 0))


def main() -> None:
    if "--cluster" in sys.argv[1:]:
        from . import cluster

        cluster.main([a for a in sys.argv[1:] if a != "--cluster"])
        return
    if "--subscriptions" in sys.argv[1:]:
        from . import subscriptions

        # The first bare --subscriptions picks the script; one followed by a number is its
        # (--subscriptions 5000: the script, with 5000 subscriptions).
        argv = sys.argv[1:]
        at = argv.index("--subscriptions")
        bare = at + 1 == len(argv) or not argv[at + 1].isdigit()
        subscriptions.main(argv[:at] + argv[at + 1 :] if bare else argv)
        return
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--cluster", action="store_true", help="one Redis vs a Redis Cluster instead (loadtest/cluster.py)"
    )
    parser.add_argument(
        "--subscriptions",
        action="store_true",
        help="many subscriptions' cost to appends, and webhooks, instead (loadtest/subscriptions.py)",
    )
    parser.add_argument("--servers", default=",".join(KINDS))
    parser.add_argument("--seconds", type=float, default=5.0, help="seconds per append scenario")
    parser.add_argument("--read-mb", type=int, default=256, help="catch-up read stream size (0: skip)")
    parser.add_argument("--latency-seconds", type=float, default=10.0)
    parser.add_argument("--out", default="loadtest/results/comparison")
    add_pin_option(parser)
    args = parser.parse_args()
    use_uvloop()
    results: dict[str, dict] = {}
    for kind in args.servers.split(","):
        result: dict = {"appends": {}}
        with start(kind) as server:
            if args.pin:
                result["pinned"] = pin(server)
                print(result["pinned"], flush=True)
            for scenario in SCENARIOS:
                with FsyncStalls(server) as stalls:
                    r = asyncio.run(run_appends(server.base_url, kind, scenario, args.seconds, server.pid))
                result["appends"][scenario] = {**asdict(r), "longest_fsync_ms": stalls.longest_ms}
                stall = f" (longest fsync {stalls.longest_ms} ms)" if stalls.longest_ms is not None else ""
                print(f"{kind:<18} {scenario:<22} {cell_append(asdict(r))}{stall}", flush=True)
            if args.read_mb:
                result["read"] = asyncio.run(run_read(server.base_url, kind, args.read_mb))
                print(f"{kind:<18} read {result['read']['mb_per_second']} MB/s", flush=True)
            result["latency"] = asyncio.run(latency.run(server.base_url, kind, 50.0, args.latency_seconds))
            print(f"{kind:<18} latency {json.dumps(result['latency'])}", flush=True)
        results[kind] = result
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    out.with_suffix(".md").write_text(table(results))
    plot(results, out.with_suffix(".png"))
    print(table(results))


if __name__ == "__main__":
    main()
