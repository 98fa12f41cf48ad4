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
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable, Mapping
from heapq import heappop, heappush
from typing import TypeAlias

from .commands import QueueOptions, retry_delay_ms
from .effects import Deliver

Record: TypeAlias = tuple[int, str | None, bytes, Mapping[str, str] | None, int]
"""A stored message: (offset, key, body, headers, ts_ms). Never changes."""

DEDUP_WINDOW = 1024
"""How many sequence numbers back a producer's retry still gets its original offset."""

_COMPACT_AT = 1024


class ConsumerState:
    __slots__ = (
        "cancelled",
        "id",
        "in_sq",
        "keys",
        "node",
        "owned",
        "prefetch",
        "timeout_ms",
        "unacked",
    )

    def __init__(
        self, consumer_id: str, node: str, prefetch: int, timeout_ms: int | None = None
    ) -> None:
        self.id = consumer_id
        self.node = node
        self.prefetch = prefetch
        self.timeout_ms = timeout_ms
        """The subscribe's delivery timeout (None: the queue's)."""
        self.unacked: dict[int, int] = {}
        """Offsets this consumer holds, in delivery order, with when each was delivered."""
        self.keys: dict[str, int] = {}
        """Ordering keys this consumer owns, with how many of their messages it holds."""
        self.owned: list[tuple[int, str]] = []
        """Heap of (head offset, key) of owned keys that have ready messages."""
        self.in_sq = False
        self.cancelled = False

    def has_credit(self) -> bool:
        return self.prefetch == 0 or len(self.unacked) < self.prefetch


class _Lane:
    """The ready messages of one ordering key, in offset order."""

    __slots__ = ("entry", "home", "offsets")

    def __init__(self, offsets: Iterable[int]) -> None:
        self.offsets: deque[int] = deque(offsets)
        self.entry: int | None = None
        """Head offset of this lane's live heap entry, None when it has none."""
        self.home: ConsumerState | None = None
        """Whose heap the live entry is in: the owner's, or None for `free_keys`."""


_GENERATION_ID = re.compile(r"g([0-9a-f]{1,16})-[0-9a-f]{32}\Z")
_GENERATION_ID_START = re.compile(r"g[0-9a-f]{0,16}(-[0-9a-f]{0,32})?\Z")


def may_start_generation_id(prefix: str) -> bool:
    """Whether `prefix` could be the start of a client's producer id (the form
    `producer_generation` reads)."""
    return _GENERATION_ID_START.match(prefix) is not None


def producer_generation(producer: str) -> int | None:
    """The generation a producer id carries: ids of exactly the form the clients make,
    "g<1 to 16 hex digits>-<32 hex digits>", the generation (at least 1) from their wall
    clock in ms. A queue that forgot a producer refuses every unknown id of that
    generation or below (`producer_forgotten`): a resend of a forgotten producer is
    never taken for a new one. Other ids (a caller's own, say Spark's) carry none."""
    match = _GENERATION_ID.match(producer)
    if match is None:
        return None
    generation = int(match.group(1), 16)
    return generation if generation > 0 else None


class ProducerState:
    """An idempotent producer's progress on one queue."""

    __slots__ = ("last_seq", "last_ts", "runs")

    def __init__(self, last_seq: int, last_ts: int) -> None:
        self.last_seq = last_seq
        self.last_ts = last_ts
        self.runs: deque[list[int]] = deque()
        """[first_seq, first_offset, count] runs of recent sequences, oldest first."""

    def record(self, first_seq: int, first_offset: int, count: int, now: int) -> None:
        self.last_seq = first_seq + count - 1
        self.last_ts = now
        runs = self.runs
        if runs:
            last = runs[-1]
            if last[0] + last[2] == first_seq and last[1] + last[2] == first_offset:
                last[2] += count
            else:
                runs.append([first_seq, first_offset, count])
        else:
            runs.append([first_seq, first_offset, count])
        horizon = self.last_seq - DEDUP_WINDOW
        while len(runs) > 1 and runs[0][0] + runs[0][2] - 1 < horizon:
            runs.popleft()

    def offset_of(self, seq: int) -> int | None:
        for first_seq, first_offset, count in reversed(self.runs):
            if first_seq <= seq < first_seq + count:
                return first_offset + seq - first_seq
            if first_seq + count <= seq:
                return None
        return None


MESSAGE_OVERHEAD = 128
"""What a retained message costs beyond its body, key and headers (its record, offset and
time), counted toward `retention_bytes`."""


