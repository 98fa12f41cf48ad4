"""What a node sent its consumers, and what a snapshot load left unsent.

A node sends a consumer the deliveries its replica's effects name (`Replica`), once
per log entry. A snapshot load changes what the machine says a consumer holds without
the log entries that made it so: a follower that catches up from the leader's
snapshot skips the entries that assigned messages to its consumers, and their effects
never run there. So the node keeps, per consumer, what it sent (`SentDeliveries`);
after a snapshot load it sends what the machine says the consumer holds and was not
sent (`missing`), and skips the effects of the entries the machine had applied when
it looked (they are sent then, or no longer held).

A delivery is not known by its offset and delivery count alone: a consumer's nack of
a keyed message takes the key's later messages it holds back with it and delivers
them again, to the same consumer as often as not, with the same delivery count (and
marked redelivered). Those go out again like any other delivery.

Used by the node core (`connection`, `serving`), which the trio server and the simulator
both drive, so the simulator runs this code. No I/O here.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..machine import Deliver

SENT_RECORD_MIN = 1024
"""A consumer's record of deliveries is trimmed to what it holds past this many (or
twice what it held at the last trim)."""


class SentDeliveries:
    """The deliveries sent to one consumer that it may still hold, by offset."""

    __slots__ = ("_limit", "_sent", "resynced_through")

    def __init__(self) -> None:
        self._sent: dict[int, tuple[int, bool]] = {}
        """offset -> (delivery count, redelivered) of the last delivery sent."""
        self._limit = SENT_RECORD_MIN
        self.resynced_through = 0
        """`missing` compared the machine at this log index: the deliveries made by
        entries up to here are sent, or no longer held."""

    def record(self, delivery: Deliver) -> None:
        """Note that `delivery` is sent."""
        self._sent[delivery.offset] = (delivery.delivery_count, delivery.redelivered)

    def was_sent(self, delivery: Deliver) -> bool:
        return self._sent.get(delivery.offset) == (delivery.delivery_count, delivery.redelivered)

    def covers(self, index: int) -> bool:
        """The effects of log entry `index` are sent already, or stale (`missing`)."""
        return index <= self.resynced_through

    def full(self) -> bool:
        """The record wants trimming (`keep`) to what the consumer still holds."""
        return len(self._sent) > self._limit

    def keep(self, held: Iterable[int]) -> None:
        """Forget the deliveries whose offsets the machine no longer has the consumer hold."""
        sent = self._sent
        self._sent = {o: sent[o] for o in held if o in sent}
        self._limit = max(SENT_RECORD_MIN, 2 * len(self._sent))


def missing(
    held: tuple[Deliver, ...] | None, sent: SentDeliveries, index: int
) -> tuple[Deliver, ...] | None:
    """After a snapshot load, with the machine at log `index`: of the deliveries it says
    a consumer holds (`Machine.held_deliveries`), those the consumer was not sent. The
    record keeps only what is held, and covers the entries up to `index`. None if the
    machine has no such consumer: it was removed meanwhile (its node was marked down:
    cancel it), or its `Subscribe` is not applied yet (wait)."""
    if held is None:
        return None
    sent.keep([d.offset for d in held])
    sent.resynced_through = max(sent.resynced_through, index)
    return tuple(d for d in held if not sent.was_sent(d))
