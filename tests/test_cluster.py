"""A real cluster: three node processes on loopback, killed with SIGKILL, paused with
SIGSTOP, restarted from their data dirs. Every process is stopped by the test."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from concurrent.futures import Future
from typing import Any

import pytest

from quorumq.client import Client, Consumer, Delivery
from quorumq.ops.local_cluster import Cluster

from .helpers import wait_for

pytestmark = pytest.mark.slow


class Recorder:
    """Consumes in a thread, acks everything, records every delivery."""

    def __init__(self, consumer: Consumer, ack: bool = True) -> None:
        self.consumer = consumer
        self.ack = ack
        self.deliveries: list[Delivery] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            d = self.consumer.get(timeout=0.1)
            if d is None:
                continue
            self.deliveries.append(d)
            if self.ack:
                d.ack()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def kill_all_and_restart(cluster: Cluster) -> None:
    """SIGKILL every node at once, start them again, wait until they apply the same log."""
    for node in cluster.nodes:
        cluster.kill(node)
    for node in cluster.nodes:
        cluster.restart(node)
    cluster.leader()
    # a restarted follower learns the commit index from the new leader: wait for it
    wait_for(lambda: converged(cluster), "all replicas applying the same log", 30)


def converged(cluster: Cluster) -> bool:
    digests = {
        (s["machine_index"], s["digest"])
        for s in (cluster.status(n, audit=True) for n in cluster.nodes)
    }
    return len(digests) == 1


def test_followers_deliver_to_their_own_consumers_through_a_leader_kill() -> None:
    with Cluster(3, node_down_grace=30.0) as cluster:
        leader = cluster.leader()
        followers = [n for n in cluster.nodes if n != leader]
        producer = cluster.client(leader)
        producer.declare("q")
        recorders = {f: Recorder(cluster.client(f).subscribe("q", prefetch=50)) for f in followers}
        offsets = [producer.publish("q", b"before-%d" % i) for i in range(100)]
        cluster.kill(leader)
        offsets += [producer.publish("q", b"after-%d" % i) for i in range(100)]
        assert offsets == list(range(200))  # no offset assigned twice, none skipped
        everything = lambda: {d.offset for r in recorders.values() for d in r.deliveries}  # noqa: E731
        wait_for(lambda: everything() == set(offsets), "every message delivered", 30)
        for r in recorders.values():
            r.stop()
        for follower, r in recorders.items():
            assert {d.node for d in r.deliveries} == {follower}  # from its own replica
            first = [d.offset for d in r.deliveries if not d.redelivered]
            assert first == sorted(first)  # FIFO
            assert len(first) == len(set(first))
        cluster.restart(leader)
        wait_for(lambda: converged(cluster), "the same digest on all three replicas", 30)


def test_a_consumer_that_subscribes_after_publishing_gets_the_waiting_messages() -> None:
    with Cluster(3) as cluster:
        client = cluster.client()
        client.declare("q")
        for i in range(5):
            client.publish("q", b"%d" % i)
        wanted = {"A": 2, "B": 2, "C": 1}
        for node in cluster.nodes:  # each subscribe finds messages ready at once
            consumer = cluster.client(node).subscribe("q", prefetch=2)
            got = [consumer.get(timeout=10) for _ in range(wanted[node])]
            assert all(d is not None and d.node == node for d in got), node


def test_every_confirmed_message_survives_killing_all_nodes_at_once() -> None:
    with Cluster(3) as cluster:
        client = cluster.client()
        client.declare("q")
        confirmed = [client.publish("q", b"m%d" % i) for i in range(300)]
        kill_all_and_restart(cluster)
        for node in cluster.nodes:
            reader = cluster.client(node)
            read = reader.read("q", 0, 1000)
            assert [m.offset for m in read] == confirmed, node
            assert [m.body for m in read] == [b"m%d" % i for i in range(300)]
            assert reader.status()["queues"]["q"]["ready"] == 300


def test_every_confirmed_message_survives_compaction_and_killing_all_nodes() -> None:
    with Cluster(3, compaction_entries=100) as cluster:
        client = cluster.client()
        client.declare("q")
        consumer = cluster.client().subscribe("q", prefetch=20)  # holds 20, acks none
        confirmed = [client.publish("q", b"m%d" % i) for i in range(400)]
        wait_for(
            lambda: all((cluster.root / n / "snapshot").exists() for n in cluster.nodes),
            "a snapshot on every node",
        )
        held = cluster.status(cluster.nodes[0])["queues"]["q"]["unacked"]
        assert held == 20
        kill_all_and_restart(cluster)
        for node in cluster.nodes:
            reader = cluster.client(node)
            assert [m.offset for m in reader.read("q", 0, 1000)] == confirmed, node
            queue = reader.status()["queues"]["q"]
            assert queue["ready"] + queue["unacked"] == 400  # the held ones too
        del consumer


def test_every_confirmed_message_survives_compaction_and_kills_on_the_write_ahead_log() -> None:
    """Issue 33's shared log, one group in it, as every node's journal: compaction,
    snapshots and a SIGKILL of every node lose nothing, and the journal is the log's
    segments, not a file of its own."""
    with Cluster(3, compaction_entries=100, journal="wal") as cluster:
        client = cluster.client()
        client.declare("q")
        confirmed = [client.publish("q", b"m%d" % i) for i in range(400)]
        wait_for(
            lambda: all((cluster.root / n / "snapshot").exists() for n in cluster.nodes),
            "a snapshot on every node",
        )
        kill_all_and_restart(cluster)
        confirmed += [client.publish("q", b"n%d" % i) for i in range(100)]
        kill_all_and_restart(cluster)
        for node in cluster.nodes:
            reader = cluster.client(node)
            assert [m.offset for m in reader.read("q", 0, 1000)] == confirmed, node
            assert reader.status()["queues"]["q"]["ready"] == 500
            data = cluster.root / node
            journal = reader.status()["journal"]
            assert journal["kind"] == "wal" and journal["segments"] >= 1, journal
            names = {p.name for p in (data / "wal").iterdir()}
            assert "group-0.meta" in names and any(n.startswith("wal-") for n in names)
            assert (data / "raft.log").read_bytes()[:4] == b"QQWA"  # the marker, no journal


def test_a_node_carries_its_journal_file_into_the_log_once_and_cannot_go_back() -> None:
    """The upgrade path: nodes that ran on journal files, started with `--journal wal`,
    carry their journals over (set aside as `raft.log.adopted-*`) and lose nothing; a
    node on the log started with `--journal file` is refused and says what to do."""
    with Cluster(3) as cluster:
        client = cluster.client()
        client.declare("q")
        confirmed = [client.publish("q", b"m%d" % i) for i in range(200)]
        client.close()
        cluster.journal = "wal"
        kill_all_and_restart(cluster)
        client = cluster.client()
        confirmed += [client.publish("q", b"n%d" % i) for i in range(50)]
        for node in cluster.nodes:
            assert [m.offset for m in cluster.client(node).read("q", 0, 1000)] == confirmed
            assert len(list((cluster.root / node).glob("raft.log.adopted-*"))) == 1
            assert (cluster.root / node / "raft.log").read_bytes()[:4] == b"QQWA"
        cluster.kill("A")
        cluster.journal = "file"
        with pytest.raises(RuntimeError, match="start it with --journal wal"):
            cluster.restart("A")
        cluster.journal = "wal"
        cluster.restart("A")
        wait_for(lambda: converged(cluster), "all replicas applying the same log", 30)
        assert [m.offset for m in cluster.client("A").read("q", 0, 1000)] == confirmed


def test_a_paused_node_loses_its_consumers_messages_to_others_and_rejoins() -> None:
    with Cluster(3, node_down_grace=1.5) as cluster:
        leader = cluster.leader()
        paused, other = [n for n in cluster.nodes if n != leader]
        producer = cluster.client(leader)
        producer.declare("q")
        stuck = cluster.client(paused).subscribe("q", prefetch=5)
        live = Recorder(cluster.client(other).subscribe("q", prefetch=100))
        for i in range(20):
            producer.publish("q", b"%d" % i)
        wait_for(
            lambda: cluster.status(leader)["queues"]["q"]["unacked"] == 5,
            "5 held on the paused node's consumer",
        )
        cluster.pause(paused)
        wait_for(
            lambda: len({d.offset for d in live.deliveries}) == 20,
            "everything at the live consumer",
            20,
        )
        again = [d for d in live.deliveries if d.redelivered]
        assert len(again) == 5 and all(d.delivery_count == 1 for d in again)
        cluster.resume(paused)
        wait_for(lambda: paused not in _down_nodes(cluster, leader), "NodeUp", 20)
        wait_for(lambda: converged(cluster), "the paused node catching up", 20)
        live.stop()
        del stuck


def _down_nodes(cluster: Cluster, node: str) -> Any:
    return cluster.status(node).get("down_nodes", [])


def test_idempotent_producer_through_two_leader_kills_loses_and_duplicates_nothing() -> None:
    total = 20_000
    with Cluster(3, node_down_grace=30.0) as cluster:
        producer = cluster.client(timeout=60.0)
        producer.declare("q")
        recorders = [
            Recorder(cluster.client(n).subscribe("q", prefetch=500)) for n in cluster.nodes
        ]
        futures: list[Future[dict[str, Any]]] = []
        kills = {total // 4, total // 2}
        window: list[Future[dict[str, Any]]] = []
        for i in range(total):
            if i in kills:
                for f in window:
                    f.result(60)
                window.clear()
                victim = cluster.leader()
                cluster.kill(victim)
                cluster.restart(victim)
            f = producer.publish_async("q", b"msg-%06d" % i)
            futures.append(f)
            window.append(f)
            if len(window) >= 500:
                for f in window:
                    f.result(60)
                window.clear()
        offsets = [f.result(60)["offset"] for f in futures]
        assert sorted(offsets) == list(range(total))  # each message exactly one offset
        stream = producer.read("q", 0, total + 10)
        assert len(stream) == total
        assert sorted(m.body for m in stream) == [b"msg-%06d" % i for i in range(total)]
        seen = lambda: {d.offset for r in recorders for d in r.deliveries}  # noqa: E731
        wait_for(lambda: len(seen()) == total, "every message delivered", 60)
        for r in recorders:
            r.stop()
        count: dict[int, int] = defaultdict(int)
        for r in recorders:
            for d in r.deliveries:
                if not d.redelivered:
                    count[d.offset] += 1
        assert max(count.values()) == 1  # delivered twice only when marked redelivered


def test_a_node_with_the_wrong_cluster_secret_is_refused_and_says_why() -> None:
    with Cluster(3) as cluster:
        client = cluster.client("A")
        client.declare("q")
        cluster.kill("C")
        cluster.restart("C", secret="not-the-cluster-secret")
        client.publish("q", b"while C is shut out")
        refused = "failed authentication: a peer uses another cluster secret"
        # whichever side dials, the node with the wrong secret says so
        wait_for(lambda: refused in cluster.log_path("C").read_text(), "C logging the refusal")
        assert cluster.status("C")["queues"].get("q", {}).get("next_offset", 0) == 0
        assert cluster.status("A")["queues"]["q"]["next_offset"] == 1
        cluster.kill("C")
        cluster.restart("C")  # the right secret: it catches up
        wait_for(lambda: converged(cluster), "C catching up once it has the secret", 30)


def test_a_node_restarted_within_the_grace_period_returns_its_earlier_consumers_messages() -> None:
    with Cluster(3, node_down_grace=60.0) as cluster:  # NodeDown will not come to help
        leader = cluster.leader()
        follower = next(n for n in cluster.nodes if n != leader)
        client = cluster.client(leader)
        client.declare("q")
        holder_client = Client([cluster.endpoint(follower)])  # only there: no failing over
        holder = holder_client.subscribe("q", prefetch=5)  # takes 5, acks none
        confirmed = [client.publish("q", b"m%d" % i) for i in range(10)]
        held = [holder.get(timeout=10) for _ in range(5)]
        assert all(d is not None for d in held)
        cluster.kill(follower)
        holder_client.close()  # it must not come back elsewhere and take them again
        cluster.restart(follower)
        other = next(n for n in cluster.nodes if n not in (leader, follower))
        recorder = Recorder(cluster.client(other).subscribe("q", prefetch=20))
        wait_for(
            lambda: {d.offset for d in recorder.deliveries} == set(confirmed),
            "the earlier run's held messages delivered again",
            30,
        )
        recorder.stop()
        assert {d.offset for d in recorder.deliveries if d.redelivered} == {
            d.offset for d in held if d is not None
        }


def test_a_follower_that_installs_a_snapshot_delivers_what_the_snapshot_skipped() -> None:
    """A follower that falls behind the leader's compaction catches up from a snapshot,
    skipping the log entries that assigned messages to its consumer: it must still send
    them (no NodeDown helps here: the pause is far below the grace period)."""
    with Cluster(3, node_down_grace=60.0, compaction_entries=100) as cluster:
        leader = cluster.leader()
        lagging = next(n for n in cluster.nodes if n != leader)
        producer = cluster.client(leader)
        producer.declare("q")
        consumer_client = Client([cluster.endpoint(lagging)])
        recorder = Recorder(consumer_client.subscribe("q", prefetch=10))
        wait_for(
            lambda: len(cluster.status(leader)["queues"]["q"]["consumer_ids"]) == 1,
            "the subscription committed",
        )
        cluster.pause(lagging)
        confirmed: list[int] = []
        paused = time.monotonic()
        try:  # a short pause fits in socket buffers: it must outlast the Raft connection
            while len(confirmed) < 400 or time.monotonic() - paused < 5:
                confirmed.append(producer.publish("q", b"m%d" % len(confirmed)))
        finally:
            cluster.resume(lagging)
        wait_for(
            lambda: cluster.status(lagging)["snapshots_loaded"] >= 1,
            "the lagging follower installing the leader's snapshot",
            30,
        )
        wait_for(
            lambda: {d.offset for d in recorder.deliveries} == set(confirmed),
            "every message delivered to the consumer on the lagging follower",
            30,
        )
        recorder.stop()
        first = [d.offset for d in recorder.deliveries if not d.redelivered]
        assert len(first) == len(set(first)), "a message delivered twice, unmarked"
        consumer_client.close()


def test_a_node_with_a_flipped_journal_byte_refuses_to_start_and_nothing_is_lost() -> None:
    """The outside trial that lost 135 of 200 confirmed messages: A's journal is damaged
    in the middle while C lags. A must not cut its log and then vote as if it were short."""
    with Cluster(3) as cluster:
        client = cluster.client("A")
        client.declare("q")
        confirmed = [client.publish("q", b"m%d" % i) for i in range(50)]
        cluster.kill("C")
        confirmed += [client.publish("q", b"m%d" % i) for i in range(50, 200)]
        client.close()
        cluster.kill("A")
        cluster.kill("B")
        journal = cluster.root / "A" / "raft.log"
        data = bytearray(journal.read_bytes())
        data[len(data) // 2] ^= 0x01
        journal.write_bytes(bytes(data))
        with pytest.raises(RuntimeError, match="refuses") as refused:
            cluster.restart("A")
        assert "members remove" in str(refused.value)  # it says what to do
        assert journal.read_bytes() == bytes(data)  # and deletes nothing
        cluster.restart("C")
        cluster.restart("B")
        cluster.leader()
        wait_for(
            lambda: all(cluster.status(n)["machine_index"] >= 203 for n in ("B", "C")),
            "B and C applying the whole log",
            30,
        )
        for node in ("B", "C"):
            read = cluster.client(node).read("q", 0, 1000)
            assert [m.offset for m in read] == confirmed, node


def test_a_node_restored_beside_nodes_started_empty_stops_and_they_go_on() -> None:
    """The operator's mistake the danger box on the operating page describes: one node's
    data restored, the others' moved away. B and C start empty, choose a cluster
    identity of their own and take new messages; A, started from its old data, drops
    their messages (they drop its), stops with one line saying what to do, and mixes
    nothing into theirs (before the identity it diverged in silence, or its tick failed
    at every message)."""
    with Cluster(3) as cluster:
        client = cluster.client("A")
        client.declare("q")
        for i in range(20):
            client.publish("q", b"old %d" % i)
        client.close()
        wait_for(
            lambda: (
                len({cluster.status(n)["cluster"] for n in cluster.nodes} - {None}) == 1
                and all(cluster.status(n)["cluster"] for n in cluster.nodes)
            ),
            "every node knowing the cluster identity",
            15,
        )
        identity = cluster.status("A")["cluster"]
        for node in cluster.nodes:
            cluster.kill(node)
        for node in ("B", "C"):
            (cluster.root / node).rename(cluster.root / f"{node}.moved-away")
            cluster.restart(node)
        cluster.leader()
        wait_for(
            lambda: all(cluster.status(n)["cluster"] for n in ("B", "C")),
            "B and C choosing an identity",
            15,
        )
        new_identity = cluster.status("B")["cluster"]
        assert new_identity != identity
        fresh = cluster.client("B")
        fresh.declare("q")
        new = [fresh.publish("q", b"new %d" % i) for i in range(5)]
        fresh.close()
        try:
            cluster.restart("A")
        except RuntimeError as e:
            assert "exited" in str(e)  # it may stop before it says it is ready
        wait_for(lambda: not cluster.alive("A"), "A stopping", 20)
        log = cluster.log_path("A").read_text(errors="replace")
        assert f"this node's data belongs to cluster {identity}" in log
        assert f"hold another (cluster {new_identity};" in log
        assert "move its data directory away and start it again empty" in log
        for node in ("B", "C"):
            read = cluster.client(node).read("q", 0, 1000)
            assert [m.body for m in read] == [b"new %d" % i for i in range(5)], node
        assert [m.offset for m in cluster.client("B").read("q", 0, 1000)] == new
        digests = {cluster.status(n, audit=True)["digest"] for n in ("B", "C")}
        assert len(digests) == 1


def test_a_leader_paused_past_the_node_down_grace_marks_no_healthy_node_down() -> None:
    """Issue 27: a leader SIGSTOPped 4 s with a 3 s grace, publishers running, came back
    and proposed `NodeDown` for every peer at once (it judged them silent from answers
    it had not read), and the next leader committed them: every consumer of the cluster
    was cancelled and its messages redelivered (3 of 3 runs). The paused node itself is
    marked down by the next leader, rightly; the others' consumers keep their
    subscriptions (a consumer cancelled with `node_down` comes back under a new id)."""
    with Cluster(3, node_down_grace=3.0) as cluster:
        producer = cluster.client(timeout=30.0)
        producer.declare("q")
        consumers = {n: cluster.client(n).subscribe("q", prefetch=20) for n in cluster.nodes}
        recorders = [Recorder(c) for c in consumers.values()]
        sent = 0
        for _ in range(3):  # each round: the leader paused in mid-stride, publishing on
            leader = cluster.leader()
            wait_for(
                lambda leader=leader: (
                    len(  # type: ignore[misc]
                        cluster.status(leader)["queues"]["q"]["consumer_ids"]
                    )
                    == 3
                ),
                "every consumer subscribed",
                30,
            )
            ids = {n: c.id for n, c in consumers.items()}
            for _ in range(200):
                producer.publish("q", b"m%d" % sent)
                sent += 1
            paused_at = time.monotonic()
            cluster.pause(leader)
            while time.monotonic() - paused_at < 4.0:  # the fault's length
                time.sleep(0.05)
            cluster.resume(leader)
            healthy = [n for n in cluster.nodes if n != leader]
            wait_for(
                lambda leader=leader, healthy=healthy: (
                    leader  # type: ignore[misc]
                    not in _down_nodes(cluster, healthy[0])
                ),
                "the paused node up again",
                30,
            )
            cancelled = {n: consumers[n].id for n in healthy if consumers[n].id != ids[n]}
            assert not cancelled, f"consumers cancelled on nodes that never stopped: {cancelled}"
        wait_for(
            lambda: len({d.body for r in recorders for d in r.deliveries}) == sent,
            "every message delivered",
            30,
        )
        for r in recorders:
            r.stop()
