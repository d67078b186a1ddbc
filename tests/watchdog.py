"""What a test that hangs was waiting for.

pytest-timeout (``timeout`` in pyproject.toml) ends a run whose test outlives its limit,
with every thread's stack: for an asyncio test that is the event loop in ``select()``,
which says nothing. Shortly before, this prints every task of the tests' event loop
with its stack: the ``await`` each one is stuck on. conftest.py imports the hook and
the fixture, which registers them.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import AsyncIterator, Iterator

import pytest

EARLY_SECONDS = 10  # before pytest-timeout's own report
_loop: asyncio.AbstractEventLoop | None = None


@pytest.fixture(scope="session", autouse=True)
async def remembered_loop() -> AsyncIterator[None]:
    """The tests' (session-wide) event loop, for the report."""
    global _loop
    _loop = asyncio.get_running_loop()
    yield
    _loop = None


def _limit(item: pytest.Item) -> float:
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args:
        return float(marker.args[0])
    try:
        return float(item.config.getini("timeout") or 0)
    except ValueError:  # pytest-timeout not installed: no limit
        return 0.0


def _report(item: pytest.Item) -> None:
    capture = item.config.pluginmanager.getplugin("capturemanager")
    if capture is not None:
        capture.suspend_global_capture(in_=True)
    loop = _loop
    tasks = [] if loop is None else list(asyncio.all_tasks(loop))  # read-only, from this thread
    out = sys.stderr
    out.write(f"\n{'+' * 30} {item.nodeid}: still running; {len(tasks)} asyncio tasks {'+' * 30}\n")
    for task in tasks:
        task.print_stack(limit=12, file=out)
    out.flush()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    limit = _limit(item)
    timer = None
    if limit > EARLY_SECONDS:
        timer = threading.Timer(limit - EARLY_SECONDS, _report, args=(item,))
        timer.daemon = True
        timer.start()
    try:
        yield
    finally:
        if timer is not None:
            timer.cancel()
