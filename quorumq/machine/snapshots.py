"""The machine's whole state in a canonical, versioned encoding (`Snapshots`: no
pickle), its digest, and the machine restored from one."""

from __future__ import annotations

import hashlib
from typing import Any, Self

import attrs

from . import encoding
from .commands import (
    QueueOptions,
)
from .queue import (
    ConsumerState,
    ProducerState,
    QueueState,
    Record,
    message_cost,
)
from .state import MachineState

_SNAPSHOT_FORMAT = "quorumq-machine"
_SNAPSHOT_VERSION = 7
"""2: retention counts keys, headers and an overhead per message (`message_cost`), and
dead-lettered messages carry their death path. 3: each queue ends with the highest
producer generation it forgot. 4: and then its messages waiting for a retry delay, its
options end with `retry_backoff_ms`, and the machine ends with where deleted queues
ended (`Machine._deleted`). Versions 1 to 3 are read too (the retained bytes are counted
again on restore; no generation was forgotten; nothing waits, options missing at the
end take their defaults, and no queue was deleted). 5: and then the disk alarms raised
(none before). A snapshot with no alarm raised is written as version 4, which nodes of
the version before read too (an upgraded leader's snapshot installs on an old
follower). 6: a queue may end with its sealed producer prefixes
(`ForgetProducers.seal`); written only when one has some (a node of an earlier version
restoring it would drop them silently, and then take producers the others refuse). 7:
and then the group count and the directory (`Place`); written only once a queue was
placed (a node of an earlier version would route without it)."""
_READABLE_VERSIONS = (1, 2, 3, 4, 5, 6, 7)
_OPTION_FIELDS = tuple(f.name for f in attrs.fields(QueueOptions))


class Snapshots(MachineState):
    """Snapshot, digest and restore (see the module's docstring)."""

    def snapshot(self) -> bytes:
        """The whole state in a canonical, versioned encoding (no pickle)."""
        version = self._snapshot_version()
        return encoding.encode(
            [
                _SNAPSHOT_FORMAT,
                version,
                self._last_index,
                self._now,
                sorted(self._down_nodes),
                [_encode_queue(q) for q in self._queues.values()],
                [
                    list(self._deleted_floor),
                    [[name, *ended] for name, ended in self._deleted.items()],  # oldest first
                ],
                *([sorted(self._disk_alarms)] if version >= 5 else []),
                *(
                    [[self._group_count, sorted([n, g] for n, g in self._placements.items())]]
                    if version >= 7
                    else []
                ),
            ]
        )

    def _snapshot_version(self) -> int:
        """7 once a queue was placed, 6 with a sealed prefix in any queue, 5 with a disk
        alarm raised, else 4: a snapshot an older node could install but not fully read
        it refuses instead."""
        if self._group_count is not None:
            return _SNAPSHOT_VERSION
        if any(q.sealed for q in self._queues.values()):
            return 6
        return 5 if self._disk_alarms else 4

    def digest(self) -> str:
        """A stable hash of the whole state: equal states give equal digests everywhere."""
        return hashlib.sha256(self.snapshot()).hexdigest()

    @classmethod
    def restore(cls, data: bytes) -> Self:
        value = encoding.decode(data)
        if not (
            isinstance(value, list) and len(value) in (6, 7, 8, 9) and value[0] == _SNAPSHOT_FORMAT
        ):
            raise encoding.DecodeError("not a quorumq machine snapshot")
        version = value[1]
        if version not in _READABLE_VERSIONS:
            raise encoding.DecodeError(f"unsupported snapshot version {version}")
        parts = 9 if version >= 7 else 8 if version >= 5 else 7 if version >= 4 else 6
        if len(value) != parts:
            raise encoding.DecodeError(f"a version {value[1]} snapshot of {len(value)} parts")
        m = cls()
        m._last_index, m._now = value[2], value[3]
        m._down_nodes = set(value[4])
        for raw in value[5]:
            q = _decode_queue(raw, m._now)
            m._queues[q.name] = q
            for consumer in q.consumers:
                m._consumer_queues.setdefault(consumer, {})[q.name] = None
        if len(value) >= 7:  # version 4: where deleted queues ended
            floor, deleted = value[6]
            m._deleted_floor = (floor[0], floor[1])
            m._deleted = {name: (offset, generation) for name, offset, generation in deleted}
        if len(value) >= 8:  # version 5: the disk alarms raised
            m._disk_alarms = set(value[7])
        if len(value) == 9:  # version 7: the directory
            count, placements = value[8]
            m._group_count = count
            m._group_loads = [0] * count
            for name, group in placements:
                m._placements[name] = group
                m._group_loads[group] += 1
        return m


