"""Headless Chromium for the browser tests (the system's: no browser download), through
Playwright: skipped, saying why, where either is missing."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import AsyncIterator
from typing import Any

import pytest

try:
    from playwright.async_api import async_playwright
except ImportError:  # (the test extra not installed)
    async_playwright = None  # type: ignore[assignment]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@contextlib.asynccontextmanager
async def headless_chromium(why: str) -> AsyncIterator[Any]:
    """A launched browser for the block; ``why``: what needs it, said when skipping."""
    if CHROMIUM is None:
        pytest.skip(f"no chromium on PATH: {why} (Debian: apt-get install chromium)")
    if async_playwright is None:
        pytest.skip("playwright is not installed (pip install -e '.[test]')")
    async with async_playwright() as driver:
        chromium = await driver.chromium.launch(executable_path=CHROMIUM)
        try:
            yield chromium
        finally:
            await chromium.close()
