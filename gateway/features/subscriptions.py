"""Subscriptions in Redis (protocol sections 6-7): what the gateway's subscription
APIs do, and what the delivery workers share with them.

Where things live (keys.py): a subscription's state, links (its cursors) and
pending streams share one hash tag with its group's schedule, so each change is
one sub_*.lua script; a stream's side of its links sits in the stream's slot,
where append.lua and create.lua read it to record wakes in the slot's outbox in
the same script as the append (workers/delivery.py takes them from there).
Links are written on the subscription's side first, then the stream's: a crash
between leaves a link no append wakes until the request is retried (PUT and the
membership calls are idempotent), or the worker's backfill re-asserts it.

Stream paths here are stream-root-relative (``events/abc``); offsets are the
protocol's fixed-width tokens, compared as strings in the scripts.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from ..protocol import offsets
from ..protocol.errors import coded
from ..protocol.models import text
from ..protocol.subscriptions import (
    ZERO_OFFSET,
    AckRequest,
    SubscriptionConfig,
    new_wake_id,
)
from ..protocol.webhooks import SigningKey
from ..redis_io import keys
from ..redis_io.contracts import (
    INDEX_SET,
    STREAM_LINK,
    SUB_ACK,
    SUB_CLAIM,
    SUB_CREATE,
    SUB_DELETE,
    SUB_GET,
    SUB_LINKS,
    SUB_NOTE,
    IndexSetArgv,
    PathTail,
    StreamLink,
    StreamLinkArgv,
    SubAck,
    SubAckArgv,
    SubAckInvalid,
    SubClaimArgv,
    SubClaimBusy,
    SubClaimed,
    SubCreateArgv,
    SubDeleteArgv,
    SubGot,
    SubLinked,
    SubLinksArgv,
    SubNoteArgv,
    SubWoke,
    status_of,
)
from ..redis_io.scripts import Scripts

log = logging.getLogger(__name__)
ALIVE_REFRESH_SECONDS = 1.0  # how stale a gateway's "a delivery worker runs" may be
TOKEN_TTL_MS = 24 * 3600 * 1000  # callback and claim tokens: fenced by generation long before
KEYS_REFRESH_SECONDS = 30.0


def flat_pairs(flat: Sequence[Any]) -> dict[str, str]:
    """A Redis flat ``[field, value, ...]`` reply as a dict of text."""
    return {text(flat[i]): text(flat[i + 1]) for i in range(0, len(flat), 2)}


@dataclass(frozen=True)
class StreamTail:
    """A stream's tail (an offset token) and incarnation (its meta 'created'; '' if none)."""

    tail: str
    inc: str


async def stream_tails(scripts: Scripts, paths: Iterable[str]) -> dict[str, StreamTail]:
    """The tails of streams by path, read now (a missing or deleted stream: ZERO_OFFSET)."""
    unique = list(dict.fromkeys(paths))

    async def one(path: str) -> StreamTail:
        meta = keys.stream_keys(keys.stream_id(path))[0]
        tail, created, deleted, exp = await scripts.command(
            meta, "HMGET", meta, "tail", "created", "deleted", "exp"
        )
        if tail is None or deleted is not None or (exp is not None and int(exp) <= time.time() * 1000):
            return StreamTail(ZERO_OFFSET, "")  # gone (expired but kept for its forks: gone too)
        return StreamTail(offsets.encode(int(tail)), text(created))

    found = await asyncio.gather(*(one(p) for p in unique))
    return dict(zip(unique, found, strict=True))


@dataclass(frozen=True)
class Link:
    path: str
    types: str  # 'e', 'g' or 'eg'
    acked: str

    @property
    def link_type(self) -> str:
        """As the API shows it: explicit wins (spec 6.1)."""
        return "explicit" if "e" in self.types else "glob"


def parse_links(flat: Sequence[Any]) -> list[Link]:
    links = []
    for path, value in flat_pairs(flat).items():
        types, acked, _ = value.split("|", 2)
        links.append(Link(path, types, acked))
    return sorted(links, key=lambda link: link.path)


def wake_streams(flat: Sequence[Any]) -> list[dict[str, Any]]:
    """A wake's streams as the webhook body and the claim answer show them, from a
    script's flat ``{path, types, acked, tail, ...}``."""
    out = []
    for i in range(0, len(flat), 4):
        path, types, acked, tail = (text(v) for v in flat[i : i + 4])
        out.append(
            {
                "path": path,
                "link_type": "explicit" if "e" in types else "glob",
                "acked_offset": acked,
                "tail_offset": tail,
                "has_pending": tail > acked,
            }
        )
    return out


