"""The queue machine: `apply(meta, command) -> Applied(reply, effects)`.

Deterministic and pure: the same commands in the same order give the same state,
replies and effects on every replica. No clock (time is `meta.ts_ms`, clamped so it
never runs back), no randomness, no I/O. A refused command gets an `Error` reply and
changes nothing but the clock (messages whose TTL ran out still expire).

`Machine` here is `apply` and each command's handler; its fields are `MachineState`
(`state.py`), its read-only answers `Queries` (`queries.py`), its snapshot, digest and
restore `Snapshots` (`snapshots.py`); a queue's own state and rules are `QueueState`
(`queue.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from .commands import (
    DEFAULT_CONSUMER_TIMEOUT_MS,
    Ack,
    Cancel,
    Command,
    CommitOffset,
    Declare,
    DeleteQueue,
    DiskAlarm,
    Down,
    Enqueue,
    EnqueueBatch,
    ForgetProducers,
    Message,
    Nack,
    NodeDown,
    NodeUp,
    PurgeQueue,
    Subscribe,
    Tick,
)
from .effects import ConsumerDown, DeadLettered, Dropped, Effect, Purged
from .queries import Queries
from .queue import (
    ConsumerState,
    ProducerState,
    QueueState,
    Record,
    producer_generation,
)
from .replies import (
    OK,
    Declared,
    Enqueued,
    Error,
    ErrorCode,
    Forgotten,
    QueueDeleted,
    QueuePurged,
    Reply,
)
from .snapshots import Snapshots
from .state import UnknownQueueError, _error, _is_resend

PRODUCER_EXPIRY_MS = 7 * 24 * 3600 * 1000
"""An idempotent producer silent this long is forgotten (its next seq starts afresh)."""
MAX_PRODUCERS = 10_000
"""Most idempotent producers a queue remembers (without a bound, every client's producer
was kept for 7 days: 100,000 short-lived producers, 100,000 states). A new producer past
it makes room by forgetting producers silent for `EVICT_SILENT_MS` (the least recently
active tenth at most), or is refused (`too_many_producers`): a producer active within
the hour is never forgotten to make room (one forgotten seconds after its first publish
had that publish enqueued twice when its client resent it)."""
MAX_SEALED = 1_000
"""Most sealed producer-id prefixes a queue keeps (`ForgetProducers.seal`): one per Spark
job or micro-batch committed within `PRODUCER_EXPIRY_MS`, about 100 bytes each; past it
the oldest seal goes (a late attempt of that job's tasks could then write again)."""
MAX_SEALED_PREFIX = 128
"""Longest sealed prefix (a Spark sink's is at most about 70 characters): a new producer's
id is looked up at its dashes within this many characters, so a long id costs no more."""
EVICT_SILENT_MS = 3600 * 1000
"""How long a producer must be silent before it may be forgotten to make room."""
MAX_DELETED_NAMES = 10_000
"""Most names of deleted queues the machine remembers where their offsets ended (a queue
declared again under one carries on from there). Past it the oldest is folded into one
floor that every other new queue starts from, so memory stays bounded as queues come
and go, and no name ever gives an offset or takes a producer id twice."""


def _make_room_for_a_producer(q: QueueState, now: int) -> bool:
    """Forget up to a tenth of `q`'s producers, least recently active first (ties by id,
    so every replica forgets the same ones), of those silent for `EVICT_SILENT_MS`;
    whether there is room for one more now."""
    silent = sorted(
        (s.last_ts, p) for p, s in q.producers.items() if now - s.last_ts >= EVICT_SILENT_MS
    )
    for _, producer in silent[: max(1, len(q.producers) // 10)]:
        q.forget_producer(producer, now)
    return len(q.producers) < MAX_PRODUCERS


@attrs.frozen
class Meta:
    """Where a command sits in the log: its index, and the proposer's clock."""

    index: int
    ts_ms: int


@attrs.frozen
class Applied:
    reply: Reply
    effects: tuple[Effect, ...]


def ends_moved(command: Command, applied: Applied) -> set[str]:
    """The queues whose end (`stats(queue).next_offset`) applying `command` may have
    moved: the one a declare or an enqueue names (refused or not), and each a message
    was dead-lettered to. A node wakes the reads waiting on these queues only
    (`quorumq.node.reads`): one missing here would leave its reads waiting to their
    deadline."""
    moved = {command.queue} if isinstance(command, Declare | Enqueue | EnqueueBatch) else set()
    for e in applied.effects:
        if type(e) is DeadLettered:
            moved.add(e.target_queue)
    return moved


MAX_DEATH_HOPS = 32
"""Most dead-letterings of one message with no rejection between them."""
_PATH_SEPARATOR = "\x1f"


def _death_path(headers: dict[str, str]) -> list[str]:
    raw = headers.get("x-death-path")
    return raw.split(_PATH_SEPARATOR) if raw else []


class Machine(Queries, Snapshots):
    """The replicated state of every queue, changed only by `apply`."""

    @property
    def last_index(self) -> int:
        """Log index of the last command applied."""
        return self._last_index

    @property
    def now_ms(self) -> int:
        """The machine's clock: the largest `ts_ms` seen."""
        return self._now

    # ------------------------------------------------------------------ apply

    def apply(self, meta: Meta, command: Command) -> Applied:
        if meta.index <= self._last_index:
            return Applied(
                _error(
                    ErrorCode.STALE_INDEX,
                    f"index {meta.index} is not after {self._last_index}: already applied",
                ),
                (),
            )
        self._last_index = meta.index
        self._now = max(self._now, meta.ts_ms)
        effects: list[Any] = []
        handler = _HANDLERS[type(command)]
        reply = handler(self, command, effects)
        return Applied(reply, tuple(effects))

    def _queue(self, name: str) -> QueueState | Error:
        q = self._queues.get(name)
        if q is None:
            return _error(ErrorCode.UNKNOWN_QUEUE, f"no queue named {name!r}")
        return q

    def _consumer(self, q: QueueState, consumer: str) -> ConsumerState | Error:
        c = q.consumers.get(consumer)
        if c is None:
            return _error(
                ErrorCode.UNKNOWN_CONSUMER, f"no consumer {consumer!r} on queue {q.name!r}"
            )
        return c

    def _run(self, queues: list[QueueState], effects: list[Any]) -> None:
        """Deliver what can be delivered, then dead-letter or drop what left undelivered.

        Dead-lettering adds to another queue, which then runs too. It terminates: a
        dead-lettered message arrives fresh (TTL >= 1 ms) and drop-head only drops.
        """
        work = list(queues)
        now = self._now
        while work:
            q = work.pop(0)
            if q.options.message_ttl_ms is not None:
                q.expire(now)
            if q.sq:
                q.dispatch(now, effects)
            if q.options.max_length is not None:
                before, had_waiting = len(q.msgs), bool(q.waiting)
                q.enforce_max_length()
                if q.sq and had_waiting and len(q.msgs) != before:
                    # a dropped waiting message may unblock its key or the queue: what it
                    # frees is delivered after its drop (the effects say so in order)
                    self._empty_outbox(q, work, effects)
                    q.dispatch(now, effects)
            self._empty_outbox(q, work, effects)

    def _empty_outbox(self, q: QueueState, work: list[QueueState], effects: list[Any]) -> None:
        """Dead-letter or drop what left `q` undelivered; a dead-letter queue that got
        something joins `work`."""
        if not q.outbox:
            return
        for msg, reason, dead_letter in q.take_outbox():
            target = self._dead_letter(q, msg, reason, dead_letter, effects)
            if target is not None and target not in work:
                work.append(target)

    def _dead_letter(
        self, q: QueueState, msg: Record, reason: str, dead_letter: bool, effects: list[Any]
    ) -> QueueState | None:
        source_offset, key, body, old_headers, _ = msg
        name = q.options.dead_letter_queue
        target = self._queues.get(name) if (dead_letter and name is not None) else None
        if target is None:
            effects.append(Dropped(queue=q.name, offset=source_offset, reason=reason))
            return None
        opts = target.options
        if (
            opts.overflow == "reject-publish"
            and opts.max_length is not None
            and target.ready_count >= opts.max_length
        ):
            effects.append(Dropped(queue=q.name, offset=source_offset, reason="dead_letter_full"))
            return None
        headers = dict(old_headers or {})
        # Cycles (A -> B -> A with a TTL on both bounced a message for ever, taking a new
        # offset each time): as in RabbitMQ, a message that would be dead-lettered into a
        # queue it already died in, with no rejection by a consumer since, is dropped.
        # `x-death-path` lists those queues; `x-death-hops` bounds it anyway.
        path = [] if reason == "rejected" else [*_death_path(headers), q.name]
        if target.name in path or len(path) > MAX_DEATH_HOPS:
            effects.append(Dropped(queue=q.name, offset=source_offset, reason="dead_letter_cycle"))
            return None
        headers["x-death-reason"] = reason
        headers["x-death-queue"] = q.name
        headers["x-death-offset"] = str(source_offset)
        if path:
            headers["x-death-path"] = _PATH_SEPARATOR.join(path)
            headers["x-death-hops"] = str(len(path))
        else:  # a consumer rejected it: a new path starts
            headers.pop("x-death-path", None)
            headers.pop("x-death-hops", None)
        offset = target.append(body, key, headers, self._now)
        target.trim_stream()
        effects.append(
            DeadLettered(
                queue=q.name,
                offset=source_offset,
                reason=reason,
                target_queue=target.name,
                target_offset=offset,
            )
        )
        return target

    # --------------------------------------------------------------- handlers

    def _declare(self, cmd: Declare, effects: list[Any]) -> Reply:
        existing = self._queues.get(cmd.queue)
        if existing is not None:
            if existing.options == cmd.options:
                return Declared(created=False)
            return _error(
                ErrorCode.OPTIONS_MISMATCH,
                f"queue {cmd.queue!r} exists with other options: {existing.options}",
            )
        if cmd.options.dead_letter_queue == cmd.queue:
            return _error(ErrorCode.INVALID, "a queue cannot be its own dead_letter_queue")
        first_offset, generation = self._deleted.pop(cmd.queue, self._deleted_floor)
        self._queues[cmd.queue] = QueueState(
            cmd.queue, cmd.options, first_offset=first_offset, forgotten_generation=generation
        )
        return Declared(created=True)

    def _check_producer(
        self, q: QueueState, producer: str | None, seq: int | None, count: int
    ) -> Reply | None:
        """None to go ahead; else the reply for a duplicate or out-of-order enqueue."""
        if producer is None and seq is None:
            return None
        if producer is None or seq is None:
            return _error(ErrorCode.INVALID, "producer and seq go together")
        state = q.producers.get(producer)
        if state is None:
            sealed = q.sealed_prefix(producer[:MAX_SEALED_PREFIX], self._now, PRODUCER_EXPIRY_MS)
            if sealed is not None:
                return _error(
                    ErrorCode.PRODUCER_SEALED,
                    f"producer {producer!r} is sealed in {q.name!r} (prefix {sealed!r}): the "
                    "Spark job or micro-batch that made it has committed or aborted, so a late "
                    "attempt of its task writes nothing (its rows landed, or the job failed)",
                )
            generation = producer_generation(producer)
            if generation is not None and generation <= q.forgotten_generation:
                # forgotten, or made with a clock far behind: a resend of a forgotten
                # producer's first publish would otherwise be enqueued a second time
                return Error(
                    code=ErrorCode.PRODUCER_FORGOTTEN,
                    message=(
                        f"producer {producer!r} is unknown to {q.name!r}, and its generation "
                        f"{generation} is not above {q.forgotten_generation}, the highest this "
                        "queue forgot: if it was forgotten, a resend could not be recognised. "
                        "Publish under a new producer id of a higher generation"
                    ),
                    generation=q.forgotten_generation,
                )
            if seq != 0:
                # a producer starts at 0: a later batch that overtook its first (forwarded
                # through another node across a leader change) would make the first look
                # like a duplicate, confirmed and never enqueued (simulator seed 215)
                return _error(
                    ErrorCode.OUT_OF_ORDER,
                    f"producer {producer!r} is new to {q.name!r} (or forgotten): its first "
                    f"seq must be 0, not {seq}",
                    0,
                )
            if len(q.producers) >= MAX_PRODUCERS and not _make_room_for_a_producer(q, self._now):
                return _error(
                    ErrorCode.TOO_MANY_PRODUCERS,
                    f"queue {q.name!r} remembers {len(q.producers)} producers, each active "
                    "within the hour: try again later, or reuse a producer",
                )
            return None
        if seq == state.last_seq + 1:
            return None
        last = state.last_seq
        if seq + count - 1 <= last:
            return Enqueued(offset=state.offset_of(seq), count=count, duplicate=True)
        expected = last + 1
        if seq <= last:
            return _error(
                ErrorCode.OUT_OF_ORDER,
                f"producer {producer!r}: seqs {seq}..{seq + count - 1} overlap the last "
                f"accepted {last}; expected {expected}",
                expected,
            )
        return _error(
            ErrorCode.OUT_OF_ORDER,
            f"producer {producer!r}: seq {seq} skips ahead; expected {expected}",
            expected,
        )

    def _enqueue_many(
        self,
        q: QueueState,
        messages: list[tuple[bytes, str | None, Any]],
        producer: str | None,
        seq: int | None,
        effects: list[Any],
    ) -> Reply:
        if self._disk_alarms and not _is_resend(q, producer, seq, len(messages)):
            # (before `_check_producer`, which may make room for a new producer by
            # forgetting silent ones; a resend of what landed is answered as a duplicate)
            return self._disk_alarm_error()
        refusal = self._check_producer(q, producer, seq, len(messages))
        if refusal is not None:
            return refusal
        now = self._now
        opts = q.options
        if opts.message_ttl_ms is not None:
            self._run([q], effects)  # what expired leaves first, and does not count as ready
        if (
            opts.overflow == "reject-publish"
            and opts.max_length is not None
            and len(messages) > opts.max_length
        ):
            return _error(
                ErrorCode.OVER_MAX_LENGTH,
                f"a batch of {len(messages)} messages can never fit queue {q.name!r}: "
                f"max_length {opts.max_length}; publish fewer at a time",
            )
        if (
            opts.overflow == "reject-publish"
            and opts.max_length is not None
            and q.ready_count + len(messages) > opts.max_length
        ):
            return _error(
                ErrorCode.QUEUE_FULL,
                f"queue {q.name!r} is full: {q.ready_count} ready, max_length {opts.max_length}",
            )
        first = q.append_many(messages, now)
        q.trim_stream()
        if producer is not None and seq is not None:
            state = q.producers.get(producer)
            if state is None:  # room was made for it (`_check_producer`)
                state = q.producers[producer] = ProducerState(seq - 1, now)
            state.record(seq, first, len(messages), now)
        self._run([q], effects)
        return Enqueued(offset=first, count=len(messages))

    def _enqueue(self, cmd: Enqueue, effects: list[Any]) -> Reply:
        q = self._queue(cmd.queue)
        if isinstance(q, Error):
            return q
        return self._enqueue_many(
            q, [(cmd.body, cmd.key, cmd.headers)], cmd.producer, cmd.seq, effects
        )

    def _enqueue_batch(self, cmd: EnqueueBatch, effects: list[Any]) -> Reply:
        q = self._queue(cmd.queue)
        if isinstance(q, Error):
            return q
        if not cmd.messages:
            return _error(ErrorCode.INVALID, "an enqueue batch needs at least one message")
        messages = [(m.body, m.key, m.headers) for m in cmd.messages]
        if cmd.seqs is not None and cmd.producer is not None:
            return self._enqueue_numbered(q, messages, cmd.producer, cmd.seqs, cmd.opens, effects)
        return self._enqueue_many(q, messages, cmd.producer, cmd.first_seq, effects)

    def _enqueue_numbered(
        self,
        q: QueueState,
        messages: list[tuple[bytes, str | None, Any]],
        producer: str,
        seqs: tuple[int, ...],
        opens: bool,
        effects: list[Any],
    ) -> Reply:
        """Messages that carry their own sequence numbers: those above the producer's
        last land (all of them or none), the others are duplicates. A producer the queue
        does not know starts only with the batch that `opens` it."""
        state = q.producers.get(producer)
        if state is None:
            refusal = self._check_producer(q, producer, 0, len(messages))
            if refusal is not None:
                return refusal
            if not opens:
                # a later batch resent after the queue forgot the producer would land
                # again (review D: a zombie Spark task after its batch was forgotten)
                return _error(
                    ErrorCode.OUT_OF_ORDER,
                    f"producer {producer!r} is new to {q.name!r} (or forgotten): its first "
                    "batch must be the one that opens it",
                    seqs[0],
                )
        last = -1 if state is None else state.last_seq
        new = [m for m, seq in zip(messages, seqs, strict=True) if seq > last]
        if not new:
            return Enqueued(offset=None, count=0, duplicate=True)
        landed = self._enqueue_many(q, new, None, None, effects)
        if isinstance(landed, Enqueued):
            if state is None:
                state = q.producers[producer] = ProducerState(-1, self._now)
            state.last_seq = seqs[-1]
            state.last_ts = self._now
        return landed

    def _subscribe(self, cmd: Subscribe, effects: list[Any]) -> Reply:
        q = self._queue(cmd.queue)
        if isinstance(q, Error):
            return q
        if cmd.node in self._down_nodes:
            return _error(
                ErrorCode.NODE_DOWN, f"node {cmd.node!r} is marked down; subscribe after it is up"
            )
        if cmd.consumer in q.consumers:
            return _error(
                ErrorCode.CONSUMER_EXISTS,
                f"consumer {cmd.consumer!r} is already on queue {cmd.queue!r}",
            )
        q.add_consumer(cmd.consumer, cmd.node, cmd.prefetch, cmd.timeout_ms)
        self._consumer_queues.setdefault(cmd.consumer, {})[cmd.queue] = None
        self._run([q], effects)
        return OK

    def _forget_if_gone(self, q: QueueState, consumer: str, *, deleted: bool = False) -> None:
        """Drop `consumer` from the queues it is on if `q` no longer has it (or is gone)."""
        if deleted or consumer not in q.consumers:
            queues = self._consumer_queues.get(consumer)
            if queues is not None:
                queues.pop(q.name, None)
                if not queues:
                    del self._consumer_queues[consumer]

    def _queue_and_consumer(
        self, queue: str, consumer: str
    ) -> tuple[QueueState, ConsumerState] | Error:
        q = self._queue(queue)
        if isinstance(q, Error):
            return q
        c = self._consumer(q, consumer)
        if isinstance(c, Error):
            return c
        return q, c

    def _holder(self, cmd: Ack | Nack) -> tuple[QueueState, ConsumerState] | Error:
        """The queue and consumer of an ack or nack, if the consumer holds every offset."""
        found = self._queue_and_consumer(cmd.queue, cmd.consumer)
        if isinstance(found, Error):
            return found
        q, c = found
        missing = [o for o in cmd.offsets if o not in c.unacked]
        if missing:
            return _error(
                ErrorCode.NOT_HELD,
                f"consumer {c.id!r} does not hold offsets {missing[:10]} of queue {q.name!r}",
            )
        return found

    def _cancel(self, cmd: Cancel, effects: list[Any]) -> Reply:
        found = self._queue_and_consumer(cmd.queue, cmd.consumer)
        if isinstance(found, Error):
            return found
        q, c = found
        if not c.cancelled:
            q.cancel(c)
            self._forget_if_gone(q, cmd.consumer)
            self._run([q], effects)
        return OK

    def _ack(self, cmd: Ack, effects: list[Any]) -> Reply:
        found = self._holder(cmd)
        if isinstance(found, Error):
            return found
        q, c = found
        q.settle(c, cmd.offsets)
        self._forget_if_gone(q, cmd.consumer)
        self._run([q], effects)
        return OK

    def _nack(self, cmd: Nack, effects: list[Any]) -> Reply:
        found = self._holder(cmd)
        if isinstance(found, Error):
            return found
        q, c = found
        if cmd.requeue:
            q.requeue(c, cmd.offsets, cmd.delay_ms, self._now)
        else:
            q.reject(c, cmd.offsets)
        self._forget_if_gone(q, cmd.consumer)
        self._run([q], effects)
        return OK

    def _remove(self, q: QueueState, c: ConsumerState, reason: str, effects: list[Any]) -> None:
        q.remove_consumer(c, self._now)
        self._forget_if_gone(q, c.id)
        effects.append(ConsumerDown(queue=q.name, consumer=c.id, node=c.node, reason=reason))

    def _down(self, cmd: Down, effects: list[Any]) -> Reply:
        touched = []
        # by name: subscription order is not kept in a snapshot, and replicas restored
        # from one must emit the same effects in the same order
        for name in sorted(self._consumer_queues.get(cmd.consumer, ())):
            q = self._queues[name]
            self._remove(q, q.consumers[cmd.consumer], "down", effects)
            touched.append(q)
        self._run(touched, effects)
        return OK

    def _node_down(self, cmd: NodeDown, effects: list[Any]) -> Reply:
        self._down_nodes.add(cmd.node)
        self._disk_alarms.discard(cmd.node)  # it writes nothing now; back, it says again
        touched = []
        for q in self._queues.values():
            gone = [c for c in q.consumers.values() if c.node == cmd.node]
            for c in gone:
                self._remove(q, c, "node_down", effects)
            if gone:
                touched.append(q)
        self._run(touched, effects)
        return OK

    def _node_up(self, cmd: NodeUp, effects: list[Any]) -> Reply:
        self._down_nodes.discard(cmd.node)
        return OK

    def _disk_alarm(self, cmd: DiskAlarm, effects: list[Any]) -> Reply:
        if cmd.raised and cmd.node not in self._down_nodes:
            # (a node marked down raises nothing: its alarm would outlive it, since it is
            # never marked down again while down; back up, it says again within a second)
            self._disk_alarms.add(cmd.node)
        else:
            self._disk_alarms.discard(cmd.node)
        return OK

    def _commit_offset(self, cmd: CommitOffset, effects: list[Any]) -> Reply:
        q = self._queue(cmd.queue)
        if isinstance(q, Error):
            return q
        if cmd.offset > q.next_offset:
            return _error(
                ErrorCode.INVALID,
                f"offset {cmd.offset} is past the end of queue {cmd.queue!r} ({q.next_offset})",
            )
        q.commits[cmd.group] = cmd.offset
        return OK

    def _forget_producers(self, cmd: ForgetProducers, effects: list[Any]) -> Reply:
        q = self._queue(cmd.queue)
        if isinstance(q, Error):
            return q
        if not cmd.prefix:
            return _error(ErrorCode.INVALID, "an empty prefix would forget every producer")
        if cmd.seal:
            if not cmd.prefix.endswith("-") or len(cmd.prefix) > MAX_SEALED_PREFIX:
                return _error(
                    ErrorCode.INVALID,
                    f"a sealed prefix must end with '-' and be at most {MAX_SEALED_PREFIX} "
                    "characters",
                )
            q.seal(cmd.prefix, self._now, most=MAX_SEALED, lifetime_ms=PRODUCER_EXPIRY_MS)
        return Forgotten(count=q.forget_producers(cmd.prefix, self._now))

    def _purge_queue(self, cmd: PurgeQueue, effects: list[Any]) -> Reply:
        q = self._queue(cmd.queue)
        if isinstance(q, Error):
            return q
        gone = q.purge()
        if gone:
            effects.append(Purged(queue=q.name, offsets=tuple(gone), reason="purged"))
        return QueuePurged(messages=len(gone))

    def _delete_queue(self, cmd: DeleteQueue, effects: list[Any]) -> Reply:
        q = self._queue(cmd.queue)
        if isinstance(q, Error):
            return q
        consumers = list(q.consumers.values())
        if consumers and not cmd.force:
            held = len(q.held)
            return _error(
                ErrorCode.QUEUE_IN_USE,
                f"queue {q.name!r} is in use by {len(consumers)} consumer(s) holding {held} "
                "message(s); cancel them, or delete with force (which cancels them, and "
                "deletes what they hold)",
            )
        for c in consumers:  # subscription order
            effects.append(
                ConsumerDown(queue=q.name, consumer=c.id, node=c.node, reason="queue_deleted")
            )
        gone = sorted(q.msgs)
        if gone:
            effects.append(Purged(queue=q.name, offsets=tuple(gone), reason="queue_deleted"))
        del self._queues[q.name]
        for c in consumers:
            self._forget_if_gone(q, c.id, deleted=True)
        self._remember_deleted(q)
        return QueueDeleted(messages=len(gone), consumers=len(consumers))

    def _remember_deleted(self, q: QueueState) -> None:
        """Keep where deleted `q` ended (`_deleted`): its next offset, and the highest
        generation of its producers (each capped at the log time, as when a producer is
        forgotten)."""
        for producer in sorted(q.producers):
            q.forget_producer(producer, self._now)
        deleted = self._deleted
        deleted[q.name] = (q.next_offset, q.forgotten_generation)
        if len(deleted) > MAX_DELETED_NAMES:
            offset, generation = deleted.pop(next(iter(deleted)))
            floor = self._deleted_floor
            self._deleted_floor = (max(floor[0], offset), max(floor[1], generation))

    def needs_tick(self) -> bool:
        """Whether time must move on even with no other command: a queue has a message
        TTL, remembers producers that may expire, has deliveries out (consumer
        timeout), or messages waiting for a retry delay. The leader proposes `Tick`
        then."""
        return any(
            q.options.message_ttl_ms is not None or q.producers or q.held or q.waiting
            for q in self._queues.values()
        )

    def next_retry_ms(self) -> int | None:
        """The log time when the next message waiting for a retry delay is due, of the
        queues with a consumer that may receive it (None: none). The leader proposes a
        `Tick` once its clock gets there, so a delay is not rounded up to the next
        periodic tick. A queue that nobody may receive from is woken by its next subscribe,
        ack or nack, which runs it anyway."""
        due = [t for q in self._queues.values() if q.sq and (t := q.next_due()) is not None]
        return min(due) if due else None

    def _tick(self, cmd: Tick, effects: list[Any]) -> Reply:
        now = self._now
        timed_out: dict[str, QueueState] = {}
        for name in sorted(self._queues):  # by name: the same effects on every replica
            q = self._queues[name]
            for c in q.timed_out(now, DEFAULT_CONSUMER_TIMEOUT_MS):
                self._remove(q, c, "consumer_timeout", effects)
                timed_out[name] = q
        if timed_out:
            self._run(list(timed_out.values()), effects)  # what they held goes to the others
        for q in self._queues.values():
            if q.options.message_ttl_ms is not None:
                q.expire(now, returned_too=True)
            if q.producers:
                for producer in sorted(
                    p for p, s in q.producers.items() if now - s.last_ts > PRODUCER_EXPIRY_MS
                ):
                    q.forget_producer(producer, now)
        self._run(
            [
                q
                for q in self._queues.values()
                if q.outbox or (q.sq and (due := q.next_due()) is not None and due <= now)
            ],
            effects,
        )  # what expired leaves; what waited for a retry delay and is due is delivered
        return OK

    # ---------------------------------------------------------------- queries

    # ------------------------------------------------------ snapshot / digest


_HANDLERS: dict[type, Callable[[Machine, Any, list[Any]], Reply]] = {
    Declare: Machine._declare,
    Enqueue: Machine._enqueue,
    EnqueueBatch: Machine._enqueue_batch,
    Subscribe: Machine._subscribe,
    Cancel: Machine._cancel,
    Ack: Machine._ack,
    Nack: Machine._nack,
    Down: Machine._down,
    NodeDown: Machine._node_down,
    NodeUp: Machine._node_up,
    DiskAlarm: Machine._disk_alarm,
    CommitOffset: Machine._commit_offset,
    ForgetProducers: Machine._forget_producers,
    PurgeQueue: Machine._purge_queue,
    DeleteQueue: Machine._delete_queue,
    Tick: Machine._tick,
}

__all__ = ["Applied", "Machine", "Message", "Meta", "UnknownQueueError"]
