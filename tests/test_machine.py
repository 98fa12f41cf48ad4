"""Direct `apply` tests: one delivery rule or refusal per test."""

from __future__ import annotations

from typing import Any

import pytest

from quorumq.machine import (
    OK,
    Ack,
    Cancel,
    CommitOffset,
    ConsumerDown,
    DeadLettered,
    Declare,
    Declared,
    DeleteQueue,
    Down,
    Dropped,
    Enqueue,
    EnqueueBatch,
    Enqueued,
    Error,
    ErrorCode,
    ForgetProducers,
    Forgotten,
    Machine,
    Message,
    Meta,
    Nack,
    NodeDown,
    NodeUp,
    Purged,
    PurgeQueue,
    QueueDeleted,
    QueueOptions,
    QueuePurged,
    Subscribe,
    Tick,
    UnknownQueueError,
    encoding,
)
from quorumq.machine.queue import HEADER_OVERHEAD, MESSAGE_OVERHEAD, message_cost

from .helpers import Driver, delivered, deliveries


def _error_code(reply: object) -> ErrorCode:
    assert isinstance(reply, Error), reply
    return reply.code


@pytest.fixture
def d() -> Driver:
    drive = Driver()
    assert drive(Declare(queue="q")).reply == Declared(created=True)
    return drive


def publish(d: Driver, n: int, queue: str = "q", key: str | None = None) -> list[int]:
    offsets = []
    for i in range(n):
        reply = d(Enqueue(queue=queue, body=b"m%d" % i, key=key)).reply
        assert isinstance(reply, Enqueued)
        assert reply.offset is not None
        offsets.append(reply.offset)
    return offsets


# ------------------------------------------------------------------ declaring


def test_declare_is_idempotent_with_same_options(d: Driver) -> None:
    assert d(Declare(queue="q")).reply == Declared(created=False)


def test_declare_with_other_options_is_refused_naming_the_options_that_differ(d: Driver) -> None:
    """The refusal printed the whole `QueueOptions(...)`, every field of it; it names
    the options that differ now, what the queue has and what was asked."""
    reply = d(Declare(queue="q", options=QueueOptions(max_length=3))).reply
    assert _error_code(reply) is ErrorCode.OPTIONS_MISMATCH
    assert isinstance(reply, Error)
    assert reply.message == "queue 'q' exists with max_length None (asked 3)"
    assert d.machine.options("q") == QueueOptions()


def test_queue_cannot_dead_letter_to_itself(d: Driver) -> None:
    reply = d(Declare(queue="x", options=QueueOptions(dead_letter_queue="x"))).reply
    assert _error_code(reply) is ErrorCode.INVALID
    assert d.machine.queues() == ("q",)


def test_invalid_options_are_refused_when_built() -> None:
    with pytest.raises(ValueError, match="max_length"):
        QueueOptions(max_length=-1)
    with pytest.raises(ValueError, match="overflow"):
        QueueOptions(overflow="drop-tail")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="message_ttl_ms"):
        QueueOptions(message_ttl_ms=0)


@pytest.mark.parametrize(
    ("build", "complaint"),
    [
        (lambda: Enqueue(queue="q", body="text"), "body must be bytes"),  # type: ignore[arg-type]
        (lambda: Message(body=b"x", key=7), "key must be a str"),  # type: ignore[arg-type]
        (lambda: Message(body=b"x", headers={"n": 1}), "header 'n' must be a str"),
        (lambda: Ack(queue="q", consumer="c", offsets=[-1]), "non-negative"),
        (lambda: Subscribe(queue="q", consumer="c", node="A", prefetch=-1), "prefetch"),
        # exact types: a float or a bool held by the machine broke every snapshot after it
        (lambda: QueueOptions(max_length=1e6), "max_length must be an int"),
        (lambda: QueueOptions(max_length=True), "max_length must be an int"),
        (lambda: QueueOptions(message_ttl_ms=60_000.0), "message_ttl_ms must be an int"),
        (lambda: QueueOptions(single_active_consumer=1), "single_active_consumer must be a b"),
        (lambda: Subscribe(queue="q", consumer="c", node="A", prefetch=2.5), "prefetch must"),
        (lambda: Ack(queue="q", consumer="c", offsets=[1.0]), "non-negative ints"),
        (lambda: Ack(queue="q", consumer="c", offsets=[True]), "non-negative ints"),
        (lambda: Nack(queue="q", consumer="c", offsets=[1], requeue=0), "requeue must be a b"),
        (lambda: Enqueue(queue="q", body=b"x", seq=1.0), "seq must be an int"),
        (lambda: Enqueue(queue="q\ud800", body=b"x"), "queue is not valid text"),
        (lambda: Message(body=b"x", key="k\udfff"), "key is not valid text"),
        (lambda: Declare(queue="q", options={"max_length": 1}), "options"),
    ],
)
def test_commands_check_their_fields_when_built(build: object, complaint: str) -> None:
    with pytest.raises((TypeError, ValueError), match=complaint):
        build()  # type: ignore[operator]


@pytest.mark.parametrize(
    "command",
    [
        Enqueue(queue="nope", body=b"x"),
        EnqueueBatch(queue="nope", messages=[Message(body=b"x")]),
        Subscribe(queue="nope", consumer="c", node="A"),
        Cancel(queue="nope", consumer="c"),
        Ack(queue="nope", consumer="c", offsets=[0]),
        Nack(queue="nope", consumer="c", offsets=[0]),
        CommitOffset(queue="nope", group="g", offset=0),
    ],
)
def test_commands_on_an_unknown_queue_are_refused(d: Driver, command: object) -> None:
    before = d.machine.digest()
    applied = d(command)  # type: ignore[arg-type]
    assert _error_code(applied.reply) is ErrorCode.UNKNOWN_QUEUE
    assert applied.effects == ()
    assert d.machine.digest() != before  # only the applied index moved
    assert d.machine.queues() == ("q",)


def test_queries_on_an_unknown_queue_raise() -> None:
    with pytest.raises(UnknownQueueError):
        Machine().ready("nope")


# ------------------------------------------------------- order and round robin


def test_offsets_are_assigned_in_order_from_zero(d: Driver) -> None:
    assert publish(d, 3) == [0, 1, 2]
    assert d.machine.ready("q") == (0, 1, 2)


def test_single_consumer_receives_messages_in_fifo_order(d: Driver) -> None:
    publish(d, 3)
    applied = d(Subscribe(queue="q", consumer="c1", node="A"))
    assert deliveries(applied) == [("c1", 0), ("c1", 1), ("c1", 2)]
    assert [e.body for e in delivered(applied)] == [b"m0", b"m1", b"m2"]
    assert all(not e.redelivered and e.delivery_count == 0 for e in delivered(applied))


def test_service_queue_is_round_robin(d: Driver) -> None:
    d(Subscribe(queue="q", consumer="c1", node="A"))
    d(Subscribe(queue="q", consumer="c2", node="B"))
    assert d.machine.service_queue("q") == ("c1", "c2")
    got = []
    for i in range(4):
        got += deliveries(d(Enqueue(queue="q", body=b"%d" % i)))
    assert got == [("c1", 0), ("c2", 1), ("c1", 2), ("c2", 3)]
    assert d.machine.service_queue("q") == ("c1", "c2")


def test_deliveries_name_the_consumers_node(d: Driver) -> None:
    d(Subscribe(queue="q", consumer="c1", node="A"))
    (deliver,) = delivered(d(Enqueue(queue="q", body=b"x", key="k", headers={"h": "v"})))
    got = (deliver.queue, deliver.node, deliver.key, deliver.headers)
    assert got == ("q", "A", "k", {"h": "v"})


def test_prefetch_limits_unacked_messages_and_ack_restores_credit(d: Driver) -> None:
    publish(d, 5)
    applied = d(Subscribe(queue="q", consumer="c1", node="A", prefetch=2))
    assert deliveries(applied) == [("c1", 0), ("c1", 1)]
    assert d.machine.service_queue("q") == ()
    applied = d(Ack(queue="q", consumer="c1", offsets=[0]))
    assert deliveries(applied) == [("c1", 2)]
    assert d.machine.unacked("q", "c1") == (1, 2)


def test_consumer_without_credit_leaves_service_queue_until_ack(d: Driver) -> None:
    d(Subscribe(queue="q", consumer="c1", node="A", prefetch=1))
    d(Subscribe(queue="q", consumer="c2", node="B", prefetch=1))
    publish(d, 3)
    assert d.machine.service_queue("q") == ()
    assert d.machine.ready("q") == (2,)
    applied = d(Ack(queue="q", consumer="c2", offsets=[1]))
    assert deliveries(applied) == [("c2", 2)]


def test_ack_removes_message_from_queue_view_but_not_stream_view(d: Driver) -> None:
    d(Subscribe(queue="q", consumer="c1", node="A"))
    publish(d, 2)
    assert d(Ack(queue="q", consumer="c1", offsets=[0, 1])).reply == OK
    assert d.machine.ready("q") == ()
    assert d.machine.unacked("q", "c1") == ()
    assert [m.body for m in d.machine.read("q", 0, 10)] == [b"m0", b"m1"]


def test_ack_of_offset_not_held_is_refused_and_changes_nothing(d: Driver) -> None:
    d(Subscribe(queue="q", consumer="c1", node="A"))
    d(Subscribe(queue="q", consumer="c2", node="B"))
    publish(d, 2)
    reply = d(Ack(queue="q", consumer="c1", offsets=[0, 1])).reply
    assert _error_code(reply) is ErrorCode.NOT_HELD
    assert "[1]" in reply.message  # type: ignore[union-attr]
    assert d.machine.unacked("q", "c1") == (0,)


def test_ack_by_unknown_consumer_is_refused(d: Driver) -> None:
    publish(d, 1)
    reply = d(Ack(queue="q", consumer="ghost", offsets=[0])).reply
    assert _error_code(reply) is ErrorCode.UNKNOWN_CONSUMER


def test_acked_message_is_never_delivered_again(d: Driver) -> None:
    d(Subscribe(queue="q", consumer="c1", node="A"))
    publish(d, 2)
    d(Ack(queue="q", consumer="c1", offsets=[0]))
    applied = d(Down(consumer="c1"))
    d2 = d(Subscribe(queue="q", consumer="c2", node="B"))
    assert deliveries(applied) == []
    assert deliveries(d2) == [("c2", 1)]


# --------------------------------------------------------------------- returns


def test_returned_message_is_redelivered_before_later_ones(d: Driver) -> None:
    d(Subscribe(queue="q", consumer="c1", node="A", prefetch=1))
    publish(d, 3)
    applied = d(Nack(queue="q", consumer="c1", offsets=[0]))
    (again,) = delivered(applied)
    assert (again.offset, again.redelivered, again.delivery_count) == (0, True, 1)


