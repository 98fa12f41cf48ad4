"""The simulator's disk space faults (`disk_alarm`, `disk_full`) on the real node core:
a disk alarm refuses publishes cluster-wide while deliveries go on, and clears when the
space returns; a full disk stops the node, which waits for space instead of failing in
a loop, and nothing confirmed is lost."""

from __future__ import annotations

import pytest

from quorumq.node.core import NodeCore
from simulations import cluster as cluster_module
from simulations.faults import SPACE_KINDS, Fault, disk_space_schedule
from simulations.runner import RunConfig, run
from simulations.workload import WorkloadConfig
from simulations.world import World

ALARM_AT_S = 3.0
ALARM_S = 4.0


def _scripted(kind: str, free: float, *, seed: int = 3) -> RunConfig:
    """Only this fault, on B, 3 s into a 12 s fault phase (the workload at 100/s)."""
    fault = Fault(at_s=ALARM_AT_S, kind=kind, nodes=("B",), duration_s=ALARM_S, amount=free)
    return RunConfig(
        seed=seed, faults="none", steps=1200, workload=WorkloadConfig(rate=100), scripted=(fault,)
    )


def test_a_disk_alarm_refuses_publishes_while_deliveries_go_on_and_clears() -> None:
    """B's disk drops to 20 MiB free (below the 64 MiB limit) for 4 s: within a second
    B raises its alarm and the log refuses every publish (an expected refusal, never a
    loss); a second or two after the space returns, publishes are confirmed again.
    (That deliveries and acks go on meanwhile: `test_machine`, and
    `test_disk_alarm` on a real node.)"""
    result = run(_scripted("disk_alarm", 20 << 20))
    assert result.ok, result.summary()
    assert result.faults["disk_alarm"] == 1  # (and the clock faults every run has)
    assert result.counts["refused"] > 0 and result.counts["lost"] == 0
    gap, _ = result.longest_confirm_gap
    # the alarm is raised at B's next measure (<= 1 s) and committed; cleared likewise
    assert ALARM_S - 1.5 <= gap <= ALARM_S + 2.5, result.longest_confirm_gap


def test_without_the_alarm_a_short_disk_refuses_nothing() -> None:
    """The same run with the alarm off (`min_free_disk_bytes` 0): nothing is refused and
    confirms never pause for the fault's length: the refusals above are the alarm's."""
    config = _scripted("disk_alarm", 20 << 20)
    original = NodeCore.disk_free

    def no_limit(self: NodeCore, free_bytes: int | None) -> None:
        original(self, None)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(NodeCore, "disk_free", no_limit)
        result = run(config)
    assert result.ok, result.summary()
    assert result.counts["refused"] == 0
    assert result.longest_confirm_gap[0] < ALARM_S - 1.5


def test_a_full_disk_stops_the_node_which_waits_for_space_then_catches_up() -> None:
    """No space left on B for 4 s: its next journal write fails with ENOSPC and the node
    stops (once); it waits for space before starting again, rejoins, and nothing
    confirmed is lost. Started again at once on the full disk (as a supervisor would
    without the wait), it failed at its first write, again and again."""
    result = run(_scripted("disk_full", 0))
    assert result.ok, result.summary()
    assert result.counts["fatal_stop"] == 1
    assert result.counts["lost"] == 0


def test_the_control_a_node_started_on_a_full_disk_fails_in_a_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The negative control of the test above: without the wait for space (a start
    needs no free space), the supervisor starts the node again a second after each
    stop, on the full disk, and it stops at its first write each time."""
    monkeypatch.setattr(cluster_module, "START_FREE_BYTES", 0)
    result = run(_scripted("disk_full", 0))
    assert result.counts["fatal_stop"] >= 3


def test_every_run_draws_disk_space_faults_from_a_stream_of_their_own() -> None:
    """Both kinds are drawn; an alarm leaves 4-64 MiB (enough to write, below the
    default limit), a full disk none; the draws are the seed's alone."""
    world = World(5)
    drawn = [
        f
        for seed in range(40)
        for f in disk_space_schedule(World(seed).stream("disk-space-faults"), "ABC", duration_s=30)
    ]
    assert {f.kind for f in drawn} == set(SPACE_KINDS)
    for f in drawn:
        if f.kind == "disk_alarm":
            assert 4 << 20 <= f.amount < 64 << 20
        else:
            assert f.amount == 0
        assert 0.5 <= f.duration_s <= 5
    a = disk_space_schedule(world.stream("disk-space-faults"), "ABC", duration_s=30)
    b = disk_space_schedule(World(5).stream("disk-space-faults"), "ABC", duration_s=30)
    assert a == b