class WorkersAlive:
    """Whether new streams are worth recording, as a gateway last saw (at most about a
    second ago): a delivery worker runs (``keys.SUBS_WORKER_ALIVE``; with none, the
    outbox would pile up) and a pattern subscription exists (``keys.SUBS_INDEX``; with
    none, nothing could match). create.lua then puts every new stream in its outbox, for
    the workers to match against the patterns. A gateway that could not look says yes
    (an entry too many, never one missed). A stream missed while the answer was stale is
    linked by the workers' backfill, which visits every stream when a worker starts and
    when a pattern subscription is made, after gateways have had time to look again."""

    def __init__(self, scripts: Scripts) -> None:
        self.scripts = scripts
        self._value, self._at = True, -float("inf")
        self._refresh: asyncio.Task[None] | None = None

    async def alive(self) -> bool:
        if time.monotonic() - self._at < ALIVE_REFRESH_SECONDS:
            return self._value
        if self._refresh is None or self._refresh.done():
            self._refresh = asyncio.create_task(self._look())
        try:
            await asyncio.shield(self._refresh)
        except Exception:
            return True
        return self._value

    def expect(self) -> None:
        """A pattern subscription was just made here: record new streams from now on (the
        other gateways learn within a second; the backfill covers that second)."""
        self._value = True

    async def _look(self) -> None:
        alive = await self.scripts.command(keys.SUBS_WORKER_ALIVE, "EXISTS", keys.SUBS_WORKER_ALIVE)
        patterns = alive and await self.scripts.command(keys.SUBS_INDEX, "HLEN", keys.SUBS_INDEX)
        self._value = bool(patterns)
        self._at = time.monotonic()


class SigningKeys:
    """The webhook signing keys (spec 6.5), kept in Redis (``keys.WEBHOOK_KEYS``) so every
    worker signs with, and every gateway publishes, the same set. Each is JSON: the
    PKCS#8 PEM, ``activate`` (ms: signing starts then; a new key is published first, so
    receivers caching the JWKS for its max-age know it before it signs) and ``retire``
    (ms: once every signature it made is past the receivers' replay window, it leaves
    the JWKS). The newest active key signs."""

    def __init__(self, scripts: Scripts) -> None:
        self.scripts = scripts
        self._keys: list[tuple[SigningKey, dict[str, Any]]] = []
        self._at = -float("inf")

    async def _all(self) -> list[tuple[SigningKey, dict[str, Any]]]:
        if time.monotonic() - self._at < KEYS_REFRESH_SECONDS and self._keys:
            return self._keys
        raw = await self.scripts.redis.hgetall(keys.WEBHOOK_KEYS)
        if not raw:
            await self.add(SigningKey.generate(), activate_ms=0)
            raw = await self.scripts.redis.hgetall(keys.WEBHOOK_KEYS)
        found = []
        for value in raw.values():
            record = orjson.loads(value)
            found.append((SigningKey.from_pem(record["pem"].encode()), record))
        found.sort(key=lambda item: (item[1]["activate"], item[0].kid))
        self._keys, self._at = found, time.monotonic()
        return found

    def forget(self) -> None:
        """Read the keys again next time (after a rotation)."""
        self._at = -float("inf")

    async def add(self, key: SigningKey, activate_ms: int) -> bool:
        """Store a key (a no-op if its kid is there); it signs from ``activate_ms`` on."""
        record = {"pem": key.to_pem().decode(), "activate": activate_ms, "retire": None}
        added = bool(await self.scripts.redis.hsetnx(keys.WEBHOOK_KEYS, key.kid, orjson.dumps(record)))
        self.forget()
        return added

    async def rotate(self, activate_after_ms: int, retire_after_ms: int) -> SigningKey:
        """A new key, published now, signing from ``activate_after_ms`` on; the keys it
        replaces leave the JWKS ``retire_after_ms`` after that."""
        now = int(time.time() * 1000)
        new = SigningKey.generate()
        activate = now + activate_after_ms
        for key, record in await self._all():
            if record.get("retire") is None:
                record["retire"] = activate + retire_after_ms
                await self.scripts.redis.hset(keys.WEBHOOK_KEYS, key.kid, orjson.dumps(record))
        await self.add(new, activate)
        return new

    async def signer(self) -> SigningKey:
        now = int(time.time() * 1000)
        keys_ = await self._all()
        active = [k for k, r in keys_ if r["activate"] <= now and (r["retire"] is None or r["retire"] > now)]
        return (active or [keys_[0][0]])[-1]

    async def published(self) -> list[dict[str, str]]:
        now = int(time.time() * 1000)
        return [k.public_jwk() for k, r in await self._all() if r["retire"] is None or r["retire"] > now]

    async def listing(self) -> list[dict[str, Any]]:
        self.forget()
        return [
            {"kid": k.kid, "activate": r["activate"], "retire": r["retire"]} for k, r in await self._all()
        ]


