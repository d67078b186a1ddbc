"""The history of a fault run, and the checker that judges it.

Writers append self-describing records, ``<writer>:<seq>;`` (ASCII, unique per
stream), and log every attempt's outcome; live readers log the bytes they
received, in order. After the run the checker compares all of it with the
stream's final content, read from the start:

* an **acknowledged** append (some attempt got a 2xx) is present exactly once;
* a **failed** append (every attempt got a definitive 4xx) is absent;
* an **unknown** append (5xx, timeout, connection error: it may or may not have
  happened) is present at most once;
* a writer's records keep its order: an acknowledged record comes before every
  later record of the same writer (those were sent only after its ack);
* the stream holds nothing but whole records that some writer sent;
* every live reader received a prefix of the final content (all of it if it saw
  the stream close): every byte once, in order, no gaps, no duplicates;
* no valid request was answered 500 (an outage is 503; a 500 is a bug).

The checker is pure: histories in, a list of human-readable violations out.
"""

from __future__ import annotations

import bisect
import re
import zlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

RECORD = re.compile(rb"\A([A-Za-z0-9_.-]+):([0-9]+)=*\Z")  # writer:seq, optionally padded with '='s

ACKED, FAILED, UNKNOWN = "acked", "failed", "unknown"


@dataclass(slots=True)
class Attempt:
    """One HTTP request of an append: its status, or None for no answer."""

    status: int | None
    error: str = ""
    via: str = ""  # which gateway
    at: float = 0.0  # seconds since the run started
    took: float = 0.0  # seconds until the answer (or the failure)

    @property
    def kind(self) -> str:
        if self.status is not None and 200 <= self.status < 300:
            return ACKED
        if self.status is not None and 400 <= self.status < 500:
            return FAILED
        return UNKNOWN

    def describe(self) -> str:
        what = str(self.status) if self.status is not None else f"no answer ({self.error})"
        return f"{what} via {self.via} at t={self.at:.2f}s"


@dataclass(slots=True)
class Append:
    """One logical append: one record, one or more attempts (retries send the same bytes,
    and for an idempotent producer the same Producer-Seq)."""

    stream: str
    writer: str
    seq: int
    producer: bool = False
    attempts: list[Attempt] = field(default_factory=list)
    pad: int = 0  # '=' bytes after the seq: bulk records

    @property
    def record(self) -> bytes:
        return record(self.writer, self.seq, self.pad)

    @property
    def acked_at(self) -> float | None:
        """When the first 2xx came (run clock), if one did."""
        for a in self.attempts:
            if a.kind == ACKED:
                return a.at + a.took
        return None

    @property
    def outcome(self) -> str:
        kinds = {a.kind for a in self.attempts}
        if ACKED in kinds:
            return ACKED
        if kinds == {FAILED}:
            return FAILED
        return UNKNOWN

    def describe(self) -> str:
        kind = "producer append" if self.producer else "append"
        tries = "; ".join(a.describe() for a in self.attempts) or "never sent"
        return f"{kind} {self.name!r} ({self.outcome}: {tries})"

    @property
    def name(self) -> str:
        """The record, short: padding elided."""
        return f"{self.writer}:{self.seq}" + (f"+{self.pad}=" if self.pad else "") + ";"


class Received:
    """A reader's bytes, kept compressed in blocks (a soak run's readers receive gigabytes
    of very compressible records); ``bytes()`` gives them back."""

    BLOCK = 1 << 20

    def __init__(self, data: bytes = b"") -> None:
        self._blocks: list[bytes] = []
        self._tail = bytearray()
        self._length = 0
        self += data

    def __iadd__(self, data: bytes) -> Received:
        self._tail += data
        self._length += len(data)
        if len(self._tail) >= self.BLOCK:
            self._blocks.append(zlib.compress(bytes(self._tail), 1))
            self._tail = bytearray()
        return self

    def __len__(self) -> int:
        return self._length

    def __bytes__(self) -> bytes:
        return b"".join([*(zlib.decompress(b) for b in self._blocks), bytes(self._tail)])


@dataclass
class ReaderLog:
    """What one live reader (SSE or long-poll) received, across all its reconnections."""

    stream: str
    name: str
    mode: str  # sse | long-poll
    received: Received = field(default_factory=Received)
    finished: bool = False  # saw the stream's close (EOF)
    connections: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    statuses: Counter[int] = field(default_factory=Counter)
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (time.monotonic(), bytes so far)
    connects: list[tuple[float, str]] = field(default_factory=list)  # (time.monotonic(), gateway) per request
    protocol_errors: list[str] = field(default_factory=list)  # answers that broke the protocol
    caught_up: float | None = None  # time.monotonic() of its first up-to-date answer: tailing from then


def record(writer: str, seq: int, pad: int = 0) -> bytes:
    return f"{writer}:{seq}".encode() + b"=" * pad + b";"


