"""The reads a node holds until its replica applies their range (`quorumq.node.reads`),
on their own: ends and times in, reads out, and the work it took counted."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from quorumq.node.reads import WaitingRead, WaitingReads


def _read(queue: str, end: int) -> dict[str, object]:
    return {"t": "read", "queue": queue, "end": end}


def _ends(reads: list[WaitingRead[Any]]) -> list[tuple[str, int]]:
    return [(r.queue, r.end) for r in reads]


def test_reads_come_out_when_their_queues_end_reaches_theirs_and_no_sooner() -> None:
    reads: WaitingReads[str] = WaitingReads()
    for end in (5, 3, 9):
        reads.add("c1", _read("q", end), "q", end, deadline=10.0)
    reads.add("c1", _read("other", 1), "other", 1, deadline=10.0)
    assert reads.ready("q", 2) == []
    assert _ends(reads.ready("q", 5)) == [("q", 3), ("q", 5)]
    assert len(reads) == 2 and reads.waiting("c1") == 2
    assert _ends(reads.ready("q", 100)) == [("q", 9)]
    assert reads.queues() == {"other"}


def test_reads_past_their_deadline_come_out_once_and_leave_their_queues_index() -> None:
    reads: WaitingReads[str] = WaitingReads()
    reads.add("c1", _read("q", 5), "q", 5, deadline=1.0)
    reads.add("c2", _read("q", 6), "q", 6, deadline=2.0)
    assert reads.next_deadline() == 1.0
    assert reads.expired(0.5) == []
    assert _ends(reads.expired(1.0)) == [("q", 5)]
    assert reads.next_deadline() == 2.0
    assert _ends(reads.ready("q", 10)) == [("q", 6)]  # not the expired one again
    assert reads.next_deadline() is None and reads.expired(9.0) == []
    assert len(reads) == 0 and reads.held() == 0


def test_a_dropped_owners_reads_leave_every_index() -> None:
    reads: WaitingReads[str] = WaitingReads()
    for end in range(64):
        reads.add("gone", _read("q", end), "q", end, deadline=1.0 + end)
        reads.add("gone", _read("p", end), "p", end, deadline=1.0 + end)
    reads.add("stays", _read("p", 3), "p", 3, deadline=5.0)
    (full,) = reads.ready("q", 0)
    reads.hold(full)  # came out while its connection had no room: still counts
    assert reads.waiting("gone") == 128 and len(reads) == 129
    assert reads.drop("gone") == 128
    assert reads.waiting("gone") == 0 and len(reads) == 1 and reads.queues() == {"p"}
    assert reads.next_due("gone") is None
    assert reads.held() <= 3  # the one that stays, in its queue's, the deadlines', its owner's
    assert reads.expired(100.0)[0].owner == "stays"
    assert reads.held() == 0 and reads.drop("stays") == 0


def test_a_read_held_for_room_comes_out_once_its_owner_asks() -> None:
    reads: WaitingReads[str] = WaitingReads()
    for end in (1, 2):
        reads.add("c", _read("q", end), "q", end, deadline=1.0)
    for read in reads.ready("q", 2):
        reads.hold(read)
    assert len(reads) == 2 and reads.waiting("c") == 2 and reads.queues() == set()
    assert reads.expired(5.0) == []  # out of the deadlines' heap: it has its answer
    first, second = reads.next_due("c"), reads.next_due("c")
    assert first is not None and second is not None and (first.end, second.end) == (1, 2)
    assert reads.next_due("c") is None and len(reads) == 0 and reads.held() == 0


def _work_to_answer_one(unrelated: int) -> tuple[int, int]:
    """Steps taken to answer one read, and to time one out, while `unrelated` others wait
    (on another queue, and on the same queue further on)."""
    reads: WaitingReads[int] = WaitingReads()
    for i in range(unrelated):
        reads.add(i, _read("idle", i), "idle", i, deadline=100.0 + i)
        reads.add(i, _read("q", 10**6 + i), "q", 10**6 + i, deadline=100.0 + i)
    reads.add(-1, _read("q", 7), "q", 7, deadline=50.0)
    reads.add(-2, _read("q", 8), "q", 8, deadline=1.0)
    before = reads.steps
    assert _ends(reads.ready("q", 7)) == [("q", 7)]
    answered = reads.steps - before
    before = reads.steps
    assert _ends(reads.expired(1.0)) == [("q", 8)]
    return answered, reads.steps - before


def test_the_work_of_answering_a_read_does_not_grow_with_the_reads_that_still_wait() -> None:
    """Each read polled on a timer of its own and was looked for in a list of all of them:
    100 connections with 64 reads each took a leader's publish p50 from 3.4 to 310 ms."""
    assert _work_to_answer_one(10) == _work_to_answer_one(5000)


ops = st.lists(
    st.tuples(
        st.sampled_from(["add", "add", "ready", "expired", "drop"]),
        st.sampled_from("abc"),  # the owner
        st.sampled_from("qp"),  # the queue
        st.integers(0, 9),  # the end, or the time that passes
    ),
    max_size=120,
)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_reads_come_out_as_a_list_of_them_says_and_dead_entries_stay_bounded(
    operations: list[tuple[str, str, str, int]],
) -> None:
    """Against the plainest model, a list scanned each time; the deadlines come in
    another order than the ends."""
    reads: WaitingReads[str] = WaitingReads()
    model: list[tuple[str, str, int, float, int]] = []  # owner, queue, end, deadline, n
    now = 0.0
    for n, (op, owner, queue, number) in enumerate(operations):
        if op == "add":
            deadline = now + (n * 7) % 5 + 1
            reads.add(owner, {"n": n}, queue, number, deadline)
            model.append((owner, queue, number, deadline, n))
            continue
        if op == "ready":
            out = [r.frame["n"] for r in reads.ready(queue, number)]
            assert sorted(out) == [m[4] for m in model if m[1] == queue and m[2] <= number]
        elif op == "expired":
            now += number
            out = [r.frame["n"] for r in reads.expired(now)]
            assert sorted(out) == [m[4] for m in model if m[3] <= now]
        else:
            out = [m[4] for m in model if m[0] == owner]
            assert reads.drop(owner) == len(out)
        model = [m for m in model if m[4] not in out]
        assert len(reads) == len(model)
        assert reads.queues() == {m[1] for m in model}
        assert reads.next_deadline() == min((m[3] for m in model), default=None)
        assert reads.held() <= 5 * len(model)  # in each heap, dead entries <= live ones