def test_nack_requeue_increments_delivery_count_each_time(d: Driver) -> None:
    d(Subscribe(queue="q", consumer="c1", node="A"))
    publish(d, 1)
    counts = []
    for _ in range(3):
        applied = d(Nack(queue="q", consumer="c1", offsets=[0]))
        counts += [e.delivery_count for e in delivered(applied)]
    assert counts == [1, 2, 3]


def test_held_deliveries_are_the_deliveries_as_they_were_sent(d: Driver) -> None:
    """A node that skips log entries by installing a snapshot sends these instead."""
    d(Subscribe(queue="q", consumer="c1", node="A", prefetch=3))
    sent = []
    for i in range(4):
        sent += delivered(d(Enqueue(queue="q", body=b"m%d" % i, key="k", headers={"h": "v"})))
    sent += delivered(d(Nack(queue="q", consumer="c1", offsets=[1])))  # 1 and 2 come back
    sent += delivered(d(Ack(queue="q", consumer="c1", offsets=[0])))  # credit: 3 goes
    held = d.machine.held_deliveries("q", "c1")
    assert held is not None
    assert [e.offset for e in held] == list(d.machine.unacked("q", "c1")) == [1, 2, 3]
    latest = {e.offset: e for e in sent}
    assert list(held) == [latest[o] for o in (1, 2, 3)]
    # 2 came back with 1 (a key tail): marked, but its own delivery did not fail
    assert [(e.redelivered, e.delivery_count) for e in held] == [(True, 1), (True, 0), (False, 0)]
    assert d.machine.held_deliveries("q", "nobody") is None
    assert d.machine.held_deliveries("no such queue", "c1") is None


def test_nack_without_requeue_drops_without_dead_letter_queue(d: Driver) -> None:
    d(Subscribe(queue="q", consumer="c1", node="A"))
    publish(d, 1)
    applied = d(Nack(queue="q", consumer="c1", offsets=[0], requeue=False))
    assert applied.effects == (Dropped(queue="q", offset=0, reason="rejected"),)
    assert d.machine.ready("q") == ()


def test_nack_without_requeue_dead_letters_atomically(d: Driver) -> None:
    d(Declare(queue="dlq"))
    d(Declare(queue="work", options=QueueOptions(dead_letter_queue="dlq")))
    d(Subscribe(queue="work", consumer="c1", node="A"))
    d(Subscribe(queue="dlq", consumer="inspector", node="B"))
    d(Enqueue(queue="work", body=b"poison", key="k", headers={"a": "b"}))
    applied = d(Nack(queue="work", consumer="c1", offsets=[0], requeue=False))
    dead, deliver = applied.effects
    assert dead == DeadLettered(
        queue="work", offset=0, reason="rejected", target_queue="dlq", target_offset=0
    )
    assert deliver.consumer == "inspector"  # type: ignore[union-attr]
    assert deliver.body == b"poison"  # type: ignore[union-attr]
    assert deliver.headers == {  # type: ignore[union-attr]
        "a": "b",
        "x-death-reason": "rejected",
        "x-death-queue": "work",
        "x-death-offset": "0",
    }


def test_delivery_limit_dead_letters_on_the_return_past_the_limit(d: Driver) -> None:
    d(Declare(queue="dlq"))
    d(Declare(queue="work", options=QueueOptions(delivery_limit=2, dead_letter_queue="dlq")))
    d(Subscribe(queue="work", consumer="c1", node="A"))
    d(Enqueue(queue="work", body=b"x"))
    for count in (1, 2):
        (again,) = delivered(d(Nack(queue="work", consumer="c1", offsets=[0])))
        assert again.delivery_count == count
    applied = d(Nack(queue="work", consumer="c1", offsets=[0]))
    assert applied.effects == (
        DeadLettered(
            queue="work", offset=0, reason="delivery_limit", target_queue="dlq", target_offset=0
        ),
    )
    assert d.machine.ready("dlq") == (0,)
    assert d.machine.ready("work") == ()


def test_delivery_limit_drops_when_no_dead_letter_queue(d: Driver) -> None:
    d(Declare(queue="work", options=QueueOptions(delivery_limit=0)))
    d(Subscribe(queue="work", consumer="c1", node="A"))
    d(Enqueue(queue="work", body=b"x"))
    applied = d(Down(consumer="c1"))
    assert Dropped(queue="work", offset=0, reason="delivery_limit") in applied.effects


def test_dead_lettering_to_a_full_reject_publish_queue_drops(d: Driver) -> None:
    full = QueueOptions(max_length=0, overflow="reject-publish")
    d(Declare(queue="dlq", options=full))
    d(Declare(queue="work", options=QueueOptions(dead_letter_queue="dlq")))
    d(Subscribe(queue="work", consumer="c1", node="A"))
    d(Enqueue(queue="work", body=b"x"))
    applied = d(Nack(queue="work", consumer="c1", offsets=[0], requeue=False))
    assert applied.effects == (Dropped(queue="work", offset=0, reason="dead_letter_full"),)


def test_down_returns_all_unacked_messages_and_removes_consumer(d: Driver) -> None:
    d(Subscribe(queue="q", consumer="c1", node="A"))
    publish(d, 2)
    d(Subscribe(queue="q", consumer="c2", node="B"))
    applied = d(Down(consumer="c1"))
    assert applied.effects[0] == ConsumerDown(queue="q", consumer="c1", node="A", reason="down")
    assert deliveries(applied) == [("c2", 0), ("c2", 1)]
    assert all(e.redelivered and e.delivery_count == 1 for e in delivered(applied))
    assert d.machine.consumers("q") == ("c2",)


def test_down_covers_every_queue_the_consumer_is_on(d: Driver) -> None:
    d(Declare(queue="other"))
    d(Subscribe(queue="q", consumer="c1", node="A"))
    d(Subscribe(queue="other", consumer="c1", node="A"))
    applied = d(Down(consumer="c1"))
    assert [e.queue for e in applied.effects if isinstance(e, ConsumerDown)] == [
        "other",
        "q",
    ]  # by queue name
    assert d.machine.consumers("q") == d.machine.consumers("other") == ()


def test_down_of_unknown_consumer_is_a_no_op(d: Driver) -> None:
    applied = d(Down(consumer="ghost"))
    assert (applied.reply, applied.effects) == (OK, ())


def test_cancel_stops_new_deliveries_but_keeps_unacked_until_acked(d: Driver) -> None:
    d(Subscribe(queue="q", consumer="c1", node="A"))
    publish(d, 1)
    assert d(Cancel(queue="q", consumer="c1")).reply == OK
    assert deliveries(d(Enqueue(queue="q", body=b"later"))) == []
    assert d.machine.unacked("q", "c1") == (0,)
    assert d(Ack(queue="q", consumer="c1", offsets=[0])).reply == OK


def test_cancelled_consumer_is_forgotten_after_its_last_ack(d: Driver) -> None:
    d(Subscribe(queue="q", consumer="c1", node="A"))
    publish(d, 1)
    d(Cancel(queue="q", consumer="c1"))
    assert d.machine.consumers("q") == ("c1",)
    d(Ack(queue="q", consumer="c1", offsets=[0]))
    assert d.machine.consumers("q") == ()
    assert d(Subscribe(queue="q", consumer="c1", node="A")).reply == OK


def test_node_down_downs_every_consumer_on_that_node(d: Driver) -> None:
    d(Subscribe(queue="q", consumer="a1", node="A"))
    d(Subscribe(queue="q", consumer="b1", node="B"))
    d(Subscribe(queue="q", consumer="a2", node="A", prefetch=1))
    publish(d, 3)
    applied = d(NodeDown(node="A"))
    gone = [(e.consumer, e.reason) for e in applied.effects if isinstance(e, ConsumerDown)]
    assert gone == [("a1", "node_down"), ("a2", "node_down")]
    assert deliveries(applied) == [("b1", 0), ("b1", 2)]
    assert d.machine.down_nodes() == {"A"}


def test_subscribe_from_a_down_node_is_refused_until_node_up(d: Driver) -> None:
    d(NodeDown(node="A"))
    reply = d(Subscribe(queue="q", consumer="c1", node="A")).reply
    assert _error_code(reply) is ErrorCode.NODE_DOWN
    d(NodeUp(node="A"))
    assert d(Subscribe(queue="q", consumer="c1", node="A")).reply == OK


def test_subscribe_twice_with_same_consumer_is_refused(d: Driver) -> None:
    d(Subscribe(queue="q", consumer="c1", node="A"))
    reply = d(Subscribe(queue="q", consumer="c1", node="B")).reply
    assert _error_code(reply) is ErrorCode.CONSUMER_EXISTS


# ----------------------------------------------------------------- ordering keys


def test_key_with_unacked_messages_goes_only_to_its_holder(d: Driver) -> None:
    d(Subscribe(queue="q", consumer="c1", node="A"))
    d(Subscribe(queue="q", consumer="c2", node="B"))
    got = []
    for i in range(4):
        got += deliveries(d(Enqueue(queue="q", body=b"%d" % i, key="k")))
    assert got == [("c1", 0), ("c1", 1), ("c1", 2), ("c1", 3)]


def test_slow_key_does_not_block_other_keys(d: Driver) -> None:
    d(Subscribe(queue="q", consumer="slow", node="A", prefetch=1))
    d(Subscribe(queue="q", consumer="fast", node="B", prefetch=1))
    d(Enqueue(queue="q", body=b"r0", key="red"))  # -> slow
    d(Enqueue(queue="q", body=b"r1", key="red"))  # red is held by slow: waits
    applied = d(Enqueue(queue="q", body=b"b0", key="blue"))
    assert deliveries(applied) == [("fast", 2)]
    assert d.machine.ready("q") == (1,)
    d(Ack(queue="q", consumer="fast", offsets=[2]))
    assert d.machine.ready("q") == (1,)  # fast may not take red while slow holds it
    # once slow holds nothing of red, red is free and goes round-robin (fast is first)
    assert deliveries(d(Ack(queue="q", consumer="slow", offsets=[0]))) == [("fast", 1)]


def test_returning_a_keyed_message_returns_later_messages_of_that_key(d: Driver) -> None:
    d(Subscribe(queue="q", consumer="c1", node="A"))
    publish(d, 3, key="k")
    d(Enqueue(queue="q", body=b"other", key="j"))
    applied = d(Nack(queue="q", consumer="c1", offsets=[1]))
    assert deliveries(applied) == [("c1", 1), ("c1", 2)]
    assert d.machine.unacked("q", "c1") == (0, 1, 2, 3)


