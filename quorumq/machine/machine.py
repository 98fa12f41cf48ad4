"""The queue machine: `apply(meta, command) -> Applied(reply, effects)`.

Deterministic and pure: the same commands in the same order give the same state,
replies and effects on every replica. No clock (time is `meta.ts_ms`, clamped so it
never runs back), no randomness, no I/O. A refused command gets an `Error` reply and
changes nothing but the clock (messages whose TTL ran out still expire).

`Machine` here is `apply` and the handlers of the commands that declare, subscribe,
settle, mark nodes down and up, and delete, purge and tick queues. Its parts: its
fields and limits are `MachineState` (`state.py`); running what a command changed
(delivery, dead-lettering) is `Dispatching` (`dispatch.py`); the publishes are
`Enqueueing` (`enqueueing.py`); its read-only answers are `Queries` (`queries.py`); its
snapshot, digest and restore are `Snapshots` (`snapshots.py`). A queue's own state and
rules are `QueueState` (`queue.py`).
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
    Place,
    PurgeQueue,
    QueueOptions,
    Subscribe,
    Tick,
)
from .effects import ConsumerDown, DeadLettered, Effect, Purged
from .enqueueing import Enqueueing
from .queries import Queries
from .queue import (
    ConsumerState,
    QueueState,
)
from .replies import (
    OK,
    Declared,
    Error,
    ErrorCode,
    Forgotten,
    Placed,
    QueueDeleted,
    QueuePurged,
    Reply,
)
from .snapshots import Snapshots
from .state import (
    EVICT_SILENT_MS,
    MAX_PLACEMENTS,
    MAX_PRODUCERS,
    MAX_SEALED,
    MAX_SEALED_PREFIX,
    PRODUCER_EXPIRY_MS,
    UnknownQueueError,
    _error,
)

IDLE_TICK_MS = 60_000
"""With queues but nothing that needs time every second, a `Tick` is due this long after
the last command at the latest (`tick_due_ms`): the log's time lags the leader's clock
by at most this much when no quiet heartbeat tells it (a leader kept busy by a silent
or older peer)."""
MAX_DELETED_NAMES = 10_000
"""Most names of deleted queues the machine remembers where their offsets ended (a queue
declared again under one carries on from there). Past it the oldest is folded into one
floor that every other new queue starts from, so memory stays bounded as queues come
and go, and no name ever gives an offset or takes a producer id twice."""


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
    was dead-lettered to; and, in group 0, the queues a `Place` names (a node with
    many groups finds their ends only once it knows their group, which its group 0
    may learn after the group applied them). A node wakes the reads waiting on these
    queues only (`quorumq.node.reads`): one missing here would leave its reads waiting
    to their deadline."""
    moved = {command.queue} if isinstance(command, Declare | Enqueue | EnqueueBatch) else set()
    if type(command) is Place:
        moved = {command.queue, command.dead_letter_queue or command.queue}
    for e in applied.effects:
        if type(e) is DeadLettered:
            moved.add(e.target_queue)
    return moved


