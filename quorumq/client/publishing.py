"""Publishing (`Publishing`): producer ids and sequence numbers, the unconfirmed publishes
and their resends in order, keys paused after an outcome unknown, the limits on what is
live, and what each answer to a publish means (confirmed, refused for good, refused for
now and parked, forgotten, or outcome unknown)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..machine.commands import MAX_SEQ, check_seqs
from ..wire.protocol import encode_frame
from .core import (
    RETRIABLE,
    KeyPausedError,
    OutcomeUnknownError,
    QuorumqError,
    RefusedBeforeError,
    ServerError,
    TooManyUnconfirmedError,
    publish_frame,
)
from .session_state import (
    _LONGEST_ID,
    PARKED_RETRY_DELAY,
    PARKED_RETRY_LONGEST,
    PASSING_REFUSALS,
    Event,
    Failed,
    Resolved,
    RewindLater,
    Send,
    SessionState,
    _at_least,
    _numbers,
    _size_of,
    keys_of,
)


class Publishing(SessionState):
    """The session's publishing (see the module's docstring)."""

    def publish(
        self, queue: str, body: bytes, key: str | None, headers: Mapping[str, str] | None
    ) -> tuple[int, dict[str, Any]]:
        self.producer.check(key)
        self._check_not_behind(queue, [key], self.producer.id_for(queue))
        self._check_fits(
            [[body, key, headers]],
            lambda: publish_frame(0, queue, body, key, headers, _LONGEST_ID, 2**62),
        )
        self._check_room([[body, key, headers]])
        producer, seq = self.producer.take(queue)
        frame = publish_frame(0, queue, body, key, headers, producer, seq)
        return self.request(frame, idempotent=True)

    def publish_batch(
        self,
        queue: str,
        rows: list[list[Any]],
        producer: str | None = None,
        first_seq: int | None = None,
        seqs: list[int] | None = None,
        opens: bool = False,
    ) -> tuple[int, dict[str, Any]]:
        """A batch under this client's producer id, or under the caller's `producer` and
        `first_seq`, or `producer` and one sequence number per message (`seqs`, strictly
        increasing): a caller that derives them from its input, so that a replay of the
        same input is recognised by the queue. `opens`: this `seqs` batch is the
        producer's first (a producer the queue does not know takes only that one)."""
        if seqs is not None:
            if producer is None or first_seq is not None:
                raise ValueError("seqs go with a producer, and without first_seq")
            check_seqs(seqs, len(rows))
            if any(
                f["queue"] == queue and f["producer"] == producer
                for f in self._unconfirmed.values()
            ):
                # the queue would take the later batch first and the earlier one, resent,
                # for a duplicate of numbers below the producer's last: lost
                raise QuorumqError(
                    f"a batch under producer {producer!r} numbered by seqs is still live: "
                    "send the next one once it is answered"
                )
        elif opens:
            raise ValueError("opens goes with seqs")
        elif (producer is None) != (first_seq is None):
            raise ValueError("producer and first_seq go together")
        elif first_seq is not None and not 0 <= first_seq <= MAX_SEQ - len(rows):
            raise ValueError(f"first_seq must be in 0..{MAX_SEQ - len(rows)}, got {first_seq}")
        for _, key, _ in rows:
            self.producer.check(key)
        own = producer if producer is not None else self.producer.id_for(queue)
        self._check_not_behind(queue, [key for _, key, _ in rows], own)
        self._check_fits(
            rows,
            lambda: {
                "t": "publish_batch",
                "queue": queue,
                "messages": rows,
                "producer": producer or _LONGEST_ID,
                "first_seq": 2**62,
                "id": 2**62,
                **({} if seqs is None else {"seqs": [2**62] * len(rows)}),
            },
        )
        self._check_room(rows)
        chosen = producer is not None
        if producer is None:
            producer, first_seq = self.producer.take(queue, len(rows))
        frame: dict[str, Any] = {
            "t": "publish_batch",
            "queue": queue,
            "messages": rows,
            "producer": producer,
            "first_seq": first_seq,
        }
        if seqs is not None:
            frame["seqs"] = list(seqs)
            if opens:
                frame["opens"] = True
        request_id, frame = self.request(frame, idempotent=True)
        if chosen:
            self._chosen.add(request_id)
        return request_id, frame

    def unconfirmed(
        self, queue: str | None = None, only: set[int] | None = None
    ) -> list[dict[str, Any]]:
        """Unconfirmed publishes (of `queue`, or all; or the request ids `only`) to send
        again, in the order they were first sent (request ids grow in send order; per
        producer that is sequence order), marked as resends. Not by producer id: a
        renewed id is random, and its publishes would overtake earlier ones of the same
        key half of the time. Not those whose resend this connection's node refused:
        they go on the next connection, or after `PARKED_RETRY_DELAY`."""
        frames = [
            (r, f)
            for r, f in sorted(self._unconfirmed.items())
            if (queue is None or f["queue"] == queue)
            and r not in self._parked
            and (only is None or r in only)
        ]
        self._resent.update(r for r, _ in frames)
        for request_id, _ in frames:
            self._attempts[request_id] = self._attempts.get(request_id, 0) + 1
        return [{**f, "retry": True} for _, f in frames]

    def outcome_unknown(self, request_id: int, why: str) -> OutcomeUnknownError | None:
        """The caller stops waiting for publish `request_id` (a timeout, a cancellation).

        Not answered yet: the publish stays live (it is resent until answered, its answer
        then read and dropped), its keys are paused, and the error to raise says so.
        Already answered (the answer was read, and is on its way to the caller): None,
        and nothing changes; the caller takes that answer. Reporting "outcome unknown"
        then would leave the key unpaused for a publish whose outcome the caller never
        learns, and the application's retry would publish it twice."""
        if request_id not in self._pending:
            return None
        publish = self._unconfirmed.get(request_id)
        if publish is None:
            return OutcomeUnknownError(why)
        self._keys_failed([publish])
        keys = sorted(keys_of(publish))
        paused = f"; key{'s' if len(keys) > 1 else ''} {', '.join(map(repr, keys))} paused"
        return OutcomeUnknownError(
            f"{why}: the publish may still land (it is being resent, and is never enqueued "
            f"twice); do not publish it again{paused if keys else ''} (once the key has left "
            "settling_keys(), read to see whether it landed, then resume it)"
        )

    def cancelled_while_waiting(self, request_id: int, keys: Iterable[str]) -> None:
        """A caller was cancelled (trio) while waiting for publish `request_id`, of
        `keys`: it never learns the outcome, so the keys are paused as after any outcome
        unknown, even if the answer was read just before (the application cannot tell,
        and its retry would publish the message twice)."""
        if self.outcome_unknown(request_id, "cancelled") is None:
            for key in keys:
                self.producer.failed(key)

    def rewind(self, queue: str) -> list[dict[str, Any]]:
        """What to send now that a `RewindLater(queue)` is due: the queue's live
        publishes after a retriable failure; its parked ones (`PARKED_RETRY_DELAY`);
        nothing if an earlier rewind sent them already."""
        everything = queue in self._rewinding
        parked_due = queue in self._parked_retry
        self._rewinding.discard(queue)
        self._parked_retry.discard(queue)
        if not parked_due:
            return self.unconfirmed(queue) if everything else []
        due = self._parked_heads(queue)
        self._parked -= due
        self._retry_parked -= due
        return self.unconfirmed(queue, None if everything else due)

    def settling_keys(self) -> set[str]:
        """Keys with a publish still live: unconfirmed, and resent until answered. Once a
        key has left, nothing more can land for it, and a read tells what did."""
        return {key for _, key in self._live}

    def resume(self, key: str) -> None:
        """Publishing `key` may go on. Refused (`KeyPausedError`) while the key has a
        live publish: one whose outcome is unknown may still land, so a read that misses
        it proves nothing, and a retry decided on it would be a second message."""
        if key in self.settling_keys():
            raise KeyPausedError(
                f"key {key!r} still has a publish that is live (unconfirmed, being resent "
                f"until a node answers it): wait until {key!r} leaves settling_keys(); then "
                "nothing more can land for it, a read tells whether it landed, and "
                f"resume({key!r}) is allowed"
            )
        self.producer.paused.discard(key)

    def _check_not_behind(self, queue: str, keys: Iterable[str | None], producer: str) -> None:
        """`KeyPausedError` for a publish under `producer` of a key that has a publish
        still unconfirmed under another producer id (a failure retired this client's
        id, or a caller chose its own): the queue orders each producer's sequence alone,
        so if the earlier one is lost and resent, it would land after this one."""
        for key in keys:
            if key is None:
                continue
            others = self._live.get((queue, key), {}).keys() - {producer}
            if others:
                raise KeyPausedError(
                    f"an earlier publish of key {key!r} to {queue!r} is still unconfirmed "
                    "under another producer id, and could land after this one: publish it "
                    f"once {key!r} has left settling_keys()"
                )

    def _check_room(self, rows: list[list[Any]]) -> None:
        """`TooManyUnconfirmedError` for a publish past the session's limits (one
        publish alone always fits: the node's --max-body bounds it)."""
        if len(self._unconfirmed) >= self.max_unconfirmed:
            raise TooManyUnconfirmedError(
                f"not sent: {len(self._unconfirmed)} publishes are unconfirmed, the "
                f"client's limit (max_unconfirmed={self.max_unconfirmed}); the key is not "
                "paused: wait for confirms and publish it again, or raise max_unconfirmed"
            )
        size = _at_least(rows)
        if self._unconfirmed and self._unconfirmed_bytes + size > self.max_unconfirmed_bytes:
            raise TooManyUnconfirmedError(
                f"not sent: {self._unconfirmed_bytes} bytes of publishes are unconfirmed, "
                f"and {size} more would pass the client's limit (max_unconfirmed_bytes="
                f"{self.max_unconfirmed_bytes}); the key is not paused: wait for confirms "
                "and publish it again, or raise max_unconfirmed_bytes"
            )

    def _drop_unconfirmed(self, request_id: int) -> dict[str, Any] | None:
        """No longer live (answered, or certainly never to land)."""
        frame = self._unconfirmed.pop(request_id, None)
        self._chosen.discard(request_id)
        if frame is None:
            return None
        self._unconfirmed_bytes -= _size_of(frame)
        for key in keys_of(frame):
            where = (frame["queue"], key)
            producers = self._live[where]
            producers[frame["producer"]] -= 1
            if not producers[frame["producer"]]:
                del producers[frame["producer"]]
                if not producers:
                    del self._live[where]
        return frame

    def _check_fits(self, rows: list[list[Any]], frame: Callable[[], dict[str, Any]]) -> None:
        """`too_large` now for a publish ([body, key, headers] `rows`) the node would
        refuse, or drop the connection over (a frame past its limit), whatever the
        retries. As any failed publish, it pauses its keys."""
        try:
            self._check_sizes(rows, frame)
        except ServerError:
            for _, key, _ in rows:
                self.producer.failed(key)
            raise

    def _check_sizes(self, rows: list[list[Any]], frame: Callable[[], dict[str, Any]]) -> None:
        if self.max_body is not None:
            for body, _, _ in rows:
                if len(body) > self.max_body:
                    raise ServerError(
                        "too_large",
                        f"message body of {len(body)} bytes exceeds the node's limit of "
                        f"{self.max_body}",
                    )
        limit = self.max_frame
        if limit is not None and _at_least(rows) + 256 + 64 * len(rows) > limit:
            size = len(encode_frame(frame()))
            if size > limit:
                raise ServerError(
                    "too_large", f"a frame of {size} bytes exceeds the node's limit of {limit}"
                )

    def _publish_answered(
        self, request_id: int, publish: dict[str, Any], frame: dict[str, Any]
    ) -> list[Event]:
        """A publish's answer. A refusal is one of: retriable (resend the queue's live
        publishes, after `REWIND_DELAY`); out of order behind an earlier live publish
        (resend it after that one); certain (the publish never lands: "not published");
        or the refusal of a resend that settles nothing (outcome unknown)."""
        newer = self._attempts.get(request_id, 1) - 1  # attempts still out after this one
        if newer > 0:
            self._attempts[request_id] = newer
        else:
            self._attempts.pop(request_id, None)
        if frame["t"] == "reply":
            self._settled(request_id)
            events: list[Event] = [Resolved(request_id, frame)]
            queue = publish["queue"]
            self._parked_delay.pop(queue, None)  # the queue takes publishes again
            events += self._release_parked(queue)
            return events
        code, message = frame["code"], frame["message"]
        if code in RETRIABLE:
            return [] if newer else self._rewind_later(publish["queue"])
        expected = frame.get("expected_seq")
        certain = request_id not in self._resent  # this attempt was the only one
        if code == "producer_forgotten":
            # The queue forgot producers of this id's generation: new ids go above it.
            # A first attempt certainly did not land (below); an earlier attempt of a
            # resend may have, before the queue forgot the id, and none can any more.
            generation = frame.get("generation")
            self.producer.above(generation if isinstance(generation, int) else 0)
            if not certain:
                return self._forgotten(request_id, publish)
        if code == "producer_sealed" and not certain:
            # the job that made the id committed: no attempt lands from now on (an
            # earlier one may have landed before the seal)
            return self._forgotten(request_id, publish)
        if code == "over_max_length":
            certain = True  # no attempt of it could ever fit the queue
        if code == "out_of_order" and publish.get("seqs") is not None:
            # A numbered batch is refused so only by a queue that does not know its
            # producer (new and not opened by it, or forgotten): never behind another
            # publish of ours. An earlier attempt may have landed before the queue
            # forgot the producer; this one never will.
            if not certain:
                return self._forgotten(request_id, publish)
        elif code == "out_of_order" and isinstance(expected, int):
            earlier = self._live_covering(publish, expected)
            if earlier in self._parked:  # it is sent again on the next connection, and so
                self._parked.add(request_id)  # is this one (or on this one, after it)
                if earlier in self._retry_parked:
                    self._retry_parked.add(request_id)
                return []
            if earlier is not None:
                return [] if newer else self._rewind_later(publish["queue"])
            if expected == 0 and request_id not in self._chosen:
                return self._forgotten(request_id, publish)
            # The queue waits for a sequence number that no live publish holds, and this
            # client never sends it again: no attempt of this one can land any more. (A
            # caller that chose its producer id replays with the same numbers.)
            certain = True
        if certain:
            self._settled(request_id)
            self._keys_failed([publish])
            refusal = Failed(request_id, ServerError(code, message))
            return [refusal, *self._give_up_after(publish)]
        # A resend refused (by a node with a smaller --max-body, say, or a queue full
        # for now): an earlier attempt may have landed, or may still be in the Raft
        # pipeline. Not "not published": the publish stays live, sent again on the next
        # connection, so the key settles once a node answers it. Later publishes of the
        # same producer stay live too, each settled by its own answer (if this one did
        # not land, theirs is out_of_order behind it). New ones take a fresh producer id.
        self._parked.add(request_id)
        self._keys_failed([publish])
        self._retire(publish)
        retry: list[Event] = []
        if code in PASSING_REFUSALS:
            self._retry_parked.add(request_id)
            retry = self._retry_parked_later(publish["queue"], steady=code == "disk_alarm")
        if request_id in self._told_unknown:
            return retry
        self._told_unknown.add(request_id)
        return [
            *retry,
            Failed(
                request_id,
                OutcomeUnknownError(
                    f"a resend was refused ({code}: {message}), but an earlier attempt may "
                    "have landed or may yet: the publish stays live (sent again after the "
                    "next reconnect) and lands at most once; do not publish it again"
                ),
            ),
        ]

    def _forgotten(self, request_id: int, publish: dict[str, Any]) -> list[Event]:
        """The queue forgot this publish's producer id (`forget_producers`, or an hour of
        silence when it needed room): it expects sequence number 0, whose publish it
        took, or it refuses the id's generation (`producer_forgotten`). An earlier
        attempt may have landed before that; none can any more (the id is retired)."""
        self._settled(request_id)
        self._keys_failed([publish])
        self._retire(publish)
        error = OutcomeUnknownError(
            f"the queue forgot the producer id {publish['producer']!r} of {publish['queue']!r}: an "
            "earlier attempt may have landed before it did, and none can any more; do "
            "not publish it again before a read tells whether it landed"
        )
        return [Failed(request_id, error)]

    def _parked_heads(self, queue: str) -> set[int]:
        """Per producer, its earliest publish to `queue` parked after a refusal for now
        (the rest would be refused behind it)."""
        heads: dict[str, int] = {}
        for r in sorted(self._retry_parked):
            frame = self._unconfirmed[r]
            if frame["queue"] == queue:
                heads.setdefault(frame["producer"], r)
        return set(heads.values())

    def _release_parked(self, queue: str) -> list[Event]:
        """The queue confirmed a publish: it takes publishes again, so each producer's
        earliest parked publish is sent again at once (its confirm sends the next). One
        a second apart, 72 publishes parked by a disk alarm of 3 s took 72 s to land
        after it cleared (the simulator's seed 1); all at once, each confirm of a queue
        full for now sent every parked publish again, to be refused again, a log entry
        each (a review: 251,500 proposals for 1,000 parked publishes)."""
        due = self._parked_heads(queue)
        if not due:
            return []
        self._parked -= due
        self._retry_parked -= due
        return [Send(frame) for frame in self.unconfirmed(queue, due)]

    def _retry_parked_later(self, queue: str, *, steady: bool = False) -> list[Event]:
        """The parked publishes' next try (`steady`: a disk alarm, which clears within
        seconds of the space coming back: tried every `PARKED_RETRY_DELAY`, not backing
        off to `PARKED_RETRY_LONGEST`, so publishers resume as soon as it clears)."""
        if queue in self._parked_retry:
            return []
        self._parked_retry.add(queue)
        delay = PARKED_RETRY_DELAY if steady else self._parked_delay.get(queue, PARKED_RETRY_DELAY)
        self._parked_delay[queue] = min(2 * delay, PARKED_RETRY_LONGEST)
        return [RewindLater(queue, delay)]

    def _rewind_later(self, queue: str) -> list[Event]:
        if queue in self._rewinding:
            return []
        self._rewinding.add(queue)
        return [RewindLater(queue)]

    def _live_covering(self, publish: dict[str, Any], seq: int) -> int | None:
        """The live publish of `publish`'s queue and producer that holds sequence `seq`."""
        for request_id, f in self._unconfirmed.items():
            if f["queue"] != publish["queue"] or f["producer"] != publish["producer"]:
                continue
            if seq in _numbers(f):
                return request_id
        return None

    def _settled(self, request_id: int) -> None:
        """`request_id` is answered for good: no longer pending, live or resent."""
        self._pending.discard(request_id)
        self._drop_unconfirmed(request_id)
        self._resent.discard(request_id)
        self._parked.discard(request_id)
        self._retry_parked.discard(request_id)
        self._told_unknown.discard(request_id)
        self._attempts.pop(request_id, None)

    def _keys_failed(self, frames: Iterable[dict[str, Any]]) -> None:
        for f in frames:
            for key in keys_of(f):
                self.producer.failed(key)

    def _retire(self, publish: dict[str, Any]) -> None:
        """After a refusal, this client's publishes to the queue take a fresh producer id
        (the queue expects the refused sequence number next from the old one)."""
        if self.producer.current(publish["queue"]) == publish["producer"]:
            self.producer.renew(publish["queue"])

    def _give_up_after(self, publish: dict[str, Any]) -> list[Event]:
        """`publish` never lands: nor does any later one of its producer (the queue takes
        a producer's sequence numbers in order). Those are not live any more."""
        self._retire(publish)  # earlier ones still out under the old id hold their keys
        if publish.get("seqs") is not None:
            return []  # the queue takes a batch numbered by its caller whatever came before
        queue, producer, seq = publish["queue"], publish["producer"], _numbers(publish)[0]
        events: list[Event] = []
        for request_id, frame in list(self._unconfirmed.items()):
            if (
                frame["queue"] == queue
                and frame["producer"] == producer
                and frame.get("seqs") is None
                and _numbers(frame)[0] > seq
            ):
                self._settled(request_id)
                self._keys_failed([frame])
                error = RefusedBeforeError(
                    f"not published: an earlier publish to {queue!r} under the same producer "
                    "id was refused, and the queue takes that id's sequence numbers in order"
                )
                events.append(Failed(request_id, error))
        return events
