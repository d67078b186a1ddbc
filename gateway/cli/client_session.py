"""A command's HTTP session (its token and timeouts), and the streams' base URL looked for
when ``--url`` is the server's address rather than the streams' base URL.

The streams live under the server's prefix (--prefix, /v1/stream by default): the server's
bare address as --url puts every path beside them, where this server has Ursula's bucket
routes (a request there fails as a bucket's, "'__ds' is the name of one of the server's
routes"), or nothing. No endpoint states the prefix; when --url has no path, the client
looks for it (at most three GETs, before any request of the command's own):
  1. GET <url>/__ds/streams: the listing there: the streams live at the root, --url is right;
  2. GET <url>/ leads to the console at <prefix>/__ds/console/ (when it is on): that prefix;
  3. GET <url>/v1/stream/__ds/streams: the listing there: the usual prefix.
Found: the command goes on there, with a note on stderr. Not found, and 1. was this server's
bucket refusal: a usage error naming the URL to give. Anything else (another server): --url
as given, as before.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import AsyncIterator
from urllib.parse import urljoin, urlsplit, urlunsplit

import aiohttp

from ..protocol.namespace import RESERVED
from .client_http import USAGE, Client, Failure, Reply, read_token, stream_url

SSE_READ_SECONDS = 60.0  # an SSE connection silent this long is dead: servers send heartbeats (15 s here)
STREAM_PREFIX = "/v1/stream"  # the protocol's usual prefix, this server's default --prefix
LISTING = f"{RESERVED}/streams"  # the listing API under the streams' base URL (this server's)
CONSOLE = f"{RESERVED}/console/"  # this server's web console under the streams' base URL, where GET / leads


def _server_address(url: str) -> bool:
    """Whether --url has no path: the streams' base URL only for a server serving them at its root."""
    parts = urlsplit(url)
    return parts.scheme in ("http", "https") and parts.path in ("", "/") and not parts.query


def _puts_paths_under_url(args: argparse.Namespace) -> bool:
    """Whether the command makes a URL under --url (ls always, the others unless every
    STREAM is a full URL)."""
    if args.command in ("ls", "tenants"):
        return True
    named = (getattr(args, name, None) for name in ("stream", "source"))
    return any(value is not None and not value.startswith(("http://", "https://")) for value in named)


def _is_listing(reply: Reply) -> bool:
    """A listing's answer, or its refusal of these credentials: the listing lives here."""
    if reply.status in (401, 403):
        return True
    with contextlib.suppress(ValueError):
        found = json.loads(reply.body) if reply.status == 200 else None
        return isinstance(found, dict) and isinstance(found.get("streams"), list)
    return False


def _is_bucket_refusal(reply: Reply) -> bool:
    """This server's answer to ``/__ds/...`` at its root when its streams live under a prefix."""
    with contextlib.suppress(ValueError):
        found = json.loads(reply.body) if reply.status == 400 else None
        error = found.get("error") if isinstance(found, dict) else None
        return isinstance(error, dict) and error.get("code") == "invalid_bucket_id"
    return False


async def _console_base(client: Client, origin: str, given: str) -> str | None:
    """The streams' base URL that ``GET /`` names, leading to the console under it."""
    reply = await client.probe(origin + "/", given)
    location = reply.headers.get("Location") if 300 <= reply.status < 400 else None
    if not location:
        return None
    target, here = urlsplit(urljoin(origin + "/", location)), urlsplit(origin)
    elsewhere = (target.scheme, target.netloc) != (here.scheme, here.netloc)
    if elsewhere or not target.path.endswith("/" + CONSOLE):
        return None
    prefix = target.path[: -len(CONSOLE)].rstrip("/")
    return urlunsplit((here.scheme, here.netloc, prefix, "", "")) if prefix else None


async def _usual_base(client: Client, origin: str, given: str) -> str | None:
    base = origin + STREAM_PREFIX
    reply = await client.probe(stream_url(base, LISTING), given, params={"limit": "1"})
    return base if _is_listing(reply) else None


async def find_base(client: Client, args: argparse.Namespace) -> None:
    """--url made the streams' base URL when it is the server's address (above)."""
    given = args.url
    origin = given.rstrip("/")
    at_root = await client.probe(stream_url(origin, LISTING), given, params={"limit": "1"})
    if _is_listing(at_root):
        return
    base = await _console_base(client, origin, given) or await _usual_base(client, origin, given)
    if base is not None:
        print(
            f"durable-streams {args.command}: note: using {base} (the server's stream prefix); "
            "pass it as --url to skip this check",
            file=sys.stderr,
            flush=True,
        )
        args.url = base
    elif _is_bucket_refusal(at_root):
        raise Failure(
            USAGE,
            f"--url {given} is the server's address, not the streams' base URL, and its stream prefix "
            f"is not {STREAM_PREFIX}: pass --url {origin}/PREFIX, PREFIX being the server's --prefix "
            "(DURABLE_STREAMS_PREFIX)",
        )


@contextlib.asynccontextmanager
async def connect(args: argparse.Namespace, *, live: bool = False) -> AsyncIterator[Client]:
    """The command's ``Client``, with the streams' base URL in ``args.url`` (found when needed)."""
    token = read_token(args.token, args.token_file)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    if live:  # a live read lasts: only connecting and silence are bounded
        timeout = aiohttp.ClientTimeout(total=None, connect=args.timeout, sock_read=SSE_READ_SECONDS)
    else:
        timeout = aiohttp.ClientTimeout(total=args.timeout)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout) as session:
        client = Client(session, args.timeout)
        if _server_address(args.url) and _puts_paths_under_url(args):
            await find_base(client, args)  # may change args.url: URLs under it are made after this
        yield client
