"""The checks of a run's other Raft groups (`quorumq node --groups G`): the checker,
the history and the liveness watch the workload's queue, in its group (the model
group, `SimNode.model_group`); every other group's replicas are checked here for what
every log must keep whatever it holds:

* `log`: two replicas never apply different entries at one index, and no node holds
  another entry committed where one was committed (`CommittedEntries`);
* `digest`: the replicas' states agree every `digest_every` entries;
* `rollback`: a replica never loads a snapshot behind what it applied;
* at the end, once healed (`converged`): every group's running replicas applied the
  same index, and each group has a leader the others follow (`stuck_group` if not),
  with the model group's members (`membership`: a change made in some groups only);
* the other groups carry traffic (`SideProducer`: batches to an idle queue in each),
  every record confirmed to one is in its queue at the end, once, on every replica
  (`lost`, `duplicated`), and each takes a record again after the heal
  (`heal_confirm`: every group comes back, not only the workload's).

Group 0 holds the directory (`Place`), so a replica that placed a queue elsewhere than
another would show here as a `log` or `digest` violation of group 0."""

from __future__ import annotations

import contextlib
import random
import zlib
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from quorumq.client.core import QuorumqError

from .clients import SimClient
from .replica_checks import CommittedEntries
from .world import micros

if TYPE_CHECKING:
    from .cluster import Cluster
    from .node import SimNode

SIDE_BATCH_EVERY_S = 0.25
"""Mean time between two batches of the side producer (one to 3 records each)."""


class GroupChecks:
    def __init__(
        self,
        groups: int,
        model_group: int,
        violation: Callable[[str, str], None],
        *,
        digest_every: int = 100,
    ) -> None:
        self.groups = [g for g in range(groups) if g != model_group]
        self._violation = violation
        self.digest_every = digest_every
        self.applied_crc: dict[int, dict[int, int]] = {g: {} for g in self.groups}
        self.committed = {g: CommittedEntries(violation, f" of group {g}") for g in self.groups}
        self.digests: dict[int, dict[int, str]] = {g: {} for g in self.groups}
        self.applies = dict.fromkeys(self.groups, 0)
        """Entries applied in each group, all replicas together (a run's other groups
        carry traffic: a count of 0 would make these checks vacuous)."""
        self.leader_changes = dict.fromkeys(self.groups, 0)
        self._log_seen: dict[tuple[int, str, int], tuple[int, int]] = {}

    def on_applied(self, node: SimNode, group: int, index: int, payload: bytes) -> None:
        self.applies[group] += 1
        crc = zlib.crc32(payload)
        known = self.applied_crc[group].setdefault(index, crc)
        if known != crc:
            self._violation(
                "log", f"{node.name} applied another command at index {index} of group {group}"
            )
        if index % self.digest_every == 0:
            digest = node.replicas[group].machine.digest()
            first = self.digests[group].setdefault(index, digest)
            if first != digest:
                self._violation(
                    "digest", f"{node.name}'s state at index {index} of group {group} differs"
                )

    def on_snapshot_loaded(self, node: SimNode, group: int, applied: int, index: int) -> None:
        if index < applied:
            self._violation(
                "rollback",
                f"{node.name} loaded a snapshot of group {group} at index {index} after "
                f"applying up to {applied}",
            )

    def on_leadership(self, node: SimNode, group: int, leader: bool) -> None:
        if leader:
            self.leader_changes[group] += 1

    def on_ticked(self, node: SimNode) -> None:
        for group in self.groups:
            member = node.replicas[group].member
            log = member.journal
            commit = member.raftCommitIndex
            key = (group, node.name, node.incarnation)
            seen = (commit, len(log))
            if self._log_seen.get(key) == seen:
                continue
            self._log_seen[key] = seen
            self.committed[group].check((node.name, node.incarnation), node.name, log, commit)

    def finish(self, nodes: list[SimNode], side: SideProducer | None = None) -> None:
        """At the end of a run, healed and drained: every group's running replicas hold
        the same state (`converge`) under one leader (`stuck_group`), and every record
        confirmed to an idle queue once (`lost`, `duplicated`)."""
        if side is not None:
            self._check_side(nodes, side)
        model = [n for n in nodes if n.member.is_leader()]
        model_members = model[0].member.members() if len(model) == 1 else None
        for group in self.groups:
            indexes = {n.name: n.replicas[group].machine.last_index for n in nodes}
            digests = {n.replicas[group].machine.digest() for n in nodes}
            if len(set(indexes.values())) > 1 or len(digests) > 1:
                self._violation(
                    "converge", f"replicas of group {group} end apart: applied indexes {indexes}"
                )
            leaders = [n for n in nodes if n.replicas[group].member.is_leader()]
            if len(leaders) != 1:
                names = [n.name for n in leaders]
                self._violation(
                    "stuck_group", f"group {group} ends with leaders {names} (one expected)"
                )
            if leaders and model_members is not None:
                members = leaders[0].replicas[group].member.members()
                if members != model_members:
                    self._violation(
                        "membership",
                        f"group {group} ends with members {sorted(members)}, the workload's "
                        f"group with {sorted(model_members)}: a change made in some groups only",
                    )

    def _check_side(self, nodes: list[SimNode], side: SideProducer) -> None:
        for queue in side.queues:
            if queue not in side.after_heal_s:
                self._violation("heal_confirm", f"no record confirmed to {queue} since the heal")
        for node in nodes:
            directory = node.replicas[0].machine
            for queue, confirmed in side.confirmed.items():
                group = directory.placement(queue)
                machine = node.replicas[group or 0].machine
                if queue not in machine.queues():
                    self._violation("lost", f"{node.name} has no queue {queue} (group {group})")
                    continue
                held = Counter(r[2] for r in machine.read_records(queue, 0, 2**62))
                lost = sorted(confirmed - set(held))
                twice = sorted(body for body, n in held.items() if n > 1)
                if lost:
                    self._violation(
                        "lost",
                        f"{node.name}'s {queue} (group {group}) lacks {len(lost)} confirmed "
                        f"records, {lost[0]!r} first",
                    )
                if twice:
                    self._violation("duplicated", f"{node.name}'s {queue} holds {twice[0]!r} twice")

    def converged(self, nodes: list[SimNode]) -> bool:
        """Whether every group's running replicas applied the same index, all that is
        committed, and follow one leader."""
        for group in self.groups:
            members = [n.replicas[group].member for n in nodes]
            applied = {n.replicas[group].machine.last_index for n in nodes}
            commits = {m.raftCommitIndex for m in members}
            leaders = sum(m.is_leader() for m in members)
            if len(applied) != 1 or max(commits) > min(applied) or leaders != 1:
                return False
        return True