def test_collateral_returns_do_not_count_as_failed_deliveries(d: Driver) -> None:
    d(Subscribe(queue="q", consumer="c1", node="A"))
    publish(d, 2, key="k")
    again = delivered(d(Nack(queue="q", consumer="c1", offsets=[0])))
    assert [(e.offset, e.redelivered, e.delivery_count) for e in again] == [
        (0, True, 1),
        (1, True, 0),
    ]


def test_key_becomes_free_after_all_its_messages_are_acked(d: Driver) -> None:
    d(Subscribe(queue="q", consumer="c1", node="A", prefetch=1))
    d(Subscribe(queue="q", consumer="c2", node="B"))
    publish(d, 1, key="k")  # -> c1
    d(Enqueue(queue="q", body=b"x"))  # -> c2
    d(Enqueue(queue="q", body=b"k1", key="k"))  # k held by c1, which has no credit
    assert d.machine.ready("q") == (2,)
    applied = d(Ack(queue="q", consumer="c1", offsets=[0]))
    assert deliveries(applied) == [("c2", 2)]  # k is free: the head of the SQ takes it


def test_down_returns_keyed_messages_and_key_moves_to_next_consumer_in_order(d: Driver) -> None:
    d(Subscribe(queue="q", consumer="c1", node="A"))
    publish(d, 3, key="k")
    d(Subscribe(queue="q", consumer="c2", node="B"))
    assert deliveries(d(Down(consumer="c1"))) == [("c2", 0), ("c2", 1), ("c2", 2)]


def test_keyed_and_unkeyed_messages_are_offered_in_offset_order(d: Driver) -> None:
    d(Enqueue(queue="q", body=b"a", key="k"))
    d(Enqueue(queue="q", body=b"b"))
    d(Enqueue(queue="q", body=b"c", key="j"))
    d(Enqueue(queue="q", body=b"d"))
    applied = d(Subscribe(queue="q", consumer="c1", node="A"))
    assert [off for _, off in deliveries(applied)] == [0, 1, 2, 3]


# ------------------------------------------------------ single active consumer


@pytest.fixture
def sac() -> Driver:
    drive = Driver()
    drive(Declare(queue="q", options=QueueOptions(single_active_consumer=True)))
    return drive


def test_single_active_consumer_only_oldest_receives(sac: Driver) -> None:
    sac(Subscribe(queue="q", consumer="c1", node="A"))
    sac(Subscribe(queue="q", consumer="c2", node="B"))
    got = []
    for i in range(3):
        got += deliveries(sac(Enqueue(queue="q", body=b"%d" % i)))
    assert got == [("c1", 0), ("c1", 1), ("c1", 2)]
    assert sac.machine.service_queue("q") == ("c1",)


def test_single_active_consumer_fails_over_with_returned_messages_first(sac: Driver) -> None:
    sac(Subscribe(queue="q", consumer="c1", node="A", prefetch=2))
    sac(Subscribe(queue="q", consumer="c2", node="B", prefetch=2))
    publish(sac, 4)
    sac(Ack(queue="q", consumer="c1", offsets=[0]))  # c1 now holds 1, 2
    applied = sac(Down(consumer="c1"))
    assert [(e.consumer, e.offset, e.redelivered) for e in delivered(applied)] == [
        ("c2", 1, True),
        ("c2", 2, True),
    ]
    sac(Ack(queue="q", consumer="c2", offsets=[1, 2]))
    assert sac.machine.unacked("q", "c2") == (3,)


def test_single_active_consumer_cancel_hands_over(sac: Driver) -> None:
    sac(Subscribe(queue="q", consumer="c1", node="A"))
    sac(Subscribe(queue="q", consumer="c2", node="B"))
    sac(Cancel(queue="q", consumer="c1"))
    assert deliveries(sac(Enqueue(queue="q", body=b"x"))) == [("c2", 0)]


# -------------------------------------------------------------------- overflow


def test_max_length_drop_head_drops_oldest_ready(d: Driver) -> None:
    d(Declare(queue="small", options=QueueOptions(max_length=2)))
    publish(d, 2, queue="small")
    applied = d(Enqueue(queue="small", body=b"new"))
    assert applied.effects == (Dropped(queue="small", offset=0, reason="max_length"),)
    assert d.machine.ready("small") == (1, 2)


def test_max_length_counts_only_ready_messages(d: Driver) -> None:
    d(Declare(queue="small", options=QueueOptions(max_length=1, overflow="reject-publish")))
    d(Subscribe(queue="small", consumer="c1", node="A", prefetch=2))
    publish(d, 3, queue="small")  # two held, one ready
    assert d.machine.stats("small").unacked == 2


def test_max_length_reject_publish_refuses_with_clear_reply(d: Driver) -> None:
    d(Declare(queue="small", options=QueueOptions(max_length=1, overflow="reject-publish")))
    publish(d, 1, queue="small")
    reply = d(Enqueue(queue="small", body=b"x")).reply
    assert _error_code(reply) is ErrorCode.QUEUE_FULL
    assert "max_length 1" in reply.message  # type: ignore[union-attr]
    assert d.machine.ready("small") == (0,)


def test_reject_publish_refuses_whole_batch_that_does_not_fit(d: Driver) -> None:
    d(Declare(queue="small", options=QueueOptions(max_length=2, overflow="reject-publish")))
    publish(d, 1, queue="small")
    batch = EnqueueBatch(queue="small", messages=[Message(body=b"a"), Message(body=b"b")])
    assert _error_code(d(batch).reply) is ErrorCode.QUEUE_FULL
    assert d.machine.stats("small").next_offset == 1


def test_reject_publish_says_when_a_batch_can_never_fit(d: Driver) -> None:
    """A batch longer than max_length is refused with its own code even from an empty
    queue: "full for now" would have a client resend it for ever (the simulator's
    reject-publish runs with max_length 3 and batches of 5 never drained)."""
    d(Declare(queue="small", options=QueueOptions(max_length=2, overflow="reject-publish")))
    batch = EnqueueBatch(queue="small", messages=[Message(body=b"%d" % i) for i in range(3)])
    reply = d(batch).reply
    assert _error_code(reply) is ErrorCode.OVER_MAX_LENGTH
    assert "never fit" in reply.message  # type: ignore[union-attr]
    two = EnqueueBatch(queue="small", messages=[Message(body=b"a"), Message(body=b"b")])
    assert d(two).reply == Enqueued(offset=0, count=2)


def test_drop_head_with_keys_drops_the_oldest_ready_of_any_key(d: Driver) -> None:
    d(Declare(queue="small", options=QueueOptions(max_length=2)))
    d(Subscribe(queue="small", consumer="c1", node="A", prefetch=1))
    d(Enqueue(queue="small", body=b"a0", key="a"))  # held by c1
    d(Enqueue(queue="small", body=b"a1", key="a"))  # ready, owned by c1
    d(Enqueue(queue="small", body=b"b0", key="b"))
    applied = d(Enqueue(queue="small", body=b"c0", key="c"))
    assert applied.effects == (Dropped(queue="small", offset=1, reason="max_length"),)
    assert d.machine.ready("small") == (2, 3)


# --------------------------------------------------------- idempotent producers


def _enq(d: Driver, seq: int, body: bytes = b"x") -> object:
    return d(Enqueue(queue="q", body=body, producer="p", seq=seq)).reply


def test_producer_retry_is_answered_with_original_offset(d: Driver) -> None:
    publish(d, 2)
    assert _enq(d, 0) == Enqueued(offset=2)
    assert _enq(d, 1) == Enqueued(offset=3)
    assert _enq(d, 0) == Enqueued(offset=2, duplicate=True)
    assert d.machine.stats("q").next_offset == 4


def test_producer_seq_gap_is_refused_with_expected_seq(d: Driver) -> None:
    _enq(d, 0)
    reply = _enq(d, 2)
    assert _error_code(reply) is ErrorCode.OUT_OF_ORDER
    assert reply.expected_seq == 1  # type: ignore[union-attr]
    assert d.machine.stats("q").next_offset == 1


def test_a_new_producer_starts_at_seq_0_so_its_first_batch_cannot_be_overtaken(
    d: Driver,
) -> None:
    """Simulator seed 215: a producer's second batch reached the log before its first
    (the first went through a leader that died); the queue took the second as the
    producer's start, then called the first a duplicate: confirmed, never enqueued."""
    overtaking = EnqueueBatch(
        queue="q", messages=[Message(body=b"c"), Message(body=b"d")], producer="p", first_seq=2
    )
    refused = d(overtaking).reply
    assert _error_code(refused) is ErrorCode.OUT_OF_ORDER
    assert refused.expected_seq == 0  # type: ignore[union-attr]
    first = EnqueueBatch(
        queue="q", messages=[Message(body=b"a"), Message(body=b"b")], producer="p", first_seq=0
    )
    assert d(first).reply == Enqueued(offset=0, count=2)
    assert d(overtaking).reply == Enqueued(offset=2, count=2)


def test_producer_batch_retry_is_a_duplicate_not_a_second_batch(d: Driver) -> None:
    batch = EnqueueBatch(
        queue="q", messages=[Message(body=b"a"), Message(body=b"b")], producer="p", first_seq=0
    )
    assert d(batch).reply == Enqueued(offset=0, count=2)
    assert d(batch).reply == Enqueued(offset=0, count=2, duplicate=True)
    assert _enq(d, 1) == Enqueued(offset=1, duplicate=True)
    assert _enq(d, 2) == Enqueued(offset=2)


def test_producer_batch_overlapping_last_seq_is_refused(d: Driver) -> None:
    _enq(d, 0)
    batch = EnqueueBatch(
        queue="q", messages=[Message(body=b"a"), Message(body=b"b")], producer="p", first_seq=0
    )
    reply = d(batch).reply
    assert _error_code(reply) is ErrorCode.OUT_OF_ORDER
    assert reply.expected_seq == 1  # type: ignore[union-attr]


def test_producer_needs_both_id_and_seq(d: Driver) -> None:
    reply = d(Enqueue(queue="q", body=b"x", producer="p")).reply
    assert _error_code(reply) is ErrorCode.INVALID


def test_rejected_publish_does_not_consume_the_seq(d: Driver) -> None:
    d(Declare(queue="small", options=QueueOptions(max_length=1, overflow="reject-publish")))
    publish(d, 1, queue="small")
    reply = d(Enqueue(queue="small", body=b"x", producer="p", seq=0)).reply
    assert _error_code(reply) is ErrorCode.QUEUE_FULL
    d(Subscribe(queue="small", consumer="c", node="A"))  # takes the ready one
    assert d(Enqueue(queue="small", body=b"x", producer="p", seq=0)).reply == Enqueued(offset=1)


