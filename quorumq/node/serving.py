"""The consumers this node serves: subscribe and cancel; the effects its replica applied
turned into frames (a delivery to a consumer of this node is sent, after its subscribe
reply; one to a consumer it does not have is answered with that consumer's `Down`; what
each consumer was sent is recorded, `quorumq.node.deliveries`); after a snapshot install,
what the skipped entries would have sent (`state_replaced`); and, every second, `Down`
for consumers the machine places on this node that no connection here serves (a `Down`
lost to a leader change, consumers of an earlier run of this node)."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from ..machine import (
    Cancel,
    ConsumerDown,
    Deliver,
    Down,
    Effect,
    Subscribe,
    UnknownQueueError,
)
from ..wire.protocol import Frame
from .connection import ConnectionCore
from .deliveries import missing as missing_deliveries
from .reading import Reading
from .services import ReplicaHandle, Services
from .settling import Settling

logger = logging.getLogger(__name__)

LOST_CONSUMERS_EVERY_S = 1.0


class Serving:
    """Serving this node's consumers (see the module's docstring)."""

    down_lost_consumers = True
    """`_down_lost_consumers`: propose `Down` for consumers in the log no connection here
    serves. (A switch for the negative controls, each of which turns off one rule.)"""
    resync_after_snapshot = True
    """`state_replaced`: after a snapshot install, send the held deliveries consumers
    here were not sent, and cancel the ones the machine removed."""

    def __init__(self, core: Services, settling: Settling, reading: Reading) -> None:
        self.core = core
        self.settling = settling
        self.reading = reading
        self._downed: set[str] = set()
        self._missing_before: set[str] = set()
        core.call_later(LOST_CONSUMERS_EVERY_S, self._down_lost_consumers)

    def subscribe(self, conn: ConnectionCore, frame: Frame) -> None:
        limit = self.core.config.max_consumers
        if len(conn.consumers) >= limit:  # cancelled ones count until they hold nothing
            self.core.error(
                conn,
                frame["id"],
                "too_many_consumers",
                f"a connection may have {limit} consumers at most (cancelled ones count "
                "until their messages are settled): cancel some, or open another connection",
            )
            return
        conn.consumer_counter += 1
        consumer = f"{self.core.consumer_prefix}{conn.number}.{conn.consumer_counter}"
        queue = frame["queue"]
        command = Subscribe(  # checked (prefetch at most 65,535) before anything is kept
            queue=queue,
            consumer=consumer,
            node=self.core.node_id,
            prefetch=frame["prefetch"],
            timeout_ms=frame.get("timeout_ms"),
        )
        conn.consumers[consumer] = queue
        conn.awaiting_reply[consumer] = []
        conn.subscribe_requests[consumer] = frame["id"]
        conn.prefetches[consumer] = command.prefetch
        conn.prefetch_allowance += command.prefetch
        self.core.consumers[consumer] = conn
        self.core.propose_for(conn, frame["id"], command, consumer=consumer, cost=0)

    def cancel(self, conn: ConnectionCore, frame: Frame) -> None:
        consumer = frame["consumer"]
        queue = conn.consumers.get(consumer)
        if queue is None:
            self.core.error(conn, frame["id"], "unknown_consumer", f"no consumer {consumer!r} here")
            return
        conn.cancelling.add(consumer)
        self.core.propose_for(conn, frame["id"], Cancel(queue=queue, consumer=consumer))

    def effects_applied(self, index: int | None, effects: Iterable[Effect]) -> None:
        """Run this node's effects of log entry `index` (None: `state_replaced`'s)."""
        for e in effects:
            if type(e) is Deliver:
                conn = self.core.consumers.get(e.consumer)
                if conn is None or conn.done:
                    self.down(e.consumer, e.queue)
                    continue
                sent = conn.sent_to(e.consumer)
                if index is not None and sent.covers(index):
                    continue  # `state_replaced` got there first
                sent.record(e)
                if sent.full():
                    self._prune_deliveries(conn, e.consumer)
                frame = {
                    "t": "deliver",
                    "consumer": e.consumer,
                    "offset": e.offset,
                    "key": e.key,
                    "body": e.body,
                    "headers": e.headers,
                    "redelivered": e.redelivered,
                    "delivery_count": e.delivery_count,
                    "node": self.core.node_id,
                }
                early = conn.awaiting_reply.get(e.consumer)
                if early is not None:  # the subscribe reply goes first
                    early.append(frame)
                else:
                    self.core.push(conn, frame)
            elif type(e) is ConsumerDown:
                self._downed.discard(e.consumer)
                conn = self.core.consumers.pop(e.consumer, None)
                if conn is not None:
                    conn.drop_consumer(e.consumer)
                    self.core.push(
                        conn, {"t": "cancelled", "consumer": e.consumer, "reason": e.reason}
                    )

    def _prune_deliveries(self, conn: ConnectionCore, consumer: str) -> None:
        """Keep, of what `consumer` was sent, what the machine says it still holds (the
        replica may have applied more than these effects: nothing if its queue is gone)."""
        queue = conn.consumers[consumer]
        replica = self.core.replica_of(queue)
        try:
            held = () if replica is None else replica.query(lambda m: m.unacked(queue, consumer))
        except UnknownQueueError:
            held = ()
        conn.sent_to(consumer).keep(held)

    def state_replaced(self, group: int = 0) -> None:
        """This node's replica of `group` jumped to the leader's snapshot: the log
        entries it skipped never ran their effects here (nor may entries it applies
        again run twice).
        Compare the machine with what each consumer here was sent: send the held
        deliveries it was not sent, and cancel the consumers the machine removed: with
        their queue (deleted meanwhile), or else as though their node was marked down
        (the client subscribes again)."""
        if not self.resync_after_snapshot:
            return
        replica = self.core.groups[group]
        for consumer in list(self.settling.acking):  # the ack they wait for may never be answered
            self.settling.propose_held_acks(consumer)
        self.reading.wake_reads(
            self.reading.waiting.queues()
        )  # the ends moved with no entry applied
        served = [
            (c, conn, conn.consumers[c])
            for c, conn in self.core.consumers.items()
            if not conn.done
            and c in conn.consumers
            and self.core.replica_of(conn.consumers[c]) in (replica, None)
        ]
        index, held, queues = replica.query(
            lambda m: (
                m.last_index,
                [m.held_deliveries(q, c) for c, _, q in served],
                set(m.queues()),
            )
        )
        for (c, conn, queue), deliveries in zip(served, held, strict=True):
            if c in conn.awaiting_reply and deliveries is not None:
                # its Subscribe was among the skipped entries: PySyncObj will not answer it
                self.core.answer(conn, conn.subscribe_requests.get(c), None, None, c)
            missing = missing_deliveries(deliveries, conn.sent_to(c), index)
            if missing is None:
                # not yet subscribed in the log, or cancelled by its client: nothing to say
                if c not in conn.awaiting_reply and c not in conn.cancelling:
                    reason = "node_down" if queue in queues else "queue_deleted"
                    down = ConsumerDown(
                        queue=queue, consumer=c, node=self.core.node_id, reason=reason
                    )
                    self.effects_applied(None, (down,))
                continue
            if missing:
                logger.info(
                    "consumer %s: sending %d deliveries the snapshot install skipped",
                    c,
                    len(missing),
                )
                self.effects_applied(None, missing)

    def _down_lost_consumers(self) -> None:
        """Propose `Down` for consumers in the log that this node serves no longer.

        A closed connection proposes its consumers' `Down` at once, but that proposal
        can be lost to a leader change. Consumers of an earlier run of this node died
        with it, and if the node came back within the grace period no `NodeDown`
        returns their messages. Neither may hold credit for a delivery that would
        reveal them. So, every second: a consumer the machine places on this node that
        no connection here serves, now and a second ago, gets its `Down` (again)."""
        node = self.core.node_id
        placed: dict[str, ReplicaHandle] = {}
        for replica in self.core.groups:  # (a consumer is on one queue: in one group)
            placed.update(dict.fromkeys(replica.query(lambda m: m.consumers_on(node)), replica))
        missing = {c for c in placed if c not in self.core.consumers}
        for consumer in sorted(missing & self._missing_before):
            if not self.down_lost_consumers:
                break
            logger.info("consumer %s is served nowhere: proposing its Down", consumer)
            placed[consumer].propose(Down(consumer=consumer))
        self._missing_before = missing
        self._forget_removed(set(placed))
        self.core.call_later(LOST_CONSUMERS_EVERY_S, self._down_lost_consumers)

    def _forget_removed(self, placed: set[str]) -> None:
        """Drop the records of consumers the machine no longer has: a cancelled one once
        it held nothing (they stayed until the connection closed: 10,000 subscribe and
        cancel cycles on one connection kept 10,000 records), and `Down`s done."""
        for consumer, conn in list(self.core.consumers.items()):
            if consumer in conn.cancelling and consumer not in placed:
                del self.core.consumers[consumer]
                conn.drop_consumer(consumer)
        self._downed &= placed

    def down(self, consumer: str, queue: str) -> None:
        """`consumer`, on `queue`, is served here no longer: its `Down`, in its queue's
        group (in every group if this node does not know where the queue is: a `Down`
        of a consumer a machine does not have does nothing)."""
        self.settling.release_acks(consumer)  # what it acked lands before what it held returns
        if consumer not in self._downed:
            self._downed.add(consumer)
            replica = self.core.replica_of(queue)
            for r in self.core.groups if replica is None else (replica,):
                r.propose(Down(consumer=consumer))
