"""Membership: configuration changes taken from the log, learners caught up before they
join (`_caught_up_to_join`), removed members, and snapshots accepted, loaded and
refused (`accept_leader_snapshot`).

A part of `RaftRules` (see `rules`): a mixin over PySyncObj's `SyncObj`."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import pysyncobj.syncobj as _syncobj
from pysyncobj import FAIL_REASON
from pysyncobj.node import Node

from .base import (
    LEARNER_IDLE_S,
    MAX_LEARNERS,
    MEMBERSHIP_PREFIX,
    STEP_DOWN,
    Entry,
    Learner,
    RaftFields,
    encode_snapshot,
    entries_after,
    node_name,
)
from .journal import JournalDamagedError

logger = logging.getLogger(__name__)


class MembershipRules(RaftFields):
    """Membership and snapshots (see the module's docstring)."""

    def make_node(self, name: str, address: str) -> Any:
        """A PySyncObj node for member `name` at `address` (subclasses: of their transport)."""
        raise NotImplementedError

    def run_on_tick_thread(self, call: Callable[[], None]) -> None:
        """Run `call` where PySyncObj's state may be touched (a real member: on its tick
        thread, soon; a simulated one: now)."""
        raise NotImplementedError

    def members(self) -> dict[str, str]:
        """The current Raft configuration as seen here: node name -> Raft address."""
        nodes = [self.selfNode, *self.otherNodes]
        return {node_name(n): str(n.id) for n in nodes}

    def add_member(self, name: str, address: str, callback: Callable[[Any, int], None]) -> None:
        """Propose adding a replica (one change at a time: the leader refuses a second
        while one is uncommitted, `_SyncObj__changeCluster`). `callback(None,
        FAIL_REASON)` on commit or refusal."""
        self.addNodeToCluster(self.make_node(name, address), callback)

    def remove_member(self, address: str, callback: Callable[[Any, int], None]) -> None:
        """Propose removing the replica at `address` (a node cannot remove itself)."""
        node = next((n for n in self.otherNodes if str(n.id) == address), None)
        if node is None:
            callback(None, FAIL_REASON.REQUEST_DENIED)  # not a member (any more)
            return
        self.removeNodeFromCluster(node, callback)

    def connected(self) -> dict[str, bool]:
        """Per peer name: whether this node has a live Raft connection to it."""
        return {node_name(n): bool(self.isNodeConnected(n)) for n in self.otherNodes}

    def ask_leader_to_step_down(self) -> None:
        """Ask the leader (this node or another) to hand leadership to its most caught-up
        follower now (Raft's TimeoutNow). Best effort: watch the leader to see it happen."""

        def ask() -> None:
            leader = self._getLeader()
            if leader is None:
                return
            if self._isLeader():
                self.transferLeadership(None, None)
            else:
                self._SyncObj__transport.send(leader, {"type": STEP_DOWN})

        self.run_on_tick_thread(ask)

    def _SyncObj__changeCluster(self, request: Any) -> bool:
        """As leader, append a configuration change only if no earlier one is still
        uncommitted (Raft's single-server changes), and add a node only once it has
        caught up as a learner (`_caught_up_to_join`). PySyncObj 0.3.17 reads its
        `__changeClusterIDx` but never sets it, so two concurrent `members add` gave
        {A..E} from {A,B,C}, whose quorum {A,D,E} does not overlap the old quorum {B,C}:
        two leaders could commit at the same index. Refused, the request is answered
        REQUEST_DENIED and may be tried again (the node core does, until its deadline)."""
        if self.uncommitted_membership_change():
            logger.info("refusing a membership change: an earlier one is not committed yet")
            return False
        if not self._caught_up_to_join(request):
            return False
        accepted = bool(super()._SyncObj__changeCluster(request))
        if accepted and request[0] == "add":
            self._promote_learner(request[2])
        return accepted

    @property
    def learners(self) -> dict[Any, Learner]:
        """Leader only: nodes being caught up before they are added, by node."""
        learners: dict[Any, Learner] | None = self.__dict__.get("_learners")
        if learners is None:
            learners = self.__dict__["_learners"] = {}
        return learners

    def _caught_up_to_join(self, request: Any) -> bool:
        """The learner stage (as RabbitMQ and etcd have it): the first `add` of a node
        makes it a learner, which this leader sends the log to (a snapshot first, if
        the log was compacted) without counting it in any majority. It catches up in
        rounds (Raft thesis 4.2.1): a round ends when the learner has the leader's last
        index of the round's start; the add is refused (the node core asks again every
        0.1 s) until a round has ended within the longest election timeout, so the new
        voter is as far behind as one round trip. Adding an empty node straight away
        made it a voter that the new majority needed before anything else could commit:
        with a member down, the cluster stopped until the new node had the whole log,
        or for good if it never came up. (A target moved to the commit index at each
        ask was never reached by a learner more than 0.1 s away: each ask commits a
        barrier first.)"""
        if not self.learner_stage or request[0] != "add" or len(request) < 3:
            return True
        node = request[2]
        if not isinstance(node, Node) or node == self._SyncObj__selfNode:
            return True
        if node in self._SyncObj__otherNodes:
            return True  # (PySyncObj refuses it: nothing to add)
        now = _syncobj.monotonicTime()
        learner = self.learners.get(node)
        if learner is None:
            if len(self.learners) >= MAX_LEARNERS:
                logger.info("refusing to add %s: %d nodes are catching up", node, MAX_LEARNERS)
                return False
            self.learners[node] = Learner(now, self._SyncObj__getCurrentLogIndex())
            self._SyncObj__readonlyNodes.add(node)
            self._SyncObj__raftNextIndex[node] = self._SyncObj__getCurrentLogIndex() + 1
            self._SyncObj__raftMatchIndex[node] = 0
            self._SyncObj__transport.addNode(node)
            logger.info("catching %s up before adding it (a learner)", node)
            return False
        learner.asked_at = now
        matched: int = self._SyncObj__raftMatchIndex.get(node, 0)
        if node not in self._SyncObj__connectedNodes or matched < learner.target:
            return False
        round_s = now - learner.round_started
        if round_s <= self._SyncObj__conf.raftMaxTimeout:
            logger.info("%s caught up (through %d): adding it", node, matched)
            return True
        learner.round_started, learner.target = now, self._SyncObj__getCurrentLogIndex()
        return False

    def learner_progress(self) -> dict[str, int]:
        """Leader only: per node being caught up, the last index it has (status)."""
        matched = self._SyncObj__raftMatchIndex
        return {node_name(n): int(matched.get(n, 0)) for n in list(self.learners)}

    def _promote_learner(self, node: Any) -> None:
        """The add of a learner is appended: it is a voter now (kept connected)."""
        if self.learners.pop(node, None) is not None:
            self._SyncObj__readonlyNodes.discard(node)
            self.learners_joined += 1

    def _drop_learners(self) -> None:
        """Forget learners nobody asked to add for `LEARNER_IDLE_S`, and every learner
        once this node no longer leads (the next leader starts its own when asked)."""
        learners = self.learners
        if not learners:
            return
        idle_since = _syncobj.monotonicTime() - LEARNER_IDLE_S
        leads = self._isLeader()
        for node, learner in list(learners.items()):
            if leads and learner.asked_at > idle_since:
                continue
            del learners[node]
            self._SyncObj__readonlyNodes.discard(node)
            self._SyncObj__serializer.cancelTransmisstion(node)  # (sic: PySyncObj's name)
            if node not in self._SyncObj__otherNodes:
                self.__dict__.get("_reached_leaders", {}).pop(str(node.id), None)
                self._SyncObj__raftNextIndex.pop(node, None)
                self._SyncObj__raftMatchIndex.pop(node, None)
                self._answered_at.pop(node, None)
                self._SyncObj__transport.dropNode(node)
            logger.info("no longer catching %s up", node)

    @property
    def removed_members(self) -> set[str]:
        """Names of the members removed from the configuration (and not added back),
        as this log says, kept in snapshots: whichever node leads marks them down."""
        removed: set[str] | None = self.__dict__.get("_removed_members")
        if removed is None:
            removed = self.__dict__["_removed_members"] = set()
        return removed

    def _SyncObj__doChangeCluster(self, request: Any, reverse: bool = False) -> bool:
        # a removal names the node by its address: its name is known while it is a member
        names = {str(n.id): node_name(n) for n in self.otherNodes}
        changed = bool(super()._SyncObj__doChangeCluster(request, reverse))
        if changed:
            node = request[2] if len(request) >= 3 else request[1]
            address = str(getattr(node, "id", node))
            name = names.get(address) or str(getattr(node, "name", address))
            if (request[0] == "add") != reverse:
                self.removed_members.discard(name)
            else:
                self.removed_members.add(name)
        return changed

    def configuration_at(self, index: int, cluster: Iterable[Any]) -> set[Any]:
        """The configuration as of log index `index`: `cluster` (this node's now) with
        every configuration entry after `index` undone, newest first. A snapshot of the
        log up to `index` stores this one: changes take effect when appended, so the
        node's configuration may hold changes after it, and one a new leader then cut
        came back from the snapshot at the next start-up (second review, 1)."""
        nodes = {str(n.id): n for n in cluster}
        log = self._SyncObj__raftLog
        for pos in range(len(log) - 1, -1, -1):
            command, idx, _ = log[pos]
            if idx <= index:
                break
            if command[:1] != MEMBERSHIP_PREFIX:
                continue
            change = self._SyncObj__parseChangeClusterRequest(command)
            if change is None or change[0] not in ("add", "rem"):
                continue
            node = change[2] if len(change) >= 3 else change[1]
            if not isinstance(node, Node):
                node = self._SyncObj__nodeClass(node)
            if change[0] == "add":
                nodes.pop(str(node.id), None)
            else:
                nodes[str(node.id)] = node
        return set(nodes.values())

    def uncommitted_membership_change(self) -> bool:
        """Whether this log holds a configuration entry after the commit index."""
        log = self._SyncObj__raftLog
        commit = self._SyncObj__raftCommitIndex
        for pos in range(len(log) - 1, -1, -1):
            command, idx, _ = log[pos]
            if idx <= commit:
                return False
            if command[:1] == MEMBERSHIP_PREFIX:
                return True
        return False

    def stored_snapshot(self) -> tuple[Entry, Entry] | None:
        """The last and the previous entry of the snapshot this node has stored, or None
        (subclasses read their snapshot store; `JournalDamagedError` if it is damaged)."""
        return None

    def check_stored_state(self) -> None:
        """Before the first tick: this node's snapshot and journal belong together.

        A journal compacted past its first entries with no snapshot to hold them would
        make the node apply the rest to an empty machine: refused. A crash after the
        snapshot was written and before the journal was compacted behind it (or after a
        leader's snapshot was stored and before the journal was replaced) leaves a
        journal that does not start at the snapshot: if it holds the snapshot's last
        entry, the compaction is finished here, keeping every entry after it. (PySyncObj
        cleared such a journal at start-up, taking entries this node had acknowledged,
        and committed ones, with it.)"""
        log = self._SyncObj__raftLog
        stored = self.stored_snapshot()
        if stored is None:
            if len(log) and log[0][1] > 1:
                raise JournalDamagedError(
                    f"the journal starts at entry {log[0][1]} (compacted), but there is no "
                    "snapshot holding the entries before it: the node would apply the rest "
                    "to an empty state. Restore the snapshot file, or remove the node from "
                    "the cluster, move its data directory away and add it again empty, at "
                    "a new Raft address (a member that missed its removal must not count "
                    "the empty node's vote)"
                )
            self._take_configuration_from_log(after=0)
            return
        last, prev = stored
        if len(log) >= 2 and tuple(log[0]) == prev and tuple(log[1]) == last:
            return
        pos = last[1] - log[0][1] if len(log) else -1
        if 1 <= pos < len(log) and tuple(log[pos]) == last and tuple(log[pos - 1]) == prev:
            logger.info(
                "finishing a compaction a crash interrupted: the journal now starts at %d",
                prev[1],
            )
            log.deleteEntriesTo(pos - 1)

    def _take_configuration_from_log(self, after: int) -> None:
        """At start-up: the configuration is the one the log ends with, committed or not
        (Raft's rule): the first configuration (`--peer`, or the snapshot's, which holds
        the log up to `after`), changed by every configuration entry after it.

        PySyncObj started from the first configuration and changed it only as entries
        were committed, so a node that had appended `remove A` and `add D` and restarted
        before it learned they were committed counted votes in {A, B, C}: with A, cut off
        in the old configuration, it was elected while the leader of {B, C, D} committed
        with C and D, and the two overwrote each other's entries (simulator, seed 169).
        The entries change the configuration here once (`_SyncObj__doApplyCommand`
        leaves them alone when they are committed)."""
        log = self._SyncObj__raftLog
        for pos in range(len(log)):
            command, index, _ = log[pos]
            if index > after and command[:1] == MEMBERSHIP_PREFIX:
                change = self._SyncObj__parseChangeClusterRequest(command)
                if change is not None:
                    self._SyncObj__doChangeCluster(change)

    def _SyncObj__loadDumpFile(self, clearJournal: bool) -> None:
        kept, self._kept_after_snapshot = self._kept_after_snapshot, []
        self._snapshot_load_error = None
        super()._SyncObj__loadDumpFile(clearJournal)
        if self._snapshot_load_error is not None:
            # PySyncObj logged it and went on with an empty machine, voting and leading
            error = self._snapshot_load_error
            raise JournalDamagedError(f"the snapshot could not be loaded: {error}")
        if not clearJournal:  # this node's own snapshot, at start-up
            self._take_configuration_from_log(after=self._SyncObj__raftLastApplied)
        if clearJournal:
            self._installed_through = self._SyncObj__raftLastApplied
            # The answer acknowledges the snapshot's last entry only, as Raft's does: the
            # kept entries after it may conflict with the leader's log (an old leader's
            # uncommitted tail), and the leader must not count them as replicated. It
            # sends from there on, and a conflict cuts them as any AppendEntries would.
            self._answer_after_install = self._SyncObj__raftLastApplied + 1
        log = self._SyncObj__raftLog
        if not kept or not len(log) or log[-1][1] != kept[0][1] - 1:
            return
        for entry in kept:
            log.add(*entry)
            change = self._SyncObj__parseChangeClusterRequest(entry[0])
            if change is not None:  # the snapshot's configuration is older than these
                self._SyncObj__doChangeCluster(change)

    def snapshot_bytes(self, data: tuple[Entry, Entry, Any]) -> bytes:
        """The snapshot PySyncObj asks for (its last entry, the one before, its
        configuration), in our encoding: the machine's state, the members as of its
        last entry, the removed members. For the subclasses' serializers."""
        last, prev, cluster = data
        members = [(str(n.id), node_name(n)) for n in self.configuration_at(last[1], cluster)]
        return encode_snapshot(last, prev, members, self._snapshot(), self.removed_members)

    def accept_leader_snapshot(self, last_index: int, last_term: int) -> bool:
        """The leader's snapshot, up to entry (`last_index`, `last_term`), has arrived
        whole: whether to install it. One not ahead of what this node applied is refused
        and answered.

        Installed the Raft way: if this log holds the snapshot's last entry (same index,
        same term), the entries after it are kept (`_SyncObj__loadDumpFile`); only a log
        that does not hold it is discarded. PySyncObj cleared the whole journal, so a
        follower that had acknowledged more than it had applied lost entries that may be
        committed (a crash then lost them for good).

        A late refusal can send the leader back below what a follower holds, and the
        leader then sends its snapshot again; a follower that installed it applied the
        entries after it a second time, and ran their effects again: deliveries its
        consumers had had. A stale snapshot is answered as what it is: this node holds,
        committed, everything up to what it applied. The caller keeps its own snapshot
        as it is (and the commit index stays: `_SyncObj__onMessageReceived`)."""
        applied = self.raftLastApplied
        if last_index > applied:
            self._kept_after_snapshot = entries_after(self._SyncObj__raftLog, last_index, last_term)
            return True
        logger.info(
            "not installing the leader's snapshot at index %d: applied up to %d already",
            last_index,
            applied,
        )
        self._SyncObj__sendNextNodeIdx(self._message_from, nextNodeIdx=applied + 1, success=True)
        return False
