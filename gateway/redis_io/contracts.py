"""The ARGV and the reply of every script in ``lua/``, one description each, checked
against the scripts' headers by tests/test_script_contracts.py.

Header grammar: ``-- ARGV:`` (``-- ARGV <group>:`` for a repeated group) lists items
``<n> <name>: <prose>`` numbered from 1, the last one may be a tail ``<n>.. <name>:
<prose>`` (the rest; a group when a ``-- ARGV <name>:`` section describes it), ``-- ARGV:
none.`` for no arguments; ``-- Returns`` names reply fields ``{'<status>', <name>, ...}``
(untagged ``{<name>, ...}``), ``[...]`` around fields that may be missing, ``<name>...``
for the rest, ``{...}...`` for a flat list of such groups, ``<name> (<prose>)`` to explain.

Each script's fixed ARGV is a ``typing.NamedTuple``, its fields in ARGV order. A
NamedTuple is a tuple: a call builds ``[*CreateArgv(...), *flatten(entries)]``, with no
conversion step (append.lua's per-append ``AppendItem`` is built for every POST). A
variadic tail has a name (``Script.tail``); a tail of repeated groups has a NamedTuple per
group (``Script.groups``). A reply the gateway reads is a NamedTuple per shape, made from
the raw reply with ``Shape(*reply)`` once its status says which (``status_of``), or with the
shape's ``of`` when it ends in a variadic field: call sites read ``reply.tail``, not
``reply[1]``. Reply fields are as Redis gives them (bytes, or text after
``Subscriptions.call``); conversions stay at the call sites.

Call sites name a script by its description (``CREATE.name``), never by a string. Each is
declared once, below, with whether it ``writes``; ``SCRIPTS`` is every one, and what
scripts.py loads.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ..protocol.models import text

Fields = type[tuple[Any, ...]]  # a NamedTuple class: a script's fixed ARGV, a group, a reply shape


class Group(NamedTuple):
    """A repeated group of a tail: its fields, and its own tail's name ('' none)."""

    fields: Fields
    tail: str = ""


@dataclass(frozen=True)
class Script:
    """One script's contract: ``argv`` its fixed ARGV (None: none), ``tail`` the name of
    what follows them ('' nothing), ``groups`` the NamedTuple of each tail that repeats a
    group, ``replies`` the shape of each tagged reply the gateway reads (by status),
    ``reply`` an untagged reply's shape (``repeats``: a flat list of them).

    ``writes``: its writes are ones a client is told of, so with --min-replicas-ack a call
    waits for the replicas (scripts.py). Not the reads (a sliding TTL's refresh may be lost
    with a failover), nor rate_limit (its buckets are not replicated at all)."""

    name: str
    argv: Fields | None = None
    tail: str = ""
    groups: Mapping[str, Group] = field(default_factory=dict)
    replies: Mapping[str, Fields] = field(default_factory=dict)
    reply: Fields | None = None
    repeats: bool = False
    writes: bool = True

    def args(self, *values: Any) -> list[Any]:
        """ARGV from values in order: the fixed ones through ``argv`` (their count
        checked), the rest as the tail (none unless the script has one)."""
        count = len(self.argv._fields) if self.argv is not None else 0  # type: ignore[attr-defined]
        if len(values) < count or (len(values) > count and not self.tail):
            raise TypeError(f"{self.name}: {len(values)} arguments for {count} (tail: {self.tail or 'none'})")
        fixed = self.argv(*values[:count]) if self.argv is not None else ()
        return [*fixed, *values[count:]]


def status_of(reply: Sequence[Any]) -> str:
    """A tagged reply's status (its first item), as text."""
    return text(reply[0])


def groups(shape: type[Any], flat: Sequence[Any]) -> list[Any]:
    """A flat reply of repeated groups (``{...}...``), one ``shape`` each."""
    size = len(shape._fields)
    return [shape(*flat[i : i + size]) for i in range(0, len(flat), size)]


# -- streams: create, append, read, delete --------------------------------------------


