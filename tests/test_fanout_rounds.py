"""How a channel's notices reach thousands of parked readers: in rounds the listener
serves a slice at a time (``Channel.serve``, ``Listener._serve``), reading the notices
that arrive in between. No Redis: channels and sinks alone.

Once one pass wrote to every reader before the listener read on and then rested as long
as it had worked: at 10,000 SSE readers a notice waited for the pass under way, the rest,
and its own pass (ack p99 ~240 ms here); now about one round (~126 ms). Around the rounds:
channels take turns, a deletion wakes everyone (a stream created anew is never written to
readers of the old one, nor handed to them from its notices), a round keeps the notices it
still owes, a reader that raises does not stop the round, and a lost connection wakes the
readers not yet reached.
"""

from __future__ import annotations

import asyncio
import time

from gateway.live import listener
from gateway.live.channels import Channel, Shutdown, Watch
from gateway.live.timers import Wheel
from gateway.protocol import notices


class Sink:
    """A parked SSE reader: what it is written, in order."""

    def __init__(self, position: int = 0) -> None:
        self.position, self.closed, self.key = position, False, "k"
        self.written: list[bytes] = []

    def frame(self, delivery: notices.Delivery) -> bytes:
        return b"".join(data for _, data in delivery.entries) + (b"|end" if delivery.closed else b"")

    def writable(self) -> bool:
        return True

    def write(self, frame: bytes) -> None:
        self.written.append(frame)


def _notice(old: int, data: bytes, closed: bool = False) -> notices.Notice | None:
    return notices.parse(b"%d %d %d %d\n%b" % (old, old + len(data), closed, len(data), data))


def _channel(readers: int) -> tuple[Channel, dict[asyncio.Event, Sink]]:
    channel = Channel(asyncio.get_running_loop().create_future())
    sinks = {asyncio.Event(): Sink() for _ in range(readers)}
    for event, sink in sinks.items():
        channel.waiters.add(event)
        channel.parked[event] = sink
    return channel, sinks


def _listener() -> listener.Listener:
    """A listener never connected: only its dispatching and serving are used."""
    return listener.Listener({}, lambda: None, 5.0)  # type: ignore[arg-type,return-value]


async def test_notices_arriving_during_a_round_reach_every_reader_once_in_order() -> None:
    channel, sinks = _channel(1000)
    channel.notify(_notice(0, b"ab"))
    assert channel.serve(300) == 300  # a slice of the first round
    channel.notify(_notice(2, b"cd"))  # arrives mid-round
    assert channel.serve(10_000) == 700  # the rest of the first round: they get both at once
    assert channel.serving  # those already visited are owed "cd": another round
    assert channel.serve(10_000) == 1000 and not channel.serving
    frames = sorted(b"+".join(s.written) for s in sinks.values())
    assert frames == [b"ab+cd"] * 300 + [b"abcd"] * 700
    assert all(s.position == 4 for s in sinks.values()) and not any(e.is_set() for e in sinks)
    assert channel.serve(10_000) == 0  # nothing new: no round


async def test_a_round_wakes_readers_it_cannot_write_to_and_skips_those_gone() -> None:
    channel, sinks = _channel(4)
    (behind, gone, plain, closing), all_sinks = list(sinks), list(sinks.values())
    all_sinks[0].position = 1  # not where the notices start: its task reads for itself
    del channel.parked[plain]  # registered, not parked (reading)
    channel.notify(_notice(0, b"xy", closed=True))
    channel.waiters.discard(gone)  # left after the round began... before it got there
    channel.serve(1)  # the first (in round order) only
    channel.serve(10)
    assert behind.is_set() and plain.is_set() and not gone.is_set() and closing.is_set()
    assert all_sinks[1].written == [] and all_sinks[3].written == [b"xy|end"] and all_sinks[3].closed
    channel.recent.clear()
    channel.deliver([notices.parse(b"2 2 1")])  # the close again, alone: written once is enough
    assert all_sinks[3].written == [b"xy|end"]


async def test_the_listener_serves_a_slice_at_a_time() -> None:
    """One ``_serve`` visits at most ``_SLICE`` readers, over the channels in the order
    they were notified; the listener calls it again between reads until all are served."""
    subscriber = _listener()
    big, big_sinks = _channel(listener._SLICE + 200)
    small, small_sinks = _channel(3)
    subscriber.channels |= {"big": big, "small": small}
    subscriber._dispatch([("message", "big", b"0 1 0 1\na"), ("message", "small", b"0 1 0 1\nb")])
    subscriber._serve()
    assert sum(bool(s.written) for s in big_sinks.values()) == listener._SLICE
    assert not any(s.written for s in small_sinks.values()) and subscriber._serving
    subscriber._serve()
    assert all(s.written == [b"a"] for s in big_sinks.values())
    assert all(s.written == [b"b"] for s in small_sinks.values()) and not subscriber._serving


