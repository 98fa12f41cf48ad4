"""Proposing, sending and answering: raw commands and the leader clock anchored at a
leader's first tick (`LeaderClock`), prompt sends and commit notices, durability before
an answer (replies held for one sync), fast catch-up (`_SyncObj__sendNextNodeIdx`),
keepalives, and a leader lost or gained. (Stale replies and trimming what the log
holds: `receiving`; snapshots: `membership`; stamping and holding proposals: `rules`.)

A part of `RaftRules` (see `rules`): a mixin over PySyncObj's `SyncObj`."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import pysyncobj.syncobj as _syncobj
from pysyncobj import FAIL_REASON

from .. import pathtiming
from ..codec import entry_time
from .base import (
    COMMIT_NOTICE,
    KEEPALIVE,
    LEADER_LOST_JITTER_S,
    LEADER_LOST_TURN_S,
    LEADER_SILENT_PERIODS,
    MAX_COMMAND_BYTES,
    PEER_KEEPALIVE_S,
    QUIET_KEEPALIVE_S,
    RAW_COMMAND,
    RAW_PREFIX,
    Queued,
    RaftFields,
    StampingQueue,
)

logger = logging.getLogger(__name__)


class Proposing(RaftFields):
    """Proposing, sending and answering (see the module's docstring)."""

    def propose(
        self,
        payload: bytes,
        callback: Callable[[Any, int], None] | None,
        *,
        leader_only: bool = False,
    ) -> None:
        """Submit `payload` for the log. `callback(result, FAIL_REASON)` runs on the tick
        thread: SUCCESS with what `apply_raw` returned on this node.

        `leader_only`: a leader's judgement (a node down, time passing), appended only
        by this node while it still leads the term it leads now; otherwise answered
        NOT_LEADER. A duty queued just before its leader was deposed (a leader paused
        in the middle of a tick judged every peer down, and the next tick forwarded
        those `NodeDown`s to the new leader, which committed them) is never forwarded."""
        if len(payload) > MAX_COMMAND_BYTES:
            raise ValueError(f"command of {len(payload)} bytes exceeds {MAX_COMMAND_BYTES}")
        if leader_only:
            term = self.raftCurrentTerm
            if not self._leads(term):
                if callback is not None:
                    callback(None, FAIL_REASON.NOT_LEADER)
                return
            self._take_commands_through_rules()
            at = _syncobj.monotonicTime()
            self._applyCommand(payload, Queued(callback, at, term), RAW_COMMAND)
            return
        self._applyCommand(payload, callback, RAW_COMMAND)

    def _applyCommand(self, command: bytes, callback: Any, commandType: int | None = None) -> None:
        """PySyncObj's, with each local proposal's time (`Queued`)."""
        if not isinstance(callback, Queued | tuple):  # (a tuple: a peer's, forwarded here)
            callback = Queued(callback, _syncobj.monotonicTime())
        super()._applyCommand(command, callback, commandType)

    def _anchor_leader_clock(self) -> None:
        """On the tick thread: a new leader takes the replicated time over."""
        clock = self.leader_clock
        term = self.raftCurrentTerm
        if clock is None or clock.term == term or not self._isLeader():
            return
        log = self._SyncObj__raftLog
        latest = 0
        for pos in range(len(log) - 1, max(-1, len(log) - 1000), -1):
            command = log[pos][0]
            if command[:1] == RAW_PREFIX:
                latest = entry_time(command[1:])
                if latest:
                    break
        clock.take_over(term, max(latest, self.replicated_time_ms()))

    def _checkCommandsToApply(self) -> None:
        self._take_commands_through_rules()
        self._settle_held_proposals()
        self._anchor_leader_clock()
        if not self._commands_waiting():
            return  # most ticks (a message read, a timer): PySyncObj's loop takes nothing
        log = self._SyncObj__raftLog
        before = log[-1][1] if len(log) else 0
        super()._checkCommandsToApply()
        if self._isLeader() and len(log) and log[-1][1] != before:
            timed = range(before + 1, log[-1][1] + 1) if pathtiming.ENABLED else range(0)
            for index in timed:
                pathtiming.mark("raft.appended", ("i", index))
            self._SyncObj__sendAppendEntries()  # send at once, not on the next heartbeat
            for index in timed:
                pathtiming.mark("raft.sent", ("i", index))
            self.make_own_entries_durable(timed)  # overlaps with the round trip
            if not self._SyncObj__otherNodes:
                # A lone member commits its entries at the next tick, and no answer comes
                # to wake it: it waited a whole tick period (50 ms) per proposal
                self.tick_soon()

    def _mark_commit(self) -> None:
        """Path timing: the commit index this node knows moved (a covering mark)."""
        commit = self.raftCommitIndex
        if commit > self._marked_commit:
            self._marked_commit = commit
            pathtiming.mark("raft.committed", ("i", commit))

    def _commands_waiting(self) -> bool:
        """Whether a proposal waits in PySyncObj's queue (read without its lock: a
        proposal that lands just after is taken on the tick its wake-up starts)."""
        queue: Any = self._SyncObj__commandsQueue
        if isinstance(queue, StampingQueue):
            queue = queue.queue
        return bool(queue._FastQueue__queue)

    def push_commit_index(self) -> None:
        """As leader, tell followers a new commit index at once (they apply promptly).

        A follower that has every entry gets a commit notice: an empty AppendEntries,
        checked and taken as any other, that it answers only if it refuses it. Its
        answer would tell the leader nothing new, and answering every commit made a
        quarter of a cluster's messages. Any follower behind: every follower gets
        PySyncObj's AppendEntries, entries included, answered as always."""
        commit = self.raftCommitIndex
        if not self._isLeader() or commit <= self._sent_commit:
            return
        self._sent_commit = commit
        log = self._SyncObj__raftLog
        last = self._SyncObj__getCurrentLogIndex()
        connected = self._SyncObj__connectedNodes
        next_index = self._SyncObj__raftNextIndex
        followers = [
            node
            for node in self._SyncObj__otherNodes | self._SyncObj__readonlyNodes
            if node in connected
        ]
        if any(not log[0][1] < next_index[node] == last + 1 for node in followers):
            self._SyncObj__sendAppendEntries()
            return
        prev_index, prev_term = self._SyncObj__getPrevLogIndexTerm(last + 1)
        notice = {
            "type": "append_entries",
            "term": self.raftCurrentTerm,
            "commit_index": commit,
            "entries": [],
            "prevLogIdx": prev_index,
            "prevLogTerm": prev_term,
            COMMIT_NOTICE: True,
        }
        transport = self._SyncObj__transport
        for node in sorted(followers, key=lambda n: n.id):
            transport.send(node, notice)
        if pathtiming.ENABLED:
            pathtiming.mark("raft.notice", ("i", commit))

    def _SyncObj__applyLogEntries(self) -> bool:
        # A leader tells followers of a new commit before it applies the entries, not
        # after (and after its tick's callbacks): they deliver to their consumers
        # meanwhile.
        if self._isLeader():
            self.push_commit_index()
        return bool(super()._SyncObj__applyLogEntries())

    def _SyncObj__sendAppendEntries(self) -> None:
        # every AppendEntries carries the commit index: no notice needed for it
        self._sent_commit = max(self._sent_commit, self.raftCommitIndex)
        super()._SyncObj__sendAppendEntries()

    def _SyncObj__sendNextNodeIdx(
        self, node: Any, reset: bool = False, nextNodeIdx: int | None = None, success: bool = False
    ) -> None:
        if success and self._handling_notice:
            return  # a commit notice taken: the leader knows this log already
        next_index = nextNodeIdx
        if reset and not success and next_index is not None and self.conflict_hints:
            next_index = self._conflict_hint(next_index)  # PySyncObj named prevLogIdx
        after_install, self._answer_after_install = self._answer_after_install, None
        if next_index is None and after_install is not None:
            next_index = after_install  # a snapshot was installed (see _SyncObj__loadDumpFile)
        elif next_index is None:  # PySyncObj's default, taken now
            next_index = self._SyncObj__getCurrentLogIndex() + 1
        reply = (node, reset, next_index, success)
        if self._held_replies is not None:
            self._held_replies.append(reply)
        else:
            self._send_replies([reply])

    def _send_replies(self, replies: list[tuple[Any, bool, int, bool]]) -> None:
        """A follower acknowledges only what is durable: one sync, then the answers."""
        if any(success for *_, success in replies):
            self.make_durable()
            if pathtiming.ENABLED:
                acked = max(i for _, _, i, success in replies if success) - 1
                pathtiming.mark("raft.synced", ("i", acked))
        for node, reset, next_index, success in replies:
            super()._SyncObj__sendNextNodeIdx(
                node, reset=reset, nextNodeIdx=next_index, success=success
            )
            if pathtiming.ENABLED and success:
                pathtiming.mark("raft.answered", ("i", next_index - 1))

    def hold_replies(self) -> None:
        """Group commit on a follower: until `release_replies`, answers to AppendEntries
        wait, and one sync then covers every message read in between (a follower that
        synced per message let them queue behind the syncs)."""
        self._held_replies = []

    def release_replies(self) -> None:
        """Apply what became committed, then sync what the held answers acknowledge,
        send them in order, stop holding. A follower that read a commit notice and the
        next AppendEntries in one poll applied the committed entry only after syncing
        the new one (its local consumers waited a whole fdatasync, about 1 ms)."""
        if self.raftCommitIndex > self.raftLastApplied and not self._isLeader():
            self._SyncObj__applyLogEntries()
        self._send_held_replies()
        self._held_replies = None

    def _send_held_replies(self) -> None:
        held = self._held_replies
        if held:
            self._held_replies = []
            self._send_replies(held)

    def keep_peer_connections_alive(self) -> None:
        """Send each peer but the leader a keepalive every `PEER_KEEPALIVE_S` (call from
        a tick callback). PySyncObj closes a connection it has read nothing from for
        `connectionTimeout` (2 s), and checks when it next sends on it. Followers never
        talk to one another, so when a leader died, the first vote request a follower
        sent closed its idle connection to the other follower instead of going out: the
        election failed, and the cluster waited a whole election timeout (0.4-0.6 s of
        every failover; seen with timestamps in the real cluster, not in the simulator,
        which did not close idle connections)."""
        if self._isLeader():
            return
        now = _syncobj.monotonicTime()
        if now < self._keepalive_due:
            return
        self._keepalive_due = now + (QUIET_KEEPALIVE_S if self.leader_quiet_s else PEER_KEEPALIVE_S)
        leader = self._SyncObj__raftLeader
        transport = self._SyncObj__transport
        for node in self._SyncObj__otherNodes & self._SyncObj__connectedNodes:
            if node != leader:
                transport.send(node, {"type": KEEPALIVE})

    def _SyncObj__onNodeDisconnected(self, node: Any) -> None:
        """A connection to a peer closed, or a dial to it failed. For this follower's
        leader (or, with no leader known, the last one: a candidate's vote request can
        come in before the news of the close, and a follower that refuses that vote,
        its log being longer, must not wait out a timeout):

        * its open connection closed: its process died, or the connection was reset. A
          live leader redials at once and sends its next heartbeat within a period, so
          elect if none comes within `LEADER_SILENT_PERIODS` periods (not after a whole
          election timeout, 0.25-0.6 s), a slow leader keeps its connection anyway;
        * then a dial to it failed (its port refuses: the process is gone): elect now.

        The followers take turns (`LEADER_LOST_TURN_S`) so that they do not all ask for
        votes at once and split them. An election is always safe: this only moves when."""
        was_connected = node in self._SyncObj__connectedNodes
        super()._SyncObj__onNodeDisconnected(node)
        self._quiet_speakers.discard(node)  # it says again when it connects again
        if node in self.learners:  # it may come back empty: it proves its log again
            self._SyncObj__raftMatchIndex[node] = 0
            self._SyncObj__raftNextIndex[node] = self._SyncObj__getCurrentLogIndex() + 1
        me = self._SyncObj__selfNode
        leader = self._SyncObj__raftLeader
        if me is None or self._isLeader():
            return
        if was_connected and node == leader:
            # proposals forwarded to it are answered on this connection or never: fail
            # them now (outcome unknown), not after the caller's 15 s timeout
            self._SyncObj__onLeaderChanged()
        if was_connected and node == (leader if leader is not None else self._last_leader):
            self._leader_closed = node
            period: float = self._SyncObj__conf.appendEntriesPeriod
            self._elect_within(node, LEADER_SILENT_PERIODS * period, "its connection closed")
        elif not was_connected and node == self._leader_closed:
            self._leader_closed = None  # once: a minority side must not elect at every dial
            self._elect_within(node, 0.0, "it refuses connections")

    def _elect_within(self, lost: Any, wait_s: float, why: str) -> None:
        """Pull this follower's election deadline in to `wait_s` plus its turn."""
        me = self._SyncObj__selfNode
        voters = sorted(n.id for n in self._SyncObj__otherNodes if n != lost)
        rank = sorted([*voters, me.id]).index(me.id)
        delay = wait_s + rank * LEADER_LOST_TURN_S + LEADER_LOST_JITTER_S * _syncobj.random.random()
        deadline: float = getattr(self, "_SyncObj__raftElectionDeadline")  # noqa: B009
        if deadline == math.inf and self._deadline_in_tick is not None:
            deadline = self._deadline_in_tick  # (set aside by `_onTick` while PySyncObj ticks)
        setattr(  # noqa: B010 (PySyncObj's private field, untyped)
            self, "_SyncObj__raftElectionDeadline", min(deadline, _syncobj.monotonicTime() + delay)
        )
        logger.info("the leader lost (%s): an election within %.3f s", why, delay)

    def _SyncObj__onBecomeLeader(self) -> None:
        self._drop_reached()  # a leader dials its own configuration only
        self._sent_commit = 0  # (a snapshot install may have taken the commit index back)
        self._leader_since = _syncobj.monotonicTime()
        self._answered_at.clear()  # answers to an earlier term of leadership say nothing now
        super()._SyncObj__onBecomeLeader()
        logger.info("leading at term %d", self.raftCurrentTerm)

    def until_election_s(self) -> float | None:
        """Seconds until this follower or candidate starts an election if nothing comes
        (None as leader): the tick loop waits no longer than this."""
        if self._isLeader() or not self._SyncObj__connectedNodes:
            return None  # (connected to no one, PySyncObj does not elect: no need to wake)
        deadline: float = self._SyncObj__raftElectionDeadline
        if deadline == math.inf and self._deadline_in_tick is not None:
            # asked from the tick's own poll: `Elections._onTick` set it aside meanwhile (a
            # quiet follower slept up to a second past it, real nodes only: the simulator
            # asks after the tick)
            deadline = self._deadline_in_tick
        return max(0.0, deadline - float(_syncobj.monotonicTime()))

    def _set_commit_index(self, index: int) -> None:
        self._SyncObj__raftCommitIndex = index
        self._SyncObj__raftLog.setRaftCommitIndex(index)
