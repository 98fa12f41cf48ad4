"""The clients of a chaos run (`simulations.chaos`): producers of unique records with the
client's idempotent retries, and one consumer per node that records every delivery,
acks it, and is told of a `node_down` cancellation."""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import attrs

from quorumq.client import Client, Consumer, QuorumqError
from quorumq.ops.local_cluster import Cluster

QUEUE = "chaos"
KEYS_PER_PRODUCER = 4
IN_FLIGHT = 32
"""Unconfirmed publishes each producer allows itself."""


@attrs.frozen
class Received:
    producer: int
    seq: int
    offset: int
    key: str
    redelivered: bool
    node: str
    consumer: str
    """Which consumer (node and life: one per kill) received it."""


class Producer:
    """Publishes records `p:seq` with ordering keys, confirmed through the client."""

    def __init__(self, number: int, client: Client, rate: float) -> None:
        self.number = number
        self.client = client
        self.rate = rate
        self.sent = 0
        self.confirmed: set[int] = set()
        self.unconfirmed: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"producer-{number}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=180)

    def _run(self) -> None:
        window: collections.deque[tuple[int, Future[dict[str, Any]]]] = collections.deque()
        started = time.monotonic()
        seq = 0
        while not self._stop.is_set():
            key = f"p{self.number}k{seq % KEYS_PER_PRODUCER}"
            try:
                future = self.client.publish_async(QUEUE, b"%d:%d" % (self.number, seq), key)
            except QuorumqError:  # the key is paused after a failure: we handled it
                if key in self.client.settling_keys():
                    self._stop.wait(0.05)  # a publish of it may still land: let it settle
                else:
                    self.client.resume(key)
                continue
            window.append((seq, future))
            self.sent += 1
            seq += 1
            while len(window) >= IN_FLIGHT:
                self._settle(*window.popleft())
            pause = started + seq / self.rate - time.monotonic()
            if pause > 0:
                self._stop.wait(pause)
        while window:
            self._settle(*window.popleft())

    def _settle(self, seq: int, future: Future[dict[str, Any]]) -> None:
        try:
            future.result(timeout=120)
        except Exception:  # connection lost for good, or an error: outcome unknown
            self.unconfirmed.add(seq)
        else:
            self.confirmed.add(seq)


class WatchedClient(Client):
    """A client that tells `on_cancelled(consumer id, reason)` of each cancellation a
    node sends it. After a `node_down` the client subscribes again on its own, so its
    consumer never shows one: the harness reads the frame as the session receives it
    (the client has no public hook for that)."""

    def __init__(
        self, *args: Any, on_cancelled: Callable[[str, str], None], **options: Any
    ) -> None:
        super().__init__(*args, **options)
        receive = self._session.receive

        def watched(frame: dict[str, Any]) -> list[Any]:
            if frame.get("t") == "cancelled":
                on_cancelled(str(frame.get("consumer")), str(frame.get("reason")))
            return receive(frame)

        self._session.receive = watched  # type: ignore[method-assign]


class ConsumerSlot:
    """The consumer attached to one node; replaced by a new one when it is killed."""

    def __init__(
        self,
        cluster: Cluster,
        node: str,
        record: Callable[[Received], None],
        on_cancelled: Callable[[str, str, str], None] = lambda _node, _consumer, _why: None,
    ) -> None:
        """`on_cancelled(node, consumer id, reason)`: its node cancelled the consumer."""
        self.cluster = cluster
        self.node = node
        self.record = record
        self.on_cancelled = on_cancelled
        self.lives = 0
        self._client: Client | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self) -> None:
        self.lives += 1
        # connected to its own node only: it waits for that node through its restarts
        client = WatchedClient(
            [self.cluster.endpoint(self.node)],
            self.cluster.token,
            timeout=120,
            on_cancelled=lambda consumer, why: self.on_cancelled(self.node, consumer, why),
        )
        self._client, self._stop = client, threading.Event()
        self._thread = threading.Thread(
            target=self._subscribe_and_run, args=(client, self.lives, self._stop), daemon=True
        )
        self._thread.start()

    def _subscribe_and_run(self, client: Client, life: int, stop: threading.Event) -> None:
        """Subscribe until the node takes it (a node marked down refuses until it is up
        again), then consume; if the consumer ends (it could not subscribe again after
        its node was cut off), the slot subscribes anew, as a new life."""
        while not stop.is_set():
            try:
                consumer = client.subscribe(QUEUE, prefetch=20)
            except QuorumqError:
                stop.wait(0.2)
                continue
            self._run(consumer, life, stop)
            self.lives += 1
            life = self.lives

    def kill(self) -> None:
        """The consumer dies with what it holds (its connection closes, unacked)."""
        self._halt()
        self.start()

    def _halt(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._client is not None:
            self._client.close()

    def stop(self) -> None:
        self._halt()

    def _run(self, consumer: Consumer, life: int, stop: threading.Event) -> None:
        name = f"{self.node}#{life}"
        while not stop.is_set():
            d = consumer.get(timeout=0.1)
            if d is None:
                if consumer.cancelled:
                    return
                continue
            producer, seq = map(int, d.body.split(b":"))
            self.record(Received(producer, seq, d.offset, d.key or "", d.redelivered, d.node, name))
            if stop.is_set():
                return  # dying: this one stays unacked and must come back
            with contextlib.suppress(QuorumqError):  # if the connection is gone, it comes back
                d.ack()
