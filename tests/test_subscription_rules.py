"""Subscription rules, webhook signatures and the webhook target policy: pure, no Redis."""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import json
import shutil
import subprocess
import time
from collections.abc import Callable

import jwt
import orjson
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ec import SECP256R1, generate_private_key

from gateway.protocol import ssrf, subscriptions, webhooks
from gateway.protocol.errors import ProtocolError
from gateway.protocol.ssrf import TargetPolicy, address_allowed, check_addresses, check_url, parse_allow_list
from gateway.protocol.subscriptions import (
    DEFAULT_LEASE_TTL_MS,
    PatternIndex,
    SubscriptionConfig,
    check_token,
    glob_match,
    issue_token,
    literal_prefix,
    normalize_path,
    parse_ack,
    parse_claim,
    parse_config,
    retry_delay_ms,
    validate_id,
    validate_pattern,
)
from gateway.protocol.webhooks import SigningKey, key_id, signature_header, verify

OFFSET_A = "0000000000000000_0000000000000042"


def error_of(excinfo: pytest.ExceptionInfo[ProtocolError]) -> tuple[int, str]:
    body = excinfo.value.body
    assert body is not None
    return excinfo.value.status, body["error"]["code"]


def refused(
    call: Callable[..., object],
    *args: object,
    status: int = 400,
    code: str = "INVALID_REQUEST",
    **kwargs: object,
) -> None:
    with pytest.raises(ProtocolError) as excinfo:
        call(*args, **kwargs)
    assert error_of(excinfo) == (status, code), excinfo.value.message


def body(**fields: object) -> bytes:
    return orjson.dumps(fields)


# --- paths, ids, patterns -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "normalized"),
    [("events/a", "events/a"), ("/events/a/", "events/a"), ("a", "a"), ("é/ü", "é/ü"), ("x/__ds", "x/__ds")],
)
def test_normalize_path_accepts(raw: str, normalized: str) -> None:
    assert normalize_path(raw) == normalized


@pytest.mark.parametrize(
    "raw",
    [
        "",
        "/",
        "//",
        "__ds",
        "__ds/subscriptions/x",
        "a//b",
        "a/./b",
        "a/../b",
        "..",
        "a/\x00",
        "a\nb",
        "a\x7f",
        "x" * 1025,
        "é" * 513,
    ],
)
def test_normalize_path_refuses(raw: str) -> None:
    refused(normalize_path, raw)


def test_normalize_path_length_is_in_utf8_bytes() -> None:
    assert normalize_path("x" * 1024) == "x" * 1024
    assert normalize_path("é" * 512) == "é" * 512


@pytest.mark.parametrize("sub_id", ["sub-1", "a", "x" * 200, "with space", "ünï"])
def test_validate_id_accepts(sub_id: str) -> None:
    assert validate_id(sub_id) == sub_id


@pytest.mark.parametrize("sub_id", ["", "x" * 201, "a/b", ".", "..", "a\tb", "a\x00"])
def test_validate_id_refuses(sub_id: str) -> None:
    refused(validate_id, sub_id)


@pytest.mark.parametrize(
    ("raw", "normalized"),
    [("events/*", "events/*"), ("/**/", "**"), ("a/**/b/*", "a/**/b/*"), ("a/b", "a/b")],
)
def test_validate_pattern_accepts(raw: str, normalized: str) -> None:
    assert validate_pattern(raw) == normalized


@pytest.mark.parametrize(
    "raw", ["", "ev*", "a/*b", "a/***", "a//*", "__ds/*", "a/../*", "/".join(["*"] * 33)]
)
def test_validate_pattern_refuses(raw: str) -> None:
    refused(validate_pattern, raw)


