"""Compaction of State Protocol streams: which messages a compaction keeps (docs/compaction.md).

A stream created with ``Stream-Compaction: state`` holds State Protocol messages
(``@durable-streams/state``): change events ``{type, key, value, headers: {operation}}``
and control events ``{headers: {control}}``. The package's two materializers differ:
MaterializedState *replaces* a row on every write, createStreamDB (TanStack DB)
*merges* a write's fields into the row it has. So a write is redundant only once the
writes after it (up to the key's next delete) set every top-level field it sets; a
``delete`` makes every earlier event of its key redundant. Folding keeps:

- each key's writes that later writes do not cover (writers of whole rows: the newest; a
  value that is no object is covered only by another such value or a delete);
- a ``delete`` until the tombstone retention has passed since it was folded, even if
  the key was written again (a resuming StreamDB must remove the row before it merges
  again);
- the newest ``reset``, and nothing before it but the messages that are no State event
  and an unclosed ``snapshot-start`` (so no reader sees an end without its start);
- every snapshot marker after the newest reset;
- every message that is not a State event.

These are plain functions on ``(position, message)`` pairs: the worker
folds the stored messages older than the compaction lag through ``Retained.fold`` in
steps, remembering between steps what is kept (``Retained``); ``compact`` folds a whole
history at once (the tests' and the benchmark's reference).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from .errors import bad_request
from .headers import JSON_CONTENT_TYPE, STREAM_COMPACTION
from .jsonmode import state_headers

STATE = "state"  # the one compaction there is: State Protocol events, by (type, key)
OPERATIONS = frozenset({"insert", "update", "upsert", "delete"})
CONTROLS = frozenset({"snapshot-start", "snapshot-end", "reset"})

Message = tuple[int, bytes]  # (position, the message's JSON)
EVERY_FIELD = None  # the fields a write of a value that is no object covers: the whole row


def asked(header: str | None) -> str | None:
    """A PUT's ``Stream-Compaction``: 'state', '' (``none``: not compacted, whatever the
    policy), or None (not given: the policy decides); 400 for anything else."""
    if header is None:
        return None
    value = header.strip().lower()
    if value not in (STATE, "none"):
        raise bad_request(f"{STREAM_COMPACTION} must be 'state' or 'none'")
    return STATE if value == STATE else ""


def mode(asked: str | None, media_type: str, path: str, prefixes: Iterable[str]) -> str:
    """The compaction a stream is created with ('state' or ''): as asked, else by the
    server's policy (``--compaction-prefixes``) for JSON streams under its prefixes. Asked
    for a stream that is not JSON: 400 (a policy passes over it)."""
    if asked is None:
        under = any(path.startswith(prefix) for prefix in prefixes)
        return STATE if under and media_type == JSON_CONTENT_TYPE else ""
    if asked and media_type != JSON_CONTENT_TYPE:
        raise bad_request(f"{STREAM_COMPACTION}: state is for application/json streams only")
    return asked


@dataclass(frozen=True, slots=True)
class Change:
    type: str
    key: str
    operation: str
    fields: frozenset[str] | None = frozenset()  # top-level fields of the value (None: no object)


@dataclass(frozen=True, slots=True)
class Control:
    control: str


def classify(message: bytes) -> Change | Control | None:
    """A stored message as a State event, or None: it is none (kept as it is).

    As the package's ``isChangeEvent``, a message whose ``headers`` has an ``operation``
    is a change event whatever its ``control``: one this cannot compact (an unknown
    operation, a ``type`` or ``key`` that is not a non-empty string) is None, never a
    control event."""
    parts = state_headers(message)
    if parts is None:
        return None
    value, headers = parts
    if "operation" in headers:
        operation, kind, key = headers["operation"], value.get("type"), value.get("key")
        if operation not in OPERATIONS or not (
            isinstance(kind, str) and kind and isinstance(key, str) and key
        ):
            return None
        row = value.get("value")
        fields = frozenset(row) if isinstance(row, dict) else EVERY_FIELD
        return Change(kind, key, operation, frozenset() if operation == "delete" else fields)
    control = headers.get("control")
    return Control(control) if control in CONTROLS else None


@dataclass(slots=True)
class Key:
    """What is kept of one ``(type, key)``."""

    # its writes since its newest delete, in order, with the fields each sets (None: a value
    # that is no object, which replaces the row for either materializer)
    writes: list[tuple[int, frozenset[str] | None]] = field(default_factory=list)
    tombstone: tuple[int, int] | None = None  # (position, ms when folded) of its newest delete

    def positions(self) -> list[int]:
        kept = [position for position, _ in self.writes]
        return kept if self.tombstone is None else [self.tombstone[0], *kept]

    def write(self, position: int, fields: frozenset[str] | None) -> list[int]:
        """A new write: the earlier writes it makes redundant (every field each sets is set
        again since; a value that is no object only by another such value)."""
        covered: set[str] | None = None if fields is EVERY_FIELD else set(fields)
        kept: list[tuple[int, frozenset[str] | None]] = []
        dropped = []
        for earlier, earlier_fields in reversed(self.writes):
            if covered is None or (earlier_fields is not None and earlier_fields <= covered):
                dropped.append(earlier)
            else:
                kept.append((earlier, earlier_fields))
                covered = None if earlier_fields is None else covered | earlier_fields
        kept.reverse()
        kept.append((position, fields))
        self.writes = kept
        return dropped

    def delete(self, position: int, now_ms: int) -> list[int]:
        dropped = self.positions()
        self.writes, self.tombstone = [], (position, now_ms)
        return dropped


@dataclass
class Retained:
    """What the folded part of a stream keeps that a later message can drop."""

    keys: dict[tuple[str, str], Key] = field(default_factory=dict)
    markers: list[int] = field(default_factory=list)  # snapshot markers since the newest reset
    open_start: int | None = None  # a snapshot-start whose end has not come yet
    reset: int | None = None  # the newest reset

    def fold(
        self, messages: Iterable[Message], now_ms: int, folded_at: Mapping[int, int] | None = None
    ) -> list[int]:
        """Take the next messages (in stream order) at ``now_ms``: the positions of earlier
        kept messages (and of these) that they make redundant. In an order any prefix of
        which may be applied first: each message's drops come after those of the messages
        before it, and a reset's snapshot markers newest first (never an end without its
        start). ``folded_at``: when deletes folded before were (a worker folding again
        what it kept; else ``now_ms``). A delete that drops an earlier message now is
        folded now, whenever it was before: a reader that read that message before this
        drop still needs the delete for the whole retention (an older write archived when
        the delete was first folded is dropped only later, by a deep run)."""
        dropped: list[int] = []
        for position, message in messages:
            event = classify(message)
            if isinstance(event, Change):
                key = self.keys.setdefault((event.type, event.key), Key())
                if event.operation == "delete":
                    when = now_ms if folded_at is None else folded_at.get(position, now_ms)
                    gone = key.delete(position, when)
                    if gone and key.tombstone is not None:  # its retention starts again (see _expired)
                        key.tombstone = (position, now_ms)
                    dropped += gone
                else:
                    dropped += key.write(position, event.fields)
            elif isinstance(event, Control):
                dropped += self._control(position, event.control)
        return dropped

    def _control(self, position: int, control: str) -> list[int]:
        if control == "snapshot-start":
            self.markers.append(position)
            self.open_start = position
            return []
        if control == "snapshot-end":
            self.markers.append(position)
            self.open_start = None
            return []
        # reset: nothing before it counts any more, but a snapshot still open
        dropped = [position for key in self.keys.values() for position in key.positions()]
        dropped += [marker for marker in reversed(self.markers) if marker != self.open_start]
        if self.reset is not None:
            dropped.append(self.reset)
        self.keys.clear()
        self.markers = [] if self.open_start is None else [self.open_start]
        self.reset = position
        return dropped

    def tombstones(self) -> list[tuple[int, int]]:
        """The kept deletes: (position, ms when folded)."""
        return [key.tombstone for key in self.keys.values() if key.tombstone is not None]

    def expired_tombstones(self, folded_before_ms: int, keep_from: int | None = None) -> list[int]:
        """Drop the deletes folded before ``folded_before_ms`` (the tombstone retention has
        passed since): a reader behind one since would keep its row (docs/compaction.md).
        Not one at or past ``keep_from`` (the newest message folded): every other drop has
        a later message kept in its place, and a read must find one at the end of what was
        folded (else a reader of a stream whose last message is a delete would never reach
        its tail)."""
        dropped = []
        for name, key in list(self.keys.items()):
            if key.tombstone is not None and key.tombstone[1] < folded_before_ms:
                if keep_from is not None and key.tombstone[0] >= keep_from:
                    continue
                dropped.append(key.tombstone[0])
                key.tombstone = None
                if not key.writes:
                    del self.keys[name]
        return dropped


def compact(
    messages: Iterable[Message], horizon: int, now_ms: int = 0, tombstones_before_ms: int | None = None
) -> list[Message]:
    """A whole history compacted at ``now_ms``: the messages before ``horizon`` folded
    (then the tombstones folded before ``tombstones_before_ms`` dropped), the rest kept."""
    history = list(messages)
    retained = Retained()
    dropped = set(retained.fold((m for m in history if m[0] < horizon), now_ms))
    if tombstones_before_ms is not None:
        folded = [m[0] for m in history if m[0] < horizon]
        dropped.update(retained.expired_tombstones(tombstones_before_ms, max(folded, default=None)))
    return [m for m in history if m[0] not in dropped]
