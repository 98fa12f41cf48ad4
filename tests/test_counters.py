"""quorumq.server.counters: what a node counts per queue as its replica applies entries."""

from __future__ import annotations

from typing import Any

from quorumq.machine import (
    Ack,
    Applied,
    Command,
    Declare,
    DeleteQueue,
    Enqueue,
    Meta,
    Nack,
    QueueOptions,
    Subscribe,
    Tick,
)
from quorumq.server.counters import COUNTS, QueueCounters

from .helpers import Driver, delivered


class Counted:
    """A machine driven with increasing indexes, its entries shown to a `QueueCounters`
    as a replica shows them."""

    def __init__(self, replica: object = None) -> None:
        self.driver = Driver()
        self.counters = QueueCounters()
        self.replica = replica

    def __call__(self, command: Command, *, ts_ms: int | None = None) -> Applied:
        applied = self.driver(command, ts_ms=ts_ms)
        self.counters.applied(self.replica, self.driver.index, b"", command, applied)
        return applied


def test_deliveries_redeliveries_acks_rejections_and_dead_letters_are_counted_per_queue() -> None:
    apply = Counted()
    counters = apply.counters
    apply(Declare(queue="dlq"))
    apply(Declare(queue="q", options=QueueOptions(dead_letter_queue="dlq")))
    apply(Subscribe(queue="q", consumer="c", node="A", prefetch=10))
    sent = [delivered(apply(Enqueue(queue="q", body=b"m"))) for _ in range(3)]
    first, second, third = (d[0].offset for d in sent)
    apply(Ack(queue="q", consumer="c", offsets=(first, first)))  # listed twice: one ack
    again = delivered(apply(Nack(queue="q", consumer="c", offsets=(second,), requeue=True)))
    assert [d.redelivered for d in again] == [True]
    apply(Nack(queue="q", consumer="c", offsets=(third,), requeue=False))
    apply(Ack(queue="q", consumer="c", offsets=(first,)))  # refused (not held): not counted

    counts = counters.counts()
    assert counts["q"] == {
        "delivered": 4,
        "redelivered": 1,
        "acked": 1,
        "rejected": 1,
        "dead_lettered": 1,
        "expired": 0,
        "dropped": 0,
        "purged": 0,
    }
    assert "dlq" not in counts  # it was enqueued into, not delivered from
    assert counters.counts(["dlq", "q"])["dlq"] == dict.fromkeys(COUNTS, 0)


def test_expired_messages_count_as_expired_and_dropped_without_a_dead_letter_queue() -> None:
    apply = Counted()
    counters = apply.counters
    apply(Declare(queue="ttl", options=QueueOptions(message_ttl_ms=10)), ts_ms=1_000)
    apply(Enqueue(queue="ttl", body=b"a"), ts_ms=1_000)
    apply(Enqueue(queue="ttl", body=b"b"), ts_ms=1_000)
    apply(Tick(), ts_ms=2_000)
    assert counters.counts()["ttl"]["expired"] == 2
    assert counters.counts()["ttl"]["dropped"] == 2
    assert counters.counts()["ttl"]["dead_lettered"] == 0


def test_purged_messages_are_counted_and_a_deleted_queues_counts_go_with_it() -> None:
    """A node whose queues come and go keeps counts of the queues that are: a delete
    drops the queue's row (applied, or skipped by a snapshot install), and a queue
    declared again under the name counts from zero."""
    from quorumq.machine import DeleteQueue, Machine, PurgeQueue

    class _Replica:
        def query(self, read: object) -> object:
            return read(machine)  # type: ignore[operator]

    apply = Counted(_Replica())
    apply(Declare(queue="q"), ts_ms=0)
    apply(Declare(queue="kept"), ts_ms=0)
    apply(Subscribe(queue="q", consumer="c", node="A", prefetch=1), ts_ms=0)
    for _ in range(4):
        apply(Enqueue(queue="q", body=b"m"), ts_ms=0)  # c holds one, three ready
    apply(PurgeQueue(queue="q"), ts_ms=0)
    assert apply.counters.counts()["q"]["purged"] == 3
    apply(DeleteQueue(queue="q", force=True), ts_ms=0)
    assert "q" not in apply.counters.counts()
    apply(Declare(queue="q"), ts_ms=0)
    assert apply.counters.counts(["q"])["q"] == dict.fromkeys(COUNTS, 0)
    apply(Enqueue(queue="q", body=b"m"), ts_ms=0)
    apply(PurgeQueue(queue="q"), ts_ms=0)  # counted: "q" has a row again
    apply(Enqueue(queue="kept", body=b"m"), ts_ms=0)
    apply(PurgeQueue(queue="kept"), ts_ms=0)
    assert sorted(apply.counters.counts()) == ["kept", "q"]
    machine = Machine()  # a snapshot taken after "q" was deleted again
    machine.apply(Meta(1, 0), Declare(queue="kept"))
    apply.counters.snapshot_loaded(apply.replica, 10, 20)
    assert list(apply.counters.counts()) == ["kept"]


class _Group:
    """One Raft group's replica as the counters see it: its machine, queried."""

    def __init__(self) -> None:
        self.driver = Driver()

    def query(self, read: Any) -> Any:
        return read(self.driver.machine)

    def apply(self, counters: QueueCounters, command: Command) -> None:
        counters.applied(self, self.driver.index + 1, b"", command, self.driver(command))


def test_one_groups_snapshot_keeps_the_counts_of_the_other_groups_queues() -> None:
    """A node with many Raft groups counts every group's queues in one place: a group's
    snapshot drops the counts of its own queues that are gone, not of the others'
    (found by review: any group's snapshot reset every other group's counts)."""
    counters = QueueCounters()
    groups = [_Group(), _Group()]
    for group, queues in zip(groups, (["q0"], ["q1", "gone"]), strict=True):
        for queue in queues:
            group.apply(counters, Declare(queue=queue))
            group.apply(counters, Subscribe(queue=queue, consumer=f"c-{queue}", node="A"))
            group.apply(counters, Enqueue(queue=queue, body=b"m"))
    assert sorted(counters.counts()) == ["gone", "q0", "q1"]
    groups[1].driver(DeleteQueue(queue="gone", force=True))  # an entry the snapshot skipped
    counters.snapshot_loaded(groups[1], 0, 0)
    assert {q: c["delivered"] for q, c in counters.counts().items()} == {"q0": 1, "q1": 1}
