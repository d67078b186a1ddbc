"""The README's screenshots of the web console, made with the browser the tests use:
``python -m tests.console_screenshots [docs/images]`` (needs chromium and redis-server).

A Redis and a gateway of their own, a few example streams, then the console on a desktop
and on a phone-sized viewport, with a live tail that got appends from outside."""

from __future__ import annotations

import asyncio
import shutil
import sys
import tempfile
from pathlib import Path
from urllib.parse import quote

import aiohttp
from playwright.async_api import Page, async_playwright

from gateway.cli.embedded import EmbeddedRedis

from .conftest import free_port, start_gateway

JSON = {"Content-Type": "application/json"}
TEXT = {"Content-Type": "text/plain"}
STREAMS: list[tuple[str, dict[str, str], bytes]] = [
    (
        "agents/run-17/events",
        JSON,
        b'[{"step":"plan","tokens":812},{"step":"search","query":"redis streams"}]',
    ),
    ("chat/general", JSON, b'[{"user":"ada","text":"deploy is green"},{"user":"lin","text":"shipping it"}]'),
    ("chat/random", JSON, b'[{"user":"sam","text":"lunch?"}]'),
    ("jobs/build-4811/log", TEXT, b"build 4811 started\nstep 1/3 ok\nstep 2/3 ok\nstep 3/3 ok\ndone\n"),
    ("jobs/build-4812/log", TEXT, b"build 4812 started\nfetching sources\n"),
    ("sensors/thermo-3", {"Content-Type": "application/octet-stream"}, bytes(range(48))),
]
LIVE = {  # (body, what its row shows) appended from outside while the console tails the stream
    "jobs/build-4812/log": [
        (b"compiling 214 modules\n", "compiling"),
        (b"tests: 1,284 passed\n", "passed"),
        (b"packaging image\n", "packaging"),
    ],
    "chat/general": [
        (b'{"user":"ada","text":"rolling out to eu-west"}', "eu-west"),
        (b'{"user":"sam","text":"looks good here"}', "good here"),
    ],
}


async def _tail(page: Page, http: aiohttp.ClientSession, base: str, path: str) -> None:
    """Open ``path`` in the console, start its live tail, append from outside, see the rows."""
    headers = TEXT if path.startswith("jobs/") else JSON
    await page.goto(f"{base}/__ds/console/#/s/{quote(path, safe='')}")
    await page.locator("#read-output:not(:empty)").wait_for()
    await page.get_by_role("button", name="Start tail").click()
    await page.locator("#tail-state", has_text="Live").wait_for()
    for seq, (body, shown) in enumerate(LIVE[path]):
        producer = {"Producer-Id": "ci-runner-7", "Producer-Epoch": "2", "Producer-Seq": str(seq)}
        async with http.post(f"{base}/{path}", data=body, headers={**headers, **producer}) as r:
            assert r.status == 200
        await page.locator("#tail-log li", has_text=shown).wait_for()
    await page.get_by_role("button", name="Refresh").click()  # the producer's state, as it is now
    await page.get_by_role("table").wait_for()
    await page.get_by_role("button", name="Refresh").blur()


async def _scroll_to(page: Page, selector: str) -> None:
    await page.locator(selector).evaluate(
        "e => window.scrollTo(0, e.getBoundingClientRect().top + scrollY - 12)"
    )


async def main(out: Path) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("no chromium on PATH (Debian: apt-get install chromium)")
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as folder:
        redis = EmbeddedRedis(folder, port=free_port())
        redis.start()
        server = await start_gateway(redis.url)
        base = str(server.make_url("/v1/stream"))
        try:
            async with aiohttp.ClientSession() as http, async_playwright() as driver:
                for path, headers, body in STREAMS:
                    async with http.put(f"{base}/{path}", data=body, headers=headers) as r:
                        assert r.status in (200, 201), r.status
                browser = await driver.chromium.launch(executable_path=chromium)
                desktop = await browser.new_page(viewport={"width": 1280, "height": 860})
                await _tail(desktop, http, base, "jobs/build-4812/log")
                await desktop.get_by_label("Data to append").fill("step 1/3 ok")
                await desktop.screenshot(path=out / "console-desktop.png", full_page=True)
                phone = await browser.new_page(
                    viewport={"width": 390, "height": 844},
                    device_scale_factor=2,
                    is_mobile=True,
                    has_touch=True,
                )
                await _tail(phone, http, base, "chat/general")
                await _scroll_to(phone, "body")
                await phone.screenshot(path=out / "console-phone-list.png")
                await _scroll_to(phone, "#tail-title")
                await phone.screenshot(path=out / "console-phone-tail.png")
                await browser.close()
        finally:
            await server.close()
            redis.stop()


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/images")))
