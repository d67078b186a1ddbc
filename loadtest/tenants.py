"""What tenants cost an append: ours without tenants against ours with ``--tenants`` (every
stream one tenant's, its quotas set so every check runs), side by side, alternating rounds.

    python -m loadtest.tenants [--seconds 5] [--rounds 2] [--scenarios 64w-1s-100B,...]

For each mode and scenario: appends/s, the gateway's CPU and its embedded Redis's CPU per
append (µs, from /proc), the median over rounds. Writes ``loadtest/results/tenants.json``
and ``tenants.md``; docs/benchmarks.md ("Tenants") quotes it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from dataclasses import asdict

import aiohttp

from .appends import run_appends
from .report import publish
from .servers import start, use_uvloop

MODES = {"off": (), "on": ("--tenants", "--tenant-paths", "=bench")}
QUOTAS = {"streams": 10**9, "stored_bytes": 10**15, "written_bytes": 10**15, "live_connections": 10**6}
FIGURES = ("appends_per_second", "server_cpu_us_per_append", "redis_cpu_us_per_append")


async def _set_quotas(base_url: str) -> None:
    async with aiohttp.ClientSession() as http:
        url = f"{base_url}/__ds/tenants/_defaults/quotas"
        async with http.patch(url, data=json.dumps(QUOTAS)) as r:
            assert r.status == 200, await r.text()


def _median(runs: list[dict], figure: str) -> float | None:
    values = [r[figure] for r in runs if r.get(figure) is not None]
    return round(statistics.median(values), 1) if values else None


def table(results: dict[str, dict[str, list[dict]]]) -> list[str]:
    lines = [
        "| scenario | appends/s off | appends/s on | on/off "
        "| gateway µs/append off / on | Redis µs/append off / on |",
        "|---|---|---|---|---|---|",
    ]
    for scenario in results["off"]:
        off, on = results["off"][scenario], results["on"][scenario]
        rate_off, rate_on = _median(off, FIGURES[0]), _median(on, FIGURES[0])
        ratio = f"{rate_on / rate_off:.2f}x" if rate_off and rate_on else "—"
        gw = f"{_median(off, FIGURES[1])} / {_median(on, FIGURES[1])}"
        rd = f"{_median(off, FIGURES[2])} / {_median(on, FIGURES[2])}"
        lines.append(f"| {scenario} | {rate_off:,.0f} | {rate_on:,.0f} | {ratio} | {gw} | {rd} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--scenarios", default="64w-1s-100B,64w-1000s-100B,64w-1s-100B-producer")
    parser.add_argument("--out", default="loadtest/results/tenants")
    args = parser.parse_args()
    use_uvloop()
    scenarios = args.scenarios.split(",")
    results: dict[str, dict[str, list[dict]]] = {mode: {s: [] for s in scenarios} for mode in MODES}
    for _ in range(args.rounds):
        for mode, flags in MODES.items():
            with start("ours", *flags) as server:
                if mode == "on":
                    asyncio.run(_set_quotas(server.base_url))
                for scenario in scenarios:
                    r = asdict(
                        asyncio.run(run_appends(server.base_url, "ours", scenario, args.seconds, server.pid))
                    )
                    results[mode][scenario].append(r)
                    figures = " ".join(f"{f}={r.get(f)}" for f in FIGURES)
                    print(f"tenants {mode:<4} {scenario:<22} {figures} errors={r['errors']}", flush=True)
    publish(args.out, results, table(results))


if __name__ == "__main__":
    main()