def test_producer_retry_older_than_window_is_still_a_duplicate(d: Driver) -> None:
    from quorumq.machine.queue import DEDUP_WINDOW

    d(Subscribe(queue="q", consumer="c", node="A"))
    for seq in range(DEDUP_WINDOW + 10):
        other = d(Enqueue(queue="q", body=b"o")).reply  # interleaved: no run merging
        assert isinstance(other, Enqueued)
        _enq(d, seq)
    assert _enq(d, 0) == Enqueued(offset=None, duplicate=True)
    assert _enq(d, DEDUP_WINDOW) == Enqueued(offset=2 * DEDUP_WINDOW + 1, duplicate=True)


def test_producers_are_tracked_per_queue(d: Driver) -> None:
    d(Declare(queue="other"))
    _enq(d, 0)
    assert d(Enqueue(queue="other", body=b"x", producer="p", seq=0)).reply == Enqueued(offset=0)


def test_silent_producer_is_forgotten_after_expiry(d: Driver) -> None:
    from quorumq.machine.machine import PRODUCER_EXPIRY_MS

    _enq(d, 0)
    d(Tick(), ts_ms=PRODUCER_EXPIRY_MS + 1)
    assert d.machine.producers("q") == ()
    refused = _enq(d, 9)  # a forgotten producer starts again at 0, as a new one
    assert _error_code(refused) is ErrorCode.OUT_OF_ORDER
    assert _enq(d, 0) == Enqueued(offset=1)


def _enq_as(d: Driver, producer: str, seq: int) -> object:
    return d(Enqueue(queue="q", body=b"x", producer=producer, seq=seq)).reply


def test_forgotten_producer_starts_afresh_so_its_old_seq_is_accepted_as_new(d: Driver) -> None:
    assert _enq_as(d, "spark-q-9-0", 0) == Enqueued(offset=0)
    assert d(ForgetProducers(queue="q", prefix="spark-q-9-")).reply == Forgotten(count=1)
    # the documented trade-off: only forget a producer that will never resend
    assert _enq_as(d, "spark-q-9-0", 0) == Enqueued(offset=1)
    assert d.machine.ready("q") == (0, 1)


def test_forgetting_producers_leaves_those_of_other_prefixes_alone(d: Driver) -> None:
    for producer in ("spark-q-9-0", "spark-q-9-1", "spark-q-10-0", "spark-q-99-0", "other"):
        _enq_as(d, producer, 0)
    assert d(ForgetProducers(queue="q", prefix="spark-q-9-")).reply == Forgotten(count=2)
    assert d.machine.producers("q") == ("other", "spark-q-10-0", "spark-q-99-0")
    assert d.machine.stats("q").producers == 3
    assert _enq_as(d, "spark-q-10-0", 0) == Enqueued(offset=2, duplicate=True)


def test_forgetting_producers_is_per_queue(d: Driver) -> None:
    d(Declare(queue="other"))
    _enq_as(d, "p", 0)
    d(Enqueue(queue="other", body=b"x", producer="p", seq=0))
    assert d(ForgetProducers(queue="other", prefix="p")).reply == Forgotten(count=1)
    assert d.machine.producers("q") == ("p",)
    assert d.machine.producers("other") == ()


def test_forgetting_producers_that_are_not_there_forgets_none(d: Driver) -> None:
    _enq_as(d, "p", 0)
    assert d(ForgetProducers(queue="q", prefix="nobody")).reply == Forgotten(count=0)
    assert d.machine.producers("q") == ("p",)


def test_forgetting_producers_with_an_empty_prefix_is_refused(d: Driver) -> None:
    _enq_as(d, "p", 0)
    reply = d(ForgetProducers(queue="q", prefix="")).reply
    assert _error_code(reply) is ErrorCode.INVALID
    assert d.machine.producers("q") == ("p",)


def test_forgetting_producers_of_an_unknown_queue_is_refused(d: Driver) -> None:
    reply = d(ForgetProducers(queue="nope", prefix="p")).reply
    assert _error_code(reply) is ErrorCode.UNKNOWN_QUEUE


def test_a_sealed_prefix_refuses_new_producers_so_a_late_attempt_writes_nothing(
    d: Driver,
) -> None:
    """The Spark sink seals a committed job's prefix: a late attempt of one of its tasks
    (a speculative copy, a zombie) opened its forgotten producer anew and wrote its rows
    a second time. Now it is refused; other prefixes, and a longer job id sharing the
    start (the closing dash), are not."""
    assert _enq_as(d, "spark-write-j1-0", 0) == Enqueued(offset=0)
    forget = ForgetProducers(queue="q", prefix="spark-write-j1-", seal=True)
    assert d(forget).reply == Forgotten(count=1)
    assert _error_code(_enq_as(d, "spark-write-j1-0", 0)) is ErrorCode.PRODUCER_SEALED
    assert _error_code(_enq_as(d, "spark-write-j1-7", 0)) is ErrorCode.PRODUCER_SEALED
    assert _enq_as(d, "spark-write-j10-0", 0) == Enqueued(offset=1)
    assert _enq_as(d, "spark-write-j2-0", 0) == Enqueued(offset=2)
    assert d.machine.ready("q") == (0, 1, 2)
    # without `seal`, forgetting opens the prefix again as before
    assert d(ForgetProducers(queue="q", prefix="spark-write-j2-")).reply == Forgotten(count=1)
    assert _enq_as(d, "spark-write-j2-0", 0) == Enqueued(offset=3)


def test_a_seal_lasts_as_long_as_a_producer_is_remembered_and_at_most_so_many_are_kept(
    d: Driver,
) -> None:
    from quorumq.machine.machine import MAX_SEALED, PRODUCER_EXPIRY_MS

    """A seal lives `PRODUCER_EXPIRY_MS` (a producer silent that long is forgotten
    anyway), and a queue keeps its newest `MAX_SEALED`: memory stays bounded however many
    jobs commit."""
    d(ForgetProducers(queue="q", prefix="job-a-", seal=True), ts_ms=1_000)
    d(Tick(), ts_ms=1_000 + PRODUCER_EXPIRY_MS - 1)
    assert _error_code(_enq_as(d, "job-a-0", 0)) is ErrorCode.PRODUCER_SEALED
    d(Tick(), ts_ms=1_000 + PRODUCER_EXPIRY_MS)
    assert isinstance(_enq_as(d, "job-a-0", 0), Enqueued)
    for i in range(MAX_SEALED + 5):
        d(ForgetProducers(queue="q", prefix=f"job-{i}-", seal=True))
    assert len(d.machine._queues["q"].sealed) == MAX_SEALED
    assert isinstance(_enq_as(d, "job-0-0", 0), Enqueued)  # the oldest went
    assert _error_code(_enq_as(d, f"job-{MAX_SEALED + 4}-0", 0)) is ErrorCode.PRODUCER_SEALED


def test_a_sealed_prefix_must_end_with_a_dash_and_be_short(d: Driver) -> None:
    """A seal is looked up at the dashes of a new producer's id (no scan of every seal
    per publish), so it must end with one, within `MAX_SEALED_PREFIX` characters: a
    publish under an id of 300,000 dashes took 10.7 s on every replica, the lookup
    quadratic in the id's length. A refused seal forgets nothing."""
    from quorumq.machine.machine import MAX_SEALED_PREFIX

    _enq_as(d, "job-1", 0)
    reply = d(ForgetProducers(queue="q", prefix="job-1", seal=True)).reply
    assert _error_code(reply) is ErrorCode.INVALID
    long_prefix = "-" * (MAX_SEALED_PREFIX + 1)
    reply = d(ForgetProducers(queue="q", prefix=long_prefix, seal=True)).reply
    assert _error_code(reply) is ErrorCode.INVALID
    assert d.machine.producers("q") == ("job-1",)
    d(ForgetProducers(queue="q", prefix="--", seal=True))
    assert _error_code(_enq_as(d, "-" * 300_000, 0)) is ErrorCode.PRODUCER_SEALED
    assert isinstance(_enq_as(d, "x" + "-" * 300_000, 0), Enqueued)  # cut at 128: quick


def test_seals_survive_a_snapshot_and_a_queue_without_any_encodes_as_before(d: Driver) -> None:
    """Seals are part of the state (snapshot, digest); a queue with none encodes byte for
    byte as before seals existed, so older nodes read the snapshots of newer ones."""

    def queue_fields() -> int:
        (queue,) = encoding.decode(d.machine.snapshot())[5]
        return len(queue)

    d(ForgetProducers(queue="q", prefix="spark-write-j0-"))  # forgets, seals nothing
    assert queue_fields() == 15  # as version 4 wrote a queue
    assert encoding.decode(d.machine.snapshot())[1] == 4
    d(ForgetProducers(queue="q", prefix="spark-write-j1-", seal=True))
    assert queue_fields() == 16
    # a version an older node refuses: restoring it, that node dropped the seals and
    # took producers the others refuse (a review found the replicas then diverge)
    assert encoding.decode(d.machine.snapshot())[1] == 6
    restored = Machine.restore(d.machine.snapshot())
    assert restored.digest() == d.machine.digest()
    replay = Driver(restored)
    assert _error_code(_enq_as(replay, "spark-write-j1-0", 0)) is ErrorCode.PRODUCER_SEALED
    assert isinstance(_enq_as(replay, "spark-write-j0-0", 0), Enqueued)


def test_forgotten_producers_stay_forgotten_in_snapshot_and_digest(d: Driver) -> None:
    _enq_as(d, "a-1", 0)
    _enq_as(d, "b-1", 0)
    before = Machine.restore(d.machine.snapshot())
    d(ForgetProducers(queue="q", prefix="a-"))
    restored = Machine.restore(d.machine.snapshot())
    assert restored.producers("q") == ("b-1",)
    assert restored.digest() == d.machine.digest()
    # the same state with the producer still remembered digests differently
    replay = Driver(before)
    replay(Tick())
    assert replay.machine.last_index == d.machine.last_index
    assert replay.machine.digest() != d.machine.digest()


# ----------------------------------------------------------------------- batches


def test_batch_lands_with_consecutive_offsets_in_one_apply(d: Driver) -> None:
    d(Subscribe(queue="q", consumer="c1", node="A"))
    batch = EnqueueBatch(queue="q", messages=[Message(body=b"%d" % i, key="k") for i in range(5)])
    applied = d(batch)
    assert applied.reply == Enqueued(offset=0, count=5)
    assert deliveries(applied) == [("c1", i) for i in range(5)]


def test_empty_batch_is_refused(d: Driver) -> None:
    assert _error_code(d(EnqueueBatch(queue="q", messages=[])).reply) is ErrorCode.INVALID


# --------------------------------------------------------------------- retention


