"""Tenants (docs/tenants.md): whose a request is, quotas checked by the write's own script
(exact across gateways), usage given back on delete and expiry, the admin API, bad input.

The rules are plain functions (first, no Redis); then a gateway with --tenants on a real
Redis; then three gateway processes racing one tenant's quotas (history checked)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
import uuid
from pathlib import Path

import aiohttp
import pytest

from gateway.features.tenants import Tenants
from gateway.http.auth import load_tokens
from gateway.protocol import tenants
from gateway.protocol.errors import ProtocolError
from gateway.redis_io import keys
from gateway.redis_io.limits import STEP_BYTES
from gateway.redis_io.scripts import Scripts

from .conftest import gateway_process, read_all, serving

TEXT = {"Content-Type": "text/plain"}
JSON_TYPE = {"Content-Type": "application/json"}
RULES = tenants.parse_path_rules("t/=shared")


# -- the rules, without Redis ---------------------------------------------------------


def test_path_rules_parse_and_refuse_bad_ones() -> None:
    rules = tenants.parse_path_rules("acme/=acme, acme/eu/=acme-eu;public/=demo")
    assert [(r.prefix, r.tenant) for r in rules] == [
        ("acme/", "acme"),
        ("acme/eu/", "acme-eu"),
        ("public/", "demo"),
    ]
    assert tenants.parse_path_rules("  ") == ()
    for bad, why in [
        ("acme/", "expected <prefix>=<tenant>"),
        ("acme/=a:b", "a tenant name is"),
        ("acme/=_x", "a tenant name is"),
        ("a/=x a/=y", "given twice"),
        ("a/=" + "x" * 65, "a tenant name is"),
    ]:
        with pytest.raises(ValueError, match=why):
            tenants.parse_path_rules(bad)


def test_a_requests_tenant() -> None:
    rules = tenants.parse_path_rules("acme/=acme acme/eu/=acme-eu =everyone")
    assert tenants.tenant_of("bank", True, "acme/x", rules) == "bank"  # the credential's, whatever the path
    assert tenants.tenant_of(None, False, "acme/eu/1", rules) == "acme-eu"  # the longest prefix
    assert tenants.tenant_of(None, False, "acme/us/1", rules) == "acme"
    assert tenants.tenant_of(None, False, "other", rules) == "everyone"
    with pytest.raises(ProtocolError) as refused:
        tenants.tenant_of(None, True, "acme/x", rules)  # a credential naming none: no fallback
    assert refused.value.status == 403 and "names no tenant" in refused.value.message
    with pytest.raises(ProtocolError) as refused:
        tenants.tenant_of(None, False, "x", tenants.parse_path_rules("acme/=acme"))
    assert refused.value.status == 403 and "--tenant-paths" in refused.value.message


def test_claims_and_token_entries_name_tenants(tmp_path: Path) -> None:
    assert tenants.claim_tenant(None) is None
    assert tenants.claim_tenant("acme.eu_1") == "acme.eu_1"
    for bad in (7, ["acme"], "", "a b", "a/b", "{x}"):
        with pytest.raises(ValueError):
            tenants.claim_tenant(bad)
    path = tmp_path / "tokens.json"
    entry = {"name": "w", "token": "x" * 20, "grants": "write:*", "tenant": "acme"}
    path.write_text(json.dumps({"tokens": [entry]}))
    assert [t.tenant for t in load_tokens(str(path), tenanted=True).values()] == ["acme"]
    path.write_text(json.dumps({"tokens": [{**entry, "tenant": "no:colons"}]}))
    with pytest.raises(ValueError, match="token 'w': tenant 'no:colons'"):
        load_tokens(str(path), tenanted=True)
    # Tenants off: the field is not read (a free-form one, as before, starts the server).
    assert [t.tenant for t in load_tokens(str(path)).values()] == [None]


def test_quota_updates_are_checked_whole() -> None:
    assert tenants.parse_quotas({"streams": 3, "stored_bytes": None}) == {"streams": 3, "stored_bytes": None}
    for bad, why in [
        ({}, "expected a JSON object"),
        ([1], "expected a JSON object"),
        ({"streams": -1}, "whole number"),
        ({"streams": 1.5}, "whole number"),
        ({"streams": "3"}, "whole number"),
        ({"streams": True}, "whole number"),
        ({"streams": 2**60}, "whole number"),
        ({"bytes": 3}, "unknown quota 'bytes'"),
        ({"written_period_seconds": 0}, "at least 1 second"),
    ]:
        with pytest.raises(ValueError, match=why):
            tenants.parse_quotas(bad)


def test_usage_reads_written_bytes_of_this_period_only() -> None:
    fields = {"u.streams": "2", "u.stored_bytes": "10", "u.written_bytes": "7", "u.period_start": "86400"}
    assert tenants.usage_of(fields, 86_400_500, 86400)["written_bytes"] == 7
    assert tenants.usage_of(fields, 2 * 86_400_000, 86400)["written_bytes"] == 0  # a new day
    assert tenants.effective({"streams": 1}, {"streams": 5, "stored_bytes": 9})["stored_bytes"] == 9
    assert tenants.effective({}, {})["written_period_seconds"] == tenants.DEFAULT_PERIOD_SECONDS


# -- one gateway ------------------------------------------------------------------------


def _name() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


async def _quotas(
    http: aiohttp.ClientSession, base: str, tenant: str, body: object, **kw: object
) -> aiohttp.ClientResponse:
    async with http.patch(f"{base}/__ds/tenants/{tenant}/quotas", data=json.dumps(body), **kw) as r:
        await r.read()
        return r


async def _tenant(http: aiohttp.ClientSession, base: str, tenant: str) -> dict:
    async with http.get(f"{base}/__ds/tenants/{tenant}") as r:
        assert r.status == 200, await r.text()
        return await r.json()


@pytest.fixture
async def tenanted(redis_url: str):
    """A gateway with tenants on, anonymous requests under <tenant>/ being <tenant>'s."""
    names = [_name() for _ in range(3)]
    rules = " ".join(f"{n}/={n}" for n in names)
    async with serving(redis_url, tenants=True, tenant_paths=rules) as base:
        yield base, names


