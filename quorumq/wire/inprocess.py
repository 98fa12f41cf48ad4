"""An in-process connection: a client and a node in one process, frames between them.

`quorumq.Node` serves clients of its own process this way: no socket, no encoding. A
connection is two `FrameChannel`s, one each way. Each holds what one side has sent and
the other has not taken yet, bounded by what it counts for, as a socket's buffers are:
a writer that finds it full waits for room (`TrioEnd.send`, `ThreadEnd.send_frame_by`
with its deadline), so a reader that stops reading stops its writer, and the node
cuts off a client that stops taking its deliveries as a slow consumer, as over TCP.

What crosses is copied by the sender (`protocol.copy_frame`), so nothing the sender
keeps is reachable by the receiver: a client cannot change the replica's state by
changing a delivery's headers, and the node's checks cannot change a client's frame.

The node's side (and the trio client's) is a `TrioEnd`, woken through its trio loop's
token; the blocking client's is a `ThreadEnd`, woken by a condition variable. Neither
side's code runs the other's: a client thread that blocks holds up its own connection,
never the node's trio loop or its Raft thread.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

import trio

from .protocol import Frame, SizedFrame, copy_frame

T = TypeVar("T")

TO_NODE_BYTES = 256 * 1024
"""What a client's frames waiting for the node may count for before the client waits
(about what the node reads from a socket at once)."""
TO_CLIENT_BYTES = 1024 * 1024
"""What the node's frames waiting for the client may count for before the node's writer
waits (about one write of the node's; beyond, frames wait in the connection's outbox,
under its slow-consumer bounds)."""


class FrameChannel(Generic[T]):
    """Frames one way, bounded (thread-safe). A writer puts a batch while less than
    `capacity` waits (one batch may go past it, as one frame can be larger); a reader
    takes everything at once. A thread waits on the channel's condition; a trio task
    is woken by `on_data` (frames came to an empty channel, or it closed) and
    `on_room` (a full one was emptied, or it closed)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: deque[T] = deque()
        self.waiting = 0
        """What the items waiting count for."""
        self.closed = False
        self._changed = threading.Condition(threading.Lock())
        self.on_data: Callable[[], None] = _nothing
        self.on_room: Callable[[], None] = _nothing

    def put(self, items: list[T], cost: int) -> bool | None:
        """Queue `items` (which count for `cost`): True; False if the channel is full
        (wait for `on_room`, or use `put_by`); None once it is closed."""
        return self.put_by(items, cost, 0.0)

    def put_by(self, items: list[T], cost: int, deadline: float) -> bool | None:
        """`put`, waiting for room until `deadline` (monotonic): True; False if it
        stayed full; None once closed."""
        with self._changed:
            while not self.closed and self.waiting >= self.capacity:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
            if self.closed:
                return None
            was_empty = not self._items
            self._items.extend(items)
            self.waiting += cost
            self._changed.notify_all()
        if was_empty:
            self.on_data()
        return True

    def take(self) -> list[T] | None:
        """Everything waiting (an empty list if nothing is); None once the channel is
        closed and nothing waits."""
        with self._changed:
            if not self._items:
                return None if self.closed else []
            items = list(self._items)
            self._items.clear()
            was_full = self.waiting >= self.capacity
            self.waiting = 0
            self._changed.notify_all()
        if was_full:
            self.on_room()
        return items

    def take_wait(self, timeout: float | None) -> list[T] | None:
        """`take`, waiting up to `timeout` seconds (None: for good) for something to
        come; `TimeoutError` if nothing did."""
        with self._changed:
            if not self._changed.wait_for(lambda: self._items or self.closed, timeout):
                raise TimeoutError("nothing came from the node in time")
        return self.take()

    def close(self) -> None:
        """No more frames either way; the reader still takes what waits. Idempotent."""
        with self._changed:
            if self.closed:
                return
            self.closed = True
            self._changed.notify_all()
        self.on_data()
        self.on_room()


def _nothing() -> None:
    pass


