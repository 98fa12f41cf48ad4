"""What a node sent its consumers (quorumq/node/deliveries.py), driven directly."""

from __future__ import annotations

from quorumq.machine import Deliver
from quorumq.node.deliveries import SENT_RECORD_MIN, SentDeliveries, missing


def deliver(offset: int, count: int = 0, *, redelivered: bool | None = None) -> Deliver:
    marked = count > 0 if redelivered is None else redelivered
    return Deliver("q", "c", "A", offset, None, b"m%d" % offset, None, marked, count)


def test_a_delivery_again_with_another_count_or_mark_is_another_delivery() -> None:
    sent = SentDeliveries()
    sent.record(deliver(3))
    assert sent.was_sent(deliver(3))
    assert not sent.was_sent(deliver(3, 1))  # nacked and delivered again
    assert not sent.was_sent(deliver(3, redelivered=True))  # taken back with its key
    sent.record(deliver(3, 1))
    assert not sent.was_sent(deliver(3))


def test_the_record_wants_trimming_past_its_limit_and_keeps_what_is_held() -> None:
    sent = SentDeliveries()
    for offset in range(SENT_RECORD_MIN):
        sent.record(deliver(offset))
    assert not sent.full()
    sent.record(deliver(SENT_RECORD_MIN))
    assert sent.full()
    sent.keep([5, 7, 10**6])
    assert not sent.full()
    assert sent.was_sent(deliver(5)) and sent.was_sent(deliver(7))
    assert not sent.was_sent(deliver(6))
    assert not sent.was_sent(deliver(10**6))  # held, but never sent here


def test_after_a_snapshot_load_what_is_held_and_unsent_is_missing() -> None:
    """The snapshot skipped the entries that delivered 4, redelivered 2 and took 3 back
    with its key (to the same consumer); 1 was acked."""
    sent = SentDeliveries()
    for offset in (1, 2, 3):
        sent.record(deliver(offset))
    held = (deliver(2, 1), deliver(3, redelivered=True), deliver(4))
    assert missing(held, sent, 40) == held
    assert not sent.was_sent(deliver(1))  # acked meanwhile: forgotten
    assert sent.was_sent(deliver(3))  # not yet sent again: the resync sends it


def test_after_a_snapshot_load_the_effects_of_the_entries_it_saw_are_covered() -> None:
    """The machine the resync compared was at index 40: a delivery made by entry 40 or
    before is sent, or no longer held; entry 41's is new."""
    sent = SentDeliveries()
    assert not sent.covers(1)
    assert missing((), sent, 40) == ()
    assert sent.covers(40) and not sent.covers(41)
    missing((), sent, 30)  # an older machine (a stale snapshot) uncovers nothing
    assert sent.covers(40)


def test_a_consumer_the_machine_does_not_have_is_not_sent_anything() -> None:
    sent = SentDeliveries()
    sent.record(deliver(1))
    assert missing(None, sent, 40) is None
    assert sent.was_sent(deliver(1)) and not sent.covers(40)
