"""Enqueueing (`Enqueueing`): a publish checked against its producer (new, known, a
resend, out of order, sealed, forgotten; room made for a new producer by forgetting
silent ones, `MAX_PRODUCERS`), against a disk alarm and the queue's length, then
appended, singly, as a batch, or numbered by the caller."""

from __future__ import annotations

from typing import Any

from .commands import (
    Enqueue,
    EnqueueBatch,
)
from .dispatch import Dispatching
from .queue import (
    ProducerState,
    QueueState,
    producer_generation,
)
from .replies import (
    Enqueued,
    Error,
    ErrorCode,
    Reply,
)
from .state import (
    EVICT_SILENT_MS,
    MAX_PRODUCERS,
    MAX_SEALED_PREFIX,
    PRODUCER_EXPIRY_MS,
    _error,
    _is_resend,
)


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


class Enqueueing(Dispatching):
    """Enqueueing (see the module's docstring)."""

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
