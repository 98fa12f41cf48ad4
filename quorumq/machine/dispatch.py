"""How the machine runs what a command changed (`Dispatching`): the queue and consumer a
command names (or the `Error` it meets), the delivery of what became ready, and what
leaves a queue undelivered, dead-lettered (at most `MAX_DEATH_HOPS` hops) or dropped."""

from __future__ import annotations

from typing import Any

from .effects import DeadLettered, Dropped
from .queue import (
    ConsumerState,
    QueueState,
    Record,
)
from .replies import (
    Error,
    ErrorCode,
)
from .state import MachineState, _error

MAX_DEATH_HOPS = 32
"""Most dead-letterings of one message with no rejection between them."""

_PATH_SEPARATOR = "\x1f"


def _death_path(headers: dict[str, str]) -> list[str]:
    raw = headers.get("x-death-path")
    return raw.split(_PATH_SEPARATOR) if raw else []


class Dispatching(MachineState):
    """Running what a command changed (see the module's docstring)."""

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