@pytest.mark.parametrize(
    ("pattern", "path", "expected"),
    [
        ("events/*", "events/a", True),
        ("events/*", "events", False),
        ("events/*", "events/a/b", False),
        ("events/**", "events", True),
        ("events/**", "events/a/b/c", True),
        ("**", "anything/at/all", True),
        ("**/x", "x", True),
        ("**/x", "a/b/x", True),
        ("**/x", "a/b/y", False),
        ("a/**/b", "a/b", True),
        ("a/**/b", "a/x/y/b", True),
        ("a/**/b", "a/x/y/c", False),
        ("*/b/*", "a/b/c", True),
        ("*/b/*", "a/c/c", False),
        ("a/b", "a/b", True),
        ("a/b", "a/bc", False),
        ("a/*/**/d", "a/b/d", True),
        ("a/*/**/d", "a/d", False),
        ("**/**", "a", True),
    ],
)
def test_glob_match(pattern: str, path: str, expected: bool) -> None:
    assert glob_match(pattern, path) is expected


def test_glob_match_is_not_exponential() -> None:
    pattern = "/".join(["**"] * 31 + ["x"])
    path = "/".join(["a"] * 500)
    started = time.perf_counter()
    assert not glob_match(pattern, path)
    assert glob_match(pattern, path + "/x")
    assert time.perf_counter() - started < 1.0


@pytest.mark.parametrize(
    ("pattern", "prefix"),
    [("events/*", "events/"), ("**", ""), ("a/b/c", "a/b/c/"), ("a/**/b", "a/"), ("*/b", "")],
)
def test_literal_prefix(pattern: str, prefix: str) -> None:
    assert literal_prefix(pattern) == prefix


def test_pattern_index_matches_like_glob_match() -> None:
    patterns = {
        "all": "**",
        "events": "events/*",
        "deep": "events/**",
        "exact": "events/a",
        "other": "orders/*",
        "mid": "*/a",
        "long": "events/a/b",
    }
    index = PatternIndex()
    for sub_id, pattern in patterns.items():
        index.add(sub_id, pattern)
    assert len(index) == len(patterns)
    for path in ["events/a", "events/b", "events", "orders/1", "x/a", "events/a/b", "z"]:
        expected = sorted(s for s, p in patterns.items() if glob_match(p, path))
        assert index.match(path) == expected, path

    index.add("events", "orders/*")  # replace
    assert "events" not in index.match("events/q")
    assert "events" in index.match("orders/q")
    assert len(index) == len(patterns)
    index.remove("events")
    index.remove("events")
    index.remove("never")
    assert len(index) == len(patterns) - 1
    assert index.match("orders/q") == ["all", "other"]


def test_pattern_index_looks_only_at_its_buckets(monkeypatch: pytest.MonkeyPatch) -> None:
    index = PatternIndex()
    for i in range(2000):
        index.add(f"t{i}", f"tenant-{i}/*")
    calls = []
    real = subscriptions.glob_match

    def counting(pattern: str, path: str) -> bool:
        calls.append(pattern)
        return real(pattern, path)

    monkeypatch.setattr(subscriptions, "glob_match", counting)
    assert index.match("tenant-7/x") == ["t7"]
    assert calls == ["tenant-7/*"]


# --- configuration ---------------------------------------------------------------------------

WEBHOOK = {"type": "webhook", "pattern": "events/*", "webhook": {"url": "https://worker.example/hooks"}}
PULL = {"type": "pull-wake", "streams": ["events/a"], "wake_stream": "/wake/pool/"}


def test_parse_config_webhook_defaults() -> None:
    config = parse_config(orjson.dumps({**WEBHOOK, "streams": ["/b", "a", "b"], "unknown": 1}))
    assert config == SubscriptionConfig(
        type="webhook",
        pattern="events/*",
        streams=("a", "b"),
        webhook_url="https://worker.example/hooks",
        wake_stream=None,
        lease_ttl_ms=DEFAULT_LEASE_TTL_MS,
        description=None,
    )
    assert config.public() == {
        "type": "webhook",
        "pattern": "events/*",
        "webhook": {"url": "https://worker.example/hooks"},
        "wake_stream": None,
        "lease_ttl_ms": 30000,
        "description": None,
    }
    assert SubscriptionConfig.from_json(config.to_json()) == config


