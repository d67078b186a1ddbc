"""The access and browser rules as plain functions (gateway/protocol/access.py, browser.py)."""

from __future__ import annotations

import pytest

from gateway.protocol import access, browser
from gateway.protocol.access import Grants, Principal, parse_grants
from gateway.protocol.errors import ProtocolError

KEY = b"k" * 40


@pytest.mark.parametrize(
    "spelling",
    ["read:chat/ write:chat/42/", "read:/chat/,write:chat/42/", ["read:chat/", "write:chat/42/"],
     {"read": ["chat/"], "write": "chat/42/"}],
)  # fmt: skip
def test_grant_spellings(spelling: object) -> None:
    grants = parse_grants(spelling)
    assert grants.prefixes == {"read": ("chat/",), "write": ("chat/42/",)}


def test_scopes_nest_and_prefixes_are_strings() -> None:
    grants = parse_grants("admin:ops/ write:chat/ read:*")
    assert grants.allows("read", "anything")
    assert grants.allows("write", "chat/1") and not grants.allows("write", "chatter")
    assert grants.allows("admin", "ops/x") and grants.allows("write", "ops/x")
    assert not grants.allows("admin", "chat/1")
    assert parse_grants("write:chat").allows("write", "chatter")  # no slash: a plain string prefix
    assert not Grants().allows("read", "")


@pytest.mark.parametrize("bad", ["read", "root:x", "read:a bogus", {"read": [1]}, 42])
def test_bad_grants_are_refused(bad: object) -> None:
    with pytest.raises(ValueError):
        parse_grants(bad)


def test_lenient_grants_skip_foreign_scopes() -> None:
    assert parse_grants("openid profile read:a/", strict=False).prefixes == {"read": ("a/",)}


def test_methods_need_scopes() -> None:
    assert [access.required_scope(m) for m in ("GET", "HEAD", "PUT", "POST", "DELETE", "PATCH")] == [
        "read", "read", "write", "write", "admin", "admin",
    ]  # fmt: skip


def test_deny_is_401_for_anonymous_and_403_for_the_rest() -> None:
    anonymous = Principal("ip:1", Grants(), anonymous=True)
    known = Principal("token:x", parse_grants("read:a/"))
    with pytest.raises(ProtocolError) as e:
        access.check(anonymous, "read", "a/1")
    assert e.value.status == 401 and e.value.headers["WWW-Authenticate"].startswith("Bearer")
    with pytest.raises(ProtocolError) as e:
        access.check(known, "write", "a/1")
    assert e.value.status == 403 and "insufficient_scope" in e.value.headers["WWW-Authenticate"]
    access.check(known, "read", "a/1")


def test_signed_urls() -> None:
    query = access.sign(KEY, "read", "chat/42", 2_000, by="token:alice")
    principal = access.verify_signed(KEY, query, "chat/42", now=1_000)
    assert principal.allows("read", "chat/42")
    assert not principal.allows("read", "chat/420")  # exactly its stream, not a prefix
    assert not principal.allows("write", "chat/42")
    assert principal.expires_at == 2_000 and principal.id.startswith("signed:")
    assert "alice" not in str(query)  # the minter is named by a digest only
    for mangled, path, now in (
        (query, "chat/43", 1_000),  # another stream
        (query, "chat/42", 2_000),  # expired
        ({**query, "ds_scope": "write"}, "chat/42", 1_000),
        ({**query, "ds_expires": "3000"}, "chat/42", 1_000),
        ({**query, "ds_by": "someone"}, "chat/42", 1_000),
        (access.sign(b"x" * 40, "read", "chat/42", 2_000, "a"), "chat/42", 1_000),  # another key
        ({**query, "ds_sig": "\udcff\ufffd"}, "chat/\udcff", 1_000),  # not UTF-8: still just 401
        ({**query, "ds_expires": "9" * 5000}, "chat/42", 1_000),
        ({**query, "ds_scope": "admin"}, "chat/42", 1_000),
    ):
        with pytest.raises(ProtocolError) as e:
            access.verify_signed(KEY, mangled, path, now)
        assert e.value.status == 401


def test_cors_defaults() -> None:
    off = browser.cors_policy(None, "GET, POST", False, auth_enabled=False)
    assert (
        off.allows("http://localhost:5173")
        and off.allows("http://127.0.0.1")
        and off.allows("http://[::1]:80")
    )
    assert not off.allows("https://evil.example") and not off.allows("http://localhost.evil.example")
    assert not off.allows("http://localhost:5173.evil") and not off.allows("null")
    on = browser.cors_policy(None, "GET", False, auth_enabled=True)
    assert not on.allows("http://localhost:5173")
    listed = browser.cors_policy("https://a.example, https://b.example/", "GET", True, auth_enabled=True)
    assert listed.allows("https://b.example") and not listed.allows("https://c.example")
    with pytest.raises(ValueError):
        browser.cors_policy("*", "GET", True, auth_enabled=True)


def test_cors_headers() -> None:
    any_origin = browser.cors_policy("*", "GET", False, auth_enabled=True)
    assert browser.response_headers(any_origin, "https://x", "E")["Access-Control-Allow-Origin"] == "*"
    listed = browser.cors_policy("https://a.example", "GET, POST", True, auth_enabled=True)
    good = browser.response_headers(listed, "https://a.example", "E")
    assert good["Access-Control-Allow-Origin"] == "https://a.example" and good["Vary"] == "Origin"
    assert good["Access-Control-Allow-Credentials"] == "true"
    assert "Access-Control-Allow-Origin" not in browser.response_headers(listed, "https://b.example", "E")
    pre = browser.preflight_headers(listed, "https://a.example", True, "E")
    assert (
        pre["Access-Control-Allow-Private-Network"] == "true"
        and "Authorization" in pre["Access-Control-Allow-Headers"]
    )
    assert "Access-Control-Allow-Private-Network" not in browser.preflight_headers(
        listed, "https://b.example", True, "E"
    )


def test_origin_check() -> None:
    policy = browser.cors_policy(None, "GET", False, auth_enabled=True)
    browser.check_origin(policy, None, same=False)  # not a browser
    browser.check_origin(policy, "https://streams.example", same=True)
    with pytest.raises(ProtocolError) as e:
        browser.check_origin(policy, "https://evil.example", same=False)
    assert e.value.status == 403
    assert browser.same_origin("https://s.example", "s.example", None)
    assert browser.same_origin("http://s.example:8080", "s.example:8080", None)
    assert browser.same_origin("https://s.example", "internal:4437", "https://s.example/base")
    assert not browser.same_origin("https://evil.example", "s.example", "https://s.example")


@pytest.mark.parametrize(
    ("media", "active"),
    [("text/html", True), ("image/svg+xml", True), ("application/xhtml+xml", True), ("text/xml", True),
     ("application/rss+xml", True), ("text/javascript", True), ("application/pdf", True),
     ("text/plain", False), ("application/json", False), ("application/octet-stream", False),
     ("image/png", False), ("text/event-stream", False), ("application/x-ndjson", False)],
)  # fmt: skip
def test_active_content(media: str, active: bool) -> None:
    assert browser.is_active(media) == active


@pytest.mark.parametrize("path", ["a/../b", "./a", "a/.", "a/./b", ".."])
def test_dot_segments_are_refused(path: str) -> None:
    """Clients and proxies resolve them: ``mine/../chat/x`` would address ``chat/x``."""
    from gateway.http.handlers import stream_name

    with pytest.raises(ProtocolError) as e:
        stream_name(path, 1024)
    assert e.value.status == 400
    assert stream_name("a/..b/.c", 1024) == "a/..b/.c"
