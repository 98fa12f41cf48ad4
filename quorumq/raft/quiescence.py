"""Quiescence: an idle group stops heartbeating at the busy rate, and its tick threads
sleep until something is due (as CockroachDB quiesces idle ranges and TiKV hibernates
idle regions).

* A leader is quiet (`quiet_period_s`) when its log is committed and applied, every
  peer is connected, holds the whole log, answered within two quiet periods and said in
  its hello that it reads quiet heartbeats (a node of an earlier version does not, and
  keeps the leader busy), no proposal waits and no leadership transfer is under way.
  A quiet leader heartbeats every `QUIET_HEARTBEAT_S` instead of every
  `appendEntriesPeriod`, each heartbeat marked with that period (`QUIET`).
* A follower that reads a quiet heartbeat from its leader moves its election deadline
  out by the quiet period, counts its lease (leader stickiness) that much longer, and
  sends its keepalives every `QUIET_KEEPALIVE_S`. Every message of the leader that is
  not marked (new entries, a commit notice, a busy heartbeat) puts it back on the busy
  deadline.
* Anything ends it at once: a proposal is appended and sent as before (the next
  heartbeat is a busy one, within `appendEntriesPeriod`); a peer that connects is sent
  a heartbeat at once (a follower whose leader's connection closed elects within two
  busy periods, `_elect_within`); a peer silent for two quiet periods makes the leader
  busy, so check-quorum and node-down judge silence at the busy rate.
* Tick threads (`tick_wait_s`): a quiet member waits for a message, or for the next
  thing due (its heartbeat, its keepalives, its election deadline, its owner's duties,
  `duty_due_s`), up to `QUIET_TICK_S`, instead of ticking every `TICK_S`. A stall is a
  look at the clock `STALL_S` past the planned wait (`Elections._look`).

What it costs failure detection: a leader whose connections stay open when it stops
(its host lost, a partition, a paused process) is noticed by a quiet follower between
the shortest election timeout and `QUIET_HEARTBEAT_S` plus the longest one after it
stopped (0.25-1.1 s with the default timeouts, against 0.25-0.7 s busy), then
pre-vote and the election run as before. A leader process that dies closes its
connections: noticed as fast as before. A part of `RaftRules` (see `rules`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pysyncobj.syncobj as _syncobj

from .base import (
    MAX_QUIET_S,
    QUIESCES,
    QUIET,
    QUIET_HEARTBEAT_S,
    QUIET_TICK_S,
    QUIET_TIME,
    RaftFields,
)


class Quiescence(RaftFields):
    """Quiet heartbeats and sleeping tick threads (see the module's docstring)."""

    duty_due_s: Callable[[], float | None] = staticmethod(lambda: None)
    """Seconds until the owner's next duty needs a tick (None: none pending); the
    replica sets it (a quiet member's thread would otherwise sleep past a retry)."""

    @property
    def _quiet_speakers(self) -> set[Any]:
        """Connected peers whose hello said they read quiet heartbeats."""
        speakers: set[Any] | None = self.__dict__.get("_quiet_speakers_set")
        if speakers is None:
            speakers = self.__dict__["_quiet_speakers_set"] = set()
        return speakers

    def heard_hello(self, node: Any, message: dict[str, Any]) -> None:
        if message.get(QUIESCES):
            self._quiet_speakers.add(node)

    def quiet_period_s(self) -> float:
        """As leader: the heartbeat period the group allows now, `QUIET_HEARTBEAT_S` if
        it is quiet, else 0 (busy)."""
        if not self.quiescence or not self._isLeader() or self._SyncObj__readonlyNodes:
            return 0.0
        last: int = self._SyncObj__getCurrentLogIndex()
        if self.raftCommitIndex != last or self.raftLastApplied != last:
            return 0.0
        if self._SyncObj__transferInProgress or self._commands_waiting():
            return 0.0
        now = _syncobj.monotonicTime()
        connected = self._SyncObj__connectedNodes
        match = self._SyncObj__raftMatchIndex
        next_index = self._SyncObj__raftNextIndex
        answered = self._answered_at
        speakers = self._quiet_speakers
        for node in self._SyncObj__otherNodes:
            if node not in connected or node not in speakers:
                return 0.0
            if match.get(node) != last or next_index.get(node) != last + 1:
                return 0.0
            if now - answered.get(node, -math.inf) > 2 * QUIET_HEARTBEAT_S:
                return 0.0
        return QUIET_HEARTBEAT_S

    def _SyncObj__sendAppendEntries(self) -> None:
        quiet = self.quiet_period_s()
        self._quiet_sent = bool(quiet)
        if not quiet:
            super()._SyncObj__sendAppendEntries()
            return
        # Every peer holds the whole log: PySyncObj would send each an empty AppendEntries
        # after the last entry. The same, marked, and the next one a quiet period later.
        self._SyncObj__newAppendEntriesTime = _syncobj.monotonicTime() + quiet
        self._sent_commit = max(self._sent_commit, self.raftCommitIndex)
        message: dict[str, Any] = {
            "type": "append_entries",
            "term": self.raftCurrentTerm,
            "commit_index": self.raftCommitIndex,
            "entries": [],
            "prevLogIdx": self._SyncObj__getCurrentLogIndex(),
            "prevLogTerm": self._SyncObj__getCurrentLogTerm(),
            QUIET: quiet,
        }
        clock = self.leader_clock
        told = clock.peek(self.raftCurrentTerm) if clock is not None else None
        if told is not None and self.replicated_time_ms() > 0:
            message[QUIET_TIME] = told  # no entry is stamped meanwhile: the time goes on
        transport = self._SyncObj__transport
        for node in sorted(self._SyncObj__otherNodes, key=lambda n: n.id):
            transport.send(node, message)

    def heard_leader(self, message: dict[str, Any]) -> None:
        """An AppendEntries of this term from this follower's leader was read (and
        PySyncObj moved the election deadline to now plus an election timeout)."""
        clock = self.leader_clock
        if clock is not None:
            clock.following(self.raftCurrentTerm)
        marked = message.get(QUIET)
        quiet = 0.0
        if (
            isinstance(marked, (int, float))
            and not isinstance(marked, bool)
            and 0 < marked <= MAX_QUIET_S  # (NaN and a huge int are neither)
        ):
            quiet = float(marked)
        if not self.quiescence or not quiet:
            self.leader_quiet_s = 0.0
            return
        self.leader_quiet_s = quiet
        told = message.get(QUIET_TIME)
        if type(told) is int and 0 < told < 2**63 and clock is not None:
            clock.heard(told, self.raftCurrentTerm)
        deadline = self._SyncObj__raftElectionDeadline
        if not self._SyncObj__transferInProgress and deadline != math.inf:
            self._SyncObj__raftElectionDeadline = deadline + quiet

    def _quiet_now(self) -> bool:
        """Whether this member may sleep past a busy tick."""
        if not self.quiescence or self._SyncObj__selfNode is None:
            return False
        if self._isLeader():
            return self._quiet_sent and bool(self.quiet_period_s())
        return (
            self.leader_quiet_s > 0
            and self._SyncObj__raftLeader is not None
            and self._SyncObj__raftLeader in self._SyncObj__connectedNodes
            and not self._commands_waiting()
        )

    @property
    def quiet(self) -> bool:
        """Whether this member is quiescent now (status, metrics)."""
        return self._quiet_now()

    def tick_wait_s(self, tick_s: float, *, election: bool = True) -> float:
        """How long the tick thread may wait for a message before it ticks again: a
        busy tick, or, quiet, until the next thing due; with `election`, no later than
        just past the election deadline. Remembered for the next look at the clock
        (`Elections._look`)."""
        wait = tick_s
        if self._quiet_now():
            now = _syncobj.monotonicTime()
            wait = QUIET_TICK_S
            if self._isLeader():
                # just past it: PySyncObj sends once its clock is beyond it
                wait = min(wait, self._SyncObj__newAppendEntriesTime - now + 0.001)
            else:
                wait = min(wait, self._keepalive_due - now)
            due = self.duty_due_s()
            if due is not None:
                wait = min(wait, due)
        if election:
            until = self.until_election_s()
            if until is not None:
                wait = min(wait, until + 0.001)  # just past it: PySyncObj elects beyond it
        wait = max(0.0, wait)
        self.planned_wait_s = wait
        return wait
