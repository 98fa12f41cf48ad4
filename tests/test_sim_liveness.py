"""The simulator's liveness checks (`simulations.liveness`): the heal bound, the checks
after the heal, and what counts as a healthy node for a false down."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from simulations.checker import Checker
from simulations.cluster import Cluster
from simulations.liveness import ELECTIONS, HealBound, Liveness
from simulations.world import US, World, micros, patched_pysyncobj

# ------------------------------------------------------------------ the bound


def test_the_heal_bound_is_reconnect_elections_and_catch_up_rounds() -> None:
    bound = HealBound(
        reconnect_s=0.5,
        election_s=0.6,
        heartbeat_s=0.0625,
        conflict_terms=2,
        transfer_rounds=1,
        client_s=2.5,
    )
    assert ELECTIONS == 3
    assert bound.rounds == 4 + 2 + 1
    assert bound.total_s == pytest.approx(0.5 + 3 * 0.6 + 7 * 0.0625)
    assert bound.confirm_s == pytest.approx(bound.total_s + 2.5)
    assert "3 x 0.60 s elections" in bound.describe()


# ------------------------------------------------- the checks after the heal


class _NoCluster:
    """A cluster with nothing running: no leader ever comes back."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.hosts: list[str] = []
        self.nodes: dict[str, Any] = {}
        self.raft_timeouts = (0.25, 0.6)
        self.network = type("Net", (), {"retry_us": (50_000, 500_000)})()

    def running(self) -> list[Any]:
        return []

    def leader(self) -> None:
        return None


def _healed(confirm_at_s: float | None) -> tuple[Checker, Liveness]:
    world = World(1)
    world.run_until(10 * US)
    checker = Checker(world)
    liveness = Liveness(_NoCluster(world), checker, grace_s=5.0)  # type: ignore[arg-type]
    bound = liveness.heal(confirm_expected=True, client_s=2.5)
    if confirm_at_s is not None:
        world.at(micros(10 + confirm_at_s), checker.confirm_times_s.append, 10 + confirm_at_s)
    world.run_until(world.now_us + micros(bound.confirm_s + 1))
    return checker, liveness


def test_no_leader_and_no_confirm_after_the_heal_fail_the_run() -> None:
    checker, liveness = _healed(confirm_at_s=None)
    assert [v.kind for v in checker.violations] == ["heal_catch_up", "heal_confirm"]
    report = liveness.report()
    assert report.caught_up_after_s is None and report.confirmed_after_s is None
    assert "caught up never, first confirm never" in "\n".join(report.lines())


def test_a_confirm_within_the_bound_satisfies_the_confirm_check() -> None:
    checker, liveness = _healed(confirm_at_s=3.0)
    assert [v.kind for v in checker.violations] == ["heal_catch_up"]
    assert liveness.report().confirmed_after_s == pytest.approx(3.0)


# ------------------------------------------------------------ healthy nodes


@pytest.fixture
def three() -> Iterator[tuple[Cluster, Liveness]]:
    """A running cluster of three (A, B, C) with a leader."""
    world = World(5)
    cluster = Cluster(world, 3)
    liveness = Liveness(cluster, Checker(world), grace_s=5.0)
    with patched_pysyncobj(world, cluster.create_journal, cluster.create_serializer):
        for name in cluster.names:
            cluster.start(name)
        world.run_until(3 * US)
        assert cluster.leader() is not None
        yield cluster, liveness


def _healthy(liveness: Liveness) -> set[str]:
    return {n for n in liveness.cluster.hosts if liveness.healthy(n)}


def test_a_node_is_healthy_while_it_runs_connected_to_a_majority(
    three: tuple[Cluster, Liveness],
) -> None:
    cluster, liveness = three
    world, network = cluster.world, cluster.network
    assert _healthy(liveness) == {"A", "B", "C"}
    network.partition([["A"], ["B", "C"]])
    assert _healthy(liveness) == {"B", "C"}  # at once: not when the connections drop
    network.partition([cluster.hosts])
    world.run_until(world.now_us + US)
    network.reset("A", "B")  # a connection breaks for a moment: still reachable
    assert _healthy(liveness) == {"A", "B", "C"}
    network.extra_delay_us[("A", "B")] = network.connection_timeout_us  # useless link
    assert "A" in _healthy(liveness)  # (still C)
    network.extra_delay_us[("A", "C")] = network.connection_timeout_us
    assert _healthy(liveness) == {"B", "C"}
    network.extra_delay_us.clear()
    cluster.pause("B")
    assert _healthy(liveness) == {"A", "C"}
    cluster.crash("C")
    assert _healthy(liveness) == set()  # A and a paused B: no majority
