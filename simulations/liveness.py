"""Liveness: a run must come back after the heal within a bound, and no node that was
up and connected may be marked down. Checked as the run goes; a failure is a
violation, like a lost record.

After the heal (every fault ended, `heal`), within `HealBound.total_s`:

* `heal_catch_up`: at some moment there is a leader and every running member of its
  configuration has applied (Raft's `lastApplied`) everything committed at the heal
  and everything the leader had committed `LAG_S` before (a follower learns a commit
  index one heartbeat later);
* `heal_confirm`: a publish is confirmed (each producer sends one more batch at the
  heal, so one is in flight), within the bound plus a client's request timeout and
  reconnect (`HealBound.confirm_s`): a client whose node died waits that long before
  it sends again;
* `heal_leaders`: no node becomes leader after the bound, until the run ends. The run
  goes on for at least `WATCH_ELECTIONS` election timeouts past the bound (seed 110
  traded leadership every 2.4 s after its heal, for good). With groups, the model
  group's preferred node may take over once after it (steering hands leadership to it
  once both are steady); any other leadership is flagged.

The bound (`heal_bound`):

    total_s = reconnect_s + ELECTIONS * election_s + heartbeat_s * rounds
    rounds  = CATCH_UP_ROUNDS + conflict_terms + transfer_rounds

* `reconnect_s`: the network's longest redial delay (0.5 s): every connection is up by
  then, and every crashed or paused node runs again;
* `ELECTIONS` (3) elections of at most the longest election timeout (0.6 s): a split
  vote, or one vote request from a node that rejoins with a higher term;
* catch-up, in heartbeats (a leader sends one at its first tick past
  appendEntriesPeriod: 100 ms with its 62.5 ms and 50 ms ticks): `CATCH_UP_ROUNDS`
  (4) to find where a follower's log matches, send what it lacks, tell it the commit
  index and apply; one round per term in the longest uncommitted tail a running node
  holds at the heal (`conflict_terms`: a leader that skips a conflicting term per
  reply repairs that tail in that many rounds; one that steps back one entry per
  heartbeat, as PySyncObj 0.3.17 does, needs one round per entry); one round per
  batch of the entries the furthest-behind member lacks (`appendEntriesBatchSizeBytes`,
  4 MB) and per chunk of the snapshot it must install if the leader compacted past
  it (`logCompactionBatchSize`, 64 KB).

False downs (`false_down`). A `NodeDown(X)` is committed (first applied anywhere).
Its proposal is the one the leader of the entry's term made (or, if the entry came
from elsewhere, say a deposed leader's proposal forwarded to the next one, the latest
proposal of `NodeDown(X)`), at `proposed`. It is false if X was a member of the
proposer's configuration and X was healthy throughout from `grace_s + MARGIN_S` before
`proposed` to the commit. Healthy means: X's process ran (no crash, no restart), it
was neither paused nor stalled (its Raft thread late: `slow_host`, a pause that began
mid-tick), and it was connected to a majority of its configuration (itself and peers
that ran, neither paused nor stalled, with a connection both want that no partition
or isolation cuts and no link delays by a connection timeout or more). Health is
sampled every `SAMPLE_S` and at every start and crash: a node seen unhealthy at any
sample in the window makes the down legitimate (a partition of a few seconds, a stall
the leader took for silence). The leader's own health does not matter: a stalled
leader that takes its own silence for its peers' is what this finds.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from typing import TYPE_CHECKING, Any

import attrs

from quorumq.machine import NodeDown

from .world import micros, seconds

if TYPE_CHECKING:
    from quorumq.machine import Applied, Command

    from .checker import Checker
    from .cluster import Cluster
    from .node import SimNode

ELECTIONS = 3
CATCH_UP_ROUNDS = 4
WATCH_ELECTIONS = 10
LAG_S = 0.2
"""How far behind the leader's commit index a caught-up follower may be: the index it
had committed this long ago (a heartbeat, a tick, and the latency, with room)."""
SAMPLE_S = 0.05
MARGIN_S = 0.25
"""Before the grace period: the leader counts silence from its peer's last answer,
which came up to a heartbeat, a tick and a latency before the peer stopped."""


@attrs.frozen(kw_only=True)
class HealBound:
    """How long after the heal the cluster may take to come back (module docstring)."""

    reconnect_s: float
    election_s: float
    heartbeat_s: float
    conflict_terms: int = 0
    transfer_rounds: int = 0
    client_s: float = 0.0
    """A client's request timeout and longest reconnect delay (for `confirm_s`)."""

    @property
    def rounds(self) -> int:
        return CATCH_UP_ROUNDS + self.conflict_terms + self.transfer_rounds

    @property
    def total_s(self) -> float:
        return self.reconnect_s + ELECTIONS * self.election_s + self.heartbeat_s * self.rounds

    @property
    def confirm_s(self) -> float:
        return self.total_s + self.client_s

    @property
    def watch_s(self) -> float:
        """How long past the bound the leadership is watched, at least."""
        return WATCH_ELECTIONS * self.election_s

    def describe(self) -> str:
        return (
            f"{self.total_s:.2f} s = {self.reconnect_s:.2f} s reconnect + {ELECTIONS} x "
            f"{self.election_s:.2f} s elections + {self.rounds} x {self.heartbeat_s * 1000:.1f}"
            f" ms catch-up rounds ({self.conflict_terms} uncommitted terms, "
            f"{self.transfer_rounds} batches to send); a confirm within {self.confirm_s:.2f} s"
        )


