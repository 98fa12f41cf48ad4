"""The operator: membership changes made as an administrator makes them.

Every change goes through the node's real administrative path: the operator's client
(`SimClient` with the admin token, the real `ClientSession`) sends `add_member` or
`remove_member` to a running member, and that node's `NodeCore` does what it does on a
real node (a barrier through the log, then it answers, refuses or proposes the change;
it asks a leader being removed to hand leadership over first; it tries the change again
while the leader refuses it; it answers once it is committed). The rules it follows:

* add: start the node on an empty disk with every current member and itself as peers
  (as the README says), then `members add` it; only while every member is up,
  connected to the leader, caught up and has the leader's configuration
  (`all_members_up`; else it waits).
* remove: `members remove` it, sent to another member; then, a moment later, stop its
  process. Until then it keeps running, cut off: the members dropped it from their
  configuration and refuse its connections, it hears from no leader, and the clients
  still connected to it get no answers (they reconnect to a member once it stops; new
  connections go to members only: `Cluster.serving`). Its consumers are marked down
  by whichever node leads (`failure_commands`: a removed member never answers), so
  what they held goes back to the queue.
* add back: a node removed earlier comes back empty (its data directory moved away,
  `Cluster.wipe`) at a new Raft address (`C@2`), as a new replica. Not with its old
  log: it would start with its old `--peer` list, and a member added since could
  never reach it (PySyncObj refuses connections from nodes it does not know). Not
  empty at its old address either: a member that missed its removal still counts
  that address in its configuration, and could win the empty node's vote and lead
  beside the real leader (simulator, seed 180, before this rule).
* a request that fails (a timeout, outcome unknown, a lost connection) is sent again,
  to another member, after a moment: adding a member with its address is answered
  with the members, removing a node that is no member is `unknown_member`, which the
  operator takes as done.
* at heal: no new change starts; those in flight finish; the first members removed
  are added back and a member whose disk is damaged beyond repair is removed and
  added back (empty, at a new address: the README's way back for such a node).

`membership` (in the cluster) changes when the operator learns a change is committed.
`feasible` keeps the cluster able to make progress: no change may leave (at any point,
whatever order the changes in flight commit in) a configuration of fewer than two
members, or one whose members with a disk beyond repair (`SimDisk.doomed`: they never
start again) are half of it or more. Damage faults ask it too.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import attrs

from .clients import SimClient
from .node import ADMIN_TOKEN, SimNode
from .world import micros

if TYPE_CHECKING:
    import random

    from quorumq.client.core import QuorumqError

    from .cluster import Cluster

ADMIN_REQUEST_TIMEOUT_S = 30.0
"""Longer than the node core's `MEMBERSHIP_DEADLINE_S`: the node answers first."""
RETRY_S = (0.5, 1.5)
STOP_AFTER_S = (0.3, 3.0)
"""How long a removed node keeps running, cut off, before its operator stops it."""


@attrs.frozen
class Change:
    kind: str
    """"add" or "remove"."""
    node: str
    address: str = ""
    """The Raft address of a node added (set when it is sent)."""

    def frame(self) -> dict[str, Any]:
        if self.kind == "add":
            return {"t": "add_member", "node": self.node, "raft_address": self.address}
        return {"t": "remove_member", "node": self.node}

    def applied_to(self, members: set[str]) -> set[str]:
        return members | {self.node} if self.kind == "add" else members - {self.node}


