"""The node core, sans I/O: every decision a node makes towards its clients.

Inputs: client connections opened and closed, the bytes they send (`data_received`),
room to write again (`sent`), proposal outcomes (through the replica handle's
callbacks), the effects this node's replica applied (`effects_applied`), the ends of
queues it moved that reads wait on (`ends_moved`), a snapshot that replaced its state
(`state_replaced`), and the time (`run_timers`). Outputs: bytes to write to each
connection (`ConnectionCore.take_output`, with `NodeShell.wake` when there is something
to do), commands proposed to the replica, and timers (`next_timer`).
No trio, socket, thread or clock inside: the trio shell (`quorumq.server`) drives it on
a real node, the simulator (`simulations`) on its own network and clock. A rule lives
here once, and both run it.

What the core does:

* the handshake: a `welcome` with a nonce; `hello` proves the client token (and, for
  administrative verbs, the admin token) with an HMAC of it; a peer that has not said
  `hello` within the deadline, sends a larger frame than 4 KiB before it, or sends
  garbage, is closed; at most `max_unauthenticated` such peers at once (one more closes
  the oldest);
* requests to commands: publishes of one producer that arrive together, with
  consecutive sequence numbers, are proposed as one `EnqueueBatch`; acks and nacks of
  one consumer read together as one `Ack` (`Nack`); a consumer id names this run of
  this node, so a replayed delivery finds no one;
* effects to frames: a delivery to a consumer of this node is sent (after its subscribe
  reply); one to a consumer it does not have is answered with that consumer's `Down`;
  what each consumer was sent is recorded (`quorumq.deliveries`) for the resync after a
  snapshot install;
* settling again what a leader change lost: an ack or nack is proposed again after "not
  applied", and for the offsets still held after "outcome unknown" or after a refusal
  of one offset no longer held;
* `Down` for consumers the machine places on this node that no connection serves, every
  second (a `Down` lost to a leader change, consumers of an earlier run of this node);
* reads: from the local replica, waiting (`wait_ms`) for it to apply a range another
  node committed (`quorumq.node.reads`: woken when the replica moves their queue's end,
  once per batch of entries applied, and timed out from one heap of deadlines);
* membership changes (administrative), waiting for a leader and for an earlier change;
* bounds: the outbox in bytes, requests that wait while it is full (back-pressure),
  consumers per connection, reads waiting per connection and per node, one audit at a
  time.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import re
from collections.abc import Callable, Iterable
from typing import Any, Protocol, TypeVar

import attrs

from .. import pathtiming
from ..deliveries import missing as missing_deliveries
from ..machine import (
    Ack,
    Cancel,
    Command,
    CommitOffset,
    ConsumerDown,
    Declare,
    DeleteQueue,
    Deliver,
    DiskAlarm,
    Down,
    Effect,
    Enqueue,
    EnqueueBatch,
    Enqueued,
    Error,
    ErrorCode,
    ForgetProducers,
    Forgotten,
    Message,
    Nack,
    PurgeQueue,
    QueueDeleted,
    QueueOptions,
    QueuePurged,
    Reply,
    Subscribe,
    Tick,
    UnknownQueueError,
)
from ..machine.commands import MAX_RETRY_DELAY_MS
from ..machine.queue import may_start_generation_id
from ..protocol import (
    PROTOCOL_VERSION,
    Frame,
    FrameDecoder,
    FrameQueue,
    ProtocolError,
    SizedFrame,
    encode_columns,
    encode_frame,
    proof_matches,
)
from ..replica import (
    AuditBusyError,
    AuditFailedError,
    NotAppliedError,
    OutcomeUnknownError,
    ProposalError,
    is_loopback,
)
from .config import READ_REPLY_BYTES, NodeConfig, check_node_config
from .connection import ConnectionCore
from .reads import WaitingRead, WaitingReads

logger = logging.getLogger(__name__)

T = TypeVar("T")

SETTLE_ATTEMPTS = 20
MEMBERSHIP_DEADLINE_S = 20.0
"""How long a membership change may wait for a leader and for an earlier change."""
ACKS_HELD_S = 0.05
"""Longest a consumer's acks wait for its ack being proposed (`NodeCore._ack`)."""
ACKS_HELD_MAX = 4096
"""Most offsets held that way: past it they are proposed at once (one log entry)."""
RETRY_EVERY_S = 0.1
LOST_CONSUMERS_EVERY_S = 1.0
PROPOSAL_COST = 256
"""What a proposal counts for besides its messages' bodies."""
READ_SPAN = 8192
"""Offsets one `read` reply looks at: bounds how long a read holds the replica's lock."""
READ_ROW_OVERHEAD = 32
"""Bytes a row costs in a reply besides its body, key and headers (a generous guess)."""
MAX_READ_WAIT_MS = 30_000
"""The longest a `read` may ask its node to wait for the replica to apply its range."""
MAX_WAITING_READS = 64
"""Reads with `wait_ms` one connection may have waiting (refused past it: `too_many_reads`)."""
MAX_WAITING_READS_PER_NODE = 8192
"""Reads with `wait_ms` a node holds at once, of all its connections: waiting for the
replica, or applied and waiting for room to be answered. Past it a read is refused with
`node_reads_full` (ask another node, or again later): each holds its request and a place
in three indexes, and 128 connections at `MAX_WAITING_READS` already reach it."""
GATHER_BYTES = 1024 * 1024
"""Most body bytes of consecutive publishes gathered into one `EnqueueBatch` entry (a log
entry holds at most `MAX_COMMAND_BYTES`; four pipelined 1 MiB publishes exceeded it and
crashed the connection, which the client then resent to for ever)."""
MIN_FORGET_PREFIX = 12
"""The shortest producer prefix a client may forget without the admin credential."""

ProposalCallback = Callable[[Reply | None, ProposalError | None], None]
_SettleKey = tuple[str, bool, bool, int | None]
"""Acks and nacks read together go in one command per (consumer, nack, requeue,
delay_ms)."""


class ReplicaHandle(Protocol):
    """The node's replica as the core uses it. Callbacks run on the core's loop: the
    shell hands them over (the trio token on a real node)."""

    node_id: str

    def propose(self, command: Command, callback: ProposalCallback | None = None) -> None: ...

    def query(self, read: Callable[[Any], T]) -> T: ...

    def members(self) -> dict[str, str]: ...

    def status(self, *, audit: bool = False) -> dict[str, Any]: ...

    def add_member(
        self, name: str, address: str, callback: Callable[[ProposalError | None], None]
    ) -> None: ...

    def remove_member(
        self, name: str, callback: Callable[[ProposalError | None], None]
    ) -> None: ...

    def ask_leader_to_step_down(self) -> None: ...

    def membership_settled(self) -> bool:
        """Whether this node's log holds no configuration change past its commit index."""
        ...

    def watch_ends(self, queues: frozenset[str]) -> None:
        """Say (`NodeCore.ends_moved`) when an entry applied from now on moves the end of
        one of `queues`."""

    def take_ends_moved(self) -> set[str]:
        """The watched queues whose end moved since the last call."""
        ...


class NodeShell(Protocol):
    """What the core asks of the code that drives it."""

    def wake(self, conn: ConnectionCore) -> None:
        """`conn` has frames to write, must close, or may be read again."""

    def timers_changed(self) -> None:
        """`NodeCore.next_timer` may be sooner than it was."""

    def run_in_worker(
        self, work: Callable[[], Any], done: Callable[[Any, BaseException | None], None]
    ) -> None:
        """Run `work` off the core's loop (it may take a while), then `done(result,
        error)` on it."""


class MembershipError(Exception):
    """A membership change the node refuses or could not complete; `code` says why."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@attrs.define
class _HeldAcks:
    """A consumer's acks waiting for its ack being proposed (`NodeCore._ack`)."""

    queue: str
    conn: ConnectionCore
    offsets: list[int]
    timer: _Timer | None = None