@attrs.frozen(kw_only=True)
class FalseDown:
    node: str
    index: int
    proposer: str
    proposed_s: float
    committed_s: float
    healthy_since_s: float


@attrs.frozen(kw_only=True)
class LivenessReport:
    """What the summary says of liveness."""

    bound: HealBound | None
    heal_s: float | None
    """When the faults ended (simulated seconds)."""
    caught_up_after_s: float | None
    confirmed_after_s: float | None
    confirm_expected: bool
    leaderships_after_heal: int
    leaderships_after_bound: int
    last_leadership_after_s: float | None
    false_downs: tuple[FalseDown, ...]
    downs: int
    """NodeDown commands committed (false or not)."""

    def lines(self) -> list[str]:
        if self.bound is None:
            return []

        def after(value: float | None) -> str:
            return "never" if value is None else f"{value:.2f} s"

        confirmed = after(self.confirmed_after_s) if self.confirm_expected else "none sent"
        last = after(self.last_leadership_after_s) if self.leaderships_after_heal else "-"
        return [
            f"heal bound {self.bound.describe()}",
            f"after heal: caught up {after(self.caught_up_after_s)}, first confirm "
            f"{confirmed}, {self.leaderships_after_heal} leaderships (last {last}, "
            f"{self.leaderships_after_bound} after the bound)",
            f"node downs committed {self.downs}, false {len(self.false_downs)}"
            + "".join(
                f"; {d.node} at {d.committed_s:.2f} s (proposed by {d.proposer} at "
                f"{d.proposed_s:.2f} s, healthy since {d.healthy_since_s:.2f} s)"
                for d in self.false_downs[:3]
            ),
        ]