def test_retention_messages_trims_stream_view_from_front(d: Driver) -> None:
    d(Declare(queue="s", options=QueueOptions(retention_messages=3)))
    d(Subscribe(queue="s", consumer="c", node="A"))
    for i in range(5):
        d(Enqueue(queue="s", body=b"%d" % i))
    assert [m.offset for m in d.machine.read("s", 0, 100)] == [2, 3, 4]
    assert d.machine.stats("s").first_retained == 2


def test_retention_bytes_trims_stream_view_from_front(d: Driver) -> None:
    each = 4 + MESSAGE_OVERHEAD
    d(Declare(queue="s", options=QueueOptions(retention_bytes=2 * each + 3)))
    for _ in range(4):
        d(Enqueue(queue="s", body=b"1234"))
    assert [m.offset for m in d.machine.read("s", 0, 100)] == [2, 3]


def test_retention_bytes_counts_keys_headers_and_overhead_not_only_bodies(d: Driver) -> None:
    """With retention_bytes=1024, 20 messages with big headers were kept (the snapshot
    was 40 MiB): only bodies were counted."""
    d(Declare(queue="s", options=QueueOptions(retention_bytes=1024)))
    for _ in range(20):
        d(Enqueue(queue="s", body=b"x", key="k" * 100, headers={"h": "v" * 300}))
    kept = d.machine.read("s", 0, 100)
    assert [m.offset for m in kept] == [19]  # 1 + 100 + 1 + 300 + 96 + 128 = 626 bytes each
    restored = Machine.restore(d.machine.snapshot())  # counted again on restore
    assert restored.digest() == d.machine.digest()


def test_retention_counts_text_in_utf8_bytes_and_an_overhead_per_header(d: Driver) -> None:
    """Keys and headers counted in characters (non-ASCII text up to 4x more bytes), and
    no cost per header (60,000 tiny headers counted 300 KB and took 5.2 MB)."""
    small = message_cost(b"", None, {"a": "b"})
    assert small == 2 + HEADER_OVERHEAD + MESSAGE_OVERHEAD
    assert message_cost(b"", "\U0001f600" * 10, None) == 40 + MESSAGE_OVERHEAD
    d(Declare(queue="s", options=QueueOptions(retention_bytes=3 * small)))
    for _ in range(5):
        d(Enqueue(queue="s", body=b"", headers={"a": "b"}))
    assert [m.offset for m in d.machine.read("s", 0, 100)] == [2, 3, 4]


def test_a_message_with_too_many_headers_is_refused() -> None:
    with pytest.raises(ValueError, match="at most 256 headers"):
        Enqueue(queue="q", body=b"", headers={str(i): "" for i in range(257)})


def test_retention_never_removes_ready_or_unacked_messages(d: Driver) -> None:
    d(Declare(queue="s", options=QueueOptions(retention_messages=0)))
    for i in range(3):
        d(Enqueue(queue="s", body=b"%d" % i))
    assert d.machine.read("s", 0, 100) == ()
    applied = d(Subscribe(queue="s", consumer="c", node="A", prefetch=2))
    assert [e.body for e in delivered(applied)] == [b"0", b"1"]
    applied = d(Down(consumer="c"))
    d(Subscribe(queue="s", consumer="c2", node="A"))
    assert d.machine.unacked("s", "c2") == (0, 1, 2)


def test_long_streams_compact_and_stay_readable(d: Driver) -> None:
    d(Declare(queue="s", options=QueueOptions(retention_messages=10)))
    for i in range(5000):
        d(Enqueue(queue="s", body=b"%d" % i))
    tail = [m.body for m in d.machine.read("s", 4990, 6000)]
    assert tail == [b"%d" % i for i in range(4990, 5000)]
    restored = Machine.restore(d.machine.snapshot())
    assert restored.read("s", 0, 6000) == d.machine.read("s", 0, 6000)


def test_read_filters_by_key_bucket(d: Driver) -> None:
    keys = ["a", "b", "c", None, "a", None]
    for i, key in enumerate(keys):
        d(Enqueue(queue="q", body=b"%d" % i, key=key))
    buckets = [d.machine.read("q", 0, 6, bucket=b, buckets=3) for b in range(3)]
    assert sorted(m.offset for part in buckets for m in part) == list(range(6))
    for part in buckets:
        assert [m.offset for m in part] == sorted(m.offset for m in part)
        assert len({m.key for m in part if m.key is not None}) == len(
            [k for k in {m.key for m in part} if k is not None]
        )
    a_bucket = [b for b, part in enumerate(buckets) if any(m.key == "a" for m in part)]
    assert len(a_bucket) == 1
    with pytest.raises(ValueError, match="together"):
        d.machine.read("q", 0, 6, bucket=1)


# --------------------------------------------------------------------------- TTL


@pytest.fixture
def ttl() -> Driver:
    drive = Driver()
    drive(Declare(queue="dlq"))
    drive(Declare(queue="q", options=QueueOptions(message_ttl_ms=100, dead_letter_queue="dlq")))
    return drive


def test_ready_message_expires_after_ttl_and_dead_letters(ttl: Driver) -> None:
    ttl(Enqueue(queue="q", body=b"old"), ts_ms=1000)
    applied = ttl(Tick(), ts_ms=1100)
    assert applied.effects == (
        DeadLettered(queue="q", offset=0, reason="expired", target_queue="dlq", target_offset=0),
    )


def test_message_younger_than_ttl_stays(ttl: Driver) -> None:
    ttl(Enqueue(queue="q", body=b"young"), ts_ms=1000)
    assert ttl(Tick(), ts_ms=1099).effects == ()
    assert ttl.machine.ready("q") == (0,)


def test_expired_message_is_not_delivered(ttl: Driver) -> None:
    ttl(Enqueue(queue="q", body=b"old"), ts_ms=1000)
    ttl(Enqueue(queue="q", body=b"new"), ts_ms=1150)
    applied = ttl(Subscribe(queue="q", consumer="c", node="A"))
    assert deliveries(applied) == [("c", 1)]


def test_unacked_message_does_not_expire(ttl: Driver) -> None:
    ttl(Subscribe(queue="q", consumer="c", node="A"))
    ttl(Enqueue(queue="q", body=b"x"), ts_ms=1000)
    assert ttl(Tick(), ts_ms=5000).effects == ()
    assert ttl.machine.unacked("q", "c") == (0,)


def test_tick_expires_returned_messages(ttl: Driver) -> None:
    ttl(Subscribe(queue="q", consumer="c", node="A"))
    ttl(Enqueue(queue="q", body=b"x"), ts_ms=1000)
    ttl(Tick(), ts_ms=1050)
    ttl(Cancel(queue="q", consumer="c"))
    ttl(Subscribe(queue="q", consumer="c2", node="A", prefetch=1))
    ttl(Down(consumer="c"))  # returned to c2 right away
    ttl(Cancel(queue="q", consumer="c2"))
    ttl(Down(consumer="c2"))  # returned, nobody to take it
    applied = ttl(Tick(), ts_ms=1200)
    assert [e.reason for e in applied.effects if isinstance(e, DeadLettered)] == ["expired"]
    assert ttl.machine.ready("q") == ()


# -------------------------------------------------------------- time and index


def test_time_never_runs_back(d: Driver) -> None:
    d(Enqueue(queue="q", body=b"a"), ts_ms=500)
    d(Enqueue(queue="q", body=b"b"), ts_ms=100)
    assert [m.ts_ms for m in d.machine.read("q", 0, 2)] == [500, 500]
    assert d.machine.now_ms == 500


def test_stale_index_is_refused(d: Driver) -> None:
    applied = d.machine.apply(Meta(d.index, 0), Enqueue(queue="q", body=b"again"))
    assert _error_code(applied.reply) is ErrorCode.STALE_INDEX
    assert d.machine.ready("q") == ()


# ---------------------------------------------------------------- commit offset


def test_commit_offset_is_kept_per_group(d: Driver) -> None:
    publish(d, 3)
    d(CommitOffset(queue="q", group="spark-1", offset=2))
    d(CommitOffset(queue="q", group="spark-2", offset=3))
    assert d.machine.committed_offsets("q") == {"spark-1": 2, "spark-2": 3}
    assert d.machine.committed_offset("q", "nobody") is None


def test_commit_offset_past_end_is_refused(d: Driver) -> None:
    reply = d(CommitOffset(queue="q", group="g", offset=1)).reply
    assert _error_code(reply) is ErrorCode.INVALID


def test_consumers_on_a_node_are_listed_across_queues_until_they_are_down() -> None:
    d = Driver()
    d(Declare(queue="q"))
    d(Declare(queue="r"))
    d(Subscribe(queue="q", consumer="a1", node="A"))
    d(Subscribe(queue="r", consumer="a2", node="A"))
    d(Subscribe(queue="q", consumer="b1", node="B"))
    assert set(d.machine.consumers_on("A")) == {"a1", "a2"}
    assert d.machine.consumers_on("B") == ("b1",)
    d(Down(consumer="a1"))
    assert d.machine.consumers_on("A") == ("a2",)
    assert d.machine.consumers_on("C") == ()


def test_a_cancelled_single_active_consumer_hands_over_only_once_it_holds_nothing() -> None:
    """DESIGN rule 5: strict FIFO including redeliveries. The next consumer took over at
    the cancel and got later messages while the first one's were out; when those came
    back they came after the later ones."""
    d = Driver()
    d(Declare(queue="q", options=QueueOptions(single_active_consumer=True)))
    d(Subscribe(queue="q", consumer="first", node="A", prefetch=2))
    d(Subscribe(queue="q", consumer="next", node="A", prefetch=10))
    for body in (b"m0", b"m1", b"m2", b"m3"):
        d(Enqueue(queue="q", body=body))
    assert d.machine.unacked("q", "first") == (0, 1)
    assert deliveries(d(Cancel(queue="q", consumer="first"))) == []  # not yet: 0, 1 are out
    assert deliveries(d(Ack(queue="q", consumer="first", offsets=[0]))) == []  # 1 still out
    returned = d(Nack(queue="q", consumer="first", offsets=[1], requeue=True))
    assert deliveries(returned) == [("next", 1), ("next", 2), ("next", 3)]  # 1 first


def test_a_dead_letter_cycle_without_a_rejection_drops_the_message() -> None:
    """A -> B -> A with a TTL on both bounced a message for ever, a new offset each time."""
    d = Driver()
    ttl = {"message_ttl_ms": 10}
    d(Declare(queue="a", options=QueueOptions(dead_letter_queue="b", **ttl)))
    d(Declare(queue="b", options=QueueOptions(dead_letter_queue="a", **ttl)))
    d(Enqueue(queue="a", body=b"m"), ts_ms=0)
    moved = d(Tick(), ts_ms=100)  # a -> b
    assert [type(e).__name__ for e in moved.effects] == ["DeadLettered"]
    (in_b,) = d.machine.read("b", 0, 10)
    assert in_b.headers is not None and in_b.headers["x-death-hops"] == "1"
    cycle = d(Tick(), ts_ms=200)  # b -> a would close the cycle: dropped
    assert [(type(e).__name__, getattr(e, "reason", None)) for e in cycle.effects] == [
        ("Dropped", "dead_letter_cycle")
    ]
    assert d(Tick(), ts_ms=300).effects == ()
    assert d.machine.stats("a").next_offset == 1 and d.machine.stats("b").next_offset == 1


