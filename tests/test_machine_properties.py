"""Property tests: random command sequences against an independent model of the rules.

The model follows replies and effects only (it never reads the machine's internals)
and after every step the invariants of DESIGN.md are checked against the machine's
public queries:

* a message is held by at most one live consumer, and holds respect prefetch;
* no enqueued message is lost: each is ready, held, acked or explicitly dropped;
* an acked message is never delivered again; `redelivered` and `delivery_count` are
  exactly what the history says;
* per consumer, first deliveries of unkeyed messages come in increasing offset order;
  per key, first deliveries come in increasing order, every held message of a key is
  held by one consumer and is older than every ready message of that key;
* a retried idempotent enqueue never gets a second offset; a forgotten producer
  starts afresh, and the others are untouched; an unknown id of a generation the
  queue forgot is refused (`producer_forgotten`), so a (producer, seq) of an id with
  a generation never lands at two offsets, forgotten or not;
* with single active consumer, only the oldest live subscriber receives;
* rule 1, with retry delays: a message is given to a consumer only when no lower
  ready message is one it could take instead (an unkeyed one, or the first ready
  message of a key nobody else holds) that is due; a message returned as failed (a
  nack with requeue, or its consumer removed) is not given again before its delay (the
  nack's `delay_ms`, else the queue's `retry_backoff_ms` doubled per failure up to its
  max) has run out in log time; a key waits behind its waiting message, in order; a
  single-active-consumer queue gives nothing above a waiting message; and after a
  `Tick` no consumer that may receive is left with a message it could take;
* the stream view at an offset never changes;
* a purge removes exactly the ready messages (held ones stay with their holders), a
  delete of a queue with consumers is refused unless forced, and a forced one cancels
  every consumer (`queue_deleted`) and removes every message, each counted; a deleted
  queue refuses everything until it is declared again: then it is empty, carries on
  from the deleted one's next offset, and refuses its producers' ids as forgotten;
* every queue whose end an entry moved is one `ends_moved` names (a node wakes the
  reads waiting on those queues only);
* a second machine fed the same log, and one restored from a snapshot taken mid-way
  and fed the rest, end with the same digest.
"""

from __future__ import annotations

import contextlib
import os

import attrs
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from quorumq.machine import (
    OK,
    Ack,
    Applied,
    Cancel,
    Command,
    CommitOffset,
    ConsumerDown,
    DeadLettered,
    Declare,
    Declared,
    DeleteQueue,
    Deliver,
    Down,
    Dropped,
    Enqueue,
    EnqueueBatch,
    Enqueued,
    Error,
    ErrorCode,
    ForgetProducers,
    Forgotten,
    Machine,
    Message,
    Meta,
    Nack,
    NodeDown,
    NodeUp,
    Purged,
    PurgeQueue,
    QueueDeleted,
    QueueOptions,
    QueuePurged,
    Subscribe,
    Tick,
    UnknownQueueError,
    ends_moved,
)
from quorumq.machine.machine import PRODUCER_EXPIRY_MS
from quorumq.machine.queue import producer_generation

QUEUES = ("q1", "q2", "dlq")
WORK_QUEUES = ("q1", "q2")
CONSUMERS = ("c0", "c1", "c2", "c3", "c4")
NODES = ("A", "B", "C")
KEYS = (None, None, "k0", "k1", "k2")
PRODUCERS = ("p0", "p1", "g5-a", "g9-b")
"""Producer ids: two named (a caller's own), two carrying a generation (the clients')."""

options_strategy = st.builds(
    QueueOptions,
    max_length=st.none() | st.integers(0, 6),
    overflow=st.sampled_from(["drop-head", "reject-publish"]),
    delivery_limit=st.none() | st.integers(0, 3),
    dead_letter_queue=st.none() | st.just("dlq"),
    single_active_consumer=st.booleans(),
    retention_messages=st.none() | st.integers(0, 8),
    retention_bytes=st.none() | st.integers(0, 40),
    message_ttl_ms=st.none() | st.integers(1, 300),
    retry_backoff_ms=st.none()
    | st.integers(1, 150).flatmap(lambda low: st.tuples(st.just(low), st.integers(low, 1_000))),
)
clock_step = st.integers(-30, 120)


@attrs.define
class ModelConsumer:
    node: str
    prefetch: int
    cancelled: bool = False


Ref = tuple[str, int]  # (queue, offset)


