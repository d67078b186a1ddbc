"""The README's screenshots of the web console, made with the browser the tests use:
``python -m tests.console_screenshots [docs/images]`` (needs chromium and redis-server).

A Redis and a gateway of their own, a few example streams, then the console on a desktop
and on a phone-sized viewport, with a live tail that got appends from outside; and the
overview, dark on the desktop, light on the phone. The overview's last 15 minutes are
simulated: recorded by the statistics' own recorder (gateway/features/stats.py) with a
simulated clock and workload (``DemoCounters``), the archive lag and subscription backlog
of those minutes written as the recorder samples them; what is under way now is real
(appends, live readers, the subscriptions and their state)."""

from __future__ import annotations

import asyncio
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

import aiohttp
import redis.asyncio as aioredis
from playwright.async_api import Page, async_playwright

from gateway.cli.embedded import EmbeddedRedis
from gateway.features import stats
from gateway.redis_io.scripts import connect_scripts

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


HISTORY_MINUTES = 15
SUBSCRIPTIONS = {
    "chat-indexer": {
        "type": "webhook",
        "pattern": "chat/*",
        "webhook": {"url": "https://93.184.215.14/hook"},
    },
    "build-notifier": {
        "type": "webhook",
        "streams": ["jobs/build-4812/log"],
        "webhook": {"url": "https://93.184.215.14/builds"},
    },
}


class DemoCounters(stats.ProcessCounters):
    """A day-time workload as a gateway's counters would see it: appends with a slow swell
    and a burst, SSE readers joining, a few long-polls."""

    def __init__(self) -> None:
        super().__init__()
        self.at = 0.0  # seconds into the history

    def start(self) -> None:
        pass

    def take(self) -> tuple[int, int]:
        rate = 38 + 14 * math.sin(self.at / 140) + (55 if 420 < self.at < 480 else 0)
        appends = int(rate * stats.TICK_SECONDS)
        return appends, appends * (180 + int(40 * math.cos(self.at / 90)))

    def live(self) -> tuple[int, int]:  # type: ignore[override]
        return 9 + int(self.at / 120) + int(2 * math.sin(self.at / 50)), 3 + int(self.at / 300)


class Demo:
    """A second gateway with a simulated workload: its last minutes recorded at once with a
    simulated clock, then recording in real time while the screenshots are made."""

    def __init__(self, redis_url: str) -> None:
        self.scripts = connect_scripts(redis_url, cluster=False, max_connections=4, timeout=5.0)
        self.client = aioredis.Redis.from_url(redis_url)
        self.counters = DemoCounters()
        self.recorder = stats.Recorder(self.scripts, lambda sid: 0, [], counters=self.counters)
        self.recorder.process = "demo-gateway"
        self.start = int(time.time() * 1000) - HISTORY_MINUTES * 60 * 1000
        self.task: asyncio.Task[None] | None = None

    async def tick(self, at: int) -> None:
        """One tick at ``at`` (ms), and the archive lag and subscription backlog one of the
        gateways samples in each bucket: simulated too."""
        t = (at - self.start) / 1000
        self.counters.at = t
        for start in (stats.bucket_start(at), stats.bucket_start(at) + stats.BUCKET_SECONDS):
            # This bucket's and the next one's sampler: the figures below, not the real gateway's.
            await self.client.hset(stats.StatsKeys().bucket(start), "s", "demo")
        await self.recorder.tick(at)
        lag = 2000 + 1500 * math.sin(t / 100) + 9000 * math.exp(-(((t - 520) / 60) ** 2))
        backlog = max(0, int(3 * math.sin(t / 70) + (14 if 440 < t < 540 else 1)))
        bucket = stats.StatsKeys().bucket(stats.bucket_start(at))
        workers = {"aw": 1, "sw": 1, "adue": int(lag > 6000), "sched": backlog + 1}  # workers run here
        await self.client.hset(bucket, mapping={"lag": int(lag), "backlog": backlog, **workers})

    async def __aenter__(self) -> Demo:
        step = int(stats.TICK_SECONDS * 1000)
        for at in range(self.start, int(time.time() * 1000), step):
            await self.tick(at)

        async def live() -> None:
            while True:
                await asyncio.sleep(stats.TICK_SECONDS)
                await self.tick(int(time.time() * 1000))

        self.task = asyncio.create_task(live())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.task is not None:
            self.task.cancel()
        await self.client.aclose()
        await self.scripts.aclose()


async def _overview(page: Page, base: str) -> None:
    await page.goto(f"{base}/__ds/console/")
    await page.locator("#overview[data-loaded]").wait_for()
    await page.locator("#charts svg polyline").first.wait_for()
    await page.locator("#subs table").wait_for()
    await page.locator("#figures", has_text="Live readers").wait_for()


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
            async with aiohttp.ClientSession() as http, async_playwright() as driver, Demo(redis.url):
                for path, headers, body in STREAMS:
                    async with http.put(f"{base}/{path}", data=body, headers=headers) as r:
                        assert r.status in (200, 201), r.status
                for sub, config in SUBSCRIPTIONS.items():
                    async with http.put(f"{base}/__ds/subscriptions/{sub}", json=config) as r:
                        assert r.status in (200, 201), (r.status, await r.text())
                readers = [  # live readers now: counted in the overview
                    await http.get(f"{base}/{path}", params={"offset": "now", "live": "sse"})
                    for path in ("chat/general", "chat/general", "jobs/build-4812/log")
                ]
                for seq in range(12):
                    async with http.post(f"{base}/chat/random", data=b'{"n": %d}' % seq, headers=JSON) as r:
                        assert r.status in (200, 204)
                await asyncio.sleep(2 * stats.TICK_SECONDS)  # the gateway recorded them
                browser = await driver.chromium.launch(executable_path=chromium)
                dark = await browser.new_page(viewport={"width": 1280, "height": 860}, color_scheme="dark")
                await _overview(dark, base)
                await dark.screenshot(path=out / "console-overview.png", full_page=True)
                desktop = await browser.new_page(viewport={"width": 1280, "height": 860})
                await _tail(desktop, http, base, "jobs/build-4812/log")
                for step in ("linking", "uploading", "done"):  # its write rate, sampled as it goes
                    await asyncio.sleep(1.1)
                    async with http.post(f"{base}/jobs/build-4812/log", data=f"{step}\n", headers=TEXT) as r:
                        assert r.status == 204
                    await desktop.get_by_role("button", name="Refresh").click()
                await desktop.locator("#activity-chart polyline").first.wait_for()
                await desktop.get_by_role("button", name="Refresh").blur()
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
                await _overview(phone, base)
                await _scroll_to(phone, "#overview-title")
                await phone.screenshot(path=out / "console-phone-overview.png")
                for reader in readers:
                    reader.close()
                await browser.close()
        finally:
            await server.close()
            redis.stop()


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/images")))