def test_a_rejection_by_a_consumer_restarts_the_dead_letter_path() -> None:
    d = Driver()
    d(Declare(queue="a", options=QueueOptions(dead_letter_queue="b")))
    d(Declare(queue="b", options=QueueOptions(dead_letter_queue="a")))
    d(Subscribe(queue="a", consumer="ca", node="A", prefetch=1))
    d(Subscribe(queue="b", consumer="cb", node="A", prefetch=1))
    d(Enqueue(queue="a", body=b"m"))
    for queue, consumer in [("a", "ca"), ("b", "cb"), ("a", "ca")]:  # rejected each time
        (held,) = d.machine.unacked(queue, consumer)
        applied = d(Nack(queue=queue, consumer=consumer, offsets=[held], requeue=False))
        assert any(type(e).__name__ == "DeadLettered" for e in applied.effects), queue


def test_a_consumer_holding_a_delivery_past_its_timeout_is_cancelled_and_returns_it() -> None:
    """A consumer alive but stuck (a SIGSTOPped client still answers keepalives) kept its
    messages for good. The machine decides from log time, on a Tick."""
    d = Driver()
    d(Declare(queue="q", options=QueueOptions(consumer_timeout_ms=60_000)))
    d(Subscribe(queue="q", consumer="stuck", node="A", prefetch=5), ts_ms=0)
    d(Subscribe(queue="q", consumer="quick", node="B", prefetch=5, timeout_ms=10**9), ts_ms=0)
    d(Enqueue(queue="q", body=b"m0"), ts_ms=1_000)  # to stuck
    d(Enqueue(queue="q", body=b"m1"), ts_ms=1_000)  # to quick
    assert d(Tick(), ts_ms=61_000).effects == ()  # 60 s: not past it yet
    timed_out = d(Tick(), ts_ms=61_001)
    down = [e for e in timed_out.effects if isinstance(e, ConsumerDown)]
    assert [(e.consumer, e.reason) for e in down] == [("stuck", "consumer_timeout")]
    assert deliveries(timed_out) == [("quick", 0)]  # m0 back, redelivered to the live one
    assert d.machine.consumers("q") == ("quick",)
    assert d(Tick(), ts_ms=10**8).effects == ()  # its own timeout is longer than the queue's


def test_the_default_consumer_timeout_is_thirty_minutes() -> None:
    d = Driver()
    d(Declare(queue="q"))
    d(Subscribe(queue="q", consumer="c", node="A", prefetch=1), ts_ms=0)
    d(Enqueue(queue="q", body=b"m"), ts_ms=0)
    assert d.machine.needs_tick()  # a delivery is out: time must move
    assert d(Tick(), ts_ms=30 * 60 * 1000).effects == ()
    assert [type(e).__name__ for e in d(Tick(), ts_ms=30 * 60 * 1000 + 1).effects] == [
        "ConsumerDown"
    ]


# ------------------------------------------------ batches that number their messages


def test_a_batch_numbered_by_its_caller_lands_only_what_is_above_the_producers_last(
    d: Driver,
) -> None:
    """A Spark task numbers its rows by their source offsets: a retry that reads fewer
    rows (retention trimmed the first ones meanwhile), or cuts its batches elsewhere,
    still numbers each row as before. Numbered by row count, the retry's rows took the
    numbers of other rows: retained rows were taken for duplicates and lost."""
    d(Declare(queue="q"))

    def batch(*seqs: int, opens: bool = False) -> EnqueueBatch:
        messages = [Message(body=b"row %d" % s) for s in seqs]
        return EnqueueBatch(
            queue="q", messages=messages, producer="spark-q-7-0", seqs=seqs, opens=opens
        )

    assert d(batch(10, 12, 15, opens=True)).reply == Enqueued(offset=0, count=3)
    assert d(batch(12, 15, 17, 20)).reply == Enqueued(offset=3, count=2)  # the retry
    assert d(batch(15, 17)).reply == Enqueued(offset=None, count=0, duplicate=True)
    bodies = [m.body for m in d.machine.read("q", 0, 100)]
    assert bodies == [b"row 10", b"row 12", b"row 15", b"row 17", b"row 20"]


def test_a_producer_numbering_its_own_starts_only_with_the_batch_that_opens_it(
    d: Driver,
) -> None:
    """Numbered batches had no "first seq must be 0" rule: once the queue forgot a Spark
    task's producer (its batch committed, or evicted), a zombie attempt's later batch,
    resent, was taken for a new producer and landed a second time (review D)."""
    d(Declare(queue="q"))

    def batch(*seqs: int, opens: bool = False) -> EnqueueBatch:
        messages = [Message(body=b"row %d" % s) for s in seqs]
        return EnqueueBatch(
            queue="q", messages=messages, producer="spark-q-3-1", seqs=seqs, opens=opens
        )

    refused = d(batch(4, 5)).reply
    assert isinstance(refused, Error) and refused.code == ErrorCode.OUT_OF_ORDER
    assert d(batch(1, 2, opens=True)).reply == Enqueued(offset=0, count=2)
    assert d(batch(4, 5)).reply == Enqueued(offset=2, count=2)
    d(ForgetProducers(queue="q", prefix="spark-q-3-"))
    again = d(batch(4, 5)).reply  # the zombie's resend
    assert isinstance(again, Error) and again.code == ErrorCode.OUT_OF_ORDER
    assert len(d.machine.read("q", 0, 100)) == 4
    with pytest.raises(ValueError, match="opens goes with seqs"):
        EnqueueBatch(
            queue="q", messages=[Message(body=b"x")], producer="p", first_seq=0, opens=True
        )


def test_numbered_batches_must_number_every_message_in_increasing_order() -> None:
    message = Message(body=b"x")
    for seqs, first_seq, producer in [
        ((1, 1), None, "p"),  # not increasing
        ((2, 1), None, "p"),
        ((1,), None, "p"),  # one seq for two messages
        ((1, 2), 0, "p"),  # with first_seq
        ((1, 2), None, None),  # without a producer
    ]:
        with pytest.raises(ValueError, match="seqs"):
            EnqueueBatch(
                queue="q",
                messages=[message, message],
                producer=producer,
                first_seq=first_seq,
                seqs=seqs,
            )


def test_oldest_ready_ms_is_the_enqueue_time_of_the_oldest_message_not_held(d: Driver) -> None:
    assert d.machine.oldest_ready_ms("q") is None
    d(Enqueue(queue="q", body=b"a"), ts_ms=1_000)
    d(Enqueue(queue="q", body=b"b"), ts_ms=2_000)
    assert d.machine.oldest_ready_ms("q") == 1_000
    d(Subscribe(queue="q", consumer="c", node="A", prefetch=1))  # takes offset 0
    assert d.machine.oldest_ready_ms("q") == 2_000
    d(Nack(queue="q", consumer="c", offsets=[0], requeue=True), ts_ms=3_000)
    d(Cancel(queue="q", consumer="c"))
    # offset 0 went back to c (its key-less place comes first): still held
    assert d.machine.oldest_ready_ms("q") == 2_000
    d(Down(consumer="c"))
    assert d.machine.oldest_ready_ms("q") == 1_000  # returned: ready again, and oldest
    restored = Machine.restore(d.machine.snapshot())
    assert restored.oldest_ready_ms("q") == 1_000


# ------------------------------------------------------------ retry with backoff


def _redelivered(applied: object) -> list[tuple[str, int, int]]:
    """(consumer, offset, delivery count) of every delivery, in order."""
    return [(e.consumer, e.offset, e.delivery_count) for e in delivered(applied)]  # type: ignore[arg-type]


def test_a_nack_with_a_delay_holds_the_message_back_until_log_time_reaches_it() -> None:
    d = Driver()
    d(Declare(queue="q"))
    d(Subscribe(queue="q", consumer="c", node="A"), ts_ms=0)
    d(Enqueue(queue="q", body=b"m0"))
    assert d(Nack(queue="q", consumer="c", offsets=[0], delay_ms=1_000), ts_ms=10).effects == ()
    assert d.machine.waiting("q") == {0: 1_010}
    assert d.machine.ready("q") == (0,)  # it counts as ready: it is in the queue, nobody's
    assert d.machine.needs_tick() and d.machine.next_retry_ms() == 1_010
    assert d(Tick(), ts_ms=1_009).effects == ()
    assert _redelivered(d(Tick(), ts_ms=1_010)) == [("c", 0, 1)]
    assert d.machine.waiting("q") == {} and d.machine.next_retry_ms() is None


def test_a_waiting_message_keeps_its_place_while_later_ones_go_on() -> None:
    """Other messages are not held up by an unkeyed one waiting; once it is due it comes
    before any later ready message (rule 1)."""
    d = Driver()
    d(Declare(queue="q"))
    d(Subscribe(queue="q", consumer="c", node="A", prefetch=1), ts_ms=0)
    publish(d, 3)  # c holds 0
    applied = d(Nack(queue="q", consumer="c", offsets=[0], delay_ms=100), ts_ms=0)
    assert deliveries(applied) == [("c", 1)]  # 0 waits; the next one goes
    assert deliveries(d(Ack(queue="q", consumer="c", offsets=[1]), ts_ms=100)) == [("c", 0)]
    assert deliveries(d(Ack(queue="q", consumer="c", offsets=[0]), ts_ms=100)) == [("c", 2)]


def test_a_waiting_keyed_message_holds_its_key_back_in_order_and_other_keys_go_on() -> None:
    d = Driver()
    d(Declare(queue="q"))
    d(Subscribe(queue="q", consumer="c1", node="A"), ts_ms=0)
    for key in ("k", "k", "j"):
        d(Enqueue(queue="q", body=b"m", key=key))  # c1 holds 0 (k), 1 (k), 2 (j)
    d(Subscribe(queue="q", consumer="c2", node="B"))
    applied = d(Nack(queue="q", consumer="c1", offsets=[0], delay_ms=1_000), ts_ms=0)
    assert applied.effects == ()  # 1 came back with 0 (rule 4); key k waits, for c2 too
    assert d.machine.unacked("q", "c1") == (2,)
    assert d.machine.waiting("q") == {0: 1_000}
    later = [delivered(d(Enqueue(queue="q", body=b"m", key=key), ts_ms=10)) for key in "kx"]
    assert [[e.offset for e in got] for got in later] == [[], [4]]  # k waits; x goes on
    assert d(Tick(), ts_ms=999).effects == ()
    woken = d(Tick(), ts_ms=1_000)
    assert [(e.offset, e.key, e.redelivered) for e in delivered(woken)] == [
        (0, "k", True),
        (1, "k", True),
        (3, "k", False),
    ]
    assert len({e.consumer for e in delivered(woken)}) == 1  # the key has one holder