class SideProducer:
    """An application publishing to the idle queues (one in each group but the model
    group), through a real client: their groups' logs carry publishes, retries and
    deduplication as the workload's does. It remembers what was confirmed, for
    `GroupChecks.finish`; a refusal or an outcome unknown is no violation here (the
    workload's producers check those)."""

    def __init__(self, cluster: Cluster, queues: list[str], rng: random.Random) -> None:
        self.world = cluster.world
        self.queues = queues
        self.random = rng
        self.client = SimClient(cluster, rng=rng)
        self.confirmed: dict[str, set[bytes]] = {q: set() for q in queues}
        self.published = 0
        self.producing = bool(queues)
        self.healed_us: int | None = None
        self.after_heal_s: dict[str, float] = {}
        """Per idle queue: how long after the heal its first record was confirmed."""

    def start(self) -> None:
        if self.producing:
            self._schedule()

    def heal(self) -> None:
        """The faults ended: go on only until each idle queue has had a record
        confirmed since (every group must take publishes again: `GroupChecks`)."""
        self.healed_us = self.world.now_us

    def _schedule(self) -> None:
        self.world.after(micros(self.random.uniform(0.5, 1.5) * SIDE_BATCH_EVERY_S), self._emit)

    def _emit(self) -> None:
        queues = self.queues
        if self.healed_us is not None:
            queues = [q for q in queues if q not in self.after_heal_s]
            self.producing = bool(queues)
        if not self.producing:
            return
        self._schedule()
        queue = queues[self.random.randrange(len(queues))]
        first, count = self.published, self.random.randint(1, 3)
        bodies = [f"side:{queue}:{n}".encode() for n in range(first, first + count)]
        self.published += count
        with contextlib.suppress(QuorumqError):  # refused before sending: never made
            self.client.publish_batch(
                queue,
                [[body, None, None] for body in bodies],
                lambda frame, _error: self._answered(queue, bodies, frame),
            )

    def _answered(self, queue: str, bodies: list[bytes], frame: dict[str, Any] | None) -> None:
        if frame is not None:
            self.confirmed[queue].update(bodies)
            if self.healed_us is not None and queue not in self.after_heal_s:
                self.after_heal_s[queue] = (self.world.now_us - self.healed_us) / 1e6