HEADER_OVERHEAD = 96
"""What a header costs beyond its name and value (its entry and two string objects)."""


def _utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8"))


def message_cost(body: bytes, key: str | None, headers: Mapping[str, str] | None) -> int:
    """Bytes a retained message counts toward `retention_bytes`: its body, its key, its
    header names and values (UTF-8 bytes), `HEADER_OVERHEAD` per header and
    `MESSAGE_OVERHEAD`. Counting the body alone let a 1 KiB retention keep 40 MiB of
    headers; counting characters and no overhead per header let 60,000 tiny headers
    count 300 KB and take 5.2 MB."""
    size = len(body) + MESSAGE_OVERHEAD
    if key is not None:
        size += _utf8_len(key)
    if headers:
        for name, value in headers.items():
            size += _utf8_len(name) + _utf8_len(value) + HEADER_OVERHEAD
    return size


class QueueState:
    __slots__ = (
        "commits",
        "consumers",
        "expiry_cursor",
        "forgotten_generation",
        "free_keys",
        "fresh",
        "held",
        "key_owner",
        "lanes",
        "msgs",
        "name",
        "next_offset",
        "options",
        "outbox",
        "producers",
        "returned",
        "returns",
        "sealed",
        "sq",
        "stream_base",
        "stream_bytes",
        "stream_head",
        "stream_items",
        "timers",
        "waiting",
        "waiting_low",
    )

    def __init__(
        self,
        name: str,
        options: QueueOptions,
        *,
        first_offset: int = 0,
        forgotten_generation: int = 0,
    ) -> None:
        """`first_offset`, `forgotten_generation`: where a queue declared under the name
        of a deleted one starts (`Machine._declare`)."""
        self.name = name
        self.options = options
        self.next_offset = first_offset
        # stream view: stream_items[i] has offset stream_base + i; retained from stream_head
        self.stream_items: list[Record | None] = []
        self.stream_base = first_offset
        self.stream_head = 0
        self.stream_bytes = 0
        # queue view
        self.msgs: dict[int, Record] = {}
        self.held: dict[int, ConsumerState] = {}
        self.returns: dict[int, int] = {}
        """Messages delivered before and returned: offset -> failed deliveries."""
        self.fresh: deque[int] = deque()
        self.returned: list[int] = []
        self.lanes: dict[str, _Lane] = {}
        self.free_keys: list[tuple[int, str]] = []
        self.key_owner: dict[str, ConsumerState] = {}
        self.consumers: dict[str, ConsumerState] = {}
        self.sq: deque[ConsumerState] = deque()
        self.producers: dict[str, ProducerState] = {}
        self.forgotten_generation = forgotten_generation
        """The highest generation of a producer id this queue forgot (`producer_generation`)."""
        self.sealed: dict[str, int] = {}
        """Producer-id prefixes no new producer may start with -> log time sealed (oldest
        first: `seal`)."""
        self.commits: dict[str, int] = {}
        self.expiry_cursor = first_offset
        self.outbox: list[tuple[Record, str, bool]] = []
        self.waiting: dict[int, int] = {}
        """Returned messages held back by a retry delay: offset -> log time it is due."""
        self.timers: list[tuple[int, int]] = []
        """Heap of (due, offset) of `waiting` (entries not matching `waiting` are stale)."""
        self.waiting_low: list[int] = []
        """Heap of the offsets of `waiting` (entries no longer in it are stale)."""

    # ----------------------------------------------------------------- counts

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

    # ------------------------------------------------------------- enqueueing

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

    # -------------------------------------------------------------- consumers

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

    # ------------------------------------------------------------- settlement

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

    # ------------------------------------------------------------ ready index

    def restore_ready(self, offsets: list[int]) -> None:
        """Rebuild the ready index from ascending ready offsets, and the timers from
        `waiting` (after a restore)."""
        waiting = self.waiting
        for off, due in sorted(waiting.items()):
            heappush(self.timers, (due, off))
            heappush(self.waiting_low, off)
        for off in offsets:
            key = self.msgs[off][1]
            if key is None:
                if off not in waiting:
                    self.fresh.append(off)
            elif key in self.lanes:
                self.lanes[key].offsets.append(off)
            else:
                self.lanes[key] = _Lane((off,))
        for key, lane in self.lanes.items():
            self._schedule(key, lane)

    def _schedule(self, key: str, lane: _Lane) -> None:
        """Make sure the lane has one live heap entry, in its owner's heap or the free one;
        none while its head waits for a retry delay (`_wake` schedules it then)."""
        head = lane.offsets[0]
        if head in self.waiting:
            lane.entry = None  # an entry in a heap is stale from now on
            return
        owner = self.key_owner.get(key)
        if lane.entry == head and lane.home is owner:
            return
        lane.entry = head
        lane.home = owner
        heappush(owner.owned if owner is not None else self.free_keys, (head, key))

    def _release(self, c: ConsumerState, key: str, n: int) -> None:
        """`c` no longer holds `n` messages of `key`; at zero the key is free again."""
        left = c.keys[key] - n
        if left:
            c.keys[key] = left
            return
        del c.keys[key]
        del self.key_owner[key]
        lane = self.lanes.get(key)
        if lane is not None:
            self._schedule(key, lane)

    def _advance_lane(self, key: str, lane: _Lane) -> None:
        """The lane's head left: skip removed offsets behind it, reschedule or drop the lane."""
        offsets = lane.offsets
        msgs = self.msgs
        offsets.popleft()
        while offsets and offsets[0] not in msgs:
            offsets.popleft()
        if offsets:
            self._schedule(key, lane)
        else:
            del self.lanes[key]

    def _peek(self, heap: list[tuple[int, str]], home: ConsumerState | None) -> tuple[int, str]:
        lanes = self.lanes
        while heap:
            top = heap[0]
            lane = lanes.get(top[1])
            if lane is not None and lane.entry == top[0] and lane.home is home:
                return top
            heappop(heap)
        return (-1, "")

    def _peek_unkeyed(self) -> int:
        msgs = self.msgs
        fresh = self.fresh
        while fresh and fresh[0] not in msgs:
            fresh.popleft()
        best = fresh[0] if fresh else -1
        returned = self.returned
        if returned:
            while returned and returned[0] not in msgs:
                heappop(returned)
            if returned and (best < 0 or returned[0] < best):
                best = returned[0]
        return best

    def _wait(self, off: int, due: int) -> None:
        """Hold returned message `off` back until log time `due`. The heaps keep stale
        entries (woken, or gone while waiting) until they surface: past twice what waits
        they are built again from `waiting` (a sorted list is a heap), so they stay
        bounded by it however many retries a queue sees."""
        waiting = self.waiting
        stale_at = 2 * len(waiting) + 32
        if len(self.timers) > stale_at or len(self.waiting_low) > stale_at:
            self.timers = sorted((d, o) for o, d in waiting.items())
            self.waiting_low = sorted(waiting)
        waiting[off] = due
        heappush(self.timers, (due, off))
        heappush(self.waiting_low, off)

    def _wake(self, now: int) -> None:
        """Make the waiting messages due at `now` ready, each at its place."""
        timers = self.timers
        waiting = self.waiting
        while timers and timers[0][0] <= now:
            due, off = heappop(timers)
            if waiting.get(off) != due:
                continue  # stale: left the queue, or woken and returned again since
            del waiting[off]
            key = self.msgs[off][1]
            if key is None:
                heappush(self.returned, off)
            else:
                lane = self.lanes[key]
                if lane.offsets[0] == off:
                    self._schedule(key, lane)

    def lowest_waiting(self) -> int:
        """Lowest offset waiting for a retry delay, or -1."""
        low = self.waiting_low
        waiting = self.waiting
        while low and low[0] not in waiting:
            heappop(low)
        return low[0] if low else -1

    def next_due(self) -> int | None:
        """When the next waiting message is due (log time), or None: from `waiting` alone,
        as every replica has it (stale timers on top are dropped first). A stale one
        answered once made a `Tick` run the queue only on the replicas that still held
        it, not on one restored from a snapshot; and, left in place with nothing due, it
        had the leader propose a `Tick` every 10 ms."""
        timers, waiting = self.timers, self.waiting
        while timers and waiting.get(timers[0][1]) != timers[0][0]:
            heappop(timers)
        return timers[0][0] if timers else None

    def oldest_ready(self) -> int:
        """Lowest ready offset (waiting ones included), or -1."""
        best = self._peek_unkeyed()
        if self.waiting:
            low = self.lowest_waiting()
            if low >= 0 and (best < 0 or low < best):
                best = low
        if self.lanes:
            candidates = [self._peek(self.free_keys, None)[0]]
            candidates += [self._peek(c.owned, c)[0] for c in self.consumers.values() if c.owned]
            for off in candidates:
                if off >= 0 and (best < 0 or off < best):
                    best = off
        return best

    def remove_ready(self, off: int) -> Record:
        """Take a ready message out of the queue view (expiry, max length)."""
        msg = self.msgs.pop(off)
        self.returns.pop(off, None)
        if self.waiting:
            self.waiting.pop(off, None)
        key = msg[1]
        if key is not None:
            lane = self.lanes[key]
            if lane.offsets[0] == off:
                self._advance_lane(key, lane)
        return msg

    def _take(self, c: ConsumerState, now: int) -> int:
        """Remove and return the next ready offset `c` may take, or -1."""
        msgs = self.msgs
        ttl = self.options.message_ttl_ms
        while True:
            best = self._peek_unkeyed()
            from_heap: list[tuple[int, str]] | None = None
            if self.lanes:
                top = self._peek(self.free_keys, None)
                if top[0] >= 0 and (best < 0 or top[0] < best):
                    best, from_heap = top[0], self.free_keys
                if c.owned:
                    top = self._peek(c.owned, c)
                    if top[0] >= 0 and (best < 0 or top[0] < best):
                        best, from_heap = top[0], c.owned
            if best < 0:
                return -1
            if self.waiting and self.options.single_active_consumer:
                low = self.lowest_waiting()
                if 0 <= low < best:
                    return -1  # strict FIFO: the queue waits for its returned message
            if ttl is not None and msgs[best][4] + ttl <= now:
                self.outbox.append((self.remove_ready(best), "expired", True))
                continue
            if from_heap is None:
                fresh = self.fresh
                if fresh and fresh[0] == best:
                    fresh.popleft()
                else:
                    heappop(self.returned)
                return best
            key = heappop(from_heap)[1]
            lane = self.lanes[key]
            lane.entry = None
            if from_heap is self.free_keys:
                self.key_owner[key] = c
                c.keys[key] = 1
            else:
                c.keys[key] += 1
            self._advance_lane(key, lane)
            return best

    # --------------------------------------------------------------- delivery

    def dispatch(self, now: int, effects: list[object]) -> None:
        """Assign ready messages round-robin over the service queue."""
        if self.timers:
            self._wake(now)
        sq = self.sq
        msgs = self.msgs
        held = self.held
        returns = self.returns
        name = self.name
        # plain FIFO (no keyed, returned or expiring messages): every ready offset is in `fresh`
        plain_fifo = (
            not self.lanes
            and not self.returned
            and not self.waiting
            and self.options.message_ttl_ms is None
        )
        fresh = self.fresh
        skipped: list[ConsumerState] = []
        add = effects.append
        while sq and (fresh if plain_fifo else len(msgs) > len(held)):
            if plain_fifo:
                off = fresh.popleft()
                if off not in msgs:
                    continue  # dropped while ready
                c = sq.popleft()
            else:
                c = sq.popleft()
                off = self._take(c, now)
                if off < 0:
                    skipped.append(c)  # nothing it may take: keeps its place at the front
                    continue
            msg = msgs[off]
            held[off] = c
            unacked = c.unacked
            unacked[off] = now
            count = returns.get(off) if returns else None
            # positional, in field order: queue, consumer, node, offset, key, body, headers,
            # redelivered, delivery_count
            add(
                Deliver(
                    name, c.id, c.node, off, msg[1], msg[2], msg[3], count is not None, count or 0
                )
            )
            if c.prefetch and len(unacked) >= c.prefetch:
                c.in_sq = False
            else:
                sq.append(c)
        if skipped:
            sq.extendleft(reversed(skipped))

    def held_deliveries(self, c: ConsumerState) -> tuple[Deliver, ...]:
        """What `c` holds, as `dispatch` delivered it (the same fields, in offset order)."""
        msgs, returns = self.msgs, self.returns
        out = []
        for off in sorted(c.unacked):
            msg = msgs[off]
            count = returns.get(off)
            out.append(
                Deliver(
                    self.name,
                    c.id,
                    c.node,
                    off,
                    msg[1],
                    msg[2],
                    msg[3],
                    count is not None,
                    count or 0,
                )
            )
        return tuple(out)

    def timed_out(self, now: int, default_ms: int) -> list[ConsumerState]:
        """Consumers that have held a delivery longer than their timeout at `now`."""
        queue_ms = self.options.consumer_timeout_ms
        out = []
        for c in self.consumers.values():
            if c.unacked:
                limit = c.timeout_ms if c.timeout_ms is not None else queue_ms
                if now - min(c.unacked.values()) > (default_ms if limit is None else limit):
                    out.append(c)
        return out

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
