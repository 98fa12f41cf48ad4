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

The session in parts: `session_state` (its state, the events it returns, how a request
is made), `publishing` (everything about publishes and their answers), `consuming`
(subscribing, settling, cancelling); `ClientSession` here is their sum, with the
connection's life and the dispatch of what arrives.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .consuming import Consuming
from .core import (
    ConnectionLostError,
    OutcomeUnknownError,
    QuorumqError,
    ServerError,
    delivery_from,
)
from .publishing import Publishing
from .session_state import (
    MAX_UNCONFIRMED,
    MAX_UNCONFIRMED_BYTES,
    PARKED_RETRY_DELAY,
    PARKED_RETRY_LONGEST,
    PASSING_REFUSALS,
    REWIND_DELAY,
    SUBSCRIBE_RETRIABLE,
    SUBSCRIBE_RETRY_FIRST,
    SUBSCRIBE_RETRY_LONGEST,
    ConsumerEnded,
    ConsumerLike,
    Delivered,
    Event,
    Failed,
    Resolved,
    Resubscribe,
    RewindLater,
    Send,
    SessionState,
    keys_of,
)


class ClientSession(Publishing, Consuming):
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

    def queue_deleted(self, queue: str) -> None:
        """This client deleted `queue`: publishes to one declared again under the name go
        under a new producer id, from seq 0 (the new queue refuses the deleted one's
        producer ids as forgotten, and the next publish would fail)."""
        self.producer.renew(queue)

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


__all__ = [
    "MAX_UNCONFIRMED",
    "MAX_UNCONFIRMED_BYTES",
    "PARKED_RETRY_DELAY",
    "PARKED_RETRY_LONGEST",
    "PASSING_REFUSALS",
    "REWIND_DELAY",
    "SUBSCRIBE_RETRIABLE",
    "SUBSCRIBE_RETRY_FIRST",
    "SUBSCRIBE_RETRY_LONGEST",
    "ClientSession",
    "ConsumerEnded",
    "ConsumerLike",
    "Delivered",
    "Event",
    "Failed",
    "Resolved",
    "Resubscribe",
    "RewindLater",
    "Send",
    "SessionState",
    "keys_of",
]
