"""Run the official conformance suite against a gateway on a fresh Redis.

    python tests/conformance/run.py [--base-url URL]

Without --base-url it starts an embedded Redis in a temporary directory and a
gateway on a free port, runs the suite, and stops both; with --archive it also
runs an archive worker with a hot window of 0, so reads go to Parquet files
as soon as the worker has moved the data, and the gateway reads every byte
stream in bulk (--read-inline-bytes 0: data by plain XRANGE, with the log
trimmed under it all the time). With --auth the gateway runs with access
control on (a token file; the suite sends an admin token with every request,
see conformance.test.mjs) and rate limits high enough never to refuse, so every
request also goes through the token check and the Redis token bucket. With
--cluster the gateway (and the worker) use a Redis Cluster of 3 primaries and 3
replicas started on loopback (tests/cluster.py) instead. The npm packages are
installed here on first use (versions pinned in package.json). Exits with the
suite's status.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run_suite(base_url: str, token: str | None = None) -> int:
    if not (HERE / "node_modules" / "@durable-streams" / "server-conformance-tests").exists():
        subprocess.run(
            ["npm", "install", "--no-package-lock", "--no-audit", "--no-fund"], cwd=HERE, check=True
        )
    env = {**os.environ, "CONFORMANCE_BASE_URL": base_url}
    if token:
        env["CONFORMANCE_TOKEN"] = token
    return subprocess.run(["npx", "vitest", "run", "conformance.test.mjs"], cwd=HERE, env=env).returncode


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-url", help="test a running gateway instead of starting one")
    parser.add_argument("--archive", action="store_true", help="run an archive worker at hot window 0")
    parser.add_argument("--auth", action="store_true", help="access control on (bearer tokens)")
    parser.add_argument(
        "--rate-limits", action="store_true", help="rate limits on too (appends then take aiohttp's path)"
    )
    parser.add_argument("--cluster", action="store_true", help="on a Redis Cluster (3 primaries, 3 replicas)")
    args = parser.parse_args()
    if args.base_url:
        return run_suite(args.base_url)
    if shutil.which("npx") is None:
        sys.exit("conformance: npx (Node 18+) is required")
    sys.path.insert(0, str(HERE.parent.parent))  # the repo root, for loadtest.servers
    if not args.cluster:
        return _run(args, [])
    from tests.cluster import start_cluster

    folder = tempfile.TemporaryDirectory(prefix="conformance-cluster-")
    with folder, start_cluster(folder.name) as cluster:
        print(f"conformance: on a Redis Cluster, seed {cluster.seed_url}")
        return _run(args, ["--redis-url", cluster.seed_url, "--redis-cluster"])


def _run(args: argparse.Namespace, redis: list[str]) -> int:
    """The suite against a gateway started here; ``redis``: its Redis options (none: embedded)."""
    from loadtest.servers import archive_worker, start, worker

    # A fresh embedded Redis; a short long-poll timeout keeps the suite's timeout tests quick.
    extra = ["--read-inline-bytes", "0"] if args.archive else []
    token = None
    if args.auth:
        token = secrets.token_urlsafe(24)
        folder = tempfile.mkdtemp(prefix="conformance-auth-")
        tokens = Path(folder, "tokens.json")
        tokens.write_text(json.dumps({"tokens": [{"name": "suite", "token": token, "grants": "admin:"}]}))
        extra += ["--auth-tokens-file", str(tokens)]
    if args.rate_limits:
        extra += ["--rate-limits", "write:=100000/s read:=100000/s"]
    # The suite's webhook receivers listen on loopback: allowed here, refused by default.
    loopback = ["--webhook-allow", "127.0.0.0/8"]
    with (
        start("ours", "--long-poll-timeout", "3", *redis, *extra, *loopback) as gateway,
        worker(gateway, "deliver", *redis, *loopback),
    ):
        base_url = gateway.base_url.removesuffix("/v1/stream")
        if not args.archive:
            return run_suite(base_url, token)
        hot_window_0 = ["--archive-hot-bytes", "0", "--archive-hot-seconds", "0", "--archive-min-bytes", "0",
                        "--archive-max-delay", "0", "--archive-interval", "0.05"]  # fmt: skip
        with archive_worker(gateway, *redis, *hot_window_0):
            status = run_suite(base_url, token)
        files = len(list(Path(gateway.data_dir, "archive").rglob("*.parquet")))
        print(f"conformance: the archive worker wrote {files} files during the suite")
        return status if files else 1


if __name__ == "__main__":
    sys.exit(main())
