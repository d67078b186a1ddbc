"""What a backup keeps of each key, and under which name a restore writes it: plain rules on
key names (keys.py), no Redis.

Three kinds of key:

* **dumped**: kept as DUMP serializes it and restored with RESTORE under the same name. A
  stream's keys (``ds:{<id>}:…``) and the deployment's own (layout, buckets, webhook keys,
  pattern subscriptions, the archive's segment sets) are named alike on one Redis and on a
  Cluster. A subscription's keys are too, but for their hash tag: its group's, which depends
  on the shape (one group on one Redis, ``SUB_GROUPS`` on a Cluster), so a restore renames them
  (``restored_name``).
* **listed**: sorted sets of stream or subscription ids whose key, or keys, depend on the
  shape (the stream index, the subscription outboxes and schedules, the archive hints): kept
  as their members and scores, and added on restore to the key the target's shape gives each
  member.
* **skipped**: state that belongs to running processes (leases, liveness marks, locks, the
  index sweep's turn, rate-limit buckets, the console's live statistics): a restored
  deployment starts without it.

The layout stamp is dumped, and a target may hold it already (a gateway or ``migrate`` ran
there first): ``restore`` keeps the target's when it is the backup's, refuses when not.
"""

from __future__ import annotations

import enum
import re

from ..features.stats import TAG as STATS_TAG
from ..redis_io import keys

PREFIXES = (f"{keys.PREFIX}:", f"{{{keys.PREFIX}:")  # every key of ours starts so


class Kind(enum.Enum):
    DUMPED = "dumped"
    LISTED = "listed"
    SKIPPED = "skipped"


class Listed(enum.Enum):
    """A listed key's family: what its members are, and where a restore adds each."""

    INDEX = "index"  # stream ids (score 0)
    OUTBOX = "outbox"  # stream ids -> when due (ms)
    HINTS = "hints"  # stream ids -> when to look (ms)
    DUE = "due"  # subscription ids -> when due (ms)


_SKIPPED_NAMES = {
    keys.ARCHIVE_WORKER_ALIVE,
    keys.ARCHIVE_RECONCILE,
    keys.SUBS_WORKER_ALIVE,
    keys.LAYOUT_LOCK,
    keys.FLEET,  # the source's processes, not the data's: the target's own join it
    keys.RESTORING,
    keys.RESTORING_LEASE,
    keys.INDEX_SWEEP,
    keys.INDEX_SWEEP_AT,
    keys.TENANT_SWEEP,
    keys.METER_FLUSHING,  # the meter (docs/tenants.md): what it counted is in the archive's
}  # usage files, or to be moved there by the source; never twice
_METER = (keys.METER_PREFIX, keys.METER_PART_PREFIX)
_TENANT = keys.tenant("")
_GROUP_TAGS = {keys.due_key(g)[len(keys.PREFIX) + 2 : -len("}:due")] for g in range(keys.SUB_GROUPS)}
_SUB_KEY = re.compile(r"ds:\{(?P<tag>[^}]*)\}:(?P<part>[slp]):(?P<sub>.*)", re.S)


def key_text(key: bytes | str) -> str:
    """A key's name as text, as keys.py encodes it (lone surrogates passed through); a name
    that is not UTF-8 at all (another application's, in a shared Redis) with its bytes escaped."""
    if isinstance(key, str):
        return key
    try:
        return key.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        return key.decode("utf-8", "surrogateescape")


def ours(key: str) -> bool:
    return key.startswith(PREFIXES)


def holds_data(key: str) -> bool:
    """A key a restore must not find in its target: one of ours a backup restores, other
    than the layout stamp (checked apart)."""
    return ours(key) and key != keys.LAYOUT and kind(key) is not Kind.SKIPPED


def tag_of(key: str) -> str | None:
    """The hash tag Redis Cluster hashes ``key`` by (None: the whole name)."""
    start = key.find("{")
    if start < 0:
        return None
    end = key.find("}", start + 1)
    return key[start + 1 : end] if end > start + 1 else None


