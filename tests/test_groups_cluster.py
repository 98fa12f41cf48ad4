"""Three node processes hosting three Raft groups each (`--groups 3`): queues spread over
the groups, clients unchanged, through a node kill; and a node started again with
another group count is refused."""

from __future__ import annotations

import pytest

from quorumq.ops.local_cluster import Cluster

from .helpers import wait_for
from .test_metrics import scrape, value

pytestmark = pytest.mark.slow

QUEUES = [f"q{i}" for i in range(6)]


def _groups_elected(cluster: Cluster, node: str) -> bool:
    groups = cluster.status(node).get("groups", [])
    return len(groups) == 3 and all(g["leader"] is not None for g in groups)


def test_queues_spread_over_groups_keep_every_confirmed_message_through_a_node_kill() -> None:
    with Cluster(3, groups=3, node_down_grace=30.0) as cluster:
        for node in cluster.nodes:
            wait_for(lambda n=node: _groups_elected(cluster, n), f"{node}'s groups elected", 30)
        declaring = cluster.client("A")
        for queue in QUEUES:
            declaring.declare(queue)
        placed = cluster.status("B")["groups"]
        assert [g["placed"] for g in placed] == [2, 2, 2]
        producer = cluster.client("B")  # placed through A: B finds them in group 0
        confirmed = {
            q: [producer.publish(q, b"%s-%d" % (q.encode(), i)) for i in range(20)] for q in QUEUES
        }
        assert all(offsets == list(range(20)) for offsets in confirmed.values())
        cluster.kill("A")
        for queue in QUEUES:
            confirmed[queue] += [producer.publish(queue, b"after") for _ in range(5)]
        assert all(offsets == list(range(25)) for offsets in confirmed.values())
        consumer = cluster.client("C")
        for queue in QUEUES:
            got = consumer.subscribe(queue, prefetch=100)
            offsets = []
            for _ in range(25):
                delivery = got.get(timeout=15)
                assert delivery is not None and delivery.node == "C", queue
                offsets.append(delivery.offset)
                delivery.ack()
            assert offsets == list(range(25)), queue  # FIFO, none lost, none twice
        cluster.restart("A")
        reader = cluster.client("A")
        for queue in QUEUES:  # from its own replicas, once they applied the range
            # (with wait: a node just started applies what it had committed, then
            # what its leaders tell it; read without, a queue could be unknown for a
            # moment, as with one group)
            assert len(reader.read(queue, 0, 25, wait=30)) == 25, queue
        assert sorted(reader.status()["queues"]) == QUEUES

        def all_acked() -> bool:  # (the acks come after the messages in each log)
            queues = reader.status()["queues"]
            return {q: s["unacked"] + s["ready"] for q, s in queues.items()} == dict.fromkeys(
                QUEUES, 0
            )

        wait_for(all_acked, "A applying every ack, in every group", 30)


def test_a_node_started_again_with_another_group_count_is_refused() -> None:
    with Cluster(3, groups=3) as cluster:
        cluster.kill("C")
        for other in (2, 1):  # 1 too: a node of one group is no exception (found by review)
            cluster.groups = other
            with pytest.raises(RuntimeError, match="group count never changes"):
                cluster.restart("C")
        cluster.groups = 3
        cluster.restart("C")


def _leaders(cluster: Cluster, node: str) -> list[str | None]:
    return [g["leader"] for g in cluster.status(node)["groups"]]


def test_leaders_spread_one_group_per_node_and_a_paused_node_stalls_only_its_own() -> None:
    """Each group's leader hands over to its preferred node (the g-th by name) once
    both are steady; then pausing a node (SIGSTOP: its connections stay open) leaves
    the groups it does not lead with their leaders and terms, taking publishes."""
    with Cluster(3, groups=3, node_down_grace=30.0, metrics=True) as cluster:
        wait_for(
            lambda: _leaders(cluster, "A") == ["A", "B", "C"],
            "each node leading its preferred group",
            60,
        )
        client = cluster.client("A")
        for queue in QUEUES:
            client.declare(queue)  # two per group
        samples = scrape(cluster.metrics_url("B"))  # every group's queues and figures
        assert {q: value(samples, "quorumq_queue_ready_messages", queue=q) for q in QUEUES} == (
            dict.fromkeys(QUEUES, 0)
        )
        for group, leader in enumerate("ABC"):
            role = value(samples, "quorumq_raft_group_role", group=str(group), role="leader")
            assert role == (1 if leader == "B" else 0), group
        before = cluster.status("A")["groups"]
        cluster.pause("B")
        try:
            for queue in ("q0", "q3", "q2", "q5"):  # groups 0 and 2 (led by A and C)
                assert client.publish(queue, b"while B is paused") == 0
            during = cluster.status("A")["groups"]
        finally:
            cluster.resume("B")
        for group in (0, 2):
            assert during[group]["leader"] == before[group]["leader"]
            assert during[group]["term"] == before[group]["term"], group


def _members_everywhere(cluster: Cluster) -> set[tuple[tuple[str, str], ...]]:
    """Every group's members, as every node sees them (one item once all agree)."""
    return {
        tuple(sorted(group["members"].items()))
        for node in cluster.nodes
        for group in cluster.status(node)["groups"]
    }


def test_a_member_added_and_removed_joins_and_leaves_every_group() -> None:
    """`members add` and `members remove` on nodes of three groups: the change is made
    in each group in turn and answered once all have it; the added node serves every
    queue from its own replicas, and the cluster goes on without the removed one."""
    with Cluster(3, groups=3) as cluster:
        for node in cluster.nodes:
            wait_for(lambda n=node: _groups_elected(cluster, n), f"{node}'s groups elected", 30)
        client = cluster.client("B")
        for queue in QUEUES:
            client.declare(queue)
            assert [client.publish(queue, b"%d" % i) for i in range(10)] == list(range(10))
        new = cluster.add_node()  # (answered once every group has it)
        expected = {n: f"127.0.0.1:{cluster.raft_ports[n]}" for n in cluster.nodes}
        for group in cluster.status("B")["groups"]:  # at once, where the request went
            assert group["members"] == expected
        wait_for(
            lambda: _members_everywhere(cluster) == {tuple(sorted(expected.items()))},
            "every node's every group with four members",
            30,
        )
        reader = cluster.client(new)
        for queue in QUEUES:  # from its own replica of each queue's group
            assert len(reader.read(queue, 0, 10, wait=30)) == 10, queue
        cluster.remove_node("A")  # (hands over any group A leads first)
        del expected["A"]
        wait_for(
            lambda: _members_everywhere(cluster) == {tuple(sorted(expected.items()))},
            "every group without A",
            30,
        )
        for queue in QUEUES:
            assert client.publish(queue, b"after") == 10
        consumer = cluster.client(new)
        for queue in QUEUES:
            got = consumer.subscribe(queue, prefetch=100)
            offsets = []
            for _ in range(11):
                delivery = got.get(timeout=15)
                assert delivery is not None and delivery.node == new, queue
                offsets.append(delivery.offset)
                delivery.ack()
            assert offsets == list(range(11)), queue
