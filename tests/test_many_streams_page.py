"""One browser page following many streams through nginx over HTTP/2 (docs/operations.md,
"Many streams on one page"): a page's EventSources share one HTTP/2 connection, on which nginx
allows ``http2_max_concurrent_streams`` requests at once (128 by default; ingress-nginx's
``http2-max-concurrent-streams``, also 128). Chromium does not open a second connection past
that: it queues the rest on the one it has, with no error. 150 EventSources in a headless
Chromium (Playwright, the system's Chromium as in tests/test_console.py) through a real nginx
(TLS, HTTP/2, proxying as tests/test_rolling_update.py's does): at nginx's default 128 are open
and 22 wait (``readyState`` 0, no request reaches the gateway, no event); with the setting
raised to 1024, all 150 are open and each gets every event, once. Skipped, saying why, without
nginx (with its HTTP/2 module), Chromium or Playwright."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import shutil
import ssl
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from yarl import URL

from gateway.features.stats import ProcessCounters

from .browser import headless_chromium
from .conftest import free_port, serving, terminate

STREAMS = 150  # more than nginx's default of 128 concurrent HTTP/2 streams per connection
NGINX_DEFAULT = 128
RAISED = 1024  # the value docs/operations.md suggests
SETTLE = 1.5  # seconds to wait, once the expected EventSources are open, for any more to open
WAIT = 15.0  # every wait is bounded
TEXT = {"Content-Type": "text/plain"}

NGINX_CONF = """\
{user}
worker_processes 1;
pid {root}/nginx.pid;
error_log {root}/error.log notice;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {root}/tmp/body;
    proxy_temp_path {root}/tmp/proxy;
    fastcgi_temp_path {root}/tmp/fastcgi;
    uwsgi_temp_path {root}/tmp/uwsgi;
    scgi_temp_path {root}/tmp/scgi;
    {streams}
    server {{
        listen 127.0.0.1:{port} ssl http2;
        ssl_certificate {root}/cert.pem;
        ssl_certificate_key {root}/key.pem;
        location = /page.html {{
            default_type text/html;
            alias {root}/page.html;
        }}
        location / {{
            # As ingress-nginx with the chart's annotations: HTTP/1.1 to the gateway, no buffering.
            proxy_pass http://127.0.0.1:{upstream};
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header Host $http_host;
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_read_timeout 120s;
        }}
    }}
}}
"""

# Each EventSource follows one stream from its start; the test reads window.state.
PAGE = """<!doctype html><meta charset="utf-8"><title>many streams</title><script>
const names = %s;
window.state = {got: {}, sources: {}};
for (const name of names) {
  state.got[name] = [];
  const source = new EventSource(`/v1/stream/${name}?offset=-1&live=sse`);
  source.addEventListener("data", (event) => state.got[name].push(event.data));
  state.sources[name] = source;
}
window.readyStates = () => Object.values(state.sources).map((source) => source.readyState);
</script>"""


def nginx_binary() -> str:
    found = shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None
    )
    if found is None:
        pytest.skip("needs an nginx binary (Debian: apt-get install nginx; .ci/run installs it)")
    built = subprocess.run([found, "-V"], capture_output=True, text=True, timeout=10).stderr
    if "--with-http_v2_module" not in built or "--with-http_ssl_module" not in built:
        pytest.skip("this nginx has no HTTP/2 or TLS module")
    return found


def self_signed(root: Path) -> None:
    """A certificate for 127.0.0.1 (the browser context ignores that nothing signed it)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )
    (root / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (root / "key.pem").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )


@contextlib.contextmanager
def nginx(root: Path, upstream: int, max_concurrent_streams: int | None, page: str) -> Iterator[str]:
    """nginx with TLS and HTTP/2 on loopback in front of the gateway on ``upstream``, serving
    ``page`` at /page.html; ``max_concurrent_streams`` None: nginx's default. Its base URL."""
    binary = nginx_binary()
    (root / "tmp").mkdir(parents=True)
    self_signed(root)
    (root / "page.html").write_text(page)
    port = free_port()
    streams = ""  # nginx's default, 128
    if max_concurrent_streams is not None:  # as docs/operations.md sets it
        streams = f"http2_max_concurrent_streams {max_concurrent_streams};"
    user = "user root;" if os.geteuid() == 0 else ""  # workers must reach the test's 0700 dirs
    conf = NGINX_CONF.format(user=user, root=root, port=port, upstream=upstream, streams=streams)
    (root / "nginx.conf").write_text(conf)
    command = [binary, "-p", str(root), "-c", str(root / "nginx.conf"), "-e", str(root / "error.log")]
    process = subprocess.Popen([*command, "-g", "daemon off;"], stdin=subprocess.DEVNULL)
    base = f"https://127.0.0.1:{port}"
    insecure = ssl.create_default_context()
    insecure.check_hostname = False
    insecure.verify_mode = ssl.CERT_NONE
    try:
        deadline = time.monotonic() + 10
        while True:
            assert process.poll() is None, (root / "error.log").read_text(errors="replace")
            try:
                with urllib.request.urlopen(f"{base}/page.html", timeout=1, context=insecure):
                    break
            except urllib.error.HTTPError:
                break
            except OSError:
                assert time.monotonic() < deadline, "nginx did not start"
                time.sleep(0.05)
        yield base
    finally:
        terminate(process)


@pytest.fixture(scope="module")
async def browser() -> AsyncIterator[Any]:
    async with headless_chromium("a page of many EventSources needs it") as chromium:
        yield chromium


async def _until(tab: Any, expression: str, seconds: float = WAIT) -> Any:
    """Polls ``expression`` in the page until it is truthy; its value."""
    deadline = time.monotonic() + seconds
    while True:
        value = await tab.evaluate(expression)
        if value or time.monotonic() > deadline:
            return value
        await tab.wait_for_timeout(100)


@pytest.mark.parametrize(
    ("max_concurrent_streams", "open_expected"),
    [(None, NGINX_DEFAULT), (RAISED, STREAMS)],
    ids=["nginx-default-128", "raised-1024"],
)
async def test_a_page_of_150_streams_through_nginx_http2(
    tmp_path: Path, redis_url: str, browser: Any, max_concurrent_streams: int | None, open_expected: int
) -> None:
    names = [f"page-{uuid.uuid4().hex[:8]}-{i}" for i in range(STREAMS)]
    async with serving(redis_url) as gateway, aiohttp.ClientSession() as http:
        for name in names:
            async with http.put(f"{gateway}/{name}", headers=TEXT) as r:
                assert r.status == 201, await r.text()
        upstream = URL(gateway).port
        assert upstream is not None
        with nginx(tmp_path, upstream, max_concurrent_streams, PAGE % json.dumps(names)) as base:
            context = await browser.new_context(ignore_https_errors=True)
            try:
                tab = await context.new_page()
                sse_before = ProcessCounters.live()[0]  # the gateway runs in this process
                await tab.goto(f"{base}/page.html")
                protocol = await tab.evaluate("performance.getEntriesByType('navigation')[0].nextHopProtocol")
                assert protocol == "h2", protocol
                is_open = "readyStates().filter((s) => s === 1).length"
                assert await _until(tab, f"{is_open} >= {open_expected}"), await tab.evaluate("readyStates()")
                await tab.wait_for_timeout(SETTLE * 1000)
                states = await tab.evaluate("readyStates()")
                assert states.count(1) == open_expected, states
                assert states.count(0) == STREAMS - open_expected, states  # waiting, no error
                # and the waiting ones never reached the gateway
                assert ProcessCounters.live()[0] - sse_before == open_expected
                live = [name for name, state in zip(names, states, strict=True) if state == 1]
                for event in ("one", "two"):
                    for name in names:
                        async with http.post(f"{gateway}/{name}", data=f"{event}-{name}", headers=TEXT) as r:
                            assert r.status == 204, await r.text()
                expected = {name: (["one-" + name, "two-" + name] if name in live else []) for name in names}
                everything = f"Object.values(state.got).filter((g) => g.length >= 2).length >= {len(live)}"
                await _until(tab, everything)
                await tab.wait_for_timeout(500)  # anything more (a duplicate, a waiting one) shows
                assert await tab.evaluate("state.got") == expected
            finally:
                await context.close()
