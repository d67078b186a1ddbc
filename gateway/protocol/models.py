"""The values storage hands to the HTTP layer: a stream's state, a read, a
validated create, an append's result. Plain data: built from what the Lua
scripts answer (``Meta.parse``), shaped into headers by ``responses.py``."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from .entries import LogEntry
from .headers import JSON_CONTENT_TYPE, Expiry
from .jsonmode import json_body

# (stream id, from position, to position, incarnation), to exclusive: a range a fork reads
# from an ancestor's log. The incarnation is the ancestor's meta 'uid' when the fork was
# made; a read refuses the range once the ancestor is gone or another stream holds its path
# (410). Stored as two meta fields: 'chain' [[id, from, to], ...] and 'chain_uids' [uid, ...]
# (a separate field: gateways from before incarnations parse 'chain' as triples, and a
# rolling update runs both). LEGACY_INCARNATION: a chain recorded without 'chain_uids'.
InheritedRange = tuple[str, int, int, str]
LEGACY_INCARNATION = "?"
Entry = tuple[int, bytes]  # (position, data)


def text(value: bytes | str) -> str:
    """A Redis reply item as text."""
    return value.decode() if isinstance(value, bytes) else value


def _chain(ranges: str | None, incarnations: str | None) -> tuple[InheritedRange, ...]:
    """A fork's chain from its meta fields 'chain' and 'chain_uids' (see InheritedRange)."""
    chain = json.loads(ranges or "[]")
    uids = json.loads(incarnations or "[]")
    if len(uids) != len(chain):
        uids = [LEGACY_INCARNATION] * len(chain)
    return tuple((sid, lo, hi, uid) for (sid, lo, hi), uid in zip(chain, uids, strict=True))


@dataclass(frozen=True, slots=True)
class Compacted:
    """A compacted stream's compaction so far (meta fields written by lua/compact.lua)."""

    upto: int = 0  # 'cto': messages below it were folded (what is kept of them is kept)
    generation: int = 0  # 'cgen': raised by every step that dropped messages (ETags)
    dropped: int = 0  # 'cdrop': bytes of messages dropped, in all
    dropped_messages: int = 0  # 'cdropn'
    last_run_ms: int = 0  # 'cat': when a run last finished
    barrier: int = 0  # 'fkmax': the newest fork point: nothing below it is dropped any more
    running_to: int = 0  # 'cnext': where a run under way (or one that died) folds up to

    @property
    def fork_floor(self) -> int:
        """Below here a compaction may have dropped messages because of later ones: no
        fork may start there (its history below its fork point is no longer whole)."""
        return max(self.upto, self.running_to)

    @classmethod
    def parse(cls, m: dict[str, str]) -> Compacted:
        def number(name: str) -> int:
            return int(m.get(name) or 0)

        return cls(
            number("cto"), number("cgen"), number("cdrop"), number("cdropn"), number("cat"),
            number("fkmax"), number("cnext"),
        )  # fmt: skip


@dataclass(frozen=True)
class Meta:
    """What a stream's meta hash says, typed."""

    sid: str
    content_type: str
    media_type: str  # normalized, for comparisons
    base: int  # where the stream's own log starts (a fork's fork point, else 0)
    tail: int
    closed: bool
    created: str
    ttl: int | None
    expires_at: str | None
    source: str | None
    chain: tuple[InheritedRange, ...]  # inherited ranges, oldest ancestor first
    arch: int  # where the Redis log starts: below it, data is in archived files
    floor: int  # where retained data starts (retention drops what is below)
    uid: str | None = None  # this incarnation's id, given when it is first forked (fork_ref.lua)
    snapshot: int | None = None  # where its latest application snapshot is (features/snapshots.py)
    compaction: str = ""  # 'state': compacted by key (docs/compaction.md); '' never
    inherits_gaps: bool = False  # 'gaps': a fork with a compacted ancestor
    compacted: Compacted = field(default_factory=Compacted)

    @classmethod
    def parse(cls, sid: str, flat: list[Any]) -> Meta:
        """From a flat ``[field, value, ...]`` list, as HGETALL (and the scripts) answer."""
        m = {text(flat[i]): text(flat[i + 1]) for i in range(0, len(flat), 2)}
        return cls(
            sid=sid,
            content_type=m["ct"],
            media_type=m["ctn"],
            base=int(m["base"]),
            tail=int(m["tail"]),
            closed=m.get("closed") == "1",
            created=m["created"],
            ttl=int(m["ttl"]) if "ttl" in m else None,
            expires_at=m.get("expires"),
            source=m.get("src"),
            chain=_chain(m.get("chain"), m.get("chain_uids")),
            arch=int(m.get("arch") or m["base"]),
            floor=int(m.get("floor") or 0),
            uid=m.get("uid"),
            snapshot=int(m["snap"]) if "snap" in m else None,
            compaction=m.get("cmp", ""),
            inherits_gaps=m.get("gaps") == "1",
            compacted=Compacted.parse(m) if "cmp" in m else Compacted(),
        )

    @property
    def is_json(self) -> bool:
        return self.media_type == JSON_CONTENT_TYPE

    @property
    def gapped(self) -> bool:
        """Whether reads may find no message where positions are: compaction dropped them
        (its own log's, or an ancestor's a fork inherits; docs/compaction.md)."""
        return bool(self.compaction or self.inherits_gaps) and self.is_json


@dataclass
class Chunk:
    """One read: data from ``start`` and the stream's state at that moment."""

    meta: Meta
    start: int
    entries: list[Entry] = field(default_factory=list)
    # Encoded responses, shared by the readers a shared read or notice reaches.
    cache: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)
    # A streamed catch-up answer's end (streams/reads.py catch_up): ``entries`` are then
    # only its first page, and the rest is read page by page while it is sent.
    until: int | None = None

    @property
    def end(self) -> int:
        return self.page_end if self.until is None else self.until

    @property
    def page_end(self) -> int:
        """Where ``entries`` end (one message or byte run each)."""
        if not self.entries:
            return self.start
        pos, data = self.entries[-1]
        return pos + len(data)

    @property
    def up_to_date(self) -> bool:
        return self.end >= self.meta.tail

    @property
    def eof(self) -> bool:
        return self.meta.closed and self.up_to_date

    def body(self) -> bytes:
        if self.meta.is_json:
            return json_body(self.entries)
        return b"".join([data for _, data in self.entries])


@dataclass(frozen=True)
class CreateSpec:
    """A validated PUT."""

    content_type: str | None  # None: not given (a fork inherits its source's)
    expiry: Expiry = Expiry()
    closed: bool = False
    entries: tuple[LogEntry, ...] = ()  # the body's (protocol/entries.py)
    fork_from: str | None = None  # source stream id
    fork_offset: str | None = None  # as given
    fork_sub_offset: int = 0
    # True: the fork holds its source (counted in its forks: a delete soft-deletes it while
    # the fork exists), the protocol's semantics. False, for a forker who may only read the
    # source: a weak fork, which loses its inherited range once the source is deleted.
    pin_source: bool = True
    if_match: str = ""  # If-Match for create.lua (conditions.IfMatch.script_arg), '' none
    compaction: str | None = None  # Stream-Compaction as asked (protocol/compaction.asked)
    tenant: str = ""  # whose quotas it counts against (docs/tenants.md), '' none


@dataclass(slots=True)  # not frozen: one per append, and a frozen __init__ costs ~1 µs more
class AppendResult:
    status: str  # ok | dup
    tail: int
    closed: bool
    producer_epoch: int | None = None
    producer_seq: int | None = None
    created: str | None = None  # the stream's incarnation (its ETag's), when appended
