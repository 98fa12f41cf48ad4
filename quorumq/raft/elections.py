"""Elections that do not disrupt a working cluster: pre-vote, leader stickiness, the
stale-term answer, check-quorum, votes refused to nodes outside the configuration,
stalls noticed and not counted against peers (`_look`; `RaftRules.peer_silence`), leadership
transfer, votes for a node added by an entry past this node's log (`_elects_outsider`).

A part of `RaftRules` (see `rules`): a mixin over PySyncObj's `SyncObj`."""

from __future__ import annotations

import logging
import math
from typing import Any

import pysyncobj.syncobj as _syncobj

from .base import (
    ADDED_AT,
    CANDIDATE,
    FOLLOWER,
    HELLO,
    LEADER,
    MAX_REACHED,
    MEMBERS,
    MEMBERSHIP_PREFIX,
    PRE_VOTE,
    PRE_VOTE_ANSWER,
    QUIESCES,
    QUIET_HEARTBEAT_S,
    SPEAKS_PRE_VOTE,
    STALL_S,
    TICK_S,
    TRANSFER,
    Entry,
    PreVoteRound,
    RaftFields,
    StoredSnapshot,
    node_name,
)

logger = logging.getLogger(__name__)


class Elections(RaftFields):
    """Elections (see the module's docstring)."""

    @property
    def _speakers(self) -> set[Any]:
        """Peers known to speak pre-vote (they said hello, or asked or answered one)."""
        speakers: set[Any] | None = self.__dict__.get("_speakers_set")
        if speakers is None:
            speakers = self.__dict__["_speakers_set"] = set()
        return speakers

    def _look(self) -> float | None:
        """The Raft thread looks at the clock. A gap since its last look, `STALL_S`
        longer than the wait it planned (`tick_wait_s`) beyond a busy tick, is a stall of
        this node: what it heard before is as old as the stall, and says nothing of its
        peers meanwhile (`peer_silence` counts no silence across it). Returns when the
        stall began (None: no stall)."""
        now = _syncobj.monotonicTime()
        before = self._last_look
        self._last_look = now
        if not before or now - before <= STALL_S + max(0.0, self.planned_wait_s - TICK_S):
            return None
        self.awake_since = now
        self.stalls += 1
        return before

    def _onTick(self, timeToWait: float = 0.0) -> None:
        stalled_from = self._look()
        self._drop_learners()
        if stalled_from is not None and self.stall_aware_silence and not self._isLeader():
            # A follower whose deadline ran out during its own stall reads what its
            # leader sent before it judges the leader gone (PySyncObj looks at the
            # deadline before it reads); once, or a node whose every tick comes late
            # would never stand at all.
            deadline: float = self._SyncObj__raftElectionDeadline
            if stalled_from < deadline <= self.awake_since and not self._deadline_pushed:
                period: float = self._SyncObj__conf.appendEntriesPeriod
                self._SyncObj__raftElectionDeadline = self.awake_since + 2 * period
                self._deadline_pushed = True
        self._pre_vote_gate()
        if not self.pre_vote or self._isLeader():
            super()._onTick(timeToWait)
            return
        # PySyncObj looks at the deadline again, a moment later: it must never stand for
        # election by itself (without pre-vote) when the deadline falls in between, or a
        # stall there. What its poll sets (a heartbeat, a vote, a transfer) is kept.
        deadline = self._deadline_in_tick = self._SyncObj__raftElectionDeadline
        self._SyncObj__raftElectionDeadline = math.inf
        try:
            super()._onTick(timeToWait)
        finally:
            self._deadline_in_tick = None
            if self._SyncObj__raftElectionDeadline == math.inf:
                self._SyncObj__raftElectionDeadline = deadline

    def _pre_vote_gate(self) -> None:
        """Before PySyncObj's tick: if this follower's election deadline has passed, ask
        for pre-votes instead of raising its term; stand for election only once a
        majority said it could win (`_on_pre_vote_answer`), or for a leadership
        transfer. A node cut off, paused or behind so never raises its term, and never
        deposes a leader that a majority still hears (the lagging follower of issue 27
        took the term from 5 to 102 in 33 s, and each new leader began its search for
        the follower's match point again).

        Mixed versions (a rolling upgrade): a peer of an earlier version ignores
        pre-votes and never says hello. After a whole round without a majority, the
        connected peers never heard to speak pre-vote count as granting (they vote as
        before), so a cluster with old nodes elects as it did before; stickiness holds
        only against nodes known to speak pre-vote, so an old node with a higher term
        is never locked out (etcd #8501: stickiness without pre-vote on the other side
        left a node out for good); and a new node at a higher term than a new leader
        tells it (`STALE_TERM`), where an old one still deposes it with its vote
        request, as before."""
        if self._SyncObj__raftState == LEADER or self._SyncObj__selfNode is None:
            self._pre_vote_round = None
            return
        now = _syncobj.monotonicTime()
        if self._SyncObj__raftElectionDeadline >= now or not self._SyncObj__connectedToAnyone():
            return
        if not self.pre_vote:
            self.elections += 1
            return  # PySyncObj stands for election in this tick
        transfer = bool(self._SyncObj__transferInProgress)
        round_ = self._pre_vote_round
        if transfer or not self._SyncObj__otherNodes:
            self._start_election(transfer=transfer)
        elif round_ is not None and self._with_earlier_versions(round_):
            self._start_election(transfer=False)
        else:
            if round_ is not None:
                self.pre_votes_lost += 1
            self._start_pre_vote(now)

    def _majority(self, votes: int) -> bool:
        return votes > (len(self._SyncObj__otherNodes) + 1) / 2

    def _with_earlier_versions(self, round_: PreVoteRound) -> bool:
        """Whether the round's grants, with the connected peers never heard to speak
        pre-vote, make a majority."""
        others = self._SyncObj__otherNodes
        connected = self._SyncObj__connectedNodes
        earlier = {n for n in others if n in connected and n not in self._speakers}
        return bool(earlier) and self._majority(1 + len((round_.granted & others) | earlier))

    def _start_pre_vote(self, now: float) -> None:
        self._deadline_pushed = False
        me = self._SyncObj__selfNode
        self.pre_vote_rounds += 1
        round_ = PreVoteRound(self.pre_vote_rounds, self.raftCurrentTerm + 1, me)
        self._pre_vote_round = round_
        self._SyncObj__raftElectionDeadline = now + self._SyncObj__generateRaftTimeout()
        request = {
            "type": PRE_VOTE,
            "term": round_.term,
            "round": round_.number,
            "last_log_index": self._SyncObj__getCurrentLogIndex(),
            "last_log_term": self._SyncObj__getCurrentLogTerm(),
            ADDED_AT: self._own_add_index(),
        }
        transport = self._SyncObj__transport
        for node in sorted(self._SyncObj__otherNodes, key=lambda n: n.id):
            transport.send(node, request)

    def _start_election(self, *, transfer: bool) -> None:
        """PySyncObj's election, with vote requests that say who asks and why."""
        self._pre_vote_round = None
        self.elections += 1
        self._SyncObj__raftElectionDeadline = (
            _syncobj.monotonicTime() + self._SyncObj__generateRaftTimeout()
        )
        self._SyncObj__transferInProgress = False
        self._SyncObj__raftLeader = None
        self._SyncObj__setState(CANDIDATE)
        self._SyncObj__setCurrentTerm(self.raftCurrentTerm + 1, self._SyncObj__selfNode.id)
        self._SyncObj__votesCount = 1
        request = {
            "type": "request_vote",
            "term": self.raftCurrentTerm,
            "last_log_index": self._SyncObj__getCurrentLogIndex(),
            "last_log_term": self._SyncObj__getCurrentLogTerm(),
            SPEAKS_PRE_VOTE: True,
            ADDED_AT: self._own_add_index(),
        }
        if transfer:
            request[TRANSFER] = True
        transport = self._SyncObj__transport
        for node in sorted(self._SyncObj__otherNodes, key=lambda n: n.id):
            transport.send(node, request)
        self._SyncObj__onLeaderChanged()
        if self._majority(self._SyncObj__votesCount):
            self._SyncObj__onBecomeLeader()

    def _log_up_to_date(self, last_index: Any, last_term: Any) -> bool:
        """Raft's election restriction: a log at least as up to date as this one's."""
        my_term: int = self._SyncObj__getCurrentLogTerm()
        if type(last_index) is not int or type(last_term) is not int:
            return False
        return last_term > my_term or (
            last_term == my_term and last_index >= self._SyncObj__getCurrentLogIndex()
        )

    def in_lease(self) -> bool:
        """Whether this node heard from its leader within the minimum election timeout,
        or, leading, from a majority within it: the cluster works, and a pre-vote or a
        vote (other than for a transfer) would only disrupt it. Quiet, the window is a
        quiet period longer (the heartbeats come that much further apart)."""
        now = _syncobj.monotonicTime()
        window: float = self._SyncObj__conf.raftMinTimeout
        if self._isLeader():
            if self._quiet_sent:
                window += QUIET_HEARTBEAT_S
            answered = self._answered_at
            since = max(now - window, self.awake_since)
            heard = sum(1 for n in self._SyncObj__otherNodes if answered.get(n, 0.0) > since)
            return self._majority(1 + heard)
        heard_at = self.leader_heard_at
        window += self.leader_quiet_s
        return bool(
            self._SyncObj__raftLeader is not None
            and self._leader_closed is None  # its connection closed: it may be gone
            and heard_at is not None
            and now - heard_at < window
        )

    def _is_member(self, node: Any) -> bool:
        return node in self._SyncObj__otherNodes

    def _elects_outsider(self, message: dict[str, Any]) -> bool:
        """Whether this node may vote for an asker outside its configuration: one whose
        log holds the entry that added it, past this log's end (this node missed it).
        A removed node, a learner or a stranger holds no such entry, and stays ignored.
        Raft's votes never depended on the voter's configuration (thesis 4.1); ignoring
        outsiders only kept removed nodes from disrupting. Without this, {A, B, C, D}
        with B lost for good, A behind the add of D, and D's log longer than C's, could
        never elect: A ignored D, D refused C (simulator, seed 140)."""
        added_at = message.get(ADDED_AT)
        return type(added_at) is int and added_at > self._SyncObj__getCurrentLogIndex()

    def took_snapshot(self, stored: StoredSnapshot) -> None:
        """A snapshot was read (this node's own at start-up, or its leader's): the
        members it removed, and whether its configuration has this node."""
        self.removed_members.clear()
        self.removed_members.update(stored.removed)
        me = self._SyncObj__selfNode
        has_me = me is not None and any(a == str(me.id) for a, _ in stored.members)
        self._member_at_snapshot = int(stored.last[1]) if has_me else 0

    def _own_add_index(self) -> int:
        """The index of the entry in this log that added this node, or, if no entry of
        this log names it, the last index of a snapshot whose configuration has it (it
        was added by then: in the first configuration, or by an entry compacted away;
        CI sweep seed 14: D's add was in its snapshot, and A gone for good, B ignored
        it). 0: none of them; it is no member (a learner, a removed node)."""
        me = self._SyncObj__selfNode
        log = self._SyncObj__raftLog
        for pos in range(len(log) - 1, -1, -1):
            command, idx, _ = log[pos]
            if command[:1] != MEMBERSHIP_PREFIX:
                continue
            change = self._SyncObj__parseChangeClusterRequest(command)
            if change is None or len(change) < 2:
                continue
            if str(getattr(change[1], "id", change[1])) == str(me.id):
                return int(idx) if change[0] == "add" else 0
        return self._member_at_snapshot

    def _SyncObj__setCurrentTerm(self, term: int, votedForNodeId: Any) -> None:
        if term != self.raftCurrentTerm:
            self._pre_vote_round = None  # its grants were for a term that is gone
        super()._SyncObj__setCurrentTerm(term, votedForNodeId)

    def _set_higher_term(self, term: int) -> None:
        """Take a higher term seen on the wire and follow (as PySyncObj does for a vote)."""
        self._SyncObj__setCurrentTerm(term, None)
        self._SyncObj__setState(FOLLOWER)
        self._SyncObj__raftLeader = None
        self._pre_vote_round = None

    def _on_pre_vote(self, node: Any, message: dict[str, Any]) -> None:
        """Could `node` win an election? Yes only for a member whose term would be past
        this node's, whose log is up to date, while this node hears no working leader.
        Nothing changes here either way."""
        self._speakers.add(node)
        term = message.get("term")
        granted = (
            type(term) is int
            and term > self.raftCurrentTerm
            and (self._is_member(node) or self._elects_outsider(message))
            and self._log_up_to_date(message.get("last_log_index"), message.get("last_log_term"))
            and not (self.leader_stickiness and self.in_lease())
        )
        answer: dict[str, Any] = {
            "type": PRE_VOTE_ANSWER,
            "term": term,
            "round": message.get("round"),
            "granted": granted,
            "current_term": self.raftCurrentTerm,
        }
        leader = self._SyncObj__raftLeader
        if not granted and leader is not None:
            answer["leader"] = [str(leader.id), node_name(leader)]
        me = self._SyncObj__selfNode
        answer[MEMBERS] = [[str(n.id), node_name(n)] for n in [me, *self._SyncObj__otherNodes]]
        self._SyncObj__transport.send(node, answer)

    def _on_pre_vote_answer(self, node: Any, message: dict[str, Any]) -> None:
        self._speakers.add(node)
        self._reach_leader(message.get("leader"))
        members = message.get(MEMBERS)
        if isinstance(members, list):
            for member in members[:MAX_REACHED]:
                self._reach_leader(member, why="a member of a peer's configuration")
        current = message.get("current_term")
        if type(current) is int and current > self.raftCurrentTerm and not self._isLeader():
            # A node is at a higher term: take it, or no round of ours could be granted
            # by it (and a log only this node has could never lead again).
            self._set_higher_term(current)
            return
        round_ = self._pre_vote_round
        if (
            round_ is None
            or message.get("term") != round_.term
            or round_.term != self.raftCurrentTerm + 1
            or message.get("round") != round_.number
            or self._isLeader()
        ):
            return  # late: an answer to an earlier round, or from before a new term
        (round_.granted if message.get("granted") else round_.refused).add(node)
        if self._majority(len(round_.granted & self._SyncObj__otherNodes) + 1):
            self._start_election(transfer=False)

    def _reach_leader(self, leader: Any, why: str = "a leader") -> None:
        """A member that refused this node a pre-vote named its leader: if this node's
        configuration lacks that leader (it missed the entry adding it, or installed a
        snapshot from before it), connect to it all the same; its AppendEntries bring
        that entry. PySyncObj connects only to the members of its configuration, so
        such a follower never heard from that leader, and (once pre-vote kept it from
        deposing the leader) stayed behind for good (simulator, seed 43 of the CI
        sweep: a node wiped and added back, whose first snapshot predated the leader's
        own add). The name comes from an authenticated member; the connection is
        authenticated as any other."""
        if not (
            isinstance(leader, list | tuple)
            and len(leader) == 2
            and all(isinstance(part, str) for part in leader)
        ):
            return
        address, name = leader
        me = self._SyncObj__selfNode
        known = {str(n.id) for n in self._SyncObj__otherNodes}
        if me is None or address == str(me.id) or address in known or self._isLeader():
            return
        reached: dict[str, Any] = self.__dict__.setdefault("_reached_leaders", {})
        if address in reached or len(reached) >= MAX_REACHED:
            return
        reached[address] = node = self.make_node(name, address)
        logger.info("reaching %s %s at %s, which this configuration lacks", why, name, address)
        self._SyncObj__transport.addNode(node)

    def _forget_reached_leaders(self) -> None:
        """A leader of this configuration is heard: leaders reached outside it that are
        still not members are dropped from the transport (it redialled them for good),
        and any may be reached again later."""
        leader = self._SyncObj__raftLeader
        if leader is not None and leader in self._SyncObj__otherNodes:
            self._drop_reached()

    def _drop_reached(self) -> None:
        reached: dict[str, Any] | None = self.__dict__.get("_reached_leaders")
        if not reached:
            return
        members = {str(n.id) for n in self._SyncObj__otherNodes}
        for address in sorted(set(reached) - members):
            self._SyncObj__transport.dropNode(reached[address])
        reached.clear()

    def _ignores_vote(self, node: Any, message: dict[str, Any]) -> bool:
        """Whether a vote request is dropped unread (no term taken, no vote): from a node
        outside this configuration (a removed server), or, while this node is in its
        lease, from a node that speaks pre-vote and was not asked to take over."""
        if self._SyncObj__selfNode is None:
            return False
        if not self._is_member(node) and not self._elects_outsider(message):
            return True
        speaks = bool(message.get(SPEAKS_PRE_VOTE)) or node in self._speakers
        return (
            self.leader_stickiness
            and speaks
            and not message.get(TRANSFER)
            and message.get("term", 0) > self.raftCurrentTerm
            and self.in_lease()
        )

    def _SyncObj__onNodeConnected(self, node: Any) -> None:
        super()._SyncObj__onNodeConnected(node)
        if self.pre_vote or self.quiescence:
            hello = {"type": HELLO, SPEAKS_PRE_VOTE: self.pre_vote, QUIESCES: self.quiescence}
            self._SyncObj__transport.send(node, hello)
        if self._isLeader():
            # a heartbeat at the next tick, not a quiet period later: a follower whose
            # connection to its leader closed elects within two busy periods
            self._SyncObj__newAppendEntriesTime = 0.0
            self.tick_soon()

    def _conflict_hint(self, prev_index: int) -> int:
        """Where the leader should send from after this follower refused an
        AppendEntries whose previous entry (`prev_index`) has another term here: the
        first index of that term in this log (Raft thesis 5.3: all of a term's entries
        are skipped in one round trip, not one index per heartbeat), never below what
        is committed here, nor below this log's second entry (a refusal named the
        first, and the leader's next message would be refused for lack of it)."""
        log = self._SyncObj__raftLog
        if not len(log):
            return prev_index
        first = log[0][1]
        pos = prev_index - first
        if not 0 <= pos < len(log):
            return prev_index
        term = log[pos][2]
        lo, hi = 0, pos  # terms never decrease along a log: the first of `term`
        while lo < hi:
            mid = (lo + hi) // 2
            if log[mid][2] < term:
                lo = mid + 1
            else:
                hi = mid
        hint: int = max(log[lo][1], self.raftCommitIndex + 1, first + 1)
        return min(prev_index, hint)

    def _send_to(self, node: Any) -> None:
        """As leader, send `node` its next AppendEntries now (after its refusal). One
        that needs a snapshot or a chunked entry is left to the next tick, which sends
        at once."""
        if node not in self._SyncObj__connectedNodes:
            return
        next_index = self._SyncObj__raftNextIndex.get(node)
        log = self._SyncObj__raftLog
        batch = self._SyncObj__conf.appendEntriesBatchSizeBytes
        last = self._SyncObj__getCurrentLogIndex()
        entries: list[Entry] = []
        if next_index is not None and log[0][1] < next_index <= last:
            entries = self._SyncObj__getEntries(next_index, None, batch)
        if (
            next_index is None
            or next_index <= log[0][1]
            or (len(entries) == 1 and len(entries[0][0]) >= batch)
        ):
            self._SyncObj__newAppendEntriesTime = 0.0
            self.tick_soon()
            return
        prev_index, prev_term = self._SyncObj__getPrevLogIndexTerm(next_index)
        if entries:
            self._SyncObj__raftNextIndex[node] = entries[-1][1] + 1
        self._SyncObj__transport.send(
            node,
            {
                "type": "append_entries",
                "term": self.raftCurrentTerm,
                "commit_index": self.raftCommitIndex,
                "entries": entries,
                "prevLogIdx": prev_index,
                "prevLogTerm": prev_term,
            },
        )
