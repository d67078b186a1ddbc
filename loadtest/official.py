"""Upstream's official benchmark cases against every server kind, in one run.

    python -m loadtest.official [--servers ours,reference,reference-memory] [--rounds 1]

Upstream's ``packages/benchmarks`` (vitest, not published on npm) measures, with the official
client: a bare round trip, append-to-long-poll latency (and its overhead over the round
trip), small-message throughput (1,000 appends of 100 B, 75 at a time) and large-message
throughput (50 appends of 1 MiB, 15 at a time). ``loadtest/official.mjs`` runs the same cases
the same way; this starts each server in turn (loadtest/servers.py), runs it, and prints
one table with each figure's ratio to the in-memory reference server. Loopback only.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

from .servers import HERE, KINDS, ensure_node_packages, start

CASES = {  # key in official.mjs's output: (row label, unit, higher is better)
    "ping": ("bare round trip (mean)", "ms", False),
    "latency_total": ("append → long-poll reader (mean)", "ms", False),
    "latency_overhead": ("  overhead over the round trip (mean)", "ms", False),
    "small_msg_per_s": ("small messages, 100 B × 1,000, 75 at a time", "msg/s", True),
    "large_msg_per_s": ("large messages, 1 MiB × 50, 15 at a time", "msg/s", True),
}
BASELINE = "reference-memory"


def run(kind: str, rounds: int) -> dict:
    with start(kind) as server:
        root = server.base_url.rsplit("/v1/stream", 1)[0]
        out = subprocess.run(
            ["node", "official.mjs", root, str(rounds)], cwd=HERE, capture_output=True, text=True, timeout=900
        )
        if out.returncode:
            raise SystemExit(f"official.mjs against {kind} failed: {out.stderr[-2000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])


def table(results: dict[str, dict]) -> str:
    servers = list(results)
    lines = ["| case | " + " | ".join(servers) + " |", "|---|" + "---:|" * len(servers)]
    for key, (label, unit, _) in CASES.items():
        cells = []
        for s in servers:
            value = results[s][key]["mean"]
            cell = f"{value:,.2f} {unit}" if unit == "ms" else f"{value:,.0f} {unit}"
            base = results.get(BASELINE, {}).get(key, {}).get("mean")
            if s != BASELINE and base:
                cell += f" ({value / base:.2f}x)"
            cells.append(cell)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--servers", default="ours,reference,reference-memory", help=f"comma list of {KINDS}")
    parser.add_argument("--rounds", type=int, default=1, help="repeat every case this many times")
    parser.add_argument("--out", default="loadtest/results/official")
    args = parser.parse_args()
    ensure_node_packages()
    results = {kind: run(kind, args.rounds) for kind in args.servers.split(",")}
    for kind, result in results.items():
        print(kind, json.dumps(result), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    out.with_suffix(".md").write_text(table(results))
    print(table(results))


if __name__ == "__main__":
    main()
