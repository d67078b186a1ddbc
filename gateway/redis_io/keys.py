"""Redis key names, in one place (the Lua scripts get them in KEYS, except as noted).

A stream's keys share one hash tag, ``{<stream id>}``, so they hash to one Redis
Cluster slot, and every key a script touches comes to it in KEYS (no script
builds a key name: tests/test_scripts_keys.py checks). The keys of no stream
(archive hints and index, the layout version) are each in a slot of their own;
on Redis Cluster the archive hints are spread over several keys (``archive_hint_keys``).
The stream id is its path with ``%``, ``{`` and ``}`` percent-encoded:
readable in ``redis-cli``, reversible, and unable to close the hash tag early.
"""

from __future__ import annotations

import functools
import hashlib
import zlib

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

PREFIX = "ds"


def stream_id(path: str) -> str:
    return path.replace("%", "%25").replace("{", "%7B").replace("}", "%7D")


def path_of(stream_id: str) -> str:
    return stream_id.replace("%7D", "}").replace("%7B", "{").replace("%25", "%")


def stream_keys(sid: str) -> list[str]:
    """meta, log, producers, forks, notify channel: the KEYS every script gets."""
    tag = f"{PREFIX}:{{{sid}}}"
    return [f"{tag}:meta", f"{tag}:log", f"{tag}:prod", f"{tag}:forks", f"{tag}:notify"]


def stream_born(sid: str) -> str:
    """The ``created`` last given at this path, kept for a short while (a string with an
    expiry; create.lua): a stream created anew there within the same millisecond (a
    DELETE and a PUT back to back) takes a later one, so its ETags, If-Match and live
    readers tell the two incarnations apart."""
    return f"{PREFIX}:{{{sid}}}:born"


def lease(sid: str) -> str:
    """Held by the archive worker working on the stream: a string holding the
    worker's token, with an expiry the worker keeps renewing. Every archive
    script gets it in KEYS and refuses to act for any other token (fencing)."""
    return f"{PREFIX}:{{{sid}}}:lease"


def fold(sid: str) -> str:
    """A compacted stream's fold record (lua/compact.lua): a hash of when each kept
    ``delete`` was folded (ms, by position; the tombstone retention counts from then) and
    the ``created`` of the incarnation it is of. The rest of what a fold remembers is
    folded again from the kept messages each run (workers/compactor.py). It expires
    (renewed by every run): no script that drops a stream needs to know of it."""
    return f"{PREFIX}:{{{sid}}}:fold"


def segments(sid: str, incarnation: str) -> str:
    """An incarnation's archived segments (sorted set; see gateway/archive/segments.py).

    Named by incarnation and never expiring, so the files of a deleted or
    expired stream stay findable (through ``ARCHIVE_SEGSETS``) until the worker
    removes them, and a new stream at the same path starts with none.
    """
    return f"{PREFIX}:{{{sid}}}:segs:{incarnation}"