class CreateArgv(NamedTuple):
    content_type: str
    media_type: str
    ttl_seconds: int | str  # '' none
    expires_at_ms: int | str  # '' none
    expires_at: str
    closed: str  # '1' | '0'
    fork_source: str  # '' not a fork
    given_offset: str
    fork_offset: str
    fork_sub_offset: int
    base: int
    chain: str  # JSON
    chain_uids: str  # JSON
    source_uid: str
    weak: str  # '1' | '0'
    workers_alive: str  # '1' | '0'
    wake_channel: str
    if_match: str
    compaction: str  # 'state' | ''
    compaction_asked: str  # '1' | '0'
    gaps: str  # '1' | '0'
    tenant: str = ""  # '' none


class CreateDone(NamedTuple):  # 'created' | 'exists'
    status: bytes
    meta: list[Any]


class CreateConflict(NamedTuple):
    status: bytes
    source: bytes


class CreateRefused(NamedTuple):  # 'precondition_failed'
    status: bytes
    tail: bytes
    created: bytes


class AppendArgv(NamedTuple):
    notice_bytes: int
    wake_channel: str
    tenant: str  # '' none


class AppendStream(NamedTuple):
    append_count: int


class AppendHead(NamedTuple):  # an append's fixed fields, one argument (AppendItem.head)
    media_type: str
    close: str  # '1' | '0'
    stream_seq: str
    if_match: str
    expected_offset: str
    token: str
    total: str  # "<positions> <bytes>", '' none

    def joined(self) -> str:
        return "\n".join(self)


class AppendItem(NamedTuple):
    head: str  # AppendHead.joined(); '' the same as the append before it in the call
    producer: str  # "<epoch> <seq> <id>", '' none
    entry_count: int


class AppendDone(NamedTuple):  # 'ok' (append_part.lua; append.lua's once its runs are expanded)
    status: bytes
    tail: bytes | int  # int: one of a run, expanded (streams/appends.py: expand_runs)
    closed: bytes
    created: bytes | None = None  # None: a close-only append to a closed stream


class AppendRun(NamedTuple):  # append.lua's 'ok': AppendDone, for a run of plain appends
    status: bytes
    tail: bytes
    closed: bytes
    created: bytes | None = None
    answers: int | None = None  # the appends it answers, when more than one (expand_runs)


class AppendPending(NamedTuple):
    status: bytes
    tail: bytes
    one_each: bytes  # b'1': a compacted stream's, whose parts store a message an entry


class AppendBusy(NamedTuple):
    status: bytes
    until: bytes


class AppendDup(NamedTuple):
    status: bytes
    tail: bytes
    closed: bytes
    epoch: bytes
    seq: bytes


class AppendClosed(NamedTuple):
    status: bytes
    tail: bytes


class AppendConflict(NamedTuple):  # 'precondition_failed' | 'offset_conflict' | 'seq_regress'
    status: bytes
    tail: bytes
    created: bytes


class AppendStaleEpoch(NamedTuple):
    status: bytes
    epoch: bytes


class AppendSeqGap(NamedTuple):
    status: bytes
    expected: bytes
    received: bytes


class AppendFailed(NamedTuple):  # 'error'
    status: bytes
    written: bytes  # 'none' | 'partial'
    message: bytes


class AppendPartArgv(NamedTuple):
    token: str
    step: str  # 'part' | 'last' | 'abort'
    close: str  # '1' | '0'
    stream_seq: str
    producer_id: str
    producer_epoch: int | str
    producer_seq: int | str
    wake_channel: str
    tenant: str  # '' none


class ReadArgv(NamedTuple):
    start: int  # -1: metadata only
    budget: int
    refresh: str  # '1' | '0'
    inline_bytes: int
    max_entries: int


class RangeReply(NamedTuple):  # read_range.lua's, and the rest of read.lua's 'ok'
    entries: list[Any]
    flag: bytes = b""  # 'archived' | 'bulk' | 'lost'
    incarnation: bytes = b""


class ReadDone(NamedTuple):  # 'ok'
    status: bytes
    meta: list[Any]
    entries: list[Any]
    flag: bytes = b""
    incarnation: bytes = b""

    def found(self) -> RangeReply:
        """What it found at the start position, as read_range.lua answers it."""
        return RangeReply(self.entries, self.flag, self.incarnation)