class Operator:
    """Sends membership changes and follows them up (see the module's docstring)."""

    same_address_when_added_back = False
    """Test-only: a node added back comes back empty at its old Raft address (not safe:
    see the module's docstring)."""
    adds_wait_for_every_member = True
    """An add waits until every member is up (`all_members_up`), as the README asks.
    The learner stage made an add with a member down cost no availability, but a
    member that misses an add still cannot vote for the new node before it has heard
    of it: with another member lost for good they could never elect (CI sweep seed 14
    with adds that did not wait). False: adds go at once (tests of the learner stage)."""

    def __init__(self, cluster: Cluster, rng: random.Random) -> None:
        self.cluster = cluster
        self.world = cluster.world
        self.random = rng
        self.in_flight: dict[str, Change] = {}
        """Per node: the change sent for it and not yet confirmed."""
        self.counts: Counter[str] = Counter()
        """Requests sent, confirmed, and failed (then sent again)."""
        self.ending = False
        """The fault phase is over: no new change starts (those in flight finish)."""

    # ------------------------------------------------------------ feasibility

    def configurations(self, changes: Iterable[Change] = ()) -> list[set[str]]:
        """Every configuration the cluster may pass through while the changes in flight
        and `changes` commit, in any order."""
        pending = [*self.in_flight.values(), *changes]
        configs = []
        for n in range(len(pending) + 1):
            for subset in itertools.combinations(pending, n):
                members = set(self.cluster.membership)
                for change in subset:
                    members = change.applied_to(members)
                configs.append(members)
        return configs

    def feasible(self, changes: Iterable[Change] = (), damaged: Iterable[str] = ()) -> bool:
        """Whether every configuration the cluster may pass through (with `changes` made
        too, and the nodes `damaged` beyond repair too) keeps a working majority."""
        beyond_repair = set(damaged)
        for members in self.configurations(changes):
            broken = {n for n in members if n in beyond_repair or self.cluster.disks[n].doomed}
            if len(members) < 2 or 2 * len(broken) >= len(members):
                return False
        return True

    def all_members_up(self, removing: Iterable[str] = ()) -> bool:
        """The README's rule for changing membership, as an operator checks it with
        `quorumq status` on every member: every current member (but the ones these
        changes remove) is up, connected to the leader, caught up with its commit index,
        and has its configuration. A member whose removal another change still waits to
        make is a member: adding D while such a member was down gave it a configuration
        without D, and with the leader's disk then damaged for good, the three left
        could never elect (seed 573, once Raft's timing moved).

        A member that misses the change adding a node does not know that node, and
        PySyncObj's transport refuses connections from nodes it does not know: that
        member cannot hear from the new node, nor the new node from it. If the new node
        leads, the member never catches up; if the cluster needs both for a majority
        (another member down for good), it never elects a leader again (simulator,
        seeds 101, 180 and 227 before this rule)."""
        cluster = self.cluster
        if cluster.groups == 1:
            return self._group_up(cluster.leader(), 0, removing) is not None
        # With groups, in every group (as `quorumq status` shows each group's leader and
        # members), and no change made in some groups only: a node added while D was
        # in some groups and not yet in the operator's members was started without D,
        # and never heard D, leader of a group it was being added to (seed 87 of
        # `--groups 8`).
        configurations = [
            self._group_up(cluster.leader_of(group), group, removing)
            for group in range(cluster.groups)
        ]
        first = configurations[0]
        return first is not None and all(c == first for c in configurations)

    def _group_up(
        self, leader: SimNode | None, group: int, removing: Iterable[str]
    ) -> dict[str, str] | None:
        """Group `group`'s configuration if every member (but `removing`) is up,
        connected to its `leader`, caught up with its commit index and has it."""
        if leader is None:
            return None
        cluster = self.cluster
        leading = leader.replicas[group].member
        commit = leading.raftCommitIndex
        configuration: dict[str, str] = leading.members()
        for name in sorted(cluster.membership - set(removing)):
            node = cluster.nodes[name]
            if node is None or node.paused:
                return None
            if node is leader:
                continue
            member = node.replicas[group].member
            if not cluster.network.is_up(member.address, leading.address):
                return None
            if member.raftCommitIndex < commit or member.members() != configuration:
                return None
        return configuration

    def busy(self, *nodes: str) -> bool:
        """Whether a change of one of `nodes` is in flight (or waits to be sent)."""
        return any(n in self.in_flight for n in nodes)

    def changing(self, name: str) -> bool:
        """Whether `name` is being removed, or added (started, the request sent)."""
        change = self.in_flight.get(name)
        return change is not None and (change.kind == "remove" or bool(change.address))

    # ---------------------------------------------------------------- changes

    def remove(
        self, name: str, *, then_add_after_s: float | None = None, restore: bool = False
    ) -> bool:
        """Remove `name` from the cluster (False: not possible now)."""
        return self.submit([Change("remove", name)], then_s=then_add_after_s, restore=restore)

    def submit(
        self,
        changes: list[Change],
        *,
        together: bool = False,
        then_s: float | None = None,
        restore: bool = False,
    ) -> bool:
        """Make `changes` (with `together`, sent to the leader in one write: it takes
        one and refuses the others while that one is uncommitted; the node core tries
        them again), and undo each `then_s` after it is confirmed. False if they
        cannot be made now: a change of one of those nodes in flight, an add of a
        member or a removal of a non-member, or no working majority after them, or the
        fault phase is over (unless it `restore`s a first member). An add waits until
        every member is up (`all_members_up`)."""
        cluster = self.cluster
        nodes = [c.node for c in changes]
        if self.ending and not restore:
            return False
        if self.busy(*nodes) or len(set(nodes)) < len(nodes):
            return False
        if cluster.groups > 1 and (self.in_flight or len(changes) > 1):
            # With groups, one change at a time, finished in every group before the
            # next, as docs/operating asks: a node started while another change was
            # under way lacked a member in its --peer list, which then led a group
            # it was being added to and was never heard (seed 87 of `--groups 8`;
            # the nodes refuse a change while another is half made, `_half_made`,
            # but the node to add was started before).
            return False
        for c in changes:
            if (c.kind == "add") == (c.node in cluster.membership):
                return False
        if not self.feasible(changes):
            return False
        for c in changes:
            self.in_flight[c.node] = c
        self._go(changes, together, then_s, restore)
        return True

    def _go(
        self, changes: list[Change], together: bool, then_s: float | None, restore: bool
    ) -> None:
        cluster = self.cluster
        adding = [c.node for c in changes if c.kind == "add"]
        leader = cluster.leader()
        if self.ending and not restore:
            for c in changes:
                del self.in_flight[c.node]
            return
        removing = [c.node for c in changes if c.kind == "remove"]
        waits = bool(removing) or self.adds_wait_for_every_member
        if waits and not self.all_members_up(removing):
            delay = micros(self.random.uniform(*RETRY_S))
            self.world.after(delay, self._go, changes, together, then_s, restore)
            return
        for name in adding:
            self._prepare_add(name)
        if together and leader is not None:
            self._send(changes, leader.name, then_s=then_s)
        else:
            for change in changes:
                self._again(change, then_s)

    def _prepare_add(self, name: str) -> None:
        cluster = self.cluster
        if cluster.nodes[name] is not None:
            cluster.stop(name)  # removed, still running: its operator stops it now
        if cluster.incarnations[name]:  # it ran before: it comes back empty, elsewhere
            cluster.wipe(name, new_address=not self.same_address_when_added_back)
        cluster.start(name)

    def _via(self, target: str) -> str | None:
        """A running member to send a change about `target` to (not `target` itself)."""
        names = [n.name for n in self.cluster.serving() if n.name != target]
        return names[self.random.randrange(len(names))] if names else None

    def _send(self, changes: list[Change], via: str, *, then_s: float | None) -> None:
        address = self.cluster.address
        changes = [
            attrs.evolve(c, address=address[c.node]) if c.kind == "add" else c for c in changes
        ]
        for change in changes:
            self.in_flight[change.node] = change
        client = SimClient(
            self.cluster,
            preferred=via,
            request_timeout_s=ADMIN_REQUEST_TIMEOUT_S,
            admin_token=ADMIN_TOKEN,
            rng=self.random,
        )
        left = [len(changes)]

        def answer(change: Change) -> Callable[[dict[str, Any] | None, Any], None]:
            def answered(frame: dict[str, Any] | None, error: QuorumqError | None) -> None:
                left[0] -= 1
                if left[0] == 0:
                    client.close()
                self._answered(change, frame, error, then_s)

            return answered

        for change in changes:
            self.counts["sent"] += 1
            self.world.trace(f"operator {change.kind} {change.node} via {via}")
        client.admin([c.frame() for c in changes], [answer(c) for c in changes])

    def _answered(
        self,
        change: Change,
        frame: dict[str, Any] | None,
        error: QuorumqError | None,
        then_s: float | None,
    ) -> None:
        code = getattr(error, "code", None)
        done = frame is not None or (change.kind == "remove" and code == "unknown_member")
        outcome = "done" if frame is not None else code or type(error).__name__
        self.world.trace(f"operator {change.kind} {change.node}: {outcome}")
        if not done:
            self.counts["failed"] += 1
            delay = micros(self.random.uniform(*RETRY_S))
            self.world.after(delay, self._again, change, then_s)
            return
        self.counts["confirmed"] += 1
        del self.in_flight[change.node]
        cluster = self.cluster
        cluster.membership = change.applied_to(cluster.membership)
        if change.kind == "remove":
            stop_after = micros(self.random.uniform(*STOP_AFTER_S))
            self.world.after(stop_after, self._stop_removed, change.node)
            if then_s is not None:
                self.world.after(stop_after + micros(then_s), self._add_back, change.node)
        elif then_s is not None:
            self.world.after(micros(then_s), self._remove_again, change.node)

    def _again(self, change: Change, then_s: float | None) -> None:
        """Send `change` to a running member (none: a moment later). A node being added
        whose disk is now damaged (its start refused) is rebuilt first, empty at a new
        address, as an operator would: the leader adds a node only once it has caught up
        (the learner stage), and one that cannot start never does (seed 1316: B's
        journal damaged mid-add, asked for again every 20 s to the end of the run)."""
        cluster = self.cluster
        name = change.node
        if (
            change.kind == "add"
            and cluster.nodes[name] is None
            and cluster.disks[name].damaged is not None
        ):
            cluster.wipe(name, new_address=True)
            cluster.start(name)
        via = self._via(change.node)
        if via is None:
            self.world.after(micros(self.random.uniform(*RETRY_S)), self._again, change, then_s)
        else:
            self._send([change], via, then_s=then_s)

    def _stop_removed(self, name: str) -> None:
        """The operator stops the removed node (unless it is being added back: an add
        waiting for every member to be up has not started it yet)."""
        if name not in self.cluster.membership and not self.changing(name):
            self.cluster.stop(name)

    def _add_back(self, name: str) -> None:
        """The removed node comes back (wiped). After the fault phase only the first
        members do: the operator restores the cluster it started with."""
        first = name in self.cluster.names
        if name in self.cluster.membership or self.busy(name) or (self.ending and not first):
            return
        if not self.submit([Change("add", name)], restore=first):
            self.world.after(micros(self.random.uniform(*RETRY_S)), self._add_back, name)

    def heal(self) -> None:
        """The fault phase is over: no new change starts, those in flight finish, the
        first members that were removed are added back (once every member is up), and a
        member whose disk is beyond repair is rebuilt: removed, and added back empty at
        a new address (the README's way back for such a node)."""
        self.ending = True
        cluster = self.cluster
        for name in cluster.names:
            if name in cluster.membership and cluster.disks[name].doomed:
                self._rebuild(name)
            else:
                self._add_back(name)

    def _rebuild(self, name: str) -> None:
        """Remove the member whose disk is beyond repair, and add it back empty (with
        groups, once the change in flight is made: tried again until it can start)."""
        if name not in self.cluster.membership or self.busy(name):
            return
        if self.remove(name, then_add_after_s=0.5, restore=True):
            self.counts["rebuilt"] += 1
        elif self.cluster.groups > 1:
            self.world.after(micros(self.random.uniform(*RETRY_S)), self._rebuild, name)

    def _remove_again(self, name: str) -> None:
        """The added node leaves again, once that keeps a working majority."""
        if self.ending or name not in self.cluster.membership or self.busy(name):
            return
        if not self.remove(name):
            self.world.after(micros(self.random.uniform(*RETRY_S)), self._remove_again, name)