@attrs.define
class _Gathered:
    """Consecutive publishes read together, to be proposed as one entry, and the bytes
    of their bodies (summed as they come: summing them again for each publish made a
    read of a few thousand small publishes quadratic)."""

    frames: list[Frame] = attrs.Factory(list)
    body_bytes: int = 0


class _Timer:
    __slots__ = ("args", "call", "cancelled", "when")

    def __init__(self, when: float, call: Callable[..., None], args: tuple[Any, ...]) -> None:
        self.when = when
        self.call = call
        self.args = args
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class NodeCore:
    """Everything a node decides towards its clients; see the module's docstring."""

    resettle_refused_batches = True
    """`settle`: after an ack or nack of several offsets is refused whole (`not_held`),
    settle again the offsets still held. (A switch for the negative controls, each of
    which turns off one rule.)"""
    retry_lost_settles = True
    """`settle`: propose an ack or nack again when a leader change or a timeout lost it."""
    down_lost_consumers = True
    """`_down_lost_consumers`: propose `Down` for consumers in the log no connection here
    serves."""
    resync_after_snapshot = True
    """`state_replaced`: after a snapshot install, send the held deliveries consumers
    here were not sent, and cancel the ones the machine removed."""

    def __init__(
        self,
        config: NodeConfig,
        replica: ReplicaHandle,
        shell: NodeShell,
        clock: Callable[[], float],
        *,
        random_bytes: Callable[[int], bytes] = os.urandom,
    ) -> None:
        """`clock`: monotonic seconds (trio's, the simulator's). `random_bytes`: for
        nonces and this run's consumer ids (the simulator's are seeded)."""
        check_node_config(config)
        self.config = config
        self.replica = replica
        self.shell = shell
        self.clock = clock
        self.random_bytes = random_bytes
        self.node_id = replica.node_id
        self.consumer_prefix = f"{self.node_id}.{random_bytes(4).hex()}."
        """Consumer ids name this run of this node, so a replayed delivery finds no one."""
        self.consumers: dict[str, ConnectionCore] = {}
        self.connections: set[ConnectionCore] = set()
        self.unauthenticated: dict[ConnectionCore, None] = {}
        """The connections of `connections` that have not said `hello`, oldest first."""
        self._downed: set[str] = set()
        self._acking: dict[str, _HeldAcks] = {}
        """Per consumer with an ack being proposed: the acks that came since, proposed
        together once it is answered (`_ack`)."""
        self._retrying: dict[str, list[_Timer]] = {}
        """Per consumer: its acks and nacks a leader change refused, due again soon."""
        self._connection_counter = 0
        self._timers: list[tuple[float, int, _Timer]] = []
        self._timer_order = itertools.count()
        self._hello_deadlines: dict[ConnectionCore, _Timer] = {}
        self.reads: WaitingReads[ConnectionCore] = WaitingReads()
        """Reads with `wait_ms` waiting for the replica to apply their range."""
        self._watched: frozenset[str] = frozenset()
        """The queues the replica is to say it moved the end of (`ends_moved`): those
        reads wait on, and some that reads waited on since it last said."""
        self._auditing = False
        self._missing_before: set[str] = set()
        self.queue_counts: Callable[[Iterable[str]], dict[str, dict[str, int]]] | None = None
        """Per queue, what this node counted as it applied (`quorumq.counters`), for status."""
        self.call_later(LOST_CONSUMERS_EVERY_S, self._down_lost_consumers)
        self.free_disk_bytes: int | None = None
        """The data disk's free space as last measured (`disk_free`); None: not yet."""
        self.disk_alarm = False
        self._alarms_in_log = False
        """Whether a disk alarm was in the log at the last measure (`disk_free`)."""
        """This node's disk alarm: raised below `min_free_disk_bytes` of free space."""
        self._alarm_proposing = False

    # ----------------------------------------------------------------- timers

    def call_later(self, delay: float, call: Callable[..., None], *args: Any) -> _Timer:
        """Run `call(*args)` in `delay` seconds (`run_timers`)."""
        timer = _Timer(self.clock() + delay, call, args)
        first = self._timers[0][0] if self._timers else None
        heapq.heappush(self._timers, (timer.when, next(self._timer_order), timer))
        if first is None or timer.when < first:
            self.shell.timers_changed()
        return timer

    def next_timer(self) -> float | None:
        """When `run_timers` has something to run next (the clock's time), or None."""
        while self._timers and self._timers[0][2].cancelled:
            heapq.heappop(self._timers)
        first = self._timers[0][0] if self._timers else None
        read = self.reads.next_deadline()
        if first is None or (read is not None and read < first):
            return read
        return first

    def run_timers(self) -> None:
        """Run the timers that are due, and time out the reads whose deadline passed."""
        now = self.clock()
        while self._timers and self._timers[0][0] <= now:
            _, _, timer = heapq.heappop(self._timers)
            if not timer.cancelled:
                timer.call(*timer.args)
        for read in self.reads.expired(now):
            self._read_expired(read)

    # ------------------------------------------------------------ connections

    def connection_made(self, *, local: bool = False) -> ConnectionCore:
        """A client connected: its core, with the node's `welcome` queued (or, past the
        connection cap, closing with a refusal). `local`: a client in the node's own
        process (`quorumq.Node`), whose frames are handed over as they are
        (`frames_received`), under every rule and bound of a connection over TCP; it is
        trusted, as the code that made it could read the node's data anyway: its `hello`
        needs no token, and it may use administrative verbs."""
        config = self.config
        if len(self.unauthenticated) >= config.max_unauthenticated:
            self._evict_oldest_unauthenticated()
        if len(self.connections) >= config.max_connections and self.unauthenticated:
            self._evict_oldest_unauthenticated()
        self._connection_counter += 1
        conn = ConnectionCore(
            self._connection_counter,
            max_frame=config.max_body + 64 * 1024,
            outbound_bytes=config.outbound_bytes,
            outbound_frames=config.outbound_frames,
            local=local,
        )
        conn.nonce = self.random_bytes(16)
        if len(self.connections) >= config.max_connections:
            limit = config.max_connections
            conn.push(
                {
                    "t": "error",
                    "id": None,
                    "code": "too_many_connections",
                    "message": f"this node serves {limit} connections at most; try another node",
                }
            )
            conn.close("too many connections")
            self.shell.wake(conn)
            return conn
        self.connections.add(conn)
        self.unauthenticated[conn] = None
        conn.push(
            {
                "t": "welcome",
                "v": PROTOCOL_VERSION,
                "node": self.node_id,
                "nonce": conn.nonce,
                "auth": config.token is not None and not local,
                "max_body": config.max_body,
                "max_frame": conn.frame_limit,
            }
        )
        self._hello_deadlines[conn] = self.call_later(
            config.handshake_timeout_s, self._close_without_hello, conn
        )
        self.shell.wake(conn)
        return conn

    def _evict_oldest_unauthenticated(self) -> None:
        """Close the oldest connection that has not said `hello`, at once, and stop
        counting it: a newer connection takes its place."""
        conn = next(iter(self.unauthenticated))
        del self.unauthenticated[conn]
        self.connections.discard(conn)
        conn.abort("evicted: too many connections have not said hello")
        self.shell.wake(conn)

    def _close_without_hello(self, conn: ConnectionCore) -> None:
        """A peer that has not said `hello` within the handshake deadline is dropped: a
        silent unauthenticated connection stayed open for good."""
        self._hello_deadlines.pop(conn, None)
        if not conn.greeted and not conn.done:
            self._error(conn, None, "hello_timeout", "no hello within the handshake deadline")
            self._close(conn, "no hello in time")

    def connection_lost(self, conn: ConnectionCore) -> None:
        """The connection is gone: its consumers are down."""
        conn.closed = True
        conn.drop_outbox()
        timer = self._hello_deadlines.pop(conn, None)
        if timer is not None:
            timer.cancel()
        self.connections.discard(conn)
        self.unauthenticated.pop(conn, None)
        self.reads.drop(conn)
        for consumer in conn.consumers:
            if self.consumers.get(consumer) is conn:
                del self.consumers[consumer]
            self._down(consumer)
        conn.consumers.clear()

    def sent(self, conn: ConnectionCore, frames: int, cost: int) -> None:
        """The shell wrote `frames` frames taken with `take_output` (they cost `cost`):
        room again, maybe for requests that waited, or reads due to answer."""
        was_full = conn.full
        conn.sent(frames, cost)
        if was_full and not conn.full:
            self._room_again(conn)

    def _room_again(self, conn: ConnectionCore) -> None:
        while not conn.full and not conn.done:  # reads that came out: before the requests
            read = self.reads.next_due(conn)
            if read is None:
                break
            self._answer_read(conn, read.frame)
        self.handle_buffered(conn)
        self.shell.wake(conn)

    def _close(self, conn: ConnectionCore, reason: str) -> None:
        conn.close(reason)
        self.shell.wake(conn)

    # --------------------------------------------------------------- outgoing

    def _push(self, conn: ConnectionCore, frame: Frame) -> None:
        if conn.push(frame) or conn.closing:
            self.shell.wake(conn)

    def _error(self, conn: ConnectionCore, request_id: int | None, code: str, message: str) -> None:
        self._push(conn, {"t": "error", "id": request_id, "code": code, "message": message})

    def _reply(
        self,
        conn: ConnectionCore,
        request_id: int,
        reply: Reply | None,
        error: ProposalError | None,
    ) -> None:
        """A proposal's outcome, to the client that asked."""
        if error is not None:
            code = "not_applied" if isinstance(error, NotAppliedError) else "outcome_unknown"
            self._error(conn, request_id, code, str(error))
        elif isinstance(reply, Error):
            self._push(
                conn,
                {
                    "t": "error",
                    "id": request_id,
                    "code": reply.code.value,
                    "message": reply.message,
                    "expected_seq": reply.expected_seq,
                    "generation": reply.generation,
                },
            )
        else:
            self._push(conn, {"t": "reply", "id": request_id, **_reply_fields(reply)})

    # --------------------------------------------------------------- incoming

    def data_received(self, conn: ConnectionCore, data: bytes | bytearray) -> None:
        """Bytes from the client. The shell reads more only while `conn.wants_data`."""
        if conn.done:
            return
        assert isinstance(conn.decoder, FrameDecoder), "bytes go to a connection over TCP"
        conn.decoder.feed(data)
        self.handle_buffered(conn)

    def frames_received(self, conn: ConnectionCore, frames: Iterable[SizedFrame]) -> None:
        """Frames from an in-process client (`connection_made(local=True)`), copied and
        sized by `protocol.copy_frame`: as `data_received`, without the bytes. Each is
        checked as a decoded frame is. The shell hands more only while `conn.wants_data`."""
        if conn.done:
            return
        assert isinstance(conn.decoder, FrameQueue), "frames go to a local connection"
        conn.decoder.feed(frames)
        self.handle_buffered(conn)

    def handle_buffered(self, conn: ConnectionCore) -> None:
        """Handle the complete frames received, as long as the connection is not `full`
        (the frames left wait in the decoder until there is room)."""
        if conn.done:
            return
        publishes = _Gathered()
        acks: dict[_SettleKey, list[int]] = {}
        while not conn.done:
            try:
                for frame in conn.decoder.frames():
                    kind = frame["t"]
                    if not conn.greeted:
                        self._hello(conn, frame)
                    elif kind == "publish":
                        self._gather_publish(conn, publishes, frame)
                    elif kind in ("ack", "nack"):
                        self._flush_publishes(conn, publishes)
                        self._gather_ack(conn, acks, frame)
                    else:
                        self._flush_publishes(conn, publishes)
                        self._flush_acks(conn, acks)
                        self._handle(conn, frame)
                    if conn.full or conn.done:
                        break
                break
            except ProtocolError as e:
                self._error(conn, e.request_id, e.code, e.message)
                # Before hello every protocol error is fatal: an unauthenticated peer got
                # an error frame per garbage frame (20,000 five-byte frames queued 1.6 MB).
                if e.fatal or not conn.greeted:
                    self._close(conn, f"protocol error: {e.message}")
                    break
                if conn.full:
                    break
        self._flush_publishes(conn, publishes)
        self._flush_acks(conn, acks)

    def _hello(self, conn: ConnectionCore, frame: Frame) -> None:
        config = self.config
        if frame["t"] != "hello":
            self._error(conn, frame.get("id"), "hello_first", "the first frame must be hello")
            self._close(conn, "no hello")
            return
        if frame["v"] != PROTOCOL_VERSION:
            self._error(conn, None, "version", f"this node speaks protocol {PROTOCOL_VERSION}")
            self._close(conn, "protocol version mismatch")
            return
        token = config.token
        trusted = conn.local  # in the node's own process (see `connection_made`)
        if (
            token is not None
            and not trusted
            and not proof_matches(token, conn.nonce, frame["proof"])
        ):
            logger.warning("client connection %d refused: wrong token", conn.number)
            self._error(conn, None, "auth_failed", "wrong token")
            self._close(conn, "authentication failed")
            return
        admin_token = config.admin_token
        admin_proof = frame.get("admin_proof")
        conn.admin = (
            trusted
            or config.open_admin
            or (
                admin_token is not None
                and isinstance(admin_proof, bytes)
                and proof_matches(admin_token, conn.nonce, admin_proof)
            )
        )
        if admin_proof is not None and not conn.admin:
            logger.warning("client connection %d: wrong admin token", conn.number)
        conn.greeted = True
        self.unauthenticated.pop(conn, None)
        timer = self._hello_deadlines.pop(conn, None)
        if timer is not None:
            timer.cancel()
        conn.decoder.max_frame = conn.frame_limit
        self._push(conn, {"t": "reply", "id": 0, "node": self.node_id})

    def _handle(self, conn: ConnectionCore, frame: Frame) -> None:
        kind = frame["t"]
        handler = _HANDLERS.get(kind)
        if handler is None:
            self._error(
                conn, frame.get("id"), "unexpected_frame", f"a client does not send {kind!r}"
            )
            return
        try:
            handler(self, conn, frame)
        except (TypeError, ValueError) as e:
            self._error(conn, frame.get("id", 0), "invalid", str(e))

    # --------------------------------------------------------------- requests

    def _propose_for(
        self,
        conn: ConnectionCore,
        request_id: int | None,
        command: Command,
        *,
        consumer: str | None = None,
        cost: int = PROPOSAL_COST,
    ) -> None:
        """Propose `command` for `conn`'s request; `cost`: what it counts for in `conn`'s
        `proposing_bytes` until its outcome."""
        conn.proposing_bytes += cost

        def done(reply: Reply | None, error: ProposalError | None) -> None:
            self._answered(conn, cost)
            self._answer(conn, request_id, reply, error, consumer)

        self.replica.propose(command, done)

    def _answered(self, conn: ConnectionCore, cost: int) -> None:
        was_full = conn.full
        conn.proposing_bytes -= cost
        if was_full and not conn.full and not conn.done:
            self._room_again(conn)

    def _answer(
        self,
        conn: ConnectionCore,
        request_id: int | None,
        reply: Reply | None,
        error: ProposalError | None,
        consumer: str | None,
    ) -> None:
        failed = error is not None or isinstance(reply, Error)
        if consumer is not None:
            if consumer not in conn.awaiting_reply:
                return  # answered already: the Subscribe was in a snapshot this node installed
            early = conn.awaiting_reply.pop(consumer)
            conn.subscribe_requests.pop(consumer, None)
            if failed:
                conn.drop_consumer(consumer)
                self.consumers.pop(consumer, None)
            elif request_id is not None:
                self._push(conn, {"t": "reply", "id": request_id, "consumer": consumer})
                for frame in early:
                    self._push(conn, frame)
                return
        if request_id is not None:
            self._reply(conn, request_id, reply, error)
        elif failed:  # acks and nacks carry no id: report what went wrong anyway
            message = str(error) if error is not None else reply.message  # type: ignore[union-attr]
            self._error(conn, None, "settle_failed", message)

    def _declare(self, conn: ConnectionCore, frame: Frame) -> None:
        options = frame["options"]
        if any(not isinstance(k, str) for k in options):
            raise ValueError("option names must be strings")
        command = Declare(queue=frame["queue"], options=QueueOptions(**options))
        self._propose_for(conn, frame["id"], command)

    def _check_body(self, conn: ConnectionCore, frame: Frame, body: bytes) -> bool:
        limit = self.config.max_body
        if len(body) > limit:
            self._error(
                conn, frame["id"], "too_large", f"message body of {len(body)} bytes exceeds {limit}"
            )
            return False
        return True

    def _gather_publish(self, conn: ConnectionCore, publishes: _Gathered, frame: Frame) -> None:
        if pathtiming.ENABLED:
            pathtiming.mark("node.read", ("p", frame["producer"], frame["seq"]))
        if not self._check_body(conn, frame, frame["body"]):
            return
        if publishes.frames:
            last = publishes.frames[-1]
            joinable = (
                publishes.body_bytes + len(frame["body"]) <= GATHER_BYTES  # one entry holds them
                and not frame.get("retry")
                and last["queue"] == frame["queue"]
                and last["producer"] == frame["producer"]
                and frame["seq"] is not None
                and last["seq"] is not None
                and frame["seq"] == last["seq"] + 1
            )
            if not joinable:
                self._flush_publishes(conn, publishes)
        publishes.frames.append(frame)
        publishes.body_bytes += len(frame["body"])
        if frame.get("retry"):
            self._flush_publishes(conn, publishes)

    def _flush_publishes(self, conn: ConnectionCore, publishes: _Gathered) -> None:
        if not publishes.frames:
            return
        frames = publishes.frames
        publishes.frames, publishes.body_bytes = [], 0
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
                self._error(conn, f["id"], "invalid", str(e))
            return
        ids = [f["id"] for f in frames]
        if self._refused_for_disk(
            conn, ids, first["queue"], first["producer"], first["seq"], len(frames)
        ):
            return
        cost = sum(len(f["body"]) + PROPOSAL_COST for f in frames)
        conn.proposing_bytes += cost

        def done(reply: Reply | None, error: ProposalError | None) -> None:
            self._answered(conn, cost)
            self._answer_publishes(conn, ids, reply, error)

        self.replica.propose(command, done)
        if pathtiming.ENABLED:
            for f in frames:
                pathtiming.mark("node.proposed", ("p", f["producer"], f["seq"]))

    def _answer_publishes(
        self,
        conn: ConnectionCore,
        ids: list[int],
        reply: Reply | None,
        error: ProposalError | None,
    ) -> None:
        if isinstance(reply, Enqueued) and error is None:
            for i, request_id in enumerate(ids):
                offset = None if reply.offset is None else reply.offset + i
                self._push(
                    conn,
                    {
                        "t": "reply",
                        "id": request_id,
                        "offset": offset,
                        "count": 1,
                        "duplicate": reply.duplicate,
                    },
                )
            return
        for request_id in ids:
            self._reply(conn, request_id, reply, error)

    def _publish_batch(self, conn: ConnectionCore, frame: Frame) -> None:
        messages = []
        for m in frame["messages"]:
            if not isinstance(m, list) or len(m) != 3:
                raise ValueError("each message must be [body, key, headers]")
            if not self._check_body(conn, frame, m[0]):
                return
            messages.append(Message(body=m[0], key=m[1], headers=m[2]))
        command = EnqueueBatch(
            queue=frame["queue"],
            messages=messages,
            producer=frame["producer"],
            first_seq=frame["first_seq"],
            seqs=frame.get("seqs"),
            opens=bool(frame.get("opens")),
        )
        if self._refused_for_disk(
            conn,
            [frame["id"]],
            command.queue,
            command.producer,
            command.first_seq,
            len(messages),
            command.seqs,
        ):
            return
        cost = sum(len(m.body) + PROPOSAL_COST for m in messages)
        self._propose_for(conn, frame["id"], command, cost=cost)

    def _refused_for_disk(
        self,
        conn: ConnectionCore,
        ids: list[int],
        queue: str,
        producer: str | None,
        first_seq: int | None,
        count: int,
        seqs: tuple[int, ...] | None = None,
    ) -> bool:
        """While a disk alarm is in the log, answer a publish it would refuse here,
        without proposing it (a log entry each, on the disk that is filling: clients
        retry a refused resend every second). Only looked up while this node saw an
        alarm at its last measure (`disk_free`), or one is raised here."""
        if not (self._alarms_in_log or self.disk_alarm):
            return False
        refusal = self.replica.query(
            lambda m: m.disk_alarm_refusal(queue, producer, first_seq, count, seqs)
        )
        if refusal is None:
            return False
        for request_id in ids:
            self._reply(conn, request_id, refusal, None)
        return True

    def _subscribe(self, conn: ConnectionCore, frame: Frame) -> None:
        limit = self.config.max_consumers
        if len(conn.consumers) >= limit:  # cancelled ones count until they hold nothing
            self._error(
                conn,
                frame["id"],
                "too_many_consumers",
                f"a connection may have {limit} consumers at most (cancelled ones count "
                "until their messages are settled): cancel some, or open another connection",
            )
            return
        conn.consumer_counter += 1
        consumer = f"{self.consumer_prefix}{conn.number}.{conn.consumer_counter}"
        queue = frame["queue"]
        command = Subscribe(  # checked (prefetch at most 65,535) before anything is kept
            queue=queue,
            consumer=consumer,
            node=self.node_id,
            prefetch=frame["prefetch"],
            timeout_ms=frame.get("timeout_ms"),
        )
        conn.consumers[consumer] = queue
        conn.awaiting_reply[consumer] = []
        conn.subscribe_requests[consumer] = frame["id"]
        conn.prefetches[consumer] = command.prefetch
        conn.prefetch_allowance += command.prefetch
        self.consumers[consumer] = conn
        self._propose_for(conn, frame["id"], command, consumer=consumer, cost=0)

    def _cancel(self, conn: ConnectionCore, frame: Frame) -> None:
        consumer = frame["consumer"]
        queue = conn.consumers.get(consumer)
        if queue is None:
            self._error(conn, frame["id"], "unknown_consumer", f"no consumer {consumer!r} here")
            return
        conn.cancelling.add(consumer)
        self._propose_for(conn, frame["id"], Cancel(queue=queue, consumer=consumer))

    def _gather_ack(
        self, conn: ConnectionCore, acks: dict[_SettleKey, list[int]], frame: Frame
    ) -> None:
        consumer = frame["consumer"]
        if consumer not in conn.consumers:
            self._error(
                conn, None, "unknown_consumer", f"no consumer {consumer!r} on this connection"
            )
            return
        offsets = frame["offsets"]
        if not all(type(o) is int and o >= 0 for o in offsets):
            self._error(conn, None, "invalid", "offsets must be non-negative integers")
            return
        nack = frame["t"] == "nack"
        requeue = bool(frame.get("requeue"))
        delay_ms = frame.get("delay_ms") if nack else None
        if delay_ms is not None and (not requeue or not 0 <= delay_ms <= MAX_RETRY_DELAY_MS):
            self._error(
                conn,
                None,
                "invalid",
                f"delay_ms must be from 0 to {MAX_RETRY_DELAY_MS}, and goes with requeue=True",
            )
            return
        acks.setdefault((consumer, nack, requeue, delay_ms), []).extend(offsets)

    def _flush_acks(self, conn: ConnectionCore, acks: dict[_SettleKey, list[int]]) -> None:
        for (consumer, nack, requeue, delay_ms), offsets in acks.items():
            queue = conn.consumers.get(consumer)
            if queue is None:
                continue
            if nack:
                self._release_acks(consumer)  # the consumer's acks before its nack
                command = Nack(
                    queue=queue,
                    consumer=consumer,
                    offsets=offsets,
                    requeue=requeue,
                    delay_ms=delay_ms,
                )
                self.settle(command, conn)
            else:
                self._ack(queue, consumer, offsets, conn)
        acks.clear()

    def _ack(self, queue: str, consumer: str, offsets: list[int], conn: ConnectionCore) -> None:
        """Propose an ack of `offsets` now, or, while an ack of the same consumer is being
        proposed, with the acks that follow it once it is answered: a consumer's acks
        arriving while one commits take one log entry (one fdatasync on each replica)
        instead of one each. Nothing waits when acks are rarer than a commit, and no ack
        waits longer than `ACKS_HELD_S` (PySyncObj does not answer every proposal: a
        snapshot install can skip its entry), nor past `ACKS_HELD_MAX` offsets."""
        held = self._acking.get(consumer)
        if held is not None:
            held.offsets += offsets
            if len(held.offsets) >= ACKS_HELD_MAX:
                self._propose_held_acks(consumer)
            elif held.timer is None:
                held.timer = self.call_later(ACKS_HELD_S, self._propose_held_acks, consumer)
            return
        self._acking[consumer] = _HeldAcks(queue, conn, [])
        self.settle(
            Ack(queue=queue, consumer=consumer, offsets=offsets),
            conn,
            answered=lambda: self._next_acks(consumer),
        )

    def _next_acks(self, consumer: str) -> None:
        held = self._acking.pop(consumer, None)
        if held is not None:
            if held.timer is not None:
                held.timer.cancel()
            if held.offsets:
                self._ack(held.queue, consumer, held.offsets, held.conn)

    def _propose_held_acks(self, consumer: str) -> None:
        """Propose the acks of `consumer` that wait, now (they waited long enough)."""
        held = self._acking.get(consumer)
        if held is not None:
            if held.timer is not None:
                held.timer.cancel()
                held.timer = None
            if held.offsets:
                offsets = list(dict.fromkeys(held.offsets))
                held.offsets = []
                self.settle(Ack(queue=held.queue, consumer=consumer, offsets=offsets), held.conn)

    def _release_acks(self, consumer: str) -> None:
        """A nack or a `Down` of `consumer` follows: its acks that wait go first, and so
        does any of its acks and nacks that a leader change made wait for their next
        attempt (a nack taking back a key's later messages, one of them acked, would
        have returned it)."""
        self._propose_held_acks(consumer)
        for retry in self._retrying.pop(consumer, ()):
            if not retry.cancelled:
                retry.cancel()
                retry.call(*retry.args)

    def _forget_retry(self, consumer: str, timer: _Timer) -> None:
        retries = self._retrying.get(consumer)
        if retries is not None and timer in retries:
            retries.remove(timer)
            if not retries:
                del self._retrying[consumer]

    def settle(
        self,
        command: Ack | Nack,
        conn: ConnectionCore,
        attempt: int = 1,
        answered: Callable[[], None] | None = None,
    ) -> None:
        """Propose an ack or nack, again if a leader change lost it: the client sent it
        and moved on, and a lost one would leave the message held by a live consumer.

        After "not applied" the same command goes again, `RETRY_EVERY_S` later (at once,
        twenty refusals from a leader that had just handed leadership over took 30 ms,
        and the ack was lost: simulator, seed 194). After "outcome unknown" it
        goes again for the offsets the consumer still holds on this replica (an ack is
        safe to repeat; a requeueing nack repeated after all is one more marked
        redelivery). A repeat refused because the offsets are no longer held means the
        first attempt did land: nothing to report.

        The machine refuses an ack or nack whole if one offset is not held (a nack of a
        keyed message takes back the key's later messages the consumer holds, and the
        client may ack one of those in the same read as others). The refusal is
        reported, and the offsets still held are settled again, so none is stranded.

        `answered` is called when this attempt is answered, whatever the answer."""

        def done(reply: Reply | None, error: ProposalError | None) -> None:
            if answered is not None:
                answered()
            if isinstance(reply, Error) and reply.code == ErrorCode.NOT_HELD:
                if attempt == 1:  # say which, then settle the offsets still held
                    self._answer(conn, None, reply, None, None)
                resettle = self.resettle_refused_batches and len(command.offsets) > 1
                if resettle and attempt < SETTLE_ATTEMPTS:
                    self._settle_held(command, conn, attempt + 1)
                return
            if self.retry_lost_settles and attempt < SETTLE_ATTEMPTS:
                if isinstance(error, NotAppliedError):
                    # after a moment: a node that still takes an old leader for the leader
                    # is refused at once ("no longer leader") until the election is over
                    # (or at once, before a nack or a Down of the same consumer)
                    self._retry_later(command, conn, attempt + 1)
                    return
                if isinstance(error, OutcomeUnknownError):
                    self._settle_held(command, conn, attempt + 1)
                    return
            self._answer(conn, None, reply, error, None)

        self.replica.propose(command, done)

    def _retry_later(self, command: Ack | Nack, conn: ConnectionCore, attempt: int) -> None:
        consumer = command.consumer
        timer: _Timer

        def again() -> None:
            self._forget_retry(consumer, timer)
            self.settle(command, conn, attempt)

        timer = self.call_later(RETRY_EVERY_S, again)
        self._retrying.setdefault(consumer, []).append(timer)

    def _settle_held(self, command: Ack | Nack, conn: ConnectionCore, attempt: int) -> None:
        try:
            held = set(self.replica.query(lambda m: m.unacked(command.queue, command.consumer)))
        except UnknownQueueError:
            return  # the queue was deleted, with what it held
        offsets = tuple(o for o in command.offsets if o in held)
        if offsets:
            self.settle(attrs.evolve(command, offsets=offsets), conn, attempt)

    # ------------------------------------------------------------------ reads

    def _read(self, conn: ConnectionCore, frame: Frame) -> None:
        """Stream view rows of [start, end) (in a key bucket), from this node's replica.

        Everything a replica has applied is committed, so a read never sees uncommitted
        data. Without `wait_ms` the reply covers what this replica has applied so far.
        With `wait_ms` the caller says the whole range is committed (it learned `end`
        from some node): a replica that lags is waited for (`ends_moved`); past the wait
        the node answers `lagging`, and the client asks another node.
        It never answers part of the range in that case. With `columns: true` the rows
        come column by column (`protocol.encode_columns`), for bulk readers."""
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
        queue = frame["queue"]
        if wait_ms is None:
            self._answer_read(conn, frame)
            return
        self._watch(queue)  # before reading its end: no move falls between
        if self._applied_end(queue) >= end:
            self._answer_read(conn, frame)
        elif self.reads.waiting(conn) >= MAX_WAITING_READS:
            self._error(
                conn,
                frame["id"],
                "too_many_reads",
                f"{MAX_WAITING_READS} reads already wait on this connection; wait for them",
            )
        elif len(self.reads) >= MAX_WAITING_READS_PER_NODE:
            self._error(
                conn,
                frame["id"],
                "node_reads_full",
                f"node {self.node_id} holds {MAX_WAITING_READS_PER_NODE} waiting reads, the "
                "most it holds (MAX_WAITING_READS_PER_NODE); ask another node, or again later",
            )
        else:
            first = self.reads.next_deadline()
            deadline = self.clock() + wait_ms / 1000
            self.reads.add(conn, frame, queue, end, deadline)
            if first is None or deadline < first:
                self.shell.timers_changed()

    def _watch(self, queue: str) -> None:
        if queue not in self._watched:
            self._watched = self._watched | {queue}
            self.replica.watch_ends(self._watched)

    def ends_moved(self) -> None:
        """The replica applied entries that moved the end of queues reads wait on (it says
        so once until they are taken: one call for a batch of entries). Answer the reads
        their ends now cover, and no other: the work is theirs, whatever else waits."""
        moved = self.replica.take_ends_moved()
        waited = self.reads.queues()
        if not moved <= waited:  # queues no read waits on any more: not watched
            self._watched = frozenset(waited)
            self.replica.watch_ends(self._watched)
        self._wake_reads(moved & waited)

    def _wake_reads(self, queues: Iterable[str]) -> None:
        queues = list(queues)
        if not queues:
            return
        ends = self.replica.query(lambda m: [_end_of(m, q) for q in queues])
        for queue, end in zip(queues, ends, strict=True):
            for read in self.reads.ready(queue, end):
                self._read_ready(read)

    def _read_ready(self, read: WaitingRead[ConnectionCore]) -> None:
        conn = read.owner
        if conn.done:
            return
        if conn.full:  # up to 64 replies of 768 KiB could come due at once
            self.reads.hold(read)
        else:
            self._answer_read(conn, read.frame)

    def _applied_end(self, queue: str) -> int:
        """The offset after the last message this replica has applied to `queue`; -1
        when it has not applied the queue's declaration (yet)."""
        end: int = self.replica.query(lambda m: _end_of(m, queue))
        return end

    def _read_expired(self, read: WaitingRead[ConnectionCore]) -> None:
        conn, frame = read.owner, read.frame
        queue, end = frame["queue"], frame["end"]
        applied = self._applied_end(queue)
        if applied >= end:  # moved as the time ran out
            self._read_ready(read)
            return
        if conn.done:
            return
        where = (
            f"does not know queue {queue!r}"
            if applied < 0
            else f"has applied {queue!r} up to offset {applied}, short of {end}"
        )
        self._error(
            conn,
            frame["id"],
            "lagging",
            f"node {self.node_id} {where} after waiting {frame['wait_ms']} ms; ask another node",
        )

    def _answer_read(self, conn: ConnectionCore, frame: Frame) -> None:
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
            rows, stats, covered = self.replica.query(page)
        except UnknownQueueError as e:
            self._error(conn, frame["id"], "unknown_queue", str(e))
            return
        reply: Frame = {
            "t": "reply",
            "id": frame["id"],
            "first_retained": stats.first_retained,
            "next_offset": stats.next_offset,
            "covered_until": covered,
        }
        if frame.get("columns") is True:  # a bulk reader's: bodies in one bytes object
            reply["columns"] = encode_columns(rows)
        else:
            reply["messages"] = rows
        self._push(conn, reply)

    # ---------------------------------------------------------- other requests

    def _commit_offset(self, conn: ConnectionCore, frame: Frame) -> None:
        command = CommitOffset(queue=frame["queue"], group=frame["group"], offset=frame["offset"])
        self._propose_for(conn, frame["id"], command)

    def _forget_producers(self, conn: ConnectionCore, frame: Frame) -> None:
        """A short prefix forgets other clients' producers too ("0".."f" forget them
        all): without the admin credential a prefix must be `MIN_FORGET_PREFIX`
        characters or more, and may not be one of a client's producer id
        ("g<ms>-<32 hex>"). Forgetting one moves the queue's forgotten generation up to
        its time, which refuses the first publish of every client whose id is older: a
        client looping that would keep other clients failing. (The machine refuses an
        empty prefix from anyone.)"""
        prefix = frame["prefix"]
        if prefix and not conn.admin and _needs_admin(prefix):
            self._error(
                conn,
                frame["id"],
                "admin_required",
                f"forget_producers with the prefix {prefix!r} needs the admin token: give at "
                f"least {MIN_FORGET_PREFIX} characters, not the start of a client's producer "
                "id ('g<generation>-<32 hex>'), nor a start of 'spark-' shorter than a whole "
                "Spark job's or batch's prefix ('spark-write-<job>-', "
                "'spark-<query id>-<batch>-'), or prove the admin token",
            )
            return
        seal = frame.get("seal") is True
        if seal and not conn.admin and SPARK_PREFIXES.fullmatch(prefix) is None:
            self._error(
                conn,
                frame["id"],
                "admin_required",
                f"sealing the prefix {prefix!r} needs the admin token: without it, only a "
                "whole Spark job's or batch's prefix ('spark-write-<job>-', "
                "'spark-<query id>-<batch>-') may be sealed",
            )
            return
        command = ForgetProducers(queue=frame["queue"], prefix=prefix, seal=seal)
        self._propose_for(conn, frame["id"], command)

    def _purge_queue(self, conn: ConnectionCore, frame: Frame) -> None:
        self._propose_for(conn, frame["id"], PurgeQueue(queue=frame["queue"]))

    def _delete_queue(self, conn: ConnectionCore, frame: Frame) -> None:
        """A queue verb, as `declare` is (the client token, not the admin one). The
        consumers of the queue are told through their `cancelled` frames, on whichever
        node serves them, once the delete is applied there."""
        command = DeleteQueue(queue=frame["queue"], force=frame["force"] is True)
        self._propose_for(conn, frame["id"], command)

    def _admin_refused(self, conn: ConnectionCore, frame: Frame, verb: str | None = None) -> bool:
        """Membership changes the cluster, not a queue, and an audit costs the node a
        copy of its state: they need the admin credential."""
        if conn.admin:
            return False
        why = (
            "this node has no admin token: start it with QUORUMQ_ADMIN_TOKEN to allow it"
            if self.config.admin_token is None
            else "prove the admin token (QUORUMQ_ADMIN_TOKEN, or admin_token= in the client)"
        )
        what = verb or frame["t"]
        self._error(conn, frame["id"], "admin_required", f"{what} is an administrative verb; {why}")
        return True

    def _status(self, conn: ConnectionCore, frame: Frame) -> None:
        if frame.get("audit") is True:
            # it encodes the whole state (in a child process, one audit at a time): an
            # administrative verb, or any client could keep a node busy hashing
            if self._admin_refused(conn, frame, "status with audit"):
                return
            self._audit(conn, frame["id"])
            return
        self._push(conn, {"t": "reply", "id": frame["id"], "status": self.status()})

    def _audit(self, conn: ConnectionCore, request_id: int) -> None:
        def done(taken: Any, error: BaseException | None) -> None:
            if isinstance(error, AuditBusyError):
                self._error(conn, request_id, "audit_busy", str(error))
            elif isinstance(error, AuditFailedError):
                self._error(conn, request_id, "audit_failed", str(error))
            elif error is not None:
                self._error(conn, request_id, "audit_failed", f"{type(error).__name__}: {error}")
            else:
                self._push(conn, {"t": "reply", "id": request_id, "status": self.status(taken)})

        replica = self.replica
        self.shell.run_in_worker(lambda: replica.status(audit=True), done)

    def status(self, replica_status: dict[str, Any] | None = None) -> dict[str, Any]:
        """What `quorumq status` shows, O(queues) (`replica_status`: one taken already,
        say with the audit digest, off the loop)."""
        status = replica_status if replica_status is not None else self.replica.status()

        def queues(m: Any) -> dict[str, Any]:
            return {
                q: {
                    **attrs.asdict(m.stats(q)),
                    "consumer_ids": list(m.consumers(q)),
                    "committed_offsets": m.committed_offsets(q),
                }
                for q in m.queues()
            }

        status["queues"] = self.replica.query(queues)
        if self.queue_counts is not None:
            for queue, counts in self.queue_counts(status["queues"]).items():
                status["queues"][queue].update(counts)
        status["disk_free_bytes"] = self.free_disk_bytes
        status["disk_alarm"] = self.disk_alarm
        status["disk_alarms"] = sorted(self.replica.query(lambda m: m.disk_alarms()))
        status["clients"] = len(self.connections)
        status["max_clients"] = self.config.max_connections
        config, replica = self.config, self.config.replica
        status["settings"] = {  # what this node runs with (its flags, as it took them)
            "election_timeout_s": list(replica.raft_timeouts),
            "node_down_grace_s": replica.node_down_grace_s,
            "max_body": config.max_body,
            "outbound_frames": config.outbound_frames,
            "outbound_bytes": config.outbound_bytes,
            "min_free_disk_bytes": config.min_free_disk_bytes,
        }
        return status

    # ------------------------------------------------------------- membership

    def _add_member(self, conn: ConnectionCore, frame: Frame) -> None:
        if self._admin_refused(conn, frame):
            return
        request_id, name, address = frame["id"], frame["node"], frame["raft_address"]
        if not (self.config.replica.secret or is_loopback(address)):
            self._error(
                conn,
                request_id,
                "invalid",
                f"{address} is not loopback: a cluster without a secret stays local",
            )
            return

        def refused(members: dict[str, str]) -> MembershipError | None:
            if name in members and members[name] != address:
                return MembershipError("member_exists", f"{name} is a member at {members[name]}")
            for other, other_address in members.items():
                if other_address == address and other != name:
                    return MembershipError("member_exists", f"{address} is {other}'s Raft address")
            return None

        _MembershipChange(
            self,
            conn,
            request_id,
            lambda done: self.replica.add_member(name, address, done),
            made=lambda members: members.get(name) == address,
            refused=refused,
            timeout_hint=(
                f": the leader adds {name} once it has caught up with the log; is it "
                f"running at {address}, with every member as --peer and the cluster "
                "secret? Ask again: its catching up goes on"
            ),
        ).start()

    def _remove_member(self, conn: ConnectionCore, frame: Frame) -> None:
        """Remove a replica (asking it to hand leadership over first if it leads), and
        answer once the change is committed. The node itself keeps running, cut off."""
        if self._admin_refused(conn, frame):
            return
        request_id, name = frame["id"], frame["node"]
        if name == self.node_id:
            self._error(
                conn,
                request_id,
                "target_is_self",
                f"{name} cannot remove itself: send the request to another member",
            )
            return

        def refused(members: dict[str, str]) -> MembershipError | None:
            if name not in members:
                return MembershipError("unknown_member", f"{name} is not a member")
            return None

        change = _MembershipChange(
            self,
            conn,
            request_id,
            lambda done: self.replica.remove_member(name, done),
            made=lambda members: name not in members,
            refused=refused,
        )
        change.step_down_first = name
        change.start()

    # ------------------------------------------------------------ disk alarm

    def disk_free(self, free_bytes: int | None) -> None:
        """The shell measured the data disk's free space (every second): raise or clear
        this node's disk alarm, and bring the log's record of it (`DiskAlarm`, which
        refuses publishes cluster-wide) in line, proposing again until it is."""
        self.free_disk_bytes = free_bytes
        limit = self.config.min_free_disk_bytes
        if free_bytes is None or limit <= 0:
            raised = False
        elif self.disk_alarm:  # cleared a margin above the limit: no flapping around it
            raised = free_bytes < limit + limit // 8
        else:
            raised = free_bytes < limit
        if raised != self.disk_alarm:
            self.disk_alarm = raised
            log = logger.warning if raised else logger.info
            log(
                "disk alarm %s: %s free on the data disk, limit %s",
                "raised" if raised else "cleared",
                _mib(free_bytes),
                _mib(limit),
            )
        alarms = self.replica.query(lambda m: m.disk_alarms())
        self._alarms_in_log = bool(alarms)
        in_log = self.node_id in alarms
        if in_log == raised or self._alarm_proposing:
            return
        self._alarm_proposing = True

        def done(_reply: Reply | None, _error: ProposalError | None) -> None:
            self._alarm_proposing = False  # (checked again at the next measure)

        self.replica.propose(DiskAlarm(node=self.node_id, raised=raised), done)

    # ----------------------------------------------- consumers the node lost

    def _down_lost_consumers(self) -> None:
        """Propose `Down` for consumers in the log that this node serves no longer.

        A closed connection proposes its consumers' `Down` at once, but that proposal
        can be lost to a leader change. Consumers of an earlier run of this node died
        with it, and if the node came back within the grace period no `NodeDown`
        returns their messages. Neither may hold credit for a delivery that would
        reveal them. So, every second: a consumer the machine places on this node that
        no connection here serves, now and a second ago, gets its `Down` (again)."""
        node = self.node_id
        placed = self.replica.query(lambda m: m.consumers_on(node))
        missing = {c for c in placed if c not in self.consumers}
        for consumer in sorted(missing & self._missing_before):
            if not self.down_lost_consumers:
                break
            logger.info("consumer %s is served nowhere: proposing its Down", consumer)
            self.replica.propose(Down(consumer=consumer))
        self._missing_before = missing
        self._forget_removed(set(placed))
        self.call_later(LOST_CONSUMERS_EVERY_S, self._down_lost_consumers)

    def _forget_removed(self, placed: set[str]) -> None:
        """Drop the records of consumers the machine no longer has: a cancelled one once
        it held nothing (they stayed until the connection closed: 10,000 subscribe and
        cancel cycles on one connection kept 10,000 records), and `Down`s done."""
        for consumer, conn in list(self.consumers.items()):
            if consumer in conn.cancelling and consumer not in placed:
                del self.consumers[consumer]
                conn.drop_consumer(consumer)
        self._downed &= placed

    def _down(self, consumer: str) -> None:
        self._release_acks(consumer)  # what it acked lands before what it held returns
        if consumer not in self._downed:
            self._downed.add(consumer)
            self.replica.propose(Down(consumer=consumer))

    # ------------------------------------------------------ from the replica

    def effects_applied(self, index: int | None, effects: Iterable[Effect]) -> None:
        """Run this node's effects of log entry `index` (None: `state_replaced`'s)."""
        for e in effects:
            if type(e) is Deliver:
                conn = self.consumers.get(e.consumer)
                if conn is None or conn.done:
                    self._down(e.consumer)
                    continue
                sent = conn.sent_to(e.consumer)
                if index is not None and sent.covers(index):
                    continue  # `state_replaced` got there first
                sent.record(e)
                if sent.full():
                    self._prune_deliveries(conn, e.consumer)
                frame = {
                    "t": "deliver",
                    "consumer": e.consumer,
                    "offset": e.offset,
                    "key": e.key,
                    "body": e.body,
                    "headers": e.headers,
                    "redelivered": e.redelivered,
                    "delivery_count": e.delivery_count,
                    "node": self.node_id,
                }
                early = conn.awaiting_reply.get(e.consumer)
                if early is not None:  # the subscribe reply goes first
                    early.append(frame)
                else:
                    self._push(conn, frame)
            elif type(e) is ConsumerDown:
                self._downed.discard(e.consumer)
                conn = self.consumers.pop(e.consumer, None)
                if conn is not None:
                    conn.drop_consumer(e.consumer)
                    self._push(conn, {"t": "cancelled", "consumer": e.consumer, "reason": e.reason})

    def _prune_deliveries(self, conn: ConnectionCore, consumer: str) -> None:
        """Keep, of what `consumer` was sent, what the machine says it still holds (the
        replica may have applied more than these effects: nothing if its queue is gone)."""
        queue = conn.consumers[consumer]
        try:
            held = self.replica.query(lambda m: m.unacked(queue, consumer))
        except UnknownQueueError:
            held = ()
        conn.sent_to(consumer).keep(held)

    def state_replaced(self) -> None:
        """This node's replica jumped to the leader's snapshot: the log entries it skipped
        never ran their effects here (and entries it applies again must not run twice).
        Compare the machine with what each consumer here was sent: send the held
        deliveries it was not sent, and cancel the consumers the machine removed: with
        their queue (deleted meanwhile), or else as though their node was marked down
        (the client subscribes again)."""
        if not self.resync_after_snapshot:
            return
        for consumer in list(self._acking):  # the ack they wait for may never be answered
            self._propose_held_acks(consumer)
        self._wake_reads(self.reads.queues())  # the ends moved with no entry applied
        served = [
            (c, conn, conn.consumers[c])
            for c, conn in self.consumers.items()
            if not conn.done and c in conn.consumers
        ]
        index, held, queues = self.replica.query(
            lambda m: (
                m.last_index,
                [m.held_deliveries(q, c) for c, _, q in served],
                set(m.queues()),
            )
        )
        for (c, conn, queue), deliveries in zip(served, held, strict=True):
            if c in conn.awaiting_reply and deliveries is not None:
                # its Subscribe was among the skipped entries: PySyncObj will not answer it
                self._answer(conn, conn.subscribe_requests.get(c), None, None, c)
            missing = missing_deliveries(deliveries, conn.sent_to(c), index)
            if missing is None:
                # not yet subscribed in the log, or cancelled by its client: nothing to say
                if c not in conn.awaiting_reply and c not in conn.cancelling:
                    reason = "node_down" if queue in queues else "queue_deleted"
                    down = ConsumerDown(queue=queue, consumer=c, node=self.node_id, reason=reason)
                    self.effects_applied(None, (down,))
                continue
            if missing:
                logger.info(
                    "consumer %s: sending %d deliveries the snapshot install skipped",
                    c,
                    len(missing),
                )
                self.effects_applied(None, missing)


