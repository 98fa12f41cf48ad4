"""The client's protocol state, sans I/O: what to send, and what a received frame means.

The blocking client and the trio client are shells around one `ClientSession`: they
do the socket work and turn its events into futures, queue puts and timers. The session
keeps what makes publishing idempotent and ordered:

* every publish has a producer id and sequence number (per queue) and stays
  "unconfirmed" until its reply; after a reconnect, or a retriable failure, the
  unconfirmed publishes of a queue are resent in sequence order (a "rewind"), and the
  queue recognises the ones it already has; a retriable failure of an attempt that a
  rewind has already sent again is stale, and starts no other rewind;
* a publish whose confirm the caller stopped waiting for (a timeout, a cancellation)
  stays live and is resent as any other; its key is paused (`outcome_unknown`), so
  neither an application's retry nor a later publish of the key overtakes it; and
  `resume(key)` is refused while the key has a live publish (`settling_keys()`): once it
  has none, nothing more can land for it, and a read tells what did;
* at most `max_unconfirmed` publishes (and `max_unconfirmed_bytes` of them) are live:
  past that a publish fails before anything is sent (`TooManyUnconfirmedError`);
* resends go out in the order the publishes were first sent, across producer ids
  (a producer id is renewed after a failure), so a key's order holds;
* the queue orders each producer id's sequence alone, so a key with a publish still
  unconfirmed under one id (this client's, retired by a failure, or one a caller chose)
  takes no publish under another until that one is answered; which keys are waiting
  is derived from the live publishes, so none can stay wedged once they are answered;
* a cancelled consumer is never subscribed again after a reconnect (its
  `cancel_requested`, set at once, outlives its id); a subscribe answered after its
  caller stopped waiting, or for a consumer cancelled meanwhile, is cancelled at once,
  and what it was given is nacked back to the queue;
* a request whose caller stopped waiting is forgotten (`abandon`), so a node that never
  answers leaves nothing growing behind;
* a publish refused for certain (its only attempt refused, or the queue expects a
  sequence number no live publish holds) makes the later ones of that producer
  impossible (the queue expects the refused sequence next): they fail too, "not
  published", and the queue gets a fresh producer id. (Expecting 0 from this client's
  own producer id, whose 0 it took, the queue shows it forgot the producer: an earlier
  attempt may have landed, none can any more; outcome unknown, and no longer live.);
* a resend refused (a node with a smaller --max-body, a queue full for now) settles
  nothing: an earlier attempt may have landed or may yet. The caller is told outcome
  unknown, the key paused; the publish stays live and goes again on the next
  connection, and the later ones of its producer stay live, each settled by its answer;
* a subscription is registered when its reply is read, before the deliveries that
  follow it on the same connection;
* a subscribe (the user's, or a consumer's after its connection broke or its node was
  cut off) that failed because of a leader change or a lost connection is tried again,
  with backoff, until the client's timeout (`subscribe_retry_delay`). That is safe: a
  Subscribe whose outcome was unknown but which landed leaves a consumer that no
  connection serves, and its node proposes that consumer's Down, so what it was given
  returns to the queue.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import attrs

from ..machine.commands import MAX_SEQ, check_seqs
from ..wire.protocol import encode_frame
from .core import (
    MAX_GENERATION,
    RETRIABLE,
    ConnectionLostError,
    Delivery,
    KeyPausedError,
    OutcomeUnknownError,
    Producer,
    QuorumqError,
    RefusedBeforeError,
    ServerError,
    TooManyUnconfirmedError,
    delivery_from,
    generation_id,
    publish_frame,
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
`PARKED_RETRY_LONGEST`, and starts over once a publish to the queue is confirmed; every
publish of the queue still parked is then sent again at once."""
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


