"""The workload: applications that publish and consume through real clients.

Producers publish unique records (body `producer:n`, some with an ordering key) in
batches through a `SimClient` (the real `ClientSession`): idempotent, resent after a
retriable failure or a reconnect, paused keys after an outcome unknown. Consumers are
attached to nodes (consumer `i` prefers node `i mod n`), subscribe with a prefetch,
ack what they receive after a processing delay (some are slow), sometimes nack with
requeue (with `retry_backoff_ms`, half those nacks leave the delay to the queue's
backoff and half give their own `delay_ms`); their client subscribes them again after a
reconnect or a `node_down`; what they held comes back to the queue through `Down` or
`NodeDown`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from quorumq.client.core import (
    Delivery,
    OutcomeUnknownError,
    QuorumqError,
    RefusedBeforeError,
    ServerError,
)
from quorumq.machine import ErrorCode, QueueOptions

from .clients import SimClient
from .names import DEAD_LETTER_QUEUE, QUEUE
from .world import micros

if TYPE_CHECKING:
    from .checker import Checker
    from .cluster import Cluster

ALARM_RETRIES = 60
"""At most this many batches after the heal (30 s of them): an alarm that never clears
shows as a liveness failure, not as a producer publishing to the run's end."""
ALARM_RETRY_S = 0.5
"""After the heal, a producer whose batch a disk alarm refused sends another this long
after (an alarm clears within a second or two of the space coming back)."""
QUEUE_OPTIONS = QueueOptions(retention_messages=1000)
"""The stream view keeps only the newest messages: the state (and its digest) stays small."""


@attrs.frozen(kw_only=True)
class WorkloadConfig:
    producers: int = 3
    consumers: int = 4
    rate: float = 150.0
    """Records per second, all producers together, while faults run."""
    max_batch: int = 5
    keys: int = 6
    """Distinct ordering keys; a third of the records have none."""
    prefetch: int = 8
    ack_delay_s: tuple[float, float] = (0.001, 0.03)
    slow_ack_delay_s: tuple[float, float] = (0.2, 1.5)
    slow_share: float = 0.25
    """Share of the consumers that are slow."""
    nack_p: float = 0.03
    request_timeout_s: float = 2.0
    reconnect_s: tuple[float, float] = (0.05, 0.5)
    message_ttl_ms: int | None = None
    """The queue's message TTL: a record may expire (it is then dropped, not lost), never
    before that much true time has passed since it was published (`early_expiry`)."""
    max_length: int | None = None
    """At most this many ready records: the oldest are dropped (`overflow="drop-head"`)
    or publishes refused (`"reject-publish"`): dropped or refused, never lost."""
    overflow: str = "drop-head"
    delivery_limit: int | None = None
    """A record returned this many times is dropped, or dead-lettered (`dead_letter`)."""
    dead_letter: bool = False
    """Dead-letter to `DEAD_LETTER_QUEUE` what expires or goes over its delivery limit
    (what max_length pushes out is dropped, not dead-lettered)."""
    single_active_consumer: bool = False
    """One consumer at a time receives the queue (the others wait, in order)."""
    consumer_timeout_ms: int | None = None
    """A consumer holding a record longer than this (queue time) is removed and what it
    held returns (the workload's slow consumers ack after up to 1.5 s)."""
    bursts: tuple[float, float] | None = None
    """(busy, idle) seconds: producers publish for `busy`, then nothing for `idle`, in
    turn from the start, so that faults also strike a quiet cluster (`quiescence`);
    None: they publish throughout."""
    retry_backoff_ms: tuple[int, int] | None = None
    """The queue's retry backoff (min, max): a returned record waits, doubling per
    failure. Consumers then nack with a delay of their own (up to max) half the time,
    and the checker holds every redelivery to its delay (`retry_early`)."""

    def queue_options(self) -> QueueOptions:
        """The workload queue's options (clear errors for bad values come from here)."""
        return attrs.evolve(
            QUEUE_OPTIONS,
            message_ttl_ms=self.message_ttl_ms,
            max_length=self.max_length,
            overflow=self.overflow,  # type: ignore[arg-type]
            delivery_limit=self.delivery_limit,
            dead_letter_queue=DEAD_LETTER_QUEUE if self.dead_letter else None,
            single_active_consumer=self.single_active_consumer,
            consumer_timeout_ms=self.consumer_timeout_ms,
            retry_backoff_ms=self.retry_backoff_ms,
        )

    def queue_option_flags(self) -> str:
        """The command-line options that give these queue options (for `replay`)."""
        flags = ""
        if self.message_ttl_ms is not None:
            flags += f" --ttl {self.message_ttl_ms}"
        if self.max_length is not None:
            flags += f" --max-length {self.max_length} --overflow {self.overflow}"
        if self.delivery_limit is not None:
            flags += f" --delivery-limit {self.delivery_limit}"
        if self.dead_letter:
            flags += " --dead-letter"
        if self.single_active_consumer:
            flags += " --single-active-consumer"
        if self.consumer_timeout_ms is not None:
            flags += f" --consumer-timeout {self.consumer_timeout_ms}"
        if self.retry_backoff_ms is not None:
            flags += " --retry-backoff {}:{}".format(*self.retry_backoff_ms)
        return flags


