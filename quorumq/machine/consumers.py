"""A queue's consumers (`QueueConsumers`): added, cancelled and removed, the service queue
of those that may receive now (single active consumer too), and settlement: acks,
rejects and requeues, what is given back and when."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from heapq import heappush

from .commands import retry_delay_ms
from .queue_base import (
    ConsumerState,
    _Lane,
)
from .ready import ReadyIndex


class QueueConsumers(ReadyIndex):
    """Consumers and settlement (see the module's docstring)."""

    __slots__ = ()

    def add_consumer(
        self, consumer_id: str, node: str, prefetch: int, timeout_ms: int | None = None
    ) -> ConsumerState:
        c = ConsumerState(consumer_id, node, prefetch, timeout_ms)
        self.consumers[consumer_id] = c
        self._enlist(c)
        return c

    def active_consumer(self) -> ConsumerState | None:
        """With single active consumer: the oldest subscriber that is not cancelled, or
        that still holds messages. A cancelled consumer stays active until it holds
        nothing: the next one takes over only then, so messages it returns come before
        any later one (strict FIFO, DESIGN rule 5)."""
        for c in self.consumers.values():
            if not c.cancelled or c.unacked:
                return c
        return None

    def _enlist(self, c: ConsumerState) -> None:
        """Put `c` at the back of the service queue if it may receive now."""
        if c.in_sq or c.cancelled or not c.has_credit():
            return
        if self.options.single_active_consumer and self.active_consumer() is not c:
            return
        c.in_sq = True
        self.sq.append(c)

    def _delist(self, c: ConsumerState) -> None:
        if c.in_sq:
            self.sq.remove(c)
            c.in_sq = False

    def cancel(self, c: ConsumerState) -> None:
        c.cancelled = True
        self._delist(c)
        self._after_change(c)

    def remove_consumer(self, c: ConsumerState, now: int) -> None:
        """The consumer is down: return everything it holds (each a failed delivery, so
        the queue's retry backoff applies) and forget it."""
        self._delist(c)
        held = sorted(c.unacked)
        self._give_back(c, held, set(held), None, now)
        del self.consumers[c.id]
        if self.options.single_active_consumer:
            active = self.active_consumer()
            if active is not None:
                self._enlist(active)

    def _after_change(self, c: ConsumerState) -> None:
        """After `c` settled or gave back messages: forget it or let it receive again."""
        if c.cancelled:
            if not c.unacked:
                del self.consumers[c.id]
            if self.options.single_active_consumer:
                active = self.active_consumer()
                if active is not None:
                    self._enlist(active)
        else:
            self._enlist(c)

    def settle(self, c: ConsumerState, offsets: Iterable[int]) -> None:
        """Ack: the messages leave the queue view for good."""
        held = self.held
        msgs = self.msgs
        unacked = c.unacked
        for off in offsets:
            if unacked.pop(off, -1) < 0:
                continue  # listed twice (delivery times are never negative)
            del held[off]
            msg = msgs.pop(off)
            if self.returns:
                self.returns.pop(off, None)
            if msg[1] is not None:
                self._release(c, msg[1], 1)
        self._after_change(c)

    def reject(self, c: ConsumerState, offsets: Iterable[int]) -> None:
        """Nack without requeue: the messages leave to the dead-letter queue or are dropped."""
        for off in sorted(set(offsets)):
            del self.held[off]
            del c.unacked[off]
            msg = self.msgs.pop(off)
            self.returns.pop(off, None)
            if msg[1] is not None:
                self._release(c, msg[1], 1)
            self.outbox.append((msg, "rejected", True))
        self._after_change(c)

    def requeue(
        self, c: ConsumerState, offsets: Iterable[int], delay_ms: int | None, now: int
    ) -> None:
        """Nack with requeue. A keyed message takes the key's later held messages with it,
        so the key is redelivered in order; only the nacked ones count as failed, and
        wait `delay_ms` (None: the queue's backoff) before they are ready again."""
        failed = set(offsets)
        first_by_key: dict[str, int] = {}
        back: set[int] = set()
        for off in failed:
            key = self.msgs[off][1]
            if key is None:
                back.add(off)
            elif key not in first_by_key or off < first_by_key[key]:
                first_by_key[key] = off
        if first_by_key:
            msgs = self.msgs
            for off in c.unacked:
                key = msgs[off][1]
                if key is not None and key in first_by_key and off >= first_by_key[key]:
                    back.add(off)
        self._give_back(c, sorted(back), failed, delay_ms, now)
        self._after_change(c)

    def _give_back(
        self,
        c: ConsumerState,
        offsets: list[int],
        failed: set[int],
        delay_ms: int | None,
        now: int,
    ) -> None:
        """Return held `offsets` (ascending) to ready, each at its original place. Each
        failed one waits `delay_ms`, or what the queue's backoff gives for its count."""
        msgs = self.msgs
        limit = self.options.delivery_limit
        backoff = self.options.retry_backoff_ms
        by_key: dict[str, list[int]] = {}
        released: dict[str, int] = {}
        for off in offsets:
            del self.held[off]
            del c.unacked[off]
            msg = msgs[off]
            count = self.returns.get(off, 0) + (off in failed)
            key = msg[1]
            if key is not None:
                released[key] = released.get(key, 0) + 1
            if limit is not None and count > limit:
                del msgs[off]
                self.returns.pop(off, None)
                self.outbox.append((msg, "delivery_limit", True))
                continue
            self.returns[off] = count
            if off in failed:
                delay = delay_ms
                if delay is None:
                    delay = 0 if backoff is None else retry_delay_ms(backoff, count)
                if delay > 0:
                    self._wait(off, now + delay)
            if key is None:
                if off not in self.waiting:
                    heappush(self.returned, off)
            else:
                by_key.setdefault(key, []).append(off)
        for key, offs in by_key.items():
            lane = self.lanes.get(key)
            if lane is None:
                self.lanes[key] = _Lane(offs)
            elif offs[-1] < lane.offsets[0]:
                lane.offsets.extendleft(reversed(offs))
            else:
                lane.offsets = deque(sorted([*offs, *lane.offsets]))
        for key, n in released.items():
            self._release(c, key, n)
        for key in by_key:
            self._schedule(key, self.lanes[key])