def test_retry_backoff_doubles_the_delay_with_each_failed_delivery_up_to_its_max() -> None:
    d = Driver()
    d(Declare(queue="q", options=QueueOptions(retry_backoff_ms=(100, 300))))
    d(Subscribe(queue="q", consumer="c", node="A"), ts_ms=0)
    d(Enqueue(queue="q", body=b"m"))
    now, waits = 0, []
    for _ in range(4):
        d(Nack(queue="q", consumer="c", offsets=[0]), ts_ms=now)
        (due,) = d.machine.waiting("q").values()
        waits.append(due - now)
        assert d(Tick(), ts_ms=due - 1).effects == ()
        now = due
        assert deliveries(d(Tick(), ts_ms=now)) == [("c", 0)]
    assert waits == [100, 200, 300, 300]


def test_a_nacks_own_delay_wins_over_the_queues_backoff_and_zero_means_at_once() -> None:
    d = Driver()
    d(Declare(queue="q", options=QueueOptions(retry_backoff_ms=(100, 300))))
    d(Subscribe(queue="q", consumer="c", node="A"), ts_ms=0)
    d(Enqueue(queue="q", body=b"m"))
    d(Nack(queue="q", consumer="c", offsets=[0], delay_ms=5_000))
    assert d.machine.waiting("q") == {0: 5_000}
    d(Tick(), ts_ms=5_000)
    assert _redelivered(d(Nack(queue="q", consumer="c", offsets=[0], delay_ms=0))) == [("c", 0, 2)]


def test_a_single_active_consumer_queue_waits_for_its_returned_message() -> None:
    """Strict FIFO, redeliveries included: nothing later is given out meanwhile."""
    d = Driver()
    d(Declare(queue="q", options=QueueOptions(single_active_consumer=True)))
    d(Subscribe(queue="q", consumer="c", node="A"), ts_ms=0)
    publish(d, 3)  # c holds 0, 1, 2
    d(Nack(queue="q", consumer="c", offsets=[1], delay_ms=500))
    d(Ack(queue="q", consumer="c", offsets=[0, 2]))
    assert deliveries(d(Enqueue(queue="q", body=b"m3"), ts_ms=100)) == []
    assert deliveries(d(Tick(), ts_ms=500)) == [("c", 1), ("c", 3)]


def test_a_consumers_messages_return_after_the_backoff_when_it_goes_down() -> None:
    d = Driver()
    d(Declare(queue="q", options=QueueOptions(retry_backoff_ms=(200, 1_000))))
    d(Subscribe(queue="q", consumer="c1", node="A", prefetch=1), ts_ms=0)
    d(Enqueue(queue="q", body=b"m"))
    d(Subscribe(queue="q", consumer="c2", node="B"))
    assert deliveries(d(Down(consumer="c1"), ts_ms=50)) == []
    assert _redelivered(d(Tick(), ts_ms=250)) == [("c2", 0, 1)]


def test_a_waiting_message_still_expires_and_still_counts_toward_max_length() -> None:
    d = Driver()
    d(Declare(queue="t", options=QueueOptions(message_ttl_ms=300)))
    d(Subscribe(queue="t", consumer="c", node="A"), ts_ms=0)
    d(Enqueue(queue="t", body=b"m"))
    d(Nack(queue="t", consumer="c", offsets=[0], delay_ms=1_000))
    expired = d(Tick(), ts_ms=300)
    assert [(e.offset, e.reason) for e in expired.effects if isinstance(e, Dropped)] == [
        (0, "expired")
    ]
    assert d.machine.waiting("t") == {} and d(Tick(), ts_ms=1_000).effects == ()

    d(Declare(queue="m", options=QueueOptions(max_length=1)))
    d(Subscribe(queue="m", consumer="c", node="A", prefetch=1))
    publish(d, 1, queue="m")
    d(Nack(queue="m", consumer="c", offsets=[0], delay_ms=1_000))
    assert deliveries(d(Enqueue(queue="m", body=b"m1"))) == [("c", 1)]
    pushed_out = d(Enqueue(queue="m", body=b"m2"))  # two ready (0 waiting, 2): one too many
    assert [(e.offset, e.reason) for e in pushed_out.effects if isinstance(e, Dropped)] == [
        (0, "max_length")
    ]
    assert d.machine.waiting("m") == {}


def test_a_snapshot_taken_while_messages_wait_restores_their_places() -> None:
    d = Driver()
    d(Declare(queue="q", options=QueueOptions(single_active_consumer=True)))
    d(Declare(queue="k"))
    for queue in ("q", "k"):
        d(Subscribe(queue=queue, consumer="c", node="A"), ts_ms=0)
    publish(d, 2)
    publish(d, 2, queue="k", key="a")
    d(Nack(queue="q", consumer="c", offsets=[0], delay_ms=100))
    d(Nack(queue="k", consumer="c", offsets=[0], delay_ms=200))
    restored = Driver(Machine.restore(d.machine.snapshot()))
    assert restored.machine.digest() == d.machine.digest()
    for ts in (50, 100, 150, 200):
        enqueue = Enqueue(queue="q", body=b"x", key=None)
        assert restored(enqueue, ts_ms=ts) == d(enqueue, ts_ms=ts)
        assert restored(Tick(), ts_ms=ts) == d(Tick(), ts_ms=ts)
    assert restored.machine.digest() == d.machine.digest()
    assert d.machine.waiting("q") == d.machine.waiting("k") == {}


def test_retry_options_are_checked_when_built() -> None:
    with pytest.raises(ValueError, match="requeue"):
        Nack(queue="q", consumer="c", offsets=[0], requeue=False, delay_ms=10)
    with pytest.raises(ValueError, match="delay_ms"):
        Nack(queue="q", consumer="c", offsets=[0], delay_ms=-1)
    with pytest.raises(ValueError, match="at most"):
        Nack(queue="q", consumer="c", offsets=[0], delay_ms=10**12)
    with pytest.raises(ValueError, match="min <= max"):
        QueueOptions(retry_backoff_ms=(500, 100))
    with pytest.raises(ValueError, match="1 <= min"):
        QueueOptions(retry_backoff_ms=(0, 100))
    with pytest.raises(TypeError, match="pair of ints"):
        QueueOptions(retry_backoff_ms=(1.0, 100))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="pair of ints"):
        QueueOptions(retry_backoff_ms=100)  # type: ignore[arg-type]
    assert QueueOptions(retry_backoff_ms=[10, 20]).retry_backoff_ms == (10, 20)  # type: ignore[arg-type]


def test_retry_timers_stay_bounded_by_what_waits_however_many_retries() -> None:
    d = Driver()
    d(Declare(queue="q"))
    d(Subscribe(queue="q", consumer="c", node="A"), ts_ms=0)
    publish(d, 2)
    for now in range(1, 3_000):  # 0 is retried 3,000 times, waiting 1 ms each time
        d(Nack(queue="q", consumer="c", offsets=[0], delay_ms=1), ts_ms=now)
        d(Tick(), ts_ms=now + 1)
    q = d.machine._queues["q"]
    assert len(q.timers) <= 2 * len(q.waiting) + 33 and len(q.waiting_low) <= 33


# ---------------------------------------------------------- purge and delete


def test_purge_removes_the_ready_messages_and_counts_them_and_held_ones_stay() -> None:
    d = Driver()
    d(Declare(queue="q"))
    d(Subscribe(queue="q", consumer="c", node="A", prefetch=2), ts_ms=0)
    d(Enqueue(queue="q", body=b"m0", key="k"))
    d(Enqueue(queue="q", body=b"m1"))  # c holds 0 and 1
    d(Nack(queue="q", consumer="c", offsets=[1], delay_ms=1_000))  # 1 waits
    for key in ("k", None, "j"):
        d(Enqueue(queue="q", body=b"r", key=key))  # c takes 2; 3 and 4 are ready
    applied = d(PurgeQueue(queue="q"))
    assert applied.reply == QueuePurged(messages=3)
    assert applied.effects == (Purged(queue="q", offsets=(1, 3, 4), reason="purged"),)
    assert d.machine.ready("q") == () and d.machine.waiting("q") == {}
    assert d.machine.unacked("q", "c") == (0, 2)
    assert [m.offset for m in d.machine.read("q", 0, 10)] == [0, 1, 2, 3, 4]  # the stream
    assert d(Tick(), ts_ms=2_000).effects == ()
    assert deliveries(d(Enqueue(queue="q", body=b"new", key="k"))) == []  # no credit
    assert deliveries(d(Ack(queue="q", consumer="c", offsets=[0, 2]))) == [("c", 5)]
    assert d(PurgeQueue(queue="q")).reply == QueuePurged(messages=0)
    assert _error_code(d(PurgeQueue(queue="nope")).reply) is ErrorCode.UNKNOWN_QUEUE


def test_deleting_a_queue_in_use_is_refused_unless_forced() -> None:
    d = Driver()
    d(Declare(queue="q"))
    d(Subscribe(queue="q", consumer="c1", node="A", prefetch=1))
    d(Subscribe(queue="q", consumer="c2", node="B", prefetch=1))
    publish(d, 3)  # c1 holds 0, c2 holds 1, 2 is ready
    d(Cancel(queue="q", consumer="c1"))
    before = d.machine.snapshot()
    refused = d(DeleteQueue(queue="q"))
    assert _error_code(refused.reply) is ErrorCode.QUEUE_IN_USE and refused.effects == ()
    assert "in use by 2 consumer(s) holding 2 message(s)" in refused.reply.message  # type: ignore[union-attr]
    assert Machine.restore(before).queues() == d.machine.queues() == ("q",)
    forced = d(DeleteQueue(queue="q", force=True))
    assert forced.reply == QueueDeleted(messages=3, consumers=2)
    assert forced.effects == (
        ConsumerDown(queue="q", consumer="c1", node="A", reason="queue_deleted"),
        ConsumerDown(queue="q", consumer="c2", node="B", reason="queue_deleted"),
        Purged(queue="q", offsets=(0, 1, 2), reason="queue_deleted"),
    )
    assert d.machine.queues() == () and d.machine.consumers_on("A") == ()
    assert _error_code(d(Ack(queue="q", consumer="c2", offsets=[1])).reply) is (
        ErrorCode.UNKNOWN_QUEUE
    )
    assert d(Down(consumer="c2")).effects == ()  # its connection closing: nothing left
    assert _error_code(d(DeleteQueue(queue="q")).reply) is ErrorCode.UNKNOWN_QUEUE


