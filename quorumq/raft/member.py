"""PySyncObj made safe and fast enough for a broker: the Raft member of a real node.

The Raft rules it changes (prompt sends, the stale-reply fixes, truncation only at a
conflict, durability points, raw commands, our snapshot encoding) are in
`rules.RaftRules`, shared with the simulator. What this module adds for a real node:

* durability: our `DurableJournal`; with `fsync="always"` a follower fsyncs before it
  acknowledges entries and a leader fsyncs its own entries before the next tick counts
  them toward commit. Snapshots are written and fsynced by us, in a forked child
  (`_write_snapshots_in_a_child`), so that the Raft thread goes on meanwhile. The
  leader's snapshot is
  received beside the node's own, and installed only if the shared rule takes it
  (one not ahead of what the node applied would make it apply entries again).
* a wake pipe: a submitted command wakes the tick loop at once.
* our own tick thread (PySyncObj's stops when the thread that built the object exits).
* Raft traffic: sealed with our cipher (`cipher.py`: AES-CTR + HMAC-SHA256, raw bytes)
  instead of Fernet, and not zlib-compressed: together they were most of a busy leader's
  CPU. Authentication failures are logged, on both sides (PySyncObj drops them silently).
* named members: every Raft node carries the quorumq node name it runs, in the initial
  configuration, in PySyncObj's membership log entries and in our snapshots, so a
  member added or removed online is known by name on every replica. A member may ask
  the leader to hand leadership over (before the leader is removed).
* the first configuration: the members a node first runs with are recorded in its data
  directory, and a later start given other peers is refused (`first_configuration.py`):
  before its first snapshot a node counts votes over its first configuration, and one
  restarted with another `--peer` list counted them over other voters than the others.

camelCase names here are PySyncObj's; they stay inside this module.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import gc
import glob
import logging
import os
import pickle
import queue
import signal
import socket
import struct
import threading
import time
import warnings
import zlib
from collections.abc import Callable, Mapping
from typing import Any, Literal, NamedTuple, NoReturn

import pysyncobj.syncobj as _syncobj
import pysyncobj.tcp_connection as _tcp
from pysyncobj import FAIL_REASON, SyncObjConf, SyncObjException
from pysyncobj.config import SERIALIZER_STATE
from pysyncobj.node import TCPNode
from pysyncobj.poller import POLL_EVENT_TYPE
from pysyncobj.tcp_connection import CONNECTION_STATE, TcpConnection
from pysyncobj.tcp_server import TcpServer
from pysyncobj.transport import TCPTransport

from ..codec import UnreadableEntryError
from .cipher import RaftCipher, ThrottledWarning
from .files import OS_FILES
from .first_configuration import settle_first_configuration
from .journal import DurableJournal, JournalDamagedError, JournalFailedError, fsync_directory
from .rules import (
    MAX_COMMAND_BYTES,
    RAW_COMMAND,
    Entry,
    RaftRules,
    decode_snapshot,
)

logger = logging.getLogger(__name__)

SNAPSHOT_DEADLINE_S = 600.0
"""A snapshot write running longer is killed and failed: a child that never ended would
stop compaction for good, silently, and the journal would grow without bound."""
SNAPSHOT_RETRY_S = (1.0, 60.0)
"""After a failed snapshot write the next waits 1 s, doubling up to 60 s: each try forks
and encodes the whole state."""

_PR_SET_PDEATHSIG = 1
try:
    _prctl: Any = ctypes.CDLL(None, use_errno=True).prctl  # looked up here, not in a child
except (OSError, AttributeError):  # not Linux
    _prctl = None

# Python 3.12+ warns that a fork with threads may deadlock the child. Our children (the
# snapshot writer, the audit) run the encoder and file writes only, no locks.
warnings.filterwarnings(
    "ignore", message=r".*use of fork\(\) may lead to deadlocks", category=DeprecationWarning
)

Fsync = Literal["always", "batch", "never"]
__all__ = ["MAX_COMMAND_BYTES", "NOT_APPLIED", "RAW_COMMAND", "Fsync", "RaftMember"]

# --------------------------------------------------------------- module hooks

_JOURNALS: dict[str, DurableJournal] = {}
_original_create_journal = _syncobj.createJournal


def _create_journal(path: str | None) -> Any:
    if path is not None and path in _JOURNALS:
        return _JOURNALS.pop(path)
    return _original_create_journal(path)


MAX_RAFT_MESSAGE_BYTES = 32 * 1024 * 1024
"""The longest Raft message a node reads (AppendEntries batches are at most 4 MiB plus
one entry of at most 3 MiB; snapshot chunks are smaller). PySyncObj read whatever length
a peer declared, up to 2 GiB, before it authenticated anything."""
MAX_UNAUTHENTICATED = 32
"""Incoming Raft connections that have not yet shown the cluster secret, at most: one
more closes the oldest of them."""
RAFT_HANDSHAKE_S = 5.0
"""An incoming Raft connection that has not shown the cluster secret by then is closed."""


RAFT_LISTEN_BACKLOG = 128
"""Pending connections the Raft port's socket queues (PySyncObj listened with 5: a flood
of connections filled it, and a real peer's dials were dropped until it drained)."""
ACCEPTS_PER_WAKE = 64
"""Connections the Raft port accepts each time it is readable (PySyncObj took one: a
backlog of 1,000 took longer than 30 s to drain, ahead of any real peer)."""


