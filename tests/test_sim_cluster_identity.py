"""The cluster identity (`quorumq.raft.cluster_identity`) in whole simulated clusters:
every node of a cluster learns one identity and keeps it on its disk, and a node
restored from a backup beside nodes started empty never mixes the two histories,
whichever starts first. (The random sweeps check the first half on every run:
`identity` and `foreign` in `simulations.replica_checks`.)"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import pytest

from quorumq.raft.cluster_identity import FOREIGN_STOP, ClusterIdentity, load_identity
from simulations.clients import SimClient
from simulations.cluster import Cluster
from simulations.workload import QUEUE_OPTIONS, declare
from simulations.world import US, World, micros, patched_pysyncobj


class _Stops:
    """Observes the nodes that stopped themselves, and why."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    def on_fatal(self, name: str, reason: str) -> None:
        self.seen.append((name, reason))

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None  # (every other observation)


@contextlib.contextmanager
def _cluster(seed: int) -> Iterator[tuple[World, Cluster, _Stops]]:
    """Three members, a leader elected and every node knowing the identity; a queue
    declared; three leaders crashed in turn (terms, and entries of each)."""
    world = World(seed)
    cluster = Cluster(world, 3)
    stops = _Stops()
    cluster.observers.append(stops)
    with patched_pysyncobj(world, cluster.create_journal, cluster.create_serializer):
        for name in cluster.names:
            cluster.start(name)
        _wait(world, 10, lambda: _all_know(cluster, "ABC"))
        declare(cluster)
        world.run_until(world.now_us + 2 * US)
        _crash_leaders(world, cluster, 3)
        yield world, cluster, stops


def _wait(world: World, seconds: float, condition: Callable[[], bool]) -> None:
    world.run_until(world.now_us + int(seconds * US), condition)
    assert condition(), f"not within {seconds} s"


def _all_know(cluster: Cluster, names: str) -> bool:
    nodes = [cluster.nodes[n] for n in names]
    return all(n is not None and n.member.cluster_identity is not None for n in nodes)


def _identity(cluster: Cluster, name: str) -> str | None:
    node = cluster.nodes[name]
    return None if node is None else node.member.cluster_identity


def _crash_leaders(world: World, cluster: Cluster, times: int) -> None:
    for _ in range(times):
        leader = cluster.leader()
        assert leader is not None
        cluster.crash(leader.name, power_loss=False)
        world.run_until(world.now_us + 2 * US)
        cluster.start(leader.name)
        world.run_until(world.now_us + US)


def _restore_a_beside_empty_b_and_c(cluster: Cluster) -> None:
    """Every node stopped; B's and C's data directories moved away (same addresses);
    A keeps its own: a backup restored on one node only."""
    for name in cluster.names:
        cluster.crash(name, power_loss=False)
    for name in "BC":
        cluster.wipe(name, new_address=False)


def _digests(cluster: Cluster) -> dict[str, str]:
    return {n: node.machine.digest() for n, node in cluster.nodes.items() if node is not None}


def test_every_node_learns_one_identity_and_keeps_it_on_its_disk() -> None:
    with _cluster(1) as (_world, cluster, stops):
        identities = {_identity(cluster, n) for n in "ABC"}
        assert len(identities) == 1
        (identity,) = identities
        for name in "ABC":
            assert load_identity(cluster.disks[name].files, "/") == identity
        # a node restarted reads it before it hears anyone
        cluster.crash("C", power_loss=True)
        restarted = cluster.start("C")
        assert restarted is not None and restarted.member.cluster_identity == identity
        assert stops.seen == []


_EMPTIES_FIRST = [
    pytest.param(1, 1, True, id="diverged in silence before"),
    pytest.param(2, 3, False, id="refused every entry before"),
]
"""(seed, leaders crashed, a second declare): two runs of B and C started empty that
went on to their own history before A started from its old data. Before the identity
the first ended with A's state differing from theirs while it ran on as a follower,
the second with A's journal refusing B's entries at every message (the negative
control below shows both)."""


def _empties_then_restored(
    world: World, cluster: Cluster, crashes: int, declare_again: bool
) -> dict[str, int]:
    """B and C start empty, elect, choose their identity and go on; then A starts from
    its old data. Returns B's and C's terms just before A started."""
    _restore_a_beside_empty_b_and_c(cluster)
    for name in "BC":
        cluster.start(name)
    _wait(world, 10, lambda: _all_know(cluster, "BC"))
    if declare_again:
        declare(cluster)
        world.run_until(world.now_us + 2 * US)
    _crash_leaders(world, cluster, crashes)
    terms = {n: cluster.nodes[n].member.raftCurrentTerm for n in "BC"}  # type: ignore[union-attr]
    cluster.start("A")
    world.run_until(world.now_us + 8 * US)
    return terms


