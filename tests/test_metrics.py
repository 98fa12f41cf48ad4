"""`quorumq node --metrics`: Prometheus metrics scraped over HTTP from a real 3-node
cluster while a workload runs."""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from quorumq.ops.local_cluster import Cluster

from .helpers import wait_for

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str) -> Samples:
    """Every sample of one scrape, by name and labels (parsed as Prometheus parses it)."""
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def queue(samples: Samples, name: str, queue: str) -> float:
    return value(samples, f"quorumq_queue_{name}", queue=queue)


class Workload:
    """A producer on A publishing to `orders` all along, and a consumer on B that acks
    most deliveries, returns some once (redelivered) and rejects others (dead-lettered)."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.stop = threading.Event()
        self.settled = 0
        self.threads = [
            threading.Thread(target=self._publish, daemon=True),
            threading.Thread(target=self._consume, daemon=True),
        ]

    def __enter__(self) -> Workload:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=30)

    def _publish(self) -> None:
        producer = self.cluster.client("A")
        while not self.stop.is_set():
            producer.publish("orders", b"order")

    def _consume(self) -> None:
        consumer = self.cluster.client("B").subscribe("orders", prefetch=10)
        while not self.stop.is_set():
            delivery = consumer.get(timeout=0.1)
            if delivery is None:
                continue
            if delivery.offset % 10 == 3 and not delivery.redelivered:
                delivery.nack(requeue=True)
            elif delivery.offset % 10 == 7:
                delivery.nack(requeue=False)
            else:
                delivery.ack()
            self.settled += 1


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    with Cluster(3, metrics=True, compaction_entries=100, node_down_grace=60.0) as cluster:
        cluster.leader()
        yield cluster


def test_metrics_move_while_a_workload_runs_on_a_three_node_cluster(cluster: Cluster) -> None:
    setup = cluster.client("A")
    setup.declare("dead")
    setup.declare("orders", dead_letter_queue="dead")
    setup.declare("ttl", message_ttl_ms=200)
    setup.declare("backlog")
    for _ in range(3):
        setup.publish("ttl", b"expires")
    for _ in range(5):
        setup.publish("backlog", b"waits")
    urls = {node: cluster.metrics_url(node) for node in cluster.nodes}

    with Workload(cluster) as workload:
        wait_for(lambda: workload.settled >= 30, "the workload to settle 30 deliveries", 30)
        first = {node: scrape(url) for node, url in urls.items()}
        settled = workload.settled
        wait_for(lambda: workload.settled >= settled + 30, "30 more settled", 30)
        wait_for(
            lambda: all(
                queue(scrape(url), "messages_expired_total", "ttl") == 3 for url in urls.values()
            ),
            "the TTL queue's messages expiring on every node",
        )
        then = {node: scrape(url) for node, url in urls.items()}

    leader = cluster.leader()
    for node in cluster.nodes:
        s1, s2 = first[node], then[node]
        for counter in ("published", "delivered", "acked"):
            name = f"messages_{counter}_total"
            assert queue(s2, name, "orders") > queue(s1, name, "orders") > 0, (node, counter)
        assert queue(s2, "messages_redelivered_total", "orders") > 0, node
        assert queue(s2, "messages_rejected_total", "orders") > 0, node
        assert queue(s2, "messages_dead_lettered_total", "orders") > 0, node
        assert queue(s2, "messages_published_total", "dead") > 0, node  # dead-lettered into
        assert queue(s2, "messages_dropped_total", "ttl") == 3, node
        assert queue(s2, "consumers", "orders") == 1, node
        assert queue(s2, "ready_messages", "backlog") == 5, node
        assert queue(s2, "unacked_messages", "backlog") == 0, node
        assert queue(s2, "oldest_ready_age_seconds", "backlog") > queue(
            s1, "oldest_ready_age_seconds", "backlog"
        )
        assert queue(s2, "oldest_ready_age_seconds", "orders") >= 0
        assert value(s2, "quorumq_node_info", node=node) == 1
        assert value(s2, "quorumq_raft_commit_index") > value(s1, "quorumq_raft_commit_index")
        assert value(s2, "quorumq_raft_applied_index") > value(s1, "quorumq_raft_applied_index")
        assert value(s2, "quorumq_raft_log_entries") >= 0
        fsyncs = "quorumq_journal_fsync_seconds_count"
        assert value(s2, fsyncs) > value(s1, fsyncs) > 0, node
        role = "leader" if node == leader else "follower"
        assert value(s2, "quorumq_raft_role", role=role) == 1, (node, role)
        contact = value(s2, "quorumq_raft_leader_contact_age_seconds")
        assert contact == 0 if node == leader else 0 <= contact < 5, (node, contact)
    assert len({value(then[n], "quorumq_raft_term") for n in cluster.nodes}) == 1
    assert value(then["A"], "quorumq_client_connections") >= 2  # setup and producer
    assert value(then["B"], "quorumq_client_connections") >= 1  # the consumer
    publishes = "quorumq_proposal_seconds_count"
    assert value(then["A"], publishes, command="publish") > value(
        first["A"], publishes, command="publish"
    )
    assert value(then["B"], publishes, command="ack") > 0  # B proposes its consumer's acks


def test_the_grafana_dashboard_asks_only_for_metrics_a_node_serves(cluster: Cluster) -> None:
    """docs/grafana-dashboard.json: every metric its queries name is in a node's scrape."""
    import json
    import re
    from pathlib import Path

    setup = cluster.client("A")
    setup.declare("q")
    setup.publish("q", b"m")  # a publish: the proposal histogram gets its child
    dashboard = json.loads(
        (Path(__file__).parent.parent / "docs" / "grafana-dashboard.json").read_text()
    )
    queries = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    queries += [v["definition"] for v in dashboard["templating"]["list"]]
    named = {name for query in queries for name in re.findall(r"quorumq_[a-z_]+", query)}
    served = {name for name, _ in scrape(cluster.metrics_url("A"))}
    assert len(named) > 15 and named <= served, sorted(named - served)


