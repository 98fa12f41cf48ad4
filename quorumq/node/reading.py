"""Reads: stream view rows from the local replica, at most `READ_SPAN` offsets and about
`READ_REPLY_BYTES` a reply; with `wait_ms`, waiting for the replica to apply a range
another node committed (`quorumq.node.reads`: woken when the replica moves their
queue's end, once per batch of entries applied, and timed out from one heap of
deadlines), at most `MAX_WAITING_READS` a connection and `MAX_WAITING_READS_PER_NODE`
in all."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from ..machine import (
    UnknownQueueError,
)
from ..wire.protocol import Frame, encode_columns
from .config import READ_REPLY_BYTES
from .connection import ConnectionCore
from .reads import WaitingRead, WaitingReads
from .services import Services

logger = logging.getLogger(__name__)

READ_SPAN = 8192
"""Offsets one `read` reply looks at: bounds how long a read holds the replica's lock."""
READ_ROW_OVERHEAD = 32
"""Bytes a row costs in a reply besides its body, key and headers (a generous guess)."""
MAX_READ_WAIT_MS = 30_000
"""The longest a `read` may ask its node to wait for the replica to apply its range."""
MAX_WAITING_READS = 64
"""Reads with `wait_ms` one connection may have waiting (refused past it: `too_many_reads`)."""
MAX_WAITING_READS_PER_NODE = 8192
"""Reads with `wait_ms` a node holds at once, of all its connections: waiting for the
replica, or applied and waiting for room to be answered. Past it a read is refused with
`node_reads_full` (ask another node, or again later): each holds its request and a place
in three indexes, and 128 connections at `MAX_WAITING_READS` already reach it."""


