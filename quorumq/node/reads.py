"""Reads that wait for this node's replica to apply their range (`read` with `wait_ms`).

Theory of operation. A waiting read sits in two heaps: its queue's, ordered by the end
it needs, and one heap of deadlines shared by all. When the replica's end of a queue
moves, `ready(queue, end)` takes the reads that end covers off the top of that queue's
heap: the work is one pop per read that comes out, whatever else waits, on that queue
or another. `expired(now)` takes the reads whose deadline passed off the top of the
deadline heap the same way, and `next_deadline` is its top. A read taken out through one
heap stays in the other as a dead entry, skipped when it comes to the top; a heap whose
dead entries outnumber its live ones is rebuilt without them, so what is held stays
within about twice the reads that wait. A read that came out while its connection had no
room for the answer is held (`hold`) until it has (`next_due`), and still counts. A
connection's reads go when it closes (`drop`).

No I/O, no clock, no replica: the node core (`NodeCore`) says when a queue's end moved
and what time it is, and answers the reads that come out. `steps` counts the heap
entries looked at or moved, the work tests count (the suite times nothing).
"""

from __future__ import annotations

import collections
import heapq
import itertools
from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

import attrs

from ..wire.protocol import Frame

Owner = TypeVar("Owner", bound=Hashable)
"""Who asked: a connection."""
K = TypeVar("K", int, float)


@attrs.define(eq=False)
class WaitingRead(Generic[Owner]):
    """A read of `queue` that needs its replica's end at `end` or past it by `deadline`."""

    owner: Owner
    frame: Frame
    queue: str
    end: int
    deadline: float
    waiting: bool = True


class _Heap(Generic[K, Owner]):
    """Reads by key, with the entries of reads no longer waiting left in until they come to
    the top or outnumber the live ones."""

    __slots__ = ("dead", "entries")

    def __init__(self) -> None:
        self.entries: list[tuple[K, int, WaitingRead[Owner]]] = []
        self.dead = 0

    def live(self) -> int:
        return len(self.entries) - self.dead

    def push(self, key: K, order: int, read: WaitingRead[Owner]) -> None:
        heapq.heappush(self.entries, (key, order, read))

    def left(self) -> int:
        """One of its reads stopped waiting (through the other heap): the entries looked
        at, if that made it rebuild, else 0."""
        self.dead += 1
        if self.dead <= len(self.entries) // 2:
            return 0
        looked_at = len(self.entries)
        self.entries = [e for e in self.entries if e[2].waiting]
        heapq.heapify(self.entries)
        self.dead = 0
        return looked_at

    def pop_through(self, key: K) -> Iterator[tuple[int, WaitingRead[Owner] | None]]:
        """Pop the entries up to `key`: (1, read) for each live one, (1, None) for a dead
        one, so that the caller counts each."""
        entries = self.entries
        while entries and entries[0][0] <= key:
            read = heapq.heappop(entries)[2]
            if read.waiting:
                yield 1, read
            else:
                self.dead -= 1
                yield 1, None

    def top(self) -> tuple[int, K | None]:
        """(entries dropped, the smallest key of a live read, or None)."""
        entries = self.entries
        dropped = 0
        while entries and not entries[0][2].waiting:
            heapq.heappop(entries)
            self.dead -= 1
            dropped += 1
        return dropped, (entries[0][0] if entries else None)


