"""The rules of State compaction (gateway/protocol/compaction.py, docs/compaction.md), with
the official package as referee.

Random histories of State Protocol messages (inserts, updates, upserts, deletes over a few
keys of two types, with whole rows or a few fields, resets, snapshot pairs, messages that
are no State event) are compacted by runs interleaved with the appends: each run folds what
is older than a random lag and drops the tombstones folded more than a random retention
ago. Readers start at -1 or resume from a position they hold (with the state they built so
far) on whichever version of the stream is there when they read on, newer or older than the
last. Every reader must end with the state of the whole history, for both ways the package
materializes (a row replaced by each write: MaterializedState; merged: createStreamDB):

* here, two model materializers, over many histories (Hypothesis);
* in ``tests/ecosystem/compaction.mjs``, ``@durable-streams/state``'s MaterializedState over a
  few hundred seeded histories in one Node run, and its createStreamDB (TanStack DB)
  reading histories from -1 off a real gateway, as written and from a compacted stream the
  archive worker compacted (and archived, half the time).

The one guarantee a reader does not have: resuming from behind a tombstone dropped since,
while its state holds that row (Kafka's ``delete.retention.ms`` likewise); it starts over.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import subprocess
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import redis.asyncio as aioredis
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.archive.files import Archive
from gateway.protocol.compaction import Change, Control, Retained, classify, compact
from gateway.redis_io import keys
from workers.archiver import Archiver, Policy
from workers.compactor import CompactionPolicy

from .conftest import ECOSYSTEM, serving

TYPES = ("user", "task")
FIELDS = ("a", "b", "c", "d")
OTHERS: tuple[Any, ...] = (
    {"note": "no headers"},
    42,
    "text",
    [1, 2],
    {"headers": {"other": 1}},
    {"type": "user", "key": "", "value": {}, "headers": {"operation": "insert"}},  # empty key
    {"type": "user", "key": "k0", "value": {}, "headers": {"operation": "merge"}},  # unknown operation
    {"headers": {"operation": "merge", "control": "reset"}},  # a change event to the package: no reset
    {"headers": {"operation": None, "control": "reset"}},
    {"type": "task", "key": "k1", "value": {"a": 0}, "headers": {"operation": "insert", "control": "reset"}},
)

State = dict[tuple[Any, Any], Any]


def encode(value: Any) -> bytes:
    return orjson.dumps(value)


# -- the rules themselves ----------------------------------------------------------------------


def test_classify() -> None:
    change = {"type": "user", "key": "1", "value": {"a": 1}, "headers": {"operation": "update", "txid": "t"}}
    assert classify(encode(change)) == Change("user", "1", "update", frozenset({"a"}))
    assert classify(encode({**change, "value": 7})) == Change("user", "1", "update", None)
    assert classify(encode({"type": "user", "key": "1", "headers": {"operation": "delete"}})) == Change(
        "user", "1", "delete"
    )
    assert classify(encode({"headers": {"control": "reset", "offset": "x"}})) == Control("reset")
    assert classify(b'{"headers":{"control":"snapshot-end"}}') == Control("snapshot-end")
    for other in OTHERS[:-1]:
        assert classify(encode(other)) is None, other
    # An operation wins over a control, as the package's isChangeEvent has it.
    assert classify(encode(OTHERS[-1])) == Change("task", "k1", "insert", frozenset({"a"}))
    huge = (
        b'{"type":"user","key":"1","headers":{"operation":"insert"},"value":{"n":123456789012345678901234}}'
    )
    assert classify(huge) == Change("user", "1", "insert", frozenset({"n"}))  # parsed exactly, as reads do


def change(pos: int, key: str, op: str, value: Any = None) -> tuple[int, bytes]:
    event = {"type": "user", "key": key, "headers": {"operation": op}}
    if op != "delete":
        event["value"] = {"v": pos} if value is None else value
    return (pos, encode(event))


def control(pos: int, name: str) -> tuple[int, bytes]:
    return (pos, encode({"headers": {"control": name}}))


def kept(messages: list[tuple[int, bytes]]) -> list[int]:
    return [m[0] for m in messages]


def test_what_a_fold_keeps() -> None:
    history = [
        change(1, "a", "insert"), change(2, "b", "insert"), change(3, "a", "update"),  # a@1 goes
        (4, b'{"note":1}'),  # no State event: kept, even before a reset
        change(5, "b", "delete"),  # b's tombstone: b@2 goes
        control(6, "snapshot-start"), change(7, "c", "upsert"), control(8, "snapshot-end"),
        control(9, "snapshot-start"),  # still open at the reset: kept
        control(10, "reset"),  # drops a@3, b@5, c@7 and the closed pair
        change(11, "d", "insert"), control(12, "snapshot-end"),
        control(13, "reset"),  # drops d@11, the first reset; the start closed at 12: both go
        change(14, "e", "insert"), change(15, "e", "delete"),
        change(16, "f", "insert"),  # beyond the horizon: kept whatever it supersedes
    ]  # fmt: skip
    assert kept(compact(history, horizon=16)) == [4, 13, 15, 16]
    # Tombstones go once folded before the cut-off (folded at now_ms 100 here).
    assert kept(compact(history, horizon=16, now_ms=100, tombstones_before_ms=100)) == [4, 13, 15, 16]
    # ... but never the newest message folded (a read must find one where the fold ended)
    assert kept(compact(history, horizon=16, now_ms=100, tombstones_before_ms=101)) == [4, 13, 15, 16]
    assert kept(compact(history, horizon=17, now_ms=100, tombstones_before_ms=101)) == [4, 13, 16]
    # The start still open at the first reset stays; from the horizon on, all stays.
    assert kept(compact(history, horizon=11)) == [4, 9, 10, *range(11, 17)]
    assert compact(history, horizon=0) == history


def test_writes_of_some_fields_stay_until_later_writes_set_them_all() -> None:
    """StreamDB merges a write's fields into the row: a write goes only once later ones set
    every field it sets (a value that is no object replaces the row: it covers all)."""
    history = [
        change(1, "k", "insert", {"a": 1, "b": 1}),
        change(2, "k", "update", {"a": 2}),  # k@1 stays: b is set by nothing later (yet)
        change(3, "k", "update", {"b": 3, "c": 3}),  # now a and b are set since: k@1 goes
        change(4, "k", "update", {"a": 4, "c": 4}),  # k@2 (a) and k@3? c yes, b no: k@3 stays
        change(5, "j", "insert", {"a": 5}),
        change(6, "j", "update", 6),  # no object: j@5 goes
        change(7, "j", "update", {}),  # sets no field: j@6 stays (only no object or a delete covers it)
        change(8, "j", "update", {"z": 8}),
    ]
    assert kept(compact(history, horizon=9)) == [3, 4, 6, 8]


def test_a_delete_stays_while_the_key_is_written_again() -> None:
    """A reader holding the row from before a delete must remove it before merging the
    writes after it: the tombstone stays (until the retention), the writes before it go."""
    history = [change(1, "k", "insert"), change(2, "k", "delete"), change(3, "k", "insert", {"x": 1})]
    assert kept(compact(history, horizon=4)) == [2, 3]
    assert kept(compact(history, horizon=4, now_ms=5, tombstones_before_ms=6)) == [3]
    history.append(change(4, "k", "delete"))  # a later delete covers the earlier one
    assert kept(compact(history, horizon=5)) == [4]


# -- histories, compaction runs and readers ------------------------------------------------------


@dataclass
class Run:
    upto: int  # how many of the history's messages were appended when it ran (also its time)
    horizon: int  # the lag: messages from this index on are not folded
    tombstones_before: int | None  # folded at a run before this time: dropped


def make_value(rnd: random.Random, n: int, whole: bool) -> Any:
    if rnd.random() < 0.03:
        return rnd.choice((n, f"v{n}", None, [n]))  # no object (MaterializedState takes any JSON)
    names = FIELDS if whole else rnd.sample(FIELDS, rnd.randint(0, len(FIELDS)))
    return {name: n for name in names}


def make_history(
    rnd: random.Random, size: int, keys: int, *, resets: bool, others: bool, objects: bool = False
) -> list[Any]:
    """Mostly what a careful writer sends; a tenth of the operations any on any key."""
    history: list[Any] = []
    live: set[tuple[str, str]] = set()
    open_snapshot = False
    whole = rnd.random() < 0.5  # writers of whole rows, or of a few fields
    for n in range(size):
        roll = rnd.random()
        if resets and roll < 0.02:
            history.append({"headers": {"control": "reset"}})
            live.clear()
        elif roll < 0.06:
            history.append({"headers": {"control": "snapshot-end" if open_snapshot else "snapshot-start"}})
            open_snapshot = not open_snapshot
        elif others and roll < 0.09:
            history.append(rnd.choice(OTHERS))
        else:
            name = (rnd.choice(TYPES), f"k{rnd.randrange(keys)}")
            operation = rnd.choice(("update", "upsert", "delete") if name in live else ("insert", "upsert"))
            if rnd.random() < 0.1:
                operation = rnd.choice(("insert", "update", "upsert", "delete"))
            event: dict[str, Any] = {"type": name[0], "key": name[1], "headers": {"operation": operation}}
            if operation != "delete":
                value = make_value(rnd, n, whole)
                event["value"] = value if isinstance(value, dict) or not objects else {"v": n}
                live.add(name)
            else:
                live.discard(name)
            history.append(event)
    return history


def make_runs(rnd: random.Random, size: int, tombstones: bool) -> list[Run]:
    """Compaction runs at growing points of the history, horizons and tombstone cut-offs
    never moving back; the last one sees the whole history."""
    runs, horizon, before = [], 0, 0
    for upto in sorted(rnd.sample(range(1, size + 1), min(size, rnd.randint(1, 6)))) + [size]:
        horizon = max(horizon, upto - rnd.randint(0, 5))
        if tombstones:
            before = max(before, rnd.randint(0, upto))
        runs.append(Run(upto, horizon, before if tombstones else None))
    return runs


@dataclass
class Version:
    kept: list[int]  # the indexes of the history kept (appended by then)
    expired: dict[int, tuple[Any, Any]]  # dropped tombstones so far: index -> (type, key)


def versions(history: list[bytes], runs: list[Run]) -> list[Version]:
    """What each run leaves, folded incrementally as the worker does (a run's time: its upto)."""
    retained, dropped, expired, folded = Retained(), set(), {}, 0
    out = []
    for run in runs:
        dropped.update(retained.fold(((i, history[i]) for i in range(folded, run.horizon)), run.upto))
        folded = run.horizon
        if run.tombstones_before is not None:
            for i in retained.expired_tombstones(run.tombstones_before):
                event = classify(history[i])
                assert isinstance(event, Change)
                expired[i] = (event.type, event.key)
                dropped.add(i)
        out.append(Version([i for i in range(run.upto) if i not in dropped], dict(expired)))
    return out


def apply_replace(state: State, message: Any) -> None:
    """A model of MaterializedState (and of an application clearing it on a reset), written
    apart from the rules: any object whose ``headers`` has an ``operation`` is a change to
    ``(type, key)``, an empty key too (the package takes it; the rules keep it as it is)."""
    headers = message.get("headers") if isinstance(message, dict) else None
    if not isinstance(headers, dict):
        return
    if "operation" in headers:
        name = (message.get("type"), message.get("key"))
        if headers["operation"] == "delete":
            state.pop(name, None)
        elif headers["operation"] in ("insert", "update", "upsert"):
            state[name] = message.get("value")
    elif headers.get("control") == "reset":
        state.clear()


def apply_merge(state: State, message: Any) -> None:
    """A model of StreamDB's rows: a write's fields merged into the row it has."""
    headers = message.get("headers") if isinstance(message, dict) else None
    if isinstance(headers, dict) and headers.get("operation") in ("insert", "update", "upsert"):
        name, value = (message.get("type"), message.get("key")), message.get("value")
        if isinstance(value, dict) and isinstance(state.get(name), dict):
            state[name] = {**state[name], **value}
            return
    apply_replace(state, message)


Apply = Callable[[State, Any], None]


def model(messages: list[Any], apply: Apply = apply_replace) -> State:
    state: State = {}
    for message in messages:
        apply(state, message)
    return state


Hop = tuple[bool, list[int]]  # (start over first, the indexes of the history read)


def journeys(rnd: random.Random, history: list[Any], stream: list[Version], count: int) -> list[list[Hop]]:
    """Readers hopping between versions (mostly forward in time, sometimes back: a cache or
    a lagging replica): each reads a version from the position it holds to a random later
    one; the last hop reads the final version to its end. A reader starts over when it
    holds a row whose tombstone ahead of it was dropped (the one case it is not promised)."""
    out = []
    for _ in range(count):
        at, hops = -1, []
        rows: State = {}  # the rows it holds (either model: the same keys)
        order = [rnd.randrange(len(stream)) for _ in range(rnd.randint(0, 4))] + [len(stream) - 1]
        for n, number in enumerate(order):
            version = stream[number]
            restart = at >= 0 and any(i > at and name in rows for i, name in version.expired.items())
            if restart:
                at, rows = -1, {}
            after = [i for i in version.kept if i > at]
            read = after if n == len(order) - 1 else after[: rnd.randint(0, len(after))]
            hops.append((restart, read))
            for i in read:
                apply_replace(rows, history[i])
            if read:
                at = read[-1]
        out.append(hops)
    return out


def replayed(history: list[Any], hops: list[Hop], apply: Apply) -> State:
    state: State = {}
    for restart, read in hops:
        if restart:
            state = {}
        for i in read:
            apply(state, history[i])
    return state


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_every_reader_ends_with_the_state_of_the_whole_history(seed: int) -> None:
    rnd = random.Random(seed)
    size = rnd.randint(1, 120)
    history = make_history(rnd, size, keys=rnd.randint(1, 8), resets=rnd.random() < 0.5, others=True)
    encoded = [encode(m) for m in history]
    runs = make_runs(rnd, size, tombstones=rnd.random() < 0.5)
    stream = versions(encoded, runs)
    numbered = list(enumerate(encoded))
    last = runs[-1]
    # Incremental runs keep exactly what one fold of the whole history keeps (tombstones
    # aside: those are timed by the run that folded them) ...
    if last.tombstones_before is None:
        assert stream[-1].kept == kept(compact(numbered, last.horizon))
    # ... compacting again changes nothing, and a worker that starts over on what is kept
    # (a fresh Retained) goes on as the one before it would have.
    final = [numbered[i] for i in stream[-1].kept]
    assert compact(final, last.horizon) == final
    middle = runs[len(runs) // 2]
    if middle.tombstones_before is None and last.tombstones_before is None:
        later = range(middle.upto, len(numbered))  # appended after that run
        resumed = compact([numbered[i] for i in [*stream[len(runs) // 2].kept, *later]], last.horizon)
        assert kept(resumed) == stream[-1].kept
    for apply in (apply_replace, apply_merge):
        expected = model(history, apply)
        for hops in journeys(rnd, history, stream, 6):
            assert replayed(history, hops, apply) == expected, (seed, apply.__name__, hops)


# -- the official package as referee -----------------------------------------------------------


def referee_cases(seed: int, count: int) -> list[dict[str, Any]]:
    rnd = random.Random(seed)
    cases = []
    for _ in range(count):
        size = rnd.randint(1, 150)
        history = make_history(rnd, size, keys=rnd.randint(1, 10), resets=rnd.random() < 0.5, others=True)
        encoded = [encode(m) for m in history]
        stream = versions(encoded, make_runs(rnd, size, tombstones=rnd.random() < 0.5))
        readers = [
            [{"restart": restart, "messages": [history[i] for i in read]} for restart, read in hops]
            for hops in journeys(rnd, history, stream, 6)
        ]
        cases.append({"history": history, "readers": readers, "db": None})
    return cases


def db_cases(seed: int, count: int) -> list[list[Any]]:
    """Histories StreamDB 0.3.1 can take (object values, no reset: see tests/ecosystem/state.mjs,
    no messages of other shapes), of whole rows or a few fields."""
    rnd = random.Random(seed ^ 0x5EED)
    return [
        make_history(
            rnd, rnd.randint(1, 150), keys=rnd.randint(1, 10), resets=False, others=False, objects=True
        )
        for _ in range(count)
    ]


TABLES = (("user", "users"), ("task", "tasks"))  # type -> collection (compaction.mjs' schema)


def with_ids(state: State) -> State:
    """Rows as StreamDB holds them: the key in the primary key field."""
    return {name: {**value, "id": name[1]} for name, value in state.items()}


async def put_stream(
    http: aiohttp.ClientSession, url: str, messages: list[Any], compacted: bool = False
) -> None:
    headers = {"Content-Type": "application/json", **({"Stream-Compaction": "state"} if compacted else {})}
    async with http.put(url, data=orjson.dumps(messages), headers=headers) as r:
        assert r.status == 201, await r.text()


async def post_messages(http: aiohttp.ClientSession, url: str, messages: list[Any]) -> None:
    async with http.post(url, data=orjson.dumps(messages), headers={"Content-Type": "application/json"}) as r:
        assert r.status in (200, 204), await r.text()


async def test_the_official_materializers_agree(
    node: str, redis_url: str, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    seed = int(os.environ.get("DS_COMPACTION_SEED") or random.randrange(2**32))
    cases = referee_cases(seed, 200)
    path = tmp_path / "cases.json"
    redis = aioredis.Redis.from_url(redis_url)
    archive = str(tmp_path / "archive")
    rnd = random.Random(seed)
    # default limits: histories of up to ~15 KB in one PUT
    async with serving(redis_url, archive_url=archive) as gateway, contextlib.aclosing(redis):
        for full in db_cases(seed, 40):
            tag = uuid.uuid4().hex[:8]
            names = {kind: f"{gateway}/compaction-referee-{kind}-{tag}" for kind in ("full", "compacted")}
            await put_stream(http, names["full"], full)
            # compacted by the worker (workers/compactor.py), tombstones kept or all dropped,
            # half the time archived, then (when archived) the rest appended and the archived
            # segments compacted again (a deep run): StreamDB reads what a real stream keeps
            hot = rnd.choice((0, 1 << 40))
            split = rnd.randint(1, len(full)) if hot == 0 else len(full)
            await put_stream(http, names["compacted"], full[:split], compacted=True)
            policy = CompactionPolicy(
                lag_ms=0, lag_bytes=0, tombstone_ms=rnd.choice((0, 3_600_000)), min_interval_ms=0,
                dirty_ratio=0,
            )  # fmt: skip
            worker = Archiver(
                redis, Archive(archive), Policy(hot_bytes=hot, hot_ms=0, max_delay_ms=0), compaction=policy
            )
            sid = keys.stream_id(names["compacted"].split("/v1/stream/", 1)[1])
            await worker.archive_stream(sid)
            if split < len(full):
                await post_messages(http, names["compacted"], full[split:])
                await worker.archive_stream(sid)
            cases.append({"history": full, "readers": [], "db": names})
        path.write_bytes(orjson.dumps({"cases": cases}))
        proc = await asyncio.to_thread(
            subprocess.run,
            [node, "compaction.mjs", str(path)], cwd=ECOSYSTEM, capture_output=True, text=True, timeout=240,
        )  # fmt: skip
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, f"compaction.mjs failed (seed {seed}):\n{proc.stderr[-3000:]}"
    results = json.loads(lines[-1])["cases"]
    merged = 0
    for n, (case, result) in enumerate(zip(cases, results, strict=True)):
        reference = result["reference"]
        # the package's state is the model's (the referee and the model agree) ...
        assert reference == sorted([[t, k, v] for (t, k), v in model(case["history"]).items()]), (seed, n)
        # ... and every reader of compacted versions ends where the whole history does
        for r, state in enumerate(result["readers"]):
            assert state == reference, f"seed {seed} (DS_COMPACTION_SEED), case {n}, reader {r}"
        if case["db"] is not None:
            db = result["db"]
            assert db["compacted"] == db["full"], f"seed {seed} (DS_COMPACTION_SEED), StreamDB case {n}"
            rows = {
                (t, k): v for t, name in (("user", "users"), ("task", "tasks")) for k, v in db["full"][name]
            }
            expected = {
                name: {**value, "id": name[1]} for name, value in model(case["history"], apply_merge).items()
            }
            assert rows == expected, f"seed {seed}: StreamDB does not merge as the model does, case {n}"
            merged += rows != {n: {**v, "id": n[1]} for n, v in model(case["history"]).items()}
    assert merged, "no StreamDB case where merging and replacing differ: the check would miss a loss"
