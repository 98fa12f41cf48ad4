"""What a node sent its consumers: a delivery goes out once, whatever the replica does.

A node sends a consumer the deliveries its replica's effects name (`Replica`). A
snapshot load changes what the machine says a consumer holds without the log entries
that made it so: a follower that catches up from the leader's snapshot skips the
entries that assigned messages to its consumers, and their effects never run there.
So the node keeps, per consumer, what it sent (`SentDeliveries`), and after a snapshot
load sends what the machine says the consumer holds and was not sent (`missing`).

Shared by the trio server (`quorumq.server.node`) and the simulator's model of it
(`simulations.node`), so the simulator runs this code. No I/O here.
"""

from __future__ import annotations

from collections.abc import Iterable

from .machine import Deliver

SENT_RECORD_MIN = 1024
"""A consumer's record of deliveries is trimmed to what it holds past this many (or
twice what it held at the last trim)."""


class SentDeliveries:
    """The deliveries sent to one consumer that it may still hold: offset -> delivery
    count. A message returned and delivered again has a higher count: a new delivery."""

    __slots__ = ("_limit", "_sent")

    def __init__(self) -> None:
        self._sent: dict[int, int] = {}
        self._limit = SENT_RECORD_MIN

    def record(self, offset: int, delivery_count: int) -> bool:
        """Note that delivery (`offset`, `delivery_count`) is sent; False if it was already."""
        if self._sent.get(offset) == delivery_count:
            return False
        self._sent[offset] = delivery_count
        return True

    def was_sent(self, offset: int, delivery_count: int) -> bool:
        return self._sent.get(offset) == delivery_count

    def full(self) -> bool:
        """The record wants trimming (`keep`) to what the consumer still holds."""
        return len(self._sent) > self._limit

    def keep(self, held: Iterable[int]) -> None:
        """Forget the deliveries whose offsets the machine no longer has the consumer hold."""
        sent = self._sent
        self._sent = {o: sent[o] for o in held if o in sent}
        self._limit = max(SENT_RECORD_MIN, 2 * len(self._sent))


def missing(held: tuple[Deliver, ...] | None, sent: SentDeliveries) -> tuple[Deliver, ...] | None:
    """After a snapshot load: of the deliveries the machine says a consumer holds
    (`Machine.held_deliveries`), those it was not sent; the record keeps only what is
    held. None if the machine has no such consumer: it was removed meanwhile (its node
    was marked down: cancel it), or its `Subscribe` is not applied yet (wait)."""
    if held is None:
        return None
    sent.keep([d.offset for d in held])
    return tuple(d for d in held if not sent.was_sent(d.offset, d.delivery_count))
