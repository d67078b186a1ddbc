"""The command-line client: ``ls``, ``info``, ``cat``, ``tail``, ``append``, ``create``,
``close``, ``rm`` and ``fork``, speaking the Durable Streams protocol over HTTP
to any server (this one or another): no Redis, nothing of the gateway's below.

This module registers the commands with ``durable-streams``' parser; they are
``client_read.py`` and ``client_write.py``, over ``client_session.py`` (the session, the
streams' base URL), ``client_http.py`` (requests, failures, exit codes) and
``client_output.py`` (what they print).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
from collections.abc import Callable
from typing import Any

from .client_http import EXIT_CODES, INTERRUPTED, OK, TOKEN_ENV, Failure
from .client_read import cat, info, ls, tail
from .client_tenants import tenants
from .client_write import DEFAULT_CONTENT_TYPE, append, close, create, fork, rm

DEFAULT_URL = "http://127.0.0.1:4437/v1/stream"
URL_ENV = "DURABLE_STREAMS_URL"


def _run(command: Callable[[argparse.Namespace], Any]) -> Callable[[argparse.Namespace], int]:
    """A command's coroutine run to its exit code; failures as one line on stderr."""

    def main(args: argparse.Namespace) -> int:
        try:
            return int(asyncio.run(command(args)))
        except Failure as exc:
            print(f"durable-streams {args.command}: {exc}", file=sys.stderr)
            return exc.code
        except KeyboardInterrupt:
            return INTERRUPTED
        except BrokenPipeError:  # `cat | head`: the reader left, which is no error of ours
            with contextlib.suppress(OSError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return OK

    return main


class _Intermixed(argparse.ArgumentParser):
    """Options anywhere among the positionals (``append s --url U hello``): plain argparse
    takes STREAM and an empty DATA together and then refuses ``hello``. The subparsers
    action calls ``parse_known_args``; the intermixed parse calls it again, inside."""

    _inside = False

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        if self._inside:
            return super().parse_known_args(args, namespace)
        self._inside = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._inside = False


def _common() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--url",
        default=os.environ.get(URL_ENV) or DEFAULT_URL,
        help=f"the streams' base URL (a server's address alone: its stream prefix is looked for) "
        f"[env {URL_ENV}; default: %(default)s]",
    )
    common.add_argument("--token", help=f"bearer token [env {TOKEN_ENV}]")
    common.add_argument("--token-file", help="file holding the bearer token")
    common.add_argument(
        "--timeout", type=float, default=30.0, help="seconds a request may take [default: 30]"
    )
    return common


