"""The workload: idempotent producers and acking consumers, as quorumq's clients behave.

Producers send unique records (body `producer:seq`, some with an ordering key) in
batches with a producer id and sequence numbers, and retry until confirmed, as
`quorumq.client.session` does: after a retriable failure or an out-of-order refusal
behind an unconfirmed batch, they resend every unconfirmed batch in order (a rewind);
after a timeout or a lost connection, they connect to another node and do the same.
The queue recognises the resends.

Consumers are attached to nodes (consumer `i` prefers node `i mod n`), subscribe with a
prefetch, ack what they receive after a processing delay (some are slow), sometimes
nack with requeue. When their node goes away they subscribe again elsewhere; the
messages they held come back to the queue through `Down` or `NodeDown`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from quorumq.machine import (
    Ack,
    Declare,
    Deliver,
    EnqueueBatch,
    Enqueued,
    Error,
    ErrorCode,
    Message,
    Nack,
    QueueOptions,
    Reply,
    Subscribe,
)

from .world import micros

if TYPE_CHECKING:
    from .checker import Checker
    from .cluster import Cluster
    from .node import SimNode

QUEUE = "orders"
QUEUE_OPTIONS = QueueOptions(retention_messages=1000)
"""The stream view keeps only the newest messages: the state (and its digest) stays small."""
REWIND_DELAY_S = 0.05


@attrs.frozen(kw_only=True)
class WorkloadConfig:
    producers: int = 3
    consumers: int = 4
    rate: float = 150.0
    """Records per second, all producers together, while faults run."""
    max_batch: int = 5
    keys: int = 6
    """Distinct ordering keys; a third of the records have none."""
    prefetch: int = 8
    ack_delay_s: tuple[float, float] = (0.001, 0.03)
    slow_ack_delay_s: tuple[float, float] = (0.2, 1.5)
    slow_share: float = 0.25
    """Share of the consumers that are slow."""
    nack_p: float = 0.03
    request_timeout_s: float = 2.0
    reconnect_s: tuple[float, float] = (0.05, 0.5)
    message_ttl_ms: int | None = None
    """The queue's message TTL: a record may expire (it is then dropped, not lost), never
    before that much true time has passed since it was published (`early_expiry`)."""

    def queue_options(self) -> QueueOptions:
        return attrs.evolve(QUEUE_OPTIONS, message_ttl_ms=self.message_ttl_ms)


class Client:
    """What producers and consumers share: a connection to one node of the cluster."""

    def __init__(self, cluster: Cluster, checker: Checker, config: WorkloadConfig) -> None:
        self.cluster = cluster
        self.world = cluster.world
        self.checker = checker
        self.config = config
        self.random = cluster.client_random
        self.node: SimNode | None = None
        cluster.clients.append(self)

    def _delay(self, span: tuple[float, float]) -> int:
        return micros(self.random.uniform(*span))

    def pick_node(self, preferred: str | None = None) -> SimNode | None:
        """A running node: the preferred one if it runs, else one at random."""
        running = self.cluster.running()
        if not running:
            return None
        for node in running:
            if node.name == preferred:
                return node
        return running[self.random.randrange(len(running))]

    def connection_lost(self, node: SimNode) -> None:
        raise NotImplementedError


# ------------------------------------------------------------------ producers


@attrs.define
class Batch:
    first_seq: int
    records: list[tuple[bytes, str | None]]
    sent_us: int = 0


class SimProducer(Client):
    def __init__(self, cluster: Cluster, checker: Checker, config: WorkloadConfig, i: int) -> None:
        super().__init__(cluster, checker, config)
        self.id = f"p{i}"
        self.next_seq = 0
        self.unconfirmed: dict[int, Batch] = {}
        self._rewinding = False
        self.producing = True

    def start(self) -> None:
        self._connect()
        self._schedule_emit()
        self.world.after(micros(0.5), self._check_timeouts)

    def _schedule_emit(self) -> None:
        if self.config.rate <= 0:
            return
        per_producer = self.config.rate / self.config.producers
        mean_batch = (1 + self.config.max_batch) / 2
        interval = mean_batch / per_producer
        self.world.after(micros(self.random.uniform(0.5, 1.5) * interval), self._emit)

    def _emit(self) -> None:
        if not self.producing:
            return
        count = self.random.randint(1, self.config.max_batch)
        batch = Batch(first_seq=self.next_seq, records=[])
        for _ in range(count):
            seq = self.next_seq
            self.next_seq += 1
            k = self.random.randrange(self.config.keys * 3 // 2 or 1)
            key = f"k{k}" if k < self.config.keys else None
            body = f"{self.id}:{seq}".encode()
            batch.records.append((body, key))
            self.checker.published(body, key)
        self.unconfirmed[batch.first_seq] = batch
        self._send(batch)
        self._schedule_emit()

    def _connect(self) -> None:
        self.node = self.pick_node()

    def _send(self, batch: Batch) -> None:
        node = self.node
        batch.sent_us = self.world.now_us
        if node is None:
            return  # resent by the timeout check
        command = EnqueueBatch(
            queue=QUEUE,
            messages=[Message(body=b, key=k) for b, k in batch.records],
            producer=self.id,
            first_seq=batch.first_seq,
        )

        def propose() -> None:
            node.propose(command, reply)

        def reply(result: Reply | None, error: str | None) -> None:
            self.cluster.send_to_client(self._on_reply, node, batch.first_seq, result, error)

        self.cluster.send_to_node(self, node, propose)

    def _on_reply(
        self, node: SimNode, first_seq: int, reply: Reply | None, error: str | None
    ) -> None:
        if node is not self.node:
            return  # an answer on a connection this producer has left
        batch = self.unconfirmed.get(first_seq)
        if batch is None:
            return  # a second answer to a resent batch
        if isinstance(reply, Enqueued):
            del self.unconfirmed[first_seq]
            for i, (body, _) in enumerate(batch.records):
                offset = None if reply.offset is None else reply.offset + i
                self.checker.confirmed(body, offset)
        elif error is not None or (
            isinstance(reply, Error)
            and reply.code == ErrorCode.OUT_OF_ORDER
            and reply.expected_seq in self.unconfirmed
        ):
            self._rewind_later()
        else:
            del self.unconfirmed[first_seq]
            for body, _ in batch.records:
                self.checker.refused(body, str(reply))

    def _rewind_later(self) -> None:
        if not self._rewinding:
            self._rewinding = True
            self.world.after(micros(REWIND_DELAY_S), self._rewind)

    def _rewind(self) -> None:
        self._rewinding = False
        for first_seq in sorted(self.unconfirmed):
            self._send(self.unconfirmed[first_seq])

    def _check_timeouts(self) -> None:
        timeout = micros(self.config.request_timeout_s)
        if any(self.world.now_us - b.sent_us > timeout for b in self.unconfirmed.values()):
            self._connect()
            self._rewind()
        self.world.after(micros(0.5), self._check_timeouts)

    def connection_lost(self, node: SimNode) -> None:
        if node is self.node:
            self.node = None
            self.world.after(self._delay(self.config.reconnect_s), self._reconnect)

    def _reconnect(self) -> None:
        self._connect()
        self._rewind()


# ------------------------------------------------------------------ consumers


class SimConsumer(Client):
    """One consumer slot: a sequence of subscriptions (a new consumer id each time)."""

    def __init__(self, cluster: Cluster, checker: Checker, config: WorkloadConfig, i: int) -> None:
        super().__init__(cluster, checker, config)
        self.slot = i
        self.home = cluster.names[i % len(cluster.names)]
        self.slow = self.random.random() < config.slow_share
        self.id: str | None = None
        self.connected = False

    def start(self) -> None:
        self._subscribe()

    def _subscribe(self) -> None:
        if self.connected:
            return
        node = self.pick_node(self.home)
        if node is None:
            self.world.after(self._delay(self.config.reconnect_s), self._subscribe)
            return
        consumer = node.new_consumer_id()
        self.node, self.id, self.connected = node, consumer, True
        self.cluster.consumers[consumer] = self
        command = Subscribe(
            queue=QUEUE, consumer=consumer, node=node.name, prefetch=self.config.prefetch
        )

        def propose() -> None:
            node.subscribe(self, command, reply)

        def reply(result: Reply | None, error: str | None) -> None:
            self.cluster.send_to_client(self._on_subscribed, node, consumer, result, error)

        self.cluster.send_to_node(self, node, propose)
        self.checker.subscribed(consumer, node.name)

    def _on_subscribed(
        self, node: SimNode, consumer: str, reply: Reply | None, error: str | None
    ) -> None:
        if consumer != self.id or (error is None and not isinstance(reply, Error)):
            return
        # refused (node marked down) or lost: this subscription is over, try again
        self._leave()
        self.world.after(self._delay(self.config.reconnect_s), self._subscribe)

    def _leave(self) -> None:
        """Close this subscription's connection (the node proposes `Down` for it)."""
        node, consumer = self.node, self.id
        self.connected = False
        self.node = None
        if node is not None and consumer is not None:
            self.cluster.send_to_node(self, node, node.consumer_gone, consumer)

    def receive(self, node: SimNode, index: int | None, delivery: Deliver) -> None:
        if not self.connected or delivery.consumer != self.id:
            return
        self.checker.received(delivery, node.name)
        delay = self.config.slow_ack_delay_s if self.slow else self.config.ack_delay_s
        self.world.after(self._delay(delay), self._settle, delivery)

    def _settle(self, delivery: Deliver) -> None:
        node = self.node
        if not self.connected or delivery.consumer != self.id or node is None:
            return
        if self.random.random() < self.config.nack_p:
            nack = Nack(queue=QUEUE, consumer=delivery.consumer, offsets=[delivery.offset])
            self.cluster.send_to_node(self, node, None, nack)
            return
        # one offset per ack frame, as the client sends them; the node gathers the acks
        # it reads at once into one Ack, as the server does
        ack = Ack(queue=QUEUE, consumer=delivery.consumer, offsets=[delivery.offset])
        self.cluster.send_to_node(self, node, None, ack)

    def cancelled(self, node: SimNode, consumer: str, reason: str) -> None:
        """The queue removed this consumer (its node was marked down): subscribe again."""
        if consumer != self.id or not self.connected:
            return
        self.connected = False
        self.node = None
        self.world.after(self._delay(self.config.reconnect_s), self._subscribe)

    def die(self) -> bool:
        """Fault: the consumer process dies; a new one starts a little later. False if
        there was no live subscription to kill."""
        if not self.connected:
            return False
        self._leave()
        self.world.after(self._delay((0.2, 2.0)), self._subscribe)
        return True

    def connection_lost(self, node: SimNode) -> None:
        if node is self.node:
            self.connected = False
            self.node = None
            self.world.after(self._delay(self.config.reconnect_s), self._subscribe)


def declare(cluster: Cluster, options: QueueOptions = QUEUE_OPTIONS) -> None:
    """Declare the workload's queue through any running node (retried until applied)."""

    def attempt() -> None:
        node = cluster.leader()
        if node is None:
            cluster.world.after(micros(0.1), attempt)
            return

        def done(reply: Reply | None, error: str | None) -> None:
            if reply is None:
                cluster.world.after(micros(0.1), attempt)

        node.propose(Declare(queue=QUEUE, options=options), done)

    attempt()


def start_workload(cluster: Cluster, checker: Checker, config: WorkloadConfig) -> list[Any]:
    producers = [SimProducer(cluster, checker, config, i) for i in range(config.producers)]
    consumers = [SimConsumer(cluster, checker, config, i) for i in range(config.consumers)]
    for c in [*consumers, *producers]:
        c.start()
    return [*producers, *consumers]
