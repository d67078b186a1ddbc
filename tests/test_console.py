"""The web console (gateway/http/console.py, gateway/console/static/): its files and headers
over HTTP, then the page in a real headless Chromium driven by Playwright: the list, a
stream opened, a live tail that shows an append made from outside within a second, an
append from the page, a delete with its confirmation; and with access control on, the
token asked for, only readable streams listed, the live tail through a signed URL, a 403
said in words; the overview's graphs, figures and subscriptions (light, dark, a phone), and
a stream's activity (its live readers on every gateway, its write rate). The browser tests
are skipped, with the reason, when no Chromium is installed (Debian: ``apt-get install
chromium``; Playwright never downloads one here)."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis

from gateway.archive.files import Archive
from gateway.cli.embedded import EmbeddedRedis
from gateway.config import Settings
from gateway.features import stats
from gateway.http import console
from gateway.redis_io import keys
from gateway.redis_io.scripts import connect_scripts
from workers.archiver import Archiver, Policy
from workers.compactor import CompactionPolicy

from .browser import headless_chromium
from .conftest import serving

try:
    from playwright.async_api import TimeoutError as PlaywrightTimeout
    from playwright.async_api import expect
except ImportError:  # the browser tests skip, saying so; the others run
    expect = None  # type: ignore[assignment]
    PlaywrightTimeout = TimeoutError  # type: ignore[assignment,misc]

WAIT_MS = 10_000  # every browser wait is bounded; a miss fails in seconds, not minutes
TAIL_SECONDS = 1.0  # an append made elsewhere shows in the live tail within this
CONSOLE = "/__ds/console/"
TEXT = {"Content-Type": "text/plain"}
UNLABELLED = """[...document.querySelectorAll("input, select, textarea")]
    .filter((control) => !control.labels.length && !control.getAttribute("aria-label"))
    .map((control) => control.id)"""


@pytest.fixture(scope="module")
async def browser() -> AsyncIterator[Any]:
    """Headless Chromium (the system's: no browser download) through Playwright."""
    async with headless_chromium("the console's browser tests need it") as chromium:
        yield chromium


@pytest.fixture
async def page(browser: Any) -> AsyncIterator[Any]:
    """A fresh browser context (its own session storage); errors on the page (a script
    error, a Content-Security-Policy violation) fail the test."""
    context = await browser.new_context(viewport={"width": 1280, "height": 900})
    tab = await context.new_page()
    tab.set_default_timeout(WAIT_MS)
    problems: list[str] = []
    tab.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
    tab.on("console", lambda msg: msg.type == "error" and problems.append(f"console: {msg.text}"))
    tab.problems = problems
    yield tab
    await context.close()


def _page_problems(tab: Any, *expected: str) -> list[str]:
    """The page's errors, but for the failed requests a test provoked (their statuses)."""
    return [p for p in tab.problems if not any(status in p for status in expected)]


async def _put(http: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str]) -> None:
    async with http.put(url, data=body, headers=headers) as r:
        assert r.status == 201, (r.status, await r.text())


async def _tail_shows_append(
    page: Any, http: aiohttp.ClientSession, url: str, headers: dict[str, str]
) -> None:
    """Start the live tail, append from outside (not through the page), and see the row
    appear within TAIL_SECONDS of the append's answer."""
    await page.get_by_role("button", name="Start tail").click()
    await page.locator("#tail-state", has_text="Live: up to date").wait_for()
    marker = f"from outside {uuid.uuid4().hex[:8]}"
    async with http.post(url, data=marker.encode(), headers={**TEXT, **headers}) as r:
        assert r.status == 204, await r.text()
    appended = time.monotonic()
    await page.locator("#tail-log li", has_text=marker).wait_for()  # the longer wait reports a miss
    took = time.monotonic() - appended
    assert took < TAIL_SECONDS, f"the live tail showed the append after {took:.2f} s"


# -- over HTTP ----------------------------------------------------------------------------


