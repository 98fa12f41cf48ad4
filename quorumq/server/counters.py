"""Per-queue counts of what a node's replica applied: deliveries, acks, dead-letterings.

The machine keeps no history counters (it holds state, and its snapshot is its state),
so a node counts as its replica applies: `QueueCounters` is the replica's observer
(`ReplicaObserver`), told of every log entry applied, on the Raft thread, after the
machine's lock is released. Every replica applies every entry, so every node counts the
whole cluster's deliveries and acks, from when its process started (entries replayed
from its journal at start-up count; entries skipped by a snapshot install do not).
`quorumq status` computes rates from two readings, and the metrics endpoint serves them
as Prometheus counters (a process restart is a counter reset, which `rate()` handles).

Counting costs one call per applied entry and a few additions per effect: the machine
stays pure, and the Raft thread takes a lock only for the additions.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from ..machine import (
    OK,
    Ack,
    Applied,
    Command,
    DeadLettered,
    Deliver,
    Dropped,
    Nack,
    Purged,
    QueueDeleted,
)

COUNTS = (
    "delivered",
    "redelivered",
    "acked",
    "rejected",
    "dead_lettered",
    "expired",
    "dropped",
    "purged",
)
"""What is counted per queue:

* `delivered`: deliveries (`Deliver` effects), redeliveries included;
* `redelivered`: deliveries of a message delivered before and returned;
* `acked`: messages acked (`Ack` commands the machine accepted);
* `rejected`: messages nacked without requeue (`Nack(requeue=False)` accepted);
* `dead_lettered`: messages that left the queue into its dead-letter queue, any reason;
* `expired`: messages whose TTL ran out (dead-lettered or dropped);
* `dropped`: messages that left the queue undelivered and were not dead-lettered (max
  length, delivery limit, rejection or expiry without a dead-letter queue, a cycle);
* `purged`: messages removed by a purge (ready ones only; a delete drops the queue's
  counts with it).

A deleted queue's counts go with it (and a queue declared again under its name counts
from zero, a counter reset to Prometheus): a node whose queues come and go keeps counts
of the queues that are, not of every queue there ever was.
"""
(
    _DELIVERED,
    _REDELIVERED,
    _ACKED,
    _REJECTED,
    _DEAD_LETTERED,
    _EXPIRED,
    _DROPPED,
    _PURGED,
) = range(len(COUNTS))


class QueueCounters:
    """Counts per queue of what this node's replica applied (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, list[int]] = {}
        self._counted_by: dict[str, int] = {}
        """Queue -> the replica (its `id`) whose entries counted it: with many Raft
        groups, one group's snapshot says nothing of another group's queues."""

    def _row(self, queue: str, replica: Any) -> list[int]:
        row = self._counts.get(queue)
        if row is None:
            row = self._counts[queue] = [0] * len(COUNTS)
            self._counted_by[queue] = id(replica)
        return row

    # ----------------------------------------------------- ReplicaObserver

    def applied(
        self, replica: Any, index: int, payload: bytes, command: Command, applied: Applied
    ) -> None:
        """One log entry applied (on the Raft thread)."""
        if isinstance(command, Ack | Nack) and applied.reply is OK:
            if isinstance(command, Ack):
                which = _ACKED
            elif not command.requeue:
                which = _REJECTED
            else:
                which = -1  # a return: it counts again when it is delivered again
            if which >= 0:
                with self._lock:
                    self._row(command.queue, replica)[which] += len(set(command.offsets))
        if isinstance(applied.reply, QueueDeleted):
            with self._lock:
                self._counts.pop(command.queue, None)  # type: ignore[union-attr]
                self._counted_by.pop(command.queue, None)  # type: ignore[union-attr]
            return  # its effects: its consumers down, its messages gone uncounted
        effects = applied.effects
        if not effects:
            return
        with self._lock:
            queue = ""
            row: list[int] = []
            for e in effects:
                if isinstance(e, Deliver):
                    if e.queue != queue or not row:
                        queue = e.queue
                        row = self._row(queue, replica)
                    row[_DELIVERED] += 1
                    if e.redelivered:
                        row[_REDELIVERED] += 1
                elif isinstance(e, DeadLettered | Dropped):
                    left = self._row(e.queue, replica)
                    left[_DEAD_LETTERED if isinstance(e, DeadLettered) else _DROPPED] += 1
                    if e.reason == "expired":
                        left[_EXPIRED] += 1
                elif isinstance(e, Purged):
                    self._row(e.queue, replica)[_PURGED] += len(e.offsets)

    def snapshot_loaded(self, replica: Any, applied: int, index: int) -> None:
        """A snapshot was loaded (the replica counts these itself): the counts of queues
        it counted and does not have, deleted in the entries it skipped, go."""
        queues = set(replica.query(lambda m: m.queues()))
        mine = id(replica)
        with self._lock:
            for queue in [q for q in self._counts if q not in queues]:
                if self._counted_by.get(queue) == mine:
                    del self._counts[queue]
                    del self._counted_by[queue]

    def proposed_duty(self, replica: Any, command: Command) -> None:
        """The replica, as leader, proposed a duty (not counted)."""

    # ------------------------------------------------------------- reading

    def counts(self, queues: Iterable[str] | None = None) -> dict[str, dict[str, int]]:
        """Per queue, every count of `COUNTS` (from any thread): of `queues` (zeros for
        one with nothing counted yet), or of every queue counted."""
        with self._lock:
            if queues is None:
                rows = {queue: list(row) for queue, row in self._counts.items()}
            else:
                rows = {q: list(self._counts.get(q) or [0] * len(COUNTS)) for q in queues}
        return {queue: dict(zip(COUNTS, row, strict=True)) for queue, row in rows.items()}


__all__ = ["COUNTS", "QueueCounters"]
