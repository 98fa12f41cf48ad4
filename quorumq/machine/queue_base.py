"""What a queue's parts share (`queue`, `ready`, `consumers`): the stored record, the
consumer, key-lane and producer states, and the queue's fields (`QueueFields`: its
slots, set up once)."""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable, Mapping
from typing import TypeAlias

from .commands import QueueOptions

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


class QueueFields:
    """A queue's fields (see `queue` for what each view holds)."""

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
