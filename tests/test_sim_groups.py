"""The simulator with nodes of many Raft groups (`quorumq node --groups G`): every node
runs G real replicas on one simulated connection per peer, the real node core routes
each command to its queue's group, and every group's log is checked
(`simulations.group_checks`) while the workload's queue, in group (seed mod G), gets
every check of a run of one group."""

from __future__ import annotations

import random
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import pytest

from quorumq.machine import Down
from quorumq.node.serving import Serving
from simulations.cluster import Cluster
from simulations.group_checks import GroupChecks, SideProducer
from simulations.network import HostTransports
from simulations.runner import RunConfig, outcome, run
from simulations.storage import SimDisk
from simulations.world import World, patched_pysyncobj
from tests.test_sim import ci_config

GROUP_SEEDS = range(32)


def groups_config(seed: int, **changes: object) -> RunConfig:
    """`ci_config` on nodes of 2, 3, 4 or 8 groups (by seed), the workload's queue in
    group (seed mod G): the same faults, membership changes among them (made in every
    group), log compaction on half the seeds."""
    return ci_config(seed, **{"groups": (2, 3, 4, 8)[seed % 4], **changes})


def test_a_group_keeps_its_files_apart_on_the_node_disk() -> None:
    """Group g's journal and records are in `/group-g` on the node's one disk: a power
    loss takes every group's unsynced writes, a group's journal is its own."""
    disk = SimDisk("A", random.Random(1))
    one = disk.group(1)
    assert disk.group(1) is one and disk.group(0) is disk and one.files is disk.files
    j0, j1 = disk.open_journal(), one.open_journal()
    for journal in (j0, j1):
        journal.setCurrentTerm(1, None)
    j0.add(b"zero", 1, 1)
    j1.add(b"one", 1, 1)
    j1.sync()
    assert one.meta_path == "/group-1/raft.log.meta"
    disk.power_loss()
    assert len(disk.open_journal()) == 0  # group 0's entry was never synced
    assert [e[0] for e in one.open_journal()] == [b"one"]
    with pytest.raises(ValueError, match="one group"):
        SimDisk("B", random.Random(1), wal=True).group(1)


def test_every_group_shares_the_node_connection_and_reads_only_its_messages() -> None:
    """Three nodes of three groups: each group elects a leader over the nodes' one
    connection per pair; a crash drops the connection for every group at once."""
    world = World(5)
    cluster = Cluster(world, 3, groups=3)
    with patched_pysyncobj(world, cluster.create_journal, cluster.create_serializer):
        for name in cluster.names:
            cluster.start(name)

        def leaders() -> list[int]:
            return [
                sum(n.replicas[g].member.is_leader() for n in cluster.running()) for g in range(3)
            ]

        world.run_until(world.now_us + 10_000_000, lambda: leaders() == [1, 1, 1])
        assert leaders() == [1, 1, 1]
        transports = cluster.network.transports["A"]
        assert isinstance(transports, HostTransports) and len(transports.groups) == 3
        assert [t.group for t in transports.groups] == [0, 1, 2]
        b = cluster.nodes["B"]
        assert b is not None
        cluster.crash("B")
        assert not cluster.network.is_up("A", "B")
        for member in cluster.nodes["A"].members:  # type: ignore[union-attr]
            assert all(node.id != "B" for node in member._SyncObj__connectedNodes), (
                "a group still sees B connected"
            )


def test_group_checks_catch_divergence_and_a_rollback() -> None:
    """The checks of the other groups are no formality: a replica applying another
    entry at an index, loading a snapshot behind what it applied, or missing a
    confirmed record (below) is a violation."""
    found: list[tuple[str, str]] = []
    checks = GroupChecks(3, 2, lambda kind, detail: found.append((kind, detail)))

    class Node:
        name = "B"
        incarnation = 1

    checks.on_applied(Node(), 1, 7, b"one")  # type: ignore[arg-type]
    checks.on_applied(Node(), 1, 7, b"one")  # type: ignore[arg-type]
    assert not found
    checks.on_applied(Node(), 1, 7, b"another")  # type: ignore[arg-type]
    checks.on_snapshot_loaded(Node(), 0, 12, 10)  # type: ignore[arg-type]
    assert [k for k, _ in found] == ["log", "rollback"]
    assert "group 1" in found[0][1] and "group 0" in found[1][1]


@pytest.mark.slow
def test_groups_sweep_every_seed_passes_and_every_group_carries_traffic() -> None:
    """The CI sweep's checks (no confirmed record lost or duplicated, order, bounded
    recovery, no false node-down) on nodes of 2 to 8 groups, under the same faults,
    membership changes among them; and every other group's logs agree, converge, and
    keep every record confirmed to its idle queue once."""
    with ProcessPoolExecutor(2) as pool:
        outcomes = list(pool.map(outcome, [groups_config(s) for s in GROUP_SEEDS]))
    failed = [o for o in outcomes if not o.ok]
    assert not failed, "\n\n".join(o.summary for o in failed[:3])
    assert min(o.faults for o in outcomes) >= 20
    for o in outcomes:
        assert o.groups["applied"] and min(o.groups["applied"].values()) > 0, o.seed
        assert min(o.groups["confirmed"].values()) > 0, o.seed


def test_a_down_sent_to_the_wrong_group_fails_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: a node core that proposes a closed connection's consumer
    `Down`s in group 0 (where a queue of one group lived) and does not sweep lost
    consumers leaves what they held with them: the run with groups fails, the same
    core with one group passes."""

    def down_in_group_0(self: Serving, consumer: str, queue: str) -> None:
        self.settling.release_acks(consumer)
        if consumer not in self._downed:
            self._downed.add(consumer)
            self.core.replica.propose(Down(consumer=consumer))

    monkeypatch.setattr(Serving, "down", down_in_group_0)
    monkeypatch.setattr(Serving, "down_lost_consumers", False)
    seed = 1
    broken = run(groups_config(seed, groups=3))
    assert not broken.ok
    assert {v.kind for v in broken.violations} & {"lost", "unsettled", "liveness"}
    one_group = run(ci_config(seed))
    assert one_group.ok, one_group.violations


def test_simulate_run_with_groups_says_what_the_other_groups_carried() -> None:
    """`quorumq simulate run --groups 3`: the summary's `groups:` line, and a replay
    command that runs the same nodes of three groups again."""
    args = ["simulate", "run", "--seed", "4", "--groups", "3", "--steps", "800"]
    result = subprocess.run(
        [sys.executable, "-m", "quorumq.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "verdict: PASS" in result.stdout
    assert "groups: 3, the workload's queue in group 1" in result.stdout
    replay = groups_config(4, groups=3).replay_command()
    assert "--groups 3" in replay


def test_a_record_confirmed_to_an_idle_queue_and_missing_fails_the_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Negative control of the side producer's check: a confirm for a record no log
    took (as a node answering before its group committed would give) is `lost`."""
    answered = SideProducer._answered

    def also_a_phantom(
        self: SideProducer, queue: str, bodies: list[bytes], frame: dict[str, Any] | None
    ) -> None:
        answered(self, queue, bodies, frame)
        if frame is not None:
            self.confirmed[queue].add(b"never-published")

    monkeypatch.setattr(SideProducer, "_answered", also_a_phantom)
    result = run(groups_config(4, groups=3, steps=600))
    lost = [v for v in result.violations if v.kind == "lost"]
    assert lost and "never-published" in lost[0].detail and "idle" in lost[0].detail
