"""The node core, sans I/O: every decision a node makes towards its clients.

Inputs: client connections opened and closed, the bytes they send (`data_received`),
room to write again (`sent`), proposal outcomes (through the replica handle's
callbacks), the effects this node's replica applied (`effects_applied`), the ends of
queues it moved that reads wait on (`ends_moved`), a snapshot that replaced its state
(`state_replaced`), the data disk's free space (`disk_free`), and the time
(`run_timers`). Outputs: bytes to write to each connection (`ConnectionCore.take_output`,
with `NodeShell.wake` when there is something to do), commands proposed to the replica,
and timers (`next_timer`). No trio, socket, thread or clock inside: the trio shell
(`quorumq.server`) drives it on a real node, the simulator (`simulations`) on its own
network and clock. A rule lives here once, and both run it.

`NodeCore` is the switchboard: it keeps the connections and the handshake (a `welcome`
with a nonce; `hello` proves the client token, and for administrative verbs the admin
token, with an HMAC of it; a peer that has not said `hello` within the deadline, sends
a frame larger than 4 KiB before it, or sends garbage, is closed; at most
`max_unauthenticated` such peers at once, one more closing the oldest), reads each
connection's frames while it has room (back-pressure), and routes them, and the
replica's inputs, to its parts, each of which owns its state:

* `Publishes` (`publishes.py`): publishes to `Enqueue` / `EnqueueBatch` entries;
* `Settling` (`settling.py`): acks and nacks, gathered, held behind the one proposed,
  settled again after a leader change lost them;
* `Serving` (`serving.py`): subscribe and cancel, effects to frames, the resync after a
  snapshot install, `Down` for consumers no connection here serves;
* `Reading` (`reading.py`): reads from the local replica, waiting for a range to be
  applied;
* `Admin` (`admin.py`): offsets, forgetting producers, purging and deleting queues,
  status and audit;
* `Membership` (`membership.py`): adding and removing members;
* `DiskWatch` (`disk.py`): the disk alarm.

What they share (the replica, the shell, timers, answering a client, proposing a
request's command) is `Services` (`services.py`), which the core is.
"""

from __future__ import annotations

import heapq
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ..machine import Declare, Effect, QueueOptions
from ..wire.protocol import (
    PROTOCOL_VERSION,
    Frame,
    FrameDecoder,
    FrameQueue,
    ProtocolError,
    SizedFrame,
    encode_frame,
    proof_matches,
)
from .admin import Admin
from .config import NodeConfig
from .connection import ConnectionCore
from .disk import DiskWatch
from .membership import Membership, MembershipError
from .publishes import Gathered, Publishes
from .reading import Reading
from .reads import WaitingReads
from .services import NodeShell, ProposalCallback, ReplicaHandle, Services, Timer
from .serving import Serving
from .settling import SettleKey, Settling

logger = logging.getLogger(__name__)