class Liveness:
    """Watches a run for the liveness checks (an observer of the cluster); reports
    violations through the checker."""

    def __init__(self, cluster: Cluster, checker: Checker, *, grace_s: float) -> None:
        self.cluster = cluster
        self.world = cluster.world
        self.checker = checker
        self.grace_s = grace_s
        self.last_unhealthy_us: dict[str, int] = dict.fromkeys(cluster.hosts, 0)
        """Per host: the last time it was seen unhealthy (not running, paused, stalled,
        or cut off from a majority)."""
        self._proposals: dict[tuple[str, int], tuple[int, str, bool]] = {}
        """(node downed, term) -> (when, by whom, whether the node was a member)."""
        self._latest: dict[str, tuple[int, str, bool]] = {}
        self._applied_max = 0
        self.downs = 0
        self.false_downs: list[FalseDown] = []
        self.leaderships_us: list[int] = []
        self.heal_us: int | None = None
        self.bound: HealBound | None = None
        self.committed_at_heal = 0
        self.caught_up_us: int | None = None
        self.confirm_expected = False
        self._commits: deque[tuple[int, int]] = deque()
        self._leaders_flagged = False
        self._steered = False

    # --------------------------------------------------------------- health

    def start(self) -> None:
        """Sample every host's health from now on."""
        self._sample()

    def _sample(self) -> None:
        now = self.world.now_us
        for name in self.cluster.hosts:
            if not self.healthy(name):
                self.last_unhealthy_us[name] = now
        self.world.after(micros(SAMPLE_S), self._sample)

    def healthy(self, name: str) -> bool:
        """Running, neither paused nor stalled, connected to a majority of its
        configuration (see the module's docstring)."""
        node = self.cluster.nodes[name]
        if node is None or not _running(node):
            return False
        members = node.member.members()
        network, me = self.cluster.network, node.member.address
        reached = 1
        for peer_name, address in members.items():
            if address == me:
                continue
            peer = self.cluster.nodes.get(peer_name)
            if (
                peer is not None
                and peer.member.address == address
                and _running(peer)
                and network.reachable(me, address)
            ):
                reached += 1
        return reached > len(members) / 2

    def on_node(self, name: str, running: bool) -> None:
        self.last_unhealthy_us[name] = self.world.now_us

    # ---------------------------------------------------------- false downs

    def on_failure_command(self, node: SimNode, command: Any) -> None:
        if not isinstance(command, NodeDown):
            return
        member = command.node in node.member.members()
        proposal = (self.world.now_us, node.name, member)
        # the latest: a leader has one NodeDown of a node in flight at a time
        self._proposals[(command.node, node.member.raftCurrentTerm)] = proposal
        self._latest[command.node] = proposal

    def on_applied(
        self, node: SimNode, index: int, crc: int, command: Command, applied: Applied
    ) -> None:
        if index <= self._applied_max:
            return  # applied before, by another replica
        self._applied_max = index
        if type(command) is NodeDown:
            self._judge(node, index, command.node)

    def _judge(self, node: SimNode, index: int, downed: str) -> None:
        self.downs += 1
        now = self.world.now_us
        proposal = self._proposals.get((downed, _term_at(node, index)))
        if proposal is None:
            proposal = self._latest.get(downed, (now, "?", True))
        proposed_us, proposer, member = proposal
        if not member:
            return  # removed from the cluster: marked down on purpose
        since = self.last_unhealthy_us.get(downed, 0)
        if since >= proposed_us - micros(self.grace_s + MARGIN_S) or not self.healthy(downed):
            return
        down = FalseDown(
            node=downed,
            index=index,
            proposer=proposer,
            proposed_s=seconds(proposed_us),
            committed_s=seconds(now),
            healthy_since_s=seconds(since),
        )
        self.false_downs.append(down)
        self.checker.violation(
            "false_down",
            f"NodeDown({downed}) committed at index {index}, proposed by {proposer} at "
            f"{down.proposed_s:.3f} s; {downed} was up and connected to a majority since "
            f"{down.healthy_since_s:.3f} s",
        )

    # ----------------------------------------------------------------- heal

    def on_leadership(self, node: SimNode, leader: bool) -> None:
        if not leader:
            return
        now = self.world.now_us
        self.leaderships_us.append(now)
        if (
            self.bound is not None
            and self.heal_us is not None
            and now > self.heal_us + micros(self.bound.total_s)
            and not self._leaders_flagged
            and not self._steered_once(node)
        ):
            self._leaders_flagged = True
            self.checker.violation(
                "heal_leaders",
                f"{node.name} became leader (term {node.member.raftCurrentTerm}) "
                f"{seconds(now - self.heal_us):.2f} s after the heal, past its bound of "
                f"{self.bound.total_s:.2f} s",
            )

    def _steered_once(self, node: SimNode) -> bool:
        """Whether `node`'s leadership past the bound is, with groups, the one handover
        steering makes (`quorumq.replica`): to the model group's preferred leader in its
        configuration, once both are steady, which may come after the bound and is no
        failure; a second is (`heal_leaders`)."""
        if self.cluster.groups == 1 or self._steered:
            return False
        names = sorted(node.member.members())
        self._steered = names[self.cluster.model_group % len(names)] == node.name
        return self._steered

    def heal(self, *, confirm_expected: bool, client_s: float) -> HealBound:
        """The faults ended now: compute the bound, and watch the cluster come back.
        `confirm_expected`: a publish is in flight (a confirm must come); `client_s`: a
        client's request timeout and longest reconnect delay."""
        self.heal_us = now = self.world.now_us
        self.committed_at_heal = self.checker.committed
        self.bound = bound = heal_bound(self.cluster, self.committed_at_heal, client_s)
        self.confirm_expected = confirm_expected
        self._probe()
        self.world.at(now + micros(bound.total_s), self._check_caught_up)
        if confirm_expected:
            self.world.at(now + micros(bound.confirm_s), self._check_confirmed)
        return bound

    def _probe(self) -> None:
        if self.caught_up_us is not None:
            return
        now = self.world.now_us
        leader = self.cluster.leader()
        if leader is not None:
            self._commits.append((now, leader.member.raftCommitIndex))
            while len(self._commits) > 1 and self._commits[1][0] <= now - micros(LAG_S):
                self._commits.popleft()
            target = self.committed_at_heal
            if self._commits[0][0] <= now - micros(LAG_S):
                target = max(target, self._commits[0][1])
            addresses = set(leader.member.members().values())
            members = [n for n in self.cluster.running() if n.member.address in addresses]
            if all(_last_applied(n) >= target for n in members):
                self.caught_up_us = now
                return
        self.world.after(micros(SAMPLE_S), self._probe)

    def _check_caught_up(self) -> None:
        if self.caught_up_us is None:
            self.checker.violation(
                "heal_catch_up",
                f"no moment within {self.bound.total_s if self.bound else 0:.2f} s of the "
                "heal with a leader and every running member applied up to its commit "
                "index: " + self._positions(),
            )

    def _positions(self) -> str:
        leader = self.cluster.leader()
        return ", ".join(
            f"{n.name} applied {_last_applied(n)} commit {n.member.raftCommitIndex}"
            + (" (leader)" if n is leader else "")
            for n in self.cluster.running()
        ) + (" (no leader)" if leader is None else "")

    def confirmed_after_s(self) -> float | None:
        if self.heal_us is None:
            return None
        times = self.checker.confirm_times_s
        heal = seconds(self.heal_us)
        i = bisect.bisect_right(times, heal)
        return times[i] - heal if i < len(times) else None

    def _check_confirmed(self) -> None:
        if self.confirmed_after_s() is None:
            self.checker.violation(
                "heal_confirm",
                f"no publish confirmed within {self.bound.confirm_s if self.bound else 0:.2f}"
                " s of the heal",
            )

    def watch_until_us(self) -> int:
        """The run lasts at least until then (the leadership watch)."""
        if self.heal_us is None or self.bound is None:
            return self.world.now_us
        return self.heal_us + micros(self.bound.total_s + self.bound.watch_s)

    def report(self) -> LivenessReport:
        heal, bound = self.heal_us, self.bound
        after = [t for t in self.leaderships_us if heal is not None and t > heal]
        past = [
            t
            for t in after
            if bound is not None and heal is not None and t > heal + micros(bound.total_s)
        ]
        return LivenessReport(
            bound=bound,
            heal_s=None if heal is None else seconds(heal),
            caught_up_after_s=(
                None
                if self.caught_up_us is None or heal is None
                else seconds(self.caught_up_us - heal)
            ),
            confirmed_after_s=self.confirmed_after_s(),
            confirm_expected=self.confirm_expected,
            leaderships_after_heal=len(after),
            leaderships_after_bound=len(past),
            last_leadership_after_s=seconds(after[-1] - heal)
            if after and heal is not None
            else None,
            false_downs=tuple(self.false_downs),
            downs=self.downs,
        )

    # ------------------------------------------------- the observer's rest

    def on_stamp(self, ts_ms: int) -> None:
        pass

    def on_snapshot_loaded(self, node: SimNode, applied: int, index: int) -> None:
        pass

    def on_refused(self, name: str, reason: str) -> None:
        pass

    def on_fatal(self, name: str, reason: str) -> None:
        pass

    def on_ticked(self, node: SimNode) -> None:
        pass

    def on_change_cluster(self, node: SimNode, request: Any, accepted: bool) -> None:
        pass


