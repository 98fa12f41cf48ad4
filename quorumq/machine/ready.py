"""The index of what is ready (`ReadyIndex`) and delivery from it: the unkeyed messages
in `fresh` and `returned`, a lane per key owned by its holder, messages waiting out a
retry delay, and `dispatch`, which gives each consumer of the service queue the
lowest-offset message it may take. See `queue` for the theory of operation."""

from __future__ import annotations

from heapq import heappop, heappush

from .effects import Deliver
from .queue_base import (
    ConsumerState,
    QueueFields,
    Record,
    _Lane,
)


class ReadyIndex(QueueFields):
    """What is ready, and delivery (see the module's docstring)."""

    __slots__ = ()

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