class NodeCore(Services):
    """Everything a node decides towards its clients; see the module's docstring."""

    def __init__(
        self,
        config: NodeConfig,
        replica: ReplicaHandle,
        shell: NodeShell,
        clock: Callable[[], float],
        *,
        random_bytes: Callable[[int], bytes] = os.urandom,
        groups: Sequence[ReplicaHandle] = (),
    ) -> None:
        """`clock`: monotonic seconds (trio's, the simulator's). `random_bytes`: for
        nonces and this run's consumer ids (the simulator's are seeded). `groups`: this
        node's replica of each Raft group, `replica` (group 0) first; none: one group."""
        super().__init__(config, replica, shell, clock, random_bytes=random_bytes, groups=groups)
        self.unauthenticated: dict[ConnectionCore, None] = {}
        """The connections of `connections` that have not said `hello`, oldest first."""
        self._connection_counter = 0
        self._hello_deadlines: dict[ConnectionCore, Timer] = {}
        self.disk = DiskWatch(self)
        self.settling = Settling(self)
        self.reading = Reading(self)
        self.serving = Serving(self, self.settling, self.reading)
        self.publishes = Publishes(self, self.disk)
        self.admin = Admin(self, self.disk)
        self.membership = Membership(self, self.admin)

    # -------------------------------------------------- inputs, to the parts

    def effects_applied(self, index: int | None, effects: Iterable[Effect]) -> None:
        """The effects this node's replica applied at `index` (`Serving`)."""
        self.serving.effects_applied(index, effects)

    def state_replaced(self, group: int = 0) -> None:
        """This node's replica of `group` installed the leader's snapshot (`Serving`)."""
        self.serving.state_replaced(group)

    def ends_moved(self) -> None:
        """The replica moved the end of a queue reads wait on (`Reading`)."""
        self.reading.ends_moved()

    def disk_free(self, free_bytes: int | None) -> None:
        """The shell measured the data disk's free space (`DiskWatch`)."""
        self.disk.disk_free(free_bytes)

    def status(self, replica_status: dict[str, Any] | None = None) -> dict[str, Any]:
        """What `quorumq status` shows (`Admin.status`)."""
        return self.admin.status(replica_status)

    @property
    def reads(self) -> WaitingReads[ConnectionCore]:
        """Reads with `wait_ms` waiting for the replica to apply their range."""
        return self.reading.waiting

    @property
    def free_disk_bytes(self) -> int | None:
        return self.disk.free_disk_bytes

    @property
    def disk_alarm(self) -> bool:
        return self.disk.disk_alarm

    # ----------------------------------------------------------------- timers

    def next_timer(self) -> float | None:
        """When `run_timers` has something to run next (the clock's time), or None."""
        while self._timers and self._timers[0][2].cancelled:
            heapq.heappop(self._timers)
        first = self._timers[0][0] if self._timers else None
        read = self.reading.waiting.next_deadline()
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
        for read in self.reading.waiting.expired(now):
            self.reading.read_expired(read)

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
            self.error(conn, None, "hello_timeout", "no hello within the handshake deadline")
            self.close(conn, "no hello in time")

    def connection_lost(self, conn: ConnectionCore) -> None:
        """The connection is gone: its consumers are down."""
        conn.closed = True
        conn.drop_outbox()
        timer = self._hello_deadlines.pop(conn, None)
        if timer is not None:
            timer.cancel()
        self.connections.discard(conn)
        self.unauthenticated.pop(conn, None)
        self.reading.waiting.drop(conn)
        for consumer, queue in conn.consumers.items():
            if self.consumers.get(consumer) is conn:
                del self.consumers[consumer]
            self.serving.down(consumer, queue)
        conn.consumers.clear()

    def sent(self, conn: ConnectionCore, frames: int, cost: int) -> None:
        """The shell wrote `frames` frames taken with `take_output` (they cost `cost`):
        room again, maybe for requests that waited, or reads due to answer."""
        was_full = conn.full
        conn.sent(frames, cost)
        if was_full and not conn.full:
            self.room_again(conn)

    def room_again(self, conn: ConnectionCore) -> None:
        while not conn.full and not conn.done:  # reads that came out: before the requests
            read = self.reading.waiting.next_due(conn)
            if read is None:
                break
            self.reading.answer_read(conn, read.frame)
        self.handle_buffered(conn)
        self.shell.wake(conn)

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
        publishes = Gathered()
        acks: dict[SettleKey, list[int]] = {}
        while not conn.done:
            try:
                for frame in conn.decoder.frames():
                    kind = frame["t"]
                    if not conn.greeted:
                        self._hello(conn, frame)
                    elif kind == "publish":
                        self.publishes.gather_publish(conn, publishes, frame)
                    elif kind in ("ack", "nack"):
                        self.publishes.flush_publishes(conn, publishes)
                        self.settling.gather_ack(conn, acks, frame)
                    else:
                        self.publishes.flush_publishes(conn, publishes)
                        self.settling.flush_acks(conn, acks)
                        self._handle(conn, frame)
                    if conn.full or conn.done:
                        break
                break
            except ProtocolError as e:
                self.error(conn, e.request_id, e.code, e.message)
                # Before hello every protocol error is fatal: an unauthenticated peer got
                # an error frame per garbage frame (20,000 five-byte frames queued 1.6 MB).
                if e.fatal or not conn.greeted:
                    self.close(conn, f"protocol error: {e.message}")
                    break
                if conn.full:
                    break
        self.publishes.flush_publishes(conn, publishes)
        self.settling.flush_acks(conn, acks)

    def _hello(self, conn: ConnectionCore, frame: Frame) -> None:
        config = self.config
        if frame["t"] != "hello":
            self.error(conn, frame.get("id"), "hello_first", "the first frame must be hello")
            self.close(conn, "no hello")
            return
        if frame["v"] != PROTOCOL_VERSION:
            self.error(conn, None, "version", f"this node speaks protocol {PROTOCOL_VERSION}")
            self.close(conn, "protocol version mismatch")
            return
        token = config.token
        trusted = conn.local  # in the node's own process (see `connection_made`)
        if (
            token is not None
            and not trusted
            and not proof_matches(token, conn.nonce, frame["proof"])
        ):
            logger.warning("client connection %d refused: wrong token", conn.number)
            self.error(conn, None, "auth_failed", "wrong token")
            self.close(conn, "authentication failed")
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
        self.push(conn, {"t": "reply", "id": 0, "node": self.node_id})

    def _handle(self, conn: ConnectionCore, frame: Frame) -> None:
        kind = frame["t"]
        handler = _HANDLERS.get(kind)
        if handler is None:
            self.error(
                conn, frame.get("id"), "unexpected_frame", f"a client does not send {kind!r}"
            )
            return
        try:
            handler(self, conn, frame)
        except (TypeError, ValueError) as e:
            self.error(conn, frame.get("id", 0), "invalid", str(e))

    def _declare(self, conn: ConnectionCore, frame: Frame) -> None:
        options = frame["options"]
        if any(not isinstance(k, str) for k in options):
            raise ValueError("option names must be strings")
        command = Declare(queue=frame["queue"], options=QueueOptions(**options))
        self.propose_for(conn, frame["id"], command)


_HANDLERS: dict[str, Callable[[NodeCore, ConnectionCore, Frame], None]] = {
    "declare": NodeCore._declare,
    "publish_batch": lambda core, conn, frame: core.publishes.publish_batch(conn, frame),
    "subscribe": lambda core, conn, frame: core.serving.subscribe(conn, frame),
    "cancel": lambda core, conn, frame: core.serving.cancel(conn, frame),
    "read": lambda core, conn, frame: core.reading.read(conn, frame),
    "commit_offset": lambda core, conn, frame: core.admin.commit_offset(conn, frame),
    "forget_producers": lambda core, conn, frame: core.admin.forget_producers(conn, frame),
    "purge_queue": lambda core, conn, frame: core.admin.purge_queue(conn, frame),
    "delete_queue": lambda core, conn, frame: core.admin.delete_queue(conn, frame),
    "status": lambda core, conn, frame: core.admin.answer_status(conn, frame),
    "add_member": lambda core, conn, frame: core.membership.add_member(conn, frame),
    "remove_member": lambda core, conn, frame: core.membership.remove_member(conn, frame),
}
"""Frame type -> the part that answers it (publishes, acks and nacks are gathered by
`handle_buffered` first)."""

__all__ = [
    "MembershipError",
    "NodeCore",
    "NodeShell",
    "ProposalCallback",
    "ReplicaHandle",
    "encode_frame",
]