class ReadRangeArgv(NamedTuple):
    start: int
    end: int
    budget: int
    whole: str  # '1' for JSON messages
    max_entries: int
    inline_bytes: int
    incarnation: str  # '' the stream's own log, '?' any


class DeleteArgv(NamedTuple):
    wake_channel: str
    tenant: str = ""  # '' none


class QuotaRefused(NamedTuple):  # 'quota' (create, append, append_part: _tenants.lua)
    status: bytes
    quota: bytes
    limit: bytes
    usage: bytes
    asked: bytes


class TenantLiveArgv(NamedTuple):
    member: str
    lease_ms: int


class TenantLiveTaken(NamedTuple):  # 'ok'
    status: bytes
    usage: bytes


class TenantRenewArgv(NamedTuple):
    lease_ms: int


class TenantRenewed(NamedTuple):
    renewed: int


class TenantSweepArgv(NamedTuple):
    tenant: str


class TenantSwept(NamedTuple):
    released: int


class Deleted(NamedTuple):
    status: bytes
    source: bytes
    source_uid: bytes
    snapshot_file: bytes = b""


# -- forks ----------------------------------------------------------------------------


class ForkRefArgv(NamedTuple):
    fork: str
    how: str  # 'pin' | 'weak' | 'stamp'
    uid: str
    anchor: int = -1  # Stream-Fork-Offset's position (-1: the tail)
    tenant: str = ""  # the forking request's ('' none)


class ForkReferenced(NamedTuple):  # 'ok'
    status: bytes
    meta: list[Any]
    added: bytes  # '1' | '0'


class ReleaseForkArgv(NamedTuple):
    fork: str
    source_uid: str


class ForkReleased(NamedTuple):  # 'collected'
    status: bytes
    source: bytes
    source_uid: bytes


# -- listing, migrations, snapshots, rate limits --------------------------------------


class StreamInfoArgv(NamedTuple):
    producers: int


class StreamInfo(NamedTuple):  # 'ok'
    status: bytes
    meta: list[Any]
    last_ms: bytes = b""
    producer_count: int = 0
    producers: Sequence[Any] = ()


class HashSwap(NamedTuple):
    field: str
    read: str
    new: str


class SnapshotSetArgv(NamedTuple):
    created: str
    position: int
    content_type: str
    file: str
    tenant: str = ""  # the publishing request's ('' none)


class SnapshotSet(NamedTuple):  # 'ok'
    status: bytes
    replaced: bytes
    tail: bytes | None = None


class RateTake(NamedTuple):
    rate: float
    burst: float
    cost: int


# -- the archive worker's -------------------------------------------------------------


class ArchiveLeaseArgv(NamedTuple):
    token: str
    hold_ms: int  # 0: release


class ArchiveArgv(NamedTuple):  # archive_check's, archive_forget's and archive_named's
    token: str
    incarnation: str


class ArchiveStageArgv(NamedTuple):
    token: str
    incarnation: str
    start: int
    end: int
    first_ms: int
    last_ms: int
    file: str


class ArchiveCommitArgv(NamedTuple):
    token: str
    incarnation: str
    member: str


class ArchiveCommitted(NamedTuple):  # 'ok'
    status: bytes
    replaced: bytes


class ArchiveReplaceArgv(NamedTuple):
    token: str
    incarnation: str
    phase: str  # 'stage' | 'commit'
    new: str  # the member replacing the old ones (the tail)
    upto: int
    barrier: int
    dropped_bytes: int
    dropped: int
    tenant: str  # the stream's as the worker read it ('' none): given the dropped bytes back


class CompactArgv(NamedTuple):
    token: str
    created: str
    upto: int
    barrier: int
    to: int
    last: str  # '1' | '0'
    dropped_bytes: int
    tombstones: str  # "<position>:<ms> ..."
    keep_ms: int
    forget: str  # "<position> ..."
    deep: str  # "<to> <kept bytes> <now ms> <kept a delete past its retention: 0|1>" | ''
    tenant: str  # the stream's as the worker read it ('' none): given the dropped bytes back


