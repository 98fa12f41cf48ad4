"""What the machine answers without changing anything (`Queries`): queue names,
options, what is ready, held and waiting, stats, producers, offsets, the disk alarms,
and reads of the stream view."""

from __future__ import annotations

from .commands import (
    QueueOptions,
)
from .effects import Deliver
from .queue import (
    QueueState,
    Record,
)
from .replies import (
    Error,
)
from .state import MachineState, UnknownQueueError, _is_resend, hashed_group
from .views import QueueStats, StreamMessage, bucket_of


class Queries(MachineState):
    """The machine's read-only queries (see the module's docstring)."""

    def _get(self, queue: str) -> QueueState:
        q = self._queues.get(queue)
        if q is None:
            raise UnknownQueueError(f"no queue named {queue!r}")
        return q

    def queues(self) -> tuple[str, ...]:
        return tuple(self._queues)

    @property
    def group_count(self) -> int | None:
        """How many Raft groups the queues are placed over (None: none placed yet)."""
        return self._group_count

    def placement(self, queue: str) -> int | None:
        """The Raft group of `queue` in the directory (`Place`), asked of group 0's
        machine: 0 for a queue group 0 holds (or held) from before there were groups;
        None for a queue never placed."""
        group = self._placements.get(queue)
        if group is None and (queue in self._queues or queue in self._deleted):
            return 0
        count = self._group_count
        if group is None and count is not None and self._directory_full():
            return hashed_group(queue, count)  # the directory is full: by the name's hash
        return group

    def group_loads(self) -> tuple[int, ...]:
        """Queue names placed in each group (empty before the first `Place`)."""
        return tuple(self._group_loads)

    def options(self, queue: str) -> QueueOptions:
        return self._get(queue).options

    def ready(self, queue: str) -> tuple[int, ...]:
        """Offsets of the ready messages (those waiting for a retry delay too, see
        `waiting`), ascending."""
        q = self._get(queue)
        return tuple(sorted(o for o in q.msgs if o not in q.held))

    def oldest_ready_ms(self, queue: str) -> int | None:
        """When the oldest ready message of `queue` was enqueued (the machine's time, ms),
        or None when none is ready. The queue keeps its messages in offset order and
        time never runs back, so this looks only at the held messages ahead of it."""
        q = self._get(queue)
        held = q.held
        for offset, msg in q.msgs.items():
            if offset not in held:
                return msg[4]
        return None

    def waiting(self, queue: str) -> dict[int, int]:
        """Returned messages of `queue` held back by a retry delay: offset -> the log time
        they are due (they count as ready, and keep their place)."""
        return dict(self._get(queue).waiting)

    def unacked(self, queue: str, consumer: str) -> tuple[int, ...]:
        """Offsets `consumer` holds on `queue` (empty if it holds none or is not there)."""
        c = self._get(queue).consumers.get(consumer)
        return tuple(sorted(c.unacked)) if c is not None else ()

    def held_deliveries(self, queue: str, consumer: str) -> tuple[Deliver, ...] | None:
        """The deliveries `consumer` holds on `queue`, with the fields they were sent
        with; None if it is not a consumer of `queue` (removed, or not there yet).

        A replica that catches up by installing a snapshot skips the log entries that
        made these deliveries: its node sends them from here."""
        q = self._queues.get(queue)
        c = None if q is None else q.consumers.get(consumer)
        if q is None or c is None:
            return None
        return q.held_deliveries(c)

    def consumers(self, queue: str) -> tuple[str, ...]:
        """Consumers on `queue`, in subscription order (cancelled ones that still hold too)."""
        return tuple(self._get(queue).consumers)

    def consumers_on(self, node: str) -> tuple[str, ...]:
        """Consumers, of any queue, that subscribed through `node`."""
        return tuple(
            consumer
            for consumer, queues in self._consumer_queues.items()
            if self._queues[next(iter(queues))].consumers[consumer].node == node
        )

    def service_queue(self, queue: str) -> tuple[str, ...]:
        """Consumers that may receive now, in round-robin order."""
        return tuple(c.id for c in self._get(queue).sq)

    def stats(self, queue: str) -> QueueStats:
        q = self._get(queue)
        return QueueStats(
            ready=q.ready_count,
            unacked=len(q.held),
            consumers=len(q.consumers),
            next_offset=q.next_offset,
            first_retained=q.first_retained,
            producers=len(q.producers),
        )

    def producers(self, queue: str) -> tuple[str, ...]:
        """Ids of the idempotent producers `queue` remembers, sorted."""
        return tuple(sorted(self._get(queue).producers))

    def committed_offset(self, queue: str, group: str) -> int | None:
        return self._get(queue).commits.get(group)

    def committed_offsets(self, queue: str) -> dict[str, int]:
        return dict(self._get(queue).commits)

    def down_nodes(self) -> frozenset[str]:
        return frozenset(self._down_nodes)

    def disk_alarm_refusal(
        self,
        queue: str,
        producer: str | None,
        first_seq: int | None,
        count: int,
        seqs: tuple[int, ...] | None = None,
    ) -> Error | None:
        """The refusal a publish would meet now for a disk alarm (None: none), for a node
        to answer before proposing: refused in the log, every retry of it was a journal
        entry carrying its body, on every node, on the disk the alarm is for."""
        q = self._queues.get(queue)
        if not self._disk_alarms or q is None:
            return None
        if seqs is not None and producer is not None:
            state = q.producers.get(producer)
            if state is not None and max(seqs) <= state.last_seq:
                return None  # wholly a resend: answered as a duplicate
        elif _is_resend(q, producer, first_seq, count):
            return None
        return self._disk_alarm_error()

    def disk_alarms(self) -> frozenset[str]:
        """Nodes whose disk alarm is raised: publishes are refused while any is."""
        return frozenset(self._disk_alarms)

    def read(
        self,
        queue: str,
        start: int,
        end: int,
        bucket: int | None = None,
        buckets: int | None = None,
    ) -> tuple[StreamMessage, ...]:
        """Stream view: retained messages with offsets in [start, end), in offset order.

        With `bucket` of `buckets`, only messages whose `bucket_of(key, offset, buckets)`
        is `bucket`. Offsets below `stats(queue).first_retained` were trimmed by retention.
        """
        return tuple(
            StreamMessage(offset=o, key=k, body=b, headers=h, ts_ms=t)
            for o, k, b, h, t in self.read_records(queue, start, end, bucket, buckets)
        )

    def read_records(
        self,
        queue: str,
        start: int,
        end: int,
        bucket: int | None = None,
        buckets: int | None = None,
    ) -> list[Record]:
        """`read` as the stored (offset, key, body, headers, ts_ms) tuples: what a node
        serves to readers, without building an object per message under the lock."""
        if (bucket is None) != (buckets is None):
            raise ValueError("bucket and buckets go together")
        if buckets is not None and bucket is not None and not 0 <= bucket < buckets:
            raise ValueError(f"bucket must be in [0, {buckets}), got {bucket}")
        records = self._get(queue).read(start, end)
        if buckets is not None:
            return [r for r in records if bucket_of(r[1], r[0], buckets) == bucket]
        return records