class Reading:
    """Answering reads (see the module's docstring)."""

    def __init__(self, core: Services) -> None:
        self.core = core
        self.waiting: WaitingReads[ConnectionCore] = WaitingReads()
        """Reads with `wait_ms` waiting for the replica to apply their range."""
        self._watched: frozenset[str] = frozenset()
        """The queues the replica is to say it moved the end of (`ends_moved`): those
        reads wait on, and some that reads waited on since it last said."""

    def read(self, conn: ConnectionCore, frame: Frame) -> None:
        """Stream view rows of [start, end) (in a key bucket), from this node's replica.

        Everything a replica has applied is committed, so a read never sees uncommitted
        data. Without `wait_ms` the reply covers what this replica has applied so far.
        With `wait_ms` the caller says the whole range is committed (it learned `end`
        from some node): a replica that lags is waited for (`ends_moved`); past the wait
        the node answers `lagging`, and the client asks another node.
        It never answers part of the range in that case. With `columns: true` the rows
        come column by column (`protocol.encode_columns`), for bulk readers."""
        start, end = frame["start"], frame["end"]
        bucket, buckets = frame["bucket"], frame["buckets"]
        wait_ms = frame.get("wait_ms")
        if start < 0 or end < start:
            raise ValueError(f"read range [{start}, {end}) is not a range of offsets")
        if (bucket is None) != (buckets is None):
            raise ValueError("bucket and buckets go together")
        if buckets is not None and not 0 <= bucket < buckets:
            raise ValueError(f"bucket must be in [0, {buckets}), got {bucket}")
        if wait_ms is not None and (
            type(wait_ms) is not int or not 0 <= wait_ms <= MAX_READ_WAIT_MS
        ):
            raise ValueError(f"wait_ms must be an integer from 0 to {MAX_READ_WAIT_MS}")
        queue = frame["queue"]
        if self.core.replica_of(queue) is None:
            # not placed on this node's group 0 yet: after a barrier there, as it is
            self.core.route(queue, lambda _replica, _error: self._placed(conn, frame))
            return
        self._read_placed(conn, frame)

    def _placed(self, conn: ConnectionCore, frame: Frame) -> None:
        if not conn.done:
            self._read_placed(conn, frame)

    def _read_placed(self, conn: ConnectionCore, frame: Frame) -> None:
        queue, end, wait_ms = frame["queue"], frame["end"], frame.get("wait_ms")
        if wait_ms is None:
            self.answer_read(conn, frame)
            return
        self._watch(queue)  # before reading its end: no move falls between
        if self._applied_end(queue) >= end:
            self.answer_read(conn, frame)
        elif self.waiting.waiting(conn) >= MAX_WAITING_READS:
            self.core.error(
                conn,
                frame["id"],
                "too_many_reads",
                f"{MAX_WAITING_READS} reads already wait on this connection; wait for them",
            )
        elif len(self.waiting) >= MAX_WAITING_READS_PER_NODE:
            self.core.error(
                conn,
                frame["id"],
                "node_reads_full",
                f"node {self.core.node_id} holds {MAX_WAITING_READS_PER_NODE} waiting reads, the "
                "most it holds (MAX_WAITING_READS_PER_NODE); ask another node, or again later",
            )
        else:
            first = self.waiting.next_deadline()
            deadline = self.core.clock() + wait_ms / 1000
            self.waiting.add(conn, frame, queue, end, deadline)
            if first is None or deadline < first:
                self.core.shell.timers_changed()

    def _watch(self, queue: str) -> None:
        if queue not in self._watched:
            self._watched = self._watched | {queue}
            for replica in self.core.groups:
                replica.watch_ends(self._watched)

    def ends_moved(self) -> None:
        """The replica applied entries that moved the end of queues reads wait on (it says
        so once until they are taken: one call for a batch of entries). Answer the reads
        their ends now cover, and no other: the work is theirs, whatever else waits."""
        moved = set().union(*(r.take_ends_moved() for r in self.core.groups))
        waited = self.waiting.queues()
        if not moved <= waited:  # queues no read waits on any more: not watched
            self._watched = frozenset(waited)
            for replica in self.core.groups:
                replica.watch_ends(self._watched)
        self.wake_reads(moved & waited)

    def wake_reads(self, queues: Iterable[str]) -> None:
        queues = list(queues)
        if not queues:
            return
        if len(self.core.groups) == 1:
            ends = self.core.replica.query(lambda m: [_end_of(m, q) for q in queues])
        else:
            ends = [self._applied_end(q) for q in queues]
        for queue, end in zip(queues, ends, strict=True):
            for read in self.waiting.ready(queue, end):
                self._read_ready(read)

    def _read_ready(self, read: WaitingRead[ConnectionCore]) -> None:
        conn = read.owner
        if conn.done:
            return
        if conn.full:  # up to 64 replies of 768 KiB could come due at once
            self.waiting.hold(read)
        else:
            self.answer_read(conn, read.frame)

    def _applied_end(self, queue: str) -> int:
        """The offset after the last message this replica has applied to `queue`; -1
        when it has not applied the queue's declaration (yet)."""
        replica = self.core.replica_of(queue)
        if replica is None:
            return -1
        end: int = replica.query(lambda m: _end_of(m, queue))
        return end

    def read_expired(self, read: WaitingRead[ConnectionCore]) -> None:
        conn, frame = read.owner, read.frame
        queue, end = frame["queue"], frame["end"]
        applied = self._applied_end(queue)
        if applied >= end:  # moved as the time ran out
            self._read_ready(read)
            return
        if conn.done:
            return
        where = (
            f"does not know queue {queue!r}"
            if applied < 0
            else f"has applied {queue!r} up to offset {applied}, short of {end}"
        )
        self.core.error(
            conn,
            frame["id"],
            "lagging",
            f"node {self.core.node_id} {where} after waiting {frame['wait_ms']} ms; "
            "ask another node",
        )

    def answer_read(self, conn: ConnectionCore, frame: Frame) -> None:
        queue, start, end = frame["queue"], frame["start"], frame["end"]
        bucket, buckets = frame["bucket"], frame["buckets"]

        def page(m: Any) -> tuple[list[tuple[Any, ...]], Any, int]:
            stats = m.stats(queue)
            limit = min(end, stats.next_offset, max(start, stats.first_retained) + READ_SPAN)
            rows: list[tuple[Any, ...]] = []
            size = 0
            for record in m.read_records(queue, start, limit, bucket, buckets):
                offset, key, body, headers = record[0], record[1], record[2], record[3]
                row_size = len(body) + READ_ROW_OVERHEAD + (len(key) if key else 0)
                if headers:
                    row_size += sum(len(k) + len(v) for k, v in headers.items())
                if rows and size + row_size > READ_REPLY_BYTES:
                    return rows, stats, offset
                rows.append(record)  # (offset, key, body, headers, ts_ms): packed as is
                size += row_size
            return rows, stats, max(start, limit)

        replica = self.core.replica_of(queue)
        try:
            if replica is None:
                raise UnknownQueueError(f"no queue named {queue!r}")
            rows, stats, covered = replica.query(page)
        except UnknownQueueError as e:
            self.core.error(conn, frame["id"], "unknown_queue", str(e))
            return
        reply: Frame = {
            "t": "reply",
            "id": frame["id"],
            "first_retained": stats.first_retained,
            "next_offset": stats.next_offset,
            "covered_until": covered,
        }
        if frame.get("columns") is True:  # a bulk reader's: bodies in one bytes object
            reply["columns"] = encode_columns(rows)
        else:
            reply["messages"] = rows
        self.core.push(conn, reply)


def _end_of(m: Any, queue: str) -> int:
    """`queue`'s end in machine `m`: the offset after its last message, -1 with no queue."""
    try:
        end: int = m.stats(queue).next_offset
    except UnknownQueueError:
        return -1
    return end
