"""One queue: its messages, its service queue and the index of what is ready.

Theory of operation
-------------------
A queue has two views of the same immutable message records, plain tuples
`(offset, key, body, headers, ts_ms)` (`Record`; a tuple costs a tenth of a frozen attrs
instance, and one is made per message on the hot path):

* the stream view: every enqueued message by offset, acked or not, trimmed from the
  front by retention (count and bytes). Stream readers (Spark) read it by offset.
* the queue view (`msgs`): the messages not yet settled. A message in it is either
  held by one consumer (`held`) or ready.

Ready messages are indexed so that a consumer finds "the lowest-offset ready message
it may take" without scanning:

* messages without key sit in `fresh` (a deque in offset order: enqueue appends, the
  head is taken) and `returned` (a heap of offsets given back by nack or consumer
  down, so they are delivered again before any later message);
* messages with an ordering key sit in a `_Lane` per key, in offset order. A key with
  held messages is owned by their holder: only the owner may take the key's next
  message. Each lane has exactly one live heap entry `(head offset, key)`: in
  `free_keys` when nobody owns the key, else in its owner's `owned` heap. Heap entries
  are checked against the lane (`entry`, `home`) when they reach the top, so a stale
  entry is skipped rather than searched for and removed.

The candidate for consumer `c` is the smallest of: the head of `fresh`, the top of
`returned`, the top of `free_keys` and the top of `c.owned`. A slow key therefore
never blocks other keys, and a key's messages are delivered in offset order.

Removal is lazy: a ready message that expires or is dropped leaves `msgs` at once and
is skipped when its offset surfaces in `fresh`, `returned` or the middle of a lane;
a lane's head is always live (`_advance_lane` cleans behind it).

Retry with backoff: a message returned with a delay (a nack's `delay_ms`, or the
queue's `retry_backoff_ms`) is ready but waiting: `waiting` maps its offset to the log
time it is due, and `timers` (a heap of (due, offset)) wakes it (`_wake`, first thing
in `dispatch`, with the time of the command being applied). Meanwhile it keeps its
place: an unkeyed one is kept out of `returned` (later messages go on; once due it
goes back there, before any later message); a lane whose head waits has no heap entry
(its key waits, in order, and its later messages wait behind it); and a
single-active-consumer queue gives out nothing above the lowest waiting offset
(`waiting_low`, a heap), so it stays strictly FIFO.

The service queue `sq` holds the consumers that may receive now (active, with credit),
in round-robin order. Every decision depends only on this state, and every iteration
that decides something runs in offset order or subscription order, which a snapshot
keeps: two replicas with the same log make the same assignments.

Messages that leave undelivered (expired, over the delivery limit, rejected, dropped
at max length) go to `outbox` as (message, reason, dead_letter); the machine then
dead-letters or drops them, since that may touch another queue.

The parts: the records, the consumer, lane and producer states and the queue's fields
are `queue_base`; the ready index and delivery are `ready` (`ReadyIndex`); consumers and
settlement are `consumers` (`QueueConsumers`); `QueueState` here adds counts,
producers, enqueueing, the stream view, expiry and purges.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from .consumers import QueueConsumers
from .queue_base import (
    _COMPACT_AT,
    DEDUP_WINDOW,
    HEADER_OVERHEAD,
    MESSAGE_OVERHEAD,
    ConsumerState,
    ProducerState,
    Record,
    _Lane,
    may_start_generation_id,
    message_cost,
    producer_generation,
)


class QueueState(QueueConsumers):
    __slots__ = ()

    @property
    def ready_count(self) -> int:
        return len(self.msgs) - len(self.held)

    @property
    def first_retained(self) -> int:
        return self.stream_base + self.stream_head

    def forget_producer(self, producer: str, now: int) -> None:
        """Drop `producer`'s state; no id of its generation (or below) is new from now on.
        The mark never passes the queue's time `now`: an id made with a clock far ahead
        (or made up to be, `gffffffffffffffff-...`) cannot lock every client out."""
        del self.producers[producer]
        generation = producer_generation(producer)
        if generation is not None:
            self.forgotten_generation = max(self.forgotten_generation, min(generation, now))

    def forget_producers(self, prefix: str, now: int) -> int:
        """Drop the state of every producer whose id starts with `prefix`; return how many."""
        gone = sorted(p for p in self.producers if p.startswith(prefix))
        for producer in gone:
            self.forget_producer(producer, now)
        return len(gone)

    def seal(self, prefix: str, now: int, *, most: int, lifetime_ms: int) -> None:
        """Refuse new producers whose id starts with `prefix` (ending in "-") from now on,
        for `lifetime_ms`; keep the newest `most` seals."""
        self.sealed.pop(prefix, None)
        self.sealed[prefix] = now
        for old, at in list(self.sealed.items()):
            if len(self.sealed) > most or now - at >= lifetime_ms:
                del self.sealed[old]
            else:
                break  # oldest first: the rest are newer

    def sealed_prefix(self, producer: str, now: int, lifetime_ms: int) -> str | None:
        """The live seal covering `producer`, if any: a seal ends with "-", so only the
        id's starts that end with one are looked up (callers cut `producer` to the
        longest seal: `MAX_SEALED_PREFIX`)."""
        if not self.sealed:
            return None
        end = producer.find("-")
        while end >= 0:
            at = self.sealed.get(producer[: end + 1])
            if at is not None and now - at < lifetime_ms:
                return producer[: end + 1]
            end = producer.find("-", end + 1)
        return None

    def append(
        self, body: bytes, key: str | None, headers: Mapping[str, str] | None, now: int
    ) -> int:
        """Give one message the next offset and make it ready. Retention runs separately."""
        return self.append_many([(body, key, headers)], now)

    def append_many(
        self, messages: Iterable[tuple[bytes, str | None, Mapping[str, str] | None]], now: int
    ) -> int:
        """Append (body, key, headers) messages at consecutive offsets; return the first."""
        first = offset = self.next_offset
        add_to_stream = self.stream_items.append
        add_fresh = self.fresh.append
        msgs = self.msgs
        lanes = self.lanes
        size = 0
        for body, key, headers in messages:
            msg = (offset, key, body, headers, now)
            add_to_stream(msg)
            msgs[offset] = msg
            size += message_cost(body, key, headers)
            if key is None:
                add_fresh(offset)
            else:
                lane = lanes.get(key)
                if lane is None:
                    lane = lanes[key] = _Lane((offset,))
                    self._schedule(key, lane)
                else:
                    lane.offsets.append(offset)
            offset += 1
        self.next_offset = offset
        self.stream_bytes += size
        return first

    def trim_stream(self) -> None:
        """Drop the oldest messages from the stream view past retention."""
        max_count = self.options.retention_messages
        max_bytes = self.options.retention_bytes
        items = self.stream_items
        head = self.stream_head
        count = len(items) - head
        size = self.stream_bytes
        while count and (
            (max_count is not None and count > max_count)
            or (max_bytes is not None and size > max_bytes)
        ):
            msg = items[head]
            assert msg is not None
            items[head] = None
            size -= message_cost(msg[2], msg[1], msg[3])
            head += 1
            count -= 1
        self.stream_bytes = size
        if head > _COMPACT_AT and head * 2 > len(items):
            del items[:head]
            self.stream_base += head
            head = 0
        self.stream_head = head

    def read(self, start: int, end: int) -> list[Record]:
        lo = max(start, self.first_retained) - self.stream_base
        hi = min(end, self.next_offset) - self.stream_base
        if hi <= lo:
            return []
        return self.stream_items[lo:hi]  # type: ignore[return-value]

    def enforce_max_length(self) -> None:
        """Drop-head: keep at most `max_length` ready messages (dropped, not dead-lettered)."""
        limit = self.options.max_length
        if limit is None or self.options.overflow != "drop-head":
            return
        while self.ready_count > limit:
            self.outbox.append((self.remove_ready(self.oldest_ready()), "max_length", False))

    def expire(self, now: int, *, returned_too: bool = False) -> None:
        """Move ready messages past their TTL to the outbox, oldest first.

        Messages that were returned sit behind the cursor; `returned_too` (on `Tick`)
        checks them as well. Any expired message is also caught when it is about to be
        delivered.
        """
        ttl = self.options.message_ttl_ms
        if ttl is None:
            return
        msgs = self.msgs
        held = self.held
        off = self.expiry_cursor
        end = self.next_offset
        while off < end:
            msg = msgs.get(off)
            if msg is not None:
                if msg[4] + ttl > now:
                    break
                if off not in held:
                    self.outbox.append((self.remove_ready(off), "expired", True))
            off += 1
        self.expiry_cursor = off
        if not returned_too:
            return
        for off in sorted(o for o in self.returns if o not in held):
            if msgs[off][4] + ttl <= now:
                self.outbox.append((self.remove_ready(off), "expired", True))

    def purge(self) -> list[int]:
        """Remove every ready message (waiting ones too); return their offsets, ascending.
        Held messages, and the keys their holders own, stay as they are."""
        held = self.held
        msgs = self.msgs
        gone = sorted(o for o in msgs if o not in held)
        self.msgs = {o: msgs[o] for o in sorted(held)}
        self.returns = {o: n for o, n in self.returns.items() if o in held}
        self.fresh.clear()
        self.returned.clear()
        self.lanes.clear()
        self.free_keys.clear()
        for c in self.consumers.values():
            c.owned.clear()
        self.waiting.clear()
        self.timers.clear()
        self.waiting_low.clear()
        return gone

    def take_outbox(self) -> list[tuple[Record, str, bool]]:
        out = self.outbox
        self.outbox = []
        return out


__all__ = [
    "DEDUP_WINDOW",
    "HEADER_OVERHEAD",
    "MESSAGE_OVERHEAD",
    "ConsumerState",
    "ProducerState",
    "QueueState",
    "Record",
    "may_start_generation_id",
    "message_cost",
    "producer_generation",
]
