"""A real node's snapshots written in a forked child (`SnapshotWriter`), so that the Raft
thread goes on meanwhile: fsynced, renamed into place, killed past
`SNAPSHOT_DEADLINE_S`, retried after a failure from 1 s doubling to 60 s
(`SNAPSHOT_RETRY_S`); the child dies with its parent (`PR_SET_PDEATHSIG`)."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import glob
import logging
import os
import signal
import time
import warnings
from typing import Any, NamedTuple, NoReturn

from pysyncobj.config import SERIALIZER_STATE

from .journal import fsync_directory
from .rules import (
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

    def __init__(self, member: RaftRules, path: str) -> None:
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


def written_by_a_child(_tmp_path: str, _data: Any) -> None:
    """PySyncObj's serializer hook: never called, since `serialize` is replaced; set so
    that PySyncObj hands us the entries rather than its own state to pickle."""
    raise AssertionError("snapshots are written by `_write_snapshots_in_a_child`")


def _write_snapshot_in_child(
    member: RaftRules, data: tuple[Any, ...], file: str, failures: int, parent: int
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