class QueueMachineRules(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.machine = Machine()
        self.index = 0
        self.ts = 0
        self.now = 0
        """The machine's clock: the largest timestamp applied so far."""
        self.log: list[tuple[Meta, Command]] = []
        self.applied: list[Applied] = []
        self.snapshot: tuple[int, bytes] | None = None
        self.options: dict[str, QueueOptions] = {}
        self.body_counter = 0
        # the model
        self.enqueued: dict[Ref, tuple[str | None, bytes]] = {}
        self.next_offset = dict.fromkeys(QUEUES, 0)
        self.held: dict[Ref, str] = {}
        self.acked: set[Ref] = set()
        self.dropped: set[Ref] = set()
        self.delivered_ever: set[Ref] = set()
        self.failures: dict[Ref, int] = {}
        self.consumers: dict[str, dict[str, ModelConsumer]] = {q: {} for q in QUEUES}
        self.last_unkeyed_first: dict[tuple[str, str], int] = {}
        self.last_key_first: dict[tuple[str, str], int] = {}
        self.producer_offsets: dict[tuple[str, str], dict[int, int]] = {}
        self.producer_last: dict[tuple[str, str], int] = {}
        self.forgotten_generation: dict[str, int] = {}
        self.sealed: dict[str, dict[str, int]] = {}
        """queue -> producer-id prefix sealed -> when (`ForgetProducers.seal`); a
        deleted queue's seals go with it."""
        self.landed: dict[tuple[str, str, int], int] = {}
        """(queue, producer, seq) -> offset, for ids with a generation: never forgotten."""
        self.down_nodes: set[str] = set()
        self.returned: set[Ref] = set()
        self.leaving: set[Ref] = set()
        """Messages given back and not delivered or gone since: under single active
        consumer they come before any later message (strict FIFO)."""
        self.due: dict[Ref, int] = {}
        """Returned messages held back by a retry delay: when they may go out again."""
        self.deleted: set[str] = set()
        """Queues deleted and not declared again."""
        self.enqueued_at: dict[Ref, int] = {}
        """When each message entered its queue, by the log's clock (TTL runs from it)."""
        self.rejecting: set[Ref] = set()
        """The messages the step being judged nacked without requeue."""

    # ---------------------------------------------------------------- driving

    def apply(self, command: Command, dt: int = 0) -> Applied:
        self.index += 1
        self.ts = max(0, self.ts + dt)
        self.now = max(self.now, self.ts)
        meta = Meta(self.index, self.ts)
        self.log.append((meta, command))
        before = self.ends()
        applied = self.machine.apply(meta, command)
        self.applied.append(applied)
        moved = {q for q, end in self.ends().items() if end >= 0 and end != before[q]}
        assert moved <= ends_moved(command, applied), (command, moved)  # reads wake on them
        return applied

    def ends(self) -> dict[str, int]:
        """Each queue's end (-1: none), as waiting reads see it."""
        ends = dict.fromkeys(QUEUES, -1)
        for q in QUEUES:
            with contextlib.suppress(UnknownQueueError):
                ends[q] = self.machine.stats(q).next_offset
        return ends

    def body(self) -> bytes:
        self.body_counter += 1
        return b"b%d" % self.body_counter

    def held_by(self, queue: str, consumer: str) -> list[int]:
        return sorted(o for (q, o), c in self.held.items() if q == queue and c == consumer)

    def forget_idle_cancelled(self, queue: str) -> None:
        for cid, mc in list(self.consumers[queue].items()):
            if mc.cancelled and not self.held_by(queue, cid):
                del self.consumers[queue][cid]

    def give_back(
        self, queue: str, offsets: list[int], failed: set[int], delay_ms: int | None = None
    ) -> None:
        """Return held `offsets`; the failed ones wait `delay_ms`, or the queue's backoff."""
        backoff = self.options[queue].retry_backoff_ms
        for off in offsets:
            ref = (queue, off)
            del self.held[ref]
            self.returned.add(ref)
            if off in failed:
                failures = self.failures[ref] = self.failures.get(ref, 0) + 1
                delay = delay_ms
                if delay is None:
                    delay = (
                        0 if backoff is None else min(backoff[1], backoff[0] * 2 ** (failures - 1))
                    )
                if delay:
                    self.due[ref] = self.now + delay

    def gone(self, queue: str, applied: Applied) -> bool:
        """Whether `queue` is deleted: then the command was refused, and did nothing."""
        if queue not in self.deleted:
            return False
        assert isinstance(applied.reply, Error), applied.reply
        assert applied.reply.code is ErrorCode.UNKNOWN_QUEUE, applied.reply
        assert applied.effects == ()
        return True

    def forget_producer(self, queue: str, producer: str) -> None:
        """`queue` forgets `producer`: unknown ids of its generation or below are refused
        from now on. The mark is capped at the log's time (an id made up far ahead must
        not lock every client out), so an id above it is new again: what it landed may
        land again, and `landed` stops holding it to one offset."""
        self.producer_last.pop((queue, producer), None)
        self.producer_offsets.pop((queue, producer), None)
        generation = producer_generation(producer)
        if generation is None:
            return
        mark = max(self.forgotten_generation.get(queue, 0), min(generation, self.now))
        self.forgotten_generation[queue] = mark
        if generation > mark:
            for slot in [k for k in self.landed if k[:2] == (queue, producer)]:
                del self.landed[slot]

    def forget_queue(self, queue: str) -> None:
        """The model of a deleted queue: no message, consumer or producer. A queue declared
        again under the name carries on from its next offset, and has forgotten its
        producers (`landed` and the forgotten generation outlive it)."""
        for producer in sorted(p for q, p in self.producer_last if q == queue):
            self.forget_producer(queue, producer)
        self.sealed.pop(queue, None)
        for refs in (self.held, self.due, self.failures, self.enqueued):
            for ref in [r for r in refs if r[0] == queue]:
                del refs[ref]  # type: ignore[attr-defined]
        for group in (self.acked, self.dropped, self.delivered_ever, self.returned, self.leaving):
            group.difference_update({r for r in group if r[0] == queue})
        for slots in (
            self.last_unkeyed_first,
            self.last_key_first,
            self.producer_offsets,
            self.producer_last,
        ):
            for slot in [k for k in slots if k[0] == queue]:
                del slots[slot]  # type: ignore[attr-defined]
        self.consumers[queue] = {}

    def ready_refs(self, queue: str) -> list[int]:
        """The model's ready offsets of `queue` (not held, settled or leaving), ascending."""
        gone = self.acked | self.dropped | self.leaving
        return sorted(
            o
            for q, o in self.enqueued
            if q == queue and (q, o) not in self.held and (q, o) not in gone
        )

    def could_take(self, queue: str, consumer: str) -> list[int]:
        """The ready offsets `consumer` could be given now (rule 1, keys, retry delays)."""
        ready = self.ready_refs(queue)
        holders = {self.enqueued[r][0]: c for r, c in self.held.items() if r[0] == queue}
        first_of_key: dict[str, int] = {}
        out = []
        for off in ready:
            key = self.enqueued[(queue, off)][0]
            if key is not None:
                if key in first_of_key:
                    continue  # behind the key's first ready message
                first_of_key[key] = off
                if holders.get(key, consumer) != consumer:
                    continue  # another consumer owns the key
            if self.due.get((queue, off), 0) > self.now:
                continue  # waits for its retry delay
            out.append(off)
        if self.options[queue].single_active_consumer:
            waiting = [o for o in ready if self.due.get((queue, o), 0) > self.now]
            if waiting:
                out = [o for o in out if o < waiting[0]]  # the queue waits, in order
        return out

    def take_effects(self, applied: Applied) -> None:
        self.leaving = {
            (e.queue, e.offset)
            for e in applied.effects
            if isinstance(e, Dropped | DeadLettered)
            and not (e.reason == "max_length" and self.due.get((e.queue, e.offset), 0) > self.now)
        }  # a return dropped in the same step does not come first: it is gone. One that
        # waits out a retry delay and is dropped by max_length goes after the step's first
        # deliveries (max_length is enforced after dispatch, not to drop what a consumer
        # takes at once), so for them it still holds its key, or the queue, back
        for e in applied.effects:
            if isinstance(e, Dropped | DeadLettered):
                self.judge_exit(e)
            if isinstance(e, ConsumerDown):
                mc = self.consumers[e.queue].pop(e.consumer)
                assert mc.node == e.node
                held = self.held_by(e.queue, e.consumer)
                self.give_back(e.queue, held, set(held))
            elif isinstance(e, Dropped):
                self.leave((e.queue, e.offset))
            elif isinstance(e, DeadLettered):
                self.leave((e.queue, e.offset))
                assert e.target_queue == self.options[e.queue].dead_letter_queue
                assert e.target_offset == self.next_offset[e.target_queue]
                self.next_offset[e.target_queue] += 1
                self.enqueued[(e.target_queue, e.target_offset)] = self.enqueued[
                    (e.queue, e.offset)
                ]
                self.enqueued_at[(e.target_queue, e.target_offset)] = self.now
            elif isinstance(e, Deliver):
                self.deliver(e)
            elif isinstance(e, Purged):
                assert e.reason == "purged", e  # a delete's effects are checked by its rule
                for off in e.offsets:
                    self.leave((e.queue, off))
            else:  # pragma: no cover - a new effect type needs a model
                raise AssertionError(f"unexpected effect {e}")
        for q in QUEUES:
            self.forget_idle_cancelled(q)
        self.judge_max_length_drops(applied)

    def judge_exit(self, e: Dropped | DeadLettered) -> None:
        """A message leaves undelivered only for a reason that holds now: its TTL passed
        by the log's clock, the queue was over its length (`judge_max_length_drops`),
        its consumer rejected it in this step, it failed past the delivery limit, or
        its dead-letter queue is full. (Every drop was taken as legitimate: messages
        expired at half their TTL, and drop-head keeping one message too few, passed.)"""
        ref = (e.queue, e.offset)
        opts = self.options[e.queue]
        if e.reason == "expired":
            ttl = opts.message_ttl_ms
            assert ttl is not None, f"{ref} expired in a queue without a TTL"
            assert self.enqueued_at[ref] + ttl <= self.now, (
                f"{ref} expired at {self.now}, enqueued at {self.enqueued_at[ref]}, TTL {ttl}"
            )
        elif e.reason == "max_length":
            assert opts.overflow == "drop-head" and opts.max_length is not None, ref
        elif e.reason == "rejected":
            assert ref in self.rejecting, f"{ref} rejected, but not nacked without requeue"
        elif e.reason == "delivery_limit":
            limit = opts.delivery_limit
            assert limit is not None, f"{ref} over a delivery limit its queue does not have"
            assert self.failures.get(ref, 0) > limit, (ref, self.failures.get(ref, 0), limit)
        elif e.reason == "dead_letter_full":
            target = opts.dead_letter_queue
            assert target is not None, ref
            topts = self.options[target]
            assert topts.overflow == "reject-publish" and topts.max_length is not None, ref
            assert len(self.ready_refs(target)) >= topts.max_length, ref
        else:
            assert e.reason == "dead_letter_cycle", e
            assert opts.dead_letter_queue is not None, ref

    def judge_max_length_drops(self, applied: Applied) -> None:
        """A drop-head drop leaves the queue at its length: what is ready after the
        step, and what the step delivered after the drop, make at least `max_length`."""
        dropped = {
            e.queue for e in applied.effects if isinstance(e, Dropped) and e.reason == "max_length"
        }
        for q in dropped:
            limit = self.options[q].max_length
            assert limit is not None
            delivered = sum(1 for e in applied.effects if isinstance(e, Deliver) and e.queue == q)
            ready = len(self.ready_refs(q))
            assert ready + delivered >= limit, f"{q}: {ready} ready after a drop, max {limit}"

    def leave(self, ref: Ref) -> None:
        self.returned.discard(ref)
        self.due.pop(ref, None)
        assert ref in self.enqueued, ref
        assert ref not in self.held, f"{ref} left while held"
        assert ref not in self.acked and ref not in self.dropped, ref
        self.dropped.add(ref)

    def deliver(self, e: Deliver) -> None:
        ref = (e.queue, e.offset)
        assert ref in self.enqueued, f"delivered an offset never enqueued: {ref}"
        assert ref not in self.acked, f"acked message delivered again: {ref}"
        assert ref not in self.dropped, f"dropped message delivered: {ref}"
        assert ref not in self.held, f"{ref} held by {self.held.get(ref)} and given to {e.consumer}"
        mc = self.consumers[e.queue].get(e.consumer)
        assert mc is not None and not mc.cancelled, f"delivery to gone consumer {e}"
        assert e.node == mc.node
        assert (e.key, e.body) == self.enqueued[ref]
        assert e.redelivered == (ref in self.delivered_ever)
        assert e.delivery_count == self.failures.get(ref, 0)
        due = self.due.pop(ref, 0)
        assert due <= self.now, f"{ref} given at {self.now}, before its retry delay ends at {due}"
        lower = [o for o in self.could_take(e.queue, e.consumer) if o < e.offset]
        assert not lower, f"{ref} given to {e.consumer} while it could take {lower} (rule 1)"
        self.returned.discard(ref)
        if self.options[e.queue].single_active_consumer:
            # the oldest subscriber that is not cancelled, or that still holds messages:
            # a cancelled one with messages out keeps the next from taking over
            active = next(
                c
                for c, m in self.consumers[e.queue].items()
                if not m.cancelled or self.held_by(e.queue, c)
            )
            assert e.consumer == active, "single active consumer: only the oldest receives"
            earlier = [
                o
                for q, o in self.returned
                if q == e.queue and o < e.offset and (q, o) not in self.leaving
            ]
            assert not earlier, f"single active consumer: {earlier} returned, {e.offset} given"
        if not e.redelivered:
            if e.key is None:
                slot = (e.queue, e.consumer)
                assert e.offset > self.last_unkeyed_first.get(slot, -1), "unkeyed order"
                self.last_unkeyed_first[slot] = e.offset
            else:
                slot = (e.queue, e.key)
                assert e.offset > self.last_key_first.get(slot, -1), "per-key order"
                self.last_key_first[slot] = e.offset
        self.held[ref] = e.consumer
        self.delivered_ever.add(ref)
        if mc.prefetch:
            assert len(self.held_by(e.queue, e.consumer)) <= mc.prefetch, "prefetch exceeded"

    def record_enqueued(
        self, queue: str, reply: Enqueued, messages: list[tuple[str | None, bytes]]
    ) -> None:
        assert reply.offset == self.next_offset[queue]
        assert reply.count == len(messages)
        for i, message in enumerate(messages):
            self.enqueued[(queue, reply.offset + i)] = message
            self.enqueued_at[(queue, reply.offset + i)] = self.now
        self.next_offset[queue] += len(messages)

    def producer_enqueue(
        self,
        queue: str,
        producer: str,
        seq: int,
        messages: list[tuple[str | None, bytes]],
        applied: Applied,
        ready_before: int,
    ) -> None:
        slot = (queue, producer)
        last = self.producer_last.get(slot)
        reply = applied.reply
        n = len(messages)
        if last is not None and seq + n - 1 <= last:
            assert isinstance(reply, Enqueued) and reply.duplicate, reply
            assert reply.offset == self.producer_offsets[slot].get(seq)
            assert applied.effects == ()
            return
        seals = self.sealed.get(queue, {})
        if last is None and any(
            producer.startswith(p) and self.now - at < PRODUCER_EXPIRY_MS for p, at in seals.items()
        ):
            assert isinstance(reply, Error) and reply.code is ErrorCode.PRODUCER_SEALED, reply
            assert applied.effects == ()
            return
        generation = producer_generation(producer)
        forgotten = self.forgotten_generation.get(queue, 0)
        if last is None and generation is not None and generation <= forgotten:
            assert isinstance(reply, Error), reply
            assert reply.code is ErrorCode.PRODUCER_FORGOTTEN, reply
            return
        expected = 0 if last is None else last + 1  # a new producer starts at 0
        if seq != expected:
            assert isinstance(reply, Error) and reply.code is ErrorCode.OUT_OF_ORDER, reply
            assert reply.expected_seq == expected
            return
        if self.refused_as_full(queue, reply, n, ready_before):
            return
        assert isinstance(reply, Enqueued) and not reply.duplicate, reply
        assert reply.offset is not None
        self.record_enqueued(queue, reply, messages)
        self.producer_last[slot] = seq + n - 1
        offsets = self.producer_offsets.setdefault(slot, {})
        for i in range(n):
            offsets[seq + i] = reply.offset + i
            if generation is not None:
                landed = self.landed.setdefault((queue, producer, seq + i), reply.offset + i)
                assert landed == reply.offset + i, f"{producer} seq {seq + i}: a second offset"

    def refused_as_full(self, queue: str, reply: object, n: int, ready_before: int) -> bool:
        opts = self.options[queue]
        if isinstance(reply, Error):
            assert opts.overflow == "reject-publish" and opts.max_length is not None
            # a batch longer than max_length can never fit; a shorter one is full for now
            never = ErrorCode.OVER_MAX_LENGTH if n > opts.max_length else ErrorCode.QUEUE_FULL
            assert reply.code is never, reply
            return True
        if opts.overflow == "reject-publish" and opts.max_length is not None:
            assert opts.message_ttl_ms is not None or ready_before + n <= opts.max_length
        return False

    # ------------------------------------------------------------------ rules

    @initialize(
        q1=options_strategy,
        q2=options_strategy,
        subscribers=st.lists(
            st.tuples(
                st.sampled_from(WORK_QUEUES),
                st.sampled_from(CONSUMERS),
                st.sampled_from(NODES),
                st.sampled_from([0, 1, 2, 3]),
            ),
            max_size=3,
            unique_by=lambda s: s[:2],
        ),
    )
    def declare_queues(
        self, q1: QueueOptions, q2: QueueOptions, subscribers: list[tuple[str, str, str, int]]
    ) -> None:
        """Declare the queues, and subscribe some consumers from the start (sequences
        where messages are held, returned and retried are the ones that find bugs)."""
        self.options = {"dlq": QueueOptions(), "q1": q1, "q2": q2}
        for name in ("dlq", "q1", "q2"):
            applied = self.apply(Declare(queue=name, options=self.options[name]))
            assert applied.reply == Declared(created=True)
        for queue, consumer, node, prefetch in subscribers:
            self.subscribe(queue, consumer, node, prefetch, 0)

    @rule(queue=st.sampled_from(QUEUES), key=st.sampled_from(KEYS), dt=clock_step)
    def enqueue(self, queue: str, key: str | None, dt: int) -> None:
        body = self.body()
        ready_before = 0 if queue in self.deleted else len(self.machine.ready(queue))
        applied = self.apply(Enqueue(queue=queue, body=body, key=key), dt)
        if self.gone(queue, applied):
            return
        if not self.refused_as_full(queue, applied.reply, 1, ready_before):
            assert isinstance(applied.reply, Enqueued)
            self.record_enqueued(queue, applied.reply, [(key, body)])
        self.take_effects(applied)

    @rule(
        queue=st.sampled_from(WORK_QUEUES),
        keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=5),
        producer=st.none() | st.sampled_from(PRODUCERS),
        seq_shift=st.sampled_from([0, 0, 0, -1, -2, 1]),
        dt=clock_step,
    )
    def enqueue_batch(
        self,
        queue: str,
        keys: list[str | None],
        producer: str | None,
        seq_shift: int,
        dt: int,
    ) -> None:
        messages = [(k, self.body()) for k in keys]
        seq = None
        if producer is not None:
            seq = max(0, self.producer_last.get((queue, producer), -1) + 1 + seq_shift)
        batch = EnqueueBatch(
            queue=queue,
            messages=[Message(body=b, key=k) for k, b in messages],
            producer=producer,
            first_seq=seq,
        )
        ready_before = 0 if queue in self.deleted else len(self.machine.ready(queue))
        applied = self.apply(batch, dt)
        if self.gone(queue, applied):
            return
        if producer is not None and seq is not None:
            self.producer_enqueue(queue, producer, seq, messages, applied, ready_before)
        elif not self.refused_as_full(queue, applied.reply, len(messages), ready_before):
            assert isinstance(applied.reply, Enqueued)
            self.record_enqueued(queue, applied.reply, messages)
        self.take_effects(applied)

    @rule(
        queue=st.sampled_from(WORK_QUEUES),
        producer=st.sampled_from(PRODUCERS),
        key=st.sampled_from(KEYS),
        seq_shift=st.sampled_from([0, 0, -1, -3, 2]),
        dt=clock_step,
    )
    def idempotent_enqueue(
        self, queue: str, producer: str, key: str | None, seq_shift: int, dt: int
    ) -> None:
        seq = max(0, self.producer_last.get((queue, producer), -1) + 1 + seq_shift)
        body = self.body()
        ready_before = 0 if queue in self.deleted else len(self.machine.ready(queue))
        cmd = Enqueue(queue=queue, body=body, key=key, producer=producer, seq=seq)
        applied = self.apply(cmd, dt)
        if self.gone(queue, applied):
            return
        self.producer_enqueue(queue, producer, seq, [(key, body)], applied, ready_before)
        self.take_effects(applied)

    @rule(
        queue=st.sampled_from(QUEUES),
        consumer=st.sampled_from(CONSUMERS),
        node=st.sampled_from(NODES),
        prefetch=st.sampled_from([0, 1, 2, 3]),
        dt=clock_step,
    )
    def subscribe(self, queue: str, consumer: str, node: str, prefetch: int, dt: int) -> None:
        applied = self.apply(
            Subscribe(queue=queue, consumer=consumer, node=node, prefetch=prefetch), dt
        )
        if self.gone(queue, applied):
            return
        if node in self.down_nodes:
            assert isinstance(applied.reply, Error) and applied.reply.code is ErrorCode.NODE_DOWN
        elif consumer in self.consumers[queue]:
            assert isinstance(applied.reply, Error)
            assert applied.reply.code is ErrorCode.CONSUMER_EXISTS
        else:
            assert applied.reply == OK
            self.consumers[queue][consumer] = ModelConsumer(node=node, prefetch=prefetch)
        self.take_effects(applied)

    @rule(queue=st.sampled_from(QUEUES), consumer=st.sampled_from(CONSUMERS), dt=clock_step)
    def cancel(self, queue: str, consumer: str, dt: int) -> None:
        applied = self.apply(Cancel(queue=queue, consumer=consumer), dt)
        if self.gone(queue, applied):
            return
        mc = self.consumers[queue].get(consumer)
        if mc is None:
            assert isinstance(applied.reply, Error)
            assert applied.reply.code is ErrorCode.UNKNOWN_CONSUMER
        else:
            assert applied.reply == OK
            mc.cancelled = True
        self.take_effects(applied)

    def pick_held(
        self, data: st.DataObject, queue: str, consumer: str, stray: bool
    ) -> tuple[list[int], bool]:
        held = self.held_by(queue, consumer)
        offsets = data.draw(st.lists(st.sampled_from(held), min_size=1)) if held else []
        if stray or not offsets:
            offsets.append(data.draw(st.integers(0, self.next_offset[queue] + 2)))
        ok = all(o in held for o in offsets)
        return offsets, ok

    def settled(self, applied: Applied, queue: str, consumer: str, all_held: bool) -> bool:
        """Check the reply to an ack or nack; True when it took effect."""
        if self.gone(queue, applied):
            return False
        if consumer not in self.consumers[queue]:
            assert isinstance(applied.reply, Error)
            assert applied.reply.code is ErrorCode.UNKNOWN_CONSUMER
            return False
        if not all_held:
            assert isinstance(applied.reply, Error) and applied.reply.code is ErrorCode.NOT_HELD
            assert applied.effects == ()
            return False
        assert applied.reply == OK
        return True

    @rule(
        data=st.data(),
        queue=st.sampled_from(QUEUES),
        consumer=st.sampled_from(CONSUMERS),
        stray=st.booleans(),
        dt=clock_step,
    )
    def ack(self, data: st.DataObject, queue: str, consumer: str, stray: bool, dt: int) -> None:
        offsets, ok = self.pick_held(data, queue, consumer, stray and data.draw(st.booleans()))
        applied = self.apply(Ack(queue=queue, consumer=consumer, offsets=offsets), dt)
        if self.settled(applied, queue, consumer, ok):
            for off in set(offsets):
                del self.held[(queue, off)]
                self.acked.add((queue, off))
        self.take_effects(applied)

    @rule(
        data=st.data(),
        queue=st.sampled_from(QUEUES),
        consumer=st.sampled_from(CONSUMERS),
        requeue=st.booleans(),
        delay_ms=st.none() | st.integers(0, 60) | st.integers(200, 2_000),
        dt=clock_step,
    )
    def nack(
        self,
        data: st.DataObject,
        queue: str,
        consumer: str,
        requeue: bool,
        delay_ms: int | None,
        dt: int,
    ) -> None:
        offsets, ok = self.pick_held(data, queue, consumer, stray=False)
        self.apply_nack(queue, consumer, offsets, ok, requeue, delay_ms if requeue else None, dt)

    def apply_nack(
        self,
        queue: str,
        consumer: str,
        offsets: list[int],
        ok: bool,
        requeue: bool,
        delay_ms: int | None,
        dt: int,
    ) -> None:
        nack = Nack(
            queue=queue, consumer=consumer, offsets=offsets, requeue=requeue, delay_ms=delay_ms
        )
        applied = self.apply(nack, dt)
        if self.settled(applied, queue, consumer, ok):
            nacked = set(offsets)
            if requeue:
                back = set(o for o in nacked if self.enqueued[(queue, o)][0] is None)
                first_by_key: dict[str, int] = {}
                for o in nacked:
                    key = self.enqueued[(queue, o)][0]
                    if key is not None:
                        first_by_key[key] = min(o, first_by_key.get(key, o))
                for o in self.held_by(queue, consumer):
                    key = self.enqueued[(queue, o)][0]
                    if key in first_by_key and o >= first_by_key[key]:
                        back.add(o)  # rule 4: the key's later messages come back with it
                self.give_back(queue, sorted(back), nacked, delay_ms)
            else:
                for o in nacked:
                    del self.held[(queue, o)]
                self.rejecting = {(queue, o) for o in nacked}
                rejected = {
                    e.offset
                    for e in applied.effects
                    if isinstance(e, Dropped | DeadLettered) and e.reason == "rejected"
                }
                assert rejected == nacked
        self.take_effects(applied)
        self.rejecting = set()

    @precondition(lambda self: self.held)
    @rule(
        data=st.data(),
        delay_ms=st.one_of(st.none(), st.none(), st.integers(0, 60), st.integers(200, 2_000)),
        dt=clock_step,
    )
    def retry_held(self, data: st.DataObject, delay_ms: int | None, dt: int) -> None:
        """A consumer that holds messages gives one back to be retried (the `nack` rule
        mostly names one that holds nothing: this one keeps retries, and their delays
        and backoff, common)."""
        queue, consumer = data.draw(
            st.sampled_from(sorted({(q, c) for (q, _), c in self.held.items()}))
        )
        offsets, ok = self.pick_held(data, queue, consumer, stray=False)
        self.apply_nack(queue, consumer, offsets, ok, True, delay_ms, dt)

    @rule(consumer=st.sampled_from(CONSUMERS), dt=clock_step)
    def down(self, consumer: str, dt: int) -> None:
        applied = self.apply(Down(consumer=consumer), dt)
        assert applied.reply == OK
        gone = {e.queue for e in applied.effects if isinstance(e, ConsumerDown)}
        assert gone == {q for q in QUEUES if consumer in self.consumers[q]}
        self.take_effects(applied)

    @rule(node=st.sampled_from(NODES), dt=clock_step)
    def node_down(self, node: str, dt: int) -> None:
        applied = self.apply(NodeDown(node=node), dt)
        expected = {(q, c) for q in QUEUES for c, m in self.consumers[q].items() if m.node == node}
        gone = {(e.queue, e.consumer) for e in applied.effects if isinstance(e, ConsumerDown)}
        assert gone == expected
        self.down_nodes.add(node)
        self.take_effects(applied)

    @precondition(lambda self: self.down_nodes)
    @rule(data=st.data(), dt=clock_step)
    def node_up(self, data: st.DataObject, dt: int) -> None:
        node = data.draw(st.sampled_from(sorted(self.down_nodes)))
        applied = self.apply(NodeUp(node=node), dt)
        assert (applied.reply, applied.effects) == (OK, ())
        self.down_nodes.discard(node)

    @rule(dt=st.integers(0, 400))
    def tick(self, dt: int) -> None:
        applied = self.apply(Tick(), dt)
        assert applied.reply == OK
        self.take_effects(applied)
        self.leaving = set()
        for q in QUEUES:  # what is due went out: nobody who may receive is left idle
            for c in self.receiving(q):
                assert not self.could_take(q, c), f"{q}: {c} could take {self.could_take(q, c)}"

    @precondition(lambda self: any(due > self.now for due in self.due.values()))
    @rule(off_by=st.integers(-2, 1))
    def tick_when_a_retry_is_due(self, off_by: int) -> None:
        """Time moves to just before, at or just after the next retry the model expects:
        a delay that runs out early, late or not at all shows here."""
        due = min(due for due in self.due.values() if due > self.now)
        self.tick(due + off_by - self.ts)

    def receiving(self, queue: str) -> list[str]:
        """Consumers of `queue` that may be given a message now (live, with credit, the
        active one under single active consumer)."""
        live = [
            c
            for c, m in self.consumers[queue].items()
            if not m.cancelled and (not m.prefetch or len(self.held_by(queue, c)) < m.prefetch)
        ]
        if self.options[queue].single_active_consumer:
            active = next(
                (
                    c
                    for c, m in self.consumers[queue].items()
                    if not m.cancelled or self.held_by(queue, c)
                ),
                None,
            )
            return [c for c in live if c == active]
        return live

    @rule(queue=st.sampled_from(QUEUES), group=st.sampled_from(["g1", "g2"]), data=st.data())
    def commit_offset(self, queue: str, group: str, data: st.DataObject) -> None:
        offset = data.draw(st.integers(0, self.next_offset[queue] + 1))
        applied = self.apply(CommitOffset(queue=queue, group=group, offset=offset))
        if self.gone(queue, applied):
            return
        if offset <= self.next_offset[queue]:
            assert applied.reply == OK
            assert self.machine.committed_offset(queue, group) == offset
        else:
            assert isinstance(applied.reply, Error) and applied.reply.code is ErrorCode.INVALID

    @rule(
        queue=st.sampled_from(QUEUES),
        prefix=st.sampled_from(["", "p", *PRODUCERS, "x", "g5-", "g9-"]),
        seal=st.booleans(),
    )
    def forget_producers(self, queue: str, prefix: str, seal: bool) -> None:
        applied = self.apply(ForgetProducers(queue=queue, prefix=prefix, seal=seal))
        if self.gone(queue, applied):
            return
        assert applied.effects == ()
        if not prefix or (seal and not prefix.endswith("-")):
            assert isinstance(applied.reply, Error) and applied.reply.code is ErrorCode.INVALID
            return
        if seal:  # new producers under it are refused from now on (`producer_enqueue`)
            self.sealed.setdefault(queue, {})[prefix] = self.now
        gone = [s for s in self.producer_last if s[0] == queue and s[1].startswith(prefix)]
        assert applied.reply == Forgotten(count=len(gone))
        for _, producer in gone:  # its next enqueue starts afresh, at seq 0
            self.forget_producer(queue, producer)

    @rule(queue=st.sampled_from(QUEUES), dt=clock_step)
    def purge(self, queue: str, dt: int) -> None:
        ready = [] if queue in self.deleted else self.ready_refs(queue)
        applied = self.apply(PurgeQueue(queue=queue), dt)
        if self.gone(queue, applied):
            return
        assert applied.reply == QueuePurged(messages=len(ready)), (applied.reply, ready)
        expected = (Purged(queue=queue, offsets=tuple(ready), reason="purged"),)
        assert applied.effects == (expected if ready else ())
        self.take_effects(applied)

    @rule(queue=st.sampled_from(QUEUES), force=st.booleans(), dt=clock_step)
    def delete_queue(self, queue: str, force: bool, dt: int) -> None:
        applied = self.apply(DeleteQueue(queue=queue, force=force), dt)
        if self.gone(queue, applied):
            return
        consumers = self.consumers[queue]
        if consumers and not force:
            assert isinstance(applied.reply, Error), applied.reply
            assert applied.reply.code is ErrorCode.QUEUE_IN_USE
            assert applied.effects == ()
            return
        gone = self.ready_refs(queue) + [o for q, o in self.held if q == queue]
        assert applied.reply == QueueDeleted(messages=len(gone), consumers=len(consumers))
        down = [
            ConsumerDown(queue=queue, consumer=c, node=m.node, reason="queue_deleted")
            for c, m in consumers.items()
        ]
        purged = [Purged(queue=queue, offsets=tuple(sorted(gone)), reason="queue_deleted")]
        assert list(applied.effects) == down + (purged if gone else [])
        self.forget_queue(queue)
        self.deleted.add(queue)

    @precondition(lambda self: self.deleted)
    @rule(data=st.data(), options=options_strategy, dt=clock_step)
    def declare_again(self, data: st.DataObject, options: QueueOptions, dt: int) -> None:
        queue = data.draw(st.sampled_from(sorted(self.deleted)))
        if queue == "dlq":
            options = QueueOptions()
        applied = self.apply(Declare(queue=queue, options=options), dt)
        assert (applied.reply, applied.effects) == (Declared(created=True), ())
        self.options[queue] = options
        self.deleted.discard(queue)
        stats = self.machine.stats(queue)  # empty, where the deleted queue ended
        assert (stats.first_retained, stats.next_offset) == (self.next_offset[queue],) * 2
        assert (stats.ready, stats.unacked, stats.consumers, stats.producers) == (0, 0, 0, 0)

    @rule()
    def snapshot_round_trip(self) -> None:
        snapshot = self.machine.snapshot()
        restored = Machine.restore(snapshot)
        assert restored.digest() == self.machine.digest()
        if self.snapshot is None or self.index % 2:
            self.snapshot = (len(self.log), snapshot)

    # ------------------------------------------------------------- invariants

    def live_queues(self) -> list[str]:
        return [q for q in QUEUES if q not in self.deleted]

    @invariant()
    def holds_match_the_model(self) -> None:
        assert set(self.machine.queues()) == set(QUEUES) - self.deleted
        for q in self.live_queues():
            assert set(self.machine.consumers(q)) == set(self.consumers[q])
            for c in self.consumers[q]:
                assert list(self.machine.unacked(q, c)) == self.held_by(q, c), (q, c)

    @invariant()
    def producers_match_the_model(self) -> None:
        for q in self.live_queues():
            mine = sorted(p for queue, p in self.producer_last if queue == q)
            assert list(self.machine.producers(q)) == mine

    @invariant()
    def nobody_idle_while_a_message_waits(self) -> None:
        """After every step, not only `Tick`: a consumer with credit is given what it
        could take. Messages that waited out a retry delay are excused until the next
        `Tick` (the leader proposes one when a delay runs out; `tick` checks them)."""
        for q in self.live_queues():
            delayed = [o for o in self.ready_refs(q) if (q, o) in self.due]
            for c in self.receiving(q):
                idle = [o for o in self.could_take(q, c) if (q, o) not in self.due]
                if delayed and self.options[q].single_active_consumer:
                    idle = [o for o in idle if o < delayed[0]]  # strict FIFO waits too
                assert not idle, f"{q}: {c} could take {idle}"

    @invariant()
    def no_message_is_lost(self) -> None:
        for q in self.live_queues():
            ready = {(q, o) for o in self.machine.ready(q)}
            mine = {r for r in self.enqueued if r[0] == q}
            held = {r for r in self.held if r[0] == q}
            settled = {r for r in self.acked | self.dropped if r[0] == q}
            assert ready.isdisjoint(held) and ready.isdisjoint(settled)
            assert ready | held | settled == mine

    @invariant()
    def keys_are_held_by_one_consumer_and_older_than_ready(self) -> None:
        for q in self.live_queues():
            holders: dict[str, set[str]] = {}
            newest_held: dict[str, int] = {}
            for (queue, off), c in self.held.items():
                key = self.enqueued[(queue, off)][0]
                if queue == q and key is not None:
                    holders.setdefault(key, set()).add(c)
                    newest_held[key] = max(off, newest_held.get(key, -1))
            assert all(len(cs) == 1 for cs in holders.values()), holders
            for off in self.machine.ready(q):
                key = self.enqueued[(q, off)][0]
                if key is not None:
                    assert off > newest_held.get(key, -1), (q, key, off)

    @invariant()
    def stream_view_never_changes(self) -> None:
        for q in self.live_queues():
            stats = self.machine.stats(q)
            assert stats.next_offset == self.next_offset[q]
            got = self.machine.read(q, 0, stats.next_offset)
            assert [m.offset for m in got] == list(range(stats.first_retained, stats.next_offset))
            assert all((m.key, m.body) == self.enqueued[(q, m.offset)] for m in got)

    def teardown(self) -> None:
        """Replicas fed the same log, one from the start and one from a snapshot, make
        the same decisions at every step (equal end states alone could hide two replicas
        that delivered a message to different consumers, then saw both acked)."""
        replica = Machine()
        for (meta, command), applied in zip(self.log, self.applied, strict=True):
            assert replica.apply(meta, command) == applied, (meta, command)
        assert replica.digest() == self.machine.digest()
        if self.snapshot is not None:
            at, snapshot = self.snapshot
            restored = Machine.restore(snapshot)
            for (meta, command), applied in zip(self.log[at:], self.applied[at:], strict=True):
                assert restored.apply(meta, command) == applied, (meta, command)
            assert restored.digest() == self.machine.digest()


QueueMachineRules.TestCase.settings = settings(
    # CI runs 200 sequences; QUORUMQ_PROPERTY_EXAMPLES=5000 for a deep local hunt
    max_examples=int(os.environ.get("QUORUMQ_PROPERTY_EXAMPLES", "200")),
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
TestQueueMachine = QueueMachineRules.TestCase