def _end_of(m: Any, queue: str) -> int:
    """`queue`'s end in machine `m`: the offset after its last message, -1 with no queue."""
    try:
        end: int = m.stats(queue).next_offset
    except UnknownQueueError:
        return -1
    return end


SPARK_PREFIXES = re.compile(
    r"spark-(write-[0-9a-f]{32}|[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}-\d+)-"
)
"""The Spark sink's producer-id prefixes: one batch write job's (`spark-write-<job>-`,
the job a random UUID) or one micro-batch's (`spark-<query id>-<batch>-`)."""


def _needs_admin(prefix: str) -> bool:
    """Whether forgetting `prefix` needs the admin credential: it is shorter than
    `MIN_FORGET_PREFIX`, or it could start a client's producer id ("g<ms hex>-<hex>":
    the generation is a time anyone can guess, and forgetting even one's own moves
    the queue's forgotten generation for every client), or it covers the Spark sink's
    producers of more than one job or micro-batch (`spark-write-`, exactly 12
    characters, forgot every batch write's producers, and a retried task then wrote
    its rows again)."""
    if len(prefix) < MIN_FORGET_PREFIX or may_start_generation_id(prefix):
        return True
    spark = "spark-"
    if spark.startswith(prefix) or prefix.startswith(spark):
        return SPARK_PREFIXES.match(prefix) is None
    return False