def short(rec: bytes) -> str:
    """A record for messages: its padding elided."""
    text = rec.decode(errors="replace")
    stripped = text.rstrip(";").rstrip("=")
    pad = len(text.rstrip(";")) - len(stripped)
    return stripped + (f"+{pad}=" if pad else "") + (";" if text.endswith(";") else "")


def _squash(data: bytes) -> bytes:
    """Long '=' padding runs shortened, for messages."""
    return re.sub(rb"={8,}", lambda m: b"=<%d>" % len(m.group()), data)


def _position(content: bytes, offset: int) -> str:
    """Where ``offset`` is in ``content``, with the records around it, for messages."""
    start = content.rfind(b";", 0, max(0, offset - 40)) + 1
    end = content.find(b";", offset + 1)
    end = len(content) if end < 0 else end + 1
    return f"byte {offset} (near {_squash(content[start:end])[:200]!r})"


def parse_records(content: bytes) -> tuple[list[tuple[int, bytes]], list[str]]:
    """``content`` as (byte offset, record) pairs, and complaints about bytes that are no record."""
    found: list[tuple[int, bytes]] = []
    problems: list[str] = []
    offset = 0
    for token in content.split(b";"):
        end = offset + len(token)
        if end == len(content):  # after the last ';'
            if token:
                problems.append(f"stream ends inside a record: {_squash(token)[:80]!r} at byte {offset}")
            break
        if RECORD.match(token):
            found.append((offset, token + b";"))
        else:
            problems.append(f"bytes no writer sent: {_squash(token)[:80]!r} at {_position(content, offset)}")
        offset = end + 1
    return found, problems


def check_stream(
    stream: str,
    content: bytes,
    appends: list[Append],
    readers: Sequence[ReaderLog] = (),
    *,
    context: str = "",
    all_valid: bool = True,
) -> list[str]:
    """Every violation of the rules above in one stream's history (empty: it holds)."""
    where = f"stream {stream!r}" + (f" ({context})" if context else "")
    violations: list[str] = []
    found, problems = parse_records(content)
    violations += [f"{where}: {p}" for p in problems]

    by_record: dict[bytes, Append] = {}
    for append in appends:
        if append.record in by_record:
            raise ValueError(f"history has record {append.record!r} twice: records must be unique")
        by_record[append.record] = append
    positions: dict[bytes, list[int]] = {}
    for offset, rec in found:
        positions.setdefault(rec, []).append(offset)
    for rec, where_found in positions.items():
        if rec not in by_record:
            violations.append(f"{where}: record {short(rec)!r} at byte {where_found[0]} was never sent")

    for append in appends:
        seen = positions.get(append.record, [])
        outcome = append.outcome
        if outcome == ACKED and not seen:
            violations.append(f"{where}: LOST acknowledged {append.describe()}")
        elif outcome == ACKED and len(seen) > 1:
            violations.append(
                f"{where}: DUPLICATED acknowledged {append.describe()}: present {len(seen)} times, at bytes "
                f"{seen}"
            )
        elif outcome == FAILED and seen:
            violations.append(f"{where}: data of a request answered 4xx is present: {append.describe()}")
        elif outcome == UNKNOWN and len(seen) > 1:
            violations.append(
                f"{where}: DUPLICATED {append.describe()}: present {len(seen)} times, at bytes {seen}"
            )
        # A 500 is a crash, never an answer to a valid request; when the history holds only
        # valid appends to open streams (``all_valid``), a 4xx is a wrong answer too.
        bad = sorted({a.status for a in append.attempts if a.status == 500
                      or (all_valid and a.status is not None and 400 <= a.status < 500)})  # fmt: skip
        if bad:
            violations.append(f"{where}: a valid append was answered {bad}: {append.describe()}")

    # Per-writer order: an acked record precedes every later record of its writer.
    by_writer: dict[str, list[Append]] = {}
    for append in appends:
        by_writer.setdefault(append.writer, []).append(append)
    for writer, mine in by_writer.items():
        mine.sort(key=lambda a: a.seq)
        latest_acked: Append | None = None  # the acked record with the highest seq so far
        for append in mine:
            seen = positions.get(append.record)
            if not seen:
                continue
            if latest_acked is not None:
                acked_at = positions[latest_acked.record][0]
                if seen[0] < acked_at:
                    violations.append(
                        f"{where}: writer {writer!r} out of order: {append.name!r} "
                        f"(seq {append.seq}) at byte {seen[0]} comes before "
                        f"{latest_acked.name!r} at byte {acked_at}, which was acknowledged "
                        f"before it was sent"
                    )
            if append.outcome == ACKED:
                latest_acked = append

    for reader in readers:
        violations += check_reader(where, content, reader)
    return violations