def test_parse_config_pull_wake() -> None:
    config = parse_config(orjson.dumps({**PULL, "lease_ttl_ms": 1000, "description": "d"}))
    assert config.wake_stream == "wake/pool"
    assert config.webhook_url is None and config.pattern is None
    assert config.lease_ttl_ms == 1000 and config.description == "d"
    assert config.public()["webhook"] is None
    assert SubscriptionConfig.from_json(config.to_json()) == config


def test_config_hash_ignores_spelling_and_order() -> None:
    a = parse_config(orjson.dumps({**PULL, "streams": ["b", "/a/", "a"]}))
    b = parse_config(
        b'{"wake_stream":"wake/pool","streams":["a","b"],"type":"pull-wake","lease_ttl_ms":30000}'
    )
    assert a.config_hash() == b.config_hash()
    assert len(a.config_hash()) == 64
    for change in [{"lease_ttl_ms": 2000}, {"description": "x"}, {"pattern": "**"}, {"wake_stream": "w2"}]:
        assert parse_config(orjson.dumps({**PULL, **change})).config_hash() != a.config_hash(), change


def test_config_hash_is_of_the_documented_fields() -> None:
    config = parse_config(orjson.dumps(WEBHOOK))
    canonical = {
        "description": None,
        "lease_ttl_ms": 30000,
        "pattern": "events/*",
        "streams": [],
        "type": "webhook",
        "wake_stream": None,
        "webhook": {"url": "https://worker.example/hooks"},
    }
    expected = hashlib.sha256(
        json.dumps(canonical, separators=(",", ":"), sort_keys=True).encode()
    ).hexdigest()
    assert config.config_hash() == expected


@pytest.mark.parametrize(
    "fields",
    [
        {"pattern": "a/*", "webhook": {"url": "https://x"}},  # no type
        {**WEBHOOK, "type": "push"},
        {"type": "webhook", "webhook": {"url": "https://x"}},  # neither pattern nor streams
        {"type": "webhook", "streams": [], "webhook": {"url": "https://x"}},
        {**WEBHOOK, "pattern": "ev*"},
        {**WEBHOOK, "pattern": 3},
        {**WEBHOOK, "streams": "a"},
        {**WEBHOOK, "streams": [1]},
        {**WEBHOOK, "streams": ["a//b"]},
        {**WEBHOOK, "webhook": None},
        {**WEBHOOK, "webhook": {}},
        {**WEBHOOK, "webhook": {"url": 5}},
        {**WEBHOOK, "webhook": "https://x"},
        {**WEBHOOK, "wake_stream": "w"},
        {**PULL, "wake_stream": None},
        {**PULL, "wake_stream": "__ds/x"},
        {**PULL, "webhook": {"url": "https://x"}},
        {**PULL, "lease_ttl_ms": 999},
        {**PULL, "lease_ttl_ms": 600_001},
        {**PULL, "lease_ttl_ms": True},
        {**PULL, "lease_ttl_ms": 30000.0},
        {**PULL, "lease_ttl_ms": "30000"},
        {**PULL, "description": 1},
        {**PULL, "description": "x" * 1025},
    ],
)
def test_parse_config_refuses(fields: dict[str, object]) -> None:
    refused(parse_config, orjson.dumps(fields))


@pytest.mark.parametrize("raw", [b"", b"not json", b"[]", b'"x"', b"null"])
def test_parse_config_refuses_non_objects(raw: bytes) -> None:
    refused(parse_config, raw)


def test_parse_config_stream_limit() -> None:
    streams = [f"s/{i}" for i in range(11)]
    refused(parse_config, orjson.dumps({**PULL, "streams": streams}), max_streams=10)
    assert len(parse_config(orjson.dumps({**PULL, "streams": streams[:10]}), max_streams=10).streams) == 10


# --- ack, release and claim bodies ----------------------------------------------------------