def test_a_queue_declared_again_is_empty_and_carries_on_from_the_deleted_ones_offsets() -> None:
    """A reader that kept an offset of the deleted queue (a Spark checkpoint, say) finds
    no message of the new one under it, only a gap, as if retention had dropped them."""
    d = Driver()
    d(Declare(queue="q", options=QueueOptions(max_length=10)))
    publish(d, 3)
    d(CommitOffset(queue="q", group="spark", offset=1))
    applied = d(DeleteQueue(queue="q"))
    assert applied.reply == QueueDeleted(messages=3, consumers=0)
    assert applied.effects == (Purged(queue="q", offsets=(0, 1, 2), reason="queue_deleted"),)
    assert d(Declare(queue="q")).reply == Declared(created=True)  # other options now
    stats = d.machine.stats("q")
    assert (stats.first_retained, stats.next_offset, stats.ready) == (3, 3, 0)
    assert d.machine.read("q", 0, 10) == ()
    assert d(Enqueue(queue="q", body=b"new")).reply == Enqueued(offset=3)
    assert [m.body for m in d.machine.read("q", 1, 10)] == [b"new"]
    assert d.machine.committed_offset("q", "spark") is None
    assert Machine.restore(d.machine.snapshot()).digest() == d.machine.digest()


def test_a_queue_declared_again_refuses_a_resend_of_a_publish_to_the_deleted_one() -> None:
    """A client whose publish landed in the deleted queue, and which resends it after the
    name was declared again (its reply lost), is refused: the new queue forgot the
    deleted one's producers, as `ForgetProducers` does. A caller's own id carries no
    generation: it starts afresh at seq 0, as after a forget."""
    d = Driver()
    d(Declare(queue="q"), ts_ms=50_000)
    client = "g9c40-" + "a" * 32  # generation 40,000: made at 40 s
    ahead = "g186a0-" + "b" * 32  # generation 100,000: a client clock ahead of the log's
    assert d(Enqueue(queue="q", body=b"m", producer=client, seq=0)).reply == Enqueued(offset=0)
    d(Enqueue(queue="q", body=b"m", producer=ahead, seq=0))
    d(Enqueue(queue="q", body=b"m", producer="mine", seq=0))
    d(DeleteQueue(queue="q"), ts_ms=60_000)
    d(Declare(queue="q"))
    refused = d(Enqueue(queue="q", body=b"m", producer=client, seq=0)).reply
    assert isinstance(refused, Error) and refused.code is ErrorCode.PRODUCER_FORGOTTEN
    assert refused.generation == 60_000  # the log's time at the delete, not `ahead`'s
    # the mark never passes the log's time (as for a forget: an id made up far ahead
    # must not lock every client out), so an id made by a clock ahead of it is new
    assert d(Enqueue(queue="q", body=b"m", producer=ahead, seq=0)).reply == Enqueued(offset=3)
    fresh = "g2bf20-" + "c" * 32  # made at 180 s, after the delete
    assert d(Enqueue(queue="q", body=b"m", producer=fresh, seq=0)).reply == Enqueued(offset=4)
    assert d(Enqueue(queue="q", body=b"m", producer="mine", seq=0)).reply == Enqueued(offset=5)


def test_deleted_names_are_remembered_up_to_a_bound_past_which_new_queues_start_above_all(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Memory stays bounded as queues come and go: past `MAX_DELETED_NAMES` the oldest
    name is let go into a floor that every other new queue starts from, so no name
    gives an offset twice however many were deleted."""
    from quorumq.machine import machine as machine_module

    monkeypatch.setattr(machine_module, "MAX_DELETED_NAMES", 2)
    d = Driver()
    for name, count in (("a", 5), ("b", 2), ("c", 1)):
        d(Declare(queue=name))
        publish(d, count, queue=name)
        d(DeleteQueue(queue=name))
    assert list(d.machine._deleted) == ["b", "c"]  # "a" (5) went into the floor
    restored = Machine.restore(d.machine.snapshot())
    assert restored.digest() == d.machine.digest()
    for name, first in (("c", 1), ("a", 5), ("new", 5), ("b", 2)):
        d(Declare(queue=name))
        assert d.machine.stats(name).next_offset == first, name
    assert d.machine._deleted == {}


def test_a_consumer_of_two_queues_keeps_the_other_when_one_is_deleted() -> None:
    d = Driver()
    d(Declare(queue="a"))
    d(Declare(queue="b"))
    for queue in ("a", "b"):
        d(Subscribe(queue=queue, consumer="c", node="A"))
        d(Enqueue(queue=queue, body=b"m"))
    d(Subscribe(queue="b", consumer="other", node="B", prefetch=1))
    d(DeleteQueue(queue="a", force=True))
    assert d.machine.consumers_on("A") == ("c",)
    down = d(Down(consumer="c"))
    assert [(e.queue, e.consumer) for e in down.effects if isinstance(e, ConsumerDown)] == [
        ("b", "c")
    ]
    assert deliveries(down) == [("other", 0)]  # what it held on b went back
    restored = Machine.restore(d.machine.snapshot())
    assert restored.digest() == d.machine.digest()


def test_dead_lettering_into_a_deleted_queue_drops_instead() -> None:
    d = Driver()
    d(Declare(queue="dlq"))
    d(Declare(queue="q", options=QueueOptions(dead_letter_queue="dlq")))
    d(Subscribe(queue="q", consumer="c", node="A"))
    d(Enqueue(queue="q", body=b"m"))
    d(DeleteQueue(queue="dlq"))
    rejected = d(Nack(queue="q", consumer="c", offsets=[0], requeue=False))
    assert rejected.effects == (Dropped(queue="q", offset=0, reason="rejected"),)


@pytest.mark.parametrize(("single_active", "key"), [(True, None), (False, "k")])
def test_a_waiting_message_dropped_by_max_length_unblocks_at_once_on_every_replica(
    single_active: bool, key: str | None
) -> None:
    """m0 waits out a retry delay ahead of m1 (same key, or a single-active-consumer
    queue); m2 drops m0 (max_length 2, drop-head). m1 was left undelivered to an idle
    consumer, and a later Tick delivered it only on a replica whose timer heap still held
    m0's stale timer: one restored from a snapshot delivered nothing (found by a helper's
    review, with the property test at 3,000 examples)."""
    from quorumq.machine import Deliver, Meta, Nack, Tick

    machine = Machine()
    log_index = 0

    def apply(command: Any, ts: int) -> Any:
        nonlocal log_index
        log_index += 1
        return machine.apply(Meta(log_index, ts), command)

    options = QueueOptions(max_length=2, overflow="drop-head", single_active_consumer=single_active)
    apply(Declare(queue="q", options=options), 1000)
    apply(Subscribe(queue="q", consumer="c", node="A", prefetch=1), 1000)
    apply(Enqueue(queue="q", body=b"m0", key=key), 1000)
    apply(Enqueue(queue="q", body=b"m1", key=key), 1001)
    apply(Nack(queue="q", consumer="c", offsets=(0,), delay_ms=1000), 1002)
    dropped = apply(Enqueue(queue="q", body=b"m2", key=key), 1003)
    assert [e.offset for e in dropped.effects if isinstance(e, Deliver)] == [1]
    restored = Machine.restore(machine.snapshot())
    tick = Meta(log_index + 1, 2500)  # past m0's old due time
    assert machine.apply(tick, Tick()).effects == restored.apply(tick, Tick()).effects
    assert machine.digest() == restored.digest()


def test_a_timer_left_by_a_message_that_no_longer_waits_asks_for_no_tick() -> None:
    """m0 waits out a retry delay and expires meanwhile (TTL): its timer stays in the
    heap. The leader asks `next_retry_ms` every 10 ms whether to propose a Tick; answered
    from the stale timer, with a Tick that runs a queue only for what waits, that was a
    Tick every 10 ms from m0's old due time on, for as long as the queue stayed so."""
    from quorumq.machine import Meta, Nack, Tick

    machine = Machine()
    index = 0

    def apply(command: Any, ts: int) -> Any:
        nonlocal index
        index += 1
        return machine.apply(Meta(index, ts), command)

    apply(Declare(queue="q", options=QueueOptions(message_ttl_ms=500)), 1000)
    apply(Subscribe(queue="q", consumer="c", node="A", prefetch=1), 1000)
    apply(Enqueue(queue="q", body=b"m0"), 1000)
    apply(Nack(queue="q", consumer="c", offsets=(0,), delay_ms=5000), 1001)
    assert machine.next_retry_ms() == 6001
    apply(Tick(), 1600)  # m0 expires while it waits
    assert not machine.waiting("q")
    assert machine.next_retry_ms() is None


# ------------------------------------------------------------------ disk alarm


def test_a_disk_alarm_refuses_publishes_but_answers_duplicates_and_lets_the_rest_go_on() -> None:
    from quorumq.codec import decode_command, encode_command
    from quorumq.machine import DiskAlarm, NodeDown
    from quorumq.machine.encoding import decode

    d = Driver()
    d(Declare(queue="q"))
    first = d(Enqueue(queue="q", body=b"a", key=None, producer="p", seq=0)).reply
    d(DiskAlarm(node="B", raised=True))
    refused = d(Enqueue(queue="q", body=b"b", key=None, producer="p", seq=1)).reply
    assert isinstance(refused, Error) and refused.code == ErrorCode.DISK_ALARM
    assert "B" in refused.message
    again = d(Enqueue(queue="q", body=b"a", key=None, producer="p", seq=0)).reply
    assert isinstance(again, Enqueued) and again.duplicate and again.offset == first.offset
    assert d(Subscribe(queue="q", consumer="c", node="A", prefetch=5)).reply == OK
    assert Machine.restore(d.machine.snapshot()).disk_alarms() == {"B"}
    alarm = DiskAlarm(node="B", raised=True)
    assert decode_command(encode_command(alarm)) == alarm

    assert decode(d.machine.snapshot())[1] == 5  # (4, read by the version before, without)
    d(NodeDown(node="B"))  # a node marked down writes nothing: its alarm goes
    assert decode(d.machine.snapshot())[1] == 4
    d(DiskAlarm(node="B", raised=True))  # nor raises one: it would outlive it
    assert d.machine.disk_alarms() == frozenset()
    assert isinstance(
        d(Enqueue(queue="q", body=b"b", key=None, producer="p", seq=1)).reply, Enqueued
    )
    d(DiskAlarm(node="A", raised=True))
    d(DiskAlarm(node="A", raised=False))
    assert d.machine.disk_alarms() == frozenset()