def heal_bound(cluster: Cluster, committed: int, client_s: float = 0.0) -> HealBound:
    """The bound for the cluster as it is at the heal, everything up to index
    `committed` committed (the module's docstring)."""
    running = cluster.running()
    if not running:
        return HealBound(
            reconnect_s=seconds(cluster.network.retry_us[1]),
            election_s=cluster.raft_timeouts[1],
            heartbeat_s=0.1,
            client_s=client_s,
        )
    conf = running[0].member._SyncObj__conf
    top = max(running, key=lambda n: n.member.raftCommitIndex)
    conflict_terms = transfer = 0
    for node in running:
        log = node.member.journal
        terms = set()
        for i in range(len(log) - 1, -1, -1):
            if log[i][1] <= committed:
                break
            terms.add(log[i][2])
        conflict_terms = max(conflict_terms, len(terms))
        transfer = max(transfer, _transfer_rounds(top, _last_applied(node), conf))
    tick_s = seconds(running[0].tick_us)
    return HealBound(
        reconnect_s=seconds(cluster.network.retry_us[1]),
        election_s=conf.raftMaxTimeout,
        heartbeat_s=math.ceil(conf.appendEntriesPeriod / tick_s - 1e-9) * tick_s,
        conflict_terms=conflict_terms,
        transfer_rounds=transfer,
        client_s=client_s,
    )


def _transfer_rounds(top: SimNode, applied: int, conf: Any) -> int:
    """Batches `top` sends a member that applied up to `applied`: the entries after it
    (and the snapshot first, if `top` compacted past it)."""
    log = top.member.journal
    if not len(log):
        return 0
    first = log[0][1]
    rounds = 0
    if applied + 1 < first and top.disk.snapshot is not None:
        rounds += math.ceil(len(top.disk.snapshot) / conf.logCompactionBatchSize)
    size = sum(len(log[i][0]) for i in range(max(0, applied + 1 - first), len(log)))
    return rounds + math.ceil(size / conf.appendEntriesBatchSizeBytes)


def _running(node: SimNode) -> bool:
    """Its process runs and its Raft thread is not held up."""
    return node.alive and not node.paused and not node.stalled


def _last_applied(node: SimNode) -> int:
    applied: int = node.member._SyncObj__raftLastApplied
    return applied


def _term_at(node: SimNode, index: int) -> int:
    log = node.member.journal
    if len(log):
        pos = index - log[0][1]
        if 0 <= pos < len(log) and log[pos][1] == index:
            term: int = log[pos][2]
            return term
    return -1
