"""The checker itself: hand-made histories it must accept, and ones it must reject."""

from __future__ import annotations

import pytest

from .history import (
    Append,
    Attempt,
    ReaderLog,
    Received,
    Tally,
    check_delivery,
    check_stream,
    parse_records,
    record,
)


def ok() -> Attempt:
    return Attempt(204, via="g0")


def err(status: int | None = None) -> Attempt:
    return Attempt(status, error="" if status else "TimeoutError", via="g1")


def app(writer: str, seq: int, *attempts: Attempt, producer: bool = False) -> Append:
    return Append("s", writer, seq, producer=producer, attempts=list(attempts))


def content(*records: tuple[str, int]) -> bytes:
    return b"".join(record(w, s) for w, s in records)


def reader(data: bytes, finished: bool = False, mode: str = "sse") -> ReaderLog:
    return ReaderLog("s", "r0", mode, Received(data), finished=finished)


def one(violations: list[str], *words: str) -> None:
    """Exactly one violation, mentioning each of ``words``."""
    assert len(violations) == 1, violations
    for word in words:
        assert word in violations[0], violations


def test_a_clean_history_passes() -> None:
    history = [
        app("a", 0, ok()),
        app("a", 1, err(503)),  # unknown, absent: fine
        app("a", 2, err()),  # unknown, present once: fine
        app("b", 0, err(503), ok(), producer=True),  # retried, then acked
        app("b", 1, ok(), producer=True),
        app("c", 0, Attempt(409, via="g0")),  # refused, absent
    ]
    final = content(("a", 0), ("b", 0), ("a", 2), ("b", 1))
    readers = [reader(final, finished=True), reader(final[:9], mode="long-poll"), reader(b"")]
    assert check_stream("s", final, history, readers, all_valid=False) == []


def test_lost_acknowledged_append_fails() -> None:
    history = [app("a", 0, ok()), app("a", 1, ok())]
    one(check_stream("s", content(("a", 0)), history), "LOST", "'a:1;'")


def test_duplicated_acknowledged_append_fails() -> None:
    history = [app("a", 0, ok()), app("a", 1, ok())]
    one(check_stream("s", content(("a", 0), ("a", 1), ("a", 1)), history), "DUPLICATED", "'a:1;'")


def test_producer_retry_applied_twice_fails() -> None:
    history = [app("p", 0, err(), err(503), ok(), producer=True)]
    one(check_stream("s", content(("p", 0), ("p", 0)), history), "DUPLICATED", "producer append")


def test_unknown_outcome_present_twice_fails() -> None:
    history = [app("a", 0, err(503))]
    one(check_stream("s", content(("a", 0), ("a", 0)), history), "DUPLICATED", "unknown")


def test_data_of_a_refused_request_fails() -> None:
    history = [app("a", 0, Attempt(400, via="g0"))]
    one(check_stream("s", content(("a", 0)), history, all_valid=False), "4xx is present")


def test_valid_append_answered_4xx_or_500_fails() -> None:
    one(check_stream("s", b"", [app("a", 0, Attempt(404))]), "answered [404]")
    one(check_stream("s", content(("a", 0)), [app("a", 0, Attempt(500), ok())]), "answered [500]")


def test_writer_order_violation_fails() -> None:
    history = [app("a", 0, ok()), app("a", 1, ok())]
    one(check_stream("s", content(("a", 1), ("a", 0)), history), "out of order", "'a:1;'")


def test_late_unknown_append_may_land_after_a_later_one() -> None:
    # a:0 timed out (still in flight), a:1 was acked, then a:0 landed: allowed.
    history = [app("a", 0, err()), app("a", 1, ok())]
    assert check_stream("s", content(("a", 1), ("a", 0)), history) == []


def test_record_after_an_acked_one_must_not_precede_it() -> None:
    history = [app("a", 0, ok()), app("a", 1, err())]
    one(check_stream("s", content(("a", 1), ("a", 0)), history), "out of order")


