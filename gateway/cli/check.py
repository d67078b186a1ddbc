"""``durable-streams check``: one pass through what a client does, against a
running server (``helm test``, an operator after a change).

It creates a uniquely named stream under ``--path`` (with a one-hour TTL, so
one a failed check leaves behind goes away by itself), appends, reads it back
(catch-up), waits in a long-poll that a second append wakes, and deletes the
stream. One line per step on stdout; exit code 0 when every step did what the
protocol says, 1 with one line on stderr saying which step failed and why.

With access control on, the token (``--token-file``) needs write and admin
(delete) on ``--path``. Without a token, a refusal (401/403) means access
control is on, which is all that can be checked: exit code 0 only with
``--allow-refusal``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from typing import Any

import aiohttp

TTL_SECONDS = 3600
WAKE_AFTER_SECONDS = 0.3  # the long-poll waits this long before the append that must wake it


class Failed(Exception):
    def __init__(self, step: str, why: str) -> None:
        super().__init__(f"{step}: {why}")
        self.step = step


class Refused(Failed):
    """Access control said no (401/403)."""


def register(commands: argparse._SubParsersAction[Any]) -> None:
    parser = commands.add_parser(
        "check",
        help="check a running server: create, append, read, long-poll, delete",
        description="Create a uniquely named stream under --path, append, read it back (catch-up, and a "
        "long-poll that an append wakes), delete it; one line per step. Exit code 0 when all "
        "went as the protocol says, else 1 with the reason.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--url", required=True, help="the streams' base URL, e.g. http://host:4437/v1/stream")
    parser.add_argument(
        "--token-file", help="file holding a bearer token with write and admin (delete) on --path"
    )
    parser.add_argument(
        "--path", default="_check/", help="where the check's stream goes (a unique name follows)"
    )
    parser.add_argument(
        "--allow-refusal",
        action="store_true",
        help="without a token, a refusal by access control (401/403) passes: access control is on",
    )
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds each step may take")
    parser.set_defaults(main=main)


def main(args: argparse.Namespace) -> int:
    try:
        token = _token(args.token_file)
    except Failed as exc:
        print(f"check failed: {exc}", file=sys.stderr)
        return 1
    try:
        asyncio.run(_check(args.url, args.path, token, args.timeout))
    except Refused as exc:
        if token is None and args.allow_refusal:
            print(f"check passed: access control is on ({exc}; no --token-file, --allow-refusal)")
            return 0
        hint = "" if token else " (access control is on: give --token-file, or --allow-refusal)"
        print(f"check failed at {exc}{hint}", file=sys.stderr)
        return 1
    except Failed as exc:
        print(f"check failed at {exc}", file=sys.stderr)
        return 1
    print(f"check passed: {args.url}")
    return 0


def _token(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        with open(path) as f:
            token = f.read().strip()
    except OSError as exc:
        raise Failed("token file", str(exc)) from None
    if not token:
        raise Failed("token file", f"{path} is empty")
    return token


def _ms(started: float) -> str:
    return f"{(time.perf_counter() - started) * 1000:.0f} ms"


async def _expect(step: str, response: aiohttp.ClientResponse, *statuses: int) -> bytes:
    body = await response.read()
    if response.status in statuses:
        return body
    text = body.decode(errors="replace").strip().splitlines()
    why = f"{response.status} {response.reason}" + (f": {text[0][:200]}" if text else "")
    if response.status in (401, 403):
        raise Refused(step, why)
    raise Failed(step, f"{why} (expected {' or '.join(map(str, statuses))})")


async def _check(base: str, path: str, token: str | None, timeout: float) -> None:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    name = f"{path.lstrip('/')}{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{uuid.uuid4().hex[:8]}"
    url = f"{base.rstrip('/')}/{name}"
    text = {"Content-Type": "text/plain"}
    step = "create"
    created = False
    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)) as http:
        try:
            started = time.perf_counter()
            async with http.put(url, headers={**text, "Stream-TTL": str(TTL_SECONDS)}) as r:
                await _expect(step, r, 201)
            created = True
            print(f"create     {url}: 201 in {_ms(started)}", flush=True)

            step, started = "append", time.perf_counter()
            async with http.post(url, data=b"hello ", headers=text) as r:
                await _expect(step, r, 200, 204)
                tail = r.headers.get("Stream-Next-Offset", "")
            print(f"append     6 bytes: {r.status} in {_ms(started)}", flush=True)

            step, started = "read", time.perf_counter()
            async with http.get(url, params={"offset": "-1"}) as r:
                body = await _expect(step, r, 200)
                if body != b"hello " or r.headers.get("Stream-Next-Offset") != tail:
                    raise Failed(step, f"read back {body[:100]!r}, expected b'hello '")
            print(f"read       {len(body)} bytes, up to date: 200 in {_ms(started)}", flush=True)

            step, started = "long-poll", time.perf_counter()
            poll = asyncio.create_task(_long_poll(http, url, tail))
            try:
                await asyncio.sleep(WAKE_AFTER_SECONDS)
                async with http.post(url, data=b"world", headers=text) as r:
                    await _expect("append (to wake the long-poll)", r, 200, 204)
                status, body = await poll
            finally:
                poll.cancel()
            if status != 200 or body != b"world":
                raise Failed(step, f"answered {status} with {body[:100]!r}, expected 200 with b'world'")
            print(f"long-poll  woken by an append: 200, {len(body)} bytes in {_ms(started)}", flush=True)

            step, started = "delete", time.perf_counter()
            async with http.delete(url) as r:
                await _expect(step, r, 200, 204)
            created = False
            print(f"delete     {r.status} in {_ms(started)}", flush=True)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise Failed(step, f"no answer from {base} ({type(exc).__name__}: {exc})") from None
        finally:
            if created:  # best effort; else its TTL removes it
                try:
                    async with http.delete(url):
                        pass
                except (aiohttp.ClientError, TimeoutError):
                    pass


async def _long_poll(http: aiohttp.ClientSession, url: str, offset: str) -> tuple[int, bytes]:
    async with http.get(url, params={"offset": offset, "live": "long-poll"}) as r:
        if r.status in (401, 403):
            await _expect("long-poll", r, 200)
        return r.status, await r.read()