async def test_files_redirects_and_headers(redis_url: str, http: aiohttp.ClientSession) -> None:
    async with serving(redis_url) as base:
        root = base.removesuffix("/v1/stream")
        async with http.get(f"{root}/", allow_redirects=False) as r:
            assert r.status == 302 and r.headers["Location"] == "v1/stream/__ds/console/"
        async with http.get(f"{base}/__ds/console", allow_redirects=False) as r:
            assert r.status == 302 and r.headers["Location"] == "console/"
        async with http.get(f"{root}/") as r:  # followed: relative Locations resolve to the page
            assert r.status == 200 and str(r.url) == f"{base}{CONSOLE}"
        async with http.get(f"{base}{CONSOLE}") as r:
            page = await r.text()
            assert r.status == 200 and r.headers["Content-Type"] == "text/html; charset=utf-8"
            csp = r.headers["Content-Security-Policy"]
            assert (
                "default-src 'self'" in csp
                and "connect-src 'self'" in csp
                and "frame-ancestors 'none'" in csp
            )
            assert "unsafe-inline" not in csp and "sandbox" not in csp
            assert (
                r.headers["Cache-Control"] == "no-cache" and r.headers["X-Content-Type-Options"] == "nosniff"
            )
            etag = r.headers["ETag"]
        assert "<script" in page and "<script>" not in page and "style=" not in page  # nothing inline
        async with http.get(f"{base}{CONSOLE}", headers={"If-None-Match": etag}) as r:
            assert r.status == 304
        for name, content_type in [
            ("console.js", "text/javascript; charset=utf-8"),
            ("api.js", "text/javascript; charset=utf-8"),
            ("charts.js", "text/javascript; charset=utf-8"),
            ("overview.js", "text/javascript; charset=utf-8"),
            ("console.css", "text/css; charset=utf-8"),
            ("icon.svg", "image/svg+xml"),
        ]:
            async with http.get(f"{base}{CONSOLE}{name}") as r:
                assert r.status == 200 and r.headers["Content-Type"] == content_type, name
        async with http.get(f"{base}{CONSOLE}config.json") as r:
            assert await r.json() == {
                "auth": False,
                "signed_urls": False,
                "signed_url_max_seconds": 3600,
                "stream_root": "../../",
                "listing": "../streams",
                "detail": "../streams/",
                "stats": "../stats",
                "sign": "../../../../auth/sign",
                "tenants": None,  # (tenants off)
            }
        async with http.get(f"{base}{CONSOLE}missing.js") as r:
            assert r.status == 404
        async with http.post(f"{base}{CONSOLE}") as r:
            assert r.status == 405


def test_nothing_is_loaded_from_another_origin() -> None:
    """No URL with a scheme or a protocol-relative one in the shipped files (CSP enforces it
    too; this says which file broke it)."""
    for item in console.STATIC.iterdir():
        text = item.read_text()
        if item.name == "icon.svg":
            text = text.replace('xmlns="http://www.w3.org/2000/svg"', "")
        for needle in ("http://", "https://", 'src="//', "url(//", "@import"):
            assert needle not in text, (item.name, needle)


@pytest.mark.parametrize(
    ("options", "served"),
    [
        ({}, True),
        ({"console": "off"}, False),
        ({"auth_anonymous": "read:public/"}, False),  # auth on, nothing to sign a live tail with
        ({"auth_anonymous": "read:public/", "console": "on"}, True),
        ({"auth_anonymous": "read:public/", "auth_signing_key_file": "key"}, True),
    ],
)
def test_when_the_console_is_served(options: dict[str, str], served: bool, caplog) -> None:
    settings = Settings(**options)
    with caplog.at_level(logging.INFO, logger="gateway.http.console"):
        paths = [path for _, path, _ in console.routes(settings)]
    assert ("/v1/stream/__ds/console/" in paths) is served
    assert ("/" in paths) is served
    said = [r.getMessage() for r in caplog.records]
    turned_off = not served and options.get("console") != "off"
    assert len(said) == turned_off and (not said or "--auth-signing-key-file" in said[0]), said


def test_streams_at_the_root_keep_the_root() -> None:
    paths = [path for _, path, _ in console.routes(Settings(prefix="/"))]
    assert "/" not in paths and "/__ds/console/" in paths
    config = json.loads(console._config(Settings(prefix="/")))
    assert config["sign"] == "../../auth/sign"


async def test_console_off_is_not_found(redis_url: str, http: aiohttp.ClientSession) -> None:
    async with serving(redis_url, console="off") as base:
        async with http.get(f"{base}{CONSOLE}") as r:
            assert r.status == 404
        async with http.get(base.removesuffix("/v1/stream") + "/", allow_redirects=False) as r:
            assert r.status == 404


# -- in the browser -----------------------------------------------------------------------