def rate_bucket(identity: str, rule_key: str) -> str:
    """A token bucket of one client under one rate limit rule (a hash, lua/rate_limit.lua):
    ``ds:rate:{<identity digest>}:<rule digest>``.

    ``identity`` is who is counted: a credential id (``token:ci``, ``jwt:<sub>``) or,
    for anonymous requests, ``ip:<address>``; ``rule_key`` is ``RateRule.key``. Both go
    in as SHA-256 digests (hex, truncated): a bounded length whatever the identity or
    the rule's prefix, no ``}`` that would end the hash tag early, and a name no
    pattern here matches (``META_PATTERN``). The hash tag is the identity's, so one
    client's buckets share a Cluster slot (one script could take from several). Stream
    keys all start ``ds:{``, so no stream path can name a bucket. An idle bucket
    expires once full again: Redis holds buckets of recent clients only.
    """
    who = hashlib.sha256(identity.encode("utf-8", "surrogatepass")).hexdigest()[:24]
    rule = hashlib.sha256(rule_key.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    return f"{PREFIX}:rate:{{{who}}}:{rule}"


# Only meta hashes match: what follows a stream's "}" is always ours, and ids hold no "}".
META_PATTERN = f"{PREFIX}:*:meta"
# Every segment set's key name, added before the set is first written: the
# worker finds the archives of deleted streams here, not by matching key names
# (paths are the users' and may hold ":segs:"). Not in any stream's slot. One key
# on Redis Cluster too: written once per incarnation, read by one reconciliation a
# minute (SSCAN), so its node sees little of it.
ARCHIVE_SEGSETS = f"{PREFIX}:archive:segsets"
# Streams with data to archive: score = when to look (ms). Gateways add
# streams they appended to (NX, about once a second); workers take them.
# On one Redis this is the only hint key; on Redis Cluster see archive_hint_keys.
ARCHIVE_HINTS = f"{PREFIX}:archive:hints"
# How many hint keys on Redis Cluster: every gateway writes hints and every worker polls
# them each second, which on one key would all land on one primary.
ARCHIVE_HINT_SHARDS = 16
# Set by every running archive worker (with an expiry it keeps renewing): gateways
# send hints only while it exists, so hints never pile up with no worker to take them.
# One key on Redis Cluster too: a SET per worker every 20 s, an EXISTS per gateway a second.
ARCHIVE_WORKER_ALIVE = f"{PREFIX}:archive:alive"
# Who scans for lost hints and dead archives, when (a SET NX per worker per interval).
ARCHIVE_RECONCILE = f"{PREFIX}:archive:reconcile"
# The key layout's version, an integer (redis_io/layout.py): set once, by the first process
# to start on a Redis without it, and raised only by `durable-streams migrate`.
LAYOUT = f"{PREFIX}:layout"
# Held (with an expiry) while `migrate` runs its steps. Its hash tag is LAYOUT's whole
# name, so the two share a Redis Cluster slot: migrate WATCHes both in one transaction.
LAYOUT_LOCK = f"{{{LAYOUT}}}:lock"
# The oldest layout whose data may still be in Redis while a rolling change is under way
# (`migrate` switched LAYOUT, `migrate --finish` has not rewritten the rest); absent: LAYOUT.
LAYOUT_OLDEST = f"{{{LAYOUT}}}:oldest"
# Set by `durable-streams restore` while it writes (the backup's seal): a restore killed
# outright leaves it, and a run of the same backup removes what that one wrote first.
RESTORING = f"{{{LAYOUT}}}:restoring"
# Held (with an expiry it renews) by a running restore: the marker of one without it is a dead one's.
RESTORING_LEASE = f"{{{LAYOUT}}}:restoring:lease"
# The fleet registry (redis_io/fleet.py): member id -> its record (JSON: role, build, the
# layouts it reads, the one it writes, its lease's end). In LAYOUT's slot: a member joins, and
# `migrate --finish` switches the layout, each with one script reading both.
FLEET = f"{{{LAYOUT}}}:fleet"


def _in_part(name: str, part: int, parts: int) -> str:
    """The first ``name.format(n)`` (n = 0, 1, ...) whose slot is in the part-th of ``parts``
    equal parts of the slots: names spread over the slot ranges primaries serve (about
    ``parts`` tries each, CRC16 spreads evenly)."""
    width = REDIS_CLUSTER_HASH_SLOTS // parts
    n = 0
    while key_slot(name.format(n).encode()) // width != part:
        n += 1
    return name.format(n)


def _hint_shard_key(shard: int) -> str:
    """Hint key ``shard`` of ``ARCHIVE_HINT_SHARDS`` on Redis Cluster:
    ``ds:archive:hints:{<shard>.<n>}`` in the shard-th part of the slots (``_in_part``): a
    cluster split evenly gives each primary about as many hint keys, and a stream's hints go
    to the key of its own slot's part (``archive_hint_shard``): mostly on its own primary."""
    return _in_part(f"{PREFIX}:archive:hints:{{{{{shard}.{{}}}}}}", shard, ARCHIVE_HINT_SHARDS)


_HINT_SHARD_KEYS = tuple(_hint_shard_key(shard) for shard in range(ARCHIVE_HINT_SHARDS))


def archive_hint_keys(cluster: bool) -> list[str]:
    """Every archive hint key, by shard: on one Redis only ``ARCHIVE_HINTS`` (as always);
    on Redis Cluster ``ARCHIVE_HINT_SHARDS`` keys in slots spread over the cluster."""
    return list(_HINT_SHARD_KEYS) if cluster else [ARCHIVE_HINTS]


def archive_hint_shard(sid: str, shards: int) -> int:
    """Which of ``shards`` hint keys holds the stream's hints: by the slot of its keys
    (a stable hash of its id), the part of the slots it falls in."""
    return stream_slot(sid) * shards // REDIS_CLUSTER_HASH_SLOTS


def split_segments_key(key: str) -> tuple[str, str]:
    """(stream id, incarnation) of a segments key; ValueError for any other name."""
    sid, inc = key_stream_id(key), key[key.rindex("}") + len(":segs:") + 1 :]
    if not inc or segments(sid, inc) != key:
        raise ValueError(f"not a segments key: {key!r}")
    return sid, inc


def key_stream_id(key: str) -> str:
    """The stream id inside any of a stream's key or channel names."""
    return key[len(PREFIX) + 2 : key.rindex("}")]


def notify_channel(sid: str) -> str:
    return stream_keys(sid)[4]


def channel_stream_id(channel: str) -> str:
    """The stream id a notify channel belongs to."""
    return key_stream_id(channel)


# -- subscriptions (features/subscriptions.py, workers/delivery.py) -------------------


def stream_subs(sid: str) -> str:
    """A stream's side of its subscription links (hash: subscription id -> 'e'|'g'|'eg',
    and '_inc': the incarnation last matched against the patterns). In the stream's
    slot: append.lua and create.lua check it to know the stream has subscribers. It
    outlives the stream (delete.lua leaves it), as explicit links do."""
    return f"{PREFIX}:{{{sid}}}:subs"


# Streams whose subscribers are to be told of them (sorted set: stream id -> when due,
# ms), written by append.lua and create.lua in the stream's own slot. One key on one
# Redis; on Redis Cluster one per slot (a script may touch only its slot's keys), named
# by a hash tag that falls in that slot (``subs_outbox``).
SUBS_OUTBOX = f"{PREFIX}:subs:outbox"
# Where a new outbox entry is announced (PUBLISH of the outbox's name): workers wake.
SUBS_WAKE_CHANNEL = f"{PREFIX}:subs:wake"
# Pattern subscriptions (hash: id -> pattern) and a counter raised on every change:
# workers match new streams against them, gateways check whether any exist.
SUBS_INDEX = f"{{{PREFIX}:subs:index}}"
SUBS_INDEX_VERSION = f"{{{PREFIX}:subs:index}}:v"
# Set by every running delivery worker (with an expiry it keeps renewing): gateways record
# new streams in the outboxes only while it exists (features/subscriptions.py WorkersAlive).
SUBS_WORKER_ALIVE = f"{PREFIX}:subs:alive"
# Webhook signing keys (hash: kid -> JSON with the PKCS#8 PEM and its times), shared by
# every gateway (JWKS) and worker (signing); and the secret callback tokens are signed with.
WEBHOOK_KEYS = f"{PREFIX}:webhook:keys"
SUBS_TOKEN_SECRET = f"{PREFIX}:subs:token-secret"
# How many groups subscriptions are spread over on Redis Cluster (each group's keys and
# schedule share a slot, as the hint keys do); one on one Redis.
SUB_GROUPS = 16


@functools.cache
def _slot_tags() -> tuple[str, ...]:
    """For every Cluster slot, a short hash tag that falls in it (computed once, ~0.5 s:
    about 300k CRC16s of hex counters; only on Redis Cluster)."""
    tags: list[str | None] = [None] * REDIS_CLUSTER_HASH_SLOTS
    missing, n = REDIS_CLUSTER_HASH_SLOTS, 0
    while missing:
        tag = format(n, "x")
        slot = key_slot(tag.encode())
        if tags[slot] is None:
            tags[slot] = tag
            missing -= 1
        n += 1
    return tuple(t for t in tags if t is not None)


def subs_outbox(sid: str, cluster: bool) -> str:
    """The outbox a stream's appends record wakes in: on Redis Cluster its slot's."""
    if not cluster:
        return SUBS_OUTBOX
    return _of_slot(SUBS_OUTBOX, stream_slot(sid))


def _of_slot(name: str, slot: int) -> str:
    """``name`` for one Cluster slot: ``<name>:{<a tag in that slot>}``."""
    return f"{name}:{{{_slot_tags()[slot]}}}"


def stream_slot(sid: str) -> int:
    """The Cluster slot of a stream's keys."""
    return key_slot(stream_keys(sid)[0].encode("utf-8", "surrogatepass"))


def outbox_keys(cluster: bool, slots: list[int] | None = None) -> list[str]:
    """Every outbox (or those of ``slots``)."""
    if not cluster:
        return [SUBS_OUTBOX]
    return [_of_slot(SUBS_OUTBOX, s) for s in (range(REDIS_CLUSTER_HASH_SLOTS) if slots is None else slots)]


# -- the stream index (features/listing.py) ------------------------------------------


# Every live stream (sorted set, score 0, member: stream id, so ZRANGE BYLEX reads
# them by path), written by create.lua and delete.lua in the stream's own slot: one
# key on one Redis; on Redis Cluster one per slot (``stream_index``), like the outboxes.
STREAM_INDEX = f"{PREFIX}:index"


# Buckets made with PUT /{bucket} (hash: name -> created, ms): features/buckets.py.
BUCKETS = f"{PREFIX}:buckets"
# Taken (SET NX, expiring) by the gateway that sweeps the index this interval, and where
# the last sweep stopped (a listing cursor): features/listing.py IndexSweep.
INDEX_SWEEP = f"{PREFIX}:index-sweep"
INDEX_SWEEP_AT = f"{PREFIX}:index-sweep:at"


def stream_index(sid: str, cluster: bool) -> str:
    """The index that lists a stream: on Redis Cluster its slot's."""
    return index_of_slot(stream_slot(sid)) if cluster else STREAM_INDEX


def index_of_slot(slot: int) -> str:
    return _of_slot(STREAM_INDEX, slot)


def sub_id(sub: str) -> str:
    """A subscription id as it goes in key names: encoded like stream ids, and ``:`` too,
    so no subscription key ends like a stream's meta (``META_PATTERN``)."""
    return stream_id(sub).replace(":", "%3A")


def _group_tag(group: int) -> str:
    """Group ``group``'s hash tag, ``subs.<group>.<n>``, in the group-th part of the slots
    (``_in_part``: spread like the hint keys)."""
    return _in_part(f"subs.{group}.{{}}", group, SUB_GROUPS)


_GROUP_TAGS = tuple(_group_tag(g) for g in range(SUB_GROUPS))


def sub_group(sub: str, cluster: bool) -> int:
    return zlib.crc32(sub.encode("utf-8", "surrogatepass")) % SUB_GROUPS if cluster else 0


def due_key(group: int) -> str:
    return f"{PREFIX}:{{{_GROUP_TAGS[group]}}}:due"


def due_keys(cluster: bool) -> list[str]:
    """Every group's schedule of subscriptions with something due (sorted set: id -> ms)."""
    return [due_key(g) for g in range(SUB_GROUPS if cluster else 1)]


def sub_keys(sub: str, cluster: bool) -> list[str]:
    """A subscription's state, links, pending and its group's schedule: the KEYS of
    every sub_*.lua script (lua/_subs.lua), one hash tag (the group's)."""
    group = sub_group(sub, cluster)
    tag, sid = f"{PREFIX}:{{{_GROUP_TAGS[group]}}}", sub_id(sub)
    return [f"{tag}:s:{sid}", f"{tag}:l:{sid}", f"{tag}:p:{sid}", due_key(group)]


# Tenants (docs/tenants.md, lua/_tenants.lua; one Redis only: a tenant's keys and its
# streams' are used by one script). Tenant names are protocol/tenants.NAME's: no ':', '{'.
TENANT_DEFAULTS = f"{PREFIX}:tenants:defaults"  # hash: 'q.<quota>' every tenant starts from
TENANT_INDEX = f"{PREFIX}:tenants"  # set: the tenants that stored something
TENANT_SWEEP = f"{PREFIX}:tenants:sweep"  # the gateway sweeping now (features/tenants.py)
METER_PREFIX = f"{PREFIX}:meter:"
METER_HOUR_SECONDS = 3600


def tenant(name: str) -> str:
    """A tenant's hash: its quota overrides ('q.<quota>') and usage ('u.<...>')."""
    return f"{PREFIX}:tenant:{name}"


def tenant_live(name: str) -> str:
    """A tenant's live connections on every gateway (sorted set: lease -> its end, ms;
    features/tenant_live.py)."""
    return f"{PREFIX}:tenant:{name}:live"


def tenant_streams(name: str) -> str:
    """A tenant's streams (hash: stream id -> the bytes stored for it there)."""
    return f"{PREFIX}:tenant:{name}:streams"


def meter(hour: int) -> str:
    """The usage counted in the hour that starts at ``hour`` (Unix seconds): a hash of
    '<tenant> <counter>' -> count, moved to Parquet by workers/meter.py."""
    return f"{METER_PREFIX}{hour}"


# The meter's hours being moved to Parquet (workers/meter.py): a hash, hour -> the part key
# its counts were renamed to, kept until the part's file is written and the part deleted.
METER_FLUSHING = f"{PREFIX}:meter-flushing"


METER_PART_PREFIX = f"{PREFIX}:meter-part:"


def meter_part(hour: int, part: str) -> str:
    """An hour's counts taken to be written as usage file ``part`` (workers/meter.py)."""
    return f"{METER_PART_PREFIX}{hour}:{part}"


def meter_hour(now: float) -> int:
    """The start of the metering hour ``now`` (Unix seconds) falls in."""
    return int(now) // METER_HOUR_SECONDS * METER_HOUR_SECONDS


def tenant_keys(name: str, now: float) -> list[str]:
    """What a script made for tenant ``name`` gets, in this order, before the outbox
    (lua/_tenants.lua's tenant_bind): its hash, the defaults, the index, its streams, the
    meter of the hour ``now`` falls in."""
    return [tenant(name), TENANT_DEFAULTS, TENANT_INDEX, tenant_streams(name), meter(meter_hour(now))]