class TrioEnd:
    """One side of an in-process connection in a trio loop: the node's, or the trio
    client's. `receive` and `send` are its `receive_some` and `send_all`; call it only
    from the loop it was made in."""

    def __init__(
        self,
        incoming: FrameChannel[Any],
        outgoing: FrameChannel[Any],
        token: trio.lowlevel.TrioToken,
    ) -> None:
        self._incoming = incoming
        self._outgoing = outgoing
        self._token = token
        self._readable = trio.Event()
        self._writable = trio.Event()
        self._pending: deque[Any] = deque()
        """`receive_frame` only: what came and was not returned yet."""
        incoming.on_data = self._soon(self._set_readable)
        outgoing.on_room = self._soon(self._set_writable)

    def _soon(self, call: Callable[[], None]) -> Callable[[], None]:
        """`call` on this end's loop (the other side may run in another thread)."""

        def wake() -> None:
            with contextlib.suppress(trio.RunFinishedError):
                self._token.run_sync_soon(call)

        return wake

    def _set_readable(self) -> None:
        self._readable.set()  # the event of the moment: `receive` makes a new one each time

    def _set_writable(self) -> None:
        self._writable.set()

    async def receive(self) -> list[Any]:
        """What the other side sent (at least one item), or [] once it closed."""
        while True:
            self._readable = trio.Event()
            items = self._incoming.take()
            if items is None:
                await trio.lowlevel.checkpoint()
                return []
            if items:
                await trio.lowlevel.checkpoint()
                return items
            await self._readable.wait()

    async def receive_frame(self) -> Frame | None:
        """The next frame (`quorumq.client.aio.Link`): the trio client's end reads them
        one at a time; None once the connection is closed."""
        if not self._pending:
            self._pending.extend(await self.receive())
            if not self._pending:
                return None
        frame: Frame = self._pending.popleft()
        return frame

    async def send(self, items: list[Any], cost: int) -> None:
        """Hand `items` over, once there is room; `trio.BrokenResourceError` once the
        connection is closed."""
        while True:
            self._writable = trio.Event()
            put = self._outgoing.put(items, cost)
            if put is None:
                raise trio.BrokenResourceError("the in-process connection is closed")
            if put:
                await trio.lowlevel.checkpoint()
                return
            await self._writable.wait()

    async def send_frame(self, frame: Frame) -> None:
        """A client's frame to the node: copied, with its size (`copy_frame`)."""
        copy, size = copy_frame(frame)
        await self.send([(copy, size)], size)

    def close(self) -> None:
        """End the connection, both ways (idempotent)."""
        self._incoming.close()
        self._outgoing.close()

    async def aclose(self) -> None:
        self.close()
        await trio.lowlevel.checkpoint()


class ThreadEnd:
    """The blocking client's side of an in-process connection: what it needs of a
    connection (`quorumq.client.wire.Link`), over the channels."""

    def __init__(
        self, incoming: FrameChannel[Frame], outgoing: FrameChannel[SizedFrame], timeout: float
    ) -> None:
        """`timeout`: how long a read may wait until `serve` (the handshake's)."""
        self._incoming = incoming
        self._outgoing = outgoing
        self._timeout: float | None = timeout
        self._pending: deque[Frame] = deque()

    def frames(self) -> Iterator[Frame]:
        """The node's frames, as they come; ends once the connection is closed. (What
        came and was not yet yielded waits for the next call: the handshake reads two
        frames, then the reader the rest.)"""
        pending = self._pending
        while True:
            while pending:
                yield pending.popleft()
            items = self._incoming.take_wait(self._timeout)
            if items is None:
                return
            pending.extend(items)

    def send_frame_by(self, frame: Frame, deadline: float) -> type[OSError] | None:
        """Hand `frame` to the node by `deadline` (monotonic): None once handed over;
        `TimeoutError` if the node took nothing until then, `OSError` once closed (as
        `Wire.send_by`). `TypeError` for a frame msgpack could not encode either."""
        copy, size = copy_frame(frame)
        put = self._outgoing.put_by([(copy, size)], size, deadline)
        if put is None:
            return OSError
        return None if put else TimeoutError

    def serve(self) -> None:
        """The handshake is over: reads wait for as long as it takes."""
        self._timeout = None

    def hang_up(self) -> None:
        """End the connection, both ways: the node sees it closed (idempotent)."""
        self._incoming.close()
        self._outgoing.close()


def open_connection(
    token: trio.lowlevel.TrioToken,
) -> tuple[TrioEnd, FrameChannel[Frame], FrameChannel[SizedFrame]]:
    """A new in-process connection: the node's end (in the loop of `token`), and the
    channels for the client's end (`ThreadEnd` or `TrioEnd` over them): frames to the
    client, and sized frames to the node."""
    to_node: FrameChannel[SizedFrame] = FrameChannel(TO_NODE_BYTES)
    to_client: FrameChannel[Frame] = FrameChannel(TO_CLIENT_BYTES)
    return TrioEnd(to_node, to_client, token), to_client, to_node