@pytest.mark.parametrize(("seed", "crashes", "declare_again"), _EMPTIES_FIRST)
def test_a_node_restored_beside_empty_nodes_that_chose_an_identity_stops(
    seed: int, crashes: int, declare_again: bool
) -> None:
    """A drops B's and C's messages, they drop A's, and A stops with one line saying
    what to do (its supervisor starts it again, and it stops again). B's and C's terms
    are untouched by it, and they agree."""
    with _cluster(seed) as (world, cluster, stops):
        old = _identity(cluster, "A")
        terms = _empties_then_restored(world, cluster, crashes, declare_again)
        new = _identity(cluster, "B")
        assert new is not None and new != old
        assert stops.seen, "A stopped"
        assert {n for n, _ in stops.seen} == {"A"}
        for _, reason in stops.seen:
            assert reason.startswith(f"{FOREIGN_STOP} cluster {old}")
            assert f"hold another (cluster {new};" in reason
            assert "move its data directory away and start it again empty" in reason
        assert {n: cluster.nodes[n].member.raftCurrentTerm for n in "BC"} == terms  # type: ignore[union-attr]
        digests = _digests(cluster)
        assert digests["B"] == digests["C"]
        leader = cluster.leader()
        assert leader is not None and leader.name in "BC"


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("order", ["empties first", "restored first", "together"])
def test_a_restored_node_and_empty_nodes_never_mix_their_histories(order: str, seed: int) -> None:
    """Whichever starts first: every node still running at the end knows one identity
    and holds the same state, and a node that stopped did so as of another cluster.
    Either history may win the race: if A is elected before B and C commit an identity
    of their own, they vote for its longer log and its data becomes theirs (Raft's
    rule); if one of them is, A stops."""
    with _cluster(seed) as (world, cluster, stops):
        _restore_a_beside_empty_b_and_c(cluster)
        if order == "empties first":
            for name in "BC":
                cluster.start(name)
            world.run_until(world.now_us + 10 * US, lambda: _all_know(cluster, "BC"))
            cluster.start("A")
        elif order == "restored first":
            cluster.start("A")
            world.run_until(world.now_us + US)
            for name in "BC":
                cluster.start(name)
        else:
            for name in "ABC":
                cluster.start(name)
        world.run_until(world.now_us + 8 * US)
        running = [n for n in "ABC" if cluster.nodes[n] is not None]
        stopped = {n for n, _ in stops.seen}
        assert all(reason.startswith(FOREIGN_STOP) for _, reason in stops.seen)
        assert stopped <= {"A"}
        assert len({_identity(cluster, n) for n in running if n not in stopped}) == 1
        assert len({d for n, d in _digests(cluster).items() if n not in stopped}) == 1


@pytest.mark.parametrize(("seed", "crashes", "declare_again"), _EMPTIES_FIRST)
def test_without_the_check_the_restored_node_mixes_the_histories(
    monkeypatch: pytest.MonkeyPatch, seed: int, crashes: int, declare_again: bool
) -> None:
    """The negative control: with foreign messages read as before, the same runs show
    the two failures seen with real processes before the identity."""
    monkeypatch.setattr(ClusterIdentity, "_foreign", lambda *args: False)
    with _cluster(seed) as (world, cluster, stops):
        _empties_then_restored(world, cluster, crashes, declare_again)
        digests = _digests(cluster)
        assert digests["B"] == digests["C"]
        if declare_again:  # A follows B, with A's old entries under B's new ones
            assert stops.seen == []
            assert cluster.nodes["A"] is not None
            assert digests["A"] != digests["B"]
        else:  # A's journal refuses to cut what it had committed, at every message
            assert stops.seen
            assert all("refusing to delete entries" in reason for _, reason in stops.seen)


# ------------------------------------------------- the hostile review's two cases


def _race(world: World, cluster: Cluster, *, b_back: bool = True) -> None:
    """The empty nodes' leader has put its identity entry and a declare on one of them,
    C, which has applied neither, when B's host dies (seeds 1, 4, 6, 8, 9, ... of
    `_cluster`; in the others C has applied the identity by then); A, restored, starts:
    its log is longer than C's, and its entries 2 and 3 have the same index and term as
    those on C. Then B starts again (`b_back`)."""
    _restore_a_beside_empty_b_and_c(cluster)
    for name in "BC":
        cluster.start(name)
    declare(cluster)

    def c_holds_three() -> bool:
        c = cluster.nodes["C"]
        return c is not None and len(c.member.journal) >= 3 and c.member.cluster_identity is None

    _wait(world, 10, c_holds_three)
    cluster.crash("B", power_loss=False)
    cluster.start("A")
    world.run_until(world.now_us + 8 * US)
    if b_back:
        cluster.start("B")
        world.run_until(world.now_us + 8 * US)