class _BoundedTcpServer(TcpServer):  # type: ignore[misc]
    """PySyncObj's Raft server socket, with a real backlog, accepting what is queued
    (up to `ACCEPTS_PER_WAKE`) at each wake, and never unbinding because an accept
    failed for want of a descriptor or memory (PySyncObj unbound, and the node stopped
    hearing its peers until the next bind retry)."""

    _busy = ThrottledWarning(
        logger, "the Raft port cannot accept a connection: out of file descriptors or memory"
    )

    def bind(self) -> None:
        if "_spare" not in self.__dict__:
            with contextlib.suppress(OSError):
                self.__dict__["_spare"] = os.open(os.devnull, os.O_RDONLY)
        try:
            super().bind()
        except OSError:
            # PySyncObj left the socket it made open, referenced from a cycle: a failed
            # `quorumq.Node(...).start()` on a taken port kept it until a collection
            self.unbind()
            raise
        self._TcpServer__socket.listen(RAFT_LISTEN_BACKLOG)

    def unbind(self) -> None:
        super().unbind()
        spare = self.__dict__.pop("_spare", None)
        if spare is not None:
            os.close(spare)

    def _TcpServer__onNewConnection(self, descr: Any, event: int) -> None:
        if event & POLL_EVENT_TYPE.READ:
            for _ in range(ACCEPTS_PER_WAKE):
                try:
                    sock, _addr = self._TcpServer__socket.accept()
                except BlockingIOError:
                    break
                except OSError as e:
                    if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                        self._busy()
                        self._shed_one()  # (the socket stays readable: not a busy loop)
                        break
                    if e.errno == errno.ECONNABORTED:
                        continue
                    self.unbind()
                    return
                self._accepted(sock)
        if event & POLL_EVENT_TYPE.ERROR:
            self.unbind()

    def _shed_one(self) -> None:
        """Out of descriptors: free the spare one, accept the oldest waiting connection
        and close it at once, and take the spare back. PySyncObj's poller is level-
        triggered, so leaving it queued would wake the Raft thread in a loop."""
        spare = self.__dict__.pop("_spare", None)
        if spare is not None:
            os.close(spare)
        try:
            sock, _addr = self._TcpServer__socket.accept()
            sock.close()
        except OSError:
            pass
        with contextlib.suppress(OSError):
            self.__dict__["_spare"] = os.open(os.devnull, os.O_RDONLY)

    def _accepted(self, sock: socket.socket) -> None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self._TcpServer__sendBufferSize)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self._TcpServer__recvBufferSize)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setblocking(False)
        except OSError:
            sock.close()  # reset before it was set up
            return
        conn = TcpConnection(
            poller=self._TcpServer__poller,
            socket=sock,
            timeout=self._TcpServer__connectionTimeout,
            sendBufferSize=self._TcpServer__sendBufferSize,
            recvBufferSize=self._TcpServer__recvBufferSize,
            keepalive=self._TcpServer__keepalive,
        )
        self._TcpServer__onNewConnectionCallback(conn)