def test_foreign_or_torn_bytes_fail() -> None:
    history = [app("a", 0, ok())]
    one(check_stream("s", content(("a", 0)) + b"zz:9;", history), "never sent")
    one(check_stream("s", content(("a", 0)) + b"garbage;", history), "no writer sent")
    one(check_stream("s", content(("a", 0)) + b"a:1", history), "ends inside a record")


def test_reader_gap_fails() -> None:
    history = [app("a", 0, ok()), app("a", 1, ok()), app("a", 2, ok())]
    final = content(("a", 0), ("a", 1), ("a", 2))
    one(check_stream("s", final, history, [reader(content(("a", 0), ("a", 2)))]), "GAP", "'a:1;'")


def test_reader_duplicate_fails() -> None:
    history = [app("a", 0, ok()), app("a", 1, ok())]
    final = content(("a", 0), ("a", 1))
    violations = check_stream("s", final, history, [reader(content(("a", 0), ("a", 0), ("a", 1)))])
    assert violations and "DUPLICATE" in violations[0], violations


def test_reader_that_saw_eof_early_fails() -> None:
    history = [app("a", 0, ok()), app("a", 1, ok())]
    final = content(("a", 0), ("a", 1))
    one(check_stream("s", final, history, [reader(content(("a", 0)), finished=True)]), "saw the stream close")


def test_reader_with_bytes_the_stream_lacks_fails() -> None:
    history = [app("a", 0, ok())]
    one(check_stream("s", content(("a", 0)), history, [reader(content(("a", 0), ("a", 1)))]), "more than")


def test_reader_answered_500_fails() -> None:
    log = reader(b"")
    log.statuses[500] += 1
    one(check_stream("s", b"", [], [log]), "got 500")


def test_parse_and_tally() -> None:
    found, problems = parse_records(b"a:0;b:12;")
    assert found == [(0, b"a:0;"), (4, b"b:12;")] and problems == []
    tally = Tally()
    history = [app("a", 0, ok()), app("a", 1, err()), app("a", 2, Attempt(409)), app("a", 3, ok())]
    tally.add(content(("a", 0), ("a", 0)), history)
    assert (tally.operations, tally.acknowledged, tally.unknown, tally.failed) == (4, 2, 1, 1)
    assert (tally.lost, tally.duplicated) == (1, 1)


def test_records_must_be_unique_in_a_history() -> None:
    with pytest.raises(ValueError):
        check_stream("s", b"", [app("a", 0, ok()), app("a", 0, ok())])


def test_delivery_delay() -> None:
    log = reader(content(("a", 0), ("a", 1), ("a", 2)))
    log.connects = [(100.0, "g0"), (105.0, "g1")]
    log.arrivals = [(100.1, 4), (103.0, 8), (125.0, 12)]
    acks = {record("a", 0): 99.0, record("a", 1): 102.9, record("a", 2): 110.0}
    assert check_delivery("s", log, acks, bound=10.0) == []  # never up to date: still catching up
    log.caught_up = 100.1
    one(check_delivery("s", log, acks, bound=10.0), "'a:2;' 15.0s after", "slept through")
    assert check_delivery("s", log, acks, bound=20.0) == []
    log.caught_up = 109.0  # caught up only then: 'a:2' came while it still settled, a catch-up
    assert check_delivery("s", log, acks, bound=10.0) == []
    log.caught_up = 100.1
    acks[record("a", 2)] = 101.0  # acked before the reader had settled: a catch-up, not a delay
    assert check_delivery("s", log, acks, bound=10.0) == []


def test_received_bytes_survive_compression() -> None:
    got = Received()
    data = b"".join(record("w", i, pad=i % 300) for i in range(20_000))
    for start in range(0, len(data), 7_777):
        got += data[start : start + 7_777]
    assert len(got) == len(data) > 2 * Received.BLOCK
    assert bytes(got) == data
