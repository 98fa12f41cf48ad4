"""The simulator's liveness checks (`simulations.liveness`): the heal bound, the checks
after the heal, and what counts as a healthy node for a false down."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import attrs
import pytest

from quorumq.machine import NodeDown
from quorumq.raft.rules import RaftRules
from simulations.__main__ import main
from simulations.checker import Checker
from simulations.cluster import Cluster
from simulations.faults import LIVENESS_KINDS, PROFILES, Fault, kinds_of
from simulations.liveness import ELECTIONS, HealBound, Liveness
from simulations.member import SimMember
from simulations.network import Network
from simulations.runner import RunConfig, run
from simulations.workload import WorkloadConfig
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


# ------------------------------------------------------------ the new faults


def test_the_liveness_fault_kinds_are_in_the_default_profile_and_can_be_named() -> None:
    default = PROFILES["default"]
    assert set(LIVENESS_KINDS) <= set(default)
    share = sum(default.count(k) for k in LIVENESS_KINDS) / len(default)
    assert 0.2 < share < 0.3  # weighted: a quarter of the default profile's faults
    assert kinds_of("slow_host,pause_mid_tick,one_way_delay,lone_candidate") == LIVENESS_KINDS
    assert set(kinds_of("liveness")) == {"kill_leader", "partition", *LIVENESS_KINDS}
    with pytest.raises(SystemExit):
        main(["run", "--seed", "1", "--faults", "slow_host,meteor"])


def test_faults_describe_themselves_with_units() -> None:
    def text(**kw: Any) -> str:
        return Fault(at_s=12.3, **kw).describe()

    assert (
        text(kind="one_way_delay", nodes=("A", "B"), duration_s=3, amount=1.2)
        == "  12.30 s one_way_delay A->B +1.2 s for 3.00 s"
    )
    assert text(kind="slow_host", nodes=("C",), duration_s=0.85).endswith("C stalls 0.85 s")
    assert text(kind="slow_host", duration_s=0.85).endswith("(the leader) stalls 0.85 s")
    assert text(kind="clock_skew", nodes=("A",), amount=-3 * 3_600_000).endswith("A off by -3.0 h")
    assert text(kind="lone_candidate", nodes=("B",), duration_s=2).endswith("B for 2.00 s")
    assert text(kind="drop", duration_s=1, amount=0.1).endswith("p=0.1 for 1.00 s")


def test_an_isolated_node_stays_cut_off_across_partitions_and_delays_keep_the_longest() -> None:
    network = Network(World(1), ["A", "B", "C"])
    network.partition([["A"], ["B", "C"]])
    network.isolate("C")
    assert network.cut == {("A", "B"), ("A", "C"), ("B", "C")}
    network.partition([["A", "B", "C"]])  # the partition ends: C is still alone
    assert network.cut == {("A", "C"), ("B", "C")}
    network.rejoin("C")
    assert network.cut == set()
    network.delay("A", "B", 100_000)
    network.delay("A", "B", 1_000_000)
    assert network.extra_delay_us == {("A", "B"): 1_000_000}
    network.undelay("A", "B", 1_000_000)
    assert network.extra_delay_us == {("A", "B"): 100_000}
    network.undelay("A", "B", 100_000)
    assert network.extra_delay_us == {}


def test_a_stalled_raft_thread_keeps_its_connections_and_reads_its_backlog_late(
    three: tuple[Cluster, Liveness],
) -> None:
    cluster, _ = three
    world, network = cluster.world, cluster.network
    leader = cluster.leader()
    assert leader is not None
    pairs = {(leader.name, n) for n in cluster.names if n != leader.name}
    term = leader.member.raftCurrentTerm
    leader.stall(world.now_us + US)
    world.run_until(world.now_us + US - 1000)
    assert any(network.inbox[leader.name])  # answers and votes wait, unread
    assert all(network.is_up(a, b) for a, b in pairs)  # no pause: connections stay
    assert leader.member.raftCurrentTerm == term  # it has not read the new term yet
    world.run_until(world.now_us + 2000)
    assert not any(network.inbox[leader.name])
    assert leader.member.raftCurrentTerm > term  # read: another leads now
    assert not leader.member.is_leader()


class _Duties:
    """Records the failure commands leaders propose, and when."""

    def __init__(self, cluster: Cluster) -> None:
        self.world = cluster.world
        self.proposed: list[tuple[int, str, str, bool]] = []

    def on_failure_command(self, node: Any, command: Any) -> None:
        leading = node.member.is_leader()
        self.proposed.append((self.world.now_us, node.name, str(command), leading))

    def __getattr__(self, name: str) -> Any:
        return lambda *args: None


@pytest.mark.parametrize("stall_aware", [True, False])
@pytest.mark.parametrize("mid_tick", [True, False])
def test_a_leader_paused_mid_tick_does_its_duties_before_it_reads(
    three: tuple[Cluster, Liveness],
    mid_tick: bool,
    stall_aware: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Resumed from the seam, a leader paused past the grace period still believes it
    leads, and does its duties before its poll reads the new term: it took its own
    silence for its peers' and proposed their downs (issue 27). It counts no silence
    across its own stall now (`RaftRules.stall_aware_silence`; switched off, the
    downs come back: the negative control). Paused between ticks, it reads first."""
    from quorumq.raft.rules import RaftRules

    monkeypatch.setattr(RaftRules, "stall_aware_silence", stall_aware)
    cluster, _ = three
    world = cluster.world
    duties = _Duties(cluster)
    cluster.observers.append(duties)  # type: ignore[arg-type]
    leader = cluster.leader()
    assert leader is not None
    if mid_tick:
        leader.pause_at_seam_us = 7 * US
        world.run_until(world.now_us + US, lambda: leader.paused)  # at its next tick
        assert leader.paused and leader.member.duties_deferred
        resumed = world.now_us + 7 * US
    else:
        cluster.pause(leader.name)
        resumed = world.now_us + 7 * US
        world.after(7 * US, cluster.resume, leader.name)
    world.run_until(resumed + US)
    mine = [(t, c, leading) for t, n, c, leading in duties.proposed if n == leader.name]
    if mid_tick and not stall_aware:
        others = sorted(n for n in cluster.names if n != leader.name)
        assert [c for t, c, _ in mine if t <= resumed + 1000] == [
            f"NodeDown(node='{n}')" for n in others
        ]
        assert all(leading for _, _, leading in mine)  # as leader, on a stale belief
    else:
        assert mine == []
    assert not leader.member.is_leader()