async def test_list_open_tail_append_delete(redis_url: str, http: aiohttp.ClientSession, page: Any) -> None:
    run = f"console-{uuid.uuid4().hex[:8]}"
    async with serving(redis_url) as base:
        await _put(http, f"{base}/{run}/log", b"first line\n", TEXT)
        producer = {"Producer-Id": "ingest-1", "Producer-Epoch": "3", "Producer-Seq": "0"}
        async with http.post(f"{base}/{run}/log", data=b"second line\n", headers={**TEXT, **producer}) as r:
            assert r.status == 200
        await _put(http, f"{base}/{run}/events", b'[{"n":1},{"n":2}]', {"Content-Type": "application/json"})
        await page.goto(f"{base}{CONSOLE}")
        assert await page.title() == "Durable Streams console"
        for role in ("banner", "navigation", "main", "search"):  # landmarks
            assert await page.get_by_role(role).count() == 1, role
        unlabelled = await page.evaluate(UNLABELLED)
        assert unlabelled == [], f"form controls without a label: {unlabelled}"

        # The list, searched by prefix (the Redis holds other tests' streams too).
        await page.get_by_label("Path prefix").fill(f"{run}/")
        await page.get_by_label("Path prefix").press("Enter")
        await page.locator("#list-state", has_text="2 streams").wait_for()
        links = page.locator("#stream-list a .path")
        assert await links.all_inner_texts() == [f"{run}/events", f"{run}/log"]  # byte order

        # Open a stream with the keyboard alone.
        await page.get_by_role("link", name=f"{run}/events").focus()
        await page.keyboard.press("Enter")
        await page.get_by_role("heading", name=f"{run}/events").wait_for()
        await page.locator("#read-output", has_text='"n": 2').wait_for()  # a JSON stream: pretty JSON
        assert await page.get_by_label("View", exact=True).input_value() == "json"
        await page.get_by_label("View", exact=True).select_option("hex")
        await page.locator("#read-output", has_text="|[{").wait_for()

        await page.get_by_role("link", name=f"{run}/log").click()
        await page.get_by_role("heading", name=f"{run}/log").wait_for()
        await page.locator("#read-output", has_text="first line").wait_for()
        assert "/s/" in page.url and run in page.url
        meta = await page.locator("#meta").inner_text()
        assert "text/plain" in meta and "open" in meta
        producers = page.get_by_role("table", name="Idempotent producers: 1")  # the producers' state
        assert await producers.locator("tbody td").all_inner_texts() == ["ingest-1", "3", "0"]

        # Live tail: an append made by another client shows within a second.
        await _tail_shows_append(page, http, f"{base}/{run}/log", {})
        assert await page.locator("#tail-log").get_attribute("aria-live") == "polite"

        # Append from the page: stored, and the tail shows it too.
        await page.get_by_label("Data to append").fill("from the page")
        await page.get_by_role("button", name="Append", exact=True).click()
        await page.locator("#append-state", has_text="next offset").wait_for()
        await page.locator("#tail-log li", has_text="from the page").wait_for()
        async with http.get(f"{base}/{run}/log", params={"offset": "-1"}) as r:
            assert (await r.text()).startswith("first line\n") and (await r.text()).endswith("from the page")

        # Paging: the next page after the end is empty and up to date.
        await page.get_by_role("button", name="Read", exact=True).click()
        await page.get_by_role("button", name="Next page").click()
        await page.locator("#read-state", has_text="0 B from offset").wait_for()

        # Delete: asks first; Cancel keeps the stream, the confirmation deletes it.
        await page.get_by_role("button", name="Delete…").click()
        dialog = page.get_by_role("dialog", name="Delete stream?")
        await dialog.wait_for()
        assert f"Delete {run}/log" in await dialog.inner_text()
        await dialog.get_by_role("button", name="Cancel").click()
        await dialog.wait_for(state="hidden")
        async with http.head(f"{base}/{run}/log") as r:
            assert r.status == 200
        await page.get_by_role("button", name="Delete…").click()
        await dialog.get_by_role("button", name="Delete stream").click()
        await page.locator("#notice", has_text=f"Deleted {run}/log").wait_for()
        async with http.head(f"{base}/{run}/log") as r:
            assert r.status == 404
        await page.locator("#list-state", has_text="1 stream").wait_for()
        assert await links.all_inner_texts() == [f"{run}/events"]
    assert _page_problems(page) == []


