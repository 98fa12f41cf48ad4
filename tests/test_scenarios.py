"""The two event sequences of RabbitMQ's post (seed 004), step by step.

Three machines A, B, C apply the same log at their own pace (leader B; c1 on A, c2 on
C). At each apply we check which replica sends which message to which consumer, which
only tracks it, and the service queue where the post states it.
"""

from __future__ import annotations

import pytest

from quorumq.ops.scenarios import (
    RABBITMQ_POST_ALTERNATE,
    RABBITMQ_POST_MAIN,
    Scenario,
    Step,
    play,
    render,
)

# (event, replica, sends, tracks only, service queue after the apply)
MAIN = [
    (0, "A", [], [], ()),
    (0, "B", [], [], ()),
    (0, "C", [], [], ()),
    (5, "B", [], [], ()),  # group 3: B applies enqueue m1
    (8, "C", [], [], ()),  # group 4: no consumers yet
    (9, "A", [], [], ()),
    (10, "B", [], [("m1", "c1")], ("c1",)),  # group 5: c1 not local to B, tracked
    (15, "C", [], [("m1", "c1")], ("c1",)),  # group 6
    (16, "A", [("m1", "c1")], [], ("c1",)),  # c1 local to A: A sends m1
    (17, "B", [], [], ("c1", "c2")),  # group 7
    (20, "A", [], [], ("c1", "c2")),
    (22, "C", [], [], ("c1", "c2")),  # group 8
    (23, "B", [], [("m2", "c1")], ("c2", "c1")),
    (24, "B", [], [], ("c2", "c1")),  # group 9: ack m1
    (25, "C", [], [("m2", "c1")], ("c2", "c1")),
    (26, "A", [("m2", "c1")], [], ("c2", "c1")),
    # 27: B fails; 28: A is elected
    (32, "A", [], [], ("c2", "c1")),  # group 13: ack m1
    (33, "C", [], [], ("c2", "c1")),
    (34, "A", [], [("m3", "c2")], ("c1", "c2")),  # group 14: c2 not local to A
    (35, "C", [("m3", "c2")], [], ("c1", "c2")),  # c2 local to C: C sends m3
]

ALTERNATE = [
    (0, "A", [], [], ()),
    (0, "B", [], [], ()),
    (0, "C", [], [], ()),
    (5, "B", [], [], ()),
    (8, "C", [], [], ()),
    (9, "A", [], [], ()),
    (10, "B", [], [("m1", "c1")], ("c1",)),
    (15, "C", [], [("m1", "c1")], ("c1",)),
    (16, "A", [("m1", "c1")], [], ("c1",)),
    (18, "B", [], [], ("c1", "c2")),  # group 7-alternate
    (19, "A", [], [], ("c1", "c2")),
    (23, "C", [], [], ("c1", "c2")),  # group 8-alternate
    (24, "B", [], [("m2", "c1")], ("c2", "c1")),
    (25, "A", [("m2", "c1")], [], ("c2", "c1")),  # tries to send to the gone c1
    (26, "B", [], [("m1", "c2"), ("m2", "c2")], ("c2",)),  # group 9: down c1
    (27, "C", [], [("m2", "c1")], ("c2", "c1")),
    (28, "A", [], [("m1", "c2"), ("m2", "c2")], ("c2",)),
    (31, "C", [("m1", "c2"), ("m2", "c2")], [], ("c2",)),  # groups 10-11: C sends both
]


def _pairs(deliveries: tuple) -> list[tuple[str, str]]:  # type: ignore[type-arg]
    return [(d.body.decode(), d.consumer) for d in deliveries]


@pytest.mark.parametrize(
    ("scenario", "expected"),
    [(RABBITMQ_POST_MAIN, MAIN), (RABBITMQ_POST_ALTERNATE, ALTERNATE)],
    ids=["main", "alternate"],
)
def test_each_replica_sends_only_to_its_local_consumers(
    scenario: Scenario,
    expected: list[tuple],  # type: ignore[type-arg]
) -> None:
    steps = list(play(scenario))
    got = [(s.event, s.replica, _pairs(s.sent), _pairs(s.tracked), s.service_queue) for s in steps]
    assert got == expected


@pytest.mark.parametrize("scenario", [RABBITMQ_POST_MAIN, RABBITMQ_POST_ALTERNATE])
def test_replicas_at_the_same_index_have_the_same_digest(scenario: Scenario) -> None:
    by_index: dict[int, set[str]] = {}
    for step in play(scenario):
        by_index.setdefault(step.index, set()).add(step.digest)
    assert all(len(digests) == 1 for digests in by_index.values())


def test_every_message_is_sent_exactly_once_across_replicas() -> None:
    sent = [d for s in play(RABBITMQ_POST_MAIN) for d in s.sent]
    assert sorted(d.body for d in sent) == [b"m1", b"m2", b"m3"]


def test_redeliveries_after_consumer_failure_are_marked() -> None:
    last: Step = list(play(RABBITMQ_POST_ALTERNATE))[-1]
    assert [(d.offset, d.redelivered, d.delivery_count) for d in last.sent] == [
        (0, True, 1),
        (1, True, 1),
    ]


def test_render_names_every_event() -> None:
    text = render(RABBITMQ_POST_MAIN)
    assert "m3->c2" in text
    assert "A wins the election" in text