def test_a_follower_that_installs_the_leaders_snapshot_counts_it(cluster: Cluster) -> None:
    leader = cluster.leader()
    lagging = next(n for n in cluster.nodes if n != leader)
    installs = "quorumq_raft_snapshot_installs_total"
    assert value(scrape(cluster.metrics_url(lagging)), installs) == 0
    producer = cluster.client(leader)
    producer.declare("q")
    cluster.pause(lagging)
    published, paused = 0, time.monotonic()
    try:  # a short pause fits in socket buffers: it must outlast the Raft connection
        while published < 400 or time.monotonic() - paused < 5:
            producer.publish("q", b"m")
            published += 1
    finally:
        cluster.resume(lagging)
    wait_for(
        lambda: value(scrape(cluster.metrics_url(lagging)), installs) >= 1,
        "the lagging follower's snapshot install counted",
        30,
    )
    assert value(scrape(cluster.metrics_url(leader)), installs) == 0


def test_a_node_whose_metrics_port_is_taken_says_so_in_one_line(tmp_path: object) -> None:
    import socket
    import subprocess
    import sys

    from quorumq.ops.local_cluster import free_ports

    client_port, raft_port = free_ports(2)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        command = [sys.executable, "-m", "quorumq", "node", "--id", "A", "--insecure"]
        command += ["--data-dir", f"{tmp_path}/a", "--listen", f"127.0.0.1:{client_port}"]
        command += ["--raft", f"127.0.0.1:{raft_port}", "--metrics", f"127.0.0.1:{port}"]
        result = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert "Address already in use" in result.stderr


def test_a_purge_is_counted_and_a_deleted_queues_series_go_from_every_node(
    cluster: Cluster,
) -> None:
    """Queues that come and go leave no series behind (nor counts in the node's memory):
    every `queue` label of a deleted queue is gone from the next scrape of every node."""
    client = cluster.client()
    client.declare("brief")
    consumer = client.subscribe("brief", prefetch=1)
    for _ in range(3):
        client.publish("brief", b"m")
    assert consumer.get(timeout=10) is not None
    assert client.purge_queue("brief") == 2
    urls = [cluster.metrics_url(node) for node in cluster.nodes]
    for url in urls:
        wait_for(
            lambda url=url: queue(scrape(url), "messages_purged_total", "brief") == 2,
            f"{url} counted the purge",
        )
    client.delete_queue("brief", force=True)
    for url in urls:
        wait_for(
            lambda url=url: not any(("queue", "brief") in labels for _, labels in scrape(url)),
            f"{url} dropped the deleted queue's series",
        )