async def test_create_fork_and_close(redis_url: str, http: aiohttp.ClientSession, page: Any) -> None:
    run = f"console-{uuid.uuid4().hex[:8]}"
    async with serving(redis_url) as base:
        await page.goto(f"{base}{CONSOLE}")
        path = page.get_by_label("Path", exact=True)
        for _ in range(3):  # opens the details (a click before the page's first render may be undone)
            await page.get_by_text("New stream", exact=True).click()
            try:
                await path.wait_for(state="visible", timeout=3000)
                break
            except PlaywrightTimeout:
                continue
        await path.fill(f"{run}/a")
        await page.get_by_label("Content type").first.fill("text/plain")
        await page.get_by_role("button", name="Create").click()
        await page.get_by_role("heading", name=f"{run}/a").wait_for()
        await page.get_by_label("Data to append").fill("one two")
        await page.get_by_role("button", name="Append", exact=True).click()
        await page.locator("#append-state", has_text="next offset").wait_for()
        await page.get_by_role("button", name="Read", exact=True).click()
        await page.locator("#read-output", has_text="one two").wait_for()

        await page.get_by_role("button", name="Fork…").click()
        fork = page.get_by_role("dialog", name="Fork stream")
        await fork.get_by_label("New stream path").fill(f"{run}/b")
        await fork.get_by_role("button", name="Fork", exact=True).click()
        await page.get_by_role("heading", name=f"{run}/b").wait_for()
        await page.locator("#meta", has_text=f"{run}/a").wait_for()  # forked from
        async with http.get(f"{base}/{run}/b", params={"offset": "-1"}) as r:
            assert await r.text() == "one two"

        await page.get_by_role("button", name="Close…").click()
        await (
            page.get_by_role("dialog", name="Close stream?")
            .get_by_role("button", name="Close stream")
            .click()
        )
        await page.locator("#notice", has_text=f"Closed {run}/b").wait_for()
        async with http.head(f"{base}/{run}/b") as r:
            assert r.headers.get("Stream-Closed") == "true"
        await expect(page.get_by_role("button", name="Close…")).to_be_disabled()
    assert _page_problems(page) == []


async def test_a_compacted_streams_compaction(
    redis_url: str, http: aiohttp.ClientSession, page: Any, tmp_path: Path
) -> None:
    run = f"console-{uuid.uuid4().hex[:8]}"
    events = [
        {"type": "t", "key": "k", "value": {"v": n}, "headers": {"operation": "upsert"}} for n in range(5)
    ]
    async with serving(redis_url) as base:
        headers = {"Content-Type": "application/json", "Stream-Compaction": "state"}
        await _put(http, f"{base}/{run}/state", json.dumps(events).encode(), headers)
        redis = aioredis.Redis.from_url(redis_url)
        archiver = Archiver(
            redis, Archive(str(tmp_path)), Policy(hot_bytes=1 << 40), compaction=CompactionPolicy(0, 0, 0)
        )
        await archiver.archive_stream(keys.stream_id(f"{run}/state"))
        await redis.aclose()
        await page.goto(f"{base}{CONSOLE}")
        await page.get_by_label("Path prefix").fill(f"{run}/")
        await page.get_by_label("Path prefix").press("Enter")
        await page.get_by_role("link", name=f"{run}/state").click()
        await page.locator("#meta", has_text="Dropped").wait_for()
        facts = await page.locator("#meta").inner_text()
        assert "state: " in facts and "4 messages" in facts, facts
    assert _page_problems(page) == []


def _tokens(folder: Path, run: str) -> dict[str, str]:
    tokens = {"user": f"console-user-{run}", "admin": f"console-admin-{run}"}
    entries = [
        {"name": "user", "token": tokens["user"], "grants": f"write:{run}/mine/"},  # write covers read
        {"name": "admin", "token": tokens["admin"], "grants": "admin:*"},
    ]
    (folder / "tokens.json").write_text(json.dumps({"tokens": entries}))
    (folder / "signing.key").write_text("k" * 48)
    return tokens