class _Transport(TCPTransport):  # type: ignore[misc]
    """PySyncObj's TCP transport, saying why a peer hangs up during the handshake, and
    bounding what peers that have not authenticated can make a node hold: at most
    `MAX_UNAUTHENTICATED` such connections, each for `RAFT_HANDSHAKE_S` at most (3
    connections each sending a 2 GiB length and 100 MiB took a node from 31 to 427 MiB,
    for good; messages are capped at `MAX_RAFT_MESSAGE_BYTES` on every connection).

    A dialling node sends its key sealed with its cluster secret; a peer with another
    secret cannot open it and closes the connection without a word. Seen from the
    dialling side, that is a connection accepted and then closed before the peer's key
    came back, again at every retry: log it, so the node with the wrong secret says so
    whichever side dials. (A peer that dies or restarts mid-handshake hangs up once.)"""

    HANG_UPS_BEFORE_WARNING = 3

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._handshaking: set[int] = set()
        self._arrived: dict[Any, float] = {}
        """Incoming connections not yet authenticated, by the time they arrived (in order)."""
        self._hang_ups: dict[Any, int] = {}
        """Per peer: handshakes in a row it hung up on."""
        self._hung_up = ThrottledWarning(
            logger,
            "a Raft peer keeps hanging up during the handshake: it failed authentication: "
            "a peer uses another cluster secret (or is not a quorumq node)",
        )
        super().__init__(*args, **kwargs)

    def _createServer(self) -> None:
        super()._createServer()
        self._server.__class__ = _BoundedTcpServer  # (not bound yet: binds as ours)

    def _onNewIncomingConnection(self, conn: Any) -> None:
        super()._onNewIncomingConnection(conn)
        self._arrived[conn] = _tcp.monotonicTime()
        while len(self._arrived) > MAX_UNAUTHENTICATED:
            oldest = next(iter(self._arrived))
            self._drop_unauthenticated(oldest, "too many connections without the secret")

    def _onIncomingMessageReceived(self, conn: Any, message: Any) -> None:
        super()._onIncomingMessageReceived(conn, message)
        if conn not in self._unknownConnections:  # it named itself: authenticated
            self._arrived.pop(conn, None)

    def _onTick(self) -> None:
        super()._onTick()
        if self._arrived:
            deadline = _tcp.monotonicTime() - RAFT_HANDSHAKE_S
            for conn, arrived in list(self._arrived.items()):
                if arrived < deadline:
                    self._drop_unauthenticated(conn, "no handshake in time")

    def _drop_unauthenticated(self, conn: Any, why: str) -> None:
        self._arrived.pop(conn, None)
        logger.info("closing an incoming Raft connection: %s", why)
        conn.disconnect()

    def _onOutgoingConnected(self, conn: Any) -> None:
        if self._syncObj.encryptor:
            self._handshaking.add(id(conn))
        super()._onOutgoingConnected(conn)

    def _onOutgoingMessageReceived(self, conn: Any, message: Any) -> None:
        if id(conn) in self._handshaking:
            self._handshaking.discard(id(conn))
            self._hang_ups.pop(self._connToNode(conn), None)
        super()._onOutgoingMessageReceived(conn, message)

    def addNode(self, node: Any) -> None:
        """Once per node: a leader reached outside the configuration
        (`RaftRules._reach_leader`) is added again when its entry is applied, and
        PySyncObj's second connection object would orphan the first."""
        if node in self._nodes:
            return
        super().addNode(node)

    def dropNode(self, node: Any) -> None:
        """PySyncObj's, telling the member the connection is gone: it forgot the
        connection before closing it, so the member took the node as connected for
        good (and forwarded proposals to a leader it no longer had a connection to)."""
        connected = node in self._connections and self._connections[node].state == (
            CONNECTION_STATE.CONNECTED
        )
        super().dropNode(node)
        if connected:
            self._onNodeDisconnected(node)

    def _onDisconnected(self, conn: Any) -> None:
        self._arrived.pop(conn, None)
        if id(conn) in self._handshaking:
            self._handshaking.discard(id(conn))
            peer = self._connToNode(conn)
            self._hang_ups[peer] = self._hang_ups.get(peer, 0) + 1
            if self._hang_ups[peer] >= self.HANG_UPS_BEFORE_WARNING:
                self._hung_up()
        super()._onDisconnected(conn)


class _DropBindFailure(logging.Filter):
    """PySyncObj logs a traceback when it cannot bind, and a warning at every tick while
    compaction fails; RaftMember reports each in one line (`compaction_error`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() not in (
            "failed to perform initialization",
            "Failed to store full dump",
        )


logging.getLogger("pysyncobj.syncobj").addFilter(_DropBindFailure())


def _send(self: Any, message: Any) -> None:
    """PySyncObj's `TcpConnection.send`, without compression: zlib level 3 was the
    largest single cost of a busy leader (message bodies are often incompressible).
    The receiver's `zlib.decompress` reads the stored blocks as before."""
    if self.sendRandKey:
        message = (self.sendRandKey, message)
    data = zlib.compress(pickle.dumps(message), 0)
    if self.encryptor:
        data = self.encryptor.encrypt_at_time(data, int(_tcp.monotonicTime()))
    self._TcpConnection__writeBuffer += struct.pack("i", len(data)) + data
    self._TcpConnection__trySendBuffer()


