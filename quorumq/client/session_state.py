"""What the client session's parts share (`session`, `publishing`, `consuming`): the
events a session returns to its shell, the limits and delays, and its state with the
way a request is made (`SessionState`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import attrs

from .core import (
    MAX_GENERATION,
    RETRIABLE,
    Delivery,
    Producer,
    QuorumqError,
    generation_id,
)

logger = logging.getLogger(__name__)

_LONGEST_ID = generation_id(MAX_GENERATION)
"""A producer id as long as the client makes them: for sizing a frame before it is sent."""

REWIND_DELAY = 0.05
"""Seconds before resending a queue's unconfirmed publishes after a retriable failure."""

PARKED_RETRY_DELAY = 1.0
"""Seconds before sending again, on the same connection, a publish whose resend the node
refused for now (`PASSING_REFUSALS`: a queue full for now): it stays live until a node
answers it, and must not wait for a reconnect that may never come: the earliest parked
publish of each producer is sent. The delay doubles with each refusal in a row, up to
`PARKED_RETRY_LONGEST`, and starts over once a publish to the queue is confirmed; each
producer's earliest publish still parked is then sent again at once (its confirm sends
the next)."""
PARKED_RETRY_LONGEST = 30.0
PASSING_REFUSALS = frozenset({"queue_full", "too_many_producers", "disk_alarm"})
"""Refusals that may not hold later on the same connection. Others (a node's
`--max-body`, say) hold until the client reconnects (perhaps to another node)."""

MAX_UNCONFIRMED = 10_000
"""Unconfirmed publishes (requests: a batch counts once) a client holds at most."""
MAX_UNCONFIRMED_BYTES = 64 * 1024 * 1024
"""Bytes of unconfirmed publishes (bodies, keys, headers) a client holds at most."""

SUBSCRIBE_RETRIABLE = RETRIABLE | {"node_down"}
"""Error codes after which a subscribe is tried again."""
SUBSCRIBE_RETRY_FIRST = 0.05
"""Seconds before subscribing again after a first retriable failure; doubled after each."""
SUBSCRIBE_RETRY_LONGEST = 1.0
"""The longest wait between two attempts to subscribe."""


class ConsumerLike(Protocol):
    id: str
    queue: str
    prefetch: int
    cancel_requested: bool
    """Set by `ClientSession.cancel` (and by the shell when the consumer ends): it is
    never subscribed again, and a subscription of it answered late is cancelled."""


@attrs.frozen
class Resolved:
    request_id: int
    frame: dict[str, Any]


@attrs.frozen
class Failed:
    request_id: int
    error: QuorumqError


@attrs.frozen
class Delivered:
    consumer: Any
    delivery: Delivery


@attrs.frozen
class ConsumerEnded:
    consumer: Any
    reason: str


@attrs.frozen
class Resubscribe:
    consumer: Any


@attrs.frozen
class Send:
    """Write `frame` now; nobody waits for its answer (a cancel of a subscription that
    nobody reads, a nack of what such a subscription was given)."""

    frame: dict[str, Any]


@attrs.frozen
class RewindLater:
    """Call `rewind(queue)` after `delay` seconds and send what it returns."""

    queue: str
    delay: float = REWIND_DELAY


Event = Resolved | Failed | Delivered | ConsumerEnded | Resubscribe | RewindLater | Send


def _at_least(rows: list[list[Any]]) -> int:
    """Bytes the rows take in a frame, at least (their text and bodies, no framing)."""
    size = 0
    for body, key, headers in rows:
        size += len(body) + (len(key.encode()) if key else 0)
        if headers:
            size += sum(len(k.encode()) + len(v.encode()) for k, v in headers.items())
    return size


def _size_of(frame: Mapping[str, Any]) -> int:
    """What a publish or publish_batch frame's messages take (`_at_least`)."""
    if frame["t"] == "publish":
        return _at_least([[frame["body"], frame["key"], frame["headers"]]])
    return _at_least(frame["messages"])


def keys_of(frame: Mapping[str, Any]) -> frozenset[str]:
    """The keys of a publish or publish_batch frame (none for any other frame)."""
    if frame["t"] == "publish":
        return frozenset({frame["key"]}) if frame["key"] is not None else frozenset()
    if frame["t"] == "publish_batch":
        return frozenset(key for _, key, _ in frame["messages"] if key is not None)
    return frozenset()


def _numbers(frame: Mapping[str, Any]) -> Sequence[int]:
    """The sequence numbers a publish or publish_batch frame carries."""
    if frame["t"] == "publish":
        return (int(frame["seq"]),)
    seqs = frame.get("seqs")
    if seqs is not None:
        return seqs  # type: ignore[no-any-return]
    first = int(frame["first_seq"])
    return range(first, first + len(frame["messages"]))