class CompactDone(NamedTuple):  # 'ok'
    status: bytes
    deleted: int


class ArchiveRetainArgv(NamedTuple):
    token: str
    incarnation: str
    cutoff_ms: int
    tenant: str  # the stream's as the worker read it ('' none): given the dropped bytes back


class ArchiveRetained(NamedTuple):  # 'ok'
    status: bytes
    dropped: list[Any]


# -- subscriptions: a stream's side ---------------------------------------------------


class StreamLinkArgv(NamedTuple):
    incarnation: str  # '' leave as is


class StreamLink(NamedTuple):
    sub_id: str
    types: str  # 'e' | 'g' | 'eg', '' to unlink


class StreamSubs(NamedTuple):
    state: bytes  # 'ok' | 'missing' | 'gone'
    tail: bytes
    incarnation: bytes
    links: list[Any]


class OutboxTakeArgv(NamedTuple):
    most: int
    hold_ms: int


class OutboxTaken(NamedTuple):
    stream_id: bytes
    recorded_ms: bytes


class BackupKeysArgv(NamedTuple):
    reads: str  # a letter per key: 'h' HGETALL, 'z' ZRANGE WITHSCORES, '-' none


class KeyDumped(NamedTuple):
    payload: bytes | None
    expiry: int
    fields: list[bytes]


class OutboxDoneArgv(NamedTuple):
    stream_id: str
    seen: str  # '' the stream was gone


class DueTakeArgv(NamedTuple):
    most: int
    hold_ms: int


class IndexSetArgv(NamedTuple):
    sub_id: str
    pattern: str  # '' to remove


# -- the fleet registry and rolling layout changes (fleet.py) ---------------------------


class FleetJoinArgv(NamedTuple):
    member: str
    record: str  # JSON
    reads_from: int
    reads_to: int
    writes: int
    lease_ms: int


class FleetJoined(NamedTuple):  # 'ok' | 'refused' | 'restoring'
    status: bytes
    layout: int
    oldest: int


class LayoutSwitchArgv(NamedTuple):
    expected: int
    to: int
    token: str


class LayoutMoved(NamedTuple):  # 'moved'
    status: bytes
    layout: int


class LayoutBehind(NamedTuple):  # 'behind'
    status: bytes
    records: tuple[bytes, ...]

    @classmethod
    def of(cls, reply: Sequence[Any]) -> LayoutBehind:
        return cls(reply[0], tuple(reply[1:]))


# -- subscriptions: a subscription's side (replies as text: Subscriptions.call) -------


class PathTail(NamedTuple):  # a group of sub_create, sub_links ('add'), sub_note, sub_claim
    path: str
    tail: str
    incarnation: str


class SubCreateArgv(NamedTuple):
    sub_id: str
    config: bytes | str  # JSON
    config_hash: str
    created_at: str
    kind: str
    lease_ms: int
    pattern: str  # '1' | '0'
    base_url: str


class SubGot(NamedTuple):
    state: list[Any]
    links: list[Any]


class SubDeleteArgv(NamedTuple):
    sub_id: str


class SubLinksArgv(NamedTuple):
    op: str  # 'add' | 'remove'
    kind: str  # 'e' | 'g'


class SubLinked(NamedTuple):  # 'ok' (sub_links.lua, sub_note.lua)
    status: str
    types: tuple[str, ...]  # per stream, '' not linked

    @classmethod
    def of(cls, reply: Sequence[Any]) -> SubLinked:
        return cls(reply[0], tuple(reply[1:]))


class SubNoteArgv(NamedTuple):
    new_wake_id: str


class SubClaimArgv(NamedTuple):
    worker: str
    new_wake_id: str


class SubClaimBusy(NamedTuple):
    status: str
    holder: str
    generation: str


class SubClaimed(NamedTuple):
    status: str
    generation: str
    wake_id: str
    lease_ms: str
    streams: list[Any]


class SubAckArgv(NamedTuple):
    mode: str  # 'callback' | 'ack' | 'release'
    generation: int | str
    wake_id: str
    done: str  # '1' | '0'
    new_wake_id: str


class SubAck(NamedTuple):
    path: str
    offset: str
    tail: str  # '' unknown