class _MembershipChange:
    """One `members add` or `members remove`, decided against the cluster's committed
    configuration. Each attempt first passes a barrier through the log (a `Tick`,
    which only lets time act): once this node applies it, its configuration holds every
    change committed before the request. If a change is still uncommitted in its log
    (`membership_settled`), it waits and tries again. Then it answers if the change is
    made already (the same change sent through another node, or an earlier attempt
    refused to us and committed all the same), refuses it if it cannot be made
    (`refused`: a removal of a node that is no member, an add of a name or address in
    use), or proposes it; proposed again while the leader refuses it (an earlier change
    not yet committed), until the deadline. A removal of the leader first asks it to
    hand leadership over (again if it leads again).

    (It proposed at once, against whatever this node's log said: a retried removal of
    a node removed meanwhile looked its address up, failed with KeyError in the core's
    timer, and stopped the node serving the request; a node that lagged behind, paused
    and not yet aware, answered "unknown_member" for a node added since, and its
    operator stopped a member. Simulator, seeds 17 and 104.)"""

    def __init__(
        self,
        core: NodeCore,
        conn: ConnectionCore,
        request_id: int,
        start: Callable[[Callable[[ProposalError | None], None]], None],
        *,
        made: Callable[[dict[str, str]], bool],
        refused: Callable[[dict[str, str]], MembershipError | None],
        timeout_hint: str = "",
    ) -> None:
        self.core = core
        self._timeout_hint = timeout_hint
        self.conn = conn
        self.request_id = request_id
        self._start = start
        self._made = made
        self._refused = refused
        self.attempts = 0
        self.deadline = core.clock() + MEMBERSHIP_DEADLINE_S
        self.step_down_first: str | None = None

    def start(self) -> None:
        self._attempt()

    def _later(self) -> None:
        if self.core.clock() + RETRY_EVERY_S < self.deadline:
            self.core.call_later(RETRY_EVERY_S, self._attempt)
        else:
            self._timed_out()

    def _attempt(self) -> None:
        replica = self.core.replica
        leader = self.step_down_first is not None and (
            replica.status()["leader"] == self.step_down_first
        )
        if leader:
            replica.ask_leader_to_step_down()
            self._later()
            return
        replica.propose(Tick(), self._barrier_passed)

    def _barrier_passed(self, _reply: Reply | None, error: ProposalError | None) -> None:
        replica = self.core.replica
        if error is not None or not replica.membership_settled():
            self._later()
            return
        members = replica.members()
        if self.attempts and self._made(members):
            self._done()
            return
        refusal = self._refused(members)
        if refusal is not None:
            self._fail(refusal)
        elif self._made(members):
            self._done()
        else:
            self.attempts += 1
            self._start(self._outcome)

    def _outcome(self, error: ProposalError | None) -> None:
        core = self.core
        if error is None:
            self._done()
        elif isinstance(error, OutcomeUnknownError):
            self._fail(MembershipError("outcome_unknown", f"{error}: check the members"))
        elif core.clock() + RETRY_EVERY_S < self.deadline:
            logger.info("membership change not applied (%s); trying again", error)
            core.call_later(RETRY_EVERY_S, self._attempt)
        else:
            self._timed_out()

    def _timed_out(self) -> None:
        self._fail(
            MembershipError(
                "timeout",
                f"the change was not committed within {MEMBERSHIP_DEADLINE_S} s"
                + self._timeout_hint,
            )
        )

    def _done(self) -> None:
        members = self.core.replica.members()
        self.core._push(self.conn, {"t": "reply", "id": self.request_id, "members": members})

    def _fail(self, error: MembershipError) -> None:
        self.core._error(self.conn, self.request_id, error.code, error.message)


