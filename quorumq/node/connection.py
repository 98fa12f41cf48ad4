"""One client connection's state in the node core: the frames it has sent that are not
handled yet, the frames waiting to go out to it, its consumers, and its bounds.

It does no I/O. The node core (`NodeCore`) feeds it bytes and decides what each frame
means; the shell takes the bytes to write (`take_output`), writes them, and says so
(`NodeCore.sent`). What a connection makes the node hold is bounded in bytes: outgoing
frames are counted in encoded bytes plus `FRAME_COST` each; past `pause_bytes` of them,
or past `PROPOSING_BYTES` of its commands proposed and not answered, the node handles
no more of its requests and reads nothing more from it (`wants_data`), so requests wait
in the client's socket, not in the node. A client with more than `outbound_bytes`
waiting (or more frames than `outbound_frames` plus its consumers' prefetch) does not
read: it is cut off as a slow consumer.

An in-process connection (`local`: a client in the node's own process, `quorumq.Node`)
carries frames, not bytes, both ways, under every rule and bound above. Its frames in
come as copies with their sizes (`protocol.copy_frame`), checked as decoded frames are
(`FrameQueue`); its frames out are copied as they are queued, so the client's frames
share nothing with the replica's state, and each counts for its estimated encoded size
(at least msgpack's) plus `FRAME_COST`. Such a client is trusted: it needs no token.
"""

from __future__ import annotations

import collections
import logging
import os

from .. import pathtiming
from ..wire.protocol import Frame, FrameDecoder, FrameQueue, copy_frame, encode_frame
from .deliveries import SentDeliveries

logger = logging.getLogger(__name__)

HELLO_FRAME_LIMIT = 4096
"""The largest frame a peer may send before its `hello` is accepted: an unauthenticated
peer could make a node buffer a full frame (max body + 64 KiB) per connection."""
FRAME_COST = 128
"""Bytes a queued frame costs the node besides its encoding (the bytes object, the
queue's slot): 20,000 tiny frames are not free."""
PAUSE_FRACTION = 4
"""Requests wait while more than `outbound_bytes // PAUSE_FRACTION` bytes wait to go out."""
PROPOSING_BYTES = 8 * 1024 * 1024
"""Requests wait while more than this many bytes of one connection's commands are
proposed and not answered (500 pipelined publishes of 512 KiB grew a node by 572 MiB)."""


def _timed_step(frame: Frame) -> tuple[str, int] | None:
    """Path timing: ("confirm" or "deliver", offset) of a frame, or None; marked queued."""
    offset = frame.get("offset")
    if not isinstance(offset, int):
        return None
    kind = "deliver" if frame["t"] == "deliver" else "confirm" if frame["t"] == "reply" else None
    if kind is None:
        return None
    pathtiming.mark(f"node.{kind}.queued", ("o", offset))
    return kind, offset


