"""The directory in group 0's machine (`Place`): which Raft group each queue lives in.

A node with many groups routes every command for a queue by this, so a placement that
moved, differed between replicas or came back different from a snapshot would send a
queue's commands to a group that does not hold it: its messages would look gone."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from quorumq.machine import (
    Declare,
    DeleteQueue,
    Error,
    ErrorCode,
    Machine,
    Meta,
    Place,
    Placed,
    QueueOptions,
    encoding,
)
from quorumq.machine import state as state_module
from quorumq.machine.snapshots import _SNAPSHOT_FORMAT
from quorumq.machine.state import hashed_group


class _Log:
    """A machine fed one command at a time, with its index."""

    def __init__(self) -> None:
        self.machine = Machine()
        self.index = 0

    def __call__(self, command: Any) -> Any:
        self.index += 1
        return self.machine.apply(Meta(self.index, 1_000 + self.index), command).reply


def test_new_queues_go_to_the_least_loaded_group_ties_to_the_lowest() -> None:
    log = _Log()
    groups = [log(Place(queue=f"q{i}", groups=3)).group for i in range(7)]
    assert groups == [0, 1, 2, 0, 1, 2, 0]
    assert log.machine.group_loads() == (3, 2, 2) and log.machine.group_count == 3


def test_a_placement_is_kept_for_good_and_a_queue_placed_again_gets_it() -> None:
    log = _Log()
    first = log(Place(queue="orders", groups=4))
    for i in range(5):
        log(Place(queue=f"other{i}", groups=4))
    assert log(Place(queue="orders", groups=4)) == first
    assert log.machine.placement("orders") == first.group
    assert log.machine.group_loads() == (2, 2, 1, 1)  # placed once, counted once


def test_queues_from_before_groups_are_in_group_0_and_count_there() -> None:
    log = _Log()
    log(Declare(queue="old"))
    log(Declare(queue="gone"))
    log(DeleteQueue(queue="gone"))  # a deleted name keeps where its offsets ended
    assert log.machine.placement("old") == 0 and log.machine.placement("gone") == 0
    assert log.machine.placement("new") is None and log.machine.group_count is None
    assert log(Place(queue="gone", groups=2)) == Placed(group=0)
    assert log.machine.group_loads() == (2, 0)
    assert [log(Place(queue=f"n{i}", groups=2)).group for i in range(3)] == [1, 1, 0]


def test_a_queue_goes_to_its_dead_letter_queues_group_and_places_it_if_new() -> None:
    log = _Log()
    log(Place(queue="a", groups=3))
    dlq = log(Place(queue="b", groups=3))
    assert log(Place(queue="c", groups=3, dead_letter_queue="b")) == dlq
    placed = log(Place(queue="d", groups=3, dead_letter_queue="new-dlq"))
    assert log.machine.placement("new-dlq") == placed.group
    # the dead-letter queue's own dead-letter queue follows it in turn
    assert log(Place(queue="new-dlq", groups=3, dead_letter_queue="dlq2")) == placed
    assert log.machine.placement("dlq2") == placed.group


def test_a_queue_and_a_dead_letter_queue_in_two_groups_are_refused_changing_nothing() -> None:
    log = _Log()
    a = log(Place(queue="a", groups=2)).group
    b = log(Place(queue="b", groups=2)).group
    assert a != b
    before = log.machine.snapshot()
    refused = log(Place(queue="a", groups=2, dead_letter_queue="b"))
    assert isinstance(refused, Error) and refused.code == ErrorCode.INVALID
    assert "dead-letters within its own group" in refused.message
    own = log(Place(queue="c", groups=2, dead_letter_queue="c"))
    assert isinstance(own, Error) and "its own dead_letter_queue" in own.message
    assert _directory(log.machine.snapshot()) == _directory(before)


def test_another_group_count_is_refused_once_the_first_place_fixed_it() -> None:
    log = _Log()
    log(Place(queue="a", groups=3))
    refused = log(Place(queue="b", groups=4))
    assert isinstance(refused, Error) and "over 3 Raft groups, not 4" in refused.message
    assert log.machine.placement("b") is None
    refused_again = log(Place(queue="a", groups=1))  # even for a queue already placed
    assert isinstance(refused_again, Error)


def test_past_the_most_placements_new_names_go_by_their_hash_and_placed_ones_stay(
    monkeypatch: Any,
) -> None:
    """A placement is kept for good, so the directory stops growing at its most and a
    new name goes where a stable hash of it says, for good too: no name is refused for
    the directory's size (temporary queues declared and deleted for ever would have
    run the cluster out of names)."""
    monkeypatch.setattr(state_module, "MAX_PLACEMENTS", 3)
    log = _Log()
    log(Place(queue="a", groups=2))
    log(Place(queue="b", groups=2))
    assert log(Place(queue="c", groups=2, dead_letter_queue="d")) == Placed(group=0)  # 4 names
    loads = log.machine.group_loads()
    for name in ("e", "f", "g", "h"):
        hashed = hashed_group(name, 2)
        assert log(Place(queue=name, groups=2)) == Placed(group=hashed)
        assert log.machine.placement(name) == hashed
    assert log.machine.group_loads() == loads  # recorded nowhere
    assert log.machine.placement("never") == hashed_group("never", 2)
    assert log(Place(queue="a", groups=2)) == Placed(group=0)  # as recorded
    apart = next(n for n in ("x", "y", "z", "w") if hashed_group(n, 2) != hashed_group("e", 2))
    refused = log(Place(queue="e", groups=2, dead_letter_queue=apart))
    assert isinstance(refused, Error) and "dead-letters within its own group" in refused.message
    together = next(n for n in ("x", "y", "z", "w") if hashed_group(n, 2) == hashed_group("e", 2))
    assert log(Place(queue="e", groups=2, dead_letter_queue=together)) == Placed(
        group=hashed_group("e", 2)
    )
    restored = Machine.restore(log.machine.snapshot())
    assert restored.placement("f") == hashed_group("f", 2) and restored.placement("c") == 0


def test_the_dead_letter_queues_of_queues_from_before_groups_stay_in_group_0() -> None:
    """A queue from before groups names a dead-letter queue not declared yet: declared
    after the upgrade, it must still be in group 0, or that queue's dead letters would
    be dropped (found by review)."""
    for first in ("other", "dead", "work"):  # the dead-letter queue's first of all, too
        log = _Log()
        log(Declare(queue="work", options=QueueOptions(dead_letter_queue="dead")))
        log(Place(queue=first, groups=3, dead_letter_queue="dead" if first == "work" else None))
        assert log(Place(queue="dead", groups=3)) == Placed(group=0)
        assert log.machine.group_loads() == (2, int(first == "other"), 0)


def test_a_snapshot_without_placements_is_written_as_before() -> None:
    log = _Log()
    log(Declare(queue="q"))
    assert encoding.decode(log.machine.snapshot())[1] == 4  # an older node reads it
    log(Place(queue="p", groups=2))
    value = encoding.decode(log.machine.snapshot())
    assert value[0] == _SNAPSHOT_FORMAT and value[1] == 7
    assert value[8] == [2, [["p", 1], ["q", 0]]]


def _directory(snapshot: bytes) -> Any:
    value = encoding.decode(snapshot)
    return value[8] if len(value) == 9 else None


# ------------------------------------------------------------------ properties

_NAMES = [f"q{i}" for i in range(8)]
_OPERATIONS = st.lists(
    st.one_of(
        st.tuples(
            st.just("place"),
            st.sampled_from(_NAMES),
            st.sampled_from([3, 3, 3, 3, 2]),  # now and then another count: refused
            st.none() | st.none() | st.sampled_from(_NAMES),
        ),
        st.tuples(  # by a node of one group, now and then with a dead-letter queue
            st.just("declare"), st.sampled_from(_NAMES), st.none() | st.sampled_from(_NAMES)
        ),
        st.tuples(st.just("delete"), st.sampled_from(_NAMES)),
        st.tuples(st.just("restore")),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(_OPERATIONS)
def test_placements_never_move_dead_letters_stay_in_their_group_and_loads_add_up(
    operations: list[Any],
) -> None:
    """Whatever the order of places (with or without a dead-letter queue, some with
    another group count), declares from before groups, deletes and restores from a
    snapshot: a name once placed keeps its group; a placed queue shares its group with
    its dead-letter queue; a refusal changes no placement; the loads count the
    placements; and a restored machine goes on as the original."""
    log = _Log()
    seen: dict[str, int] = {}
    for op in operations:
        m = log.machine
        if op[0] == "restore":
            restored = Machine.restore(m.snapshot())
            assert restored.digest() == m.digest()
            assert restored.group_loads() == m.group_loads()
            log.machine = restored
            continue
        if op[0] == "declare":
            if m.group_count is None:  # only before groups: a node with groups places first
                log(Declare(queue=op[1], options=QueueOptions(dead_letter_queue=op[2])))
        elif op[0] == "delete":
            log(DeleteQueue(queue=op[1], force=True))
        else:
            _, queue, groups, dlq = op
            count_before = m.group_count
            before = {n: m.placement(n) for n in _NAMES}
            reply = log(Place(queue=queue, groups=groups, dead_letter_queue=dlq))
            if isinstance(reply, Error):
                assert {n: m.placement(n) for n in _NAMES} == before
                assert m.group_count == count_before
                assert (
                    (count_before is not None and count_before != groups)
                    or dlq == queue
                    or None is not before[queue] != before.get(dlq) is not None  # type: ignore[arg-type]
                )
            else:
                assert m.group_count == (count_before or groups) == groups
                assert 0 <= reply.group < groups
                assert m.placement(queue) == reply.group
                if dlq is not None:
                    assert m.placement(dlq) == reply.group
        m = log.machine
        for name in _NAMES:
            group = m.placement(name)
            if name in seen:
                assert group == seen[name], f"{name} moved from {seen[name]} to {group}"
            elif group is not None and m.group_count is not None:
                seen[name] = group
        if m.group_count is not None:
            directory = dict(encoding.decode(m.snapshot())[8][1])
            loads = m.group_loads()
            assert loads == tuple(list(directory.values()).count(g) for g in range(len(loads)))
            assert Machine.restore(m.snapshot()).group_loads() == loads  # as a replica would
            for name in _NAMES:  # a queue from before groups shares its dead-letter queue's
                if name in m.queues() and name in directory:
                    dead = m.options(name).dead_letter_queue
                    assert dead is None or m.placement(dead) == m.placement(name)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(_NAMES * 3 + [f"x{i}" for i in range(30)]), max_size=40))
def test_without_dead_letter_queues_the_groups_differ_by_at_most_one_queue(
    names: list[str],
) -> None:
    log = _Log()
    for name in names:
        log(Place(queue=name, groups=4))
    loads = log.machine.group_loads()
    if loads:
        assert max(loads) - min(loads) <= 1
        assert sum(loads) == len(set(names))
