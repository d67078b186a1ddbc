"""Run the official conformance suite against a gateway on a fresh Redis.

    python tests/conformance/run.py [--base-url URL]

Without --base-url it starts an embedded Redis in a temporary directory and a
gateway on a free port, runs the suite, and stops both. The npm packages are
installed here on first use (versions pinned in package.json). Exits with the
suite's status.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"gateway exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/readyz", timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    sys.exit("gateway did not become ready")


def run_suite(base_url: str) -> int:
    if not (HERE / "node_modules" / "@durable-streams" / "server-conformance-tests").exists():
        subprocess.run(
            ["npm", "install", "--no-package-lock", "--no-audit", "--no-fund"], cwd=HERE, check=True
        )
    env = {**os.environ, "CONFORMANCE_BASE_URL": base_url}
    return subprocess.run(["npx", "vitest", "run", "conformance.test.mjs"], cwd=HERE, env=env).returncode


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-url", help="test a running gateway instead of starting one")
    args = parser.parse_args()
    if args.base_url:
        return run_suite(args.base_url)
    if shutil.which("npx") is None:
        sys.exit("conformance: npx (Node 18+) is required")
    port = free_port()
    with tempfile.TemporaryDirectory() as data_dir:
        env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DURABLE_STREAMS_REDIS_URL")}
        # A short long-poll timeout keeps the suite's timeout tests quick.
        gateway = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gateway",
                "serve",
                "--port",
                str(port),
                "--data-dir",
                data_dir,
                "--long-poll-timeout",
                "3",
                "--log-level",
                "warning",
            ],
            env=env,
        )
        try:
            wait_ready(f"http://127.0.0.1:{port}", gateway)
            return run_suite(f"http://127.0.0.1:{port}")
        finally:
            gateway.terminate()
            gateway.wait(30)


if __name__ == "__main__":
    sys.exit(main())
