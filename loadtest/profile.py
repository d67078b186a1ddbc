"""Where a gateway's CPU goes under appends: py-spy samples, as a table.

    python -m loadtest.profile [--scenario 64w-1s-100B] [--seconds 10] [--out loadtest/results/profile]
        [--server-args '--tenants --tenant-paths =bench']

Starts ours (one process, embedded Redis), runs an append scenario (loadtest/appends.py;
wrk when installed), samples the gateway with py-spy meanwhile (``pip install py-spy``;
sampling slows it somewhat: read shares, not rates) and writes the functions by their share
of the samples, self and inclusive, to ``<out>.md``, plus py-spy's flame graph ``<out>.svg``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import re
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from .appends import run_appends
from .servers import start

_LOCATION = re.compile(r" \((?P<file>[^()]*?):\d+\)$")


def collapse(raw: str, top: int = 30) -> str:
    """py-spy's raw (collapsed) stacks as a table of functions by self and inclusive share."""
    own: collections.Counter[str] = collections.Counter()
    within: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.splitlines():
        if not line.strip():
            continue
        stack, count = line.rsplit(" ", 1)
        frames = [_LOCATION.sub(lambda m: f" ({Path(m['file']).name})", f) for f in stack.split(";")]
        total += int(count)
        own[frames[-1]] += int(count)
        for frame in set(frames):
            within[frame] += int(count)
    rows = ["| function | self | inclusive |", "|---|---:|---:|"]
    for frame, count in own.most_common(top):
        rows.append(f"| `{frame}` | {100 * count / total:.1f}% | {100 * within[frame] / total:.1f}% |")
    rows.append(f"\n{total:,} samples.\n")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--scenario", default="64w-1s-100B")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--out", default="loadtest/results/profile")
    parser.add_argument(
        "--server-args", default="", help="more flags for ours, e.g. '--tenants --tenant-paths =t'"
    )
    args = parser.parse_args()
    if shutil.which("py-spy") is None:
        raise SystemExit("needs py-spy: pip install py-spy")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with start("ours", *shlex.split(args.server_args)) as server, tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp, "raw.txt")
        record = ["py-spy", "record", "--pid", str(server.pid), "--rate", "250", "--nonblocking"]
        seconds = str(max(1, round(args.seconds - 2)))

        def sample() -> None:  # both record while the load runs, after a second of warm-up
            subprocess.run([*record, "--format", "raw", "-o", str(raw), "-d", seconds], capture_output=True)

        def flame() -> None:
            subprocess.run([*record, "-o", str(out.with_suffix(".svg")), "-d", seconds], capture_output=True)

        threading.Timer(1.0, sample).start()
        threading.Timer(1.0, flame).start()
        result = asyncio.run(run_appends(server.base_url, "ours", args.scenario, args.seconds, server.pid))
        threading.Event().wait(2)
        table = collapse(raw.read_text())
    head = f"# {args.scenario}: {result.appends_per_second:,.0f} appends/s under sampling\n\n"
    out.with_suffix(".md").write_text(head + table)
    print(head + table)


if __name__ == "__main__":
    main()
