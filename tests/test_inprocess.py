"""In-process connections on their own: the bounded channels and their two ends."""

from __future__ import annotations

import threading
import time

import trio

from quorumq.wire.inprocess import FrameChannel, ThreadEnd, TrioEnd
from quorumq.wire.protocol import copy_frame


def test_a_full_channel_takes_nothing_more_until_its_reader_takes_what_waits() -> None:
    """As a socket's buffers: the writer waits (or gives up at its deadline), so a reader
    that stops reading bounds what waits for it."""
    channel: FrameChannel[int] = FrameChannel(capacity=100)
    rooms: list[str] = []
    channel.on_room = lambda: rooms.append("room")
    assert channel.put([1, 2], 60) is True
    assert channel.put([3], 60) is True  # under the capacity when put: one may go past it
    assert channel.put([4], 1) is False
    started = time.monotonic()
    assert channel.put_by([4], 1, time.monotonic() + 0.05) is False
    assert time.monotonic() - started >= 0.05
    assert channel.take() == [1, 2, 3] and rooms == ["room"]
    assert channel.put([4], 1) is True and channel.take() == [4]
    assert rooms == ["room"]  # it was not full


def test_a_writer_waiting_for_room_goes_on_once_the_reader_takes() -> None:
    channel: FrameChannel[int] = FrameChannel(capacity=10)
    channel.put([1], 10)
    threading.Timer(0.05, channel.take).start()
    assert channel.put_by([2], 1, time.monotonic() + 5) is True
    assert channel.take() == [2]


def test_a_closed_channel_wakes_its_waiters_and_hands_over_what_waited() -> None:
    channel: FrameChannel[int] = FrameChannel(capacity=10)
    channel.put([1], 10)
    threading.Timer(0.05, channel.close).start()
    started = time.monotonic()
    assert channel.put_by([2], 1, time.monotonic() + 5) is None
    assert time.monotonic() - started < 4  # woken by the close, not by its 5 s deadline
    assert channel.take() == [1]  # what waited is still taken
    assert channel.take() is None
    assert channel.take_wait(5) is None


def test_the_blocking_end_keeps_what_it_has_not_yielded_for_the_next_read() -> None:
    """The handshake reads two frames and drops its iterator; the reader's iterator
    goes on with the rest of the batch they came in."""
    to_client: FrameChannel[dict[str, object]] = FrameChannel(capacity=1000)
    to_node: FrameChannel[tuple[object, int]] = FrameChannel(capacity=1000)
    end = ThreadEnd(to_client, to_node, timeout=1.0)
    to_client.put([{"n": 1}, {"n": 2}, {"n": 3}], 30)
    first = end.frames()
    assert next(first) == {"n": 1}
    del first
    to_client.close()
    assert list(end.frames()) == [{"n": 2}, {"n": 3}]


def test_the_blocking_end_sends_copies_and_gives_up_at_its_deadline() -> None:
    to_client: FrameChannel[dict[str, object]] = FrameChannel(capacity=1000)
    to_node: FrameChannel[tuple[object, int]] = FrameChannel(capacity=50)
    end = ThreadEnd(to_client, to_node, timeout=1.0)
    headers = {"h": "v"}
    frame = {"t": "publish", "headers": headers}
    assert end.send_frame_by(frame, time.monotonic() + 1) is None
    ((sent, size),) = to_node.take() or []
    assert sent == frame and sent["headers"] is not headers
    assert size == copy_frame(frame)[1]
    to_node.put([("filler", 50)], 50)
    assert end.send_frame_by(frame, time.monotonic() + 0.05) is TimeoutError
    end.hang_up()
    assert end.send_frame_by(frame, time.monotonic() + 1) is OSError


def test_a_trio_end_waits_for_a_thread_to_make_room_and_sees_the_close() -> None:
    """The node's end in its loop, the client's in a thread: the node's writer waits
    for the client to take, without blocking the loop."""

    async def main() -> None:
        to_client: FrameChannel[object] = FrameChannel(capacity=10)
        to_node: FrameChannel[object] = FrameChannel(capacity=10)
        node = TrioEnd(to_node, to_client, trio.lowlevel.current_trio_token())
        await node.send(["a"], 10)  # now full
        ticks = 0

        async def count() -> None:
            nonlocal ticks
            while True:
                await trio.sleep(0.01)
                ticks += 1

        async with trio.open_nursery() as nursery:
            nursery.start_soon(count)
            threading.Timer(0.1, to_client.take).start()
            with trio.fail_after(5):
                await node.send(["b"], 1)
            assert ticks >= 5  # the loop ran meanwhile
            threading.Timer(0.05, lambda: to_node.put([("f", 3)], 3)).start()
            with trio.fail_after(5):
                assert await node.receive() == [("f", 3)]
            threading.Timer(0.05, to_node.close).start()
            with trio.fail_after(5):
                assert await node.receive() == []
            nursery.cancel_scope.cancel()

    trio.run(main)