@pytest.mark.parametrize("seed", [1, 4, 6, 8, 9])
def test_a_restored_node_whose_entries_collide_with_a_followers_mixes_nothing(seed: int) -> None:
    """The hostile review's race, where C voted for A and appended A's entries after its
    own (A's entry 2 and 3 took for C's): now C drops A's messages that name or carry
    another entry of the same index and term. One side wins (A's when C had led and B
    held nothing yet, B's and C's when B had led), the other stops as of another
    history, and the nodes that go on agree."""
    with _cluster(seed) as (world, cluster, stops):
        _race(world, cluster)
        stopped = {n for n, _ in stops.seen}
        assert len(stopped) == 1
        assert all(reason.startswith(FOREIGN_STOP) for _, reason in stops.seen)
        going_on = [n for n in "ABC" if n not in stopped]
        assert len({_digests(cluster)[n] for n in going_on}) == 1
        assert len({_identity(cluster, n) for n in going_on}) == 1


def test_without_the_collision_check_the_race_mixes_the_histories(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The negative control: with no entry compared by index and term, C votes for A and
    appends A's entries after B's first two, which it takes for A's."""
    monkeypatch.setattr(ClusterIdentity, "_held", lambda *args: None)
    with _cluster(1) as (world, cluster, _stops):
        _race(world, cluster, b_back=False)
        a, c = (cluster.nodes[n] for n in "AC")
        assert a is not None and c is not None
        a_entries = {(e[1], e[2]): e[0] for e in a.member.journal}
        c_entries = [(e[1], e[2], e[0]) for e in c.member.journal]
        theirs = [i for i, t, command in c_entries if a_entries.get((i, t)) == command]
        own = [i for i, t, command in c_entries if a_entries.get((i, t), command) != command]
        assert 2 in own and theirs and max(theirs) > max(own)  # B's entries, then A's


@contextlib.contextmanager
def _earlier_version(monkeypatch: pytest.MonkeyPatch, old: set[str]) -> Iterator[None]:
    """The nodes named in `old` run as a version without the identity: no file, nothing
    said or checked, no identity drawn, identity entries applied as the no-ops they are."""
    rules = {
        name: ClusterIdentity.__dict__[name]
        for name in (
            "keep_identity_in",
            "announce_identity",
            "_applied_no_op",
            "_SyncObj__onBecomeLeader",
            "_SyncObj__onMessageReceived",
        )
    }

    def keep(self: Any, files: Any, data_dir: str) -> None:
        if self.name not in old:
            rules["keep_identity_in"](self, files, data_dir)

    def announce(self: Any) -> None:
        if self.name not in old:
            rules["announce_identity"](self)

    def applied(self: Any, command: bytes) -> None:
        if self.name not in old:
            rules["_applied_no_op"](self, command)

    def lead(self: Any) -> None:
        if self.name not in old:
            rules["_SyncObj__onBecomeLeader"](self)
        else:
            super(ClusterIdentity, self)._SyncObj__onBecomeLeader()

    def receive(self: Any, node: Any, message: Any) -> None:
        if self.name not in old:
            rules["_SyncObj__onMessageReceived"](self, node, message)
        else:
            if type(message) is dict:
                message = {k: v for k, v in message.items() if not k.startswith("quorumq_c")}
                message.pop("quorumq_identity_entry", None)
            super(ClusterIdentity, self)._SyncObj__onMessageReceived(node, message)

    for name, rule in [
        ("keep_identity_in", keep),
        ("announce_identity", announce),
        ("_applied_no_op", applied),
        ("_SyncObj__onBecomeLeader", lead),
        ("_SyncObj__onMessageReceived", receive),
    ]:
        monkeypatch.setattr(ClusterIdentity, name, rule)
    yield


def test_a_rolling_upgrade_draws_one_identity_and_stops_no_node(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The hostile review's case: A, upgraded first, leads and draws an identity; the
    earlier version's B and C apply it as a no-op, write no file, and compact it away
    while A is down; upgraded, one of them leads. Its log no longer starts at the first
    index, so it draws no second identity (it did: A, of the first, then stopped as of
    another cluster, at every restart)."""
    old = {"A", "B", "C"}
    world = World(1)
    cluster = Cluster(world, 3, compaction_entries=8)
    stops = _Stops()
    cluster.observers.append(stops)

    def churn(times: int) -> None:
        for _ in range(times):
            leader = cluster.leader()
            if leader is None:
                world.run_until(world.now_us + US)
                continue
            cluster.crash(leader.name, power_loss=False)
            world.run_until(world.now_us + int(1.5 * US))
            cluster.start(leader.name)
            world.run_until(world.now_us + US)

    def upgrade(name: str) -> None:
        cluster.crash(name, power_loss=False)
        old.discard(name)
        cluster.start(name)
        world.run_until(world.now_us + 3 * US)

    with (
        _earlier_version(monkeypatch, old),
        patched_pysyncobj(world, cluster.create_journal, cluster.create_serializer),
    ):
        for name in cluster.names:
            cluster.start(name)
        world.run_until(world.now_us + 3 * US)
        declare(cluster)
        world.run_until(world.now_us + 2 * US)
        churn(3)
        upgrade("A")
        for _ in range(10):
            if _identity(cluster, "A") is not None:
                break
            churn(1)
        drawn = _identity(cluster, "A")
        assert drawn is not None
        cluster.crash("A", power_loss=False)
        world.run_until(world.now_us + 3 * US)
        churn(14)
        for name in "BC":
            upgrade(name)
        cluster.start("A")
        world.run_until(world.now_us + 8 * US)
        assert stops.seen == []
        assert {_identity(cluster, n) for n in "ABC"} <= {drawn, None}
        for name in "ABC":
            assert load_identity(cluster.disks[name].files, "/") in (drawn, None)
        # the third review's case: A, behind the compacted log, takes the snapshot of a
        # leader that knows no identity and catches up (refused, it stayed behind for
        # good); then with another node down the two left still commit
        world.run_until(world.now_us + 20 * US)
        applied = {n: cluster.nodes[n].member.raftLastApplied for n in "ABC"}  # type: ignore[union-attr]
        assert len(set(applied.values())) == 1, applied
        down = next(n for n in "BC" if n != cluster.leader().name)  # type: ignore[union-attr]
        cluster.crash(down, power_loss=False)
        _declares(world, cluster, "after", 3)
        assert stops.seen == []


def _declares(world: World, cluster: Cluster, prefix: str, count: int) -> None:
    """`count` queues declared, one after another (an entry each)."""
    client = SimClient(cluster)
    left = [f"{prefix}{i}" for i in range(count)]

    def attempt() -> None:
        client.declare(left[0], attrs.asdict(QUEUE_OPTIONS), answered)

    def answered(frame: dict[str, Any] | None, error: Any) -> None:
        if frame is not None:
            left.pop(0)
        if left:
            world.after(micros(0.1 if frame is None else 0), attempt)
        else:
            client.close()

    world.after(micros(0.05), attempt)
    _wait(world, 30, lambda: not left)


def test_a_restored_node_of_no_identity_with_a_compacted_log_attaches_nowhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The second hostile review's case: A's data is of an earlier version (no identity)
    and compacted; B and C, started empty, know theirs and hold entries of the same
    index and term as A's. When their leader dies, the other votes for A's longer log,
    and kept its own entries up to A's `prevLogIdx` and took A's after them; the
    leader's entry there is compared now: B and C stop hearing A, elect again and go
    on. No log holds entries of both histories."""
    old = {"A", "B", "C"}
    world = World(1)
    cluster = Cluster(world, 3, compaction_entries=8)
    with (
        _earlier_version(monkeypatch, old),
        patched_pysyncobj(world, cluster.create_journal, cluster.create_serializer),
    ):
        for name in "ABC":
            cluster.start(name)
        world.run_until(world.now_us + 3 * US)
        _declares(world, cluster, "old", 30)
        world.run_until(world.now_us + 2 * US)
        a_entries = {(e[1], e[2]): e[0] for e in cluster.nodes["A"].member.journal}  # type: ignore[union-attr]
        last_a = max(i for i, _ in a_entries)
        old.clear()  # every node runs this version from here on
        _restore_a_beside_empty_b_and_c(cluster)
        for name in "BC":
            cluster.start(name)
        _wait(world, 10, lambda: _all_know(cluster, "BC"))
        _declares(world, cluster, "new", last_a - 6)
        world.run_until(world.now_us + 2 * US)
        leader = cluster.leader()
        assert leader is not None and leader.name in "BC"
        y_entries = {
            (e[1], e[2]): e[0]
            for n in "BC"
            for e in cluster.nodes[n].member.journal  # type: ignore[union-attr]
            if e[1] > 1
        }
        cluster.crash(leader.name, power_loss=False)
        cluster.start("A")
        world.run_until(world.now_us + 8 * US)
        cluster.start(leader.name)
        world.run_until(world.now_us + 8 * US)
        for name in "ABC":
            node = cluster.nodes[name]
            assert node is not None
            held = {(e[1], e[2]): e[0] for e in node.member.journal if e[1] > 1}
            of_a = [k for k, v in held.items() if a_entries.get(k) == v]
            of_y = [k for k, v in held.items() if y_entries.get(k) == v]
            assert not (of_a and of_y), (name, of_a, of_y)
        digests = _digests(cluster)
        assert digests["B"] == digests["C"]  # (here theirs goes on; A, knowing none, apart)
        leader = cluster.leader()
        assert leader is not None and leader.name in "BC"
