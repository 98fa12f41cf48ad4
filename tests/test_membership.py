"""Online membership: replicas added and removed one at a time on a live cluster of
real node processes, and the configuration surviving restarts."""

from __future__ import annotations

import pytest

from quorumq.client import ServerError
from quorumq.ops.local_cluster import Cluster

from .helpers import wait_for
from .test_cluster import Recorder, converged, kill_all_and_restart

pytestmark = pytest.mark.slow


def members_everywhere(cluster: Cluster) -> set[tuple[tuple[str, str], ...]]:
    return {tuple(sorted(cluster.status(n)["members"].items())) for n in cluster.nodes}


def test_an_added_replica_catches_up_and_delivers_to_its_own_consumers() -> None:
    with Cluster(3) as cluster:
        client = cluster.client()
        client.declare("q")
        before = [client.publish("q", b"before-%d" % i) for i in range(200)]
        new = cluster.add_node()
        assert new == "D"
        expected = {n: f"127.0.0.1:{cluster.raft_ports[n]}" for n in cluster.nodes}
        wait_for(lambda: members_everywhere(cluster) == {tuple(sorted(expected.items()))}, "4")
        wait_for(lambda: converged(cluster), "the new replica applying the same log", 30)
        recorder = Recorder(cluster.client(new).subscribe("q", prefetch=50))
        after = [client.publish("q", b"after-%d" % i) for i in range(100)]
        wait_for(
            lambda: {d.offset for d in recorder.deliveries} == set(before + after),
            "every message delivered by the new replica",
            30,
        )
        recorder.stop()
        assert {d.node for d in recorder.deliveries} == {new}
        first = [d.offset for d in recorder.deliveries]
        assert first == sorted(first)


def test_a_replica_added_while_a_member_is_down_joins_once_caught_up() -> None:
    """The learner stage on real processes: with C killed, D is added; the leader sends
    D the log before it makes D a voter, so the two live members keep committing; C,
    back, learns of D from the log and all four converge."""
    with Cluster(3) as cluster:
        client = cluster.client()
        client.declare("q")
        down = next(n for n in cluster.nodes if n != cluster.leader())
        cluster.kill(down)
        before = [client.publish("q", b"before-%d" % i) for i in range(300)]
        new = cluster.add_node()
        after = [client.publish("q", b"after-%d" % i) for i in range(100)]
        assert before + after == list(range(400))
        cluster.restart(down)
        expected = {n: f"127.0.0.1:{cluster.raft_ports[n]}" for n in cluster.nodes}
        wait_for(lambda: members_everywhere(cluster) == {tuple(sorted(expected.items()))}, "4")
        wait_for(lambda: converged(cluster), "four replicas applying the same log", 30)
        joined = sum(cluster.status(n)["learners_joined"] for n in cluster.nodes if n != new)
        assert joined == 1, f"{new} was added without the learner stage"


def test_removing_the_leader_hands_leadership_over_and_loses_nothing() -> None:
    with Cluster(3) as cluster:
        client = cluster.client()
        client.declare("q")
        cluster.add_node()  # four replicas: three remain, a majority of them is two
        leader = cluster.leader()
        stays = [n for n in cluster.nodes if n != leader]
        recorders = {n: Recorder(cluster.client(n).subscribe("q", prefetch=20)) for n in stays}
        confirmed = [client.publish("q", b"m%d" % i) for i in range(150)]
        cluster.remove_node(leader)
        assert cluster.leader() in stays
        confirmed += [client.publish("q", b"m%d" % i) for i in range(150, 300)]
        assert confirmed == list(range(300))
        everything = lambda: {d.offset for r in recorders.values() for d in r.deliveries}  # noqa: E731
        wait_for(lambda: everything() == set(confirmed), "every message delivered", 30)
        for r in recorders.values():
            r.stop()
        expected = {n: f"127.0.0.1:{cluster.raft_ports[n]}" for n in stays}
        wait_for(lambda: members_everywhere(cluster) == {tuple(sorted(expected.items()))}, "3")
        wait_for(lambda: converged(cluster), "the remaining replicas converging", 30)


def test_membership_survives_killing_every_node_with_and_without_a_snapshot() -> None:
    with Cluster(3, compaction_entries=50) as cluster:
        client = cluster.client()
        client.declare("q")
        cluster.add_node()
        cluster.remove_node("B")
        expected = {n: f"127.0.0.1:{cluster.raft_ports[n]}" for n in cluster.nodes}
        assert sorted(expected) == ["A", "C", "D"]
        kill_all_and_restart(cluster)  # the change is in the journal only
        assert members_everywhere(cluster) == {tuple(sorted(expected.items()))}
        for i in range(200):  # past the compaction threshold: the change is in snapshots
            client.publish("q", b"%d" % i)
        wait_for(
            lambda: all((cluster.root / n / "snapshot").exists() for n in cluster.nodes),
            "a snapshot on every node",
        )
        kill_all_and_restart(cluster)
        assert members_everywhere(cluster) == {tuple(sorted(expected.items()))}
        assert len(cluster.client().read("q", 0, 1000)) == 200


def test_membership_requests_that_cannot_work_fail_clearly() -> None:
    with Cluster(3) as cluster:
        client = cluster.client("A")
        with pytest.raises(ServerError, match="target_is_self"):
            client.remove_member("A")
        with pytest.raises(ServerError, match="unknown_member"):
            client.remove_member("Z")
        with pytest.raises(ServerError, match="member_exists"):
            client.add_member("B", "127.0.0.1:1")
        with pytest.raises(ServerError, match="member_exists"):
            client.add_member("Z", f"127.0.0.1:{cluster.raft_ports['B']}")
        assert len(client.status()["members"]) == 3