async def test_a_stream_always_busy_does_not_hold_up_the_others() -> None:
    """Channels take turns a slice each: one notified again within every round (always
    due) once kept a small channel behind it from ever being served."""
    subscriber = _listener()
    busy, _ = _channel(4 * listener._SLICE)
    small, small_sinks = _channel(3)
    subscriber.channels |= {"busy": busy, "small": small}
    subscriber._dispatch([("message", "busy", b"0 1 0 1\na"), ("message", "small", b"0 1 0 1\nb")])
    position = 1
    for _ in range(3):
        subscriber._serve()
        subscriber._dispatch([("message", "busy", b"%d %d 0 1\na" % (position, position + 1))])
        position += 1
    assert all(s.written == [b"b"] for s in small_sinks.values())


async def test_a_deleted_stream_created_anew_is_not_written_to_readers_of_the_old_one() -> None:
    """After ``deleted`` the channel may hear of a new stream of the same name, its offsets
    starting over: a reader parked on the old one is woken to read Redis, never written the
    new one's bytes."""
    channel, sinks = _channel(2)
    (event, sink), (plain, _) = list(sinks.items())
    del channel.parked[plain]
    channel.notify(None)  # deleted
    channel.notify(_notice(0, b"NEW"))  # created again, appended to
    while channel.serving:
        channel.serve(10)
    assert event.is_set() and plain.is_set() and sink.written == [] and not channel.parked


async def test_a_woken_reader_of_a_deleted_stream_reads_redis_not_the_new_ones_notices() -> None:
    """A reader not parked (or not yet back from its wake) asks the notices itself: after a
    deletion, those of the stream created anew may chain on from its offset by chance (the
    old stream's tail 5, the new one's second append from 5 on): it must read Redis, and
    only once it has do the notices serve it again."""
    channel = Channel(asyncio.get_running_loop().create_future())
    channel.confirm()
    watch = Watch(Shutdown(), channel, Wheel(), read_at=time.monotonic())
    channel.waiters.add(watch)
    channel.notify(_notice(0, b"hello"))
    assert watch.delivery(0) is not None  # the old stream's notices serve it
    channel.notify(None)  # deleted
    channel.notify(_notice(0, b"ABCDE"))  # created again, appended to
    channel.notify(_notice(5, b"FGHIJ"))
    assert channel.recent.delivery(5) is not None  # the chance chaining
    assert watch.delivery(5) is None  # read Redis
    watch.reading()  # it did (and found the stream it followed gone, or went on from there)
    delivery = watch.delivery(5)
    assert delivery is not None and delivery.entries == ((5, b"FGHIJ"),)


async def test_a_long_round_keeps_the_notices_it_still_has_to_deliver() -> None:
    """Appends of 4 KB arriving during a round of 1,000 readers: beyond Recent's usual 64
    KiB, yet every reader is written all of it, none sent to read Redis instead."""
    channel, sinks = _channel(1000)
    channel.notify(_notice(0, b"a" * 4096))
    channel.serve(300)
    for i in range(1, 20):
        channel.notify(_notice(4096 * i, b"b" * 4096))
    while channel.serving:
        channel.serve(300)
    assert not any(event.is_set() for event in sinks)
    assert all(s.position == 20 * 4096 and len(b"".join(s.written)) == 20 * 4096 for s in sinks.values())
    assert channel.recent.held <= 64 * 1024 and len(channel.recent) <= 32  # the round over: trimmed


async def test_a_burst_between_two_slices_is_written_not_read_again() -> None:
    """A few readers, and notices holding more than Recent's usual 64 KiB arriving before
    their round: each reader is written all of them (the old pass stitched the batch)."""
    channel, sinks = _channel(3)
    for i in range(3):
        channel.notify(_notice(30_000 * i, b"j" * 30_000))
    channel.serve(500)
    assert not any(event.is_set() for event in sinks)
    assert all(len(b"".join(s.written)) == 90_000 for s in sinks.values())
    assert channel.recent.held <= 64 * 1024


async def test_a_reader_that_raises_is_woken_and_the_round_goes_on() -> None:
    channel, sinks = _channel(5)
    broken_event, broken = next(iter(sinks.items()))

    def frame(delivery: notices.Delivery) -> bytes:
        raise ValueError("a bug")

    broken.frame = frame  # type: ignore[method-assign]
    broken.key = "other"  # its own frame, not the one the others share
    channel.deliver([_notice(0, b"ab")])
    assert broken_event.is_set() and broken.written == []
    assert [s.written for s in sinks.values() if s is not broken] == [[b"ab"]] * 4
    assert not channel.serving


async def test_readers_a_lost_connection_leaves_unvisited_are_woken_at_once() -> None:
    subscriber = _listener()
    channel, sinks = _channel(listener._SLICE + 100)
    subscriber.channels["c"] = channel
    subscriber._dispatch([("message", "c", b"0 1 0 1\na")])
    subscriber._serve()  # one slice written
    subscriber._lost()
    written = [s for s in sinks.values() if s.written]
    assert len(written) == listener._SLICE and not subscriber._serving and not channel.serving
    assert all(event.is_set() for event, s in sinks.items() if not s.written)