class ClientSession:
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

    # --------------------------------------------------------------- outgoing

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

    def publish(
        self, queue: str, body: bytes, key: str | None, headers: Mapping[str, str] | None
    ) -> tuple[int, dict[str, Any]]:
        self.producer.check(key)
        self._check_not_behind(queue, [key], self.producer.id_for(queue))
        self._check_fits(
            [[body, key, headers]],
            lambda: publish_frame(0, queue, body, key, headers, _LONGEST_ID, 2**62),
        )
        self._check_room([[body, key, headers]])
        producer, seq = self.producer.take(queue)
        frame = publish_frame(0, queue, body, key, headers, producer, seq)
        return self.request(frame, idempotent=True)

    def publish_batch(
        self,
        queue: str,
        rows: list[list[Any]],
        producer: str | None = None,
        first_seq: int | None = None,
        seqs: list[int] | None = None,
        opens: bool = False,
    ) -> tuple[int, dict[str, Any]]:
        """A batch under this client's producer id, or under the caller's `producer` and
        `first_seq`, or `producer` and one sequence number per message (`seqs`, strictly
        increasing): a caller that derives them from its input, so that a replay of the
        same input is recognised by the queue. `opens`: this `seqs` batch is the
        producer's first (a producer the queue does not know takes only that one)."""
        if seqs is not None:
            if producer is None or first_seq is not None:
                raise ValueError("seqs go with a producer, and without first_seq")
            check_seqs(seqs, len(rows))
            if any(
                f["queue"] == queue and f["producer"] == producer
                for f in self._unconfirmed.values()
            ):
                # the queue would take the later batch first and the earlier one, resent,
                # for a duplicate of numbers below the producer's last: lost
                raise QuorumqError(
                    f"a batch under producer {producer!r} numbered by seqs is still live: "
                    "send the next one once it is answered"
                )
        elif opens:
            raise ValueError("opens goes with seqs")
        elif (producer is None) != (first_seq is None):
            raise ValueError("producer and first_seq go together")
        elif first_seq is not None and not 0 <= first_seq <= MAX_SEQ - len(rows):
            raise ValueError(f"first_seq must be in 0..{MAX_SEQ - len(rows)}, got {first_seq}")
        for _, key, _ in rows:
            self.producer.check(key)
        own = producer if producer is not None else self.producer.id_for(queue)
        self._check_not_behind(queue, [key for _, key, _ in rows], own)
        self._check_fits(
            rows,
            lambda: {
                "t": "publish_batch",
                "queue": queue,
                "messages": rows,
                "producer": producer or _LONGEST_ID,
                "first_seq": 2**62,
                "id": 2**62,
                **({} if seqs is None else {"seqs": [2**62] * len(rows)}),
            },
        )
        self._check_room(rows)
        chosen = producer is not None
        if producer is None:
            producer, first_seq = self.producer.take(queue, len(rows))
        frame: dict[str, Any] = {
            "t": "publish_batch",
            "queue": queue,
            "messages": rows,
            "producer": producer,
            "first_seq": first_seq,
        }
        if seqs is not None:
            frame["seqs"] = list(seqs)
            if opens:
                frame["opens"] = True
        request_id, frame = self.request(frame, idempotent=True)
        if chosen:
            self._chosen.add(request_id)
        return request_id, frame

    def subscribe(self, consumer: ConsumerLike) -> tuple[int, dict[str, Any]]:
        """The subscribe request; `ConnectionLostError` while there is no connection (a
        request sent then would be lost without an answer, and only publishes are sent
        again on the next connection)."""
        if consumer.cancel_requested:
            raise QuorumqError("the consumer was cancelled: it is not subscribed again")
        if not self.connected and not self.closed:
            if self.lost is not None:
                raise ConnectionLostError(str(self.lost))
            raise ConnectionLostError("not connected: the client is reconnecting")
        frame = {"t": "subscribe", "queue": consumer.queue, "prefetch": consumer.prefetch}
        timeout_ms = getattr(consumer, "timeout_ms", None)
        if timeout_ms is not None:
            frame["timeout_ms"] = timeout_ms
        return self.request(frame, subscribing=consumer)

    def subscribe_retry_delay(
        self, error: QuorumqError, attempt: int, time_left: float
    ) -> float | None:
        """Seconds to wait before subscribing again after attempt number `attempt` (1, 2,
        ...) failed with `error`, `time_left` seconds before the deadline; None: give up.

        Tried again: a failure a leader change explains (`RETRIABLE`), the node being
        marked down (it is cut off from the leader; it is marked up when it is back), a lost
        connection (the client reconnects meanwhile). Not: any other refusal (say
        `unknown_queue`), a closed client, a client that gave up reaching any node, and
        a wait that would end past the deadline."""
        if self.closed or self.lost is not None:
            return None
        retriable = isinstance(error, ConnectionLostError) or (
            isinstance(error, ServerError) and error.code in SUBSCRIBE_RETRIABLE
        )
        if not retriable:
            return None
        delay = min(SUBSCRIBE_RETRY_FIRST * 2 ** (attempt - 1), SUBSCRIBE_RETRY_LONGEST)
        return delay if delay < time_left else None

    def resubscribe_failed(self, queue: str, error: QuorumqError) -> str:
        """Why a consumer of `queue` ends after it could not subscribe again (said in
        the log too, unless the client was closed)."""
        if self.closed:
            return "client closed"
        logger.warning("a consumer of %r ends: could not subscribe again: %s", queue, error)
        return f"could not subscribe again: {error}"

    def settle_frame(
        self, delivery: Delivery, ack: bool, requeue: bool, delay_ms: int | None = None
    ) -> dict[str, Any] | None:
        """The ack or nack to send; None for a delivery to an earlier subscription (it
        is redelivered anyway)."""
        if delivery.consumer not in self.consumers:
            return None
        frame: dict[str, Any] = {
            "t": "ack" if ack else "nack",
            "consumer": delivery.consumer,
            "offsets": [delivery.offset],
        }
        if not ack:
            frame["requeue"] = requeue
            if delay_ms is not None:
                frame["delay_ms"] = delay_ms
        return frame

    def unconfirmed(
        self, queue: str | None = None, only: set[int] | None = None
    ) -> list[dict[str, Any]]:
        """Unconfirmed publishes (of `queue`, or all; or the request ids `only`) to send
        again, in the order they were first sent (request ids grow in send order; per
        producer that is sequence order), marked as resends. Not by producer id: a
        renewed id is random, and its publishes would overtake earlier ones of the same
        key half of the time. Not those whose resend this connection's node refused:
        they go on the next connection, or after `PARKED_RETRY_DELAY`."""
        frames = [
            (r, f)
            for r, f in sorted(self._unconfirmed.items())
            if (queue is None or f["queue"] == queue)
            and r not in self._parked
            and (only is None or r in only)
        ]
        self._resent.update(r for r, _ in frames)
        for request_id, _ in frames:
            self._attempts[request_id] = self._attempts.get(request_id, 0) + 1
        return [{**f, "retry": True} for _, f in frames]

    def outcome_unknown(self, request_id: int, why: str) -> OutcomeUnknownError | None:
        """The caller stops waiting for publish `request_id` (a timeout, a cancellation).

        Not answered yet: the publish stays live (it is resent until answered, its answer
        then read and dropped), its keys are paused, and the error to raise says so.
        Already answered (the answer was read, and is on its way to the caller): None,
        and nothing changes; the caller takes that answer. Reporting "outcome unknown"
        then would leave the key unpaused for a publish whose outcome the caller never
        learns, and the application's retry would publish it twice."""
        if request_id not in self._pending:
            return None
        publish = self._unconfirmed.get(request_id)
        if publish is None:
            return OutcomeUnknownError(why)
        self._keys_failed([publish])
        keys = sorted(keys_of(publish))
        paused = f"; key{'s' if len(keys) > 1 else ''} {', '.join(map(repr, keys))} paused"
        return OutcomeUnknownError(
            f"{why}: the publish may still land (it is being resent, and is never enqueued "
            f"twice); do not publish it again{paused if keys else ''} (once the key has left "
            "settling_keys(), read to see whether it landed, then resume it)"
        )

    def cancelled_while_waiting(self, request_id: int, keys: Iterable[str]) -> None:
        """A caller was cancelled (trio) while waiting for publish `request_id`, of
        `keys`: it never learns the outcome, so the keys are paused as after any outcome
        unknown, even if the answer was read just before (the application cannot tell,
        and its retry would publish the message twice)."""
        if self.outcome_unknown(request_id, "cancelled") is None:
            for key in keys:
                self.producer.failed(key)

    def cancel(self, consumer: ConsumerLike) -> tuple[int, dict[str, Any]] | None:
        """The application cancels `consumer`: it is never subscribed again (nor after a
        reconnect), and stays registered for its acks. The cancel request to send if it
        is subscribed on this connection; None if not (a subscribe of it still out is
        cancelled when its answer comes, see `_resolve`)."""
        consumer.cancel_requested = True
        if self.consumers.get(consumer.id) is not consumer:
            return None
        return self.request({"t": "cancel", "consumer": consumer.id})

    def abandon(self, request_id: int) -> bool:
        """The caller stops waiting for `request_id`, a request other than a publish (a
        timeout, a cancellation; for a publish see `outcome_unknown`). True: no answer
        yet, and none is kept for it (a subscribe that succeeds later is cancelled at
        once: a consumer nobody reads would hold `prefetch` messages, and be subscribed
        again after every reconnect). False: its answer was read; the caller takes it."""
        if request_id not in self._pending:
            return False
        if request_id in self._unconfirmed:
            raise ValueError("a publish is not abandoned: see outcome_unknown")
        if request_id in self._subscribing:
            self._abandoned.add(request_id)  # its answer must still be read
        else:
            self._pending.discard(request_id)
        return True

    def rewind(self, queue: str) -> list[dict[str, Any]]:
        """What to send now that a `RewindLater(queue)` is due: the queue's live
        publishes after a retriable failure; its parked ones (`PARKED_RETRY_DELAY`);
        nothing if an earlier rewind sent them already."""
        everything = queue in self._rewinding
        parked_due = queue in self._parked_retry
        self._rewinding.discard(queue)
        self._parked_retry.discard(queue)
        if not parked_due:
            return self.unconfirmed(queue) if everything else []
        due = self._parked_heads(queue)
        self._parked -= due
        self._retry_parked -= due
        return self.unconfirmed(queue, None if everything else due)

    # ------------------------------------------------------------- connection

    def connection_made(self, welcome: Mapping[str, Any] | None = None) -> None:
        """A new connection is in place (its unconfirmed publishes are being sent)."""
        self.connected = True
        self._parked.clear()  # sent again now, to this node
        self._parked_retry.clear()
        self._retry_parked.clear()
        self._parked_delay.clear()
        self._attempts.clear()  # answers to the last connection's attempts never come
        if welcome is not None:
            body, frame = welcome.get("max_body"), welcome.get("max_frame")
            self.max_body = body if type(body) is int else None
            self.max_frame = frame if type(frame) is int else None

    def settling_keys(self) -> set[str]:
        """Keys with a publish still live: unconfirmed, and resent until answered. Once a
        key has left, nothing more can land for it, and a read tells what did."""
        return {key for _, key in self._live}

    def queue_deleted(self, queue: str) -> None:
        """This client deleted `queue`: publishes to one declared again under the name go
        under a new producer id, from seq 0 (the new queue refuses the deleted one's
        producer ids as forgotten, and the next publish would fail)."""
        self.producer.renew(queue)

    def resume(self, key: str) -> None:
        """Publishing `key` may go on. Refused (`KeyPausedError`) while the key has a
        live publish: one whose outcome is unknown may still land, so a read that misses
        it proves nothing, and a retry decided on it would be a second message."""
        if key in self.settling_keys():
            raise KeyPausedError(
                f"key {key!r} still has a publish that is live (unconfirmed, being resent "
                f"until a node answers it): wait until {key!r} leaves settling_keys(); then "
                "nothing more can land for it, a read tells whether it landed, and "
                f"resume({key!r}) is allowed"
            )
        self.producer.paused.discard(key)

    def _check_not_behind(self, queue: str, keys: Iterable[str | None], producer: str) -> None:
        """`KeyPausedError` for a publish under `producer` of a key that has a publish
        still unconfirmed under another producer id (a failure retired this client's
        id, or a caller chose its own): the queue orders each producer's sequence alone,
        so if the earlier one is lost and resent, it would land after this one."""
        for key in keys:
            if key is None:
                continue
            others = self._live.get((queue, key), {}).keys() - {producer}
            if others:
                raise KeyPausedError(
                    f"an earlier publish of key {key!r} to {queue!r} is still unconfirmed "
                    "under another producer id, and could land after this one: publish it "
                    f"once {key!r} has left settling_keys()"
                )

    def _check_room(self, rows: list[list[Any]]) -> None:
        """`TooManyUnconfirmedError` for a publish past the session's limits (one
        publish alone always fits: the node's --max-body bounds it)."""
        if len(self._unconfirmed) >= self.max_unconfirmed:
            raise TooManyUnconfirmedError(
                f"not sent: {len(self._unconfirmed)} publishes are unconfirmed, the "
                f"client's limit (max_unconfirmed={self.max_unconfirmed}); the key is not "
                "paused: wait for confirms and publish it again, or raise max_unconfirmed"
            )
        size = _at_least(rows)
        if self._unconfirmed and self._unconfirmed_bytes + size > self.max_unconfirmed_bytes:
            raise TooManyUnconfirmedError(
                f"not sent: {self._unconfirmed_bytes} bytes of publishes are unconfirmed, "
                f"and {size} more would pass the client's limit (max_unconfirmed_bytes="
                f"{self.max_unconfirmed_bytes}); the key is not paused: wait for confirms "
                "and publish it again, or raise max_unconfirmed_bytes"
            )

    def _add_unconfirmed(self, request_id: int, frame: dict[str, Any]) -> None:
        self._unconfirmed[request_id] = frame
        self._unconfirmed_bytes += _size_of(frame)
        for key in keys_of(frame):
            producers = self._live.setdefault((frame["queue"], key), {})
            producers[frame["producer"]] = producers.get(frame["producer"], 0) + 1

    def _drop_unconfirmed(self, request_id: int) -> dict[str, Any] | None:
        """No longer live (answered, or certainly never to land)."""
        frame = self._unconfirmed.pop(request_id, None)
        self._chosen.discard(request_id)
        if frame is None:
            return None
        self._unconfirmed_bytes -= _size_of(frame)
        for key in keys_of(frame):
            where = (frame["queue"], key)
            producers = self._live[where]
            producers[frame["producer"]] -= 1
            if not producers[frame["producer"]]:
                del producers[frame["producer"]]
                if not producers:
                    del self._live[where]
        return frame

    def _check_fits(self, rows: list[list[Any]], frame: Callable[[], dict[str, Any]]) -> None:
        """`too_large` now for a publish ([body, key, headers] `rows`) the node would
        refuse, or drop the connection over (a frame past its limit), whatever the
        retries. As any failed publish, it pauses its keys."""
        try:
            self._check_sizes(rows, frame)
        except ServerError:
            for _, key, _ in rows:
                self.producer.failed(key)
            raise

    def _check_sizes(self, rows: list[list[Any]], frame: Callable[[], dict[str, Any]]) -> None:
        if self.max_body is not None:
            for body, _, _ in rows:
                if len(body) > self.max_body:
                    raise ServerError(
                        "too_large",
                        f"message body of {len(body)} bytes exceeds the node's limit of "
                        f"{self.max_body}",
                    )
        limit = self.max_frame
        if limit is not None and _at_least(rows) + 256 + 64 * len(rows) > limit:
            size = len(encode_frame(frame()))
            if size > limit:
                raise ServerError(
                    "too_large", f"a frame of {size} bytes exceeds the node's limit of {limit}"
                )

    def connection_lost(self) -> list[Event]:
        """Requests that are not idempotent fail; consumers must subscribe again.
        (The unconfirmed publishes stay, to be sent again on the next connection.)"""
        self.connected = False
        events: list[Event] = []
        for request_id in sorted(self._pending - set(self._unconfirmed)):
            self._pending.discard(request_id)
            self._subscribing.pop(request_id, None)
            if request_id not in self._abandoned:
                events.append(Failed(request_id, ConnectionLostError("the connection broke")))
        self._abandoned.clear()
        self._ghosts.clear()  # the node downs them with the connection
        for consumer in self.consumers.values():
            if consumer.cancel_requested:
                events.append(ConsumerEnded(consumer, "cancelled"))
            else:
                events.append(Resubscribe(consumer))
        self.consumers.clear()
        return events

    def give_up(self, error: QuorumqError) -> list[Event]:
        """No node can be reached: everything pending fails, every consumer ends."""
        self.connected = False
        self.lost = error
        events: list[Event] = [Failed(r, error) for r in sorted(self._pending)]
        self._pending.clear()
        self._unconfirmed.clear()
        self._unconfirmed_bytes = 0
        self._live.clear()
        self._resent.clear()
        self._parked.clear()
        self._parked_retry.clear()
        self._retry_parked.clear()
        self._parked_delay.clear()
        self._told_unknown.clear()
        self._attempts.clear()
        self._chosen.clear()
        self._subscribing.clear()
        self._abandoned.clear()
        self._ghosts.clear()
        events += [ConsumerEnded(c, f"connection lost: {error}") for c in self.consumers.values()]
        self.consumers.clear()
        return events

    def close(self) -> list[Event]:
        """Everything pending fails (no answer will be read any more), every consumer ends.
        A publish sent and not confirmed fails as outcome unknown: it may have landed (a
        plain error says it was not published, and a retry would publish it twice)."""
        self.closed = True
        self.connected = False
        events: list[Event] = [
            Failed(
                r,
                OutcomeUnknownError(
                    "the client was closed before this publish was confirmed: it may have "
                    "landed; read the queue to see whether it did before publishing it again"
                )
                if r in self._unconfirmed
                else QuorumqError("the client is closed"),
            )
            for r in sorted(self._pending)
        ]
        self._pending.clear()
        self._unconfirmed.clear()
        self._unconfirmed_bytes = 0
        self._live.clear()
        self._resent.clear()
        self._parked.clear()
        self._parked_retry.clear()
        self._retry_parked.clear()
        self._parked_delay.clear()
        self._told_unknown.clear()
        self._attempts.clear()
        self._chosen.clear()
        self._subscribing.clear()
        self._abandoned.clear()
        self._ghosts.clear()
        events += [ConsumerEnded(c, "client closed") for c in self.consumers.values()]
        self.consumers.clear()
        return events

    # --------------------------------------------------------------- incoming

    def receive(self, frame: dict[str, Any]) -> list[Event]:
        kind = frame["t"]
        if kind == "deliver":
            if frame["consumer"] in self._ghosts:  # give it back to the queue
                nack = {"t": "nack", "consumer": frame["consumer"], "offsets": [frame["offset"]]}
                return [Send({**nack, "requeue": True})]
            consumer = self.consumers.get(frame["consumer"])
            if consumer is None:
                return []
            return [Delivered(consumer, delivery_from(frame, consumer.queue, self._settle))]
        if kind == "cancelled":
            self._ghosts.discard(frame["consumer"])
            consumer = self.consumers.pop(frame["consumer"], None)
            if consumer is None:
                return []
            if frame["reason"] == "node_down" and not consumer.cancel_requested:
                return [Resubscribe(consumer)]  # to come back elsewhere
            return [ConsumerEnded(consumer, frame["reason"])]
        if kind in ("reply", "error"):
            request_id = frame.get("id")
            if isinstance(request_id, int):
                return self._resolve(request_id, frame)
        return []

    def _resolve(self, request_id: int, frame: dict[str, Any]) -> list[Event]:
        if request_id not in self._pending:
            return []  # answered before (a second answer to a resent request)
        publish = self._unconfirmed.get(request_id)
        if publish is not None:
            return self._publish_answered(request_id, publish, frame)
        self._pending.discard(request_id)
        consumer = self._subscribing.pop(request_id, None)
        abandoned = request_id in self._abandoned
        self._abandoned.discard(request_id)
        events: list[Event] = []
        if frame["t"] == "error":
            error = ServerError(frame["code"], frame["message"])
            return [] if abandoned else [Failed(request_id, error)]
        if consumer is not None:
            if abandoned or consumer.cancel_requested:  # subscribed for nobody: cancel it
                self._ghosts.add(frame["consumer"])
                cancel = {"t": "cancel", "consumer": frame["consumer"], "id": self._next_id}
                self._next_id += 1  # not pending: nobody waits for its answer
                events.append(Send(cancel))
            else:
                consumer.id = frame["consumer"]
                self.consumers[consumer.id] = consumer
        if not abandoned:
            events.append(Resolved(request_id, frame))
        return events

    def _publish_answered(
        self, request_id: int, publish: dict[str, Any], frame: dict[str, Any]
    ) -> list[Event]:
        """A publish's answer. A refusal is one of: retriable (resend the queue's live
        publishes, after `REWIND_DELAY`); out of order behind an earlier live publish
        (resend it after that one); certain (the publish never lands: "not published");
        or the refusal of a resend that settles nothing (outcome unknown)."""
        newer = self._attempts.get(request_id, 1) - 1  # attempts still out after this one
        if newer > 0:
            self._attempts[request_id] = newer
        else:
            self._attempts.pop(request_id, None)
        if frame["t"] == "reply":
            self._settled(request_id)
            events: list[Event] = [Resolved(request_id, frame)]
            queue = publish["queue"]
            self._parked_delay.pop(queue, None)  # the queue takes publishes again
            events += self._release_parked(queue)
            return events
        code, message = frame["code"], frame["message"]
        if code in RETRIABLE:
            return [] if newer else self._rewind_later(publish["queue"])
        expected = frame.get("expected_seq")
        certain = request_id not in self._resent  # this attempt was the only one
        if code == "producer_forgotten":
            # The queue forgot producers of this id's generation: new ids go above it.
            # A first attempt certainly did not land (below); an earlier attempt of a
            # resend may have, before the queue forgot the id, and none can any more.
            generation = frame.get("generation")
            self.producer.above(generation if isinstance(generation, int) else 0)
            if not certain:
                return self._forgotten(request_id, publish)
        if code == "producer_sealed" and not certain:
            # the job that made the id committed: no attempt lands from now on (an
            # earlier one may have landed before the seal)
            return self._forgotten(request_id, publish)
        if code == "over_max_length":
            certain = True  # no attempt of it could ever fit the queue
        if code == "out_of_order" and publish.get("seqs") is not None:
            # A numbered batch is refused so only by a queue that does not know its
            # producer (new and not opened by it, or forgotten): never behind another
            # publish of ours. An earlier attempt may have landed before the queue
            # forgot the producer; this one never will.
            if not certain:
                return self._forgotten(request_id, publish)
        elif code == "out_of_order" and isinstance(expected, int):
            earlier = self._live_covering(publish, expected)
            if earlier in self._parked:  # it is sent again on the next connection, and so
                self._parked.add(request_id)  # is this one (or on this one, after it)
                if earlier in self._retry_parked:
                    self._retry_parked.add(request_id)
                return []
            if earlier is not None:
                return [] if newer else self._rewind_later(publish["queue"])
            if expected == 0 and request_id not in self._chosen:
                return self._forgotten(request_id, publish)
            # The queue waits for a sequence number that no live publish holds, and this
            # client never sends it again: no attempt of this one can land any more. (A
            # caller that chose its producer id replays with the same numbers.)
            certain = True
        if certain:
            self._settled(request_id)
            self._keys_failed([publish])
            refusal = Failed(request_id, ServerError(code, message))
            return [refusal, *self._give_up_after(publish)]
        # A resend refused (by a node with a smaller --max-body, say, or a queue full
        # for now): an earlier attempt may have landed, or may still be in the Raft
        # pipeline. Not "not published": the publish stays live, sent again on the next
        # connection, so the key settles once a node answers it. Later publishes of the
        # same producer stay live too, each settled by its own answer (if this one did
        # not land, theirs is out_of_order behind it). New ones take a fresh producer id.
        self._parked.add(request_id)
        self._keys_failed([publish])
        self._retire(publish)
        retry: list[Event] = []
        if code in PASSING_REFUSALS:
            self._retry_parked.add(request_id)
            retry = self._retry_parked_later(publish["queue"], steady=code == "disk_alarm")
        if request_id in self._told_unknown:
            return retry
        self._told_unknown.add(request_id)
        return [
            *retry,
            Failed(
                request_id,
                OutcomeUnknownError(
                    f"a resend was refused ({code}: {message}), but an earlier attempt may "
                    "have landed or may yet: the publish stays live (sent again after the "
                    "next reconnect) and lands at most once; do not publish it again"
                ),
            ),
        ]

    def _forgotten(self, request_id: int, publish: dict[str, Any]) -> list[Event]:
        """The queue forgot this publish's producer id (`forget_producers`, or an hour of
        silence when it needed room): it expects sequence number 0, whose publish it
        took, or it refuses the id's generation (`producer_forgotten`). An earlier
        attempt may have landed before that; none can any more (the id is retired)."""
        self._settled(request_id)
        self._keys_failed([publish])
        self._retire(publish)
        error = OutcomeUnknownError(
            f"the queue forgot the producer id {publish['producer']!r} of {publish['queue']!r}: an "
            "earlier attempt may have landed before it did, and none can any more; do "
            "not publish it again before a read tells whether it landed"
        )
        return [Failed(request_id, error)]

    def _parked_heads(self, queue: str) -> set[int]:
        """Per producer, its earliest publish to `queue` parked after a refusal for now
        (the rest would be refused behind it)."""
        heads: dict[str, int] = {}
        for r in sorted(self._retry_parked):
            frame = self._unconfirmed[r]
            if frame["queue"] == queue:
                heads.setdefault(frame["producer"], r)
        return set(heads.values())

    def _release_parked(self, queue: str) -> list[Event]:
        """The queue confirmed a publish: it takes publishes again, so each producer's
        earliest parked publish is sent again at once (its confirm sends the next). One
        a second apart, 72 publishes parked by a disk alarm of 3 s took 72 s to land
        after it cleared (the simulator's seed 1); all at once, each confirm of a queue
        full for now sent every parked publish again, to be refused again, a log entry
        each (a review: 251,500 proposals for 1,000 parked publishes)."""
        due = self._parked_heads(queue)
        if not due:
            return []
        self._parked -= due
        self._retry_parked -= due
        return [Send(frame) for frame in self.unconfirmed(queue, due)]

    def _retry_parked_later(self, queue: str, *, steady: bool = False) -> list[Event]:
        """The parked publishes' next try (`steady`: a disk alarm, which clears within
        seconds of the space coming back: tried every `PARKED_RETRY_DELAY`, not backing
        off to `PARKED_RETRY_LONGEST`, so publishers resume as soon as it clears)."""
        if queue in self._parked_retry:
            return []
        self._parked_retry.add(queue)
        delay = PARKED_RETRY_DELAY if steady else self._parked_delay.get(queue, PARKED_RETRY_DELAY)
        self._parked_delay[queue] = min(2 * delay, PARKED_RETRY_LONGEST)
        return [RewindLater(queue, delay)]

    def _rewind_later(self, queue: str) -> list[Event]:
        if queue in self._rewinding:
            return []
        self._rewinding.add(queue)
        return [RewindLater(queue)]

    def _live_covering(self, publish: dict[str, Any], seq: int) -> int | None:
        """The live publish of `publish`'s queue and producer that holds sequence `seq`."""
        for request_id, f in self._unconfirmed.items():
            if f["queue"] != publish["queue"] or f["producer"] != publish["producer"]:
                continue
            if seq in _numbers(f):
                return request_id
        return None

    def _settled(self, request_id: int) -> None:
        """`request_id` is answered for good: no longer pending, live or resent."""
        self._pending.discard(request_id)
        self._drop_unconfirmed(request_id)
        self._resent.discard(request_id)
        self._parked.discard(request_id)
        self._retry_parked.discard(request_id)
        self._told_unknown.discard(request_id)
        self._attempts.pop(request_id, None)

    def _keys_failed(self, frames: Iterable[dict[str, Any]]) -> None:
        for f in frames:
            for key in keys_of(f):
                self.producer.failed(key)

    def _retire(self, publish: dict[str, Any]) -> None:
        """After a refusal, this client's publishes to the queue take a fresh producer id
        (the queue expects the refused sequence number next from the old one)."""
        if self.producer.current(publish["queue"]) == publish["producer"]:
            self.producer.renew(publish["queue"])

    def _give_up_after(self, publish: dict[str, Any]) -> list[Event]:
        """`publish` never lands: nor does any later one of its producer (the queue takes
        a producer's sequence numbers in order). Those are not live any more."""
        self._retire(publish)  # earlier ones still out under the old id hold their keys
        if publish.get("seqs") is not None:
            return []  # the queue takes a batch numbered by its caller whatever came before
        queue, producer, seq = publish["queue"], publish["producer"], _numbers(publish)[0]
        events: list[Event] = []
        for request_id, frame in list(self._unconfirmed.items()):
            if (
                frame["queue"] == queue
                and frame["producer"] == producer
                and frame.get("seqs") is None
                and _numbers(frame)[0] > seq
            ):
                self._settled(request_id)
                self._keys_failed([frame])
                error = RefusedBeforeError(
                    f"not published: an earlier publish to {queue!r} under the same producer "
                    "id was refused, and the queue takes that id's sequence numbers in order"
                )
                events.append(Failed(request_id, error))
        return events
