"""Acks and nacks: those of one consumer read together go as one command per
(consumer, nack, requeue, delay), and while one ack of a consumer is proposed the next
ones wait for it and go together (`ACKS_HELD_S`, `ACKS_HELD_MAX`); settled again what a
leader change lost (after "not applied", `RETRY_EVERY_S` later; after "outcome
unknown" or a refusal of an offset no longer held, for the offsets still held)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import attrs

from ..machine import (
    Ack,
    Error,
    ErrorCode,
    Nack,
    Reply,
    UnknownQueueError,
)
from ..machine.commands import MAX_RETRY_DELAY_MS
from ..replica import (
    NotAppliedError,
    OutcomeUnknownError,
    ProposalError,
)
from ..wire.protocol import Frame
from .connection import ConnectionCore
from .services import RETRY_EVERY_S, Services, Timer

logger = logging.getLogger(__name__)

SETTLE_ATTEMPTS = 20
ACKS_HELD_S = 0.05
"""Longest a consumer's acks wait for its ack being proposed (`Settling._ack`)."""
ACKS_HELD_MAX = 4096
"""Most offsets held that way: past it they are proposed at once (one log entry)."""
SettleKey = tuple[str, bool, bool, int | None]
"""Acks and nacks read together go in one command per (consumer, nack, requeue,
delay_ms)."""


@attrs.define
class _HeldAcks:
    """A consumer's acks waiting for its ack being proposed (`Settling._ack`)."""

    queue: str
    conn: ConnectionCore
    offsets: list[int]
    timer: Timer | None = None