async def test_the_streams_quota_holds_and_a_delete_gives_back(tenanted, http) -> None:
    base, (a, *_) = tenanted
    assert (await _quotas(http, base, a, {"streams": 2})).status == 200
    for i in range(2):
        async with http.put(f"{base}/{a}/s{i}", headers=TEXT) as r:
            assert r.status == 201
    async with http.put(f"{base}/{a}/s2", headers=TEXT) as r:
        assert r.status == 403
        assert "quota 'streams' exceeded: limit 2, usage 2" in await r.text()
        assert r.headers["Stream-Quota"] == "quota=streams; limit=2; usage=2; asked=1"
    async with http.head(f"{base}/{a}/s2") as r:
        assert r.status == 404  # nothing made
    async with http.put(f"{base}/{a}/s1", headers=TEXT) as r:
        assert r.status == 200  # an idempotent re-create is no new stream
    async with http.delete(f"{base}/{a}/s0") as r:
        assert r.status == 204
    async with http.put(f"{base}/{a}/s2", headers=TEXT) as r:
        assert r.status == 201
    assert (await _tenant(http, base, a))["usage"]["streams"] == 2


async def test_the_bytes_quotas_hold_to_the_byte(tenanted, http) -> None:
    base, (a, *_) = tenanted
    await _quotas(http, base, a, {"stored_bytes": 100, "written_bytes": 150})
    async with http.put(f"{base}/{a}/x", data=b"a" * 40, headers=TEXT) as r:
        assert r.status == 201
    async with http.post(f"{base}/{a}/x", data=b"b" * 60, headers=TEXT) as r:
        assert r.status == 204  # exactly the quota
    async with http.post(f"{base}/{a}/x", data=b"c", headers=TEXT) as r:
        assert (
            r.status == 403
            and r.headers["Stream-Quota"] == "quota=stored_bytes; limit=100; usage=100; asked=1"
        )
    async with http.post(f"{base}/{a}/x", headers={**TEXT, "Stream-Closed": "true"}) as r:
        assert r.status == 204  # closing stores nothing: allowed
    assert await read_all(http, f"{base}/{a}/x") == b"a" * 40 + b"b" * 60
    usage = (await _tenant(http, base, a))["usage"]
    assert (usage["stored_bytes"], usage["written_bytes"], usage["streams"]) == (100, 100, 1)
    async with http.delete(f"{base}/{a}/x") as r:
        assert r.status == 204
    # Stored bytes come back with the delete; bytes written this period do not.
    async with http.put(f"{base}/{a}/y", data=b"d" * 51, headers=TEXT) as r:
        assert r.status == 403 and "written_bytes" in r.headers["Stream-Quota"]
    async with http.put(f"{base}/{a}/y", data=b"d" * 50, headers=TEXT) as r:
        assert r.status == 201
    usage = (await _tenant(http, base, a))["usage"]
    assert (usage["stored_bytes"], usage["written_bytes"], usage["streams"]) == (50, 150, 1)