def _add(
    commands: argparse._SubParsersAction[Any],
    name: str,
    command: Callable[[argparse.Namespace], Any],
    summary: str,
    *,
    json_output: bool = True,
    positional: str = "stream",
) -> argparse.ArgumentParser:
    parser = commands.add_parser(
        name,
        help=summary,
        description=summary[0].upper() + summary[1:] + ". STREAM is a path under --url, or a full URL.",
        parents=[_common()],
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    if positional == "stream":
        parser.add_argument("stream", metavar="STREAM" if name != "fork" else "NEW")
    if json_output:
        parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.set_defaults(main=_run(command))
    return parser


def _lifetime(parser: argparse.ArgumentParser) -> None:
    expiry = parser.add_mutually_exclusive_group()
    expiry.add_argument("--ttl", type=int, help="sliding time-to-live in seconds")
    expiry.add_argument("--expires-at", help="absolute expiry, RFC 3339 (e.g. 2030-01-01T00:00:00Z)")


def register(commands: argparse._SubParsersAction[Any]) -> None:
    base = commands._parser_class  # the main parser's class (its error format), intermixed
    commands._parser_class = type("IntermixedParser", (_Intermixed, base), {})
    try:
        _register(commands)
    finally:
        commands._parser_class = base


def _register(commands: argparse._SubParsersAction[Any]) -> None:
    parser = _add(commands, "ls", ls, "list the streams whose paths start with PREFIX", positional="prefix")
    parser.add_argument("prefix", nargs="?", default="", metavar="PREFIX", help="[default: every stream]")
    parser.add_argument("-l", "--long", action="store_true", help="status, bytes, created, type, path")
    parser.add_argument("--limit", type=int, help="list at most this many [default: all, page after page]")
    parser.description = (
        "List the streams whose paths start with PREFIX (GET <url>/__ds/streams, a page of 1,000 at a "
        "time): one path a line, --long, or --json (one object a line). With a token, only the "
        "streams it may read."
    )

    _add(commands, "info", info, "show a stream's content type, next offset, closure, TTL/expiry")

    parser = _add(commands, "cat", cat, "print a stream from an offset to its current end", json_output=False)
    parser.add_argument("--offset", default="-1", help="where to start (-1: the beginning) [default: -1]")
    parser.add_argument(
        "--json-lines", action="store_true", help="JSON streams: one message per line (else one array)"
    )

    parser = _add(
        commands, "tail", tail, "follow a stream live (SSE) until it is closed or Ctrl-C", json_output=False
    )
    parser.add_argument("--offset", default="now", help="where to start: now, -1 or an offset [default: now]")

    parser = _add(commands, "append", append, "append DATA arguments (else stdin); print the new offset")
    parser.add_argument(
        "data", nargs="*", metavar="DATA", help="joined by newlines; JSON streams: one message each"
    )
    parser.add_argument("--content-type", help="default: the stream's (asked with HEAD)")
    parser.add_argument("--close", action="store_true", help="close the stream with this append")
    parser.add_argument("--producer-id", help="idempotent producer: a retry of the same seq is dropped")
    parser.add_argument("--epoch", type=int, help="producer epoch [default: 0]")
    parser.add_argument("--seq", type=int, help="producer sequence number of this append [default: 0]")

    parser = _add(commands, "create", create, "create a stream (200 and no change if it exists alike)")
    parser.add_argument("data", nargs="*", metavar="DATA", help="initial content (not read from stdin)")
    parser.add_argument("--content-type", help=f"[default: {DEFAULT_CONTENT_TYPE}]")
    parser.add_argument("--closed", action="store_true", help="create it closed (DATA is all it holds)")
    _lifetime(parser)

    _add(commands, "close", close, "close a stream: no appends after this")
    _add(commands, "rm", rm, "delete a stream")

    parser = _add(
        commands, "tenants", tenants, "list tenants, or show one's quotas and usage", positional="tenant"
    )
    parser.add_argument("tenant", nargs="?", metavar="TENANT", help="a tenant, or _defaults [default: all]")
    parser.add_argument(
        "--set", action="append", default=[], metavar="QUOTA=N", help="change a quota (N or none); repeatable"
    )
    parser.add_argument("--limit", type=int, default=100, help="list at most this many [default: 100]")
    parser.add_argument("--usage", action="store_true", help="TENANT's usage per UTC day (its history)")
    parser.add_argument(
        "--from", dest="since", metavar="DAY", help="--usage from this day, YYYY-MM-DD [default: 6 days ago]"
    )
    parser.add_argument("--to", dest="until", metavar="DAY", help="--usage up to this day [default: today]")
    parser.description = (
        "The tenants (server started with --tenants; GET <url>/__ds/tenants, needs admin access): "
        "usage/quota of each, those storing the most first; TENANT: one's (its own token may read it); "
        "--set streams=100 --set stored_bytes=none changes its quotas (admin; _defaults: everyone's)."
    )

    parser = _add(commands, "fork", fork, "create stream NEW holding SRC's data up to an offset")
    parser.add_argument("--from", dest="source", required=True, metavar="SRC", help="the source stream")
    parser.add_argument("--offset", help="where NEW diverges [default: SRC's tail]")
    parser.add_argument("--content-type", help="must be SRC's [default: SRC's]")
    _lifetime(parser)
