"""One client connection: frames in, commands to the replica, replies and deliveries out.

Every handler is synchronous and non-blocking: it proposes a command (the reply comes
back later through the node's trio token) or answers from the local replica. The only
awaits are in the reader (`receive_some`, and waiting for room in the outbox) and the
writer (`send_all`).

What a connection makes the node hold is bounded in bytes. Outgoing frames wait in the
outbox, counted in encoded bytes plus `FRAME_COST` each. While more than a quarter of
the node's `outbound_bytes` waits, the reader handles no further request and reads
nothing more from the socket (back-pressure: requests wait in the client's socket,
not in the node); a waiting read answers only once there is room. The same holds
while more than `PROPOSING_BYTES` of its commands are proposed and not yet answered: a
client that pipelines publishes faster than the cluster commits them waits, rather
than fill the Raft queue. What still arrives unasked, deliveries and proposals'
replies, is bounded by the consumers' prefetch and by the requests already read; a
client with more than `outbound_bytes` waiting (or more frames than `outbound_frames`
plus its consumers' prefetch) does not read: it is cut off as a slow consumer, its
consumers are downed and their messages return to the queue. A connection has at most
`max_consumers` consumers.

Publishes from one client that arrive together for the same queue and producer, with
consecutive sequence numbers, are proposed as one `EnqueueBatch` (one log entry).
Resent publishes (`retry`) are proposed alone, so a retry never overlaps a batch.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

import trio

from ..deliveries import SentDeliveries
from ..machine import (
    Ack,
    Cancel,
    Command,
    CommitOffset,
    Declare,
    Enqueue,
    EnqueueBatch,
    Enqueued,
    Error,
    ForgetProducers,
    Forgotten,
    Message,
    Nack,
    QueueOptions,
    Reply,
    Subscribe,
    UnknownQueueError,
)
from ..protocol import (
    PROTOCOL_VERSION,
    Frame,
    FrameDecoder,
    ProtocolError,
    encode_frame,
    proof_matches,
)
from ..replica import AuditBusyError, AuditFailedError, NotAppliedError, ProposalError

if TYPE_CHECKING:
    from .node import NodeServer

logger = logging.getLogger(__name__)

RECEIVE_CHUNK = 256 * 1024
CLOSE_FLUSH_SECONDS = 5.0
"""How long a closing connection may take to send what it has queued."""
HELLO_FRAME_LIMIT = 4096
"""The largest frame a peer may send before its `hello` is accepted: an unauthenticated
peer could make a node buffer a full frame (max body + 64 KiB) per connection."""
FRAME_COST = 128
"""Bytes a queued frame costs the node besides its encoding (the bytes object, the
channel's slot): 20,000 tiny frames are not free."""
WRITE_BYTES = 1024 * 1024
"""The writer joins queued frames into one write of about this many bytes at most."""
PAUSE_FRACTION = 4
"""Requests wait while more than `outbound_bytes // PAUSE_FRACTION` bytes wait to go out."""
PROPOSING_BYTES = 8 * 1024 * 1024
"""Requests wait while more than this many bytes of one connection's commands are
proposed and not answered (500 pipelined publishes of 512 KiB grew a node by 572 MiB)."""
PROPOSAL_COST = 256
"""What a proposal counts for besides its messages' bodies."""
READ_REPLY_BYTES = 768 * 1024
"""A `read` reply carries about this many bytes of messages at most (one larger message
goes alone), so it stays within the clients' frame limit; the client asks again."""
READ_SPAN = 8192
"""Offsets one `read` reply looks at: bounds how long a read holds the replica's lock."""
READ_ROW_OVERHEAD = 32
"""Bytes a row costs in a reply besides its body, key and headers (a generous guess)."""
MAX_READ_WAIT_MS = 30_000
"""The longest a `read` may ask its node to wait for the replica to apply its range."""


class ClosingError(Exception):
    """The connection is going away (fatal protocol error, slow consumer, auth failure)."""


class MembershipError(Exception):
    """A membership change the node refuses or could not complete; `code` says why."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


MIN_FORGET_PREFIX = 12
"""The shortest producer prefix a client may forget without the admin credential."""
MAX_WAITING_READS = 64
"""Reads with `wait_ms` one connection may have waiting (each is a task for up to 30 s)."""
GATHER_BYTES = 1024 * 1024
"""Most body bytes of consecutive publishes gathered into one `EnqueueBatch` entry (a log
entry holds at most `MAX_COMMAND_BYTES`; four pipelined 1 MiB publishes exceeded it and
crashed the connection, which the client then resent to for ever)."""


class Connection:
    def __init__(self, node: NodeServer, stream: trio.abc.Stream, number: int) -> None:
        self.node = node
        self.stream = stream
        self.number = number
        self.frame_limit = node.config.max_body + 64 * 1024
        self.decoder = FrameDecoder(HELLO_FRAME_LIMIT)
        """Before `hello` a peer may send only small frames; the full limit after it."""
        self.outbox_send, self.outbox_receive = trio.open_memory_channel[bytes](math.inf)
        self.queued = 0
        """Frames waiting to be sent."""
        self.queued_bytes = 0
        """What they cost: their encoded bytes plus `FRAME_COST` each."""
        self.outbound_bytes = node.config.outbound_bytes
        self.pause_bytes = node.config.outbound_bytes // PAUSE_FRACTION
        self.proposing_bytes = 0
        """What this connection's commands proposed and not yet answered count for
        (bodies plus `PROPOSAL_COST` each; subscribes, bounded by `max_consumers`, and
        acks, gathered per read, count nothing)."""
        self._room = trio.lowlevel.ParkingLot()
        """Where tasks wait for room (`_until_room`): the reader, and reads due to answer."""
        self.prefetches: dict[str, int] = {}
        """Each consumer's prefetch, while it is here."""
        self.prefetch_allowance = 0
        """Sum of `prefetches`: that many deliveries may wait for a slow reader."""
        self.waiting_reads = 0
        """Reads with `wait_ms` waiting to be applied (at most `MAX_WAITING_READS`)."""
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
        node sends what the machine says it holds and was not sent (`quorumq.deliveries`)."""
        self.nonce = os.urandom(16)
        self.greeted = False
        self.admin = False
        """The peer proved the admin token at hello (or the node needs none)."""
        self._scope = trio.CancelScope()
        """Everything this connection runs: `evict` cancels it."""
        self.reading = trio.CancelScope()
        self._hello_deadline = trio.CancelScope()
        self.closed = False
        self.close_reason = ""
        self._consumer_counter = 0
        self._nursery: trio.Nursery | None = None
        """Runs this connection's tasks: the writer, and reads waiting for the replica."""

    # ------------------------------------------------------------------ tasks

    async def run(self) -> None:
        """Serve the connection until either side ends it. Nothing that happens here
        may take the node down: an unexpected error closes this connection only."""
        self.push(
            {
                "t": "welcome",
                "v": PROTOCOL_VERSION,
                "node": self.node.node_id,
                "nonce": self.nonce,
                "auth": self.node.config.token is not None,
                "max_body": self.node.config.max_body,
                "max_frame": self.frame_limit,
            }
        )
        try:
            with self._scope:
                await self._serve()
        except Exception:
            logger.exception("client connection %d failed; closing it", self.number)
        finally:
            self.closed = True
            self.node.forget(self)
            with trio.CancelScope(shield=True):  # the writer closes it, if it got to run
                await self.stream.aclose()

    async def _serve(self) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._writer)
            nursery.start_soon(self._close_without_hello)
            try:
                with self.reading:
                    await self._reader()
            finally:
                self.close(self.close_reason or "the client went away")
                self._hello_deadline.cancel()  # it kept a closed connection for 5 s
                # the writer flushes what is queued (an error frame, say), then ends
                nursery.cancel_scope.deadline = trio.current_time() + CLOSE_FLUSH_SECONDS

    def evict(self) -> None:
        """Close at once, without sending what is queued: a newer connection needs this
        one's place (it has not said `hello`, so it holds nothing of a client's)."""
        self.close("evicted: too many connections have not said hello")
        self._scope.cancel()

    async def _close_without_hello(self) -> None:
        """A peer that has not said `hello` within the handshake deadline is dropped: a
        silent unauthenticated connection stayed open for good."""
        with self._hello_deadline:
            await trio.sleep(self.node.config.handshake_timeout_s)
        if not self.greeted and not self.closed:
            self.error(None, "hello_timeout", "no hello within the handshake deadline")
            self.close("no hello in time")
            assert self._nursery is not None
            self._nursery.cancel_scope.deadline = trio.current_time() + CLOSE_FLUSH_SECONDS
            self.reading.cancel()

    async def _reader(self) -> None:
        """Handle the frames received, and receive more, while the outbox has room: a
        client that pipelines requests and reads no replies (say 20,000 reads of 768 KiB
        each) stops being read, rather than fill the node's memory."""
        while not self.closed:
            await self._until_room()
            try:
                if not self._handle_available():
                    continue  # stopped for room: the rest of the buffer waits
            except ClosingError:
                return
            try:
                data = await self.stream.receive_some(RECEIVE_CHUNK)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return
            if not data:
                return
            self.decoder.feed(data)

    def _full(self) -> bool:
        """Too much waits to be sent, or to be committed: handle no more requests."""
        return self.queued_bytes > self.pause_bytes or self.proposing_bytes > PROPOSING_BYTES

    async def _until_room(self) -> None:
        """Wait until the connection is not `_full` (or it closes)."""
        while self._full() and not self.closed:
            await self._room.park()

    def answered(self, cost: int) -> None:
        """A proposal that counted `cost` has its outcome."""
        self.proposing_bytes -= cost
        if not self._full():
            self._room.unpark_all()

    async def _writer(self) -> None:
        try:
            async for data in self.outbox_receive:
                chunks = [data]
                size = len(data)
                while size < WRITE_BYTES:
                    try:
                        chunk = self.outbox_receive.receive_nowait()
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
                    chunks.append(chunk)
                    size += len(chunk)
                await self.stream.send_all(b"".join(chunks))
                self.queued -= len(chunks)
                self.queued_bytes -= size + FRAME_COST * len(chunks)
                if not self._full():
                    self._room.unpark_all()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            self.closed = True
            self._room.unpark_all()  # a reader waiting for room would wait for good
            with trio.CancelScope(shield=True):
                await self.stream.aclose()

    # --------------------------------------------------------------- outgoing

    def push(self, frame: Frame) -> None:
        """Queue a frame to send. A client that does not read is cut off (its consumers
        are then down and their messages return to the queue) once this frame would make
        more than `outbound_bytes` wait, or more frames than its consumers' prefetch
        allows plus `outbound_frames`."""
        if self.closed:
            return
        data = encode_frame(frame)
        cost = len(data) + FRAME_COST
        limit = self.node.config.outbound_frames + self.prefetch_allowance
        if self.queued >= limit or self.queued_bytes + cost > self.outbound_bytes:
            self.close(
                f"slow consumer: {self.queued} frames, {self.queued_bytes} bytes waiting to be sent"
            )
            return
        self.queued += 1
        self.queued_bytes += cost
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            self.outbox_send.send_nowait(data)

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

    def close(self, reason: str) -> None:
        """Take no more frames; the writer sends what is queued and closes the stream."""
        if not self.closed:
            logger.info("closing client connection %d: %s", self.number, reason)
            self.closed = True
            self.close_reason = reason
        self.outbox_send.close()
        self._room.unpark_all()  # whoever waits for room: there will be none

    def reply(self, request_id: int, reply: Reply | None, error: ProposalError | None) -> None:
        """A proposal's outcome, on the trio thread."""
        if error is not None:
            code = "not_applied" if isinstance(error, NotAppliedError) else "outcome_unknown"
            self.push({"t": "error", "id": request_id, "code": code, "message": str(error)})
        elif isinstance(reply, Error):
            self.push(
                {
                    "t": "error",
                    "id": request_id,
                    "code": reply.code.value,
                    "message": reply.message,
                    "expected_seq": reply.expected_seq,
                }
            )
        else:
            self.push({"t": "reply", "id": request_id, **_reply_fields(reply)})

    def error(self, request_id: int | None, code: str, message: str) -> None:
        self.push({"t": "error", "id": request_id, "code": code, "message": message})

    # --------------------------------------------------------------- incoming

    def _handle_available(self) -> bool:
        """Handle the complete frames received. False: it stopped early because the
        connection is `_full` (the frames left wait in the decoder's buffer)."""
        publishes: list[Frame] = []
        acks: dict[tuple[str, bool, bool], list[int]] = {}
        handled_all = True
        while True:
            try:
                for frame in self.decoder.frames():
                    kind = frame["t"]
                    if not self.greeted:
                        self._hello(frame)
                    elif kind == "publish":
                        self._gather_publish(publishes, frame)
                    elif kind in ("ack", "nack"):
                        self._flush_publishes(publishes)
                        self._gather_ack(acks, frame)
                    else:
                        self._flush_publishes(publishes)
                        self._flush_acks(acks)
                        self._handle(frame)
                    if self._full():
                        handled_all = False
                        break
                break
            except ProtocolError as e:
                self.error(e.request_id, e.code, e.message)
                # Before hello every protocol error is fatal: an unauthenticated peer got
                # an error frame per garbage frame (20,000 five-byte frames queued 1.6 MB).
                if e.fatal or not self.greeted:
                    self.close(f"protocol error: {e.message}")
                    raise ClosingError from None
                if self._full():
                    handled_all = False
                    break
        self._flush_publishes(publishes)
        self._flush_acks(acks)
        return handled_all

    def _hello(self, frame: Frame) -> None:
        if frame["t"] != "hello":
            self.error(frame.get("id"), "hello_first", "the first frame must be hello")
            self.close("no hello")
            raise ClosingError
        if frame["v"] != PROTOCOL_VERSION:
            self.error(None, "version", f"this node speaks protocol {PROTOCOL_VERSION}")
            self.close("protocol version mismatch")
            raise ClosingError
        token = self.node.config.token
        if token is not None and not proof_matches(token, self.nonce, frame["proof"]):
            logger.warning("client connection %d refused: wrong token", self.number)
            self.error(None, "auth_failed", "wrong token")
            self.close("authentication failed")
            raise ClosingError
        admin_token = self.node.config.admin_token
        admin_proof = frame.get("admin_proof")
        self.admin = self.node.open_admin or (
            admin_token is not None
            and isinstance(admin_proof, bytes)
            and proof_matches(admin_token, self.nonce, admin_proof)
        )
        if admin_proof is not None and not self.admin:
            logger.warning("client connection %d: wrong admin token", self.number)
        self.greeted = True
        self.node.greeted(self)
        self.decoder.max_frame = self.frame_limit
        self.push({"t": "reply", "id": 0, "node": self.node.node_id})

    def _propose(self, request_id: int, command: Command, cost: int = PROPOSAL_COST) -> None:
        self.proposing_bytes += cost
        self.node.propose(command, self, request_id, cost=cost)

    def _handle(self, frame: Frame) -> None:
        kind = frame["t"]
        rid: int = frame.get("id", 0)
        handler = _HANDLERS.get(kind)
        if handler is None:
            self.error(frame.get("id"), "unexpected_frame", f"a client does not send {kind!r}")
            return
        try:
            handler(self, frame)
        except (TypeError, ValueError) as e:
            self.error(rid, "invalid", str(e))

    def _declare(self, frame: Frame) -> None:
        options = frame["options"]
        if any(not isinstance(k, str) for k in options):
            raise ValueError("option names must be strings")
        self._propose(frame["id"], Declare(queue=frame["queue"], options=QueueOptions(**options)))

    def _check_body(self, frame: Frame, body: bytes) -> bool:
        limit = self.node.config.max_body
        if len(body) > limit:
            self.error(
                frame["id"], "too_large", f"message body of {len(body)} bytes exceeds {limit}"
            )
            return False
        return True

    def _gather_publish(self, publishes: list[Frame], frame: Frame) -> None:
        if not self._check_body(frame, frame["body"]):
            return
        if publishes:
            last = publishes[-1]
            gathered = sum(len(f["body"]) for f in publishes)
            joinable = (
                gathered + len(frame["body"]) <= GATHER_BYTES  # one log entry holds them
                and not frame.get("retry")
                and last["queue"] == frame["queue"]
                and last["producer"] == frame["producer"]
                and frame["seq"] is not None
                and last["seq"] is not None
                and frame["seq"] == last["seq"] + 1
            )
            if not joinable:
                self._flush_publishes(publishes)
        publishes.append(frame)
        if frame.get("retry"):
            self._flush_publishes(publishes)

    def _flush_publishes(self, publishes: list[Frame]) -> None:
        if not publishes:
            return
        frames = list(publishes)
        publishes.clear()
        first = frames[0]
        try:
            if len(frames) == 1:
                command: Command = Enqueue(
                    queue=first["queue"],
                    body=first["body"],
                    key=first["key"],
                    headers=first["headers"],
                    producer=first["producer"],
                    seq=first["seq"],
                )
            else:
                command = EnqueueBatch(
                    queue=first["queue"],
                    messages=[
                        Message(body=f["body"], key=f["key"], headers=f["headers"]) for f in frames
                    ],
                    producer=first["producer"],
                    first_seq=first["seq"],
                )
        except (TypeError, ValueError) as e:
            for f in frames:
                self.error(f["id"], "invalid", str(e))
            return
        ids = [f["id"] for f in frames]
        cost = sum(len(f["body"]) + PROPOSAL_COST for f in frames)
        self.proposing_bytes += cost
        self.node.propose_publishes(command, self, ids, cost)

    def _publish_batch(self, frame: Frame) -> None:
        messages = []
        for m in frame["messages"]:
            if not isinstance(m, list) or len(m) != 3:
                raise ValueError("each message must be [body, key, headers]")
            if not self._check_body(frame, m[0]):
                return
            messages.append(Message(body=m[0], key=m[1], headers=m[2]))
        command = EnqueueBatch(
            queue=frame["queue"],
            messages=messages,
            producer=frame["producer"],
            first_seq=frame["first_seq"],
        )
        self._propose(frame["id"], command, sum(len(m.body) + PROPOSAL_COST for m in messages))

    def _subscribe(self, frame: Frame) -> None:
        limit = self.node.config.max_consumers
        if len(self.consumers) >= limit:  # cancelled ones count until they hold nothing
            self.error(
                frame["id"],
                "too_many_consumers",
                f"a connection may have {limit} consumers at most (cancelled ones count "
                "until their messages are settled): cancel some, or open another connection",
            )
            return
        self._consumer_counter += 1
        consumer = f"{self.node.consumer_prefix}{self.number}.{self._consumer_counter}"
        queue = frame["queue"]
        command = Subscribe(  # checked (prefetch at most 65,535) before anything is kept
            queue=queue,
            consumer=consumer,
            node=self.node.node_id,
            prefetch=frame["prefetch"],
            timeout_ms=frame.get("timeout_ms"),
        )
        self.consumers[consumer] = queue
        self.awaiting_reply[consumer] = []
        self.subscribe_requests[consumer] = frame["id"]
        self.prefetches[consumer] = command.prefetch
        self.prefetch_allowance += command.prefetch
        self.node.consumers[consumer] = self
        self.node.propose(command, self, frame["id"], consumer=consumer)

    def _cancel(self, frame: Frame) -> None:
        consumer = frame["consumer"]
        queue = self.consumers.get(consumer)
        if queue is None:
            self.error(frame["id"], "unknown_consumer", f"no consumer {consumer!r} here")
            return
        self.cancelling.add(consumer)
        self._propose(frame["id"], Cancel(queue=queue, consumer=consumer))

    def _gather_ack(self, acks: dict[tuple[str, bool, bool], list[int]], frame: Frame) -> None:
        consumer = frame["consumer"]
        if consumer not in self.consumers:
            self.error(None, "unknown_consumer", f"no consumer {consumer!r} on this connection")
            return
        offsets = frame["offsets"]
        if not all(type(o) is int and o >= 0 for o in offsets):
            self.error(None, "invalid", "offsets must be non-negative integers")
            return
        nack = frame["t"] == "nack"
        acks.setdefault((consumer, nack, bool(frame.get("requeue"))), []).extend(offsets)

    def _flush_acks(self, acks: dict[tuple[str, bool, bool], list[int]]) -> None:
        for (consumer, nack, requeue), offsets in acks.items():
            queue = self.consumers.get(consumer)
            if queue is None:
                continue
            command: Ack | Nack
            if nack:
                command = Nack(queue=queue, consumer=consumer, offsets=offsets, requeue=requeue)
            else:
                command = Ack(queue=queue, consumer=consumer, offsets=offsets)
            self.node.settle(command, self)
        acks.clear()

    def _read(self, frame: Frame) -> None:
        """Stream view rows of [start, end) (in a key bucket), from this node's replica.

        Everything a replica has applied is committed, so a read never sees uncommitted
        data. Without `wait_ms` the reply covers what this replica has applied so far.
        With `wait_ms` the caller says the whole range is committed (it learned `end`
        from some node): a replica that lags waits for it, on a trio task, polling the
        machine, so neither the trio loop nor the Raft thread blocks; past the wait it
        answers `lagging`, and the client asks another node. It never answers part of
        the range in that case.
        """
        start, end = frame["start"], frame["end"]
        bucket, buckets = frame["bucket"], frame["buckets"]
        wait_ms = frame.get("wait_ms")
        if start < 0 or end < start:
            raise ValueError(f"read range [{start}, {end}) is not a range of offsets")
        if (bucket is None) != (buckets is None):
            raise ValueError("bucket and buckets go together")
        if buckets is not None and not 0 <= bucket < buckets:
            raise ValueError(f"bucket must be in [0, {buckets}), got {bucket}")
        if wait_ms is not None and (
            type(wait_ms) is not int or not 0 <= wait_ms <= MAX_READ_WAIT_MS
        ):
            raise ValueError(f"wait_ms must be an integer from 0 to {MAX_READ_WAIT_MS}")
        if wait_ms is None or self._applied_end(frame["queue"]) >= end:
            self._answer_read(frame)
        elif self.waiting_reads >= MAX_WAITING_READS:
            self.error(
                frame["id"],
                "too_many_reads",
                f"{MAX_WAITING_READS} reads already wait on this connection; wait for them",
            )
        else:
            assert self._nursery is not None
            self.waiting_reads += 1
            self._nursery.start_soon(self._read_when_applied, frame, wait_ms)

    def _applied_end(self, queue: str) -> int:
        """The offset after the last message this replica has applied to `queue`; -1
        when it has not applied the queue's declaration (yet)."""
        try:
            return self.node.replica.query(lambda m: m.stats(queue).next_offset)
        except UnknownQueueError:
            return -1

    async def _read_when_applied(self, frame: Frame, wait_ms: int) -> None:
        try:
            await self._wait_and_read(frame, wait_ms)
        finally:
            self.waiting_reads -= 1

    async def _wait_and_read(self, frame: Frame, wait_ms: int) -> None:
        queue, end = frame["queue"], frame["end"]
        deadline = trio.current_time() + wait_ms / 1000
        delay = 0.001
        while (applied := self._applied_end(queue)) < end:
            if trio.current_time() >= deadline:
                if applied < 0:
                    where = f"does not know queue {queue!r}"
                else:
                    where = f"has applied {queue!r} up to offset {applied}, short of {end}"
                self.error(
                    frame["id"],
                    "lagging",
                    f"node {self.node.node_id} {where} after waiting {wait_ms} ms; "
                    "ask another node",
                )
                return
            await trio.sleep(delay)
            delay = min(2 * delay, 0.02)
        await self._until_room()  # up to 64 replies of 768 KiB could come due at once
        if not self.closed:
            self._answer_read(frame)

    def _answer_read(self, frame: Frame) -> None:
        queue, start, end = frame["queue"], frame["start"], frame["end"]
        bucket, buckets = frame["bucket"], frame["buckets"]

        def page(m: Any) -> tuple[list[tuple[Any, ...]], Any, int]:
            stats = m.stats(queue)
            limit = min(end, stats.next_offset, max(start, stats.first_retained) + READ_SPAN)
            rows: list[tuple[Any, ...]] = []
            size = 0
            for record in m.read_records(queue, start, limit, bucket, buckets):
                offset, key, body, headers = record[0], record[1], record[2], record[3]
                row_size = len(body) + READ_ROW_OVERHEAD + (len(key) if key else 0)
                if headers:
                    row_size += sum(len(k) + len(v) for k, v in headers.items())
                if rows and size + row_size > READ_REPLY_BYTES:
                    return rows, stats, offset
                rows.append(record)  # (offset, key, body, headers, ts_ms): packed as is
                size += row_size
            return rows, stats, max(start, limit)

        try:
            rows, stats, covered = self.node.replica.query(page)
        except UnknownQueueError as e:
            self.error(frame["id"], "unknown_queue", str(e))
            return
        self.push(
            {
                "t": "reply",
                "id": frame["id"],
                "messages": rows,
                "first_retained": stats.first_retained,
                "next_offset": stats.next_offset,
                "covered_until": covered,
            }
        )

    def _commit_offset(self, frame: Frame) -> None:
        command = CommitOffset(queue=frame["queue"], group=frame["group"], offset=frame["offset"])
        self._propose(frame["id"], command)

    def _forget_producers(self, frame: Frame) -> None:
        """A short prefix forgets other clients' producers too ("0".."f" forget them all,
        and a forgotten producer's resend can then be accepted as new): below
        `MIN_FORGET_PREFIX` characters it needs the admin credential. (The machine
        refuses an empty one from anyone.)"""
        prefix = frame["prefix"]
        if 0 < len(prefix) < MIN_FORGET_PREFIX and not self.admin:
            self.error(
                frame["id"],
                "admin_required",
                f"forget_producers with a prefix of {len(prefix)} characters could forget "
                f"other clients' producers: give at least {MIN_FORGET_PREFIX} (a client's "
                "producer id is 32 hex characters, a Spark batch's 'spark-<query id>-<batch>-'"
                "), or prove the admin token",
            )
            return
        command = ForgetProducers(queue=frame["queue"], prefix=prefix)
        self._propose(frame["id"], command)

    def _admin_refused(self, frame: Frame, verb: str | None = None) -> bool:
        """Membership changes the cluster, not a queue, and an audit costs the node a
        copy of its state: they need the admin credential."""
        if self.admin:
            return False
        why = (
            "this node has no admin token: start it with QUORUMQ_ADMIN_TOKEN to allow it"
            if self.node.config.admin_token is None
            else "prove the admin token (QUORUMQ_ADMIN_TOKEN, or admin_token= in the client)"
        )
        what = verb or frame["t"]
        self.error(frame["id"], "admin_required", f"{what} is an administrative verb; {why}")
        return True

    def _add_member(self, frame: Frame) -> None:
        if self._admin_refused(frame):
            return
        self._membership(frame["id"], self.node.add_member(frame["node"], frame["raft_address"]))

    def _remove_member(self, frame: Frame) -> None:
        if self._admin_refused(frame):
            return
        self._membership(frame["id"], self.node.remove_member(frame["node"]))

    def _membership(self, request_id: int, change: Coroutine[Any, Any, dict[str, str]]) -> None:
        async def run() -> None:
            try:
                members = await change
            except MembershipError as e:
                self.error(request_id, e.code, e.message)
            else:
                self.push({"t": "reply", "id": request_id, "members": members})

        assert self._nursery is not None
        self._nursery.start_soon(run)

    def _status(self, frame: Frame) -> None:
        if frame.get("audit") is True:
            # it encodes the whole state (in a child process, one audit at a time): an
            # administrative verb, or any client could keep a node busy hashing
            if self._admin_refused(frame, "status with audit"):
                return
            assert self._nursery is not None
            self._nursery.start_soon(self._audit, frame["id"])
            return
        self.push({"t": "reply", "id": frame["id"], "status": self.node.status()})

    async def _audit(self, request_id: int) -> None:
        replica = self.node.replica
        try:
            taken = await trio.to_thread.run_sync(
                lambda: replica.status(audit=True), abandon_on_cancel=True
            )
        except AuditBusyError as e:
            self.error(request_id, "audit_busy", str(e))
            return
        except AuditFailedError as e:
            self.error(request_id, "audit_failed", str(e))
            return
        self.push({"t": "reply", "id": request_id, "status": self.node.status(taken)})


def _reply_fields(reply: Reply | None) -> dict[str, Any]:
    if isinstance(reply, Enqueued):
        return {"offset": reply.offset, "count": reply.count, "duplicate": reply.duplicate}
    if isinstance(reply, Forgotten):
        return {"forgotten": reply.count}
    created = getattr(reply, "created", None)
    return {} if created is None else {"created": created}


_HANDLERS: dict[str, Callable[[Connection, Frame], None]] = {
    "declare": Connection._declare,
    "publish_batch": Connection._publish_batch,
    "subscribe": Connection._subscribe,
    "cancel": Connection._cancel,
    "read": Connection._read,
    "commit_offset": Connection._commit_offset,
    "forget_producers": Connection._forget_producers,
    "status": Connection._status,
    "add_member": Connection._add_member,
    "remove_member": Connection._remove_member,
}