def _is_live_leases(rest: str) -> bool:
    """Whether ``ds:tenant:<rest>`` is a tenant's live leases (keys.tenant_live), not the hash
    of a tenant named e.g. ``live`` (names hold no ':')."""
    name, colon, suffix = rest.partition(":")
    return bool(name) and bool(colon) and suffix == "live"


def kind(key: str) -> Kind | Listed:
    """What a backup keeps of ``key`` (one of ours): a ``Listed`` family, or a ``Kind``."""
    if key in _SKIPPED_NAMES or key.startswith((f"{keys.PREFIX}:rate:", STATS_TAG, *_METER)):
        return Kind.SKIPPED
    if key.startswith(_TENANT) and _is_live_leases(key[len(_TENANT) :]):  # the source's connections
        return Kind.SKIPPED
    if key == keys.STREAM_INDEX or key.startswith(f"{keys.STREAM_INDEX}:{{"):
        return Listed.INDEX
    if key == keys.SUBS_OUTBOX or key.startswith(f"{keys.SUBS_OUTBOX}:{{"):
        return Listed.OUTBOX
    if key == keys.ARCHIVE_HINTS or key.startswith(f"{keys.ARCHIVE_HINTS}:{{"):
        return Listed.HINTS
    tag = tag_of(key)
    if tag in _GROUP_TAGS and key.endswith("}:due"):
        return Listed.DUE
    if key.startswith(f"{keys.PREFIX}:{{") and tag is not None and tag not in _GROUP_TAGS:
        if key.endswith("}:lease"):  # the archive worker's, on one stream
            return Kind.SKIPPED
    return Kind.DUMPED


def subscription_of(key: str) -> str | None:
    """The subscription id (as in key names) a subscription's key belongs to, else None."""
    match = _SUB_KEY.fullmatch(key)
    return match["sub"] if match is not None and match["tag"] in _GROUP_TAGS else None


def subscription_part(key: str) -> str | None:
    """'s' (state), 'l' (links) or 'p' (pending) for a subscription's key, else None."""
    match = _SUB_KEY.fullmatch(key)
    return match["part"] if match is not None and match["tag"] in _GROUP_TAGS else None


def is_subscription_state(key: str) -> bool:
    """A subscription's state hash (one per subscription; ``keys.sub_keys``' first)."""
    match = _SUB_KEY.fullmatch(key)
    return match is not None and match["tag"] in _GROUP_TAGS and match["part"] == "s"


def restored_name(key: str, cluster: bool) -> str:
    """The name a dumped key takes in a deployment of the given shape: its own, but a
    subscription's keys, which move to the group the shape gives the subscription."""
    match = _SUB_KEY.fullmatch(key)
    if match is None or match["tag"] not in _GROUP_TAGS:
        return key
    sub = keys.path_of(match["sub"].replace("%3A", ":"))
    state, links, pending, _ = keys.sub_keys(sub, cluster)
    return {"s": state, "l": links, "p": pending}[match["part"]]


def listed_key(family: Listed, member: str, cluster: bool) -> str:
    """The key a listed member goes to in a deployment of the given shape."""
    if family is Listed.INDEX:
        return keys.stream_index(member, cluster)
    if family is Listed.OUTBOX:
        return keys.subs_outbox(member, cluster)
    if family is Listed.HINTS:
        hint_keys = keys.archive_hint_keys(cluster)
        return hint_keys[keys.archive_hint_shard(member, len(hint_keys))]
    return keys.sub_keys(member, cluster)[3]


def is_segment_set(key: str) -> bool:
    """An archive segment set (``keys.segments``): not a stream key whose path holds ':segs:'."""
    try:
        keys.split_segments_key(key)
    except ValueError:
        return False
    return True


def is_stream_meta(key: str) -> bool:
    """A stream's meta hash (the manifest's summary is one per stream)."""
    return key.startswith(f"{keys.PREFIX}:{{") and key.endswith("}:meta") and tag_of(key) not in _GROUP_TAGS