_read_more = TcpConnection._TcpConnection__processRead


def _process_read(self: Any) -> bool:
    """PySyncObj's read, bounded: a declared length outside (0, `MAX_RAFT_MESSAGE_BYTES`]
    closes the connection, and reading stops once a whole message's worth is buffered
    (PySyncObj read everything the peer sent before it parsed anything)."""
    more = bool(_read_more(self))
    buffer = self._TcpConnection__readBuffer
    if len(buffer) >= 4:
        (length,) = struct.unpack_from("i", buffer)
        if not 0 < length <= MAX_RAFT_MESSAGE_BYTES:
            logger.warning("closing a Raft connection that announced a %d-byte message", length)
            self.disconnect()
            return False
        if len(buffer) > 4 + length:
            return False  # parse what is there first
    return more


_syncobj.createJournal = _create_journal
_syncobj.getEncryptor = RaftCipher
TcpConnection.send = _send
TcpConnection._TcpConnection__processRead = _process_read


def _named_node(address: str, name: str) -> Any:
    return TCPNode(address, name=name)


# ------------------------------------------------------------------- outcomes

NOT_APPLIED = {
    FAIL_REASON.QUEUE_FULL: "the proposal queue is full",
    FAIL_REASON.MISSING_LEADER: "no leader",
    FAIL_REASON.NOT_LEADER: "the node it was sent to is no longer leader",
    FAIL_REASON.REQUEST_DENIED: "refused",
    FAIL_REASON.DISCARDED: "discarded by a leader change",
}
"""Failure reasons after which the command is known not to be in the log."""


