"""``durable-streams migrate``: the layout changes from what Redis holds to this build's.

Two kinds (docs/operations.md, "Upgrades"):

* **offline** steps (``layout.STEPS``: v1 -> v2 -> v3), from before changes rolled: every
  process of the older build stops first; ``migrate`` runs them (``layout.migrate``).
* **rolling** changes (``ROLLING[v]``: v -> v + 1), in three moves, each its own deploy:

  1. *expand*: the new build rolls out as any deploy. It reads layouts v and v + 1 and
     writes the one Redis holds, v, so it runs beside the build before, and the build
     before can come back (a downgrade is a deploy too).
  2. ``migrate``: runs the change's ``expand`` step if it has one (data both builds read:
     new keys filled, an index built), online, in bounded steps, safe to stop and repeat.
  3. ``migrate --finish`` (the contract; no way back to the build before after it): refuses
     while a live process (the fleet registry, ``fleet.py``) does not read v + 1; switches
     what is written to v + 1 (``keys.LAYOUT``; ``keys.LAYOUT_OLDEST`` keeps v: data of v
     remains), waits until every live process says it writes v + 1, runs the change's
     ``contract`` step (what is still in layout v, rewritten), then drops
     ``keys.LAYOUT_OLDEST``. Interrupted anywhere, ``--finish`` again picks up where it was.

All of it under the migration lock (``layout.locked``): one migration at a time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from . import fleet, keys, layout
from .connections import Client
from .layout import Mismatch, Step


@dataclass(frozen=True)
class Rolling:
    """A rolling change from one layout to the next. ``expand`` (optional): data both builds
    read, made by ``migrate``; ``contract``: what is still in the older layout rewritten by
    ``migrate --finish`` once every process writes the newer one. Each idempotent and in
    bounded steps (a page of keys at a time), so an interrupted run can simply run again."""

    summary: str
    contract: Step
    expand: Step | None = None


async def no_rewrite(redis: Client) -> None:
    """Nothing to rewrite: compacted streams' logs may have gaps from now on."""


# ROLLING[v]: the change from layout v to v + 1 (none pending: layout.OLDEST_READ == CURRENT).
ROLLING: dict[int, Rolling] = {
    # State compaction (docs/compaction.md) drops messages of compacted streams: builds
    # before v4 would misread the gaps (a catch-up from inside one answered empty for ever),
    # so the archive workers compact only once v4 is written (layout.COMPACTING).
    3: Rolling("compacted streams may drop messages (their logs get gaps)", contract=no_rewrite),
}
SWITCH_WAIT_SECONDS = 3 * fleet.LEASE_SECONDS  # every member renews (and so switches) in a third of it


@dataclass(frozen=True)
class Build:
    """What a build knows of layouts (this one's by default; tests describe others)."""

    current: int = layout.CURRENT
    oldest_read: int = layout.OLDEST_READ
    steps: Mapping[int, Step] = field(default_factory=lambda: layout.STEPS)
    rolling: Mapping[int, Rolling] = field(default_factory=lambda: ROLLING)

    def change(self, version: int) -> Rolling:
        found = self.rolling.get(version)
        if found is None:
            raise Mismatch(f"this build has no change from layout v{version} to v{version + 1}")
        return found


async def migrate(
    redis: Client,
    say: Callable[[str], None],
    *,
    finish: bool = False,
    build: Build | None = None,
    wait_seconds: float = SWITCH_WAIT_SECONDS,
    lock_seconds: float = layout.LOCK_SECONDS,
    lease_seconds: float = fleet.LEASE_SECONDS,
) -> int:
    """Run what is due (module docstring); ``say`` reports each move. Returns the layout
    written now. ``build``: this one's layouts (tests describe others)."""
    build = build or Build()
    found = await layout.stamp(redis, build.current)
    if found < build.oldest_read:
        found = await layout.migrate(
            redis, _unless_current(say), current=build.oldest_read, steps=build.steps,
            lock_seconds=lock_seconds,
        )  # fmt: skip
    if found > build.current:
        raise Mismatch(layout.verdict(found, build.current) or "")
    oldest = await layout.oldest_held(redis, found)
    if oldest == found == build.current:
        say(f"layout v{found} is current")
        return found
    async with layout.locked(redis, lock_seconds) as token:
        found = await layout.stamp(redis, build.current)  # again, under the lock
        oldest = await layout.oldest_held(redis, found)
        for version in range(found, build.current):
            change = build.change(version)
            if change.expand is not None:
                say(f"layout v{version} -> v{version + 1}, expand: {layout.summary(change.expand)}")
                await change.expand(redis)
        if not finish:
            say(_pending(found, oldest, build.current))
            return found
        while True:
            if oldest < found:  # switched: wait for every member, then rewrite what is left
                await _wait_switched(redis, found, say, wait_seconds, lease_seconds)
                for version in range(oldest, found):
                    contract = build.change(version).contract
                    say(f"layout v{version} -> v{version + 1}, contract: {layout.summary(contract)}")
                    await contract(redis)
                await fleet.switch(redis, found, found, token)  # no layout older than `found` left
                oldest = found
            if found >= build.current:
                break
            await fleet.switch(redis, found, found + 1, token)
            say(f"layout v{found} -> v{found + 1}: switched: v{found + 1} is written from now on")
            found, oldest = found + 1, found
    say(f"layout v{found} is current")
    return found


def _unless_current(say: Callable[[str], None]) -> Callable[[str], None]:
    """The offline steps' report without their closing line: this function says the last word."""
    return lambda line: None if line.endswith(" is current") else say(line)


def _pending(found: int, oldest: int, current: int) -> str:
    if found < current:
        return (
            f"layout v{found} is written; this build is ready to write v{current}: once every gateway "
            "and worker runs it (`durable-streams fleet`), run `durable-streams migrate --finish` "
            "(until then the build before can still be rolled back to)"
        )
    return f"layout v{found} is written, data of v{oldest} remains: run `durable-streams migrate --finish`"


async def _wait_switched(
    redis: Client, version: int, say: Callable[[str], None], seconds: float, lease_seconds: float
) -> None:
    """Until every live member writes ``version`` (they learn it at their next renewal) and a
    whole lease has passed (a member whose lease ended unseen, paused or cut off, stops
    writing by then: ``Membership.writing``), or Mismatch after ``seconds``: the contract must
    not rewrite data a member still writes the old way. Redis must still hold ``version``
    (a failover may have lost the switch)."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    told = False
    while True:
        held = await redis.get(keys.LAYOUT)
        if held is None or int(held) != version:
            raise Mismatch(
                f"Redis holds key layout {held!r}, not v{version}, after the switch (a failover that "
                "lost it?): run `durable-streams migrate --finish` again"
            )
        behind = [m for m in await fleet.members(redis) if m.writes < version]
        waited = loop.time() - started
        if not behind and waited >= lease_seconds:
            return
        if waited >= max(seconds, lease_seconds):
            raise Mismatch(
                f"{len(behind)} live process(es) still write layout v{behind[0].writes} "
                f"after {waited:.0f} s: "
                + "; ".join(m.describe() for m in behind)
                + ": see why (or stop them), then run `durable-streams migrate --finish` again"
            )
        if not told:
            who = f"{len(behind)} process(es) to write layout v{version} (at their next renewal)"
            say(f"waiting for {who} and a lease ({lease_seconds:.0f} s)")
            told = True
        await asyncio.sleep(min(0.5, lease_seconds / 4))
