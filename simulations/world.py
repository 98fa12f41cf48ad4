"""The simulated world every part of a run shares: one clock, one event queue, seeded
random streams and the trace hash.

Nothing here reads the real clock or the OS's randomness. Time is an integer count of
microseconds (no float drift); events at the same time run in the order they were
scheduled. Each part of a run (Raft's election timeouts, the network, the workload, the
faults) draws from its own `random.Random`, derived from the run's seed, so changing
one part's draws does not reshuffle the others.

`patched_pysyncobj(world, ...)` points PySyncObj's clock and random module at the world,
and its journal and snapshot store at the simulated disks, for the duration of a run,
and restores them after: the simulator runs the real PySyncObj.
"""

from __future__ import annotations

import contextlib
import hashlib
import heapq
import math
import random
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, TextIO

import pysyncobj.dns_resolver
import pysyncobj.syncobj
import pysyncobj.tcp_connection
import pysyncobj.transport

US = 1_000_000
"""Microseconds per second."""
WALL_EPOCH_MS = 1_800_000_000_000
"""What the hosts' wall clocks read at simulated time 0 (before any clock fault)."""

_CLOCK_MODULES = (
    pysyncobj.syncobj,
    pysyncobj.transport,
    pysyncobj.tcp_connection,
    pysyncobj.dns_resolver,
)


def seconds(us: int) -> float:
    return us / US


def micros(s: float) -> int:
    return round(s * US)


def first_micros_at(when_s: float) -> int:
    """The first microsecond at which `World.monotonic` reads `when_s` or later. Not
    just `ceil(when_s * US)`: that product can round down, and a timer scheduled then
    would find the clock still short of its time, run nothing, and be scheduled again
    at the same instant, for ever (simulator seed 125)."""
    when = math.ceil(when_s * US)
    while when / US < when_s:
        when += 1
    while when > 0 and (when - 1) / US >= when_s:
        when -= 1
    return when


class World:
    """Clock, event queue, random streams and trace of one simulated run."""

    def __init__(self, seed: int, history: TextIO | None = None) -> None:
        """`history`: where to write every traced event, one line each (`replay`)."""
        self.seed = seed
        self.history = history
        self.now_us = 0
        self._queue: list[tuple[int, int, Callable[..., None], tuple[Any, ...]]] = []
        """Events due later than when they were scheduled: (when, number, fn, args)."""
        self._now: deque[tuple[Callable[..., None], tuple[Any, ...]]] = deque()
        """Events scheduled for the current instant, in the order scheduled. They come
        after every event of `_queue` due now (those were scheduled earlier): a queue of
        their own spares the heap a push and a pop for each of them (a third of all)."""
        self._counter = 0
        self.events_run = 0
        self.raft_random = self.stream("raft")
        self.identity_random = self.stream("cluster identities")
        """Where leaders draw cluster identities (a stream of its own: drawing one moves
        no other part of the run)."""
        self._trace = hashlib.sha256()
        self._trace_pending: list[str] = []
        """Trace lines not hashed yet: hashed in batches (`_hash_pending`), which gives
        the hash of their concatenation, the same as one update per line."""
        self.trace_lines = 0

    def stream(self, name: str) -> random.Random:
        """A random stream for one part of the run, fixed by the seed and the name."""
        digest = hashlib.sha256(f"{self.seed}:{name}".encode()).digest()
        return random.Random(int.from_bytes(digest[:8], "big"))

    # ------------------------------------------------------------------ clock

    def monotonic(self) -> float:
        """The clock PySyncObj reads (seconds)."""
        return self.now_us / US

    @property
    def now_ms(self) -> int:
        return self.now_us // 1000

    # ----------------------------------------------------------------- events

    def at(self, when_us: int, fn: Callable[..., None], *args: Any) -> None:
        """Run `fn(*args)` at simulated time `when_us` (never before now)."""
        self._counter += 1
        if when_us <= self.now_us:
            self._now.append((fn, args))
        else:
            heapq.heappush(self._queue, (when_us, self._counter, fn, args))

    def after(self, delay_us: int, fn: Callable[..., None], *args: Any) -> None:
        self._counter += 1
        if delay_us <= 0:
            self._now.append((fn, args))
        else:
            heapq.heappush(self._queue, (self.now_us + delay_us, self._counter, fn, args))

    def run_until(self, until_us: int, stop: Callable[[], bool] | None = None) -> None:
        """Run events up to `until_us` (or until `stop()` says so, checked between events).
        Events run in time order, and those due at the same time in the order they were
        scheduled: first those of the heap due now, then those scheduled now."""
        queue, now, pop, popleft = self._queue, self._now, heapq.heappop, self._now.popleft
        while True:
            if queue and queue[0][0] <= self.now_us:
                _, _, fn, args = pop(queue)
            elif now:
                fn, args = popleft()
            elif queue and queue[0][0] <= until_us:
                when, _, fn, args = pop(queue)
                self.now_us = when
            else:
                break
            self.events_run += 1
            fn(*args)
            if stop is not None and stop():
                return
        self.now_us = max(self.now_us, until_us)

    # ------------------------------------------------------------------ trace

    def trace(self, line: str) -> None:
        """Add one event to the run's trace hash (same seed, same hash, anywhere)."""
        pending = self._trace_pending
        pending.append(f"{self.now_us} {line}\n")
        if len(pending) >= 256:
            self._hash_pending()
        self.trace_lines += 1
        if self.history is not None:
            self.history.write(f"{self.now_us / US:12.6f} {line}\n")

    def _hash_pending(self) -> None:
        self._trace.update("".join(self._trace_pending).encode())
        self._trace_pending.clear()

    def trace_hash(self) -> str:
        self._hash_pending()
        return self._trace.hexdigest()


@contextlib.contextmanager
def patched_pysyncobj(
    world: World,
    create_journal: Callable[[str], Any],
    create_serializer: Callable[..., Any],
) -> Iterator[None]:
    """PySyncObj on the world's clock and random stream, with journals from
    `create_journal` and snapshot stores from `create_serializer` (in place of its
    `Serializer`, on files), until the block ends."""
    saved_clocks = [(m, m.monotonicTime) for m in _CLOCK_MODULES]
    saved_random = pysyncobj.syncobj.random
    saved_journal = pysyncobj.syncobj.createJournal
    saved_serializer = pysyncobj.syncobj.Serializer
    try:
        for module, _ in saved_clocks:
            module.monotonicTime = world.monotonic
        pysyncobj.syncobj.random = world.raft_random
        pysyncobj.syncobj.createJournal = create_journal
        pysyncobj.syncobj.Serializer = create_serializer
        yield
    finally:
        for module, clock in saved_clocks:
            module.monotonicTime = clock
        pysyncobj.syncobj.random = saved_random
        pysyncobj.syncobj.createJournal = saved_journal
        pysyncobj.syncobj.Serializer = saved_serializer
