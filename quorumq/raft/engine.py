"""The Raft engine of a node process: one thread ticking every Raft group the node
hosts, one poll over all their sockets, and one sync of their journals per round.

Issue 33 runs many Raft groups in one node process. A thread per group would contend
for one interpreter lock anyway, and each would pay its own fdatasync; here one thread
runs rounds (`RaftEngine._round`):

1. every member's PySyncObj tick (elections, commit counting, applying, proposals sent
   to followers), with what a leader must make durable of its own entries owed to the
   engine (`RaftMember.make_own_entries_durable`);
2. one sync of every journal (on the write-ahead log, `wal.py`, one fdatasync covers
   every group: group commit across groups) before any later tick counts a leader's
   own entries towards a commit;
3. one poll over every member's sockets, each member holding its answers to
   AppendEntries (`RaftRules.hold_replies`) until the poll is over; the first member
   to release them syncs what every member read, and the others find nothing left to
   sync.

A node with one group runs an engine of one member (`RaftMember` makes it). camelCase
names are PySyncObj's.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import queue
import select
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from pysyncobj.poller import POLL_EVENT_TYPE

from ..codec import UnreadableEntryError
from .cipher import ThrottledWarning
from .journal import JournalDamagedError, JournalFailedError, RaftJournal
from .link import EngineLink
from .wal import JournalKind, WriteAheadLog, open_group_journal, open_node_log

logger = logging.getLogger(__name__)

FATAL = (JournalFailedError, JournalDamagedError, UnreadableEntryError)
"""What stops a member for good: nothing more may be acknowledged or applied."""

_Subscription = tuple[Callable[[int, int], None], int]
T = TypeVar("T")

TICK_FAILURE_LOG_S = 5.0
"""A member's tick that keeps failing logs its traceback at most this often."""


class EngineMember(Protocol):
    """What the engine asks of a member (`member.RaftMember`)."""

    name: str
    group: int
    fsync: str
    journal: RaftJournal
    poller: MemberPoller
    closed: threading.Event

    @property
    def stopping(self) -> bool: ...

    def join_engine(self) -> None: ...

    def tick_in_engine(self) -> None: ...

    def sync_in_engine(self) -> None: ...

    def tick_wait_s(self, tick_s: float, *, election: bool = True) -> float: ...

    def hold_replies(self) -> None: ...

    def release_replies(self) -> None: ...

    def fail(self, error: BaseException) -> None: ...

    def close(self) -> None: ...


class EnginePoller:
    """One `poll` over every member's descriptors (PySyncObj's `PollPoller` kept a
    descriptor's callback after `unsubscribe`, and with it a stopped member and its
    log, until the number was used again)."""

    def __init__(self) -> None:
        self._poll = select.poll()
        self._callbacks: dict[int, Callable[[int, int], None]] = {}
        self._failed = ThrottledWarning(
            logger, "a Raft connection's event failed (a peer sent what no group asked for?)"
        )

    def subscribe(self, descr: int, callback: Callable[[int, int], None], mask: int) -> None:
        events = 0
        if mask & POLL_EVENT_TYPE.READ:
            events |= select.POLLIN
        if mask & POLL_EVENT_TYPE.WRITE:
            events |= select.POLLOUT
        if mask & POLL_EVENT_TYPE.ERROR:
            events |= select.POLLERR
        self._callbacks[descr] = callback
        self._poll.register(descr, events)

    def unsubscribe(self, descr: int) -> None:
        self._callbacks.pop(descr, None)
        with contextlib.suppress(KeyError, ValueError):
            self._poll.unregister(descr)

    def poll(self, timeout: float) -> None:
        for descr, event in self._poll.poll(timeout * 1000):
            mask = 0
            if event & select.POLLIN:
                mask |= POLL_EVENT_TYPE.READ
            if event & select.POLLOUT:
                mask |= POLL_EVENT_TYPE.WRITE
            if event & (select.POLLERR | select.POLLHUP | select.POLLNVAL):
                mask |= POLL_EVENT_TYPE.ERROR
            callback = self._callbacks.get(descr)
            if callback is not None:
                try:
                    callback(descr, mask)
                except Exception:  # (a member's are guarded already: the link's)
                    self._failed()


class MemberPoller:
    """PySyncObj's poller as one member of an engine sees it: its descriptors join the
    engine's one poll once the member is started (before that, a message read would
    call into an owner not yet set up), each callback's failure stops that member
    only; its own `poll`, at the end of PySyncObj's tick, does nothing (the engine
    polls once for every member)."""

    def __init__(self, engine: RaftEngine) -> None:
        self._engine = engine
        self.member: EngineMember | None = None
        self._waiting: dict[int, _Subscription] | None = {}
        """Subscriptions made before the member joined the engine's poll."""

    def subscribe(self, descr: int, callback: Callable[[int, int], None], mask: int) -> None:
        if self._waiting is not None:
            self._waiting[descr] = (callback, mask)
        else:
            self._engine.poller.subscribe(descr, self._guarded(callback), mask)

    def unsubscribe(self, descr: int) -> None:
        if self._waiting is not None:
            self._waiting.pop(descr, None)
        else:
            self._engine.poller.unsubscribe(descr)

    def poll(self, _timeout: float) -> None:
        """Nothing: the engine polls for every member after their ticks."""

    def join(self) -> None:
        """Put the subscriptions made so far into the engine's poll (on its thread)."""
        waiting, self._waiting = self._waiting or {}, None
        for descr, (callback, mask) in waiting.items():
            self.subscribe(descr, callback, mask)

    def _guarded(self, callback: Callable[[int, int], None]) -> Callable[[int, int], None]:
        def guarded(descr: int, event: int) -> None:
            member = self.member
            if member is None or member.stopping:
                return
            try:
                callback(descr, event)
            except FATAL as e:
                member.fail(e)
            except Exception:
                self._engine.tick_failed(member, "handling a message")

        return guarded