# ------------------------------------------------------------------ producers


@attrs.define
class Batch:
    records: list[tuple[bytes, str | None]]
    sent_us: int = 0


class SimProducer:
    """An application that publishes unique records (body `producer:n`), in batches,
    through a real client (`SimClient`). After an outcome unknown it publishes nothing
    more of that key until the key has settled, then resumes it (the client's contract);
    a key paused by a refusal is resumed at once (a refusal is a violation anyway)."""

    def __init__(self, cluster: Cluster, checker: Checker, config: WorkloadConfig, i: int) -> None:
        self.cluster = cluster
        self.world = cluster.world
        self.checker = checker
        self.config = config
        self.random = cluster.client_random
        self.id = f"p{i}"
        self.next_n = 0
        self.producing = True
        self._alarm_refused = False
        """A disk alarm refused a publish since the last confirm."""
        self._alarm_retries = 0
        self._alarm_retry_due = False
        """One batch after an alarm is due (one at a time, whatever refused how many)."""
        self.client = SimClient(
            cluster,
            request_timeout_s=config.request_timeout_s,
            reconnect_s=config.reconnect_s,
        )

    def start(self) -> None:
        self._schedule_emit()

    @property
    def unconfirmed(self) -> bool:
        """Publishes still live in the client: unconfirmed, being resent."""
        return bool(self.client.session._unconfirmed)

    def _schedule_emit(self) -> None:
        if self.config.rate <= 0:
            return
        per_producer = self.config.rate / self.config.producers
        mean_batch = (1 + self.config.max_batch) / 2
        interval = mean_batch / per_producer
        self.world.after(micros(self.random.uniform(0.5, 1.5) * interval), self._emit)

    def _key(self) -> str | None:
        session = self.client.session
        k = self.random.randrange(self.config.keys * 3 // 2 or 1)
        key = f"k{k}" if k < self.config.keys else None
        if key is not None and key in session.producer.paused:
            if key in session.settling_keys():
                return None  # its outcome-unknown publish may still land: not this key now
            session.resume(key)
        return key

    def _emit(self) -> None:
        if not self.producing:
            return
        idle_until = self._idle_until_us()
        if idle_until is not None:
            self.world.at(idle_until, self._emit)
            return
        self._schedule_emit()
        self._publish_batch()

    def _idle_until_us(self) -> int | None:
        """The end of the idle part of the burst under way (None: a busy part)."""
        if self.config.bursts is None:
            return None
        busy_us, idle_us = (micros(s) for s in self.config.bursts)
        phase = self.world.now_us % (busy_us + idle_us)
        return None if phase < busy_us else self.world.now_us + busy_us + idle_us - phase

    def last_batch(self) -> None:
        """Stop producing after one more batch, sent now (at the heal: a publish is then
        in flight, and the liveness check wants it confirmed within a bound)."""
        if self.producing and self.config.rate > 0:
            self._publish_batch()
        self.producing = False

    def _publish_batch(self) -> None:
        count = self.random.randint(1, self.config.max_batch)
        records = []
        for _ in range(count):
            body = f"{self.id}:{self.next_n}".encode()
            self.next_n += 1
            records.append((body, self._key()))
        rows = [[body, key, None] for body, key in records]
        try:
            self.client.publish_batch(
                QUEUE, rows, lambda frame, error: self._answered(records, frame, error)
            )
        except QuorumqError:
            # refused before sending (too many unconfirmed, a key behind): not made
            self._again_after_alarm()
            return
        for body, key in records:
            self.checker.published(body, key)

    def _answered(
        self, records: list[tuple[bytes, str | None]], frame: dict[str, Any] | None, error: Any
    ) -> None:
        """A batch's outcome; after an outcome unknown, maybe its late answer too."""
        if frame is not None:
            self._alarm_refused = False
            first = frame.get("offset")
            for i, (body, _) in enumerate(records):
                self.checker.confirmed(body, None if first is None else first + i)
        elif isinstance(error, OutcomeUnknownError):
            for body, _ in records:
                self.checker.outcome_unknown(body)
            if "disk_alarm" in str(error) and self._alarm_may_be_raised():  # may land later
                self._alarm_refused = True
            self._again_after_alarm()
        else:
            full = isinstance(error, ServerError) and error.code in (
                ErrorCode.QUEUE_FULL,
                ErrorCode.OVER_MAX_LENGTH,
            )
            behind = isinstance(error, RefusedBeforeError)  # a full queue refused one before
            expected = (full or behind) and self.config.overflow == "reject-publish"
            alarm = (
                isinstance(error, ServerError)
                and error.code == ErrorCode.DISK_ALARM
                and self._alarm_may_be_raised()
            )  # (one with no space fault near is a violation: an alarm raised or kept wrongly)
            if alarm:
                self._alarm_refused = True
            # publishes sent behind one a disk alarm refused are refused too (the queue
            # takes a producer's numbers in order)
            expected = expected or alarm or (behind and self._alarm_refused)
            for body, _ in records:
                self.checker.refused(body, str(error), expected=expected)
            self._again_after_alarm()

    def _alarm_may_be_raised(self) -> bool:
        """Whether a disk alarm may be in the log now: a host's disk space fault has
        run in this run. An alarm raised stays in the log until a clear commits, which
        takes a leader and a majority (CI seed 127: B's space came back, and no leader
        could commit its clear before the heal), or until its node is marked down. So a
        refusal for an alarm is a violation only if no space fault ever ran; an alarm
        that does not clear after the heal fails the liveness check instead (each
        producer publishes until one is confirmed, `_again_after_alarm`)."""
        return self.cluster.space_fault_ran

    def _again_after_alarm(self) -> None:
        """After the heal, a batch a disk alarm kept from landing (refused by it, behind
        publishes it parked, or a resend it refused whose outcome is now unknown) is
        followed by another a moment later, as an
        application told "publishes wait" does: the liveness check wants a confirm
        after the heal, and the last batch met an alarm not cleared yet."""
        if (
            self._alarm_refused
            and not self.producing
            and not self._alarm_retry_due
            and self._alarm_retries < ALARM_RETRIES
        ):
            self._alarm_retries += 1
            self._alarm_retry_due = True
            self.world.after(micros(ALARM_RETRY_S), self._publish_after_alarm)

    def _publish_after_alarm(self) -> None:
        self._alarm_retry_due = False
        self._publish_batch()


# ------------------------------------------------------------------ consumers


class SimConsumer:
    """One consumer slot: an application process with a real client, subscribed to the
    queue, acking what it receives after a processing delay (some are slow), sometimes
    nacking. The client subscribes it again by itself (a reconnect, its node cut off);
    when its process dies (`die`), a new one takes the slot a little later."""

    def __init__(self, cluster: Cluster, checker: Checker, config: WorkloadConfig, i: int) -> None:
        self.cluster = cluster
        self.world = cluster.world
        self.checker = checker
        self.config = config
        self.random = cluster.client_random
        self.slot = i
        self.home = cluster.names[i % len(cluster.names)]
        self.slow = self.random.random() < config.slow_share
        self.client: SimClient | None = None
        self.sub: _Subscription | None = None

    def start(self) -> None:
        self._start_process()

    def _start_process(self) -> None:
        self.client = SimClient(
            self.cluster,
            preferred=self.home,
            request_timeout_s=self.config.request_timeout_s,
            reconnect_s=self.config.reconnect_s,
        )
        self.sub = _Subscription(self, self.client)
        self.client.subscribe(self.sub)

    @property
    def id(self) -> str | None:
        return self.sub.id if self.sub is not None else None

    def die(self) -> bool:
        """Fault: the consumer's process dies; a new one starts a little later. False if
        there was no live subscription to kill."""
        if self.client is None or self.sub is None or not self.sub.id:
            return False
        self.client.close()
        self.client = self.sub = None
        self.world.after(micros(self.random.uniform(0.2, 2.0)), self._start_process)
        return True

    def ended(self, sub: _Subscription, reason: str) -> None:
        """The subscription ended (not by the application): subscribe again, as an
        application whose consumer was cancelled would."""
        if sub is not self.sub or self.client is None:
            return
        self.sub = _Subscription(self, self.client)
        delay = micros(self.random.uniform(*self.config.reconnect_s))
        self.world.after(delay, self.client.subscribe, self.sub)


class _Subscription:
    """What the client's session knows as a consumer (`ConsumerLike`)."""

    def __init__(self, slot: SimConsumer, client: SimClient) -> None:
        self.slot = slot
        self.client = client
        self.queue = QUEUE
        self.prefetch = slot.config.prefetch
        self.id = ""
        self.cancel_requested = False

    def subscribed(self) -> None:
        self.slot.checker.subscribed(self.id, "")

    def delivered(self, delivery: Delivery) -> None:
        slot = self.slot
        slot.checker.received(delivery, delivery.node)
        delay = slot.config.slow_ack_delay_s if slot.slow else slot.config.ack_delay_s
        slot.world.after(micros(slot.random.uniform(*delay)), self._settle, delivery)

    def _settle(self, delivery: Delivery) -> None:
        if self.slot.sub is not self or self.client.closed:
            return
        slot = self.slot
        if slot.random.random() < slot.config.nack_p:
            backoff = slot.config.retry_backoff_ms
            if backoff is not None and slot.random.random() < 0.5:
                delivery.nack(delay_ms=slot.random.randint(0, backoff[1]))
            else:
                delivery.nack()
        else:
            delivery.ack()

    def ended(self, reason: str) -> None:
        self.slot.ended(self, reason)


def declare(
    cluster: Cluster,
    options: QueueOptions = QUEUE_OPTIONS,
    *,
    first: Sequence[str] = (),
    then: Sequence[str] = (),
) -> SimClient:
    """Declare the workload's queue (and first its dead-letter queue, if it has one)
    through a client, each tried again until it answers; before them, the queues
    `first`, after them the queues `then` (default options), in order."""
    client = SimClient(cluster)
    queues = [(QUEUE, options)]
    if options.dead_letter_queue is not None:
        queues.insert(0, (options.dead_letter_queue, QueueOptions()))  # keeps them all
    queues = [*((n, QueueOptions()) for n in first), *queues, *((n, QueueOptions()) for n in then)]

    def attempt() -> None:
        name, queue_options = queues[0]
        client.declare(name, attrs.asdict(queue_options), answered)

    def answered(frame: dict[str, Any] | None, error: Any) -> None:
        if frame is not None:
            queues.pop(0)
        if not queues:
            client.close()
        else:
            cluster.world.after(micros(0.1 if frame is None else 0), attempt)

    cluster.world.after(micros(0.05), attempt)
    return client


def start_workload(cluster: Cluster, checker: Checker, config: WorkloadConfig) -> list[Any]:
    producers = [SimProducer(cluster, checker, config, i) for i in range(config.producers)]
    consumers = [SimConsumer(cluster, checker, config, i) for i in range(config.consumers)]
    for c in [*consumers, *producers]:
        c.start()
    return [*producers, *consumers]
