"""Listing streams (``GET {prefix}/__ds/streams``): the query, the cursor, and which
part of the stream index a page reads. Plain functions, no I/O: features/listing.py
reads the index, http/listing.py shapes the answer.

The index is split in parts (one on one Redis; one per hash slot on Redis Cluster,
where a script may only write keys of its stream's slot), each sorted by stream id.
A page walks the parts in order, each from where the last page stopped: a
``Position`` (part, last id seen in it). So one Redis lists in path order; a cluster
lists part by part (each part in path order), which costs a page about as many
index reads as parts it crosses, not a merge of all 16,384 parts per page.

Which index keys and ranges a page reads is features/listing.py's (the index holds
stream ids, whose byte order differs from the paths' where they percent-encode).

The cursor handed to clients (``next_cursor``, given back as ``after``) is opaque:
on one Redis it is the last path listed (any path works as ``after``: the streams
after it), on a cluster the part and that path, base64url-encoded.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .access import SCOPES, Principal, deny
from .errors import bad_request

MAX_LIMIT = 1000
DEFAULT_LIMIT = 1000  # as Ursula's bucket listing
MAX_PREFIXES = 32  # grant prefixes a listing reads apart (each an index range per part)
_CLUSTER_CURSOR = "c1."  # a cluster cursor's mark (no path listed on one Redis needs to start so)


@dataclass(frozen=True)
class Position:
    """Where a page starts: index part ``part``, after the path ``after`` in it (None:
    from the part's start)."""

    part: int
    after: str | None = None


@dataclass(frozen=True)
class Query:
    prefix: str
    start: Position
    limit: int


def parse_query(query: Mapping[str, str], parts: int) -> Query:
    """``prefix``, ``after`` (a cursor) and ``limit`` (1..1000) from the query string;
    400 for a bad limit or a cursor this deployment did not make."""
    raw_limit = query.get("limit", "")
    if raw_limit == "":
        limit = DEFAULT_LIMIT
    elif (
        len(raw_limit) > 4
        or not raw_limit.isascii()
        or not raw_limit.isdigit()
        or not 1 <= int(raw_limit) <= MAX_LIMIT
    ):
        raise bad_request(f"limit must be a whole number from 1 to {MAX_LIMIT}")
    else:
        limit = int(raw_limit)
    after = query.get("after", "")
    start = decode_cursor(after, parts) if after else Position(0)
    return Query(prefix=query.get("prefix", ""), start=start, limit=limit)


def encode_cursor(position: Position, parts: int) -> str:
    """``next_cursor``: the path itself on one Redis, else part and path, encoded."""
    after = position.after or ""
    if parts == 1:
        return after
    raw = f"{position.part}:{after}".encode("utf-8", "surrogatepass")
    return _CLUSTER_CURSOR + base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str, parts: int) -> Position:
    if parts == 1:
        return Position(0, cursor)
    if not cursor.startswith(_CLUSTER_CURSOR):
        raise bad_request("after is not a cursor of this server (give back next_cursor)")
    body = cursor[len(_CLUSTER_CURSOR) :]
    try:
        raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)).decode("utf-8", "surrogatepass")
        part, after = raw.split(":", 1)
        number = int(part)
    except (ValueError, binascii.Error, UnicodeDecodeError):
        raise bad_request("after is not a cursor of this server (give back next_cursor)") from None
    if not 0 <= number < parts:
        raise bad_request("after is not a cursor of this server (give back next_cursor)")
    return Position(number, after or None)


def readable_prefixes(principal: Principal, prefix: str) -> list[str]:
    """The prefixes a listing of ``prefix`` reads, narrowed to what ``principal`` may
    read: ``[prefix]`` when it may read all of it, the grants inside it otherwise
    (none inside another: their ranges are disjoint), ``[]`` when it may read nothing
    there; more than ``MAX_PREFIXES`` grants: ``[prefix]`` (each path is checked anyway,
    ``Principal.allows``). A signed URL's grant covers one path only: see ``only_path``."""
    held: set[str] = set()
    for scope in SCOPES:  # every scope covers read
        held.update(principal.grants.prefixes.get(scope, ()))
    if principal.only_path is not None:
        held = {principal.only_path} if any(principal.only_path.startswith(p) for p in held) else set()
    if any(prefix.startswith(grant) for grant in held):
        return [prefix]
    inside = _outermost(grant for grant in held if grant.startswith(prefix))
    return [prefix] if len(inside) > MAX_PREFIXES else inside


def _outermost(prefixes: Iterable[str]) -> list[str]:
    out: list[str] = []
    for prefix in sorted(set(prefixes)):
        if not out or not prefix.startswith(out[-1]):
            out.append(prefix)
    return out


def check_listable(principal: Principal, prefixes: list[str]) -> None:
    """401 for a request without (usable) credentials that may list nothing: it should
    bring some. With credentials that cover nothing asked for, the page is just empty."""
    if not prefixes and principal.anonymous:
        raise deny(principal, "read", "")