class SessionState:
    """The session's state, and how a request is made and remembered (see `session`)."""

    def __init__(
        self,
        settle: Callable[[Delivery, bool, bool, int | None], Any],
        *,
        max_unconfirmed: int = MAX_UNCONFIRMED,
        max_unconfirmed_bytes: int = MAX_UNCONFIRMED_BYTES,
        producer: Producer | None = None,
    ) -> None:
        """`max_unconfirmed`, `max_unconfirmed_bytes`: how many unconfirmed publishes,
        and how many bytes of them, the session holds at most; a publish past either
        fails before anything is sent (`TooManyUnconfirmedError`). Unconfirmed publishes
        are kept, and resent, until answered: a node that never answers would otherwise
        make them grow without bound. `producer`: where producer ids come from (the
        simulator gives one on its own clock and random stream)."""
        if max_unconfirmed < 1 or max_unconfirmed_bytes < 1:
            raise ValueError("max_unconfirmed and max_unconfirmed_bytes must be positive")
        self.max_unconfirmed = max_unconfirmed
        self.max_unconfirmed_bytes = max_unconfirmed_bytes
        self.producer = producer if producer is not None else Producer()
        self.consumers: dict[str, Any] = {}
        self._settle = settle
        self._next_id = 1
        self._pending: set[int] = set()
        self._unconfirmed: dict[int, dict[str, Any]] = {}
        self._unconfirmed_bytes = 0
        """Bytes of the unconfirmed publishes' bodies, keys and headers."""
        self._subscribing: dict[int, Any] = {}
        self._rewinding: set[str] = set()
        self._resent: set[int] = set()
        """Publishes sent more than once: a refusal of a resend leaves the outcome unknown."""
        self._attempts: dict[int, int] = {}
        """Live publishes -> attempts sent on this connection and not answered yet. The
        node answers each attempt once (with its proposal's outcome, or outcome_unknown
        at its proposal timeout). A retriable refusal of one while a newer attempt is
        out is stale: that newer one's answer decides (a rewind for every stale refusal
        would resend the whole queue again and again, a storm under load)."""
        self._chosen: set[int] = set()
        """Live publishes under a producer id and sequence numbers their caller chose."""
        self._parked: set[int] = set()
        """Live publishes whose resend this connection's node refused: sent again on the
        next connection, or on this one after `PARKED_RETRY_DELAY` (outcome unknown until
        a node answers them)."""
        self._parked_retry: set[str] = set()
        """Queues whose parked publishes are due to be sent again at their `rewind`."""
        self._parked_delay: dict[str, float] = {}
        """Per queue: the delay of its next parked retry (doubling, `PARKED_RETRY_DELAY`)."""
        self._retry_parked: set[int] = set()
        """Parked publishes refused for now (`PASSING_REFUSALS`): sent again on this
        connection, the earliest of each producer first."""
        self._told_unknown: set[int] = set()
        """Live publishes whose caller was told the outcome is unknown (told once)."""
        self._live: dict[tuple[str, str], dict[str, int]] = {}
        """(queue, key) -> producer id -> how many unconfirmed publishes of that key the
        producer has: the keys still settling, and under which ids. A publish of a key
        under another producer id than one of these waits (`_check_not_behind`)."""
        self._abandoned: set[int] = set()
        """Subscribes whose caller stopped waiting: if one succeeds, it is cancelled."""
        self._ghosts: set[str] = set()
        """Consumer ids subscribed for nobody (abandoned, or cancelled meanwhile), being
        cancelled on this connection: what they are given is nacked back at once."""
        self.closed = False
        self.connected = False
        """Between `connection_made` and `connection_lost`."""
        self.max_body: int | None = None
        self.max_frame: int | None = None
        """The connected node's limits (from its welcome): a publish that can never fit
        fails at once, instead of being resent for ever to a node that drops it."""
        self.lost: QuorumqError | None = None
        """Why the client gave up reaching any node (`give_up`); it will not reconnect."""

    def request(
        self,
        frame: dict[str, Any],
        *,
        idempotent: bool = False,
        subscribing: Any = None,
    ) -> tuple[int, dict[str, Any]]:
        """Give `frame` a request id; return (id, frame to send)."""
        if self.closed:
            raise QuorumqError("the client is closed")
        request_id = self._next_id
        self._next_id += 1
        frame = {**frame, "id": request_id}
        self._pending.add(request_id)
        if idempotent:
            self._add_unconfirmed(request_id, frame)
            self._attempts[request_id] = 1
        if subscribing is not None:
            self._subscribing[request_id] = subscribing
        return request_id, frame

    def _add_unconfirmed(self, request_id: int, frame: dict[str, Any]) -> None:
        self._unconfirmed[request_id] = frame
        self._unconfirmed_bytes += _size_of(frame)
        for key in keys_of(frame):
            producers = self._live.setdefault((frame["queue"], key), {})
            producers[frame["producer"]] = producers.get(frame["producer"], 0) + 1
