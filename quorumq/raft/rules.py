"""The Raft behaviour quorumq changes in PySyncObj 0.3.17, in one class that real nodes
(`RaftMember`) and the simulator's members share, so the simulator runs the same rules.

* prompt sends: the leader sends new entries right after appending them instead of on
  the next 100 ms heartbeat, and pushes a new commit index at once (`push_commit_index`,
  from a tick callback). Commands that arrive together still go out in one
  AppendEntries (group commit). The default, batched append path is kept:
  `appendEntriesUseBatch=False` makes followers truncate applied entries.
* the stale-reply fixes: with several AppendEntries in flight, a late success reply must
  not move the leader's `nextIndex` for that follower backwards (which makes the follower
  delete and re-add entries it already applied), and a late refusal must not move it
  forwards (which undoes the search for the index where the logs agree: a follower with
  a divergent tail under big entries never caught up). A late refusal may still send the
  leader back below what the follower holds: the follower's side copes (below).
* truncation only where logs conflict: Raft cuts a follower's log only at an entry that
  conflicts with the leader's; PySyncObj cuts everything after `prevLogIdx`, so a late
  AppendEntries made a follower delete entries it had acknowledged (even applied) and
  add fewer back. `trim_known_entries` rewrites such a message first.
* durability points: a follower calls `make_durable` before it acknowledges entries, a
  leader after appending its own (before the next tick counts them toward commit).
  Real nodes fsync there; the simulator marks its in-memory journal durable. A
  follower syncs once for all the AppendEntries it reads in one poll, then answers
  them (`hold_replies`): syncing per message let messages queue behind the syncs.
* raw commands: the log holds our codec's bytes under a command type of our own (4);
  nothing of ours is pickled. `apply_raw(index, payload)` gets the entry's Raft index.
* snapshots in our own encoding (`encode_snapshot` / `decode_snapshot`).
* replicated time comes from the leader: proposers leave an entry's time unstamped,
  and the leader stamps every raw entry as it appends it (`LeaderClock`: its monotonic
  clock from the replicated time it took over), so no node's wall clock moves the
  machines' clock after a cluster's first leader.
* stale snapshots refused: a leader sent back below what a follower holds (a late
  refusal) sends its snapshot again; a follower that installed it applied the entries
  after it a second time. Whoever stores the incoming snapshot asks
  `accept_leader_snapshot` first; a stale one is answered as what it is.
* a snapshot is written while the node goes on (`RaftMember`'s child process, the
  simulator's delayed write); the journal is compacted only once it is stored, and a
  follower behind the compacted log is sent the previous snapshot meanwhile.
* the commit index moves with a snapshot only when it is installed: PySyncObj moves a
  follower's commit index to the leader's (within its own log) on every message of a
  snapshot transfer, though the message checks nothing of the log. A follower with an
  uncommitted tail of an earlier term (an old leader back from a crash) applied that
  tail, entries no other replica has, while the snapshot was on its way.

* elections that do not disrupt a working cluster (`_pre_vote_gate`, `_start_election`):
  **pre-vote** (a node asks whether it could win before it raises its term, so a node
  cut off, stalled or behind never deposes a working leader), **leader stickiness** (a
  node that heard from its leader within the minimum election timeout, or a leader that
  heard from a majority, refuses pre-votes, and ignores votes, except for a leadership
  transfer), a **stale-term answer** (a node whose term is higher than a leader's tells
  it, so the cluster moves on instead of ignoring it), **check-quorum** (a leader that
  has not heard from a majority for the longest election timeout steps down:
  `leaderFallbackTimeout`), and votes and pre-votes refused to nodes outside this
  node's configuration (a removed server). See `_pre_vote_gate` for mixed versions.
* fast catch-up: a refusal names the first index of the conflicting term (or the
  follower's last index + 1), not one index back, and the leader sends again at once
  instead of on its next heartbeat (`_SyncObj__sendNextNodeIdx`, `_send_to`).
* silence judged only while awake: `peer_silence` counts a peer silent only from the
  later of its last answer and the end of this node's own last stall (`awake_since`,
  set by `_look`), so a leader paused past the node-down grace does not judge every
  peer down from timestamps taken before its pause; and a leader's duty
  (`propose(..., leader_only=True)`) is appended only by the leader of the term that
  judged it, never forwarded to another.

The rules live in parts, each a mixin over PySyncObj's `SyncObj`: `proposing`
(proposing, sending, answering, durability), `receiving` (every Raft message read,
through the rules first), `elections` (everything about terms, votes and stalls),
`membership` (configurations, learners, removed members, snapshots made, accepted and
loaded); `base` holds the fields they share
(`RaftFields`), the message keys, the helper types and the snapshot encoding.
`RaftRules` here is their sum, with applying and status.

The reasons, measured, are in docs/pysyncobj-notes.md. camelCase names here are
PySyncObj's; they stay inside quorumq/raft.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import pysyncobj.syncobj as _syncobj
from pysyncobj import FAIL_REASON

from .. import pathtiming
from ..codec import UnreadableEntryError, stamp_entry
from .base import (
    ADDED_AT,
    ARRIVALS_KEPT,
    COMMIT_NOTICE,
    HELLO,
    KEEPALIVE,
    LEADER_LOST_JITTER_S,
    LEADER_LOST_TURN_S,
    LEADER_SILENT_PERIODS,
    LEARNER_IDLE_S,
    MAX_COMMAND_BYTES,
    MAX_LEARNERS,
    MAX_REACHED,
    MEMBERS,
    MEMBERSHIP_PREFIX,
    PEER_KEEPALIVE_S,
    PRE_VOTE,
    PRE_VOTE_ANSWER,
    PROPOSALS_HELD_S,
    QUIESCES,
    QUIET,
    QUIET_HEARTBEAT_S,
    QUIET_KEEPALIVE_S,
    QUIET_TICK_S,
    QUIET_TIME,
    RAW_COMMAND,
    RAW_PREFIX,
    SNAPSHOT_VERSION,
    SPEAKS_PRE_VOTE,
    STALE_TERM,
    STALL_S,
    STEP_DOWN,
    TICK_S,
    TRANSFER,
    Entry,
    LeaderClock,
    Learner,
    PreVoteRound,
    Queued,
    StampingQueue,
    StoredSnapshot,
    decode_snapshot,
    encode_snapshot,
    entries_after,
    leader_fallback_s,
    node_name,
    trim_known_entries,
    wall_clock_ms,
)
from .cluster_identity import ClusterIdentity
from .elections import Elections
from .journal import NO_OP_PREFIX
from .membership import MembershipRules
from .proposing import Proposing
from .quiescence import Quiescence
from .receiving import Receiving

logger = logging.getLogger(__name__)


class RaftRules(ClusterIdentity, Quiescence, Proposing, Receiving, Elections, MembershipRules):
    """PySyncObj with quorumq's Raft rules. Subclasses give `apply_raw` and
    `make_durable`, call `push_commit_index` and `keep_peer_connections_alive` from a tick
    callback, and ask
    `accept_leader_snapshot` before they install a snapshot from the leader."""

    def start(self) -> None:
        """Start ticking (the owner is set up by then)."""

    def stop(self) -> None:
        """Stop ticking; close connections and the journal."""

    def use_leader_clock(self, clock: LeaderClock) -> None:
        """Stamp raw entries with `clock` as they are appended as leader (call before the
        first tick). Stamped at append, on the tick thread, after the new leader took
        the time over: an entry stamped when proposed (on any thread) could be left
        unstamped before that, or stamped while it waited in the queue, and then took
        the machine's time of an earlier entry, seconds old after a failover: a TTL
        counted from there expired early."""
        self.leader_clock = clock
        self._take_commands_through_rules()

    def _take_commands_through_rules(self) -> None:
        """PySyncObj's command queue, taken through `StampingQueue` (once)."""
        queue: Any = getattr(self, "_SyncObj__commandsQueue")  # noqa: B009 (name-mangled)
        if not isinstance(queue, StampingQueue):
            self._SyncObj__commandsQueue = StampingQueue(
                queue, self._stamp_taken_command, self._leads, self._holds_proposals
            )

    def _leads(self, term: int) -> bool:
        return bool(self._isLeader()) and self.raftCurrentTerm == term

    def _settle_held_proposals(self) -> None:
        """As a follower holding proposals (`_holds_proposals`) or knowing no leader
        (PySyncObj's loop then takes nothing at all): fail each local proposal held past
        `PROPOSALS_HELD_S` (MISSING_LEADER). Without it a node that knew no leader (a
        leader isolated, stepped down by check-quorum) kept its proposals for as long as
        the partition lasted, and appended them after the clients' retries once it
        healed."""
        if self._isLeader() or not (self._SyncObj__raftLeader is None or self._holds_proposals()):
            return
        queue: Any = self._SyncObj__commandsQueue
        if not isinstance(queue, StampingQueue):
            return
        for proposal in queue.take_overdue(_syncobj.monotonicTime()):
            proposal(None, FAIL_REASON.MISSING_LEADER)

    def _holds_proposals(self) -> bool:
        """Whether proposals wait in the queue: a follower whose connection to its
        leader is down keeps each for up to `PROPOSALS_HELD_S` (PySyncObj sent them on
        the connection that was down, where they were lost, and their callers heard
        nothing until their timeout), then fails it as never sent (MISSING_LEADER:
        certainly not applied), rather than keep it until the link heals, maybe hours
        later (a follower cut off from a leader the others still hear: pre-vote keeps it
        from standing, so the leader it knows stays). Each proposal its own time, not
        the connection's: the node core settles an ack refused as not applied again only
        20 times, 0.1 s apart, and acks failed at once once the leader had been gone
        long were given up during an 18 s outage, their messages held by a live
        consumer for good (simulator, CI seed 78; seed 20 of the liveness sweep with a
        1.2 s hold)."""
        leader = self._SyncObj__raftLeader
        return (
            leader is not None
            and not self._isLeader()
            and leader not in self._SyncObj__connectedNodes
        )

    def _stamp_taken_command(self, command: bytes) -> bytes:
        """`command`, taken from the queue to append: stamped if it is a raw entry and this
        node leads (a follower forwards it unstamped, and the leader stamps it)."""
        clock = self.leader_clock
        if clock is None or command[:1] != RAW_PREFIX or not self._isLeader():
            return command
        ts = clock.now(self.raftCurrentTerm)
        if ts is None:
            return command
        return RAW_PREFIX + stamp_entry(command[1:], ts)

    def apply_raw(self, index: int, payload: bytes) -> Any:
        """Apply one committed raw command; what it returns goes to the proposer's callback."""
        raise NotImplementedError

    def replicated_time_ms(self) -> int:
        """The machine's clock (the largest time applied so far): a new leader's floor."""
        return 0

    def make_durable(self) -> None:
        """Every journal entry written so far must survive a crash once this returns."""
        raise NotImplementedError

    def make_own_entries_durable(self, marks: range = range(0)) -> None:
        """A leader's own new entries, sent to the followers: durable before any later
        tick counts the leader towards their commit (a node's engine may sync them once
        for all its groups, after every group ticked). `marks`: their indexes, marked
        synced for path timing once they are."""
        self.make_durable()
        for index in marks:
            pathtiming.mark("raft.synced", ("i", index))

    def tick_soon(self) -> None:
        """Have the next tick come at once rather than after a tick period (the simulator
        ticks on its own schedule)."""

    # -------------------------------------------------------------- proposing

    # -------------------------------------------------------------- elections

    # ------------------------------------------------------------- membership

    # --------------------------------------------------------------- applying

    def _SyncObj__doApplyCommand(self, command: bytes) -> Any:
        if pathtiming.ENABLED:
            self._mark_commit()  # a leader's commit index moved in this tick, just before
        if command[:1] == MEMBERSHIP_PREFIX:
            # the configuration changed when the entry was appended (or at start-up,
            # `_take_configuration_from_log`); changing it again as the entry is
            # committed undid later changes (add D, remove D, add D: D removed until
            # the last add was committed too)
            return None
        if command[:1] == NO_OP_PREFIX:
            self._applied_no_op(command)  # (the cluster's identity, if it carries one)
            return None
        if command[:1] == RAW_PREFIX:
            index = self.raftLastApplied + 1
            try:
                return self.apply_raw(index, command[1:])
            except UnreadableEntryError:
                raise  # the node must stop (its tick loop stops it), not skip the entry
            except Exception:  # an exception here would re-apply the entry forever
                logger.exception("applying log entry %d failed", index)
                return None
        return super()._SyncObj__doApplyCommand(command)

    # ----------------------------------------------------------------- status

    def leader_address(self) -> str | None:
        leader = self._getLeader()
        return None if leader is None else str(leader.id)

    def is_leader(self) -> bool:
        return bool(self._isLeader())

    def role(self) -> str:
        """ "follower", "candidate" or "leader" (PySyncObj's Raft state; metrics)."""
        return ("follower", "candidate", "leader")[self._SyncObj__raftState]

    @property
    def _answered_at(self) -> dict[Any, float]:
        """Per peer: when its last answer to an AppendEntries arrived (monotonic
        seconds). PySyncObj's `lastResponseTime` also holds when this node became leader,
        which is no answer."""
        answered: dict[Any, float] | None = self.__dict__.get("_answered_at_map")
        if answered is None:
            answered = self.__dict__["_answered_at_map"] = {}
        return answered

    def peer_silence(self) -> dict[str, float]:
        """Leader only: seconds each peer has been silent, for judging it down: since its
        last answer, or since this node became leader or last woke from a stall
        (`_look`), whichever is latest. A leader paused past the node-down grace (a GC, a
        starved CPU, a SIGSTOP, in the middle of a tick too) judged every peer down from
        answers it had not read yet; now a peer must stay silent a whole grace after the
        judge wakes."""
        self._look()
        now = _syncobj.monotonicTime()
        answered = self._answered_at
        since = max(self._leader_since, self.awake_since if self.stall_aware_silence else 0.0)
        return {str(n.id): now - max(answered.get(n, 0.0), since) for n in self.otherNodes}

    def peer_answered_ago(self) -> dict[str, float]:
        """Leader only: seconds since each peer last answered an AppendEntries (infinity:
        never, to this node), for judging a down node up again: only a real answer
        counts (a leader back from a stall, or newly elected, marked long-dead nodes up:
        PySyncObj counts its election as an answer from every peer)."""
        now = _syncobj.monotonicTime()
        answered = self._answered_at
        return {str(n.id): now - answered.get(n, -math.inf) for n in self.otherNodes}