def test_parse_ack() -> None:
    ack = parse_ack(
        body(
            wake_id="w_1",
            generation=7,
            acks=[{"stream": "/events/a", "offset": OFFSET_A}, {"path": "events/b", "offset": OFFSET_A}],
            done=True,
        )
    )
    assert ack.wake_id == "w_1" and ack.generation == 7 and ack.done is True
    # offsets come back as minted now (format 1: twice the position), whatever format was sent
    canonical = "0000000000000001_0000000000000084"
    assert ack.acks == (("events/a", canonical), ("events/b", canonical))
    release = parse_ack(body(wake_id="w_1", generation=0))
    assert release.acks == () and release.done is False


@pytest.mark.parametrize(
    "fields",
    [
        {"generation": 1},
        {"wake_id": "", "generation": 1},
        {"wake_id": 3, "generation": 1},
        {"wake_id": "w"},
        {"wake_id": "w", "generation": -1},
        {"wake_id": "w", "generation": True},
        {"wake_id": "w", "generation": "1"},
        {"wake_id": "w", "generation": 1.0},
        {"wake_id": "w", "generation": 1, "acks": {}},
        {"wake_id": "w", "generation": 1, "acks": ["x"]},
        {"wake_id": "w", "generation": 1, "acks": [{"offset": OFFSET_A}]},
        {"wake_id": "w", "generation": 1, "acks": [{"stream": "a"}]},
        {"wake_id": "w", "generation": 1, "acks": [{"stream": "a", "offset": "12"}]},
        {"wake_id": "w", "generation": 1, "acks": [{"stream": "a", "offset": "now"}]},
        {"wake_id": "w", "generation": 1, "acks": [{"stream": "a", "offset": "٠" * 16 + "_" + "0" * 16}]},
        {"wake_id": "w", "generation": 1, "acks": [{"stream": "a//b", "offset": OFFSET_A}]},
        {"wake_id": "w", "generation": 1, "done": "true"},
    ],
)
def test_parse_ack_refuses(fields: dict[str, object]) -> None:
    refused(parse_ack, orjson.dumps(fields))


def test_parse_ack_minus_one_is_invalid_offset() -> None:
    refused(
        parse_ack,
        body(wake_id="w", generation=1, acks=[{"stream": "a", "offset": "-1"}]),
        status=409,
        code="INVALID_OFFSET",
    )


def test_parse_ack_limits() -> None:
    refused(parse_ack, body(wake_id="w", generation=1), require_acks=True)
    acks = [{"stream": "a", "offset": OFFSET_A}] * 3
    refused(parse_ack, body(wake_id="w", generation=1, acks=acks), max_acks=2)
    assert len(parse_ack(body(wake_id="w", generation=1, acks=acks), max_acks=3).acks) == 3


def test_parse_claim() -> None:
    assert parse_claim(body(worker="worker-1")) == "worker-1"
    for fields in [{}, {"worker": ""}, {"worker": 1}, {"worker": "x" * 201}, {"worker": "a\nb"}]:
        refused(parse_claim, orjson.dumps(fields))
    refused(parse_claim, b"nope")


# --- tokens ----------------------------------------------------------------------------------

SECRET = b"s" * 32
OLD_SECRET = b"o" * 32
NOW_MS = 1_778_324_210_000


def test_token_round_trip_and_rotation() -> None:
    token = issue_token(SECRET, "sub-1", 7, "w_abc", "callback", 30_000, NOW_MS)
    claims = check_token([SECRET], token, "sub-1", "callback", NOW_MS + 29_999)
    assert (claims.generation, claims.wake_id) == (7, "w_abc")
    payload = jwt.decode(token, options={"verify_signature": False})
    assert set(payload) == {"sub", "gen", "wake", "kind", "exp", "iat"}
    assert payload["sub"] == "subscription:sub-1"
    old = issue_token(OLD_SECRET, "sub-1", 7, "w_abc", "callback", 30_000, NOW_MS)
    assert check_token([SECRET, OLD_SECRET], old, "sub-1", "callback", NOW_MS).generation == 7
    refused(check_token, [SECRET], old, "sub-1", "callback", NOW_MS, status=401, code="TOKEN_INVALID")