async def test_with_access_control(
    redis_url: str, http: aiohttp.ClientSession, page: Any, tmp_path: Path
) -> None:
    run = f"console-{uuid.uuid4().hex[:8]}"
    tokens = _tokens(tmp_path, run)
    admin = {"Authorization": f"Bearer {tokens['admin']}"}
    settings = {
        "auth_tokens_file": str(tmp_path / "tokens.json"),
        "auth_signing_key_file": str(tmp_path / "signing.key"),
    }
    requests: list[str] = []
    page.on("request", lambda request: requests.append(request.url))
    async with serving(redis_url, **settings) as base:
        for path in (f"{run}/mine/x", f"{run}/other/y"):
            await _put(http, f"{base}/{path}", b"hello\n", {**TEXT, **admin})
        await page.goto(f"{base}{CONSOLE}")

        # Asked for a token at once; without one the listing is refused, said in words.
        dialog = page.get_by_role("dialog", name="Sign in")
        await dialog.wait_for()
        await dialog.get_by_role("button", name="Continue without").click()
        await page.locator("#problem", has_text="Not signed in").wait_for()
        assert not await dialog.is_visible()  # declined: not asked again at once

        await page.get_by_role("button", name="Sign in").click()
        await dialog.get_by_label("Bearer token").fill(tokens["user"])
        await dialog.get_by_role("button", name="Sign in").click()
        await page.locator("#session-state", has_text="Signed in").wait_for()
        await page.get_by_label("Path prefix").fill(f"{run}/")
        await page.get_by_role("button", name="Search").click()
        await page.locator("#list-state", has_text="1 stream").wait_for()
        assert await page.locator("#stream-list a .path").all_inner_texts() == [f"{run}/mine/x"]

        await page.get_by_role("link", name=f"{run}/mine/x").click()
        await page.locator("#read-output", has_text="hello").wait_for()
        await _tail_shows_append(page, http, f"{base}/{run}/mine/x", admin)
        live = [url for url in requests if "live=sse" in url]
        assert live and all("ds_sig=" in url and "ds_scope=read" in url for url in live), live
        assert not [url for url in requests if tokens["user"] in url]  # never in a URL
        stored = await page.evaluate("sessionStorage.getItem('durable-streams-console-token')")
        assert stored == tokens["user"]

        # Delete needs admin: a 403, said in words, and the stream stays.
        await page.get_by_role("button", name="Delete…").click()
        await (
            page.get_by_role("dialog", name="Delete stream?")
            .get_by_role("button", name="Delete stream")
            .click()
        )
        await page.locator("#problem", has_text="This token may not do that").wait_for()
        async with http.head(f"{base}/{run}/mine/x", headers=admin) as r:
            assert r.status == 200
    assert _page_problems(page, "401", "403") == []


# -- the system live ----------------------------------------------------------------------


class _Workload(stats.ProcessCounters):
    """A gateway's counters as a test sets them (for a bucket recorded in the past)."""

    def start(self) -> None:
        pass

    def take(self) -> tuple[int, int]:
        return 120, 12_000

    def live(self) -> tuple[int, int]:  # type: ignore[override]
        return 4, 1


async def _recorded_before(redis_url: str) -> None:
    """A bucket of 20 s ago as a gateway recorded it: the graphs show complete buckets."""
    scripts = connect_scripts(redis_url, cluster=False, max_connections=2, timeout=5.0)
    try:
        past = stats.Recorder(scripts, lambda sid: 0, [], counters=_Workload(), interval=2.0)
        past.process = "earlier-gateway"
        await past.tick(int(time.time() * 1000) - 20_000)
    finally:
        await scripts.aclose()


async def _until(check: Any, then: Any, what: str, seconds: float = WAIT_MS / 1000) -> None:
    """``then()`` (e.g. a refresh) until ``check()`` holds, for at most ``seconds``."""
    deadline = time.monotonic() + seconds
    while not await check():
        assert time.monotonic() < deadline, f"never: {what}"
        await then()
        await asyncio.sleep(0.3)