class RaftMember(RaftRules):
    """One Raft member: bytes in (`propose`), committed bytes out (`apply`), in log order."""

    def __init__(
        self,
        name: str,
        members: Mapping[str, str],
        *,
        data_dir: str,
        password: str | None,
        fsync: Fsync,
        apply: Callable[[int, bytes], Any],
        snapshot: Callable[[], bytes],
        restore: Callable[[bytes], None],
        on_tick: Callable[[], None],
        raft_timeouts: tuple[float, float] = (0.25, 0.6),
        compaction_entries: int = 50_000,
        tick_period: float = 0.05,
    ) -> None:
        address = members[name]
        if not address.rsplit(":", 1)[0]:
            raise ValueError(f"raft address {address!r} needs a host")
        os.makedirs(data_dir, exist_ok=True)
        self.data_dir = data_dir
        self.fsync = fsync
        journal_path = os.path.join(data_dir, "raft.log")
        snapshot_path = os.path.join(data_dir, "snapshot")
        # the node runs with the members recorded at its first start; checked before
        # anything is opened, so a refusal (`PeersChangedError`) leaves nothing to close
        members = settle_first_configuration(
            OS_FILES,
            data_dir,
            members,
            holds_raft_state=os.path.exists(journal_path + ".meta")
            or os.path.exists(snapshot_path),
        )
        self.journal = DurableJournal(
            journal_path, durable=fsync != "never", strict=fsync == "always"
        )
        _JOURNALS[journal_path] = self.journal
        self._apply = apply
        self._snapshot = snapshot
        self._restore = restore
        self._on_tick = on_tick
        self._tick_period = tick_period
        self._stopping = threading.Event()
        self.fatal_error: BaseException | None = None
        """Why this member stopped by itself (its journal failed): the node must stop."""
        self.compaction_error: str | None = None
        """Why the last snapshot could not be written (None: the last one was), for status."""
        self._calls: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        for fd in (self._wake_r, self._wake_w):
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_NONBLOCK)
        conf = SyncObjConf(
            password=password,
            autoTick=False,
            journalFile=journal_path,
            fullDumpFile=snapshot_path,
            serializer=_written_by_a_child,  # (replaced: `_write_snapshots_in_a_child`)
            deserializer=self._read_snapshot,
            bindAddress=address,
            appendEntriesBatchSizeBytes=4 * 1024 * 1024,
            logCompactionMinEntries=compaction_entries,
            logCompactionMinTime=10**9,
            raftMinTimeout=raft_timeouts[0],
            raftMaxTimeout=raft_timeouts[1],
            appendEntriesPeriod=min(0.1, raft_timeouts[0] / 4),
            leaderFallbackTimeout=2 * raft_timeouts[1],  # check-quorum: see RaftRules
            connectionRetryTime=0.5,
            connectionTimeout=2.0,
            commandsWaitLeader=True,
            dynamicMembershipChange=True,
            bindRetryTime=0.2,
            maxBindRetries=5,  # PySyncObj's default, 0, retries forever: a taken port hangs
        )
        try:
            super().__init__(
                _named_node(address, name),
                [_named_node(a, n) for n, a in members.items() if n != name],
                conf,
                transportClass=_Transport,
            )
        except Exception as e:
            _JOURNALS.pop(journal_path, None)
            self.journal._destroy()
            os.close(self._wake_r)
            os.close(self._wake_w)
            if isinstance(e, SyncObjException) and "BindError" in str(e.errorCode):
                raise OSError(f"cannot listen for Raft traffic on {address} (in use?)") from None
            raise
        try:
            self.check_stored_state()
        except Exception:
            self._doDestroy()
            os.close(self._wake_r)
            os.close(self._wake_w)
            raise
        self._write_snapshots_in_a_child()
        self._close_snapshot_transmissions()
        self._refuse_stale_snapshots()
        self.addOnTickCallback(self._tick_callback)
        self._poller.subscribe(self._wake_r, self._drain_wake, POLL_EVENT_TYPE.READ)
        self._poller.poll = self._poll_with_group_commit(self._poller.poll)
        self._thread = threading.Thread(target=self._tick_loop, name=f"raft-{address}", daemon=True)

    def start(self) -> None:
        """Start ticking (a separate step, so the owner is set up before the first tick
        calls back into it)."""
        self._thread.start()

    # ------------------------------------------------------------ tick thread

    def _tick_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                # wake for the election deadline too (just past it: PySyncObj elects
                # once its clock is beyond the deadline), not up to a tick period late
                until_election = self.until_election_s()
                wait = self._tick_period if until_election is None else until_election + 0.001
                self.doTick(min(self._tick_period, wait))
            except (JournalFailedError, JournalDamagedError, UnreadableEntryError) as e:
                # Nothing more may be acknowledged (or applied): stop taking part at once.
                self.fatal_error = e
                logger.critical("raft member stopped: %s", e)
                self._stopping.set()
            except Exception:
                logger.exception("raft tick failed")
                time.sleep(self._tick_period)
        try:
            try:
                self.snapshot_writer.stop()
            finally:
                self._doDestroy()
        finally:
            os.close(self._wake_r)
            os.close(self._wake_w)

    def stop(self) -> None:
        """Stop ticking, close connections and the journal (fsyncing it). Idempotent."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self._wake()
        if self._thread.ident is None:  # never started: tear down here
            self._tick_loop()
        elif threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)

    def _poll_with_group_commit(self, poll: Callable[[float], None]) -> Callable[[float], None]:
        """PySyncObj's poll, answering the AppendEntries it reads after one sync."""

        def poll_and_answer(timeout: float) -> None:
            self.hold_replies()
            try:
                poll(timeout)
            finally:
                self.release_replies()

        return poll_and_answer

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"!")

    def _drain_wake(self, fd: int, _event: int) -> None:
        try:
            while os.read(fd, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _tick_callback(self) -> None:
        if self.fsync != "never":
            self.journal.sync()  # the no-op of a new term; "batch" mode syncs only here
        self.push_commit_index()
        self.keep_peer_connections_alive()
        while True:
            try:
                call = self._calls.get_nowait()
            except queue.Empty:
                break
            call()
        self._on_tick()

    # ------------------------------------------------------------- the rules

    def apply_raw(self, index: int, payload: bytes) -> Any:
        return self._apply(index, payload)

    def make_durable(self) -> None:
        if self.fsync == "always":
            self.journal.sync()

    def tick_soon(self) -> None:
        self._wake()

    def _applyCommand(self, command: bytes, callback: Any, commandType: int | None = None) -> None:
        super()._applyCommand(command, callback, commandType)
        self._wake()

    # ------------------------------------------------------------- membership

    def make_node(self, name: str, address: str) -> Any:
        return _named_node(address, name)

    def run_on_tick_thread(self, call: Callable[[], None]) -> None:
        self._calls.put(call)
        self._wake()

    # -------------------------------------------------------------- snapshots

    def _write_snapshots_in_a_child(self) -> None:
        """Write each snapshot in a forked child, while the Raft thread goes on.

        Written on the Raft thread, a snapshot stopped the node for as long as encoding
        the whole state took: 0.25 s at 15 MB and 1.2 s at 30 MB (the retained stream),
        and every node compacts at the same log index, so the whole cluster stopped at
        once, followers stood for election, and deliveries stalled for up to 1.6 s
        (seen with timestamps at 5,000 msg/s). So PySyncObj's snapshot store writes
        through a `SnapshotWriter`: the Raft thread forks, the child writes, and only
        once the snapshot is stored does PySyncObj compact the journal behind it."""
        serializer = self._SyncObj__serializer
        self.snapshot_writer = SnapshotWriter(self, serializer._Serializer__fileName)
        serializer.serialize = self.snapshot_writer.serialize
        serializer.checkSerializing = self.snapshot_writer.check

    def _cancel_snapshot(self) -> None:
        """Kill the child writing a snapshot, and forget what it wrote: a leader's
        snapshot installed now is ahead of it."""
        self.snapshot_writer.cancel()

    def snapshot_writing(self) -> bool:
        """Whether a child is writing a snapshot now."""
        return self.snapshot_writer.child is not None

    def _read_snapshot(self, path: str) -> tuple[Any, Any, Any]:
        try:
            with open(path, "rb") as f:
                stored = decode_snapshot(f.read(), path)
            self._restore(stored.machine)
        except Exception as e:
            self._snapshot_load_error = e  # PySyncObj swallows it: RaftRules raises it
            raise
        if self.fsync != "never":
            fsync_directory(self.data_dir)
        self.took_snapshot(stored)
        return (stored.last, stored.prev, {_named_node(a, n) for a, n in stored.members})

    def stored_snapshot(self) -> tuple[Entry, Entry] | None:
        path = os.path.join(self.data_dir, "snapshot")
        try:
            with open(path, "rb") as f:
                stored = decode_snapshot(f.read(), path)
        except FileNotFoundError:
            return None
        except ValueError as e:
            raise JournalDamagedError(
                f"{e}: the node refuses to start. Restore the file, or remove the node from "
                "the cluster, move its data directory away and add it again empty, at a "
                "new Raft address"
            ) from None
        return stored.last, stored.prev

    def _refuse_stale_snapshots(self) -> None:
        """Receive the leader's snapshot beside ours, and install it only if the shared
        rule (`RaftRules.accept_leader_snapshot`) takes it: only if it is ahead of what
        this node applied. PySyncObj writes the incoming snapshot over the node's own
        first, so even a refused one would have broken the node's next start (its
        journal no longer follows its snapshot)."""
        serializer = self._SyncObj__serializer
        path: str = serializer._Serializer__fileName
        incoming_path = path + ".incoming"
        incoming: list[Any] = [None]

        def set_transmission_data(data: Any) -> bool:
            if data is None:
                return False
            chunk, is_first, is_last = data
            try:
                if is_first:
                    if incoming[0] is not None:
                        incoming[0].close()
                    incoming[0] = open(incoming_path, "wb")  # noqa: SIM115 - kept across chunks
                elif incoming[0] is None:
                    return False
                incoming[0].write(chunk)
                if not is_last:
                    return False
                f, incoming[0] = incoming[0], None
                f.flush()
                if self.fsync != "never":
                    os.fsync(f.fileno())
                f.close()
                with open(incoming_path, "rb") as r:
                    last = decode_snapshot(r.read(), incoming_path).last
            except Exception:
                logger.exception("receiving the leader's snapshot failed")
                incoming[0] = None
                return False
            if not self.accept_leader_snapshot(last[1], last[2]):
                os.unlink(incoming_path)
                return False
            self._cancel_snapshot()  # its snapshot is behind this one: it must not land
            os.replace(incoming_path, path)
            if self.fsync != "never":
                fsync_directory(self.data_dir)
            return True

        serializer.setTransmissionData = set_transmission_data

    def _close_snapshot_transmissions(self) -> None:
        """PySyncObj opens the snapshot file to stream it to a lagging follower and drops
        the file object unclosed when the transfer ends or a new snapshot replaces it.
        Close those files ourselves."""
        serializer = self._SyncObj__serializer
        get_data = serializer.getTransmissionData
        check = serializer.checkSerializing

        def table() -> dict[Any, Any]:
            return serializer._Serializer__transmissions  # type: ignore[no-any-return]

        def close(transmission: Any) -> None:
            if transmission is not None and "file" in transmission:
                transmission["file"].close()

        def get_transmission_data(transmission_id: Any) -> Any:
            before = table().get(transmission_id)
            result = get_data(transmission_id)
            if before is not None and transmission_id not in table():
                close(before)
            return result

        def check_serializing() -> Any:
            before = table()
            result = check()
            if table() is not before:
                for transmission in before.values():
                    close(transmission)
            return result

        serializer.getTransmissionData = get_transmission_data
        serializer.checkSerializing = check_serializing


class _Child(NamedTuple):
    pid: int
    through: int
    """The log index PySyncObj compacts through once this snapshot is stored."""
    file: str
    failures: int
    """The read end of the pipe the child tells a failure through."""
    started: float


class SnapshotWriter:
    """PySyncObj's snapshot store writes through this (`serialize`, `check`): each
    snapshot in a forked child, as `Replica.audit` encodes the state (the page tables
    are copied, the memory is shared copy-on-write; pages the node writes meanwhile are
    copied, so a write costs up to the state's memory again).

    The child holds the state as it was at the last applied entry, encodes it, writes
    and fsyncs it to a file of its own beside the snapshot, and exits. At a later tick
    `check` sees it exit, moves the file over the snapshot and syncs the directory;
    only then does PySyncObj compact the journal. Meanwhile a follower behind the
    compacted log is sent the previous snapshot, still in place. A leader's snapshot
    installed meanwhile, a write running past `SNAPSHOT_DEADLINE_S`, or the node
    stopping kills the child. A failure (the fork, the encoder, the disk) is one log
    line, shows as the node's `compaction_error`, and is tried again after
    `SNAPSHOT_RETRY_S`, doubling: the journal is kept whole meanwhile. Nothing here
    blocks the Raft thread: a child killed during an fsync dies only when the fsync
    ends, so killed children are reaped at later ticks."""

    def __init__(self, member: RaftMember, path: str) -> None:
        self.member = member
        self.path = path
        self.child: _Child | None = None
        self.killed: list[int] = []
        """Children killed and not reaped yet."""
        self.failures = 0
        """Failed writes since the last that succeeded."""
        self.retry_at = 0.0
        self._written = 0
        for stale in glob.glob(glob.escape(path) + ".writing-*"):  # a crash's leftovers
            with contextlib.suppress(OSError):
                os.unlink(stale)

    def serialize(self, data: tuple[Any, ...], index: int) -> None:
        """Start writing the snapshot PySyncObj asks for (its last two applied entries
        and its members), unless one is being written or a failed one waits to retry."""
        self._reap_killed()
        if self.child is not None or time.monotonic() < self.retry_at:
            return
        self._written += 1
        file = f"{self.path}.writing-{os.getpid()}-{self._written}"
        parent = os.getpid()
        try:
            failures, write_end = os.pipe()
        except OSError as e:
            self._failed(f"cannot start the snapshot writer: {e}")
            return
        try:
            os.set_blocking(failures, False)
            pid = os.fork()
        except OSError as e:
            os.close(failures)
            self._failed(f"cannot start the snapshot writer: {e}")
            return
        finally:
            if os.getpid() == parent:
                os.close(write_end)
        if pid == 0:
            _write_snapshot_in_child(self.member, data[1:], file, write_end, parent)
        self.child = _Child(pid, index, file, failures, time.monotonic())

    def check(self) -> tuple[int, int | None]:
        """PySyncObj's `checkSerializing`: whether a write runs, has just stored its
        snapshot (SUCCESS: compact through the index), or failed."""
        self._reap_killed()
        child = self.child
        if child is None:
            return SERIALIZER_STATE.NOT_SERIALIZING, None
        try:
            done, status = os.waitpid(child.pid, os.WNOHANG)
        except ChildProcessError:
            # something else in the process reaped it (SIGCHLD ignored, a waitpid(-1)):
            # the file tells whether it was written whole
            done, status = child.pid, None
        if done == 0:
            if time.monotonic() - child.started < SNAPSHOT_DEADLINE_S:
                return SERIALIZER_STATE.SERIALIZING, child.through
            self.cancel()
            return self._failed(
                f"the snapshot writer ran for more than {SNAPSHOT_DEADLINE_S:.0f} s and was killed",
                child.through,
            )
        self.child = None
        try:
            failure = os.read(child.failures, 4096).decode(errors="replace")
        except BlockingIOError:  # (another process forked meanwhile holds the write end)
            failure = ""
        finally:
            os.close(child.failures)
        if status == 0 or (status is None and self._whole(child)):
            try:
                os.replace(child.file, self.path)
                if self.member.fsync != "never":
                    fsync_directory(self.member.data_dir)
            except OSError as e:
                failure = f"storing the snapshot failed: {e}"
            else:
                self._stored(child)
                return SERIALIZER_STATE.SUCCESS, child.through
        elif not failure:
            failure = "the snapshot writer " + (
                _ended(status) if status is not None else "left no whole snapshot"
            )
        with contextlib.suppress(OSError):
            os.unlink(child.file)
        return self._failed(failure, child.through)

    def _whole(self, child: _Child) -> bool:
        """Whether `child`'s file, its exit status unknown, is its snapshot, whole and
        synced."""
        try:
            with open(child.file, "rb") as f:
                data = f.read()
                if self.member.fsync != "never":
                    os.fsync(f.fileno())
            return decode_snapshot(data, child.file).prev[1] == child.through
        except (OSError, ValueError):
            return False

    def _stored(self, child: _Child) -> None:
        member = self.member
        member.compaction_error = None
        self.failures = 0
        self.retry_at = 0.0
        member._SyncObj__serializer._Serializer__transmissions = {}  # transfers start over
        logger.info(
            "stored a snapshot of log entry %d (%d bytes) in %.2f s",
            child.through + 1,
            os.path.getsize(self.path),
            time.monotonic() - child.started,
        )

    def _failed(self, failure: str, index: int | None = None) -> tuple[int, int | None]:
        member = self.member
        if failure != member.compaction_error:  # one line per new failure, not per try
            logger.error("log compaction failed, the journal keeps growing: %s", failure)
        member.compaction_error = failure
        self.failures += 1
        first, most = SNAPSHOT_RETRY_S
        self.retry_at = time.monotonic() + min(most, first * 2 ** (self.failures - 1))
        return SERIALIZER_STATE.FAILED, index

    def cancel(self) -> None:
        """Kill the child writing a snapshot, if any, and forget what it wrote."""
        child, self.child = self.child, None
        if child is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signal.SIGKILL)
        os.close(child.failures)
        with contextlib.suppress(OSError):
            os.unlink(child.file)
        self.killed.append(child.pid)
        self._reap_killed()

    def _reap_killed(self) -> None:
        for pid in list(self.killed):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done = pid
            if done:
                self.killed.remove(pid)

    def stop(self) -> None:
        """The node stops: kill the child and wait for every child killed (one in an
        fsync dies when the fsync ends), so that none outlives the node."""
        self.cancel()
        for pid in self.killed:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        self.killed.clear()


