"""Clients in a simulation: the real `ClientSession` and the real wire protocol, on
simulated connections.

* `SimLink` is one TCP connection between a client and a node: bytes both ways, in
  order, with latency; it breaks when the node's process dies (the client learns it
  after a latency), and the node learns when the client closes it.
* `SimClient` is what `quorumq.client.blocking` and `quorumq.client.aio` are around
  the session, on the simulated clock: the handshake (welcome, hello, reply), frames
  encoded and decoded by `quorumq.wire.protocol`, the session's events (answers, deliveries,
  consumers ended, resubscribes with backoff, rewinds, frames to send), timeouts
  (`outcome_unknown` for a publish, `abandon` for the rest), reconnects to another node
  after the connection breaks. So every rule of the session runs in every simulation:
  resends in send order, paused keys, resubscribing, cancelled consumers. A client
  connects only to a running member of the cluster (`Cluster.serving`: its endpoints).
  The operator's client proves the admin token (`admin_token`) and sends membership
  changes (`admin`), several in one write if asked (they reach the node together).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from quorumq.client.core import (
    ConnectionLostError,
    Delivery,
    Producer,
    QuorumqError,
    check_hello_answer,
    generation_id,
    hello_frame,
)
from quorumq.client.session import (
    ClientSession,
    ConsumerEnded,
    Delivered,
    Event,
    Failed,
    Resolved,
    Resubscribe,
    RewindLater,
    Send,
)
from quorumq.wire.protocol import FrameDecoder, ProtocolError, encode_frame

from .world import WALL_EPOCH_MS, micros

if TYPE_CHECKING:
    from .cluster import Cluster
    from .node import SimNode

LATENCY_S = (0.0002, 0.001)
"""One way, client to node and back."""

Answer = Callable[[dict[str, Any] | None, QuorumqError | None], None]
"""(the reply frame, None) or (None, the error)."""


class SimLink:
    """One client connection to a node."""

    def __init__(self, cluster: Cluster, node: SimNode, client: SimClient) -> None:
        self.cluster = cluster
        self.world = cluster.world
        self.node = node
        self.client = client
        self.open = True
        self.conn: Any = None
        """The node core's connection, once the node accepted it."""
        self._arrivals = {"up": 0, "down": 0}
        cluster.links[self] = None
        self._later("up", self._accepted)

    def _later(self, direction: str, fn: Callable[..., None], *args: Any) -> None:
        """`fn(*args)` after one latency, in order with what went the same way before."""
        low, high = micros(LATENCY_S[0]), micros(LATENCY_S[1])
        rng = self.client.random
        when = max(
            self.world.now_us + low + int(rng.random() * (high - low)), self._arrivals[direction]
        )
        self._arrivals[direction] = when
        self.world.at(when, fn, *args)

    def _accepted(self) -> None:
        if self.open and self.node.alive:
            self.node.accept(self)  # sets `conn` (a paused node: once resumed)

    def to_node(self, data: bytes) -> None:
        if self.open:
            self._later("up", self._arrive_at_node, data)

    def _arrive_at_node(self, data: bytes) -> None:
        if self.open and self.node.alive:
            self.node.receive(self, data)

    def to_client(self, data: bytes) -> None:
        if self.open:
            self._later("down", self._arrive_at_client, data)

    def _arrive_at_client(self, data: bytes) -> None:
        if self.open:
            self.client.data_received(self, data)

    def close_by_client(self) -> None:
        """The client closes the connection (or its process dies)."""
        if not self.open:
            return
        self.open = False
        self.cluster.links.pop(self, None)
        self._later("up", self._closed_at_node)

    def _closed_at_node(self) -> None:
        if self.node.alive:
            self.node.link_closed(self)

    def broken_by_node(self) -> None:
        """The node ends the connection, or its process died: the client learns it."""
        if not self.open:
            return
        self.open = False
        self.cluster.links.pop(self, None)
        self._later("down", self.client.connection_lost, self)


