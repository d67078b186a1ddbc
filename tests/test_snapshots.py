"""Ursula's snapshots and bootstrap (issue 18) against a real gateway and Redis: publish,
read (latest by redirect, at an offset), the refusals (stale, beyond the tail, too large,
deletes), what happens below a snapshot (410, -1 starts there), the blob kept in the
archive store and removed when replaced or when its stream is deleted, and bootstrap's
multipart answer with and without a snapshot, on JSON and byte streams."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import aiohttp
import redis.asyncio as aioredis

from gateway.protocol import offsets
from gateway.redis_io import keys

from .conftest import serving

JSON = {"Content-Type": "application/json"}
OCTETS = {"Content-Type": "application/octet-stream"}


def _root(base: str) -> str:
    return base.split("/v1/stream")[0]


async def _call(http: aiohttp.ClientSession, method: str, url: str, **kwargs: Any) -> tuple[int, bytes, Any]:
    async with http.request(method, url, allow_redirects=False, **kwargs) as r:
        return r.status, await r.read(), r.headers


async def _bootstrap(http: aiohttp.ClientSession, url: str) -> tuple[Any, list[tuple[str, bytes]]]:
    """The headers and the parts (content type, bytes) of a bootstrap answer."""
    async with http.get(url) as r:
        assert r.status == 200, await r.text()
        assert r.headers["Content-Type"].startswith("multipart/mixed; boundary=")
        reader = aiohttp.MultipartReader.from_response(r)
        parts = []
        while True:
            part = await reader.next()
            if part is None:
                return r.headers, parts
            assert isinstance(part, aiohttp.BodyPartReader)
            parts.append((part.headers["Content-Type"], bytes(await part.read())))


async def _stream(http: aiohttp.ClientSession, root: str, headers: dict[str, str]) -> str:
    bucket = f"snap-{uuid.uuid4().hex[:8]}"
    assert (await _call(http, "PUT", f"{root}/{bucket}"))[0] == 201
    assert (await _call(http, "PUT", f"{root}/{bucket}/doc", headers=headers))[0] == 201
    return f"{root}/{bucket}/doc"


async def test_publish_read_and_refusals(
    redis_url: str, http: aiohttp.ClientSession, archive_dir: str
) -> None:
    async with serving(redis_url, archive_url=archive_dir, max_snapshot_bytes=1024) as base:
        url = await _stream(http, _root(base), JSON)
        tails = []
        for n in range(4):
            _, _, headers = await _call(http, "POST", url, headers=JSON, data=f'{{"n":{n}}}')
            tails.append(headers["Stream-Next-Offset"])
        assert (await _call(http, "GET", f"{url}/snapshot"))[0] == 404  # none yet
        status, _, headers = await _call(
            http,
            "PUT",
            f"{url}/snapshot/{tails[1]}",
            headers={"Content-Type": "application/x-state"},
            data=b"S1",
        )
        assert status == 204
        assert (headers["Stream-Snapshot-Offset"], headers["Stream-Next-Offset"]) == (tails[1], tails[3])
        status, _, headers = await _call(http, "GET", f"{url}/snapshot")
        assert status == 307 and headers["Location"].endswith(f"/doc/snapshot/{tails[1]}")
        assert headers["Stream-Snapshot-Offset"] == tails[1] and headers["Stream-Up-To-Date"] == "false"
        status, body, headers = await _call(http, "GET", f"{url}/snapshot/{tails[1]}")
        assert (status, body, headers["Content-Type"]) == (200, b"S1", "application/x-state")
        assert headers["Stream-Next-Offset"] == tails[3]
        ursula = f"{offsets.decode(tails[1]):020d}"  # Ursula's 20-digit form names it too
        assert (await _call(http, "GET", f"{url}/snapshot/{ursula}"))[1] == b"S1"
        assert (await _call(http, "HEAD", url))[2]["Stream-Snapshot-Offset"] == tails[1]
        # below the snapshot: gone (saying where retained data starts); -1 starts at it
        status, _, headers = await _call(http, "GET", f"{url}?offset={offsets.encode(0)}")
        assert (status, headers["Stream-Next-Offset"], headers["Stream-Earliest-Offset"]) == (
            410,
            tails[1],
            tails[1],
        )
        fork = {
            **JSON,
            "Stream-Forked-From": "/v1/stream/" + url.split("/", 3)[3],
            "Stream-Fork-Offset": tails[0],
        }
        assert (await _call(http, "PUT", f"{url}-fork", headers=fork))[0] == 410  # below the floor
        assert (await _call(http, "GET", f"{url}?offset=-1"))[1] == b'[{"n":2},{"n":3}]'
        # refusals
        assert (await _call(http, "PUT", f"{url}/snapshot/{tails[0]}", data=b"old"))[0] == 409  # stale
        assert (await _call(http, "PUT", f"{url}/snapshot/{tails[1]}", data=b"same"))[0] == 409
        assert (await _call(http, "PUT", f"{url}/snapshot/{offsets.encode(10**6)}", data=b"x"))[0] == 409
        assert (await _call(http, "PUT", f"{url}/snapshot/{tails[3]}", data=b"x" * 1025))[0] == 413
        assert (await _call(http, "PUT", f"{url}/snapshot/not-an-offset", data=b"x"))[0] == 400
        assert (await _call(http, "GET", f"{url}/snapshot/{tails[0]}"))[0] == 404
        assert (await _call(http, "DELETE", f"{url}/snapshot/{tails[1]}"))[0] == 409  # the current one
        assert (await _call(http, "DELETE", f"{url}/snapshot/{tails[0]}"))[0] == 404
        assert (await _call(http, "PUT", f"{url}-missing/snapshot/{tails[0]}", data=b"x"))[0] == 404


async def test_blobs_live_in_the_archive_store(
    redis_url: str, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    archive = tmp_path / "archive"
    async with serving(redis_url, archive_url=str(archive)) as base:
        url = await _stream(http, _root(base), OCTETS)
        _, _, headers = await _call(http, "POST", url, headers=OCTETS, data=b"abc")
        first = headers["Stream-Next-Offset"]
        blob = b"\x00state" * 1000
        assert (await _call(http, "PUT", f"{url}/snapshot/{first}", data=blob))[0] == 204
        files = list(archive.rglob("*.snapshot"))
        assert len(files) == 1 and files[0].read_bytes() == blob and files[0].parts[-3] == "_snapshots"
        async with aioredis.Redis.from_url(redis_url) as client:
            bucket, stream = url.rsplit("/", 2)[-2:]
            meta = await client.hgetall(keys.stream_keys(keys.stream_id(f"{bucket}/{stream}"))[0])
            assert meta[b"snap_file"].decode() == str(files[0].relative_to(archive))
            assert len(b"".join(meta.values())) < 1000  # the blob is not in Redis
        _, _, headers = await _call(http, "POST", url, headers=OCTETS, data=b"def")
        assert (await _call(http, "PUT", f"{url}/snapshot/{headers['Stream-Next-Offset']}", data=b"S2"))[
            0
        ] == 204
        assert [f.read_bytes() for f in archive.rglob("*.snapshot")] == [b"S2"]  # the replaced one removed
        assert (await _call(http, "DELETE", url))[0] == 204
        assert list(archive.rglob("*.snapshot")) == []


async def test_bootstrap(redis_url: str, http: aiohttp.ClientSession, archive_dir: str) -> None:
    async with serving(redis_url, archive_url=archive_dir, max_chunk_bytes=8) as base:
        root = _root(base)
        url = await _stream(http, root, JSON)
        headers, parts = await _bootstrap(http, f"{url}/bootstrap")
        assert parts == [("application/octet-stream", b"")]  # no snapshot, no updates: one empty part
        assert headers["Stream-Snapshot-Offset"] == "none" and headers["Stream-Up-To-Date"] == "true"
        tails = []
        for n in range(5):
            _, _, h = await _call(http, "POST", url, headers=JSON, data=f'{{"n":{n}}}')
            tails.append(h["Stream-Next-Offset"])
        headers, parts = await _bootstrap(http, f"{url}/bootstrap")
        assert parts == [("application/octet-stream", b"")] + [
            ("application/json", f'{{"n":{n}}}'.encode()) for n in range(5)
        ]
        await _call(http, "PUT", f"{url}/snapshot/{tails[2]}", headers=JSON, data=b'{"sum":3}')
        headers, parts = await _bootstrap(http, f"{url}/bootstrap")
        assert parts == [
            ("application/json", b'{"sum":3}'),
            ("application/json", b'{"n":3}'),
            ("application/json", b'{"n":4}'),
        ]
        assert (headers["Stream-Snapshot-Offset"], headers["Stream-Next-Offset"]) == (tails[2], tails[4])
        assert "Stream-Closed" not in headers
        await _call(http, "POST", url, headers={"Stream-Closed": "true"})
        headers, _ = await _bootstrap(http, f"{url}/bootstrap")
        assert headers["Stream-Closed"] == "true"
        assert (await _call(http, "GET", f"{url}/bootstrap?live=sse"))[0] == 400
        assert (await _call(http, "GET", f"{url}-missing/bootstrap"))[0] == 404
        # a byte stream: one part per read chunk (--max-chunk-bytes 8 here), bytes unchanged
        raw = await _stream(http, root, OCTETS)
        await _call(http, "POST", raw, headers=OCTETS, data=b"0123456789abcdefghij")
        _, parts = await _bootstrap(http, f"{raw}/bootstrap")
        assert b"".join(data for _, data in parts[1:]) == b"0123456789abcdefghij" and len(parts) > 2


async def test_large_snapshots_odd_names_and_preflights(
    redis_url: str, http: aiohttp.ClientSession, archive_dir: str
) -> None:
    """A snapshot larger than --max-body-bytes (4 MiB) is taken up to --max-snapshot-bytes,
    sent whole or chunked; a stream id with '?' gets a Location that names it; the new
    routes answer CORS preflights; HEAD answers 304 to its own ETag; Ursula's /readyz/local."""
    async with serving(redis_url, archive_url=archive_dir, max_snapshot_bytes=8 << 20) as base:
        root = _root(base)
        url = await _stream(http, root, OCTETS)
        _, _, headers = await _call(http, "POST", url, headers=OCTETS, data=b"x")
        at = headers["Stream-Next-Offset"]
        big = b"s" * (6 << 20)
        assert (await _call(http, "PUT", f"{url}/snapshot/{at}", data=big))[0] == 204

        async def chunked():  # no Content-Length
            for _ in range(6):
                yield b"c" * (1 << 20)

        _, _, headers = await _call(http, "POST", url, headers=OCTETS, data=b"y")
        at2 = headers["Stream-Next-Offset"]
        assert (await _call(http, "PUT", f"{url}/snapshot/{at2}", data=chunked()))[0] == 204
        assert (await _call(http, "GET", f"{url}/snapshot/{at2}"))[1] == b"c" * (6 << 20)
        _, _, headers = await _call(http, "POST", url, headers=OCTETS, data=b"z")
        assert (
            await _call(
                http, "PUT", f"{url}/snapshot/{headers['Stream-Next-Offset']}", data=b"t" * ((8 << 20) + 1)
            )
        )[0] == 413
        odd = url.rsplit("/", 1)[0] + "/a%3Fb"
        assert (await _call(http, "PUT", odd, headers=OCTETS, data=b"q"))[0] == 201
        _, _, headers = await _call(http, "POST", odd, headers=OCTETS, data=b"r")
        await _call(http, "PUT", f"{odd}/snapshot/{headers['Stream-Next-Offset']}", data=b"ODD")
        status, _, headers = await _call(http, "GET", f"{odd}/snapshot")
        assert status == 307 and "/a%3Fb/snapshot/" in headers["Location"]
        for path in ("", "/streams", "/doc/snapshot", f"/doc/snapshot/{at}", "/doc/bootstrap"):
            target = url.rsplit("/", 1)[0] + path
            status, _, _ = await _call(http, "OPTIONS", target, headers={"Origin": "https://app.example"})
            assert status == 204, path
        _, _, headers = await _call(http, "HEAD", url)
        assert (await _call(http, "HEAD", url, headers={"If-None-Match": headers["ETag"]}))[0] == 304
        assert (await _call(http, "GET", f"{root}/readyz/local"))[0] == 200
        assert (await _call(http, "PUT", f"{root}/__ds"))[0] == 400