# ------------------------------------------------------- negative controls
# Each breaks the real code a node runs, in a way only a liveness check can see, and
# must fail a run the real code passes. The seeds are named: a change that shifts the
# runs can move them (find others by running the patched code over a few seeds).


CONTROL_SEEDS = (2, 8)


def _short(seed: int, **changes: Any) -> RunConfig:
    """10 s of default-profile faults at 30 records/s."""
    config = RunConfig(
        seed=seed, steps=1000, fault_interval_s=0.8, workload=WorkloadConfig(rate=30)
    )
    return attrs.evolve(config, **changes)


def _kinds(config: RunConfig) -> set[str]:
    return {v.kind for v in run(config).violations}


def test_the_real_code_comes_back_within_the_heal_bound() -> None:
    """Seed 8 commits two downs of members a leader proposed 1.7 s before: each member
    was cut off or held up meanwhile (legitimate)."""
    for seed in CONTROL_SEEDS:
        result = run(_short(seed))
        assert result.ok, result.summary()
        report = result.liveness
        assert report.bound is not None and report.caught_up_after_s is not None
        assert report.caught_up_after_s <= report.bound.total_s
        assert report.leaderships_after_bound == 0 and not report.false_downs


@pytest.mark.parametrize("kind", ["slow_host", "partition", "pause"])
def test_a_node_held_up_or_cut_off_past_the_grace_period_is_rightly_marked_down(
    kind: str,
) -> None:
    """B stalled, alone on its side of a partition, or paused for 6.5 s
    (past the 5 s grace period): it is marked down, and that is no false down."""
    fault = Fault(at_s=3.0, kind=kind, nodes=("B",), duration_s=6.5)
    config = RunConfig(
        seed=3, faults="none", steps=1200, workload=WorkloadConfig(rate=20), scripted=(fault,)
    )
    result = run(config)
    assert result.ok, result.summary()
    assert result.liveness.downs >= 1 and not result.liveness.false_downs
    assert result.faults[kind] == 1