async def token_secret(scripts: Scripts) -> bytes:
    """The secret callback and claim tokens are signed with (HMAC), made once, shared."""
    redis = scripts.redis
    secret = await redis.get(keys.SUBS_TOKEN_SECRET)
    if secret is None:
        await redis.set(keys.SUBS_TOKEN_SECRET, secrets.token_hex(32), nx=True)
        secret = await redis.get(keys.SUBS_TOKEN_SECRET)
    return secret if isinstance(secret, bytes) else str(secret).encode()


class Subscriptions:
    """The subscription APIs' storage: each call is one script on the subscription's
    keys, after the stream reads it needs (tails) and before its streams' side."""

    def __init__(self, scripts: Scripts) -> None:
        self.scripts = scripts
        self.cluster = scripts.cluster
        self.workers = WorkersAlive(scripts)
        self.signing = SigningKeys(scripts)
        self._secret: bytes | None = None

    def keys_of(self, sub: str) -> list[str]:
        return keys.sub_keys(sub, self.cluster)

    async def secret(self) -> bytes:
        if self._secret is None:
            self._secret = await token_secret(self.scripts)
        return self._secret

    async def call(self, name: str, sub: str, *args: Any) -> list[Any]:
        """Script ``name`` (a subscription's side: contracts.py) on the subscription's keys,
        its answer's bytes as text."""
        return [
            text(v) if isinstance(v, bytes) else v
            for v in await self.scripts.run(name, self.keys_of(sub), args)
        ]

    # -- configuration ----------------------------------------------------------

    async def create(self, sub: str, config: SubscriptionConfig, created_at: str, base: str) -> bool:
        """PUT: True if created, False if re-confirmed; 409 for another configuration."""
        tails = await stream_tails(self.scripts, config.streams)
        triples: list[str] = []
        for path in config.streams:
            triples += PathTail(path, tails[path].tail, tails[path].inc)
        argv = SubCreateArgv(
            sub_id=sub,
            config=config.to_json(),
            config_hash=config.config_hash(),
            created_at=created_at,
            kind=config.type,
            lease_ms=config.lease_ttl_ms,
            pattern="1" if config.pattern else "0",
            base_url=base,
        )
        status = status_of(await self.call(SUB_CREATE.name, sub, *argv, *triples))
        if status == "conflict":
            raise coded(
                409, "SUBSCRIPTION_ALREADY_EXISTS", "subscription exists with a different configuration"
            )
        # Both answers re-assert the streams' side and the index: a PUT retried after a
        # crash between the steps completes them.
        await self._link_streams(sub, {path: "1" for path in config.streams})
        await self.note_tails(sub, config.streams)
        if config.pattern:
            await self.set_pattern(sub, config.pattern)
            self.workers.expect()
        return status == "created"

    async def note_tails(self, sub: str, paths: Sequence[str]) -> None:
        """Tell the subscription its streams' tails read now, after their side of the link
        exists: an append that came between the first read and the link was recorded by
        no script, and is seen here."""
        if not paths:
            return
        tails = await stream_tails(self.scripts, paths)
        triples: list[str] = []
        for path, tail in tails.items():
            if tail.inc:
                triples += PathTail(path, tail.tail, tail.inc)
        if triples:
            await self.call(SUB_NOTE.name, sub, *SubNoteArgv(new_wake_id()), *triples)

    async def set_pattern(self, sub: str, pattern: str | None) -> None:
        argv = IndexSetArgv(sub, pattern or "")
        await self.scripts.run(INDEX_SET.name, [keys.SUBS_INDEX, keys.SUBS_INDEX_VERSION], [*argv])

    async def _link_streams(self, sub: str, types: dict[str, str], inc: str = "") -> None:
        """The streams' side: '1' linked, '' unlinked (one script per stream)."""
        calls = [
            ([keys.stream_subs(keys.stream_id(path))], [*StreamLinkArgv(inc), *StreamLink(sub, value)])
            for path, value in types.items()
        ]
        if calls:
            for result in await self.scripts.run_each(STREAM_LINK.name, calls):
                if isinstance(result, BaseException):
                    raise result

    async def relink_explicit(self, sub: str, paths: Sequence[str]) -> None:
        """The streams' side of explicit links again (the worker's backfill: idempotent)."""
        await self._link_streams(sub, dict.fromkeys(paths, "1"))

    async def get(self, sub: str) -> tuple[dict[str, str], list[Link]] | None:
        reply = await self.scripts.run(SUB_GET.name, self.keys_of(sub), [])
        if not reply:
            return None
        got = SubGot(*reply)
        return flat_pairs(got.state), parse_links(got.links)

    async def delete(self, sub: str) -> bool:
        """DELETE: its state goes at once; its streams' side is cleaned by the worker."""
        existed = bool(await self.scripts.run(SUB_DELETE.name, self.keys_of(sub), [*SubDeleteArgv(sub)]))
        await self.set_pattern(sub, None)
        return existed

    async def add_streams(self, sub: str, paths: Sequence[str]) -> None:
        tails = await stream_tails(self.scripts, paths)
        triples: list[str] = []
        for path in paths:
            triples += PathTail(path, tails[path].tail, tails[path].inc)
        result = await self.call(SUB_LINKS.name, sub, *SubLinksArgv("add", "e"), *triples)
        if status_of(result) == "missing":
            raise not_found(sub)
        await self._link_streams(sub, {path: "1" for path in paths})
        await self.note_tails(sub, paths)

    async def remove_stream(self, sub: str, path: str) -> None:
        result = await self.call(SUB_LINKS.name, sub, *SubLinksArgv("remove", "e"), path)
        if status_of(result) == "missing":
            raise not_found(sub)
        if SubLinked.of(result).types[0] == "":
            await self._link_streams(sub, {path: ""})

    # -- wakes ------------------------------------------------------------------

    async def claim(self, sub: str, worker: str) -> dict[str, Any]:
        """POST claim: the wake's lease for ``worker``, over every stream's tail now."""
        current = await self.get(sub)
        if current is None:
            raise not_found(sub)
        tails = await stream_tails(self.scripts, [link.path for link in current[1]])
        observed: list[str] = []
        for path, tail in tails.items():
            observed += PathTail(path, tail.tail, tail.inc)
        result = await self.call(SUB_CLAIM.name, sub, *SubClaimArgv(worker, new_wake_id()), *observed)
        status = status_of(result)
        if status == "missing":
            raise not_found(sub)
        if status == "wrong_type":
            raise coded(400, "INVALID_REQUEST", "subscription is not pull-wake")
        if status == "busy":
            busy = SubClaimBusy(*result)
            raise coded(
                409,
                "ALREADY_CLAIMED",
                "another worker holds the lease",
                current_holder=busy.holder,
                generation=int(busy.generation),
            )
        if status == "idle":
            raise coded(409, "NO_PENDING_WORK", "subscription has no pending work")
        claimed = SubClaimed(*result)
        return {
            "generation": int(claimed.generation),
            "wake_id": claimed.wake_id,
            "lease_ttl_ms": int(claimed.lease_ms),
            "streams": wake_streams(claimed.streams),
        }

    async def ack(self, mode: str, sub: str, request: AckRequest) -> bool:
        """Callback (webhook), ack or release (pull-wake); returns next_wake."""
        tails = await stream_tails(self.scripts, [path for path, _ in request.acks]) if request.acks else {}
        triples: list[str] = []
        for path, offset in request.acks:
            triples += SubAck(path, offset, tails[path].tail if tails[path].inc else "")
        argv = SubAckArgv(
            mode, request.generation, request.wake_id, "1" if request.done else "0", new_wake_id()
        )
        result = await self.call(SUB_ACK.name, sub, *argv, *triples)
        status = status_of(result)
        if status == "missing":
            raise not_found(sub)
        if status == "wrong_type":
            kind = "webhook" if mode == "callback" else "pull-wake"
            raise coded(400, "INVALID_REQUEST", f"subscription is not {kind}")
        if status == "fenced":
            raise coded(409, "FENCED", "wake generation is stale")
        if status == "invalid_offset":
            raise coded(409, "INVALID_OFFSET", SubAckInvalid(*result).why)
        return SubWoke(*result).new_wake == "1"


def not_found(sub: str) -> Exception:
    return coded(404, "SUBSCRIPTION_NOT_FOUND", f"no subscription {sub[:100]!r}")