class ConnectionCore:
    """A client connection, as the node core sees it."""

    def __init__(
        self,
        number: int,
        *,
        max_frame: int,
        outbound_bytes: int,
        outbound_frames: int,
        local: bool = False,
    ) -> None:
        """`local`: a client in the node's own process, whose frames travel as they are
        (see the module's docstring)."""
        self.number = number
        self.local = local
        self.frame_limit = max_frame
        """The largest frame the peer may send once it has said `hello`."""
        self.decoder: FrameDecoder | FrameQueue = (
            FrameQueue(HELLO_FRAME_LIMIT) if local else FrameDecoder(HELLO_FRAME_LIMIT)
        )
        """Before `hello` a peer may send only small frames; the full limit after it."""
        self.outbox: collections.deque[bytes] | collections.deque[Frame] = collections.deque()
        """Frames waiting to be taken by the shell: encoded, or (`local`) copies."""
        self._sizes: collections.deque[int] = collections.deque()
        """`local` only: what each outbox frame counts for, encoded."""
        self._timed: collections.deque[tuple[str, int] | None] = collections.deque()
        """Path timing only: the confirm or delivery each outbox frame is (or None)."""
        self._taken_timed: list[tuple[str, int] | None] = []
        self.queued = 0
        """Frames waiting to be sent (in the outbox, or taken and not yet written)."""
        self.queued_bytes = 0
        """What they cost: their encoded bytes plus `FRAME_COST` each."""
        self.outbound_bytes = outbound_bytes
        self.outbound_frames = outbound_frames
        self.pause_bytes = outbound_bytes // PAUSE_FRACTION
        self.proposing_bytes = 0
        """What this connection's commands proposed and not yet answered count for
        (bodies plus `PROPOSAL_COST` each; subscribes, bounded by `max_consumers`, and
        acks, gathered per read, count nothing)."""
        self.prefetches: dict[str, int] = {}
        """Each consumer's prefetch, while it is here."""
        self.prefetch_allowance = 0
        """Sum of `prefetches`: that many deliveries may wait for a slow reader."""
        self.consumers: dict[str, str] = {}
        """consumer id -> queue, for consumers of this connection."""
        self.awaiting_reply: dict[str, list[Frame]] = {}
        """Deliveries to consumers whose subscribe reply is not sent yet (they follow it)."""
        self.subscribe_requests: dict[str, int] = {}
        """Request id of each subscribe not answered yet, by consumer."""
        self.cancelling: set[str] = set()
        """Consumers the client cancelled (they may still ack what they hold)."""
        self._sent: dict[str, SentDeliveries] = {}
        """Per consumer, what it was sent and may still hold: after a snapshot load the
        node sends what the machine says it holds and was not sent (`quorumq.node.deliveries`)."""
        self.nonce = os.urandom(16)
        self.greeted = False
        self.admin = False
        """The peer proved the admin token at hello (or the node needs none)."""
        self.consumer_counter = 0
        self.closing = False
        """The node ends this connection: the shell writes what is queued, then closes."""
        self.aborted = False
        """The node ends it at once: the shell closes without writing what is queued."""
        self.closed = False
        """The shell reported the connection gone (`NodeCore.connection_lost`)."""
        self.close_reason = ""
        self.transport: object = None
        """The shell's handle of this connection (a trio stream, a simulated socket)."""

    # --------------------------------------------------------------- outgoing

    @property
    def done(self) -> bool:
        """No more frames are taken for it."""
        return self.closing or self.aborted or self.closed

    def push(self, frame: Frame) -> bool:
        """Queue `frame` to send; False if it was not (the connection is ending, or this
        frame made it a slow consumer: it is then closing)."""
        if self.done:
            return False
        if self.local:
            item, size = copy_frame(frame)
        else:
            item = encode_frame(frame)
            size = len(item)
        cost = size + FRAME_COST
        limit = self.outbound_frames + self.prefetch_allowance
        if self.queued >= limit or self.queued_bytes + cost > self.outbound_bytes:
            self.close(
                f"slow consumer: {self.queued} frames, {self.queued_bytes} bytes waiting to be sent"
            )
            return False
        self.queued += 1
        self.queued_bytes += cost
        self.outbox.append(item)  # (bytes, or frames if local)
        if self.local:
            self._sizes.append(size)
        if pathtiming.ENABLED:
            self._timed.append(_timed_step(frame))
        return True

    def take_output(self, most: int) -> tuple[bytes | list[Frame], int, int]:
        """(what to write, frames, what they cost): queued frames, about `most` bytes
        (at least one frame), joined into bytes, or (`local`) a list of them. Give
        `sent(frames, cost)` back once written."""
        if self.local:
            return self._take_frames(most)
        chunks: list[bytes] = []
        size = 0
        outbox: collections.deque[bytes] = self.outbox  # type: ignore[assignment]
        while outbox and (not chunks or size + len(outbox[0]) <= most):
            chunk = outbox.popleft()
            chunks.append(chunk)
            size += len(chunk)
        if pathtiming.ENABLED:
            self._taken_timed += [self._timed.popleft() for _ in chunks]
        return b"".join(chunks), len(chunks), size + FRAME_COST * len(chunks)

    def _take_frames(self, most: int) -> tuple[list[Frame], int, int]:
        frames: list[Frame] = []
        size = 0
        outbox: collections.deque[Frame] = self.outbox  # type: ignore[assignment]
        sizes = self._sizes
        while outbox and (not frames or size + sizes[0] <= most):
            frames.append(outbox.popleft())
            size += sizes.popleft()
        if pathtiming.ENABLED:
            self._taken_timed += [self._timed.popleft() for _ in frames]
        return frames, len(frames), size + FRAME_COST * len(frames)

    def drop_outbox(self) -> None:
        """Forget what waits to be taken: the connection ends without sending it."""
        self.outbox.clear()
        self._sizes.clear()

    def sent(self, frames: int, cost: int) -> None:
        """The shell wrote `frames` frames taken together, which cost `cost`."""
        self.queued -= frames
        self.queued_bytes -= cost
        if pathtiming.ENABLED:
            written, self._taken_timed = self._taken_timed[:frames], self._taken_timed[frames:]
            for timed in written:
                if timed is not None:
                    pathtiming.mark(f"node.{timed[0]}.written", ("o", timed[1]))

    @property
    def full(self) -> bool:
        """Too much waits to be sent, or to be committed: handle no more requests."""
        return self.queued_bytes > self.pause_bytes or self.proposing_bytes > PROPOSING_BYTES

    @property
    def wants_data(self) -> bool:
        """Whether the shell should read more from the client now."""
        return not self.done and not self.full

    def close(self, reason: str) -> None:
        """Take no more frames; the shell sends what is queued, then closes."""
        if not self.done:
            logger.info("closing client connection %d: %s", self.number, reason)
            self.close_reason = reason
        self.closing = True

    def abort(self, reason: str) -> None:
        """Close at once, without sending what is queued."""
        self.close(reason)
        self.aborted = True
        self.drop_outbox()

    # -------------------------------------------------------------- consumers

    def sent_to(self, consumer: str) -> SentDeliveries:
        """What `consumer` of this connection was sent and may still hold."""
        sent = self._sent.get(consumer)
        if sent is None:
            sent = self._sent[consumer] = SentDeliveries()
        return sent

    def drop_consumer(self, consumer: str) -> None:
        """`consumer` is gone from this connection."""
        self.consumers.pop(consumer, None)
        self.awaiting_reply.pop(consumer, None)
        self.prefetch_allowance -= self.prefetches.pop(consumer, 0)
        self.subscribe_requests.pop(consumer, None)
        self.cancelling.discard(consumer)
        self._sent.pop(consumer, None)
