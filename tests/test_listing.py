"""Listing streams, ``GET {prefix}/__ds/streams`` (issue 17): the rules (query, cursor,
key ranges, what a credential may list) without Redis, then against a real Redis and a
real Redis Cluster: pages cover every stream once, the fields match HEAD, deleted,
expired and soft-deleted streams leave the listing, access control narrows it, and
``durable-streams migrate`` lists the streams made before the index was kept."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp
import pytest
import redis.asyncio as aioredis

from gateway.cli.embedded import EmbeddedRedis
from gateway.features.listing import IndexSweep, Listing, lex_range
from gateway.protocol import listing as rules
from gateway.protocol.access import EVERYTHING, Grants, Principal
from gateway.protocol.errors import ProtocolError
from gateway.redis_io import keys, layout
from gateway.redis_io.scripts import connect_scripts

from .cluster import Cluster
from .conftest import serving

TEXT = {"Content-Type": "text/plain"}

# -- rules ------------------------------------------------------------------------------------


def test_query_limits_and_defaults() -> None:
    assert rules.parse_query({}, 1) == rules.Query("", rules.Position(0), rules.DEFAULT_LIMIT)
    assert rules.parse_query({"prefix": "a/", "limit": "7", "after": "a/3"}, 1) == rules.Query(
        "a/", rules.Position(0, "a/3"), 7
    )
    for bad in ("0", "1001", "-1", "x", "1.5", "٣", "00001", "9" * 5000):
        with pytest.raises(ProtocolError) as refused:
            rules.parse_query({"limit": bad}, 1)
        assert refused.value.status == 400, bad


def test_cursors_round_trip_and_foreign_ones_are_refused() -> None:
    for position in (rules.Position(0, "a/b"), rules.Position(0, "é/{x}%")):
        assert rules.decode_cursor(rules.encode_cursor(position, 1), 1) == position
    for position in (rules.Position(0, "a/b"), rules.Position(16383, "é:{x}%"), rules.Position(7)):
        cursor = rules.encode_cursor(position, 16384)
        assert cursor.startswith("c1.") and "/" not in cursor
        assert rules.decode_cursor(cursor, 16384) == position
    for bad in ("a/b", "c1.!!!", "c1." + "eA", "c1.OTk5OTk6eA"):  # a path, not base64, no part, part 99999
        with pytest.raises(ProtocolError) as refused:
            rules.decode_cursor(bad, 16384)
        assert refused.value.status == 400, bad


def test_lex_ranges() -> None:
    assert lex_range(b"", None) == (b"-", b"+")
    assert lex_range(b"", b"k") == (b"(k", b"+")
    assert lex_range(b"a/", None) == (b"[a/", b"[a/\xff")
    assert lex_range(b"a/", b"a/7") == (b"(a/7", b"[a/\xff")
    assert lex_range(b"a/", b"0") == (b"[a/", b"[a/\xff")  # a cursor before the prefix
    assert lex_range(b"a/", b"b") is None  # past every path with the prefix


def test_what_a_credential_lists() -> None:
    def principal(spec: dict[str, tuple[str, ...]], only: str | None = None) -> Principal:
        return Principal("p", Grants(spec), only_path=only)  # type: ignore[arg-type]

    assert rules.readable_prefixes(principal(EVERYTHING.prefixes), "a/") == ["a/"]  # type: ignore[arg-type]
    reader = principal({"read": ("chat/",), "write": ("jobs/1/", "jobs/")})
    assert rules.readable_prefixes(reader, "") == ["chat/", "jobs/"]  # nested grants: the outer one
    assert rules.readable_prefixes(reader, "chat/4") == ["chat/4"]  # all of it readable
    assert rules.readable_prefixes(reader, "other/") == []
    assert rules.readable_prefixes(principal({"admin": ("",)}), "x") == ["x"]
    signed = principal({"read": ("a/",)}, only="a/b")
    assert rules.readable_prefixes(signed, "") == ["a/b"]
    assert rules.readable_prefixes(principal({"read": ("z/",)}, only="a/b"), "") == []
    many = principal({"read": tuple(f"t{n}/" for n in range(rules.MAX_PREFIXES + 1))})
    assert rules.readable_prefixes(many, "t") == ["t"]  # too many ranges: one, each path checked
    with pytest.raises(ProtocolError) as refused:
        rules.check_listable(Principal("anonymous", Grants({}), anonymous=True), [])
    assert refused.value.status == 401
    rules.check_listable(principal({"read": ("z/",)}), [])  # credentials that cover nothing: empty page


# -- against Redis ----------------------------------------------------------------------------


async def _put(
    http: aiohttp.ClientSession, url: str, headers: dict[str, str] | None = None, body: bytes = b"x"
) -> None:
    async with http.put(url, headers={**TEXT, **(headers or {})}, data=body) as r:
        assert r.status in (200, 201), (url, r.status, await r.text())


async def _page(
    http: aiohttp.ClientSession,
    base: str,
    status: int = 200,
    headers: dict[str, str] | None = None,
    **query: Any,
) -> dict[str, Any]:
    async with http.get(
        f"{base}/__ds/streams", params={k: str(v) for k, v in query.items()}, headers=headers
    ) as r:
        assert r.status == status, await r.text()
        return await r.json() if status == 200 else {"error": await r.text()}


async def _walk(
    http: aiohttp.ClientSession, base: str, prefix: str, limit: int, headers: dict[str, str] | None = None
) -> list[str]:
    """Every path listed under ``prefix``, page after page."""
    seen: list[str] = []
    after = None
    for _ in range(1000):
        query: dict[str, Any] = {"prefix": prefix, "limit": limit, **({"after": after} if after else {})}
        page = await _page(http, base, headers=headers, **query)
        assert len(page["streams"]) <= limit
        seen += [s["path"] for s in page["streams"]]
        assert page["has_more"] == (page["next_cursor"] is not None)
        if not page["has_more"]:
            return seen
        after = page["next_cursor"]
    raise AssertionError("the pages never ended")


def _order(path: str) -> bytes:
    return keys.stream_id(path).encode()


async def test_pages_cover_every_stream_once_in_path_order(
    redis_url: str, http: aiohttp.ClientSession
) -> None:
    p = f"list-{uuid.uuid4().hex[:8]}"
    paths = [f"{p}/{n:02d}" for n in range(20)] + [f"{p}/x%y", f"{p}/{{t}}", f"{p}/é", f"{p}/a/b/c", f"{p}0"]
    async with serving(redis_url) as base:
        await asyncio.gather(*(_put(http, f"{base}/{path}") for path in paths))
        for limit in (1, 3, 7, 1000):
            seen = await _walk(http, base, p, limit)
            assert seen == sorted(paths, key=_order), limit
        assert await _walk(http, base, f"{p}/", 4) == sorted(
            (x for x in paths if x.startswith(f"{p}/")), key=_order
        )
        assert await _walk(http, base, f"{p}/a/", 4) == [f"{p}/a/b/c"]
        assert await _walk(http, base, f"{p}-nothing", 4) == []
        # any path works as `after` on one Redis: the streams after it
        page = await _page(http, base, prefix=p, after=f"{p}/09", limit=2)
        assert [s["path"] for s in page["streams"]] == [f"{p}/10", f"{p}/11"]
        for bad in ("0", "1001", "many"):
            await _page(http, base, 400, limit=bad)


async def test_fields_match_the_streams(redis_url: str, http: aiohttp.ClientSession) -> None:
    p = f"fields-{uuid.uuid4().hex[:8]}"
    async with serving(redis_url) as base:
        await _put(
            http, f"{base}/{p}/json", {"Content-Type": "application/json", "Stream-TTL": "600"}, b'[{"a":1}]'
        )
        await _put(http, f"{base}/{p}/closed", {"Stream-Closed": "true"}, b"done")
        async with http.post(
            f"{base}/{p}/json", headers={"Content-Type": "application/json"}, data=b'{"b":2}'
        ) as r:
            assert r.status in (200, 204)
        await _put(http, f"{base}/{p}/fork", {"Stream-Forked-From": f"/v1/stream/{p}/closed"}, b"")
        listed = {s["path"]: s for s in (await _page(http, base, prefix=p))["streams"]}
        assert set(listed) == {f"{p}/json", f"{p}/closed", f"{p}/fork"}
        for path, item in listed.items():
            async with http.head(f"{base}/{path}") as r:
                assert item["tail_offset"] == r.headers["Stream-Next-Offset"], path
                assert item["content_type"] == r.headers["Content-Type"], path
                assert item["status"] == ("closed" if r.headers.get("Stream-Closed") == "true" else "open")
            assert isinstance(item["created_at_ms"], int) and item["created_at_ms"] > 1.7e12
        json_stream = listed[f"{p}/json"]
        assert (
            json_stream["ttl_seconds"] == 600 and json_stream["expires_at_ms"] > json_stream["created_at_ms"]
        )
        assert json_stream["last_write_at_ms"] >= json_stream["created_at_ms"]
        assert listed[f"{p}/closed"]["bytes"] == 4 and listed[f"{p}/closed"]["expires_at_ms"] is None
        assert listed[f"{p}/fork"]["forked_from"] == f"{p}/closed" and listed[f"{p}/fork"]["bytes"] == 4


async def test_deleted_expired_and_soft_deleted_streams_leave_the_listing(
    redis_url: str, http: aiohttp.ClientSession
) -> None:
    p = f"gone-{uuid.uuid4().hex[:8]}"
    async with serving(redis_url) as base:
        for name in ("kept", "deleted", "source"):
            await _put(http, f"{base}/{p}/{name}")
        await _put(http, f"{base}/{p}/short", {"Stream-TTL": "1"})
        await _put(http, f"{base}/{p}/fork", {"Stream-Forked-From": f"/v1/stream/{p}/source"}, b"")
        assert len(await _walk(http, base, p, 2)) == 5
        for name in ("deleted", "source"):  # the source stays (soft-deleted) while its fork reads it
            async with http.delete(f"{base}/{p}/{name}") as r:
                assert r.status in (200, 204)
        await asyncio.sleep(1.5)  # the TTL stream expires: Redis drops its keys, no script runs
        async with aioredis.Redis.from_url(redis_url) as client:
            short = keys.stream_id(f"{p}/short")
            assert await client.zscore(keys.STREAM_INDEX, short) is not None  # still in the index
            assert await _walk(http, base, p, 2) == [f"{p}/fork", f"{p}/kept"]
            assert await client.zscore(keys.STREAM_INDEX, short) is None  # the listing took it out
        await _put(http, f"{base}/{p}/deleted")  # made again: listed again
        assert await _walk(http, base, p, 2) == [f"{p}/deleted", f"{p}/fork", f"{p}/kept"]


async def test_a_credential_lists_what_it_may_read(
    redis_url: str, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    p = f"auth-{uuid.uuid4().hex[:8]}"
    tokens = {
        "admin": ("t-admin-0123456789abcdef", "admin:"),
        "a-only": ("t-aonly-0123456789abcdef", f"read:{p}/a/ write:{p}/b/1"),
        "none": ("t-none-0123456789abcdef0", "read:elsewhere/"),
    }
    entries = [{"name": n, "token": t, "grants": g} for n, (t, g) in tokens.items()]
    (tmp_path / "tokens.json").write_text(json.dumps({"tokens": entries}))
    paths = [f"{p}/a/1", f"{p}/a/2", f"{p}/b/1", f"{p}/b/2", f"{p}/c"]

    def bearer(name: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {tokens[name][0]}"}

    async with serving(redis_url, auth_tokens_file=str(tmp_path / "tokens.json")) as base:
        for path in paths:
            await _put(http, f"{base}/{path}", bearer("admin"))
        assert await _walk(http, base, p, 2, bearer("admin")) == paths
        assert await _walk(http, base, p, 1, bearer("a-only")) == [f"{p}/a/1", f"{p}/a/2", f"{p}/b/1"]
        assert await _walk(http, base, f"{p}/a/2", 1, bearer("a-only")) == [f"{p}/a/2"]
        assert await _walk(http, base, p, 2, bearer("none")) == []
        await _page(http, base, 401, prefix=p)  # no credentials
        await _page(http, base, 401, prefix=p, headers={"Authorization": "Bearer wrong-token-0123456789"})


async def test_migrate_lists_streams_made_before_the_index(
    own_redis: EmbeddedRedis, http: aiohttp.ClientSession
) -> None:
    """Layout v1 had no index: `migrate` (step v1 -> v2) lists every live stream, and an
    idempotent PUT of an unlisted stream lists it too."""
    paths = [f"old/{n}" for n in range(5)]
    async with serving(own_redis.url) as base:
        for path in paths:
            await _put(http, f"{base}/{path}")
        async with aioredis.Redis.from_url(own_redis.url) as client:
            await client.delete(keys.STREAM_INDEX)  # as a v1 install left it
            await client.set(keys.LAYOUT, 1)
            assert await _walk(http, base, "old/", 10) == []
            await _put(http, f"{base}/old/0")  # the same PUT again: 200, listed now
            assert await _walk(http, base, "old/", 10) == ["old/0"]
            said: list[str] = []
            assert await layout.migrate(client, said.append, current=3) == 3  # the offline steps
            assert said[0].startswith("layout v1 -> v2: List every stream in the stream index")
            assert await _walk(http, base, "old/", 2) == paths
            assert await layout.index_streams(client) == 0  # again: nothing missing


async def test_pages_on_a_cluster_cover_every_slot_once(
    redis_cluster: Cluster, http: aiohttp.ClientSession
) -> None:
    p = f"clist-{uuid.uuid4().hex[:8]}"
    paths = [f"{p}/{n}" for n in range(40)]
    async with serving(redis_cluster.seed_url, redis_cluster=True) as base:
        await asyncio.gather(*(_put(http, f"{base}/{path}") for path in paths))
        slots = {keys.stream_slot(keys.stream_id(path)) for path in paths}
        assert len(slots) > 30  # spread over many slots (and so every primary)
        for limit in (1, 7, 1000):
            seen = await _walk(http, base, p, limit)
            assert sorted(seen) == sorted(paths) and len(seen) == len(paths), limit
        # in slot order, each slot's streams by path
        assert seen == sorted(paths, key=lambda x: (keys.stream_slot(keys.stream_id(x)), _order(x)))
        page = await _page(http, base, prefix=p, limit=5)
        assert page["next_cursor"].startswith("c1.")
        await _page(http, base, 400, prefix=p, after=f"{p}/3")  # a path is no cluster cursor
        nothing = await _page(http, base, prefix=f"{p}-none")  # every slot's index asked: in steps
        assert nothing["streams"] == [] and nothing["has_more"]
        assert await _walk(http, base, f"{p}-none", 10) == []
        async with http.delete(f"{base}/{paths[0]}") as r:
            assert r.status in (200, 204)
        assert sorted(await _walk(http, base, p, 9)) == sorted(paths[1:])


async def test_the_registry_stream_records_creates_and_deletes(
    redis_url: str, http: aiohttp.ClientSession
) -> None:
    """--stream-registry: __registry__ holds upstream's change events, in order; an idempotent
    PUT adds none; the materialized state (as upstream's test UI builds it) is what exists."""
    p = f"reg-{uuid.uuid4().hex[:8]}"
    async with serving(redis_url, stream_registry=True) as base:
        await _put(http, f"{base}/{p}/1")
        await _put(http, f"{base}/{p}/2", {"Content-Type": "application/json"}, b"[]")
        await _put(http, f"{base}/{p}/1")  # exists alike: no event
        async with http.delete(f"{base}/{p}/1") as r:
            assert r.status == 204
        async with http.get(f"{base}/__registry__", params={"offset": "-1"}) as r:
            assert r.status == 200 and r.headers["Content-Type"] == "application/json"
            events = [e for e in await r.json() if e["key"].startswith(f"{p}/")]
    assert [(e["key"], e["headers"]["operation"]) for e in events] == [
        (f"{p}/1", "insert"),
        (f"{p}/2", "insert"),
        (f"{p}/1", "delete"),
    ]
    assert events[1]["type"] == "streams" and events[1]["value"]["contentType"] == "application/json"
    assert isinstance(events[1]["value"]["createdAt"], int)
    state: dict[str, Any] = {}
    for e in events:
        if e["headers"]["operation"] == "delete":
            state.pop(e["key"], None)
        else:
            state[e["key"]] = e["value"]
    assert list(state) == [f"{p}/2"]


async def test_one_stream_with_its_producers(
    redis_url: str, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    p = f"one-{uuid.uuid4().hex[:8]}"
    entries = [{"name": "r", "token": "t-reader-0123456789abcdef", "grants": f"admin:{p}/a"}]
    (tmp_path / "tokens.json").write_text(json.dumps({"tokens": entries}))
    auth = {"Authorization": "Bearer t-reader-0123456789abcdef"}
    async with serving(redis_url, auth_tokens_file=str(tmp_path / "tokens.json")) as base:
        await _put(http, f"{base}/{p}/a", auth)
        for producer, epoch, seq in (
            ("w-2", 0, 0),
            ("w-1", 3, 0),
            ("w-1", 3, 1),
            ("w-2", 0, 1),
            ("w-2", 0, 2),
        ):
            headers = {
                **TEXT,
                **auth,
                "Producer-Id": producer,
                "Producer-Epoch": str(epoch),
                "Producer-Seq": str(seq),
            }
            async with http.post(f"{base}/{p}/a", headers=headers, data=b"x") as r:
                assert r.status in (200, 204), await r.text()
        async with http.get(f"{base}/__ds/streams/{p}/a", headers=auth) as r:
            assert r.status == 200, await r.text()
            one = await r.json()
        assert one["path"] == f"{p}/a" and one["bytes"] == 6 and one["producer_count"] == 2
        assert one["producers"] == [{"id": "w-1", "epoch": 3, "seq": 1}, {"id": "w-2", "epoch": 0, "seq": 2}]
        async with http.get(f"{base}/__ds/streams/{p}/a") as r:
            assert r.status == 401  # no credentials
        async with http.get(f"{base}/__ds/streams/{p}/a-missing", headers=auth) as r:
            assert r.status == 404
        async with http.get(f"{base}/__ds/streams/{p}/b", headers=auth) as r:
            assert r.status == 403  # not its to read


async def test_grants_whose_paths_sort_otherwise_than_their_ids(
    redis_url: str, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """Grants `x&` and `x{`: as paths `x&` < `x{`, as stream ids `x%7B` < `x&` (the index's
    order). Every page walk lists each readable stream once (a review found pages
    repeating one range and never reaching the other)."""
    p = f"ord-{uuid.uuid4().hex[:8]}"
    token = "t-grants-0123456789abcdef"
    entries = [
        {"name": "g", "token": token, "grants": f"read:{p}/x& read:{p}/x{{ read:{p}/%"},
        {"name": "admin", "token": "t-admin-0123456789abcdef", "grants": "admin:"},
    ]
    (tmp_path / "tokens.json").write_text(json.dumps({"tokens": entries}))
    auth, admin = {"Authorization": f"Bearer {token}"}, {"Authorization": "Bearer t-admin-0123456789abcdef"}
    paths = [f"{p}/{stem}{n}" for stem in ("x&", "x{", "%") for n in ("", "1", "2", "3")]
    async with serving(redis_url, auth_tokens_file=str(tmp_path / "tokens.json")) as base:
        for path in [*paths, f"{p}/x", f"{p}/y"]:
            await _put(http, f"{base}/{quote(path)}", admin)
        for limit in (1, 2, 3, 5, 1000):
            seen = await _walk(http, base, p, limit, auth)
            assert seen == sorted(paths, key=_order), limit


async def test_a_signed_url_lists_its_one_stream(
    redis_url: str, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    p = f"sig-{uuid.uuid4().hex[:8]}"
    token = "t-admin-0123456789abcdef"
    (tmp_path / "tokens.json").write_text(
        json.dumps({"tokens": [{"name": "a", "token": token, "grants": "admin:"}]})
    )
    (tmp_path / "signing.key").write_text("k" * 48)
    settings = {
        "auth_tokens_file": str(tmp_path / "tokens.json"),
        "auth_signing_key_file": str(tmp_path / "signing.key"),
    }
    auth = {"Authorization": f"Bearer {token}"}
    async with serving(redis_url, **settings) as base:
        for path in (f"{p}/a", f"{p}/a0", f"{p}/a1"):
            await _put(http, f"{base}/{path}", auth)
        root = base.split("/v1/stream")[0]
        async with http.post(f"{root}/auth/sign", json={"path": f"{p}/a"}, headers=auth) as r:
            assert r.status == 200
            signed = (await r.json())["url"]
        query = dict(part.split("=", 1) for part in signed.split("?", 1)[1].split("&"))
        page = await _page(http, base, prefix=f"{p}/a", **query)  # the signature covers the path given
        assert [s["path"] for s in page["streams"]] == [f"{p}/a"] and not page["has_more"]
        async with http.options(f"{base}/__ds/streams", headers={"Origin": "https://x.example"}) as r:
            assert r.status == 204  # a browser's preflight before a listing with a token


async def test_detail_shows_producers_to_writers_only(
    redis_url: str, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    p = f"prod-{uuid.uuid4().hex[:8]}"
    tokens = [
        {"name": "w", "token": "t-writer-0123456789abcdef", "grants": f"admin:{p}/"},
        {"name": "r", "token": "t-reader-0123456789abcdef", "grants": f"read:{p}/"},
    ]
    (tmp_path / "tokens.json").write_text(json.dumps({"tokens": tokens}))
    writer, reader = ({"Authorization": f"Bearer {t['token']}"} for t in tokens)
    async with serving(redis_url, auth_tokens_file=str(tmp_path / "tokens.json")) as base:
        await _put(http, f"{base}/{p}/s", writer)
        headers = {**TEXT, **writer, "Producer-Id": "w-1", "Producer-Epoch": "0", "Producer-Seq": "0"}
        async with http.post(f"{base}/{p}/s", headers=headers, data=b"x") as r:
            assert r.status == 200
        for who, expected in ((writer, [{"id": "w-1", "epoch": 0, "seq": 0}]), (reader, None)):
            async with http.get(f"{base}/__ds/streams/{p}/s", headers=who) as r:
                one = await r.json()
            assert one["producers"] == expected and one["producer_count"] == (1 if expected else None)


async def test_the_sweep_takes_expired_streams_out_of_the_index(
    own_redis: EmbeddedRedis, http: aiohttp.ClientSession
) -> None:
    async with serving(own_redis.url) as base:
        for n in range(30):
            await _put(http, f"{base}/sweep/{n:02d}", {"Stream-TTL": "1"} if n % 3 == 0 else {})
    await asyncio.sleep(1.5)
    scripts = connect_scripts(own_redis.url, cluster=False, max_connections=4, timeout=5.0)
    try:
        sweep = IndexSweep(Listing(scripts))
        async with aioredis.Redis.from_url(own_redis.url) as client:
            assert await client.zcard(keys.STREAM_INDEX) == 30
            assert await sweep.once()
            assert not await sweep.once()  # one sweep per interval, whoever takes it
            assert await client.zcard(keys.STREAM_INDEX) == 20
            assert not await client.exists(keys.INDEX_SWEEP_AT)  # it reached the end: round again
    finally:
        await scripts.aclose()


async def test_the_registry_is_made_again_after_a_delete(redis_url: str, http: aiohttp.ClientSession) -> None:
    p = f"reg2-{uuid.uuid4().hex[:8]}"
    async with serving(redis_url, stream_registry=True) as base:
        await _put(http, f"{base}/{p}/1")
        async with http.delete(f"{base}/__registry__") as r:
            assert r.status == 204
        await _put(http, f"{base}/{p}/2")  # the first event after the delete is not lost
        async with http.get(f"{base}/__registry__", params={"offset": "-1"}) as r:
            assert [e["key"] for e in await r.json()] == [f"{p}/2"]