class Machine(Enqueueing, Queries, Snapshots):
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

    # --------------------------------------------------------------- handlers

    def _declare(self, cmd: Declare, effects: list[Any]) -> Reply:
        existing = self._queues.get(cmd.queue)
        if existing is not None:
            if existing.options == cmd.options:
                return Declared(created=False)
            differ = ", ".join(
                f"{f.name} {getattr(existing.options, f.name)!r} (asked "
                f"{getattr(cmd.options, f.name)!r})"
                for f in attrs.fields(QueueOptions)
                if getattr(existing.options, f.name) != getattr(cmd.options, f.name)
            )
            return _error(ErrorCode.OPTIONS_MISMATCH, f"queue {cmd.queue!r} exists with {differ}")
        if cmd.options.dead_letter_queue == cmd.queue:
            return _error(ErrorCode.INVALID, "a queue cannot be its own dead_letter_queue")
        first_offset, generation = self._deleted.pop(cmd.queue, self._deleted_floor)
        self._queues[cmd.queue] = QueueState(
            cmd.queue, cmd.options, first_offset=first_offset, forgotten_generation=generation
        )
        return Declared(created=True)

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

    def _place(self, cmd: Place, effects: list[Any]) -> Reply:
        count = self._group_count
        if count is not None and cmd.groups != count:
            return _error(
                ErrorCode.INVALID,
                f"this cluster places its queues over {count} Raft groups, not {cmd.groups}: "
                f"every node must run with groups={count}",
            )
        dlq = cmd.dead_letter_queue
        if dlq == cmd.queue:
            return _error(ErrorCode.INVALID, "a queue cannot be its own dead_letter_queue")
        if count is None:  # first: what group 0 holds is placed before anything is looked up
            self._fix_group_count(cmd.groups)  # (found by review: placed after, the loads
            # counted some names twice, and a replica restored from a snapshot placed
            # the next queues elsewhere). No refusal below follows a first Place, but for
            # more than `MAX_PLACEMENTS` names from before groups (the count stays fixed).
        group = self.placement(cmd.queue)
        dlq_group = None if dlq is None else self.placement(dlq)
        if group is not None and dlq_group is not None and dlq_group != group:
            return _error(
                ErrorCode.INVALID,
                f"queue {cmd.queue!r} is in Raft group {group} and its dead_letter_queue "
                f"{dlq!r} in group {dlq_group}: a queue dead-letters within its own group "
                f"only; choose a dead-letter queue in group {group}",
            )
        new = [n for n, g in ((cmd.queue, group), (dlq, dlq_group)) if n is not None and g is None]
        if group is None:
            group = dlq_group if dlq_group is not None else self._least_loaded()
        for name in new:
            self._placements[name] = group
            self._group_loads[group] += 1
        return Placed(group=group)

    def _fix_group_count(self, groups: int) -> None:
        """The first `Place`: the queues group 0 holds or held are placed there, with the
        dead-letter queues they name (declared or not: a queue dead-letters within its
        own group only)."""
        self._group_count = groups
        self._group_loads = [0] * groups
        names = [*self._queues, *self._deleted]
        names += sorted(
            {q.options.dead_letter_queue for q in self._queues.values()} - {None} - set(names)  # type: ignore[arg-type]
        )
        for name in names:
            self._placements[name] = 0
            self._group_loads[0] += 1

    def _least_loaded(self) -> int:
        loads = self._group_loads
        return loads.index(min(loads))

    def needs_tick(self) -> bool:
        """Whether time must move on even with no other command (`tick_due_ms`)."""
        return self.tick_due_ms() is not None

    def tick_due_ms(self) -> int | None:
        """The log time by which a `Tick` is due with no other command (None: none is).
        The machine's time now while a queue has a message TTL, deliveries out
        (consumer timeout) or messages waiting for a retry delay: the leader proposes a
        `Tick` every second. Otherwise, with any queue, `IDLE_TICK_MS` after the last
        command (or sooner, when the first producer it remembers expires), not a `Tick`
        a second for the week a producer is remembered (an idle cluster wrote,
        replicated and synced one a second). Computed once per applied entry (the leader
        asks at every quiet wait)."""
        cached = self._tick_due
        if cached is not None and cached[0] == self._last_index:
            return cached[1]
        due: int | None = self._now + IDLE_TICK_MS if self._queues else None
        for q in self._queues.values():
            if q.options.message_ttl_ms is not None or q.held or q.waiting:
                due = self._now
                break
            if q.producers:
                first = min(s.last_ts for s in q.producers.values()) + PRODUCER_EXPIRY_MS + 1
                due = first if due is None else min(due, first)
        self._tick_due = (self._last_index, due)
        return due

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
    Place: Machine._place,
    Tick: Machine._tick,
}

__all__ = [
    "EVICT_SILENT_MS",
    "IDLE_TICK_MS",
    "MAX_PLACEMENTS",
    "MAX_PRODUCERS",
    "MAX_SEALED",
    "MAX_SEALED_PREFIX",
    "PRODUCER_EXPIRY_MS",
    "Applied",
    "Machine",
    "Message",
    "Meta",
    "UnknownQueueError",
]