def test_token_refusals() -> None:
    token = issue_token(SECRET, "sub-1", 7, "w_abc", "claim", 30_000, NOW_MS)
    invalid = {"status": 401, "code": "TOKEN_INVALID"}
    refused(check_token, [SECRET], token, "sub-2", "claim", NOW_MS, **invalid)
    refused(check_token, [SECRET], token, "sub-1", "callback", NOW_MS, **invalid)
    refused(check_token, [SECRET], token[:-2] + "AA", "sub-1", "claim", NOW_MS, **invalid)
    refused(check_token, [SECRET], "garbage", "sub-1", "claim", NOW_MS, **invalid)
    refused(check_token, [SECRET], "", "sub-1", "claim", NOW_MS, **invalid)
    none_alg = jwt.encode({"sub": "subscription:sub-1"}, None, algorithm="none")
    refused(check_token, [SECRET], none_alg, "sub-1", "claim", NOW_MS, **invalid)
    missing = jwt.encode({"sub": "subscription:sub-1", "exp": 9e9}, SECRET, algorithm="HS256")
    refused(check_token, [SECRET], missing, "sub-1", "claim", NOW_MS, **invalid)
    refused(check_token, [SECRET], token, "sub-1", "claim", NOW_MS + 30_000, status=401, code="TOKEN_EXPIRED")
    # Expired and for another subscription: invalid, not expired (say nothing about others' tokens).
    refused(check_token, [SECRET], token, "sub-2", "claim", NOW_MS + 60_000, **invalid)


# --- retries and wake ids --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("attempt", "base"), [(0, 1000), (1, 1000), (2, 2000), (3, 4000), (6, 32000), (7, 60000), (1000, 60000)]
)
def test_retry_delay(attempt: int, base: int) -> None:
    assert retry_delay_ms(attempt, lambda: 0.5) == base
    assert retry_delay_ms(attempt, lambda: 0.0) == round(base * 0.8)
    assert retry_delay_ms(attempt, lambda: 1.0) == round(base * 1.2)
    assert 0.8 * base <= retry_delay_ms(attempt) <= 1.2 * base