class RaftEngine:
    """One thread ticking the Raft members (groups) of a node process (see the module's
    docstring). Members are added by `RaftMember.start` and leave by `RaftMember.stop`
    or by failing; `stop` stops the engine and every member in it.

    What touches the members' journals (one write-ahead log, not thread-safe) runs on
    the engine's thread once it runs: a member of a running engine is built there
    (`run`), and closed there."""

    def __init__(
        self,
        name: str,
        *,
        tick_period: float = 0.05,
        raft_address: str | None = None,
        password: str | None = None,
        insecure: bool = False,
    ) -> None:
        """`raft_address`: the node's one Raft port for every group (`link.EngineLink`,
        messages tagged by group; `password`, the cluster secret, seals them and is
        required unless `insecure`). None: each member listens at its own address."""
        if raft_address is not None and not password and not insecure:
            raise ValueError(
                "a Raft port without a cluster secret takes any peer's word: give "
                "password, or insecure=True"
            )
        self.name = name
        self.tick_period = tick_period
        self.poller = EnginePoller()
        self.ticking = False
        """True while the members tick (step 1): a leader's sync is owed to step 2."""
        self._members: list[EngineMember] = []
        self._calls: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._wal: WriteAheadLog | None = None
        self._failures_logged: dict[tuple[str, int], float] = {}
        self._pipe_lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        for fd in (self._wake_r, self._wake_w):
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_NONBLOCK)
        self.poller.subscribe(self._wake_r, self._drain_wake, POLL_EVENT_TYPE.READ)
        self._thread = threading.Thread(target=self._run, name=f"raft-{name}", daemon=True)
        self.link: EngineLink | None = None
        if raft_address is not None:
            try:
                self.link = EngineLink(raft_address, password, self.poller, self._guard)
            except BaseException:
                self._close()
                raise

    # ------------------------------------------------------------------ journals

    def open_journal(
        self,
        node_dir: str,
        data_dir: str,
        group: int,
        kind: JournalKind,
        *,
        durable: bool,
        strict: bool,
    ) -> RaftJournal:
        """Group `group`'s journal: a file in its `data_dir`, or its part of the node's
        one write-ahead log in `node_dir/wal` (opened by the first group that asks)."""
        self.check_thread("a member's journal is opened")
        if kind != "wal":
            return open_group_journal(
                None, data_dir, group, kind, durable=durable, strict=strict, node_dir=node_dir
            )
        wal = self._wal
        if wal is None or wal.closed:
            wal = self._wal = open_node_log(node_dir, durable=durable, strict=strict)
        elif (wal.durable, wal.strict) != (durable, strict):
            raise ValueError("every group of a node's write-ahead log syncs the same way")
        try:
            return open_group_journal(
                wal, data_dir, group, kind, durable=durable, strict=strict, node_dir=node_dir
            )
        except BaseException:
            if not wal.groups_open():
                wal.close()
            raise

    def check_thread(self, what: str) -> None:
        """Refuse to touch the members' journals off the engine's thread once it runs."""
        if self._thread.is_alive() and not self.on_engine_thread():
            raise RuntimeError(
                f"{what} off the thread of a running Raft engine: build or close its "
                "members through RaftEngine.run"
            )

    # ------------------------------------------------------------------ members

    def member_poller(self) -> MemberPoller:
        return MemberPoller(self)

    def add(self, member: EngineMember) -> None:
        """Tick `member` from the next round on."""

        def join() -> None:
            try:
                member.join_engine()
            except BaseException as e:
                member.fail(e)
                self._close_member(member)
                raise
            self._members.append(member)

        self.call(join)

    def call(self, call: Callable[[], None]) -> None:
        """Run `call` on the engine's thread, before its next round."""
        if self._stopping.is_set():
            raise RuntimeError(f"the Raft engine {self.name} is stopped")
        self._calls.put(call)
        self.wake()

    def run(self, call: Callable[[], T], timeout: float = 30.0) -> T:
        """`call()` on the engine's thread (here if it does not run, or this is it),
        its result or exception back to the caller."""
        if not self._thread.is_alive() or self.on_engine_thread():
            return call()
        done = threading.Event()
        outcome: list[Any] = []

        def run_it() -> None:
            try:
                outcome.append((True, call()))
            except BaseException as e:
                outcome.append((False, e))
            finally:
                done.set()

        self.call(run_it)
        if not done.wait(timeout):
            raise TimeoutError(f"the Raft engine {self.name} did not run a call in {timeout} s")
        ok, value = outcome[0]
        if not ok:
            raise value
        return value  # type: ignore[no-any-return]

    def wake(self) -> None:
        """Start the next round now (a proposal, a call)."""
        with self._pipe_lock:
            if self._wake_w >= 0:
                with contextlib.suppress(BlockingIOError, OSError):
                    os.write(self._wake_w, b"!")

    def alive(self) -> bool:
        """Whether the engine's thread runs."""
        return self._thread.is_alive()

    def on_engine_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def start(self) -> None:
        if self._stopping.is_set():
            raise RuntimeError(f"the Raft engine {self.name} is stopped")
        if self._thread.ident is None:
            self._thread.start()

    def stop(self) -> None:
        """Stop the thread and close every member (their journals synced). Idempotent."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self.wake()
        if self._thread.ident is None:  # never started: close here
            self._close()
        elif not self.on_engine_thread():
            self._thread.join(timeout=10)

    def leave(self, member: EngineMember) -> None:
        """Close `member` (a stopped member leaves at the end of the round it is in)."""
        if not self._thread.is_alive():  # never started, or ended
            self._close_member(member)
        elif not self.on_engine_thread():
            self.wake()
            member.closed.wait(timeout=10)

    def tick_failed(self, member: EngineMember, what: str) -> None:
        """Log a failed step of `member` (not fatal), its traceback at most every
        `TICK_FAILURE_LOG_S` (a tick that fails at every wake-up is not a flood)."""
        now = time.monotonic()
        key = (member.name, member.group)
        if now - self._failures_logged.get(key, -TICK_FAILURE_LOG_S) >= TICK_FAILURE_LOG_S:
            self._failures_logged[key] = now
            logger.exception("raft member %s, group %d: %s failed", *key, what)

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                try:
                    self._round()
                except Exception:
                    logger.exception("raft engine %s: a round failed", self.name)
                    self._stopping.wait(self.tick_period)
        finally:
            self._close()

    def _run_calls(self) -> None:
        while True:
            try:
                call = self._calls.get_nowait()
            except queue.Empty:
                return
            try:
                call()
            except Exception:
                logger.exception("raft engine %s: a call failed", self.name)

    def _round(self) -> None:
        self._run_calls()
        if self.link is not None:
            self.link.tick()
        members = [m for m in self._members if not m.stopping]
        slow = False
        # 1. every member's tick
        self.ticking = True
        try:
            for member in members:
                slow |= not self._guard(member, member.tick_in_engine, "its tick")
        finally:
            self.ticking = False
        # 2. one sync (the write-ahead log's covers every group); a sync that fails in
        # any way stops the member: its entries may be counted only once durable
        for member in members:
            if not member.stopping:
                try:
                    member.sync_in_engine()
                except BaseException as e:
                    member.fail(e)
        self._drop_stopped()
        # 3. one poll, answers held until it is over
        members = [m for m in self._members if not m.stopping]
        wait = 1.0
        for member in members:
            try:
                wait = min(wait, member.tick_wait_s(self.tick_period))
            except Exception:
                self.tick_failed(member, "deciding its wait")
                wait = min(wait, self.tick_period)
            self._guard(member, member.hold_replies, "holding its answers")
        if slow:
            wait = max(wait, self.tick_period)  # a tick that keeps failing: not a busy loop
        try:
            self.poller.poll(wait)
        finally:
            for member in members:
                if not member.stopping:
                    self._guard(member, member.release_replies, "answering")
        self._drop_stopped()

    def _guard(self, member: EngineMember, step: Callable[[], Any], what: str) -> bool:
        """Run one member's `step`; a failure stops that member only (a write-ahead
        log that failed fails every group on it, each at its next step)."""
        try:
            step()
            return True
        except FATAL as e:
            member.fail(e)
        except Exception:
            self.tick_failed(member, what)
        return False

    def _drop_stopped(self) -> None:
        for member in [m for m in self._members if m.stopping]:
            self._members.remove(member)
            self._close_member(member)

    def _close_member(self, member: EngineMember) -> None:
        try:
            member.close()
        except Exception:
            logger.exception("raft member %s: closing it failed", member.name)

    def _close(self) -> None:
        self._run_calls()  # members that were to join: they join, to be closed with the rest
        members, self._members = self._members, []
        for member in members:
            self._close_member(member)
        if self.link is not None:
            self.link.destroy()
        with self._pipe_lock:
            for fd in (self._wake_r, self._wake_w):
                if fd >= 0:
                    self.poller.unsubscribe(fd)
                    with contextlib.suppress(OSError):
                        os.close(fd)
            self._wake_r = self._wake_w = -1

    def _drain_wake(self, fd: int, _event: int) -> None:
        try:
            while os.read(fd, 4096):
                pass
        except (BlockingIOError, OSError):
            pass