def _reply_fields(reply: Reply | None) -> dict[str, Any]:
    if isinstance(reply, Enqueued):
        return {"offset": reply.offset, "count": reply.count, "duplicate": reply.duplicate}
    if isinstance(reply, Forgotten):
        return {"forgotten": reply.count}
    if isinstance(reply, QueuePurged):
        return {"messages": reply.messages}
    if isinstance(reply, QueueDeleted):
        return {"messages": reply.messages, "consumers": reply.consumers}
    created = getattr(reply, "created", None)
    return {} if created is None else {"created": created}


_HANDLERS: dict[str, Callable[[NodeCore, ConnectionCore, Frame], None]] = {
    "declare": NodeCore._declare,
    "publish_batch": NodeCore._publish_batch,
    "subscribe": NodeCore._subscribe,
    "cancel": NodeCore._cancel,
    "read": NodeCore._read,
    "commit_offset": NodeCore._commit_offset,
    "forget_producers": NodeCore._forget_producers,
    "purge_queue": NodeCore._purge_queue,
    "delete_queue": NodeCore._delete_queue,
    "status": NodeCore._status,
    "add_member": NodeCore._add_member,
    "remove_member": NodeCore._remove_member,
}


def _mib(n: int | None) -> str:
    return "?" if n is None else f"{n / (1024 * 1024):.1f} MiB"


__all__ = ["MembershipError", "NodeCore", "NodeShell", "ReplicaHandle", "encode_frame"]
