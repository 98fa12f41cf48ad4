"""Consuming (`Consuming`): subscribing (and again after a reconnect or a retriable
refusal), settling, cancelling a consumer, and forgetting a request whose caller stopped
waiting."""

from __future__ import annotations

from typing import Any

from .core import (
    ConnectionLostError,
    Delivery,
    QuorumqError,
    ServerError,
)
from .session_state import (
    SUBSCRIBE_RETRIABLE,
    SUBSCRIBE_RETRY_FIRST,
    SUBSCRIBE_RETRY_LONGEST,
    ConsumerLike,
    SessionState,
    logger,
)


class Consuming(SessionState):
    """The session's consuming (see the module's docstring)."""

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
