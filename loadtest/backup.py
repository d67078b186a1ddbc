"""Backup, restore and verify (issue 43) at size: ``--streams`` streams holding ``--mb`` MiB in
all, written through a gateway into its embedded Redis (AOF, fsync on every write); then

* ``durable-streams backup`` while one writer appends 100-byte bodies to a stream of its own
  without pause: its append latency in the 3 s before and during the backup (the blip a
  backup's scripts cause: each holds Redis while it serializes one stream's keys);
* ``durable-streams restore`` into a fresh Redis set up as the embedded one;
* ``durable-streams verify --exact`` of the restore (every stream's bytes read and digested).

    .venv/bin/python -m loadtest.backup [--streams 100000] [--mb 1024] [--quick]

Output: a table on stdout and ``loadtest/results/backup.{json,md}`` (``--quick``: 2,000
streams, 32 MiB, nothing written unless ``--out`` is given).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from gateway.cli.embedded import EmbeddedRedis

from .servers import free_port, start, use_uvloop

RESULTS = Path(__file__).parent / "results"


async def _fill(base: str, streams: int, size: int) -> float:
    """``streams`` streams of ``size`` bytes each (one PUT with its body); seconds taken."""
    started = time.monotonic()
    body = os.urandom(size)
    queue = iter(range(streams))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as http:

        async def one() -> None:
            for n in queue:
                async with http.put(
                    f"{base}/s{n:07d}", data=body, headers={"Content-Type": "application/octet-stream"}
                ) as r:
                    assert r.status == 201, r.status

        await asyncio.gather(*(one() for _ in range(64)))
    return time.monotonic() - started


async def _writer(base: str, stop: asyncio.Event, latencies: list[tuple[float, float]]) -> None:
    async with aiohttp.ClientSession() as http:
        url = f"{base}/blip-writer"
        async with http.put(url, headers={"Content-Type": "text/plain"}) as r:
            assert r.status == 201
        while not stop.is_set():
            t = time.monotonic()
            async with http.post(url, data=b"x" * 100, headers={"Content-Type": "text/plain"}) as r:
                assert r.status == 204, r.status
            latencies.append((t, time.monotonic() - t))


def _cli(*args: str) -> tuple[float, str]:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "gateway", *args], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{args[0]} failed: {done.stdout}{done.stderr}")
    return time.monotonic() - started, done.stdout


def _ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    return {
        "p50_ms": round(statistics.median(ordered) * 1000, 2),
        "p99_ms": round(ordered[int(len(ordered) * 0.99) - 1 if len(ordered) > 1 else 0] * 1000, 2),
        "max_ms": round(ordered[-1] * 1000, 2),
        "appends": len(ordered),
    }


async def run(streams: int, mb: int) -> dict[str, Any]:
    size = mb * (1 << 20) // streams
    work = Path(tempfile.mkdtemp(prefix="ds-bench-backup-"))
    out: dict[str, Any] = {"streams": streams, "bytes_per_stream": size, "total_mib": mb}
    try:
        with start("ours") as server:
            out["fill_seconds"] = round(await _fill(server.base_url, streams, size), 1)
            stop, latencies = asyncio.Event(), []
            writer = asyncio.create_task(_writer(server.base_url, stop, latencies))
            await asyncio.sleep(3.0)
            began = time.monotonic()
            backup = work / "backup"
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "gateway", "backup", "--to", str(backup), "--data-dir", server.data_dir,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
            said, err = await proc.communicate()
            ended = time.monotonic()
            stop.set()
            await writer
            if proc.returncode:
                raise RuntimeError(f"backup failed: {err.decode()}")
            manifest = json.loads((backup / "manifest.json").read_text())
            out["backup_seconds"] = round(ended - began, 1)
            out["backup_dump_seconds"] = manifest["dump_seconds"]
            out["backup_mib"] = round(sum(f["bytes"] for f in manifest["files"].values()) / (1 << 20), 1)
            out["appends_before_backup"] = _ms([d for t, d in latencies if began - 3.0 <= t < began])
            out["appends_during_backup"] = _ms([d for t, d in latencies if began <= t < ended])
            out["backup_said"] = said.decode().strip().splitlines()[-1]
        target = EmbeddedRedis(work / "target", port=free_port())
        target.start()
        try:
            seconds, said_ = _cli("restore", "--from", str(backup), "--redis-url", target.url)
            out["restore_seconds"] = round(seconds, 1)
            out["restore_said"] = said_.strip().splitlines()[-1]
            seconds, said_ = _cli("verify", "--from", str(backup), "--redis-url", target.url, "--exact",
                                  "--archive-url", str(work / "no-archive"))  # fmt: skip
            out["verify_seconds"] = round(seconds, 1)
            out["verify_said"] = said_.strip().splitlines()[-1]
        finally:
            target.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def _markdown(r: dict[str, Any]) -> str:
    def row(name: str, t: dict[str, Any]) -> str:
        return f"| {name} | {t.get('p50_ms')} | {t.get('p99_ms')} | {t.get('max_ms')} | {t.get('appends')} |"

    backup = f"dump {r['backup_dump_seconds']} s, then digests; {r['backup_mib']} MiB on disk"
    return "\n".join([
        f"Backup, restore, verify: {r['streams']:,} streams, {r['total_mib']} MiB "
        f"({r['bytes_per_stream']:,} B each), embedded Redis (AOF, fsync always)",
        "",
        "| step | seconds | notes |",
        "|---|---:|---|",
        f"| fill (PUT with body, 64 at once) | {r['fill_seconds']} | |",
        f"| backup | {r['backup_seconds']} | {backup} |",
        f"| restore | {r['restore_seconds']} | {r['restore_said']} |",
        f"| verify --exact | {r['verify_seconds']} | {r['verify_said']} |",
        "",
        "| one writer's appends | p50 ms | p99 ms | max ms | appends |",
        "|---|---:|---:|---:|---:|",
        row("3 s before the backup", r["appends_before_backup"]),
        row("during the backup", r["appends_during_backup"]),
        "",
    ])  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, default=100_000)
    parser.add_argument("--mb", type=int, default=1024)
    parser.add_argument("--quick", action="store_true", help="2,000 streams, 32 MiB")
    parser.add_argument("--out", help="where to write results (default: loadtest/results/backup.*)")
    args = parser.parse_args()
    if args.quick:
        args.streams, args.mb = 2000, 32
    use_uvloop()
    result = asyncio.run(run(args.streams, args.mb))
    text = _markdown(result)
    print(text)
    if args.out or not args.quick:
        stem = Path(args.out) if args.out else RESULTS / "backup"
        stem.parent.mkdir(parents=True, exist_ok=True)
        stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
        stem.with_suffix(".md").write_text(text)


if __name__ == "__main__":
    main()