def test_new_wake_id() -> None:
    ids = {subscriptions.new_wake_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(len(i) == 26 and i.startswith("w_") and int(i[2:], 16) >= 0 for i in ids)


# --- webhook signatures ----------------------------------------------------------------------


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def test_rfc8037_thumbprint() -> None:
    x = "11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo"
    raw = base64.urlsafe_b64decode(x + "=")
    assert key_id(raw) == "ds_kPrK_qmxVWaYVA9wwBF6Iuo3vVzz7TxHCTwXBygrS4k"


def test_sign_and_verify() -> None:
    key = SigningKey.generate()
    keys = webhooks.jwks([key.public_jwk()])
    jwk = keys["keys"][0]
    assert jwk["kid"] == key.kid == key_id(base64.urlsafe_b64decode(jwk["x"] + "="))
    assert {k: jwk[k] for k in ("kty", "crv", "use", "alg")} == {
        "kty": "OKP",
        "crv": "Ed25519",
        "use": "sig",
        "alg": "EdDSA",
    }
    payload = b'{"subscription_id":"sub-1"}'
    ts = 1_778_324_210
    header = signature_header(key, payload, ts)
    assert header.startswith(f"t={ts},kid={key.kid},ed25519=")
    assert "=" not in header.rsplit("ed25519=", 1)[1]
    assert verify(header, payload, keys, now=ts)
    assert verify(header, payload, keys, now=ts + 300)
    assert verify(header, payload, keys, now=ts - 300)
    assert not verify(header, payload, keys, now=ts + 301)
    assert not verify(header, payload, keys, now=ts - 301)
    assert not verify(header, payload + b" ", keys, now=ts)
    assert not verify(header, payload, webhooks.jwks([SigningKey.generate().public_jwk()]), now=ts)
    other_kid = {"keys": [{**jwk, "kid": "ds_other"}]}
    assert not verify(header, payload, other_kid, now=ts)
    # The kid picks the key: another key under this kid does not verify.
    impostor = {"keys": [{**SigningKey.generate().public_jwk(), "kid": key.kid}]}
    assert not verify(header, payload, impostor, now=ts)
    resigned = signature_header(key, payload, ts - 1000).replace(f"t={ts - 1000}", f"t={ts}")
    assert not verify(resigned, payload, keys, now=ts)


@pytest.mark.parametrize(
    "header",
    [
        "",
        "garbage",
        "t=1,kid=k",
        "t=abc,kid=k,ed25519=AAAA",
        "kid=k,t=1,ed25519=AAAA",
        "t=1,kid=k,ed25519=AAAA,extra=1",
        "t=1,kid=k,ed25519=AA==",
        "t=1,kid=k,ed25519=!!!",
        "t=1,kid=k,ed25519=A",
    ],
)
def test_verify_never_raises(header: str) -> None:
    key = SigningKey.generate()
    keys = {"keys": [{**key.public_jwk(), "kid": "k"}]}
    assert not verify(header, b"{}", keys, now=1)
    assert not verify(header, b"{}", {"keys": [{"kid": "k", "x": "!!"}, "junk"]}, now=1)
    assert not verify(header, b"{}", {}, now=1)


def test_pem_round_trip() -> None:
    key = SigningKey.generate()
    again = SigningKey.from_pem(key.to_pem())
    assert again.kid == key.kid
    assert again.public_jwk() == key.public_jwk()
    assert verify(signature_header(again, b"x", 5), b"x", webhooks.jwks([key.public_jwk()]), now=5)


def test_pem_refuses_other_keys() -> None:
    ec = generate_private_key(SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    with pytest.raises(ValueError, match="Ed25519"):
        SigningKey.from_pem(ec)
    with pytest.raises(ValueError):
        SigningKey.from_pem(b"not a pem")


NODE_VERIFY = """
const crypto = require('crypto');
const [jwk, header, body] = JSON.parse(process.argv[1]);
const m = header.match(/^t=(\\d+),kid=([^,]+),ed25519=([A-Za-z0-9_-]+)$/);
const pub = crypto.createPublicKey({key: jwk, format: 'jwk'});
const ok = m !== null && m[2] === jwk.kid &&
  crypto.verify(null, Buffer.from(m[1] + '.' + body), pub, Buffer.from(m[3], 'base64url'));
process.stdout.write(ok ? 'ok' : 'bad');
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node")
def test_signature_verifies_with_node() -> None:
    key = SigningKey.generate()
    payload = '{"subscription_id":"sub-1","wake_id":"w_1","generation":7,"ü":"é"}'
    header = signature_header(key, payload.encode(), 1_778_324_210)

    def node(body: str) -> str:
        argument = json.dumps([key.public_jwk(), header, body])
        return subprocess.run(
            ["node", "-e", NODE_VERIFY, argument], capture_output=True, text=True, check=True, timeout=30
        ).stdout

    assert node(payload) == "ok"
    assert node(payload + " ") == "bad"


# --- webhook target policy -------------------------------------------------------------------

LOCAL = parse_allow_list("127.0.0.0/8")


@pytest.mark.parametrize(
    ("url", "policy", "expected"),
    [
        ("https://worker.example/hooks", TargetPolicy(), ("worker.example", 443)),
        ("https://Worker.Example:8443/h?q=1", TargetPolicy(), ("worker.example", 8443)),
        ("https://8.8.8.8/hook", TargetPolicy(), ("8.8.8.8", 443)),
        ("https://[2001:4860:4860::8888]/", TargetPolicy(), ("2001:4860:4860::8888", 443)),
        ("https://bücher.example/", TargetPolicy(), ("xn--bcher-kva.example", 443)),
        ("http://127.0.0.1:1234/webhook", LOCAL, ("127.0.0.1", 1234)),
        ("http://127.0.0.5/webhook", LOCAL, ("127.0.0.5", 80)),
        ("http://localhost/", parse_allow_list("localhost"), ("localhost", 80)),
        (
            "http://hook.ns.svc.cluster.local/",
            parse_allow_list("*.svc.cluster.local"),
            ("hook.ns.svc.cluster.local", 80),
        ),
        ("http://[::1]:9/", parse_allow_list("::1"), ("::1", 9)),
        ("https://10.1.2.3/", parse_allow_list("10.1.2.3"), ("10.1.2.3", 443)),
    ],
)
def test_check_url_accepts(url: str, policy: TargetPolicy, expected: tuple[str, int]) -> None:
    assert check_url(url, policy) == expected


@pytest.mark.parametrize(
    ("url", "policy"),
    [
        ("http://10.0.0.1/hook", TargetPolicy()),
        ("https://10.0.0.1/hook", TargetPolicy()),
        ("http://127.0.0.1:1234/webhook", TargetPolicy()),
        ("http://8.8.8.8/hook", TargetPolicy()),  # public, but http
        ("http://worker.example/hooks", TargetPolicy()),
        ("http://worker.example/hooks", LOCAL),
        ("http://10.0.0.1/hook", LOCAL),
        ("https://169.254.169.254/", TargetPolicy()),
        ("https://[::ffff:10.0.0.1]/", TargetPolicy()),
        ("https://[::ffff:127.0.0.1]/", TargetPolicy()),
        ("https://[64:ff9b::a00:1]/", TargetPolicy()),
        ("https://[2002:a00:1::]/", TargetPolicy()),
        ("https://[::1]/", TargetPolicy()),
        ("https://[fe80::1]/", TargetPolicy()),
        ("https://[fe80::1%25eth0]/", TargetPolicy()),
        ("https://[fd00::1]/", TargetPolicy()),
        ("https://[::]/", TargetPolicy()),
        ("http://localhost/", TargetPolicy()),
        ("https://localhost/", TargetPolicy()),
        ("https://a.localhost/", TargetPolicy()),
        ("http://localhost/", parse_allow_list("*.localhost")),
        ("https://2130706433/", TargetPolicy()),
        ("https://0x7f.1/", TargetPolicy()),
        ("https://0x7f000001/", TargetPolicy()),
        ("https://127.1/", TargetPolicy()),
        ("https://0177.0.0.1/", TargetPolicy()),
        ("https://100.64.0.1/", TargetPolicy()),
        ("https://0.0.0.0/", TargetPolicy()),
        ("https://224.0.0.1/", TargetPolicy()),
        ("https://255.255.255.255/", TargetPolicy()),
        ("https://192.0.2.1/", TargetPolicy()),
        ("ftp://worker.example/", TargetPolicy()),
        ("file:///etc/passwd", TargetPolicy()),
        ("worker.example/hooks", TargetPolicy()),
        ("https:///path", TargetPolicy()),
        ("https://user:pw@worker.example/", TargetPolicy()),
        ("https://user@worker.example/", TargetPolicy()),
        ("https://worker.example/#frag", TargetPolicy()),
        ("https://worker.example/" + "a" * 2048, TargetPolicy()),
        ("https://worker.example:99999/", TargetPolicy()),
        ("https://worker.example:0/", TargetPolicy()),
        ("https://[::1/", TargetPolicy()),
        ("https://work er.example/", TargetPolicy()),
        ("https://worker.example\\@10.0.0.1/", TargetPolicy()),
        ("https://a..b/", TargetPolicy()),
    ],
)
def test_check_url_refuses(url: str, policy: TargetPolicy) -> None:
    refused(check_url, url, policy, code="WEBHOOK_URL_REJECTED")


@pytest.mark.parametrize(
    ("address", "allowed"),
    [
        ("8.8.8.8", True),
        ("2001:4860:4860::8888", True),
        ("64:ff9b::808:808", True),  # NAT64 of a public address
        ("::ffff:8.8.8.8", True),
        ("10.0.0.1", False),
        ("172.16.0.1", False),
        ("172.31.255.255", False),
        ("192.168.1.1", False),
        ("127.0.0.1", False),
        ("169.254.169.254", False),
        ("100.64.0.1", False),
        ("0.1.2.3", False),
        ("224.0.0.251", False),
        ("239.255.255.250", False),
        ("240.0.0.1", False),
        ("255.255.255.255", False),
        ("198.51.100.7", False),
        ("203.0.113.7", False),
        ("198.18.0.1", False),
        ("::1", False),
        ("::", False),
        ("fe80::1", False),
        ("fc00::1", False),
        ("fd12:3456::1", False),
        ("ff02::1", False),
        ("2001:db8::1", False),
        ("::ffff:169.254.169.254", False),
        ("::a00:1", False),  # IPv4-compatible
        ("2002:7f00:1::", False),  # 6to4 of 127.0.0.1
        ("64:ff9b::7f00:1", False),  # NAT64 of 127.0.0.1
        ("64:ff9b:1::1", False),
        ("2001::1", False),  # Teredo
    ],
)
def test_address_allowed(address: str, allowed: bool) -> None:
    assert address_allowed(ipaddress.ip_address(address), "worker.example", TargetPolicy()) is allowed


def test_address_allowed_by_policy() -> None:
    policy = parse_allow_list("10.0.0.0/8, ::1, hooks.internal, *.svc.cluster.local")
    assert address_allowed(ipaddress.ip_address("10.9.9.9"), "x.example", policy)
    assert address_allowed(ipaddress.ip_address("::ffff:10.9.9.9"), "x.example", policy)
    assert address_allowed(ipaddress.ip_address("::1"), "x.example", policy)
    assert address_allowed(ipaddress.ip_address("192.168.0.1"), "hooks.internal", policy)
    assert address_allowed(ipaddress.ip_address("192.168.0.1"), "a.b.svc.cluster.local", policy)
    assert not address_allowed(ipaddress.ip_address("192.168.0.1"), "svc.cluster.local", policy)
    assert not address_allowed(ipaddress.ip_address("192.168.0.1"), "evilsvc.cluster.local", policy)
    assert not address_allowed(ipaddress.ip_address("127.0.0.1"), "x.example", policy)


def test_parse_allow_list() -> None:
    policy = parse_allow_list("127.0.0.0/8,::1,localhost,*.svc.cluster.local,10.1.2.3, ,Hooks.Example.")
    assert policy.networks == (
        ipaddress.ip_network("127.0.0.0/8"),
        ipaddress.ip_network("::1/128"),
        ipaddress.ip_network("10.1.2.3/32"),
    )
    assert policy.hosts == ("localhost", "*.svc.cluster.local", "hooks.example")
    assert parse_allow_list("") == TargetPolicy()
    for bad in [
        "10.0.0.1/8",
        "10.0.0.0/33",
        "300.1.1.1",
        "::g",
        "a b",
        "*",
        "*.",
        "a.*.b",
        "http://x",
        "2130706433",
    ]:
        with pytest.raises(ValueError, match="allow list"):
            parse_allow_list(bad)


def test_check_addresses() -> None:
    policy = TargetPolicy()
    assert check_addresses("w.example", ["8.8.8.8", "2001:4860:4860:0::8888"], policy) == [
        "8.8.8.8",
        "2001:4860:4860::8888",
    ]
    refused(check_addresses, "w.example", [], policy, code="WEBHOOK_URL_REJECTED")
    refused(check_addresses, "w.example", ["8.8.8.8", "10.0.0.1"], policy, code="WEBHOOK_URL_REJECTED")
    refused(check_addresses, "w.example", ["not-an-ip"], policy, code="WEBHOOK_URL_REJECTED")
    local = parse_allow_list("localhost")
    assert check_addresses("localhost", ["127.0.0.1", "::1"], local) == ["127.0.0.1", "::1"]
    assert check_addresses("w.svc", ["10.0.0.1"], parse_allow_list("10.0.0.0/8")) == ["10.0.0.1"]
    assert ssrf.MAX_URL_CHARS == 2048