class SimClient:
    """A client process with one connection at a time (see the module's docstring)."""

    def __init__(
        self,
        cluster: Cluster,
        *,
        preferred: str | None = None,
        request_timeout_s: float = 2.0,
        reconnect_s: tuple[float, float] = (0.05, 0.5),
        subscribe_for_s: float = 600.0,
        admin_token: str | None = None,
        rng: random.Random | None = None,
    ) -> None:
        """`rng`: the client's random draws (latency, reconnects); by default the
        workload's stream."""
        self.cluster = cluster
        self.world = cluster.world
        self.random = rng or cluster.client_random
        self.admin_token = admin_token
        self.preferred = preferred
        self.request_timeout_us = micros(request_timeout_s)
        self.reconnect_s = reconnect_s
        self.subscribe_for_s = subscribe_for_s
        self.session = ClientSession(
            self._settle,
            producer=Producer(clock_ms=self._wall_ms, make_id=self._producer_id),
        )
        self.link: SimLink | None = None
        self._decoder = FrameDecoder()
        self._welcome: dict[str, Any] | None = None
        self._answers: dict[int, Answer] = {}
        self._resubscribe_after: list[Any] = []
        """Consumers to subscribe again once the next connection is in place."""
        self._when_connected: list[Callable[[], None]] = []
        """Calls to make once the next connection is in place (`admin`)."""
        self.closed = False
        self.connect()

    def _wall_ms(self) -> int:
        """The client host's wall clock: the simulated epoch (clients' clocks are right)."""
        return WALL_EPOCH_MS + self.world.now_ms

    def _producer_id(self, generation: int) -> str:
        """As a real client's, from the seed's client stream instead of uuid4."""
        return generation_id(generation, self.cluster.producer_ids.getrandbits(128))

    @property
    def node(self) -> SimNode | None:
        return self.link.node if self.link is not None and self.link.open else None

    # -------------------------------------------------------------- connecting

    def connect(self) -> None:
        """Connect to a running member (the preferred one if it runs); none: try later."""
        if self.closed:
            return
        running = self.cluster.serving()
        if not running:
            self.world.after(self._delay(self.reconnect_s), self.connect)
            return
        node = next((n for n in running if n.name == self.preferred), None)
        if node is None:
            node = running[self.random.randrange(len(running))]
        self._decoder = FrameDecoder()
        self._welcome = None
        self.link = SimLink(self.cluster, node, self)

    def _delay(self, span: tuple[float, float]) -> int:
        return micros(self.random.uniform(*span))

    def data_received(self, link: SimLink, data: bytes) -> None:
        if link is not self.link or self.closed:
            return
        self._decoder.feed(data)
        try:
            for frame in self._decoder.frames():
                if not self.session.connected:
                    self._handshake(frame)
                else:
                    self._handle(self.session.receive(frame))
        except (ProtocolError, QuorumqError):
            self.link.close_by_client()
            self.connection_lost(link)

    def _handshake(self, frame: dict[str, Any]) -> None:
        if self._welcome is None:
            self._welcome = frame
            self._write(hello_frame(frame, None, self.admin_token))
            return
        check_hello_answer(frame)
        self.session.connection_made(self._welcome)
        for resend in self.session.unconfirmed():
            self._write(resend)
        consumers, self._resubscribe_after = self._resubscribe_after, []
        for consumer in consumers:
            self._resubscribe(consumer, 1, self.world.now_us + micros(self.subscribe_for_s))
        calls, self._when_connected = self._when_connected, []
        for call in calls:
            call()

    def connection_lost(self, link: SimLink) -> None:
        """The connection broke: what waited fails or is resent, consumers subscribe
        again, on a connection to another node after a moment."""
        if link is not self.link or self.closed:
            return
        self.link = None
        events = self.session.connection_lost()
        self._resubscribe_after += [e.consumer for e in events if isinstance(e, Resubscribe)]
        self._handle([e for e in events if not isinstance(e, Resubscribe)])
        self.world.after(self._delay(self.reconnect_s), self.connect)

    def close(self) -> None:
        """The client process ends (its connection closes at once)."""
        if self.closed:
            return
        self.closed = True
        link, self.link = self.link, None
        if link is not None:
            link.close_by_client()
        self._handle(self.session.close())

    # ----------------------------------------------------------------- events

    def _write(self, frame: dict[str, Any]) -> None:
        link = self.link
        if link is not None and link.open:
            link.to_node(encode_frame(frame))

    def _handle(self, events: list[Event]) -> None:
        for e in events:
            if isinstance(e, Resolved | Failed):
                answer = self._answers.pop(e.request_id, None)
                if answer is not None:
                    if isinstance(e, Resolved):
                        answer(e.frame, None)
                    else:
                        answer(None, e.error)
            elif isinstance(e, Delivered):
                e.consumer.delivered(e.delivery)
            elif isinstance(e, ConsumerEnded):
                e.consumer.ended(e.reason)
            elif isinstance(e, Resubscribe):
                self._resubscribe(e.consumer, 1, self.world.now_us + micros(self.subscribe_for_s))
            elif isinstance(e, RewindLater):
                self.world.after(micros(e.delay), self._rewind, e.queue)
            elif isinstance(e, Send):
                self._write(e.frame)

    def _rewind(self, queue: str) -> None:
        if self.closed:
            return
        for frame in self.session.rewind(queue):
            self._write(frame)

    def _request(self, made: tuple[int, dict[str, Any]], answer: Answer, *, publish: bool) -> None:
        request_id, frame = made
        self._answers[request_id] = answer
        self._write(frame)
        self.world.after(self.request_timeout_us, self._timed_out, request_id, publish)

    def _timed_out(self, request_id: int, publish: bool) -> None:
        why = f"no answer within {self.request_timeout_us / 1e6} s"
        if publish:
            # The caller hears "outcome unknown"; the publish stays live, and its answer,
            # if one comes, is given too (the checker counts a late confirm as one).
            answer = self._answers.get(request_id)
            error = None if answer is None else self.session.outcome_unknown(request_id, why)
            if answer is not None and error is not None:
                answer(None, error)
            return
        answer = self._answers.pop(request_id, None)
        if answer is not None and self.session.abandon(request_id):
            answer(None, ConnectionLostError(why))

    # ------------------------------------------------------------------- verbs

    def declare(self, queue: str, options: dict[str, Any], answer: Answer) -> None:
        made = self.session.request({"t": "declare", "queue": queue, "options": options})
        self._request(made, answer, publish=False)

    def admin(self, frames: list[dict[str, Any]], answers: list[Answer]) -> None:
        """Send administrative requests (`add_member`, `remove_member`) once connected,
        all in one write: they reach the node at the same instant."""
        if self.closed:
            return
        if not self.session.connected:
            self._when_connected.append(lambda: self.admin(frames, answers))
            return
        made = [self.session.request(frame) for frame in frames]
        for (request_id, _), answer in zip(made, answers, strict=True):
            self._answers[request_id] = answer
            self.world.after(self.request_timeout_us, self._timed_out, request_id, False)
        link = self.link
        if link is not None and link.open:
            link.to_node(b"".join(encode_frame(frame) for _, frame in made))

    def publish_batch(self, queue: str, rows: list[list[Any]], answer: Answer) -> None:
        """Publish under this client's producer (`answer` gets the reply frame, or the
        error: raised at once too, for a publish the session refuses to send)."""
        self._request(self.session.publish_batch(queue, rows), answer, publish=True)

    def subscribe(self, consumer: Any) -> None:
        """Subscribe `consumer` (it has `queue`, `prefetch`, `id`, `cancel_requested`,
        `delivered(delivery)`, `ended(reason)` and `subscribed()`), again with backoff
        after a failure a leader change or a lost connection explains."""
        self._resubscribe(consumer, 1, self.world.now_us + micros(self.subscribe_for_s))

    def _resubscribe(self, consumer: Any, attempt: int, deadline_us: int) -> None:
        if self.closed or consumer.cancel_requested:
            return
        if not self.session.connected:
            if consumer not in self._resubscribe_after:
                self._resubscribe_after.append(consumer)
            return

        def answer(frame: dict[str, Any] | None, error: QuorumqError | None) -> None:
            if error is None:
                consumer.subscribed()
                return
            time_left = (deadline_us - self.world.now_us) / 1e6
            delay = self.session.subscribe_retry_delay(error, attempt, time_left)
            if delay is None:
                consumer.ended(self.session.resubscribe_failed(consumer.queue, error))
                return
            self.world.after(micros(delay), self._resubscribe, consumer, attempt + 1, deadline_us)

        try:
            made = self.session.subscribe(consumer)
        except QuorumqError as e:
            answer(None, e)
            return
        self._request(made, answer, publish=False)

    def _settle(self, delivery: Delivery, ack: bool, requeue: bool, delay_ms: int | None) -> None:
        frame = self.session.settle_frame(delivery, ack, requeue, delay_ms)
        if frame is not None:
            self._write(frame)