class WaitingReads(Generic[Owner]):
    """The reads a node holds until its replica applies their range; see the module's
    docstring."""

    def __init__(self) -> None:
        self._by_queue: dict[str, _Heap[int, Owner]] = {}
        self._deadlines: _Heap[float, Owner] = _Heap()
        self._by_owner: dict[Owner, set[WaitingRead[Owner]]] = {}
        self._due: dict[Owner, collections.deque[WaitingRead[Owner]]] = {}
        self._due_count = 0
        self._order = itertools.count()
        self._count = 0
        self.steps = 0
        """Heap entries looked at or moved so far."""

    def __len__(self) -> int:
        """The reads that wait, or are held for room."""
        return self._count + self._due_count

    def waiting(self, owner: Owner) -> int:
        """How many of `owner`'s reads wait, or are held for room."""
        return len(self._by_owner.get(owner, ())) + len(self._due.get(owner, ()))

    def queues(self) -> set[str]:
        """The queues some read waits on."""
        return set(self._by_queue)

    def held(self) -> int:
        """Entries held in every index, dead ones included (tests check there is no leak)."""
        return (
            sum(len(h.entries) for h in self._by_queue.values())
            + len(self._deadlines.entries)
            + sum(len(reads) for reads in self._by_owner.values())
            + self._due_count
        )

    def add(self, owner: Owner, frame: Frame, queue: str, end: int, deadline: float) -> None:
        """Hold a read of `queue` until its end reaches `end` or `deadline` passes."""
        read: WaitingRead[Owner] = WaitingRead(owner, frame, queue, end, deadline)
        order = next(self._order)
        heap = self._by_queue.get(queue)
        if heap is None:
            heap = self._by_queue[queue] = _Heap()
        heap.push(end, order, read)
        self._deadlines.push(deadline, order, read)
        self._by_owner.setdefault(owner, set()).add(read)
        self._count += 1
        self.steps += 1

    def ready(self, queue: str, end: int) -> list[WaitingRead[Owner]]:
        """Take out the reads of `queue` that its end, now `end`, covers."""
        heap = self._by_queue.get(queue)
        if heap is None:
            return []
        out: list[WaitingRead[Owner]] = []
        for steps, read in heap.pop_through(end):
            self.steps += steps
            if read is not None:
                self._taken(read)
                self.steps += self._deadlines.left()
                out.append(read)
        if heap.live() == 0:
            del self._by_queue[queue]
        return out

    def expired(self, now: float) -> list[WaitingRead[Owner]]:
        """Take out the reads whose deadline is `now` or before."""
        out: list[WaitingRead[Owner]] = []
        for steps, read in self._deadlines.pop_through(now):
            self.steps += steps
            if read is not None:
                self._taken(read)
                self._left_queue(read.queue)
                out.append(read)
        return out

    def next_deadline(self) -> float | None:
        """The earliest deadline of a read that waits, or None."""
        dropped, deadline = self._deadlines.top()
        self.steps += dropped
        return deadline

    def hold(self, read: WaitingRead[Owner]) -> None:
        """Hold a read that came out until its owner has room for the answer."""
        self._due.setdefault(read.owner, collections.deque()).append(read)
        self._due_count += 1

    def next_due(self, owner: Owner) -> WaitingRead[Owner] | None:
        """The oldest of `owner`'s reads held for room, taken out; or None."""
        due = self._due.get(owner)
        if due is None:
            return None
        read = due.popleft()
        self._due_count -= 1
        if not due:
            del self._due[owner]
        return read

    def drop(self, owner: Owner) -> int:
        """Forget `owner`'s reads (its connection closed); how many there were."""
        reads = self._by_owner.pop(owner, set())
        for read in reads:
            read.waiting = False
            self._count -= 1
            self._left_queue(read.queue)
            self.steps += self._deadlines.left()
        due = len(self._due.pop(owner, ()))
        self._due_count -= due
        return len(reads) + due

    def _taken(self, read: WaitingRead[Owner]) -> None:
        read.waiting = False
        self._count -= 1
        mine = self._by_owner[read.owner]
        mine.discard(read)
        if not mine:
            del self._by_owner[read.owner]

    def _left_queue(self, queue: str) -> None:
        heap = self._by_queue[queue]
        if heap.live() == 1:  # its last read: the heap goes, dead entries and all
            self.steps += len(heap.entries)
            del self._by_queue[queue]
        else:
            self.steps += heap.left()