def check_reader(where: str, content: bytes, reader: ReaderLog) -> list[str]:
    """A live reader's bytes: a prefix of the final content (all of it once it saw EOF)."""
    got = bytes(reader.received)
    who = f"{where}: {reader.mode} reader {reader.name!r} ({reader.connections} connections)"
    violations: list[str] = []
    if not content.startswith(got):
        mismatch = next(
            (i for i, (a, b) in enumerate(zip(got, content, strict=False)) if a != b),
            min(len(got), len(content)),
        )
        start = got.rfind(b";", 0, mismatch) + 1
        got_record = got[start : got.find(b";", mismatch) + 1 or None]
        want_record = content[start : content.find(b";", mismatch) + 1 or None]
        kind = "received more than the stream holds"
        if mismatch < len(content):
            earlier = content.find(got_record, 0, start) if got_record else -1
            later = content.find(got_record, start + 1) if got_record else -1
            if earlier >= 0:
                kind = f"DUPLICATE: it got {short(got_record)!r} again (already at byte {earlier})"
            elif later >= 0:
                kind = f"GAP: it skipped {short(want_record)!r} (got {short(got_record)!r}, at byte {later})"
            else:
                kind = f"got {_squash(got_record)[:100]!r}, which the stream does not hold there or later"
        violations.append(
            f"{who} diverges from the stream at byte {mismatch} of {len(got)} received "
            f"(stream has {len(content)}): expected {_squash(want_record)[:100]!r}; {kind}"
        )
        counts = Counter(rec for _, rec in parse_records(got)[0])
        dups = [short(rec) for rec, n in counts.items() if n > 1]
        if dups:
            violations.append(f"{who} received {len(dups)} records more than once, e.g. {dups[:5]}")
    elif reader.finished and len(got) != len(content):
        violations.append(
            f"{who} saw the stream close after {len(got)} bytes, but the stream holds {len(content)}: "
            f"missing from {_position(content, len(got))}"
        )
    for status, n in reader.statuses.items():
        if status == 500:
            violations.append(f"{who} got 500 for a valid read {n} times")
    if reader.protocol_errors:
        violations.append(
            f"{who} got {len(reader.protocol_errors)} answers that break the protocol, e.g. "
            f"{reader.protocol_errors[:3]}"
        )
    return violations


def check_delivery(
    stream: str, reader: ReaderLog, acks: dict[bytes, float], bound: float, settle: float = 2.0
) -> list[str]:
    """Live means live: a record acknowledged at time A (time.monotonic()) while the reader
    was tailing (from its first up-to-date answer + ``settle`` on) must reach it by A +
    ``bound``. A reader that slept through an append (a lost wake-up, a subscription
    missing after a reconnect) gets it only at its next poll or SSE cycle: much later.
    A reader still catching up (a late one, from the start of a long stream) is reading,
    not waiting to be woken: its pace is throughput, not liveness. Only the worst delay
    per reader is reported."""
    if not reader.connects or not reader.arrivals or reader.caught_up is None:
        return []
    since = max(reader.connects[0][0], reader.caught_up) + settle
    sizes = [size for _, size in reader.arrivals]
    worst: tuple[float, bytes, float, float] | None = None
    for offset, rec in parse_records(bytes(reader.received))[0]:
        acked = acks.get(rec)
        if acked is None or acked < since:
            continue
        index = bisect.bisect_left(sizes, offset + len(rec))
        if index >= len(sizes):
            continue
        arrived = reader.arrivals[index][0]
        delay = arrived - acked
        if delay > bound and (worst is None or delay > worst[0]):
            worst = (delay, rec, acked, arrived)
    if worst is None:
        return []
    delay, rec, acked, arrived = worst
    nearby = [f"{t - acked:+.1f}s {via}" for t, via in reader.connects if acked - 30 <= t <= arrived]
    return [
        f"stream {stream!r}: {reader.mode} reader {reader.name!r} got {short(rec)!r} {delay:.1f}s after it "
        f"was acknowledged (bound {bound:.0f}s): a live reader slept through an append; its requests "
        f"(time relative to the ack, gateway): {nearby[-8:]}"
    ]


@dataclass
class Tally:
    """Counts for the run's summary line."""

    operations: int = 0
    acknowledged: int = 0
    failed: int = 0
    unknown: int = 0
    attempts: int = 0
    lost: int = 0
    duplicated: int = 0

    def add(self, content: bytes, appends: list[Append]) -> None:
        counts = Counter(rec for _, rec in parse_records(content)[0])
        for append in appends:
            self.operations += 1
            self.attempts += len(append.attempts)
            outcome = append.outcome
            n = counts.get(append.record, 0)
            if outcome == ACKED:
                self.acknowledged += 1
                self.lost += n == 0
            elif outcome == FAILED:
                self.failed += 1
            else:
                self.unknown += 1
            self.duplicated += n > 1
