"""What a node sent its consumers (quorumq/deliveries.py), driven directly."""

from __future__ import annotations

from quorumq.deliveries import SENT_RECORD_MIN, SentDeliveries, missing
from quorumq.machine import Deliver


def deliver(offset: int, count: int = 0) -> Deliver:
    return Deliver("q", "c", "A", offset, None, b"m%d" % offset, None, count > 0, count)


def test_a_delivery_is_recorded_once_and_its_redelivery_is_new() -> None:
    sent = SentDeliveries()
    assert sent.record(3, 0)
    assert not sent.record(3, 0)
    assert sent.was_sent(3, 0) and not sent.was_sent(3, 1)
    assert sent.record(3, 1)  # returned and delivered again: a new delivery
    assert not sent.was_sent(3, 0)


def test_the_record_wants_trimming_past_its_limit_and_keeps_what_is_held() -> None:
    sent = SentDeliveries()
    for offset in range(SENT_RECORD_MIN):
        sent.record(offset, 0)
    assert not sent.full()
    sent.record(SENT_RECORD_MIN, 0)
    assert sent.full()
    sent.keep([5, 7, 10**6])
    assert not sent.full()
    assert sent.was_sent(5, 0) and sent.was_sent(7, 0) and not sent.was_sent(6, 0)
    assert not sent.was_sent(10**6, 0)  # held, but never sent here


def test_after_a_snapshot_load_what_is_held_and_unsent_is_missing() -> None:
    """The snapshot skipped the entries that delivered 4 and redelivered 2; 1 was acked."""
    sent = SentDeliveries()
    for offset in (1, 2, 3):
        sent.record(offset, 0)
    held = (deliver(2, 1), deliver(3), deliver(4))
    assert missing(held, sent) == (deliver(2, 1), deliver(4))
    assert not sent.was_sent(1, 0)  # acked meanwhile: forgotten
    assert sent.was_sent(3, 0)


def test_a_consumer_the_machine_does_not_have_is_not_resent_anything() -> None:
    sent = SentDeliveries()
    sent.record(1, 0)
    assert missing(None, sent) is None
    assert missing((), sent) == ()
    assert not sent.was_sent(1, 0)