async def test_overview(
    own_redis: EmbeddedRedis, http: aiohttp.ClientSession, page: Any, monkeypatch
) -> None:
    monkeypatch.setattr(stats, "TICK_SECONDS", 0.2)  # the gateway records five times a second
    async with serving(own_redis.url) as base:
        await _recorded_before(own_redis.url)
        await _put(http, f"{base}/orders/1", b"", TEXT)
        for n in range(3):
            async with http.post(f"{base}/orders/1", data=f"order {n}\n".encode(), headers=TEXT) as r:
                assert r.status == 204
        hook = {"type": "webhook", "pattern": "orders/*", "webhook": {"url": "https://93.184.215.14/h"}}
        async with http.put(f"{base}/__ds/subscriptions/order-feed", json=hook) as r:
            assert r.status == 201

        await page.goto(f"{base}{CONSOLE}")
        await page.get_by_role("region", name="Overview").wait_for()
        await page.locator("#overview[data-loaded]").wait_for()
        assert await page.get_by_role("link", name="Overview").get_attribute("aria-current") == "page"
        for role in ("banner", "navigation", "main", "search"):  # the landmarks as before
            assert await page.get_by_role(role).count() == 1, role
        unlabelled = await page.evaluate(UNLABELLED)
        assert unlabelled == [], f"form controls without a label: {unlabelled}"

        # Five graphs, each saying in words what it shows; the past bucket drawn.
        charts = page.locator("#charts svg[role=img]")
        assert await charts.count() == 5
        labels = [await chart.get_attribute("aria-label") for chart in await charts.all()]
        assert labels[0].startswith("Appends per second, 15 min ago to now: latest") and labels[0].endswith(
            "highest 12/s"
        ), labels
        assert labels[2].startswith("Live readers") and labels[2].endswith("highest 0.8"), labels
        assert await page.locator("#charts svg polyline").count() >= 4
        # 120 recorded before, 3 now (the gateways of one process share its counters: another
        # test's gateway still running here may record some of these in its own Redis).
        await page.locator("#overview-state", has_text=re.compile(r"12\d appends in 15 min")).wait_for()
        figures = await page.locator("#figures").inner_text()
        for name in ("Appends", "Written", "Live readers", "Archive lag", "Subscription backlog"):
            assert name in figures, figures

        # The subscriptions with their state.
        row = page.get_by_role("row", name="order-feed")
        await row.wait_for()
        assert "due now" in await row.inner_text() and "orders/*" in await row.inner_text()

        # A live reader from outside: counted at the next refresh (here: the window changed).
        sse = await http.get(f"{base}/orders/1", params={"offset": "now", "live": "sse"})
        try:
            readers = page.locator("#figures div", has_text="Live readers").locator(".value")

            async def counted() -> bool:
                return await readers.inner_text() == "1"

            async def refresh() -> None:
                window = page.get_by_label("Graphs of the last")
                await window.select_option("60" if await window.input_value() == "15" else "15")

            await _until(counted, refresh, "the live reader counted")
        finally:
            sse.close()

        # Dark and light schemes, and a phone: no sideways scrolling.
        line = page.locator("#charts svg polyline").first
        stroke = "e => getComputedStyle(e).stroke"
        light = await line.evaluate(stroke)
        await page.emulate_media(color_scheme="dark")
        assert await line.evaluate(stroke) != light
        await page.set_viewport_size({"width": 390, "height": 844})
        wide = await page.evaluate("document.documentElement.scrollWidth")
        assert wide <= 390, f"the page is {wide}px wide on a phone"
        box = await charts.first.bounding_box()
        assert box and box["width"] > 200  # a graph across the screen
    assert _page_problems(page) == []


async def test_stream_activity(
    own_redis: EmbeddedRedis, http: aiohttp.ClientSession, page: Any, monkeypatch
) -> None:
    monkeypatch.setattr(stats, "TICK_SECONDS", 0.2)
    async with serving(own_redis.url) as base:
        await _put(http, f"{base}/jobs/7/log", b"started\n", TEXT)
        await page.goto(f"{base}{CONSOLE}")
        await page.get_by_role("link", name="jobs/7/log").click()
        activity = page.get_by_role("region", name="Activity")
        await activity.wait_for()
        readers = page.locator("#activity div", has_text="Live readers").locator(".value")
        await readers.wait_for()
        refresh = page.get_by_role("button", name="Refresh")

        # The page's own live tail is a reader; so is one on another gateway of the same Redis.
        await page.get_by_role("button", name="Start tail").click()
        await page.locator("#tail-state", has_text="Live").wait_for()
        async with serving(own_redis.url) as other:
            sse = await http.get(f"{other}/jobs/7/log", params={"offset": "now", "live": "sse"})
            try:

                async def two() -> bool:
                    return await readers.inner_text() == "2"

                await _until(two, refresh.click, "both readers counted")
            finally:
                sse.close()

        # Its write rate: appends between samples a second apart.
        for n in range(3):
            async with http.post(f"{base}/jobs/7/log", data=f"step {n}\n".encode(), headers=TEXT) as r:
                assert r.status == 204
            await asyncio.sleep(1.05)
            await refresh.click()
        await page.locator("#activity-chart svg polyline").first.wait_for()
        rate = await page.locator("#activity div", has_text="Write rate").locator(".value").inner_text()
        assert rate.endswith("/s") and rate != "—", rate
        label = await page.locator("#activity-chart svg").get_attribute("aria-label")
        assert label.startswith("Write rate, since opened to now: latest"), label

        # Back to the overview: by its link, focus on its heading, the stream's polling stopped.
        await page.get_by_role("link", name="Overview").click()
        await expect(page.get_by_role("heading", name="Overview")).to_be_focused()
        assert await page.locator("#detail").is_hidden()
    assert _page_problems(page) == []