def test_a_leader_that_marks_every_peer_down_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A replica whose leader proposes `NodeDown` for every peer it does not hold down
    (besides the real commands: the downed ones come back up, and go down again)."""
    import quorumq.replica

    real = quorumq.replica.failure_commands

    def every_peer(leader: str, silence_s: Any, down: Any, *args: Any) -> list[Any]:
        commands = real(leader, silence_s, down, *args)
        return commands + [
            NodeDown(node=n) for n in sorted(silence_s) if n != leader and n not in down
        ]

    monkeypatch.setattr(quorumq.replica, "failure_commands", every_peer)
    assert "false_down" in _kinds(_short(CONTROL_SEEDS[0]))


def test_a_member_that_never_catches_up_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Node C takes the AppendEntries' heartbeat and drops their entries: it answers,
    so nobody marks it down, but it never applies anything new."""
    real = RaftRules._SyncObj__onMessageReceived  # type: ignore[attr-defined]

    def starved(self: RaftRules, node: Any, message: Any) -> None:
        if (
            self.name == "C"  # type: ignore[attr-defined]
            and isinstance(message, dict)
            and message.get("type") == "append_entries"
            and message.get("entries")
        ):
            message = {**message, "entries": []}
        real(self, node, message)

    monkeypatch.setattr(RaftRules, "_SyncObj__onMessageReceived", starved)
    assert "heal_catch_up" in _kinds(_short(CONTROL_SEEDS[0]))


def test_leaders_that_keep_handing_over_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A leader hands leadership over (Raft's TimeoutNow) a second after it took it,
    for ever: the cluster commits, catches up and confirms, but never settles."""
    real = SimMember._tick_callback

    def restless(self: SimMember) -> None:
        real(self)
        now = self.network.world.monotonic()
        if not self.is_leader():
            return
        term, since = self.__dict__.setdefault("_led", (self.raftCurrentTerm, now))
        if term != self.raftCurrentTerm:
            self.__dict__["_led"] = (self.raftCurrentTerm, now)
        elif now - since > 1.0:
            self.transferLeadership(None, None)

    monkeypatch.setattr(SimMember, "_tick_callback", restless)
    assert "heal_leaders" in _kinds(_short(CONTROL_SEEDS[0]))


# ---------------------------------------------------- liveness bugs fixed
# What the Raft rule fixes of issue 27 fixed (each was a strict xfail before them).


def test_a_leader_paused_mid_tick_past_the_grace_period_marks_nobody_down() -> None:
    """The leader pauses at the seam of a tick for 7 s (past the 5 s grace period); the
    others elect. It resumed believing it led, saw every peer silent for 7 s and
    proposed their downs; PySyncObj forwarded them to the new leader, which committed
    NodeDown of itself (`false_down`). It counts no silence across its own stall now,
    and its duties are never forwarded (`propose(leader_only=True)`)."""
    pause = Fault(at_s=3.0, kind="pause_mid_tick", duration_s=7.0)  # (the leader)
    result = run(
        RunConfig(
            seed=1,
            faults="none",
            steps=1500,
            workload=WorkloadConfig(rate=20),
            scripted=(pause,),
        )
    )
    assert result.ok, result.summary()


def test_a_run_stopped_at_a_violation_counts_records_in_flight_but_flags_no_loss() -> None:
    """A liveness violation stops a run seconds after the heal; the records then in
    flight are not lost (seed 30 reported 235 lost records at its false down)."""
    for stopped in (True, False):
        checker = Checker(World(1))
        checker.published(b"p0:0", None)
        checker.confirmed(b"p0:0", 0)
        counts = checker.finish([], drained=False, stopped=stopped)
        assert counts["lost"] == 1
        kinds = [v.kind for v in checker.violations]
        assert kinds == ([] if stopped else ["lost", "liveness"])