class Settling:
    """Settling acks and nacks (see the module's docstring)."""

    resettle_refused_batches = True
    """`settle`: after an ack or nack of several offsets is refused whole (`not_held`),
    settle again the offsets still held. (A switch for the negative controls, each of
    which turns off one rule.)"""
    retry_lost_settles = True
    """`settle`: propose an ack or nack again when a leader change or a timeout lost it."""

    def __init__(self, core: Services) -> None:
        self.core = core
        self.acking: dict[str, _HeldAcks] = {}
        """Per consumer with an ack being proposed: the acks that came since, proposed
        together once it is answered (`_ack`)."""
        self._retrying: dict[str, list[Timer]] = {}
        """Per consumer: its acks and nacks a leader change refused, due again soon."""

    def gather_ack(
        self, conn: ConnectionCore, acks: dict[SettleKey, list[int]], frame: Frame
    ) -> None:
        consumer = frame["consumer"]
        if consumer not in conn.consumers:
            self.core.error(
                conn, None, "unknown_consumer", f"no consumer {consumer!r} on this connection"
            )
            return
        offsets = frame["offsets"]
        if not all(type(o) is int and o >= 0 for o in offsets):
            self.core.error(conn, None, "invalid", "offsets must be non-negative integers")
            return
        nack = frame["t"] == "nack"
        requeue = bool(frame.get("requeue"))
        delay_ms = frame.get("delay_ms") if nack else None
        if delay_ms is not None and (not requeue or not 0 <= delay_ms <= MAX_RETRY_DELAY_MS):
            self.core.error(
                conn,
                None,
                "invalid",
                f"delay_ms must be from 0 to {MAX_RETRY_DELAY_MS}, and goes with requeue=True",
            )
            return
        acks.setdefault((consumer, nack, requeue, delay_ms), []).extend(offsets)

    def flush_acks(self, conn: ConnectionCore, acks: dict[SettleKey, list[int]]) -> None:
        for (consumer, nack, requeue, delay_ms), offsets in acks.items():
            queue = conn.consumers.get(consumer)
            if queue is None:
                continue
            if nack:
                self.release_acks(consumer)  # the consumer's acks before its nack
                command = Nack(
                    queue=queue,
                    consumer=consumer,
                    offsets=offsets,
                    requeue=requeue,
                    delay_ms=delay_ms,
                )
                self.settle(command, conn)
            else:
                self._ack(queue, consumer, offsets, conn)
        acks.clear()

    def _ack(self, queue: str, consumer: str, offsets: list[int], conn: ConnectionCore) -> None:
        """Propose an ack of `offsets` now, or, while an ack of the same consumer is being
        proposed, with the acks that follow it once it is answered: a consumer's acks
        arriving while one commits take one log entry (one fdatasync on each replica)
        instead of one each. Nothing waits when acks are rarer than a commit, and no ack
        waits longer than `ACKS_HELD_S` (PySyncObj does not answer every proposal: a
        snapshot install can skip its entry), nor past `ACKS_HELD_MAX` offsets."""
        held = self.acking.get(consumer)
        if held is not None:
            held.offsets += offsets
            if len(held.offsets) >= ACKS_HELD_MAX:
                self.propose_held_acks(consumer)
            elif held.timer is None:
                held.timer = self.core.call_later(ACKS_HELD_S, self.propose_held_acks, consumer)
            return
        self.acking[consumer] = _HeldAcks(queue, conn, [])
        self.settle(
            Ack(queue=queue, consumer=consumer, offsets=offsets),
            conn,
            answered=lambda: self._next_acks(consumer),
        )

    def _next_acks(self, consumer: str) -> None:
        held = self.acking.pop(consumer, None)
        if held is not None:
            if held.timer is not None:
                held.timer.cancel()
            if held.offsets:
                self._ack(held.queue, consumer, held.offsets, held.conn)

    def propose_held_acks(self, consumer: str) -> None:
        """Propose the acks of `consumer` that wait, now (they waited long enough)."""
        held = self.acking.get(consumer)
        if held is not None:
            if held.timer is not None:
                held.timer.cancel()
                held.timer = None
            if held.offsets:
                offsets = list(dict.fromkeys(held.offsets))
                held.offsets = []
                self.settle(Ack(queue=held.queue, consumer=consumer, offsets=offsets), held.conn)

    def release_acks(self, consumer: str) -> None:
        """A nack or a `Down` of `consumer` follows: its acks that wait go first, and so
        does any of its acks and nacks that a leader change made wait for their next
        attempt (a nack taking back a key's later messages, one of them acked, would
        have returned it)."""
        self.propose_held_acks(consumer)
        for retry in self._retrying.pop(consumer, ()):
            if not retry.cancelled:
                retry.cancel()
                retry.call(*retry.args)

    def _forget_retry(self, consumer: str, timer: Timer) -> None:
        retries = self._retrying.get(consumer)
        if retries is not None and timer in retries:
            retries.remove(timer)
            if not retries:
                del self._retrying[consumer]

    def settle(
        self,
        command: Ack | Nack,
        conn: ConnectionCore,
        attempt: int = 1,
        answered: Callable[[], None] | None = None,
    ) -> None:
        """Propose an ack or nack, again if a leader change lost it: the client sent it
        and moved on, and a lost one would leave the message held by a live consumer.

        After "not applied" the same command goes again, `RETRY_EVERY_S` later (at once,
        twenty refusals from a leader that had just handed leadership over took 30 ms,
        and the ack was lost: simulator, seed 194). After "outcome unknown" it
        goes again for the offsets the consumer still holds on this replica (an ack is
        safe to repeat; a requeueing nack repeated after all is one more marked
        redelivery). A repeat refused because the offsets are no longer held means the
        first attempt did land: nothing to report.

        The machine refuses an ack or nack whole if one offset is not held (a nack of a
        keyed message takes back the key's later messages the consumer holds, and the
        client may ack one of those in the same read as others). The refusal is
        reported, and the offsets still held are settled again, so none is stranded.

        `answered` is called when this attempt is answered, whatever the answer."""

        def done(reply: Reply | None, error: ProposalError | None) -> None:
            if answered is not None:
                answered()
            if isinstance(reply, Error) and reply.code == ErrorCode.NOT_HELD:
                if attempt == 1:  # say which, then settle the offsets still held
                    self.core.answer(conn, None, reply, None, None)
                resettle = self.resettle_refused_batches and len(command.offsets) > 1
                if resettle and attempt < SETTLE_ATTEMPTS:
                    self._settle_held(command, conn, attempt + 1)
                return
            if self.retry_lost_settles and attempt < SETTLE_ATTEMPTS:
                if isinstance(error, NotAppliedError):
                    # after a moment: a node that still takes an old leader for the leader
                    # is refused at once ("no longer leader") until the election is over
                    # (or at once, before a nack or a Down of the same consumer)
                    self._retry_later(command, conn, attempt + 1)
                    return
                if isinstance(error, OutcomeUnknownError):
                    self._settle_held(command, conn, attempt + 1)
                    return
            self.core.answer(conn, None, reply, error, None)

        self.core.propose_to_queue(command, done)

    def _retry_later(self, command: Ack | Nack, conn: ConnectionCore, attempt: int) -> None:
        consumer = command.consumer
        timer: Timer

        def again() -> None:
            self._forget_retry(consumer, timer)
            self.settle(command, conn, attempt)

        timer = self.core.call_later(RETRY_EVERY_S, again)
        self._retrying.setdefault(consumer, []).append(timer)

    def _settle_held(self, command: Ack | Nack, conn: ConnectionCore, attempt: int) -> None:
        replica = self.core.replica_of(command.queue)
        try:
            if replica is None:
                raise UnknownQueueError(command.queue)
            held = set(replica.query(lambda m: m.unacked(command.queue, command.consumer)))
        except UnknownQueueError:
            return  # the queue was deleted, with what it held
        offsets = tuple(o for o in command.offsets if o in held)
        if offsets:
            self.settle(attrs.evolve(command, offsets=offsets), conn, attempt)