class SubAckInvalid(NamedTuple):  # 'invalid_offset'
    status: str
    why: str


class SubWoke(NamedTuple):  # 'ok' (sub_ack.lua, sub_result.lua)
    status: str
    new_wake: str  # '1' if a new wake began


class SubStepArgv(NamedTuple):
    sub_id: str
    new_wake_id: str
    token: str
    hold_ms: int
    backfill_hold_ms: int


class SubBackfill(NamedTuple):
    status: str
    config: str


class SubDeliver(NamedTuple):
    status: str
    generation: str
    wake_id: str
    config: str
    attempts: str
    streams: list[Any]
    base_url: str


class SubEmit(NamedTuple):
    status: str
    generation: str
    wake_id: str
    config: str
    streams: list[Any]
    attempts: str


class SubResultArgv(NamedTuple):
    outcome: str  # 'done' | 'accepted' | 'failed' | 'emitted' | 'backfilled'
    token: str
    generation: int | str
    wake_id: str
    retry_ms: int
    new_wake_id: str


# -- the scripts ----------------------------------------------------------------------

# Streams (streams/).
_CONFLICTS = dict.fromkeys(("precondition_failed", "offset_conflict", "seq_regress"), AppendConflict)
CREATE = Script(
    "create",
    CreateArgv,
    tail="entries",
    replies={
        "created": CreateDone,
        "exists": CreateDone,
        "conflict": CreateConflict,
        "precondition_failed": CreateRefused,
        "quota": QuotaRefused,
    },
)
APPEND = Script(
    "append",
    AppendArgv,
    tail="streams",
    groups={"streams": Group(AppendStream, "appends"), "appends": Group(AppendItem, "entries")},
    replies={
        "ok": AppendRun,
        "pending": AppendPending,
        "busy": AppendBusy,
        "dup": AppendDup,
        "closed": AppendClosed,
        **_CONFLICTS,
        "stale_epoch": AppendStaleEpoch,
        "seq_gap": AppendSeqGap,
        "error": AppendFailed,
        "quota": QuotaRefused,
    },
)
APPEND_PART = Script(
    "append_part", AppendPartArgv, tail="entries", replies={"ok": AppendDone, "quota": QuotaRefused}
)
READ = Script("read", ReadArgv, replies={"ok": ReadDone}, writes=False)
READ_RANGE = Script("read_range", ReadRangeArgv, reply=RangeReply, writes=False)
DELETE = Script("delete", DeleteArgv, replies={"deleted": Deleted})
FORK_REF = Script("fork_ref", ForkRefArgv, replies={"ok": ForkReferenced})
RELEASE_FORK = Script("release_fork", ReleaseForkArgv, replies={"collected": ForkReleased})
# Tenants (features/tenants.py): what streams that ended without a script held, given back.
TENANT_SWEEP = Script("tenant_sweep", TenantSweepArgv, tail="streams", reply=TenantSwept)
TENANT_RENEW = Script("tenant_renew", TenantRenewArgv, tail="members", reply=TenantRenewed)
TENANT_LIVE = Script("tenant_live", TenantLiveArgv, replies={"ok": TenantLiveTaken, "quota": QuotaRefused})
# The stream index (features/listing.py): the listing's look at a stream it found there, and
# migrate's step that lists streams made before the index (layout.py).
STREAM_INFO = Script("stream_info", StreamInfoArgv, replies={"ok": StreamInfo}, writes=False)
INDEX_ADD = Script("index_add")
# `durable-streams backup` (gateway/backup/take.py): one hash tag's keys at one moment.
BACKUP_KEYS = Script("backup_keys", BackupKeysArgv, reply=KeyDumped, repeats=True, writes=False)
# Migrate's step to layout v3 (layout.py): offsets kept by subscriptions, rewritten.
HASH_SWAP = Script("hash_swap", tail="swaps", groups={"swaps": Group(HashSwap)})
# The fleet registry (fleet.py): a member's lease; `migrate --finish`'s switch.
FLEET_JOIN = Script(
    "fleet_join", FleetJoinArgv, replies={"ok": FleetJoined, "refused": FleetJoined, "restoring": FleetJoined}
)
LAYOUT_SWITCH = Script(
    "layout_switch", LayoutSwitchArgv, replies={"moved": LayoutMoved, "behind": LayoutBehind}
)
# Ursula's snapshots (features/snapshots.py): the stream's record of its latest one.
SNAPSHOT_SET = Script("snapshot_set", SnapshotSetArgv, replies={"ok": SnapshotSet})
# The archive worker's (KEYS: the stream's five, its lease and (not archive_lease) its
# incarnation's segment set; fenced by the lease).
ARCHIVE_LEASE = Script("archive_lease", ArchiveLeaseArgv)
ARCHIVE_NAMED = Script("archive_named", ArchiveArgv, tail="files", writes=False)
ARCHIVE_STAGE = Script("archive_stage", ArchiveStageArgv)
ARCHIVE_COMMIT = Script("archive_commit", ArchiveCommitArgv, replies={"ok": ArchiveCommitted})
ARCHIVE_FORGET = Script("archive_forget", ArchiveArgv, tail="members")
ARCHIVE_CHECK = Script("archive_check", ArchiveArgv, writes=False)
ARCHIVE_RETAIN = Script("archive_retain", ArchiveRetainArgv, tail="sizes", replies={"ok": ArchiveRetained})
# State compaction's step (workers/compactor.py): the stream's five keys, its lease, its fold record.
COMPACT = Script("compact", CompactArgv, tail="positions", replies={"ok": CompactDone})
# ... and its rewrite of an archived segment (workers/compacted_segments.py): the archive's KEYS.
ARCHIVE_REPLACE = Script("archive_replace", ArchiveReplaceArgv, tail="old")
# KEYS: token buckets (keys.rate_bucket), no stream's; see features/ratelimit.py.
RATE_LIMIT = Script("rate_limit", tail="takes", groups={"takes": Group(RateTake)}, writes=False)
# Subscriptions (features/subscriptions.py): a stream's side (its links, its slot's outbox).
STREAM_SUBS = Script("stream_subs", reply=StreamSubs, writes=False)
STREAM_LINK = Script("stream_link", StreamLinkArgv, tail="links", groups={"links": Group(StreamLink)})
OUTBOX_TAKE = Script("outbox_take", OutboxTakeArgv, reply=OutboxTaken, repeats=True)
OUTBOX_DONE = Script("outbox_done", OutboxDoneArgv)
DUE_TAKE = Script("due_take", DueTakeArgv)
INDEX_SET = Script("index_set", IndexSetArgv)
# A subscription's side (KEYS: keys.sub_keys; _subs.lua put in front).
SUB_CREATE = Script("sub_create", SubCreateArgv, tail="streams", groups={"streams": Group(PathTail)})
SUB_GET = Script("sub_get", reply=SubGot, writes=False)
SUB_DELETE = Script("sub_delete", SubDeleteArgv)
SUB_LINKS = Script("sub_links", SubLinksArgv, tail="streams", replies={"ok": SubLinked})
SUB_NOTE = Script(
    "sub_note", SubNoteArgv, tail="streams", groups={"streams": Group(PathTail)}, replies={"ok": SubLinked}
)
SUB_CLAIM = Script(
    "sub_claim",
    SubClaimArgv,
    tail="streams",
    groups={"streams": Group(PathTail)},
    replies={"busy": SubClaimBusy, "claimed": SubClaimed},
)
SUB_ACK = Script(
    "sub_ack",
    SubAckArgv,
    tail="acks",
    groups={"acks": Group(SubAck)},
    replies={"invalid_offset": SubAckInvalid, "ok": SubWoke},
)
SUB_STEP = Script(
    "sub_step",
    SubStepArgv,
    replies={"backfill": SubBackfill, "deliver": SubDeliver, "emit": SubEmit},
)
SUB_RESULT = Script("sub_result", SubResultArgv, replies={"ok": SubWoke})

# Every script in lua/, by name: the module's Script constants above, in their order (each
# declared once, there; scripts.py loads these).
SCRIPTS: dict[str, Script] = {s.name: s for s in list(globals().values()) if isinstance(s, Script)}
