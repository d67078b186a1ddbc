"""The request metrics' tally (telemetry/metrics.py): added in bulk, the same exposition
as prometheus-client's own observe() of every request."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from gateway.telemetry.metrics import RequestTally

BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01)
DURATIONS = [0.0001, 0.0005, 0.0007, 0.001, 0.003, 0.01, 0.02, 7.0, 0.0]


def _metrics() -> tuple[CollectorRegistry, Counter, Histogram]:
    registry = CollectorRegistry()
    counter = Counter("t_requests_total", "requests", ["route", "method", "status"], registry=registry)
    histogram = Histogram("t_seconds", "durations", ["route", "method"], buckets=BUCKETS, registry=registry)
    return registry, counter, histogram


def _tally(counter: Counter, histogram: Histogram) -> tuple[RequestTally, Counter]:
    fast = Counter("t_fast_total", "fast", registry=CollectorRegistry())
    return RequestTally(counter, histogram, fast), fast


def _exposition(registry: CollectorRegistry) -> list[str]:
    """Every sample but the creation times; sums rounded (added in another order, the
    floats may differ in their last digit)."""
    lines = []
    for line in generate_latest(registry).decode().splitlines():
        if "_created" in line:
            continue
        if "_sum{" in line:
            name, value = line.rsplit(" ", 1)
            line = f"{name} {float(value):.9f}"
        lines.append(line)
    return lines


def test_a_flushed_tally_exposes_what_observe_would() -> None:
    tallied, counter, histogram = _metrics()
    tally, _ = _tally(counter, histogram)
    observed, counter2, histogram2 = _metrics()
    for n, seconds in enumerate(DURATIONS):
        status = 204 if n % 3 else 409
        tally.observe("stream", "POST", status, seconds)
        counter2.labels("stream", "POST", str(status)).inc()
        histogram2.labels("stream", "POST").observe(seconds)
    tally.observe("other", "GET", 404, 0.002)
    counter2.labels("other", "GET", "404").inc()
    histogram2.labels("other", "GET").observe(0.002)
    assert not [line for line in _exposition(tallied) if not line.startswith("#")]  # nothing yet
    tally.flush()
    assert _exposition(tallied) == _exposition(observed)
    tally.flush()  # nothing pending: nothing changes
    assert _exposition(tallied) == _exposition(observed)


async def test_a_tally_flushes_itself_within_a_second() -> None:
    import asyncio

    registry, counter, histogram = _metrics()
    tally, fast = _tally(counter, histogram)
    tally.FLUSH_SECONDS = 0.05
    tally.observe("stream", "POST", 204, 0.001)
    tally.observe_fast("stream", "POST", 204, 0.001)
    await asyncio.sleep(0.2)
    assert counter.labels("stream", "POST", "204")._value.get() == 2
    assert fast._value.get() == 1