def _ended(status: int) -> str:
    code = os.waitstatus_to_exitcode(status)
    return f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"


def _written_by_a_child(_tmp_path: str, _data: Any) -> None:
    """PySyncObj's serializer hook: never called, since `serialize` is replaced; set so
    that PySyncObj hands us the entries rather than its own state to pickle."""
    raise AssertionError("snapshots are written by `_write_snapshots_in_a_child`")


def _write_snapshot_in_child(
    member: RaftMember, data: tuple[Any, ...], file: str, failures: int, parent: int
) -> NoReturn:
    """In the forked child of `SnapshotWriter.serialize`: encode the snapshot of the
    state as it was at the fork into `file` (a new file: O_EXCL), fsync it, exit. Only
    the forking thread exists here, and other threads may have held locks at the fork,
    so it runs the encoder and file writes only (no logging, no locks); a failure is
    told through `failures`, one line, and a non-zero exit."""
    code = 1
    try:
        gc.disable()  # no finalizer of the parent's objects runs here
        if _prctl is not None:  # die with the node's Raft thread, not outlive it
            _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:
            os._exit(1)  # the node died before that
        with contextlib.suppress(ValueError):
            # a signal to the node's process group at shutdown is the node's to act on:
            # it stops, and kills this child itself
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        # the parent's sockets: a connection the parent closes meanwhile closes now
        os.closerange(3, failures)
        os.closerange(failures + 1, os.sysconf("SC_OPEN_MAX"))
        try:
            blob = memoryview(member.snapshot_bytes(data))
            fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                while blob:
                    blob = blob[os.write(fd, blob) :]
                if member.fsync != "never":
                    os.fsync(fd)
            finally:
                os.close(fd)
            code = 0
        except BaseException as e:  # told to the parent, which logs it
            os.write(failures, f"{type(e).__name__}: {e}"[:4000].encode())
    finally:
        os._exit(code)
