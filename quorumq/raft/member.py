"""PySyncObj made safe and fast enough for a broker: the Raft member of a real node.

The Raft rules it changes (prompt sends, the stale-ack fix, durability points, raw
commands, our snapshot encoding) are in `rules.RaftRules`, shared with the simulator.
What this module adds for a real node:

* durability: our `DurableJournal`; with `fsync="always"` a follower fsyncs before it
  acknowledges entries and a leader fsyncs its own entries before the next tick counts
  them toward commit. Snapshots are written and fsynced by us.
* a wake pipe: a submitted command wakes the tick loop at once.
* our own tick thread (PySyncObj's stops when the thread that built the object exits).
* authentication failures on Raft connections are logged (PySyncObj drops them silently).

camelCase names here are PySyncObj's; they stay inside this module.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, Literal

import pysyncobj.syncobj as _syncobj
from pysyncobj import FAIL_REASON, SyncObjConf, SyncObjException
from pysyncobj.node import TCPNode
from pysyncobj.poller import POLL_EVENT_TYPE

from .journal import DurableJournal, fsync_directory
from .rules import MAX_COMMAND_BYTES, RAW_COMMAND, RaftRules, decode_snapshot, encode_snapshot

logger = logging.getLogger(__name__)

Fsync = Literal["always", "batch", "never"]
__all__ = ["MAX_COMMAND_BYTES", "NOT_APPLIED", "RAW_COMMAND", "Fsync", "RaftMember"]

# --------------------------------------------------------------- module hooks

_JOURNALS: dict[str, DurableJournal] = {}
_original_create_journal = _syncobj.createJournal


def _create_journal(path: str | None) -> Any:
    if path is not None and path in _JOURNALS:
        return _JOURNALS.pop(path)
    return _original_create_journal(path)


class _LoggingEncryptor:
    """PySyncObj's Fernet encryptor, logging what fails to authenticate."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._last_warning = 0.0

    def encrypt_at_time(self, data: bytes, ts: int) -> bytes:
        return self._inner.encrypt_at_time(data, ts)  # type: ignore[no-any-return]

    def extract_timestamp(self, data: bytes) -> int:
        try:
            return self._inner.extract_timestamp(data)  # type: ignore[no-any-return]
        except Exception:
            self._warn()
            raise

    def decrypt(self, data: bytes) -> bytes:
        try:
            return self._inner.decrypt(data)  # type: ignore[no-any-return]
        except Exception:
            self._warn()
            raise

    def _warn(self) -> None:
        now = time.monotonic()
        if now - self._last_warning > 5.0:
            self._last_warning = now
            logger.warning(
                "refused Raft traffic that failed authentication: a peer uses another "
                "cluster secret (or is not a quorumq node); connection dropped"
            )


class _DropBindFailure(logging.Filter):
    """PySyncObj logs a traceback when it cannot bind; RaftMember reports it in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "failed to perform initialization"


logging.getLogger("pysyncobj.syncobj").addFilter(_DropBindFailure())

_original_get_encryptor = _syncobj.getEncryptor
_syncobj.createJournal = _create_journal
_syncobj.getEncryptor = lambda password: _LoggingEncryptor(_original_get_encryptor(password))


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
        address: str,
        peers: list[str],
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
        if not address.rsplit(":", 1)[0]:
            raise ValueError(f"raft address {address!r} needs a host")
        os.makedirs(data_dir, exist_ok=True)
        self.data_dir = data_dir
        self.fsync = fsync
        journal_path = os.path.join(data_dir, "raft.log")
        self.journal = DurableJournal(journal_path, durable=fsync != "never")
        _JOURNALS[journal_path] = self.journal
        self._apply = apply
        self._snapshot = snapshot
        self._restore = restore
        self._on_tick = on_tick
        self._tick_period = tick_period
        self._stopping = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        for fd in (self._wake_r, self._wake_w):
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_NONBLOCK)
        conf = SyncObjConf(
            password=password,
            autoTick=False,
            journalFile=journal_path,
            fullDumpFile=os.path.join(data_dir, "snapshot"),
            serializer=self._write_snapshot,
            deserializer=self._read_snapshot,
            bindAddress=address,
            appendEntriesBatchSizeBytes=4 * 1024 * 1024,
            logCompactionMinEntries=compaction_entries,
            logCompactionMinTime=10**9,
            raftMinTimeout=raft_timeouts[0],
            raftMaxTimeout=raft_timeouts[1],
            appendEntriesPeriod=min(0.1, raft_timeouts[0] / 4),
            leaderFallbackTimeout=max(2.0, raft_timeouts[1] * 2),
            connectionRetryTime=0.5,
            connectionTimeout=2.0,
            commandsWaitLeader=True,
            dynamicMembershipChange=True,
            bindRetryTime=0.2,
            maxBindRetries=5,  # PySyncObj's default, 0, retries forever: a taken port hangs
        )
        try:
            super().__init__(address, [p for p in peers if p != address], conf)
        except Exception as e:
            _JOURNALS.pop(journal_path, None)
            self.journal._destroy()
            os.close(self._wake_r)
            os.close(self._wake_w)
            if isinstance(e, SyncObjException) and "BindError" in str(e.errorCode):
                raise OSError(f"cannot listen for Raft traffic on {address} (in use?)") from None
            raise
        self._close_snapshot_transmissions()
        self.addOnTickCallback(self._tick_callback)
        self._poller.subscribe(self._wake_r, self._drain_wake, POLL_EVENT_TYPE.READ)
        self._thread = threading.Thread(target=self._tick_loop, name=f"raft-{address}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ tick thread

    def _tick_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                self.doTick(self._tick_period)
            except Exception:
                logger.exception("raft tick failed")
                time.sleep(self._tick_period)
        try:
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
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)

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
        self._on_tick()

    # ------------------------------------------------------------- the rules

    def apply_raw(self, index: int, payload: bytes) -> Any:
        return self._apply(index, payload)

    def make_durable(self) -> None:
        if self.fsync == "always":
            self.journal.sync()

    def _applyCommand(self, command: bytes, callback: Any, commandType: int | None = None) -> None:
        super()._applyCommand(command, callback, commandType)
        self._wake()

    # -------------------------------------------------------------- snapshots

    def _write_snapshot(self, tmp_path: str, data: tuple[Any, Any, Any]) -> None:
        last, prev, cluster = data
        try:
            blob = encode_snapshot(last, prev, [n.id for n in cluster], self._snapshot())
            with open(tmp_path, "wb") as f:
                f.write(blob)
                f.flush()
                if self.fsync != "never":
                    os.fsync(f.fileno())
        except Exception:
            logger.exception("writing the snapshot failed")
            raise

    def _read_snapshot(self, path: str) -> tuple[Any, Any, Any]:
        with open(path, "rb") as f:
            last, prev, cluster, machine = decode_snapshot(f.read(), path)
        self._restore(machine)
        if self.fsync != "never":
            fsync_directory(self.data_dir)
        return (last, prev, {TCPNode(n) for n in cluster})

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