def _encode_queue(q: QueueState) -> list[Any]:
    first = q.first_retained
    early = sorted(o for o in q.msgs if o < first)
    messages = [q.msgs[o] for o in early]
    messages += q.read(first, q.next_offset)
    return [
        q.name,
        [getattr(q.options, f) for f in _OPTION_FIELDS],
        q.next_offset,
        first,
        q.stream_bytes,
        messages,
        sorted(q.msgs),
        sorted([o, n] for o, n in q.returns.items()),
        [
            [c.id, c.node, c.prefetch, c.cancelled, sorted(c.unacked.items()), c.timeout_ms]
            for c in q.consumers.values()
        ],
        [c.id for c in q.sq],
        sorted(
            [p, s.last_seq, s.last_ts, [list(r) for r in s.runs]] for p, s in q.producers.items()
        ),
        sorted([g, o] for g, o in q.commits.items()),
        q.expiry_cursor,
        q.forgotten_generation,
        sorted([o, due] for o, due in q.waiting.items()),
        # only when there are seals: without, the encoding is version 4's, byte for byte
        *([[[p, at] for p, at in q.sealed.items()]] if q.sealed else []),  # oldest first
    ]


def _decode_queue(raw: list[Any], now: int) -> QueueState:
    (
        name,
        options,
        next_offset,
        first,
        stream_bytes,
        messages,
        in_queue,
        returns,
        consumers,
        sq,
        producers,
        commits,
        expiry_cursor,
        *later,  # version 3: the forgotten generation; 4: and what waits; 5: and seals
    ) = raw
    if len(options) > len(_OPTION_FIELDS):
        raise encoding.DecodeError(f"queue {name!r} has {len(options)} options")
    # options added later (consumer_timeout_ms) take their defaults in older snapshots
    q = QueueState(name, QueueOptions(**dict(zip(_OPTION_FIELDS, options, strict=False))))
    q.next_offset = next_offset
    by_offset: dict[int, Record] = {m[0]: tuple(m) for m in messages}
    q.stream_items = [by_offset[o] for o in range(first, next_offset)]
    q.stream_base = first
    del stream_bytes  # counted again: version 1 counted bodies only
    q.stream_bytes = sum(
        message_cost(m[2], m[1], m[3]) for m in by_offset.values() if m[0] >= first
    )
    q.msgs = {o: by_offset[o] for o in in_queue}
    q.returns = {o: n for o, n in returns}
    q.waiting = {o: due for o, due in later[1]} if len(later) > 1 else {}
    for cid, node, prefetch, cancelled, unacked, *rest in consumers:
        c = ConsumerState(cid, node, prefetch, rest[0] if rest else None)
        c.cancelled = cancelled
        q.consumers[cid] = c
        for held in unacked:  # [offset, delivered at]; version 1: the offset alone
            off, at = (held, now) if type(held) is int else held
            c.unacked[off] = at
            q.held[off] = c
            key = q.msgs[off][1]
            if key is not None:
                q.key_owner[key] = c
                c.keys[key] = c.keys.get(key, 0) + 1
    q.restore_ready(sorted(o for o in q.msgs if o not in q.held))
    for cid in sq:
        c = q.consumers[cid]
        c.in_sq = True
        q.sq.append(c)
    for producer, last_seq, last_ts, runs in producers:
        state = ProducerState(last_seq, last_ts)
        state.runs.extend(runs)
        q.producers[producer] = state
    q.commits = {g: o for g, o in commits}
    q.expiry_cursor = expiry_cursor
    q.forgotten_generation = later[0] if later else 0
    q.sealed = {p: at for p, at in later[2]} if len(later) > 2 else {}
    return q
