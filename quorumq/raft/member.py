"""PySyncObj made safe and fast enough for a broker: the Raft member of a real node.

The Raft rules it changes (prompt sends, the stale-reply fixes, truncation only at a
conflict, durability points, raw commands, our snapshot encoding) are in
`rules.RaftRules`, shared with the simulator. What this module adds for a real node:

* durability: our `DurableJournal` (or, with `journal="wal"`, group 0 of the
  write-ahead log, `wal.py`); with `fsync="always"` a follower fsyncs before it
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

The Raft port and its connections are `transport.py`; the snapshot writer in a forked
child is `snapshot_writer.py`. camelCase names here are PySyncObj's; they stay inside
quorumq/raft.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable, Mapping
from typing import Any, Literal

import pysyncobj.syncobj as _syncobj
from pysyncobj import FAIL_REASON, SyncObjConf, SyncObjException
from pysyncobj.node import TCPNode

from .. import pathtiming
from .cipher import RaftCipher
from .engine import RaftEngine
from .files import OS_FILES
from .first_configuration import settle_first_configuration
from .journal import JournalDamagedError, RaftJournal, fsync_directory
from .link import GroupTransport
from .rules import (
    MAX_COMMAND_BYTES,
    RAW_COMMAND,
    Entry,
    RaftRules,
    decode_snapshot,
    leader_fallback_s,
)
from .snapshot_writer import SnapshotWriter, written_by_a_child
from .transport import Transport
from .wal import JournalKind

logger = logging.getLogger(__name__)

Fsync = Literal["always", "batch", "never"]
__all__ = ["MAX_COMMAND_BYTES", "NOT_APPLIED", "RAW_COMMAND", "Fsync", "RaftMember"]

# --------------------------------------------------------------- module hooks

_JOURNALS: dict[str, RaftJournal] = {}
_original_create_journal = _syncobj.createJournal


def _create_journal(path: str | None) -> Any:
    if path is not None and path in _JOURNALS:
        return _JOURNALS.pop(path)
    return _original_create_journal(path)


_building = threading.local()
"""The poller of the member being built on this thread (`_create_poller`)."""
_original_create_poller = _syncobj.createPoller


def _create_poller(poller_type: str) -> Any:
    poller = getattr(_building, "poller", None)
    if poller is not None:
        return poller
    return _original_create_poller(poller_type)


_syncobj.createJournal = _create_journal
_syncobj.createPoller = _create_poller
_syncobj.getEncryptor = RaftCipher


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
        journal: JournalKind = "file",
        engine: RaftEngine | None = None,
        group: int = 0,
        node_dir: str | None = None,
    ) -> None:
        """`engine`: the node's engine, ticking this member among its others (None: an
        engine of its own). `group`: the Raft group this member belongs to; its
        journal is its part of the node's write-ahead log in `node_dir` (by default
        `data_dir`) with `journal="wal"`."""
        address = members[name]
        if not address.rsplit(":", 1)[0]:
            raise ValueError(f"raft address {address!r} needs a host")
        if engine is not None:
            engine.check_thread("a member is built")
        os.makedirs(data_dir, exist_ok=True)
        self.name = name
        self.data_dir = data_dir
        self.fsync = fsync
        self.group = group
        journal_path = os.path.join(data_dir, "raft.log")
        snapshot_path = os.path.join(data_dir, "snapshot")
        node_dir = data_dir if node_dir is None else node_dir
        # the node runs with the members recorded at its first start; checked before
        # anything is opened, so a refusal (`PeersChangedError`) leaves nothing to close
        members = settle_first_configuration(
            OS_FILES,
            data_dir,
            members,
            holds_raft_state=os.path.exists(journal_path + ".meta")
            or os.path.exists(os.path.join(node_dir, "wal", f"group-{group}.meta"))
            or os.path.exists(snapshot_path),
        )
        self.keep_identity_in(OS_FILES, data_dir)
        self._owns_engine = engine is None
        if engine is None:
            engine = RaftEngine(address, tick_period=tick_period)
        self._engine = engine
        if engine.link is not None and engine.link.address != address:
            raise ValueError(
                f"member {name} of group {group} is at {address}, its node's Raft port "
                f"at {engine.link.address}"
            )
        if engine.link is not None and (password or None) != engine.link.password:
            raise ValueError(
                f"member {name} of group {group} has another cluster secret than its "
                "node's Raft port, which seals every group's messages"
            )
        try:
            self.journal: RaftJournal = engine.open_journal(
                node_dir,
                data_dir,
                group,
                journal,
                durable=fsync != "never",
                strict=fsync == "always",
            )
        except BaseException:
            self._stop_own_engine()
            raise
        self._owed_marks: list[int] = []
        _JOURNALS[journal_path] = self.journal
        self._apply = apply
        self._snapshot = snapshot
        self._restore = restore
        self._on_tick = on_tick
        self._stopping = threading.Event()
        self._started = False
        self.closed = threading.Event()
        """Set once the member is closed (its connections, its journal synced)."""
        self.fatal_error: BaseException | None = None
        """Why this member stopped by itself (its journal failed): the node must stop."""
        self.on_fatal: Callable[[], None] = lambda: None
        """Called on the Raft thread once `fatal_error` is set (the node stops then)."""
        self.compaction_error: str | None = None
        """Why the last snapshot could not be written (None: the last one was), for status."""
        self._calls: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        conf = SyncObjConf(
            # on the node's link, the link seals every group's messages: a cipher of the
            # member's own would cost a key derivation (0.1 s) on the engine's thread
            password=password if engine.link is None else None,
            autoTick=False,
            journalFile=journal_path,
            fullDumpFile=snapshot_path,
            serializer=written_by_a_child,  # (replaced: `_write_snapshots_in_a_child`)
            deserializer=self._read_snapshot,
            bindAddress=address,
            appendEntriesBatchSizeBytes=4 * 1024 * 1024,
            logCompactionMinEntries=compaction_entries,
            logCompactionMinTime=10**9,
            raftMinTimeout=raft_timeouts[0],
            raftMaxTimeout=raft_timeouts[1],
            appendEntriesPeriod=min(0.1, raft_timeouts[0] / 4),
            leaderFallbackTimeout=leader_fallback_s(raft_timeouts),  # check-quorum: RaftRules
            connectionRetryTime=0.5,
            connectionTimeout=2.0,
            commandsWaitLeader=True,
            dynamicMembershipChange=True,
            bindRetryTime=0.2,
            maxBindRetries=5,  # PySyncObj's default, 0, retries forever: a taken port hangs
        )
        self.poller = engine.member_poller()
        _building.poller = self.poller
        transport: Any = Transport
        if engine.link is not None:
            transport = engine.link.group_transport(group)
        try:
            super().__init__(
                _named_node(address, name),
                [_named_node(a, n) for n, a in members.items() if n != name],
                conf,
                transportClass=transport,
            )
        except Exception as e:
            _JOURNALS.pop(journal_path, None)
            half_built = getattr(self, "_SyncObj__transport", None)
            if isinstance(half_built, GroupTransport):
                half_built.destroy()  # (its group could never be built again on the link)
            self.journal._destroy()
            self._stop_own_engine()
            if isinstance(e, SyncObjException) and "BindError" in str(e.errorCode):
                raise OSError(f"cannot listen for Raft traffic on {address} (in use?)") from None
            raise
        finally:
            _building.poller = None
        self.poller.member = self
        self.announce_identity()
        try:
            self.check_stored_state()
        except Exception:
            self._doDestroy()
            self._stop_own_engine()
            raise
        self._write_snapshots_in_a_child()
        self._close_snapshot_transmissions()
        self._refuse_stale_snapshots()
        self.addOnTickCallback(self._tick_callback)

    def start(self) -> None:
        """Start ticking (a separate step, so the owner is set up before the first tick
        calls back into it)."""
        if self._started or self._stopping.is_set():
            return
        self._started = True
        self._engine.add(self)
        self._engine.start()

    # ------------------------------------------------------------ the engine

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def join_engine(self) -> None:
        """Joined the engine's round: its sockets polled, its peers heard."""
        self.poller.join()
        transport = self._SyncObj__transport
        if isinstance(transport, GroupTransport):
            transport.join()

    def tick_in_engine(self) -> None:
        """One PySyncObj tick, without its poll (the engine polls for every member)."""
        self.doTick(0.0)

    def sync_in_engine(self) -> None:
        """The engine's sync after every member ticked: what this member's tick wrote
        (a leader's new entries, a new term's no-op) made durable."""
        if self.fsync != "never":
            self.journal.sync()
        marks, self._owed_marks = self._owed_marks, []
        for index in marks:
            pathtiming.mark("raft.synced", ("i", index))

    def fail(self, error: BaseException) -> None:
        """Stop taking part at once (the journal failed, or an entry cannot be read):
        nothing more may be acknowledged or applied; the node is told (`on_fatal`)."""
        if self.fatal_error is not None:
            return
        self.fatal_error = error
        logger.critical("raft member stopped: %s", error)
        self._stopping.set()
        self.on_fatal()

    def close(self) -> None:
        """Close the connections and the journal (synced), on the engine's thread or
        once it is gone. Idempotent."""
        if self.closed.is_set():
            return
        try:
            self.snapshot_writer.stop()
        finally:
            try:
                self._doDestroy()
            finally:
                self.closed.set()

    def stop(self) -> None:
        """Stop ticking, close connections and the journal (fsyncing it). Idempotent."""
        self._stopping.set()
        if not self._started:
            self._engine.run(self.close)
            self._stop_own_engine()
        elif self._owns_engine:
            self._engine.stop()
        else:
            self._engine.leave(self)

    def _stop_own_engine(self) -> None:
        if self._owns_engine:
            self._engine.stop()

    def _wake(self) -> None:
        self._engine.wake()

    def _tick_callback(self) -> None:
        if self.fsync != "never" and not self._engine.ticking:
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

    def make_own_entries_durable(self, marks: range = range(0)) -> None:
        if self._engine.ticking:  # the engine syncs once every member ticked (step 2)
            self._owed_marks.extend(marks)
        else:
            super().make_own_entries_durable(marks)

    def _SyncObj__onBecomeLeader(self) -> None:
        super()._SyncObj__onBecomeLeader()
        # the new term's no-op: elected in the engine's poll, a follower's answer read in
        # the same poll would otherwise be counted with it before the next round synced it
        self.make_own_entries_durable()

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