__all__ = [
    "ADDED_AT",
    "ARRIVALS_KEPT",
    "COMMIT_NOTICE",
    "HELLO",
    "KEEPALIVE",
    "LEADER_LOST_JITTER_S",
    "LEADER_LOST_TURN_S",
    "LEADER_SILENT_PERIODS",
    "LEARNER_IDLE_S",
    "MAX_COMMAND_BYTES",
    "MAX_LEARNERS",
    "MAX_REACHED",
    "MEMBERS",
    "MEMBERSHIP_PREFIX",
    "NO_OP_PREFIX",
    "PEER_KEEPALIVE_S",
    "PRE_VOTE",
    "PRE_VOTE_ANSWER",
    "PROPOSALS_HELD_S",
    "QUIESCES",
    "QUIET",
    "QUIET_HEARTBEAT_S",
    "QUIET_KEEPALIVE_S",
    "QUIET_TICK_S",
    "QUIET_TIME",
    "RAW_COMMAND",
    "RAW_PREFIX",
    "SNAPSHOT_VERSION",
    "SPEAKS_PRE_VOTE",
    "STALE_TERM",
    "STALL_S",
    "STEP_DOWN",
    "TICK_S",
    "TRANSFER",
    "Entry",
    "LeaderClock",
    "Learner",
    "PreVoteRound",
    "Queued",
    "RaftRules",
    "StampingQueue",
    "StoredSnapshot",
    "decode_snapshot",
    "encode_snapshot",
    "entries_after",
    "leader_fallback_s",
    "node_name",
    "trim_known_entries",
    "wall_clock_ms",
]
