"""One command, one table: every scenario against ours and the reference server.

    python -m loadtest.compare [--seconds 5] [--read-mb 256] [--servers ours,reference,reference-memory]

Starts each server in turn (ours: one gateway process on an embedded Redis
with AOF fsync always; ``reference``: the npm server file-backed, its durable
mode; ``reference-memory``: the same in memory), runs the append scenarios,
the catch-up read and the end-to-end latency scenario against it, and writes
``loadtest/results/comparison.json`` and ``comparison.md`` (the README's table).
Servers run one at a time, so they never compete for the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import asdict
from pathlib import Path

from . import latency
from .appends import SCENARIOS, run_appends, run_read
from .servers import KINDS, start, use_uvloop


def cell_append(r: dict) -> str:
    rate = f"{r['appends_per_second']:,.0f}/s"
    if r["scenario"].endswith("KiB"):
        return f"{rate} = {r['mb_per_second']} MB/s"
    errors = sum(r["errors"].values())
    extra = f" (+{errors:,} errors)" if errors else ""
    return f"{rate}, p99 {r['p99_ms']} ms{extra}"


def table(results: dict[str, dict]) -> str:
    servers = list(results)
    lines = ["| scenario | " + " | ".join(servers) + " |", "|---|" + "---:|" * len(servers)]
    for scenario in SCENARIOS:
        row = [cell_append(results[s]["appends"][scenario]) for s in servers]
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
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--servers", default=",".join(KINDS))
    parser.add_argument("--seconds", type=float, default=5.0, help="seconds per append scenario")
    parser.add_argument("--read-mb", type=int, default=256, help="catch-up read stream size (0: skip)")
    parser.add_argument("--latency-seconds", type=float, default=10.0)
    parser.add_argument("--out", default="loadtest/results/comparison")
    args = parser.parse_args()
    use_uvloop()
    results: dict[str, dict] = {}
    for kind in args.servers.split(","):
        result: dict = {"appends": {}}
        with start(kind) as server:
            for scenario in SCENARIOS:
                r = asyncio.run(run_appends(server.base_url, kind, scenario, args.seconds, server.pid))
                result["appends"][scenario] = asdict(r)
                print(f"{kind:<18} {scenario:<22} {cell_append(asdict(r))}", flush=True)
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
    print(table(results))


if __name__ == "__main__":
    main()
