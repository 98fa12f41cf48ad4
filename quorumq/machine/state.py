"""The machine's state, as every part of `Machine` sees it (`MachineState`), and what
they share: the refusal a command meets as an `Error`, a resend recognised, a query of a
queue that does not exist (`UnknownQueueError`)."""

from __future__ import annotations

import zlib

from .queue import (
    QueueState,
)
from .replies import (
    Error,
    ErrorCode,
)


class UnknownQueueError(LookupError):
    """A query named a queue that was never declared."""


def _error(code: ErrorCode, message: str, expected_seq: int | None = None) -> Error:
    return Error(code=code, message=message, expected_seq=expected_seq)


def _is_resend(q: QueueState, producer: str | None, seq: int | None, count: int) -> bool:
    """Whether a publish is wholly a resend of what `producer` landed already."""
    state = q.producers.get(producer) if producer is not None else None
    return state is not None and seq is not None and seq + count - 1 <= state.last_seq


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
MAX_PLACEMENTS = 100_000
"""Most queue names the directory records (`Place`), about 15 MB. A placement is never
forgotten (a queue deleted and declared again must come back to its group, to carry on
from its offsets there), so past it a new name is placed by a stable hash of the name
instead (`hashed_group`), recorded nowhere and as lasting; a queue placed so must have
its dead-letter queue in the same group."""


def hashed_group(queue: str, groups: int) -> int:
    """The group of a name the full directory does not hold: a stable hash of it."""
    return zlib.crc32(queue.encode("utf-8")) % groups


EVICT_SILENT_MS = 3600 * 1000
"""How long a producer must be silent before it may be forgotten to make room."""


class MachineState:
    """The replicated state of every queue: the fields `Machine`'s parts (`Queries`,
    `Snapshots`) and its handlers share."""

    def __init__(self) -> None:
        self._queues: dict[str, QueueState] = {}
        self._now = 0
        self._last_index = 0
        self._tick_due: tuple[int, int | None] | None = None
        """(last index, `tick_due_ms` then): derived, asked often by an idle leader."""
        self._down_nodes: set[str] = set()
        self._disk_alarms: set[str] = set()
        """Nodes whose data disk is below its free-space limit (`DiskAlarm`)."""
        self._consumer_queues: dict[str, dict[str, None]] = {}
        """Consumer id -> the queues it is on (derived, for `Down`)."""
        self._deleted: dict[str, tuple[int, int]] = {}
        """Names of deleted queues not declared again, oldest first -> (the offset after
        the last one the queue gave, the highest producer generation it knew or forgot):
        a queue declared again under the name starts there, so an offset a reader kept
        never names a message of the other queue, and a resend of a publish to the
        deleted queue is refused (`producer_forgotten`), not enqueued in the new one."""
        self._deleted_floor = (0, 0)
        """The highest of each over the names `_deleted` let go (`MAX_DELETED_NAMES`):
        where every other new queue starts."""
        self._group_count: int | None = None
        """How many Raft groups the cluster places its queues over: fixed by the first
        `Place` (None: no queue was ever placed)."""
        self._placements: dict[str, int] = {}
        """The directory (`Place`): every queue name ever placed -> its group, for good."""
        self._group_loads: list[int] = []
        """Placements per group (derived from `_placements`)."""

    def _directory_full(self) -> bool:
        """Whether the directory holds `MAX_PLACEMENTS` names (it takes no more: a new
        name is placed by its hash, `hashed_group`)."""
        return len(self._placements) >= MAX_PLACEMENTS

    def _disk_alarm_error(self) -> Error:
        return _error(
            ErrorCode.DISK_ALARM,
            f"publishes wait: the data disk of {', '.join(sorted(self._disk_alarms))} is "
            "below its free-space limit (deliveries, acks and reads go on)",
        )
