"""Publishes to commands: those of one producer that arrive together, with consecutive
sequence numbers, are proposed as one `EnqueueBatch` (at most `GATHER_BYTES` of bodies);
a body over `max_body` is refused; while a disk alarm is in the log, a publish it would
refuse is answered here, without a log entry."""

from __future__ import annotations

import logging

import attrs

from .. import pathtiming
from ..machine import (
    Command,
    Enqueue,
    EnqueueBatch,
    Enqueued,
    Message,
    Reply,
)
from ..replica import (
    ProposalError,
)
from ..wire.protocol import Frame
from .connection import ConnectionCore
from .disk import DiskWatch
from .services import PROPOSAL_COST, Services

logger = logging.getLogger(__name__)

GATHER_BYTES = 1024 * 1024
"""Most body bytes of consecutive publishes gathered into one `EnqueueBatch` entry (a log
entry holds at most `MAX_COMMAND_BYTES`; four pipelined 1 MiB publishes exceeded it and
crashed the connection, which the client then resent to for ever)."""


@attrs.define
class Gathered:
    """Consecutive publishes read together, to be proposed as one entry, and the bytes
    of their bodies (summed as they come: summing them again for each publish made a
    read of a few thousand small publishes quadratic)."""

    frames: list[Frame] = attrs.Factory(list)
    body_bytes: int = 0


class Publishes:
    """Proposing publishes (see the module's docstring)."""

    def __init__(self, core: Services, disk: DiskWatch) -> None:
        self.core = core
        self.disk = disk

    def _check_body(self, conn: ConnectionCore, frame: Frame, body: bytes) -> bool:
        limit = self.core.config.max_body
        if len(body) > limit:
            self.core.error(
                conn, frame["id"], "too_large", f"message body of {len(body)} bytes exceeds {limit}"
            )
            return False
        return True

    def gather_publish(self, conn: ConnectionCore, publishes: Gathered, frame: Frame) -> None:
        if pathtiming.ENABLED:
            pathtiming.mark("node.read", ("p", frame["producer"], frame["seq"]))
        if not self._check_body(conn, frame, frame["body"]):
            return
        if publishes.frames:
            last = publishes.frames[-1]
            joinable = (
                publishes.body_bytes + len(frame["body"]) <= GATHER_BYTES  # one entry holds them
                and not frame.get("retry")
                and last["queue"] == frame["queue"]
                and last["producer"] == frame["producer"]
                and frame["seq"] is not None
                and last["seq"] is not None
                and frame["seq"] == last["seq"] + 1
            )
            if not joinable:
                self.flush_publishes(conn, publishes)
        publishes.frames.append(frame)
        publishes.body_bytes += len(frame["body"])
        if frame.get("retry"):
            self.flush_publishes(conn, publishes)

    def flush_publishes(self, conn: ConnectionCore, publishes: Gathered) -> None:
        if not publishes.frames:
            return
        frames = publishes.frames
        publishes.frames, publishes.body_bytes = [], 0
        first = frames[0]
        try:
            if len(frames) == 1:
                command: Command = Enqueue(
                    queue=first["queue"],
                    body=first["body"],
                    key=first["key"],
                    headers=first["headers"],
                    producer=first["producer"],
                    seq=first["seq"],
                )
            else:
                command = EnqueueBatch(
                    queue=first["queue"],
                    messages=[
                        Message(body=f["body"], key=f["key"], headers=f["headers"]) for f in frames
                    ],
                    producer=first["producer"],
                    first_seq=first["seq"],
                )
        except (TypeError, ValueError) as e:
            for f in frames:
                self.core.error(conn, f["id"], "invalid", str(e))
            return
        ids = [f["id"] for f in frames]
        if self._refused_for_disk(
            conn, ids, first["queue"], first["producer"], first["seq"], len(frames)
        ):
            return
        cost = sum(len(f["body"]) + PROPOSAL_COST for f in frames)
        conn.proposing_bytes += cost

        def done(reply: Reply | None, error: ProposalError | None) -> None:
            self.core.answered(conn, cost)
            self._answer_publishes(conn, ids, reply, error)

        self.core.propose_to_queue(command, done, conn)
        if pathtiming.ENABLED:
            for f in frames:
                pathtiming.mark("node.proposed", ("p", f["producer"], f["seq"]))

    def _answer_publishes(
        self,
        conn: ConnectionCore,
        ids: list[int],
        reply: Reply | None,
        error: ProposalError | None,
    ) -> None:
        if isinstance(reply, Enqueued) and error is None:
            for i, request_id in enumerate(ids):
                offset = None if reply.offset is None else reply.offset + i
                self.core.push(
                    conn,
                    {
                        "t": "reply",
                        "id": request_id,
                        "offset": offset,
                        "count": 1,
                        "duplicate": reply.duplicate,
                    },
                )
            return
        for request_id in ids:
            self.core.reply(conn, request_id, reply, error)

    def publish_batch(self, conn: ConnectionCore, frame: Frame) -> None:
        messages = []
        for m in frame["messages"]:
            if not isinstance(m, list) or len(m) != 3:
                raise ValueError("each message must be [body, key, headers]")
            if not self._check_body(conn, frame, m[0]):
                return
            messages.append(Message(body=m[0], key=m[1], headers=m[2]))
        command = EnqueueBatch(
            queue=frame["queue"],
            messages=messages,
            producer=frame["producer"],
            first_seq=frame["first_seq"],
            seqs=frame.get("seqs"),
            opens=bool(frame.get("opens")),
        )
        if self._refused_for_disk(
            conn,
            [frame["id"]],
            command.queue,
            command.producer,
            command.first_seq,
            len(messages),
            command.seqs,
        ):
            return
        cost = sum(len(m.body) + PROPOSAL_COST for m in messages)
        self.core.propose_for(conn, frame["id"], command, cost=cost)

    def _refused_for_disk(
        self,
        conn: ConnectionCore,
        ids: list[int],
        queue: str,
        producer: str | None,
        first_seq: int | None,
        count: int,
        seqs: tuple[int, ...] | None = None,
    ) -> bool:
        """While a disk alarm is in the log, answer a publish it would refuse here,
        without proposing it (a log entry each, on the disk that is filling: clients
        retry a refused resend every second). Only looked up while this node saw an
        alarm at its last measure (`disk_free`), or one is raised here."""
        if not (self.disk.alarms_in_log or self.disk.disk_alarm):
            return False
        replica = self.core.replica_of(queue)
        if replica is None:
            return False  # (proposed, it is answered as a queue not placed)
        refusal = replica.query(
            lambda m: m.disk_alarm_refusal(queue, producer, first_seq, count, seqs)
        )
        if refusal is None:
            return False
        for request_id in ids:
            self.core.reply(conn, request_id, refusal, None)
        return True