async def test_json_and_a_producers_retry(tenanted, http) -> None:
    base, (a, *_) = tenanted
    await _quotas(http, base, a, {"stored_bytes": 20})
    async with http.put(f"{base}/{a}/j", headers=JSON_TYPE) as r:
        assert r.status == 201
    producer = {"Producer-Id": "p", "Producer-Epoch": "0", "Producer-Seq": "0"}
    async with http.post(
        f"{base}/{a}/j", data=b'[{"k":"0123456789"}]', headers={**JSON_TYPE, **producer}
    ) as r:
        assert r.status == 200  # a message of 18 bytes stored
    async with http.post(f"{base}/{a}/j", data=b'{"k":1}', headers=JSON_TYPE) as r:
        assert r.status == 403  # 18 + 7 > 20
    async with http.post(
        f"{base}/{a}/j", data=b'[{"k":"0123456789"}]', headers={**JSON_TYPE, **producer}
    ) as r:
        assert r.status == 204  # the retry is its duplicate, not a new write the quota refuses
    assert (await _tenant(http, base, a))["usage"]["stored_bytes"] == 18


async def test_a_large_append_is_counted_and_refused_whole(tenanted, http, redis) -> None:
    base, (a, *_) = tenanted
    big = os.urandom(STEP_BYTES + STEP_BYTES // 2)  # written in steps
    await _quotas(http, base, a, {"stored_bytes": len(big) + 10})
    async with http.put(f"{base}/{a}/big", data=b"0123456789", headers=TEXT) as r:
        assert r.status == 201
    async with http.post(f"{base}/{a}/big", data=big + b"!", headers=TEXT) as r:
        assert r.status == 403  # refused at its first step, before its parts are sent
    async with http.post(f"{base}/{a}/big", data=big, headers=TEXT) as r:
        assert r.status == 204
    assert await read_all(http, f"{base}/{a}/big") == b"0123456789" + big
    assert (await _tenant(http, base, a))["usage"]["stored_bytes"] == len(big) + 10
    owned = await redis.hgetall(keys.tenant_streams(a))
    assert owned == {keys.stream_id(f"{a}/big").encode(): str(len(big) + 10).encode()}


async def test_an_expired_stream_is_given_back(tenanted, http, redis) -> None:
    base, (a, b, _) = tenanted
    for name in ("gone", "again"):
        async with http.put(f"{base}/{a}/{name}", data=b"12345", headers={**TEXT, "Stream-TTL": "1"}) as r:
            assert r.status == 201
    await asyncio.sleep(1.3)  # Redis drops both: no script of the stream's runs
    assert (await _tenant(http, base, a))["usage"]["streams"] == 2  # (not given back yet)
    async with http.put(f"{base}/{a}/again", data=b"1", headers=TEXT) as r:
        assert r.status == 201  # made anew: the old one's bytes given back by the create
    usage = (await _tenant(http, base, a))["usage"]
    assert (usage["streams"], usage["stored_bytes"]) == (2, 6)
    assert await Tenants(Scripts(redis)).sweep(a) == 1  # the sweep finds the other
    usage = (await _tenant(http, base, a))["usage"]
    assert (usage["streams"], usage["stored_bytes"]) == (1, 1)
    assert await Tenants(Scripts(redis)).sweep(a) == 0


async def test_the_admin_api_refuses_bad_input_and_changes_nothing(tenanted, http) -> None:
    base, (a, b, c) = tenanted
    assert (await _quotas(http, base, a, {"streams": 5, "stored_bytes": 1000})).status == 200
    before = await _tenant(http, base, a)
    for body in (b"{", b"[]", b"{}", b'{"streams": -1}', b'{"streams": 7, "nope": 1}', b'{"streams": "7"}'):
        async with http.patch(f"{base}/__ds/tenants/{a}/quotas", data=body) as r:
            assert r.status == 400, body
    async with http.patch(f"{base}/__ds/tenants/a:b/quotas", data=b'{"streams": 1}') as r:
        assert r.status == 400
    async with http.patch(f"{base}/__ds/tenants/{a}/quotas", data=b"x" * 10_000) as r:
        assert r.status == 413
    assert await _tenant(http, base, a) == before
    async with http.get(f"{base}/__ds/tenants/{_name()}") as r:
        assert r.status == 404 and "unknown tenant" in await r.text()
    async with http.get(f"{base}/__ds/tenants/bad name") as r:
        assert r.status == 400
    async with http.get(f"{base}/__ds/tenants?limit=0") as r:
        assert r.status == 400
    # null goes back to the default; the defaults apply to every tenant at once
    await _quotas(http, base, a, {"streams": None})
    try:
        assert (await _quotas(http, base, "_defaults", {"streams": 1})).status == 200
        assert (await _tenant(http, base, a))["quotas"]["streams"] == 1
        async with http.put(f"{base}/{b}/one", headers=TEXT) as r:
            assert r.status == 201
        async with http.put(f"{base}/{b}/two", headers=TEXT) as r:
            assert r.status == 403
    finally:
        await _quotas(http, base, "_defaults", {"streams": None})
    async with http.put(f"{base}/{b}/two", headers=TEXT) as r:
        assert r.status == 201
    async with http.get(f"{base}/__ds/tenants") as r:
        listed = [t["tenant"] for t in (await r.json())["tenants"]]
    assert {a, b} <= set(listed)


async def test_without_a_tenant_a_request_is_refused(tenanted, http) -> None:
    base, _ = tenanted
    async with http.put(f"{base}/nobody/x", headers=TEXT) as r:
        assert r.status == 403 and "--tenant-paths" in await r.text()
    async with http.get(f"{base}/nobody/x") as r:
        assert r.status == 403


@pytest.fixture
async def credentialed(redis_url: str, tmp_path: Path):
    """A gateway with access control: tokens of tenants a and b (both may write everything),
    one naming no tenant, and an admin's."""
    a, b = _name(), _name()
    secret = {who: uuid.uuid4().hex for who in ("a", "b", "none", "admin")}
    entries = [
        {"name": "a", "token": secret["a"], "grants": "read:* write:* admin:shared/", "tenant": a},
        {"name": "b", "token": secret["b"], "grants": "read:* write:* admin:shared/", "tenant": b},
        {"name": "none", "token": secret["none"], "grants": "read:* write:*"},
        {"name": "admin", "token": secret["admin"], "grants": "admin:"},
    ]
    path = tmp_path / "tokens.json"
    path.write_text(json.dumps({"tokens": entries}))
    auth = {who: {"Authorization": f"Bearer {s}"} for who, s in secret.items()}
    async with serving(redis_url, tenants=True, auth_tokens_file=str(path)) as base:
        yield base, a, b, auth


async def test_a_stream_is_its_tenants_to_write(credentialed, http) -> None:
    base, a, b, auth = credentialed
    url = f"{base}/shared/{uuid.uuid4().hex}"
    async with http.put(url, data=b"mine", headers={**TEXT, **auth["a"]}) as r:
        assert r.status == 201
    for method, extra in (("POST", {"data": b"theirs"}), ("PUT", {}), ("DELETE", {})):
        async with http.request(method, url, headers={**TEXT, **auth["b"]}, **extra) as r:
            assert r.status == 403 and "another tenant" in await r.text(), method
    async with http.get(url, headers=auth["b"]) as r:
        assert r.status == 200 and await r.read() == b"mine"  # reading is the grants' business
    async with http.post(url, data=b"!", headers={**TEXT, **auth["none"]}) as r:
        assert r.status == 403 and "names no tenant" in await r.text()
    async with http.get(url, headers=auth["a"]) as r:
        assert await r.read() == b"mine"
    # The API: an admin sees any tenant, a tenant its own entry only, nobody else changes quotas.
    async with http.get(f"{base}/__ds/tenants/{a}", headers=auth["admin"]) as r:
        assert r.status == 200 and (await r.json())["usage"]["stored_bytes"] == 4
    async with http.get(f"{base}/__ds/tenants/{a}", headers=auth["a"]) as r:
        assert r.status == 200
    async with http.get(f"{base}/__ds/tenants/{a}", headers=auth["b"]) as r:
        assert r.status == 403
    assert (await _quotas(http, base, a, {"streams": 9}, headers=auth["a"])).status == 403
    assert (await _quotas(http, base, a, {"streams": 9})).status == 401
    assert (await _quotas(http, base, a, {"streams": 9}, headers=auth["admin"])).status == 200


# -- three gateway processes racing one tenant's quotas -----------------------------------


async def test_three_gateways_never_pass_a_tenants_quotas(redis_url, http, tmp_path: Path) -> None:
    tenant = _name()
    stream_quota, byte_quota = 12, 20_000
    flags = ("--tenants", "--tenant-paths", f"{tenant}/={tenant}")
    with (
        gateway_process(redis_url, tmp_path / "g1.log", *flags) as g1,
        gateway_process(redis_url, tmp_path / "g2.log", *flags) as g2,
        gateway_process(redis_url, tmp_path / "g3.log", *flags) as g3,
    ):
        gateways = [g1, g2, g3]
        assert (
            await _quotas(http, g1, tenant, {"streams": stream_quota, "stored_bytes": byte_quota})
        ).status == 200
        created: set[int] = set()
        accepted: dict[int, list[bytes]] = {}
        refused: list[bytes] = []

        async def create(n: int) -> None:
            async with http.put(f"{random.choice(gateways)}/{tenant}/s{n}", headers=TEXT) as r:
                assert r.status in (201, 403), await r.text()
                if r.status == 201:
                    created.add(n)
                    accepted[n] = []

        await asyncio.gather(*(create(n) for n in range(20)))  # 20 creates race for 12 places
        assert len(created) == stream_quota

        async def writer(w: int) -> None:
            rng = random.Random(w)
            for k in range(30):
                n = rng.choice(sorted(created))
                body = f"<{w}.{k}>".encode().ljust(rng.randrange(20, 400), b".")
                async with http.post(f"{rng.choice(gateways)}/{tenant}/s{n}", data=body, headers=TEXT) as r:
                    assert r.status in (204, 403), await r.text()
                    if r.status == 204:
                        accepted[n].append(body)
                    else:
                        assert "stored_bytes" in r.headers["Stream-Quota"]
                        refused.append(body)

        await asyncio.gather(*(writer(w) for w in range(16)))
        assert refused, "the writers must reach the quota"
        total = sum(len(b) for bodies in accepted.values() for b in bodies)
        assert total <= byte_quota
        described = await _tenant(http, g2, tenant)
        assert described["usage"]["stored_bytes"] == total  # exact: every accepted byte, no other
        assert described["usage"]["streams"] == stream_quota
        # History: each stream holds exactly its accepted appends (in some order), no refused one.
        for n in created:
            data = await read_all(http, f"{g3}/{tenant}/s{n}")
            assert len(data) == sum(len(b) for b in accepted[n])
            for body in accepted[n]:
                assert data.count(body) == 1
            for body in refused:
                assert body not in data
        # The meter counted the same appends and bytes.
        counted = {"appends": 0, "bytes_in": 0, "streams_created": 0}
        meter_keys = [k async for k in _meter_keys(redis_url)]
        async with aiohttp_redis(redis_url) as client:
            for key in meter_keys:
                for field, value in (await client.hgetall(key)).items():
                    who, _, counter = field.decode().partition(" ")
                    if who == tenant and counter in counted:
                        counted[counter] += int(value)
        appends = sum(len(bodies) for bodies in accepted.values())
        assert counted == {"appends": appends, "bytes_in": total, "streams_created": stream_quota}


async def _meter_keys(redis_url: str):
    async with aiohttp_redis(redis_url) as client:
        async for key in client.scan_iter(match=f"{keys.METER_PREFIX}*"):
            yield key


def aiohttp_redis(redis_url: str):
    import redis.asyncio as aioredis

    return aioredis.Redis.from_url(redis_url)


def test_the_hour_of_the_meter() -> None:
    assert keys.meter_hour(7200 + 3599.9) == 7200
    assert keys.tenant_keys("a", time.time())[0] == keys.tenant("a")


# -- live connections, fleet-wide ---------------------------------------------------------


async def _open_sse(http: aiohttp.ClientSession, url: str) -> aiohttp.ClientResponse:
    response = await http.get(url, params={"offset": "-1", "live": "sse"})
    if response.status == 200:
        await response.content.readline()  # the answer has begun: its lease is held
    return response


async def test_live_connections_are_capped_across_gateways(redis_url, http) -> None:
    tenant = _name()
    rules = f"{tenant}/={tenant}"
    async with serving(redis_url, tenants=True, tenant_paths=rules) as one:
        async with serving(redis_url, tenants=True, tenant_paths=rules) as two:
            await _quotas(http, one, tenant, {"live_connections": 2})
            async with http.put(f"{one}/{tenant}/live", headers=TEXT) as r:
                assert r.status == 201
            first = await _open_sse(http, f"{one}/{tenant}/live")
            second = await _open_sse(http, f"{two}/{tenant}/live")
            assert (first.status, second.status) == (200, 200)
            assert (await _tenant(http, one, tenant))["usage"]["live_connections"] == 2
            async with http.get(f"{two}/{tenant}/live", params={"offset": "-1", "live": "long-poll"}) as r:
                assert r.status == 429 and r.headers["Retry-After"] == "5"
                assert r.headers["Stream-Quota"] == "quota=live_connections; limit=2; usage=2; asked=1"
            first.close()
            for _ in range(50):  # the server sees the client leave, and gives its lease back
                if (await _tenant(http, one, tenant))["usage"]["live_connections"] == 1:
                    break
                await asyncio.sleep(0.1)
            third = await _open_sse(http, f"{one}/{tenant}/live")
            assert third.status == 200
            second.close()
            third.close()


async def test_a_killed_gateways_connections_leave_the_count(redis_url, http, tmp_path: Path) -> None:
    from gateway.features.tenant_live import LEASE_SECONDS

    from .conftest import started_gateway

    tenant = _name()
    rules = f"{tenant}/={tenant}"
    proc, doomed = started_gateway(redis_url, tmp_path / "gateway.log", "--tenants", "--tenant-paths", rules)
    try:
        async with serving(redis_url, tenants=True, tenant_paths=rules) as other:
            await _quotas(http, other, tenant, {"live_connections": 3})
            async with http.put(f"{other}/{tenant}/k", headers=TEXT) as r:
                assert r.status == 201
            held = [await _open_sse(http, f"{doomed}/{tenant}/k") for _ in range(3)]
            assert [r.status for r in held] == [200] * 3
            assert (await _tenant(http, other, tenant))["usage"]["live_connections"] == 3
            proc.send_signal(signal.SIGKILL)  # no lease given back
            proc.wait(10)
            started = time.monotonic()
            while (await _tenant(http, other, tenant))["usage"]["live_connections"]:
                assert time.monotonic() - started < LEASE_SECONDS + 5, "the dead gateway's leases did not end"
                await asyncio.sleep(0.5)
            refreshed = [await _open_sse(http, f"{other}/{tenant}/k") for _ in range(3)]
            assert [r.status for r in refreshed] == [200] * 3
            for r in (*held, *refreshed):
                r.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


# -- rates and what gateways serve ----------------------------------------------------------


async def _metered(redis_url: str, tenant: str) -> dict[str, int]:
    """Every hour's meter of ``tenant``, summed by counter."""
    counted: dict[str, int] = {}
    async with aiohttp_redis(redis_url) as client:
        async for key in client.scan_iter(match=f"{keys.METER_PREFIX}*"):
            for field, value in (await client.hgetall(key)).items():
                who, _, counter = field.decode().partition(" ")
                if who == tenant:
                    counted[counter] = counted.get(counter, 0) + int(value)
    return counted


async def test_rate_quotas_are_a_tenants_own(tenanted, http) -> None:
    base, (a, b, _) = tenanted
    await _quotas(http, base, a, {"writes_per_second": 2, "reads_per_second": 0})
    async with http.put(f"{base}/{b}/r", headers=TEXT) as r:  # b has no rate quota
        assert r.status == 201

    async def post(tenant: str) -> int:
        async with http.post(f"{base}/{tenant}/r", data=b"x", headers=TEXT) as r:
            return r.status if r.status != 429 else int(r.headers["Retry-After"]) * 1000 + 429

    async with http.put(f"{base}/{a}/r", headers=TEXT) as r:
        assert r.status == 201  # (the first token of a's bucket)
    statuses = await asyncio.gather(*(post(a) for _ in range(6)))
    assert statuses.count(204) <= 2 and 1429 in statuses  # 429, Retry-After: 1
    assert await asyncio.gather(*(post(b) for _ in range(6))) == [204] * 6
    async with http.get(f"{base}/{a}/r", params={"offset": "-1"}) as r:
        assert r.status == 403 and "reads_per_second" in r.headers["Stream-Quota"]


async def test_what_gateways_serve_is_metered(tenanted, http, redis_url) -> None:
    base, (a, *_) = tenanted
    async with http.put(f"{base}/{a}/m", data=b"0123456789", headers=TEXT) as r:
        assert r.status == 201
    for _ in range(3):
        async with http.post(f"{base}/{a}/m", data=b"abcde", headers=TEXT) as r:
            assert r.status == 204
    served = 0
    for _ in range(4):
        async with http.get(f"{base}/{a}/m", params={"offset": "-1"}) as r:
            served += len(await r.read())
    async with http.get(f"{base}/{a}/m", params={"offset": "now", "live": "long-poll"}) as r:
        assert r.status == 204  # (timed out: nothing new)
    async with http.head(f"{base}/{a}/m") as r:
        assert r.status == 200
    await asyncio.sleep(1.5)  # a flush of the gateway's counts
    counted = await _metered(redis_url, a)
    assert counted["bytes_out"] == served == 4 * 25
    assert (counted["requests_create"], counted["requests_append"], counted["requests_read"]) == (1, 3, 4)
    assert (counted["requests_long_poll"], counted["requests_head"]) == (1, 1)
    assert (counted["appends"], counted["bytes_in"], counted["streams_created"]) == (3, 25, 1)


async def test_stored_bytes_are_metered_by_the_second(tenanted, http, redis, redis_url) -> None:
    base, (a, *_) = tenanted
    async with http.put(f"{base}/{a}/kept", data=b"x" * 1000, headers=TEXT) as r:
        assert r.status == 201
    started = time.monotonic()
    await asyncio.sleep(2.2)
    await Tenants(Scripts(redis)).sweep(a)
    first = (await _metered(redis_url, a))["stored_byte_seconds"]
    assert 2000 <= first <= 1000 * int(time.monotonic() - started + 1)
    async with http.post(f"{base}/{a}/kept", data=b"y" * 1000, headers=TEXT) as r:
        assert r.status == 204  # each change accrues what was stored until then, too
    await asyncio.sleep(1.1)
    await Tenants(Scripts(redis)).sweep(a)
    assert (await _metered(redis_url, a))["stored_byte_seconds"] >= first + 2000


def test_metrics_label_a_capped_number_of_tenants() -> None:
    from types import SimpleNamespace

    from gateway.features.usage import UsageMeter, request_kind
    from gateway.telemetry import metrics

    meter = UsageMeter(SimpleNamespace(redis=None), labelled=2)  # type: ignore[arg-type]
    names = [_name() for _ in range(4)]
    for name in names:
        meter.request(name, "read", 10)
    meter.request(names[0], "append", 0)
    assert meter.labelled == set(names[:2])  # the first two served; the rest are "other"
    assert metrics.TENANT_REQUESTS.labels(names[0], "append")._value.get() == 1
    assert metrics.TENANT_BYTES_OUT.labels(names[1])._value.get() == 10
    assert meter.counts[f"{names[3]} bytes_out"] == 10  # the meter counts every tenant by name
    assert (request_kind("GET", "sse"), request_kind("GET", None), request_kind("PUT", None)) == (
        "sse",
        "read",
        "create",
    )


# -- after the review: forks, adoption, signed URLs ------------------------------------------


async def test_a_forked_stream_stays_counted_until_its_last_fork_goes(tenanted, http, redis) -> None:
    base, (a, b, _) = tenanted
    async with http.put(f"{base}/{a}/src", data=b"x" * 100, headers=TEXT) as r:
        assert r.status == 201
    async with http.put(
        f"{base}/{a}/fork", headers={**TEXT, "Stream-Forked-From": f"/v1/stream/{a}/src"}
    ) as r:
        assert r.status == 201, await r.text()
    async with http.put(
        f"{base}/{b}/theirs", headers={**TEXT, "Stream-Forked-From": f"/v1/stream/{a}/src"}
    ) as r:
        assert r.status == 403 and "another tenant" in await r.text()  # nothing pinned for b
    async with http.delete(f"{base}/{a}/src") as r:
        assert r.status == 204  # soft: the fork still reads its data
    usage = (await _tenant(http, base, a))["usage"]
    assert (usage["streams"], usage["stored_bytes"]) == (2, 100)  # still held: still counted
    assert await read_all(http, f"{base}/{a}/fork") == b"x" * 100
    async with http.delete(f"{base}/{a}/fork") as r:
        assert r.status == 204  # the last fork: the source's data goes too
    for _ in range(50):  # (the source is collected after the fork's delete answered)
        if await Tenants(Scripts(redis)).sweep(a) or (await _tenant(http, base, a))["usage"]["streams"] == 0:
            break
        await asyncio.sleep(0.1)
    usage = (await _tenant(http, base, a))["usage"]
    assert (usage["streams"], usage["stored_bytes"]) == (0, 0)


async def test_a_stream_made_before_tenants_is_adopted_by_its_first_write(redis_url, http) -> None:
    tenant = _name()
    path = f"{tenant}/old"
    async with serving(redis_url) as plain:  # tenants off
        async with http.put(f"{plain}/{path}", data=b"before", headers=TEXT) as r:
            assert r.status == 201
    async with serving(redis_url, tenants=True, tenant_paths=f"{tenant}/={tenant}") as base:
        await _quotas(http, base, tenant, {"stored_bytes": 10})
        async with http.post(f"{base}/{path}", data=b"x" * 11, headers=TEXT) as r:
            assert r.status == 403  # refused: nothing changed, not adopted either
        async with http.post(
            f"{base}/{path}", data=b'"x"', headers={"Content-Type": "application/json"}
        ) as r:
            assert r.status == 409  # refused by the protocol's own check: not adopted
        async with http.get(f"{base}/__ds/tenants/{tenant}") as r:
            assert (await r.json())["usage"]["streams"] == 0
        async with http.post(f"{base}/{path}", data=b"after", headers=TEXT) as r:
            assert r.status == 204
        usage = (await _tenant(http, base, tenant))["usage"]
        assert (usage["streams"], usage["stored_bytes"]) == (1, 5)  # its bytes from then on
        async with http.delete(f"{base}/{path}") as r:
            assert r.status == 204
        usage = (await _tenant(http, base, tenant))["usage"]
        assert (usage["streams"], usage["stored_bytes"]) == (0, 0)


def test_a_signed_url_carries_its_minters_tenant() -> None:
    from gateway.protocol import access

    key = b"k" * 32
    query = access.sign(key, "write", "acme/x", 2_000, "token:w", tenant="acme")
    assert access.verify_signed(key, query, "acme/x", 1_000).tenant == "acme"
    with pytest.raises(ProtocolError):
        access.verify_signed(key, {**query, access.SIG_TENANT: "globex"}, "acme/x", 1_000)
    with pytest.raises(ProtocolError):  # dropped: the signature was over the tenant
        access.verify_signed(key, {k: v for k, v in query.items() if k != access.SIG_TENANT}, "acme/x", 1_000)
    plain = access.sign(key, "read", "acme/x", 2_000, "token:w")  # as before tenants: v1
    assert access.SIG_TENANT not in plain and access.verify_signed(key, plain, "acme/x", 1_000).tenant is None


async def test_a_tenants_usage_history(redis_url, http, redis, tmp_path: Path) -> None:
    """GET …/tenants/<name>/usage: per UTC day, what the usage files hold and what Redis still
    holds, added up; bad days are 400."""
    from datetime import UTC, datetime

    from gateway.archive.files import Archive
    from workers.meter import GRACE_SECONDS, Meter

    tenant = _name()
    archive = str(tmp_path / "archive")
    async with serving(
        redis_url, tenants=True, tenant_paths=f"{tenant}/={tenant}", archive_url=archive
    ) as base:
        async with http.put(f"{base}/{tenant}/h", data=b"12345", headers=TEXT) as r:
            assert r.status == 201
        # This hour's counts moved to a usage file as if it had closed, then more in Redis.
        await Meter(redis, Archive(archive)).flush_once(time.time() + 3600 + GRACE_SECONDS + 1)
        async with http.post(f"{base}/{tenant}/h", data=b"678", headers=TEXT) as r:
            assert r.status == 204
        async with http.get(f"{base}/__ds/tenants/{tenant}/usage") as r:
            assert r.status == 200, await r.text()
            found = await r.json()
        today = datetime.now(UTC).date().isoformat()
        (day,) = found["days"]
        assert day["day"] == today and found["to"] == today
        assert (day["usage"]["bytes_in"], day["usage"]["appends"], day["usage"]["streams_created"]) == (
            8,
            1,
            1,
        )
        for query in ("from=2026-13-01", "from=2026-01-10&to=2026-01-01", "from=2020-01-01&to=2026-01-01"):
            async with http.get(f"{base}/__ds/tenants/{tenant}/usage?{query}") as r:
                assert r.status == 400, query
        async with http.get(f"{base}/__ds/tenants/{tenant}/usage?from=2001-01-01&to=2001-01-02") as r:
            assert (await r.json())["days"] == []
