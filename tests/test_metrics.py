"""/metrics: Prometheus exposition of what the gateway does."""

from __future__ import annotations

import asyncio

from prometheus_client.parser import text_string_to_metric_families


async def scrape(http, gateway: str) -> dict[tuple[str, tuple], float]:
    base = gateway.split("/v1/stream")[0]
    async with http.get(f"{base}/metrics") as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        text = await r.text()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def test_requests_appends_live_and_redis_are_counted(http, gateway, url):
    before = await scrape(http, gateway)
    async with http.put(url, headers={"Content-Type": "text/plain"}) as r:
        assert r.status == 201
    for _ in range(3):
        async with http.post(url, data=b"12345", headers={"Content-Type": "text/plain"}) as r:
            assert r.status == 204
    async with http.post(url, data=b"[1]", headers={"Content-Type": "application/json"}) as r:
        assert r.status == 409
    async with http.get(gateway.split("/v1/stream")[0] + "/no/such/page") as r:
        assert r.status == 404
    sse = await http.get(url, params={"offset": "now", "live": "sse"})
    await sse.content.readline()
    try:
        for _ in range(50):
            after = await scrape(http, gateway)
            if value(after, "ds_live_connections", mode="sse") >= 1:
                break
            await asyncio.sleep(0.05)
        assert value(after, "ds_live_connections", mode="sse") >= 1
        assert value(after, "ds_pubsub_subscriptions") >= 1
    finally:
        sse.close()

    def grew(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert grew("ds_appends_total") == 3 and grew("ds_appended_bytes_total") == 15
    assert grew("ds_http_requests_total", route="stream", method="POST", status="204") == 3
    assert grew("ds_http_requests_total", route="stream", method="POST", status="409") == 1
    assert grew("ds_http_requests_total", route="stream", method="PUT", status="201") == 1
    assert grew("ds_http_requests_total", route="other", method="GET", status="404") == 1
    assert grew("ds_redis_call_duration_seconds_count", script="append") == 4
    assert grew("ds_http_request_duration_seconds_count", route="stream", method="POST") == 4
    # No stream path ever becomes a label (cardinality).
    assert not any(url.rsplit("/", 1)[1] in str(key) for key in after)
