"""Access control end to end: static tokens, JWTs (a JWKS URL that rotates), signed
URLs, anonymous grants; who may do what (the matrix), forks, live reads that end
with their credential, CORS, user content, the admin listener and Location."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import jwt
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from gateway.config import Settings
from gateway.http.app import create_app

from .conftest import free_port, start_gateway

TOKENS = {
    "reader": "reader-token-0123456789",
    "writer": "writer-token-0123456789",  # write on chat/ (so read there too)
    "admin": "admin-token-01234567890",
    "forker": "forker-token-0123456789",  # read on chat/, write on mine/
    "mineonly": "mineonly-token-0123456",  # write on mine/ alone
    "expired": "expired-token-012345678",
    "hashed": "hashed-token-0123456789",  # stored as its SHA-256 only
}
ISSUER, AUDIENCE = "https://issuer.test", "durable-streams-test"


def _token_file(path: Path) -> None:
    entries: list[dict[str, Any]] = [
        {"name": "reader", "token": TOKENS["reader"], "grants": "read:*"},
        {"name": "writer", "token": TOKENS["writer"], "grants": {"write": ["chat/"]}},
        {"name": "admin", "token": TOKENS["admin"], "grants": ["admin:"]},
        {"name": "forker", "token": TOKENS["forker"], "grants": "read:chat/ write:mine/"},
        {"name": "mineonly", "token": TOKENS["mineonly"], "grants": "write:mine/"},
        {
            "name": "expired",
            "token": TOKENS["expired"],
            "grants": "admin:",
            "expires_at": "2020-01-01T00:00:00Z",
        },
        {
            "name": "hashed",
            "sha256": hashlib.sha256(TOKENS["hashed"].encode()).hexdigest(),
            "grants": "read:chat/",
        },
    ]
    path.write_text(json.dumps({"tokens": entries}))


class Jwks:
    """A JWKS endpoint whose keys the test rotates."""

    def __init__(self) -> None:
        self.keys: dict[str, Any] = {}
        self.fetches = 0

    def add(self, kid: str) -> Any:
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.keys[kid] = key
        return key

    def document(self) -> dict[str, Any]:
        keys = []
        for kid, key in self.keys.items():
            jwk = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(key.public_key()))
            keys.append({**jwk, "kid": kid, "alg": "RS256", "use": "sig"})
        return {"keys": keys}

    async def handle(self, request: web.Request) -> web.Response:
        self.fetches += 1
        return web.json_response(self.document())


def make_jwt(key: Any, kid: str, *, grants: object, exp: float | None = None, **claims: Any) -> str:
    payload = {"iss": ISSUER, "aud": AUDIENCE, "sub": "alice", "exp": int(exp or time.time() + 600), **claims}
    if grants is not None:
        payload["streams"] = grants
    return jwt.encode(payload, key, algorithm="RS256", headers={"kid": kid})


@pytest.fixture(scope="module")
async def jwks() -> AsyncIterator[tuple[Jwks, str]]:
    keys = Jwks()
    keys.add("k1")
    app = web.Application()
    app.router.add_get("/jwks.json", keys.handle)
    server = TestServer(app, host="127.0.0.1", port=free_port())
    await server.start_server()
    yield keys, str(server.make_url("/jwks.json"))
    await server.close()


@pytest.fixture(scope="module")
def secrets_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("auth")
    _token_file(folder / "tokens.json")
    (folder / "signing.key").write_text("s" * 48)
    return folder


def auth_settings(secrets_dir: Path, jwks_url: str, **more: Any) -> dict[str, Any]:
    return {
        "auth_tokens_file": str(secrets_dir / "tokens.json"),
        "auth_jwks_url": jwks_url,
        "auth_jwt_audience": AUDIENCE,
        "auth_jwt_issuer": ISSUER,
        "auth_jwks_cache_seconds": 2.0,
        "auth_signing_key_file": str(secrets_dir / "signing.key"),
        "auth_anonymous": "read:public/",
        "cors_origins": "https://app.example",
        **more,
    }


@pytest.fixture(scope="module")
async def secured(redis_url: str, secrets_dir: Path, jwks: tuple[Jwks, str]) -> AsyncIterator[str]:
    """A gateway with access control on; its stream prefix URL. Live reads last long
    (SSE 30 s, long-poll 10 s): the ones here end because their credential expires."""
    server = await start_gateway(
        redis_url, **auth_settings(secrets_dir, jwks[1], sse_cycle_seconds=30, long_poll_timeout=10)
    )
    yield str(server.make_url("/v1/stream"))
    await server.close()


def bearer(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[name]}"}


ADMIN = bearer("admin")
TEXT = {"Content-Type": "text/plain"}


# -- the matrix -----------------------------------------------------------------------


async def _prepare(http: aiohttp.ClientSession, base: str) -> str:
    """chat/<id> with some data, created as admin; its path."""
    path = f"chat/m-{uuid.uuid4().hex[:10]}"
    async with http.put(f"{base}/{path}", data=b"hello", headers={**TEXT, **ADMIN}) as r:
        assert r.status == 201
    return path


def _operations(http: aiohttp.ClientSession, base: str, path: str, h: dict[str, str]) -> dict[str, Any]:
    """Each operation: (a function making its request, the scope it needs)."""
    url = f"{base}/{path}"
    fork = f"{base}/chat/f-{uuid.uuid4().hex[:10]}"
    new = f"{base}/chat/n-{uuid.uuid4().hex[:10]}"
    forked = {"Stream-Forked-From": f"/v1/stream/{path}", **TEXT, **h}
    return {
        "create": (lambda: http.put(new, headers={**TEXT, **h}), "write"),
        "append": (lambda: http.post(url, data=b"more", headers={**TEXT, **h}), "write"),
        "close": (lambda: http.post(url, headers={"Stream-Closed": "true", **h}), "write"),
        "read": (lambda: http.get(url, params={"offset": "-1"}, headers=h), "read"),
        "head": (lambda: http.head(url, headers=h), "read"),
        "long-poll": (lambda: http.get(url, params={"offset": "-1", "live": "long-poll"}, headers=h), "read"),
        "sse": (lambda: http.get(url, params={"offset": "-1", "live": "sse"}, headers=h), "read"),
        "fork": (lambda: http.put(fork, headers=forked), "write"),
        "delete": (lambda: http.delete(url, headers=h), "admin"),
    }


OPS = ["create", "append", "close", "read", "head", "long-poll", "sse", "fork", "delete"]
ALLOWED = {  # credential -> scopes it holds on chat/
    "reader": {"read"},
    "writer": {"read", "write"},
    "admin": {"read", "write", "admin"},
    "hashed": {"read"},
    "jwt-writer": {"read", "write"},
    "jwt-scope-claim": set(),  # OAuth scopes are not grants unless --auth-jwt-claim scope
}
REFUSED = [
    "none",
    "garbage",
    "basic",
    "expired",
    "jwt-expired",
    "jwt-foreign-key",
    "jwt-wrong-aud",
    "jwt-no-exp",
]


def _credential(name: str, jwks: Jwks) -> dict[str, str]:
    key = jwks.keys["k1"]
    if name in TOKENS:
        return bearer(name)
    tokens = {
        "none": None,
        "garbage": "Bearer not-a-token-at-all",
        "basic": "Basic YWxhZGRpbjpvcGVuc2VzYW1l",
        "jwt-writer": "Bearer " + make_jwt(key, "k1", grants={"write": ["chat/"]}),
        "jwt-scope-claim": "Bearer " + make_jwt(key, "k1", grants=None, scope="openid read:chat/"),
        "jwt-expired": "Bearer " + make_jwt(key, "k1", grants={"admin": [""]}, exp=time.time() - 60),
        "jwt-foreign-key": "Bearer "
        + make_jwt(
            rsa.generate_private_key(public_exponent=65537, key_size=2048), "k1", grants={"admin": [""]}
        ),
        "jwt-wrong-aud": "Bearer " + make_jwt(key, "k1", grants={"admin": [""]}, aud="someone-else"),
        "jwt-no-exp": "Bearer "
        + jwt.encode(
            {"iss": ISSUER, "aud": AUDIENCE, "sub": "x", "streams": {"admin": [""]}},
            key,
            algorithm="RS256",
            headers={"kid": "k1"},
        ),
    }
    value = tokens[name]
    return {} if value is None else {"Authorization": value}


@pytest.mark.parametrize("credential", [*ALLOWED, *REFUSED])
async def test_matrix(
    http: aiohttp.ClientSession, secured: str, jwks: tuple[Jwks, str], credential: str
) -> None:
    """Every operation × credentials: none/invalid/expired → 401 (with WWW-Authenticate),
    held but not enough → 403, enough → 2xx."""
    h = _credential(credential, jwks[0])
    for op in OPS:
        path = await _prepare(http, secured)
        request, needs = _operations(http, secured, path, h)[op]
        async with request() as r:
            if r.headers.get("Content-Type") != "text/event-stream":
                await r.read()
            if credential in REFUSED:
                assert r.status == 401, (credential, op, r.status)
                assert r.headers["WWW-Authenticate"].startswith("Bearer")
                if credential != "none":
                    assert 'error="invalid_token"' in r.headers["WWW-Authenticate"]
            elif needs in ALLOWED[credential]:
                assert r.status in (200, 201, 204), (credential, op, r.status, await r.text())
            else:
                assert r.status == 403, (credential, op, r.status)
                assert 'error="insufficient_scope"' in r.headers["WWW-Authenticate"]
        # A refused request changed nothing.
        async with http.get(f"{secured}/{path}", params={"offset": "-1"}, headers=ADMIN) as r:
            changed = r.status != 200 or await r.read() != b"hello" or "Stream-Closed" in r.headers
        allowed = credential not in REFUSED and needs in ALLOWED[credential]
        assert changed == (allowed and op in ("append", "close", "delete")), (credential, op)


async def test_grants_stop_at_their_prefix(http: aiohttp.ClientSession, secured: str) -> None:
    h = bearer("writer")
    async with http.put(f"{secured}/other/x-{uuid.uuid4().hex[:8]}", headers={**TEXT, **h}) as r:
        assert r.status == 403
    path = await _prepare(http, secured)
    other = path.replace("chat/", "chatter/")
    async with http.put(f"{secured}/{other}", headers={**TEXT, **h}) as r:
        assert r.status == 403  # "chat/" (with its slash) does not cover "chatter/"


async def test_anonymous_reads_only_their_prefix(http: aiohttp.ClientSession, secured: str) -> None:
    path = f"public/p-{uuid.uuid4().hex[:8]}"
    async with http.put(f"{secured}/{path}", data=b"open", headers={**TEXT, **ADMIN}) as r:
        assert r.status == 201
    async with http.get(f"{secured}/{path}", params={"offset": "-1"}) as r:
        assert r.status == 200 and await r.read() == b"open"
        assert r.headers["Cache-Control"].startswith("public")
    async with http.post(f"{secured}/{path}", data=b"x", headers=TEXT) as r:
        assert r.status == 401
    chat = await _prepare(http, secured)
    async with http.get(f"{secured}/{chat}", params={"offset": "-1"}) as r:
        assert r.status == 401
    # Reads made with credentials are kept out of shared caches.
    async with http.get(f"{secured}/{chat}", params={"offset": "-1"}, headers=bearer("reader")) as r:
        assert r.status == 200 and r.headers["Cache-Control"].startswith("private")


# -- forks ------------------------------------------------------------------------------


async def test_fork_needs_read_on_source(http: aiohttp.ClientSession, secured: str) -> None:
    source = await _prepare(http, secured)
    fork = f"{secured}/mine/f-{uuid.uuid4().hex[:8]}"
    headers = {"Stream-Forked-From": f"/v1/stream/{source}", **TEXT, **bearer("mineonly")}
    async with http.put(fork, headers=headers) as r:
        assert r.status == 403
    async with http.head(fork, headers=ADMIN) as r:
        assert r.status == 404


async def test_fork_by_a_reader_does_not_hold_the_source(http: aiohttp.ClientSession, secured: str) -> None:
    """A fork made by someone who may only read its source must not keep the source's
    path answering 410 (and its re-create 409) after the owner deletes it."""
    source = await _prepare(http, secured)
    fork = f"{secured}/mine/f-{uuid.uuid4().hex[:8]}"
    headers = {"Stream-Forked-From": f"/v1/stream/{source}", **TEXT, **bearer("forker")}
    async with http.put(fork, headers=headers) as r:
        assert r.status == 201
    async with http.post(fork, data=b" own", headers={**TEXT, **bearer("forker")}) as r:
        assert r.status == 204
    async with http.delete(f"{secured}/{source}", headers=ADMIN) as r:
        assert r.status == 204
    async with http.get(f"{secured}/{source}", params={"offset": "-1"}, headers=ADMIN) as r:
        assert r.status == 404
    async with http.put(f"{secured}/{source}", data=b"new", headers={**TEXT, **ADMIN}) as r:
        assert r.status == 201
    async with http.get(fork, params={"offset": "-1"}, headers=bearer("forker")) as r:
        assert r.status == 410  # what it inherited was deleted by its owner
    async with http.head(fork, headers=bearer("forker")) as r:
        offset = r.headers["Stream-Next-Offset"]
        assert r.status == 200
    async with http.get(fork, params={"offset": offset}, headers=bearer("forker")) as r:
        assert r.status == 200


async def test_fork_by_a_writer_of_the_source_holds_it(http: aiohttp.ClientSession, secured: str) -> None:
    source = await _prepare(http, secured)
    fork = f"{secured}/chat/f-{uuid.uuid4().hex[:8]}"
    async with http.put(fork, headers={"Stream-Forked-From": f"/v1/stream/{source}", **TEXT, **ADMIN}) as r:
        assert r.status == 201
    async with http.delete(f"{secured}/{source}", headers=ADMIN) as r:
        assert r.status == 204
    async with http.get(f"{secured}/{source}", params={"offset": "-1"}, headers=ADMIN) as r:
        assert r.status == 410  # the protocol's soft delete
    async with http.get(fork, params={"offset": "-1"}, headers=ADMIN) as r:
        assert r.status == 200 and await r.read() == b"hello"


# -- signed URLs --------------------------------------------------------------------------


async def _sign(http: aiohttp.ClientSession, secured: str, token: str, **body: Any) -> tuple[int, Any]:
    root = secured.split("/v1/stream")[0]
    async with http.post(f"{root}/auth/sign", json=body, headers=bearer(token)) as r:
        return r.status, (await r.json() if r.status == 200 else await r.text())


async def test_signed_urls(http: aiohttp.ClientSession, secured: str) -> None:
    path = await _prepare(http, secured)
    status, signed = await _sign(http, secured, "reader", path=path, expires_in=60)
    assert status == 200, signed
    url = signed["url"]
    assert url.startswith(f"{secured}/{path}?")
    async with http.get(url + "&offset=-1") as r:
        assert r.status == 200 and await r.read() == b"hello"
        assert r.headers["Cache-Control"].startswith("private")
    async with http.post(url, data=b"x", headers=TEXT) as r:
        assert r.status == 403  # a read URL cannot append
    async with http.get(url.replace(path, path + "x") + "&offset=-1") as r:
        assert r.status == 401  # another stream
    async with http.get(url.replace(path, path[:-1]) + "&offset=-1") as r:
        assert r.status == 401  # not a prefix grant either
    tampered = url.replace("ds_expires=", "ds_expires=9")
    async with http.get(tampered + "&offset=-1") as r:
        assert r.status == 401
    # No more than the minter holds, no longer than the server allows.
    assert (await _sign(http, secured, "reader", path=path, scope="write"))[0] == 403
    assert (await _sign(http, secured, "reader", path=path, expires_in=10**7))[0] == 400
    assert (await _sign(http, secured, "reader", path=path, scope="admin"))[0] == 400
    status, signed = await _sign(http, secured, "writer", path=path, scope="write", expires_in=60)
    async with http.post(signed["url"], data=b"!", headers=TEXT) as r:
        assert r.status == 204
    root = secured.split("/v1/stream")[0]
    async with http.post(f"{root}/auth/sign", json={"path": path}) as r:
        assert r.status == 401


async def test_signed_url_expires(http: aiohttp.ClientSession, secured: str) -> None:
    path = await _prepare(http, secured)
    _, signed = await _sign(http, secured, "reader", path=path, expires_in=1)
    await asyncio.sleep(max(0.0, signed["expires_at"] - time.time()) + 0.1)
    async with http.get(signed["url"] + "&offset=-1") as r:
        assert r.status == 401
        assert "expired" in r.headers["WWW-Authenticate"]


async def test_sse_ends_when_its_signed_url_expires(http: aiohttp.ClientSession, secured: str) -> None:
    """An EventSource opened with a signed URL ends (with a control event saying where to
    resume) when the URL expires, though the SSE cycle (30 s here) is far from over;
    data appended before then reached it."""
    path = await _prepare(http, secured)
    _, signed = await _sign(http, secured, "reader", path=path, expires_in=2)
    started = time.monotonic()
    async with http.get(signed["url"] + "&offset=-1&live=sse") as r:
        assert r.status == 200
        await asyncio.sleep(0.3)
        async with http.post(f"{secured}/{path}", data=b"-live", headers={**TEXT, **ADMIN}) as w:
            assert w.status == 204
        body = await asyncio.wait_for(r.read(), 10)
    elapsed = time.monotonic() - started
    assert elapsed < 5, elapsed
    assert b"hello" in body and b"-live" in body
    assert body.rstrip().splitlines()[-1].startswith(b"data:")
    assert b"streamNextOffset" in body.rsplit(b"event: control", 1)[1]
    async with http.get(signed["url"] + "&offset=-1&live=sse") as r:
        assert r.status == 401


async def test_long_poll_ends_when_its_credential_expires(
    http: aiohttp.ClientSession, secured: str, jwks: tuple[Jwks, str]
) -> None:
    path = await _prepare(http, secured)
    token = make_jwt(jwks[0].keys["k1"], "k1", grants="read:chat/", exp=time.time() + 2)
    started = time.monotonic()
    params = {"offset": "now", "live": "long-poll"}
    async with http.get(
        f"{secured}/{path}", params=params, headers={"Authorization": f"Bearer {token}"}
    ) as r:
        assert r.status == 204
    assert time.monotonic() - started < 6  # at the token's expiry (≤ 2 s), not the 10 s timeout


# -- JWKS rotation ------------------------------------------------------------------------


async def test_jwks_rotation(http: aiohttp.ClientSession, secured: str, jwks: tuple[Jwks, str]) -> None:
    """A new key is picked up without a restart (unknown kid → the JWKS is fetched
    again); a key withdrawn from the JWKS stops working once the cache expires."""
    keys, _ = jwks
    path = await _prepare(http, secured)
    url = f"{secured}/{path}"
    old = keys.keys["k1"]
    new_key = keys.add("k2")
    await asyncio.sleep(1.1)  # refetches for unknown key ids are spaced by a second
    token = make_jwt(new_key, "k2", grants="read:chat/")
    async with http.head(url, headers={"Authorization": f"Bearer {token}"}) as r:
        assert r.status == 200
    del keys.keys["k1"]
    await asyncio.sleep(2.2)  # the gateway's JWKS cache: 2 s
    fresh_old = make_jwt(old, "k1", grants="read:chat/", jti="after-rotation")
    async with http.head(url, headers={"Authorization": f"Bearer {fresh_old}"}) as r:
        assert r.status == 401
    async with http.head(
        url, headers={"Authorization": f"Bearer {make_jwt(new_key, 'k2', grants='read:')}"}
    ) as r:
        assert r.status == 200
    keys.keys["k1"] = old  # other tests sign with k1


async def test_jwt_with_a_static_key(http: aiohttp.ClientSession, redis_url: str, tmp_path: Path) -> None:
    """--auth-jwt-key-file: an EC public key (ES256), and an HS256 secret."""
    private = ec.generate_private_key(ec.SECP256R1())
    from cryptography.hazmat.primitives import serialization

    pem = private.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    (tmp_path / "ec.pem").write_bytes(pem)
    (tmp_path / "hs.key").write_text("h" * 40)
    for key_file, signing_key, alg in (
        (tmp_path / "ec.pem", private, "ES256"),
        (tmp_path / "hs.key", "h" * 40, "HS256"),
    ):
        server = await start_gateway(redis_url, auth_jwt_key_file=str(key_file), auth_jwt_audience=AUDIENCE)
        base = str(server.make_url("/v1/stream"))
        try:
            token = jwt.encode(
                {"exp": int(time.time()) + 60, "aud": AUDIENCE, "streams": "write:k/"},
                signing_key,
                algorithm=alg,
            )
            async with http.put(
                f"{base}/k/{uuid.uuid4().hex[:8]}", headers={"Authorization": f"Bearer {token}"}
            ) as r:
                assert r.status == 201, (alg, r.status)
            other = jwt.encode(
                {"exp": int(time.time()) + 60, "aud": AUDIENCE, "streams": "write:k/"},
                "x" * 40,
                algorithm="HS256",
            )
            async with http.put(
                f"{base}/k/{uuid.uuid4().hex[:8]}", headers={"Authorization": f"Bearer {other}"}
            ) as r:
                assert r.status == 401, alg
        finally:
            await server.close()


# -- browsers -------------------------------------------------------------------------------


async def test_cors_with_access_control(http: aiohttp.ClientSession, secured: str) -> None:
    path = await _prepare(http, secured)
    url = f"{secured}/{path}"
    good, evil = {"Origin": "https://app.example"}, {"Origin": "https://evil.example"}
    async with http.get(url, params={"offset": "-1"}, headers={**good, **ADMIN}) as r:
        assert r.headers["Access-Control-Allow-Origin"] == "https://app.example"
        assert "Origin" in r.headers["Vary"]
    async with http.get(url, params={"offset": "-1"}, headers={**evil, **ADMIN}) as r:
        assert "Access-Control-Allow-Origin" not in r.headers
    for origin in (good, evil):  # a preflight is answered without credentials
        async with http.options(url, headers={**origin, "Access-Control-Request-Method": "POST"}) as r:
            assert r.status == 204
            assert ("Access-Control-Allow-Origin" in r.headers) == (origin is good)
    # A page of another origin cannot make a browser write, even with a credential the
    # browser holds: refused before anything is stored.
    async with http.post(url, data=b"csrf", headers={**TEXT, **evil, **ADMIN}) as r:
        assert r.status == 403
    async with http.get(url, params={"offset": "-1"}, headers=ADMIN) as r:
        assert await r.read() == b"hello"


async def test_foreign_pages_cannot_write_to_a_local_server(http: aiohttp.ClientSession, url: str) -> None:
    """Access control off (the session gateway): a web page's simple POST (no preflight)
    to a local server is refused; pages from this machine may call."""
    async with http.put(url, headers=TEXT) as r:
        assert r.status == 201
    async with http.post(url, data=b"x", headers={**TEXT, "Origin": "https://evil.example"}) as r:
        assert r.status == 403
    async with http.options(
        url, headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "PUT"}
    ) as r:
        assert "Access-Control-Allow-Origin" not in r.headers
    async with http.post(url, data=b"ok", headers={**TEXT, "Origin": "http://127.0.0.1:8080"}) as r:
        assert r.status == 204
        assert r.headers["Access-Control-Allow-Origin"] == "http://127.0.0.1:8080"
    async with http.get(url, params={"offset": "-1"}) as r:
        assert await r.read() == b"ok"


@pytest.mark.parametrize(
    ("content_type", "attachment"),
    [("text/html", True), ("image/svg+xml", True), ("application/xhtml+xml", True), ("text/javascript", True),
     ("application/atom+xml", True), ("text/plain", False), ("application/json", False)],
)  # fmt: skip
async def test_user_content_cannot_run_in_our_origin(
    http: aiohttp.ClientSession, url: str, content_type: str, attachment: bool
) -> None:
    body = b"[1]" if content_type == "application/json" else b"<script>alert(1)</script>"
    async with http.put(url, data=body, headers={"Content-Type": content_type}) as r:
        assert r.status == 201
    for params in ({"offset": "-1"}, {"offset": "-1", "live": "long-poll"}):
        async with http.get(url, params=params) as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith(content_type)  # clients still see the type
            assert r.headers["Content-Security-Policy"].startswith("sandbox")
            assert (r.headers.get("Content-Disposition") == "attachment") == attachment


# -- operations, Location ---------------------------------------------------------------------


async def test_metrics_need_admin_without_an_admin_listener(
    http: aiohttp.ClientSession, secured: str
) -> None:
    root = secured.split("/v1/stream")[0]
    async with http.get(f"{root}/metrics") as r:
        assert r.status == 401
    async with http.get(f"{root}/metrics", headers=bearer("reader")) as r:
        assert r.status == 403
    async with http.get(f"{root}/metrics", headers=ADMIN) as r:
        assert r.status == 200
    async with http.get(f"{root}/readyz") as r:
        assert r.status == 200


async def test_admin_listener(http: aiohttp.ClientSession, redis_url: str) -> None:
    """With --admin-port, /metrics and health answer there alone; streams stay on the public port."""
    public, admin = free_port(), free_port()
    app = create_app(Settings(admin_port=admin), redis_url)
    runner = web.AppRunner(app)
    await runner.setup()
    for port in (public, admin):
        await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        for path in ("/metrics", "/healthz", "/readyz"):
            async with http.get(f"http://127.0.0.1:{public}{path}") as r:
                assert r.status == 404, path
            async with http.get(f"http://127.0.0.1:{admin}{path}") as r:
                assert r.status == 200, path
        async with http.put(
            f"http://127.0.0.1:{public}/v1/stream/a-{uuid.uuid4().hex[:8]}", headers=TEXT
        ) as r:
            assert r.status == 201
    finally:
        await runner.cleanup()


async def test_location_from_public_url(http: aiohttp.ClientSession, redis_url: str) -> None:
    server = await start_gateway(redis_url, public_url="https://streams.example.com/")
    try:
        name = f"loc-{uuid.uuid4().hex[:8]}"
        url = str(server.make_url(f"/v1/stream/{name}"))
        async with http.put(url, headers={**TEXT, "Host": "localhost:9"}) as r:
            assert r.status == 201
            assert r.headers["Location"] == f"https://streams.example.com/v1/stream/{name}"
    finally:
        await server.close()


def test_bad_auth_configuration_stops_the_start(tmp_path: Path) -> None:
    (tmp_path / "tokens.json").write_text('{"tokens": [{"name": "x", "token": "short", "grants": "read:"}]}')
    (tmp_path / "weak.key").write_text("too-short")
    for settings in (
        Settings(auth_tokens_file=str(tmp_path / "tokens.json")),
        Settings(auth_tokens_file=str(tmp_path / "missing.json")),
        Settings(auth_signing_key_file=str(tmp_path / "weak.key")),
        Settings(auth_anonymous="read"),
        Settings(cors_origins="*", cors_credentials=True),
        Settings(rate_limits="write:=fast"),
        Settings(auth_jwks_url="https://issuer.test/jwks.json"),  # no audience
    ):
        with pytest.raises(RuntimeError):
            create_app(settings, "redis://127.0.0.1:1/0")


async def test_dns_rebinding_is_refused(http: aiohttp.ClientSession, url: str) -> None:
    """Access control off on loopback: a request for another host name (a web page whose
    name was rebound to 127.0.0.1) is refused, reads included; loopback names work."""
    port = url.split(":")[2].split("/")[0]
    async with http.put(url, data=b"mine", headers=TEXT) as r:
        assert r.status == 201
    rebound = {**TEXT, "Host": f"evil.example:{port}", "Origin": f"http://evil.example:{port}"}
    for method in ("GET", "POST", "DELETE"):
        async with http.request(method, url, params={"offset": "-1"}, headers=rebound) as r:
            assert r.status == 403, method
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "localhost"):
        async with http.get(url, params={"offset": "-1"}, headers={"Host": host}) as r:
            assert r.status == 200 and await r.read() == b"mine"


async def test_sign_preflight_and_minted_urls_count_against_their_minter(
    http: aiohttp.ClientSession, redis_url: str, secrets_dir: Path, jwks: tuple[Jwks, str]
) -> None:
    settings = auth_settings(secrets_dir, jwks[1], rate_limits="read:=0.01/s+3")
    server = await start_gateway(redis_url, **settings)
    root = str(server.make_url(""))
    try:
        async with http.options(
            f"{root}/auth/sign",
            headers={"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "authorization, content-type"},
        ) as r:  # fmt: skip
            assert r.status == 204
            assert "Authorization" in r.headers["Access-Control-Allow-Headers"]
            assert r.headers["Access-Control-Allow-Origin"] == "https://app.example"
        path = f"chat/rl-{uuid.uuid4().hex[:8]}"
        async with http.put(f"{root}/v1/stream/{path}", data=b"x", headers={**TEXT, **ADMIN}) as r:
            assert r.status == 201
        async with http.post(f"{root}/auth/sign", json={"path": path}, headers=bearer("reader")) as r:
            signed = (await r.json())["url"]  # took one of the reader's 3 tokens
        async with http.head(f"{root}/v1/stream/{path}", headers=bearer("reader")) as r:
            assert r.status == 200  # the second
        async with http.get(signed + "&offset=-1") as r:
            assert r.status == 200  # the third: the URL counts against its minter
        async with http.get(signed + "&offset=-1") as r:
            assert r.status == 429 and int(r.headers["Retry-After"]) >= 1
        forged = {"Authorization": "Bearer forged-token-0123456789"}
        async with http.head(f"{root}/v1/stream/{path}", headers=forged) as r:
            assert r.status in (401, 429)  # failed credentials are charged as anonymous, then refused
    finally:
        await server.close()
