"""A gateway process's memory: freed memory kept for the next body (gateway/cli/allocator.py:
a request's buffers of a MiB or more come from memory already mapped, not page by page from
the kernel), and what it holds once started kept out of the cycle collector's way
(gc.freeze in http/lifecycle.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from gateway.cli import allocator

# A request's worth of large buffers, freed, eight times over: the page faults it costs.
PROBE = """
import resource, sys
from gateway.cli import allocator
tuned = allocator.keep_freed_memory() if sys.argv[1] == "tune" else False
def faults(): return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def request():
    held = [bytearray(1 << 20) for _ in range(12)]  # the body's pieces, the body, its command
    for b in held:
        b[::4096] = b"x" * len(b[::4096])  # touch every page, as a copy does
request()
before = faults()
for _ in range(8):
    request()
print(tuned, faults() - before)
"""


def probe(mode: str, **env: str) -> tuple[bool, int]:
    command = [sys.executable, "-c", PROBE, mode]
    done = subprocess.run(command, env={**os.environ, **env}, capture_output=True, text=True, check=True)
    out = done.stdout.split()
    return out[0] == "True", int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_large_buffers_are_reused_not_faulted_in_again() -> None:
    tuned, faults = probe("tune")
    untuned, faults_before = probe("plain")
    print(f"page faults for 8 requests of 12 MiB: {faults_before} by default, {faults} kept")
    assert tuned and not untuned
    assert faults_before > 8 * 12 * 256 / 2  # the kernel hands the pages over again each time
    assert faults < faults_before / 10


def test_the_operators_own_settings_win() -> None:
    tuned, _ = probe("tune", MALLOC_TRIM_THRESHOLD_="131072")
    assert not tuned
    assert allocator.operator_set({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=131072"})
    assert not allocator.operator_set({"GLIBC_TUNABLES": "glibc.pthread.rseq=0"})
    assert allocator.MMAP_THRESHOLD_BYTES >= 16 << 20  # covers a large append's step and its command


# A gateway's start as `serve` makes it (the process's own server), in a process of its own.
STARTED = """
import asyncio, gc, sys
from aiohttp import web
from gateway.config import Settings
from gateway.http.app import create_app

async def main():
    before = gc.get_freeze_count()
    app = create_app(Settings(), sys.argv[1], drain_on_sigterm=True)
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        print(before, gc.get_freeze_count())
    finally:
        await runner.cleanup()

asyncio.run(main())
"""


def test_what_a_started_gateway_holds_is_frozen(redis_url) -> None:
    command = [sys.executable, "-c", STARTED, redis_url]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    before, after = map(int, done.stdout.split())
    assert before == 0 and after > 50_000, (before, after)  # the modules, the app and its clients
