"""What the run's checks share: the records, the violations, and the checker's state
(`CheckerState`); and the replica-side checks (`ReplicaChecks`): every applied command
modelled (what each consumer holds, what expired, what was delivered and settled),
wall clocks and stamps, commits that must never be lost, snapshots loaded, leaders."""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

from quorumq.machine import (
    Ack,
    Applied,
    Cancel,
    Command,
    ConsumerDown,
    DeadLettered,
    Deliver,
    Dropped,
    Enqueue,
    EnqueueBatch,
    Enqueued,
    Nack,
    Ok,
    Subscribe,
)
from quorumq.raft.cluster_identity import FOREIGN_STOP

from .names import QUEUE
from .world import WALL_EPOCH_MS, World, seconds

TIME_BOUND_MS = 2
"""How far one term's leader may move queue time past its true elapsed time: none, but
for the truncation of its monotonic clock to milliseconds."""

if TYPE_CHECKING:
    from .node import SimNode

MAX_VIOLATIONS_KEPT = 50
MEMBERSHIP_ENTRY = b"\x02"
"""The first byte of PySyncObj's configuration-change log entries."""


@attrs.frozen
class Violation:
    at_s: float
    kind: str
    detail: str


@attrs.define
class Record:
    key: str | None
    confirmed: bool = False
    refused: bool = False
    received: int = 0
    received_unmarked: int = 0
    offsets: set[int] = attrs.field(factory=set)
    acked: bool = False
    dropped: bool = False
    """The queue dropped or dead-lettered it (its options say so): not lost."""
    dead_lettered: bool = False
    unknown: bool = False
    published_ms: int = 0
    """True time (simulated ms) when its producer made it."""


class CommittedEntries:
    """What every node holds committed agrees (`log`): per log index, the CRC of the
    entry first seen committed there; per run of a node, how far its log is checked."""

    def __init__(self, violation: Callable[[str, str], None], what: str = "") -> None:
        """`what`: which log, in a violation's words (" of group 2")."""
        self._violation = violation
        self._what = what
        self.crc: dict[int, int] = {}
        self._checked_through: dict[tuple[str, int], int] = {}

    def check(self, run: tuple[str, int], name: str, log: Any, commit: int) -> None:
        """The entries node run `run` (name, incarnation) holds committed, up to `commit`,
        are those first seen committed at their index."""
        start = self._checked_through.get(run, 0)
        if commit <= start or not len(log):
            return
        first, last = log[0][1], log[-1][1]
        committed_crc = self.crc
        for index in range(max(start + 1, first), min(commit, last) + 1):
            crc = zlib.crc32(log[index - first][0])
            known = committed_crc.setdefault(index, crc)
            if known != crc:
                self._violation(
                    "log", f"{name} holds another entry committed at index {index}{self._what}"
                )
        self._checked_through[run] = commit


class CheckerState:
    """The checker's state and its violations (see `checker`)."""

    def __init__(
        self,
        world: World,
        *,
        digest_every: int = 500,
        message_ttl_ms: int | None = None,
        single_active: bool = False,
        retry_backoff_ms: tuple[int, int] | None = None,
    ) -> None:
        self.world = world
        self.message_ttl_ms = message_ttl_ms
        self.single_active = single_active
        self.retry_backoff_ms = retry_backoff_ms
        self.failures: dict[int, int] = {}
        """Per offset of the queue: its failed deliveries so far (the last `delivery_count`
        delivered, plus the failures since)."""
        self.retry_due: dict[int, int] = {}
        """Per offset returned with a delay: the queue time before which it may not go."""
        self.retries_held = 0
        """Redeliveries that waited for a retry delay (the workload exercised it)."""
        self.digest_every = digest_every
        self.records: dict[bytes, Record] = {}
        self.violations: list[Violation] = []
        self.violation_count = 0
        self.confirm_times_s: list[float] = []
        """When each record was first confirmed (for `pauses`)."""
        self.first_delivery_times_s: list[float] = []
        """When each record was first received."""
        self.log_crc: dict[int, int] = {}
        self.digests: dict[int, str] = {}
        self.digests_compared = 0
        # the model, in log order
        self.holder: dict[int, str] = {}
        self.held_by: dict[str, dict[int, None]] = {}
        self.prefetch: dict[str, int] = {}
        self.delivered_ever: set[int] = set()
        self.settled: set[int] = set()
        self.last_unkeyed_first: dict[str, int] = {}
        self.last_key_first: dict[str, int] = {}
        self.body_of: dict[int, bytes] = {}
        self.key_of: dict[int, str | None] = {}
        self.deliveries = 0
        self.redeliveries = 0
        self.made: dict[tuple[str, int, int, bool], int] = {}
        """Per delivery (consumer, offset, count, mark): how many times the log made it."""
        self.got: dict[tuple[str, int, int, bool], int] = {}
        """Per delivery: how many times its consumer received it."""
        self.stamped_at: dict[int, int] = {}
        """Per time a leader stamped: the true time (ms) when it first did."""
        self.refused_starts = 0
        self.fatal_stops = 0
        self.max_term = 0
        self.genesis_ahead_ms: int | None = None
        """How far ahead of true time queue time started (the first leader's wall clock)."""
        self.time_ahead_ms = 0
        """The furthest any machine's clock got ahead of true time, beyond genesis."""
        self.committed = 0
        """The highest commit index any node has reached."""
        self.committed_entries = CommittedEntries(self.violation)
        self._log_seen: dict[tuple[str, int], tuple[int, int, Any]] = {}
        """Per run of a node: its commit index, log length and last entry when last
        checked (a tick that changed none of them has nothing new to check)."""
        self.config_changes: Counter[str] = Counter()
        """Configuration changes leaders accepted (appended) and refused."""
        self.cluster_identity: str | None = None
        """The identity the first node that knew one knew (`identity`)."""
        self._identities_reported: set[tuple[str, str]] = set()
        self._config_overlaps: set[tuple[str, tuple[int, ...]]] = set()
        self.subscribers: dict[str, bool] = {}
        """The queue's consumers in subscription order, and whether each was cancelled:
        with a single active consumer, the first not cancelled (or still holding) is
        the active one (the machine's rule, `QueueState.active_consumer`)."""
        self.landed: set[bytes] = set()
        """Bodies the log took (a refused one must not be among them: `phantom`)."""
        self.dead_lettered_at: dict[tuple[str, int], bytes] = {}
        """(target queue, offset) -> the body dead-lettered there (checked at the end)."""
        self.consumers_removed: Counter[str] = Counter()
        """Consumers the log removed, by reason (`consumer_timeout`, `down`, ...)."""

    def violation(self, kind: str, detail: str) -> None:
        self.violation_count += 1
        if len(self.violations) < MAX_VIOLATIONS_KEPT:
            self.violations.append(Violation(seconds(self.world.now_us), kind, detail))
        self.world.trace(f"violation {kind} {detail}")


class ReplicaChecks(CheckerState):
    """The checks of what the replicas apply (see the module's docstring)."""

    def on_applied(
        self, node: SimNode, index: int, crc: int, command: Command, applied: Applied
    ) -> None:
        known = self.log_crc.get(index)
        if known is None:
            self.log_crc[index] = crc
            self._model(command, applied, node.machine.now_ms)
        elif known != crc:
            self.violation("log", f"{node.name} applied another command at index {index}")
        self._check_time(node)
        if index % self.digest_every == 0:
            digest = node.machine.digest()
            first = self.digests.setdefault(index, digest)
            self.digests_compared += 1
            if first != digest:
                self.violation("digest", f"{node.name}'s state at index {index} differs")

    def _check_time(self, node: SimNode) -> None:
        self.max_term = max(self.max_term, node.member.raftCurrentTerm)
        stamped_at = self.stamped_at.get(node.machine.now_ms)
        if stamped_at is None:
            return  # nothing stamped yet
        ahead = node.machine.now_ms - (WALL_EPOCH_MS + stamped_at)
        if self.genesis_ahead_ms is None:
            self.genesis_ahead_ms = ahead
        ahead -= self.genesis_ahead_ms
        if ahead > self.time_ahead_ms:
            self.time_ahead_ms = ahead
            if ahead > TIME_BOUND_MS * (self.max_term + 1):
                self.violation(
                    "time_ahead",
                    f"{node.name}'s queue time is {ahead} ms further ahead of true time "
                    f"than at genesis, after {self.max_term} terms",
                )

    def on_leadership(self, node: SimNode, leader: bool) -> None:
        pass

    def on_stamp(self, ts_ms: int) -> None:
        self.stamped_at.setdefault(ts_ms, self.world.now_ms)

    def on_failure_command(self, node: SimNode, command: Any) -> None:
        pass

    def on_node(self, name: str, running: bool) -> None:
        pass

    def on_change_cluster(self, node: SimNode, request: Any, accepted: bool) -> None:
        self.config_changes["accepted" if accepted else "refused"] += 1

    def on_ticked(self, node: SimNode) -> None:
        """Committed entries agree (`log`); no log holds two configuration changes past
        the commit index (`config`)."""
        member = node.member
        identity = member.cluster_identity
        if identity is not None and identity != self.cluster_identity:
            self._check_identity(node.name, identity)
        log = member.journal
        length, commit = len(log), member.raftCommitIndex
        seen = (commit, length, log[length - 1] if length else None)
        run = (node.name, node.incarnation)
        if self._log_seen.get(run) == seen:
            return  # (the global commit index only moves on: no new overlap to find)
        self._log_seen[run] = seen
        self.committed = committed = max(self.committed, commit)
        self.committed_entries.check(run, node.name, log, commit)
        changes = []
        for pos in range(length - 1, -1, -1):
            command, index, _ = log[pos]
            if index <= committed:
                break
            if command[:1] == MEMBERSHIP_ENTRY:
                changes.append(index)
        if len(changes) > 1:
            key = (node.name, tuple(changes))
            if key not in self._config_overlaps:
                self._config_overlaps.add(key)
                self.violation(
                    "config",
                    f"{node.name}'s log holds {len(changes)} uncommitted configuration "
                    f"changes (at {sorted(changes)}; committed up to {committed})",
                )

    def _check_identity(self, name: str, identity: str) -> None:
        """Every node of the run's one cluster knows the same identity, once it knows
        one (`identity`)."""
        if self.cluster_identity is None:
            self.cluster_identity = identity
        elif (name, identity) not in self._identities_reported:
            self._identities_reported.add((name, identity))
            self.violation(
                "identity",
                f"{name} knows cluster identity {identity}, another node {self.cluster_identity}",
            )

    def on_refused(self, name: str, reason: str) -> None:
        """A node refused to start from a damaged disk: what it must do (never a cut)."""
        self.refused_starts += 1

    def on_fatal(self, name: str, reason: str) -> None:
        """A node stopped itself: a journal write or sync failed (never because it took
        its own cluster for another: `foreign`)."""
        self.fatal_stops += 1
        if reason.startswith(FOREIGN_STOP):
            self.violation("foreign", f"{name} stopped as of another cluster: {reason}")

    def on_snapshot_loaded(self, node: SimNode, applied: int, index: int) -> None:
        if index < applied:
            self.violation(
                "rollback",
                f"{node.name} loaded a snapshot at index {index} after applying up to "
                f"{applied}: it applies entries again",
            )

    def _release(self, offset: int) -> None:
        consumer = self.holder.pop(offset, None)
        if consumer is not None:
            self.held_by[consumer].pop(offset, None)

    def _return_key_tails(self, consumer: str, offsets: tuple[int, ...]) -> None:
        """A returned keyed message takes the key's later messages held by the same
        consumer back with it (so the key is redelivered in order)."""
        held = self.held_by.get(consumer, {})
        for offset in offsets:
            key = self.key_of.get(offset)
            if key is not None:
                for later in [o for o in held if o > offset and self.key_of.get(o) == key]:
                    self._release(later)

    def _model(self, command: Command, applied: Applied, now_ms: int) -> None:
        reply = applied.reply
        if (
            isinstance(command, Enqueue | EnqueueBatch)
            and isinstance(reply, Enqueued)
            and not reply.duplicate
            and reply.offset is not None
        ):
            bodies = (
                [command.body]
                if isinstance(command, Enqueue)
                else [m.body for m in command.messages]
            )
            for i, body in enumerate(bodies):
                self.body_of[reply.offset + i] = body
                self.landed.add(body)
                record = self.records.get(body)
                if record is not None and record.refused:
                    self.violation(
                        "phantom",
                        f"{body!r} was reported not published to its producer, and landed",
                    )
        if isinstance(command, Subscribe) and isinstance(applied.reply, Ok):
            self.prefetch[command.consumer] = command.prefetch
            if command.queue == QUEUE:
                self.subscribers.pop(command.consumer, None)
                self.subscribers[command.consumer] = False  # the newest, at the back
        elif isinstance(command, Cancel) and isinstance(applied.reply, Ok):
            if command.consumer in self.subscribers:
                self.subscribers[command.consumer] = True
        elif isinstance(command, Ack | Nack) and isinstance(applied.reply, Ok):
            if isinstance(command, Nack):
                if command.requeue and command.queue == QUEUE:
                    for offset in set(command.offsets):
                        self._failed(offset, now_ms, command.delay_ms)
                self._return_key_tails(command.consumer, command.offsets)
            for offset in command.offsets:
                self._release(offset)
                if isinstance(command, Ack):
                    self.settled.add(offset)
                    body = self.body_of.get(offset)
                    if body is not None and body in self.records:
                        self.records[body].acked = True
        for e in applied.effects:
            if type(e) is Deliver:
                self._delivered(e, now_ms)
            elif type(e) is ConsumerDown:
                self.consumers_removed[e.reason] += 1
                if e.queue == QUEUE:
                    self.subscribers.pop(e.consumer, None)
                    for offset in self.held_by.get(e.consumer, ()):
                        self._failed(offset, now_ms, None)
                for offset in list(self.held_by.get(e.consumer, ())):
                    self._release(offset)
            elif type(e) is Dropped or type(e) is DeadLettered:
                if e.queue != QUEUE:
                    continue  # the dead-letter queue's offsets are its own
                body = self.body_of.get(e.offset)
                if body is not None and body in self.records:
                    record = self.records[body]
                    record.dropped = True
                    record.dead_lettered = type(e) is DeadLettered
                    if type(e) is DeadLettered:
                        self.dead_lettered_at[(e.target_queue, e.target_offset)] = body
                    if e.reason == "expired":
                        self._check_expiry(body, e.offset, now_ms)

    def _check_expiry(self, body: bytes, offset: int, now_ms: int) -> None:
        """A record expired at queue time `now_ms`: at least its TTL of true time must have
        passed since it was published (an early expiry is queue time running fast)."""
        ttl, stamped = self.message_ttl_ms, self.stamped_at.get(now_ms)
        if ttl is None or stamped is None:
            return
        lived = stamped - self.records[body].published_ms
        if lived < ttl - 1:  # 1 ms: the leader clock's truncation
            self.violation(
                "early_expiry",
                f"offset {offset} expired {lived} ms of true time after it was published, "
                f"with a TTL of {ttl} ms",
            )

    def _failed(self, offset: int, now_ms: int, delay_ms: int | None) -> None:
        """A delivery of `offset` failed at queue time `now_ms`: when it may go again."""
        failures = self.failures[offset] = self.failures.get(offset, 0) + 1
        backoff = self.retry_backoff_ms
        if delay_ms is None and backoff is not None:
            delay_ms = min(backoff[1], backoff[0] << min(failures - 1, 62))
        if delay_ms:
            self.retry_due[offset] = now_ms + delay_ms

    def _delivered(self, e: Deliver, now_ms: int) -> None:
        offset = e.offset
        self.deliveries += 1
        key = delivery_key(e)
        self.made[key] = self.made.get(key, 0) + 1
        self.redeliveries += e.redelivered
        if e.queue == QUEUE:
            self.failures[offset] = e.delivery_count
            due = self.retry_due.pop(offset, None)
            if due is not None:
                self.retries_held += 1
                if now_ms < due:
                    self.violation(
                        "retry_early",
                        f"offset {offset} given to {e.consumer} at queue time {now_ms}, "
                        f"{due - now_ms} ms before its retry delay ran out",
                    )
        self.body_of[offset] = e.body
        self.key_of[offset] = e.key
        if offset in self.settled:
            self.violation(
                "acked_redelivered", f"offset {offset} acked, then given to {e.consumer}"
            )
        holder = self.holder.get(offset)
        if holder is not None:
            self.violation(
                "double_hold", f"offset {offset} given to {e.consumer}; {holder} holds it"
            )
        if self.single_active:
            active = next(
                (
                    c
                    for c, cancelled in self.subscribers.items()
                    if not cancelled or self.held_by.get(c)
                ),
                None,
            )
            if e.consumer != active:
                self.violation(
                    "single_active",
                    f"offset {offset} given to {e.consumer}; the active consumer is {active}",
                )
        if e.redelivered != (offset in self.delivered_ever):
            self.violation("redelivered_flag", f"offset {offset} to {e.consumer}: {e.redelivered}")
        self.delivered_ever.add(offset)
        self.holder[offset] = e.consumer
        held = self.held_by.setdefault(e.consumer, {})
        held[offset] = None
        prefetch = self.prefetch.get(e.consumer, 0)
        if prefetch and len(held) > prefetch:
            self.violation("prefetch", f"{e.consumer} holds {len(held)} > {prefetch}")
        if not e.redelivered:
            last = self.last_unkeyed_first if e.key is None else self.last_key_first
            slot = e.consumer if e.key is None else e.key
            if offset <= last.get(slot, -1):
                what = f"consumer {e.consumer}" if e.key is None else f"key {e.key}"
                self.violation("order", f"{what}: first delivery of {offset} after {last[slot]}")
            last[slot] = offset


def delivery_key(d: Deliver) -> tuple[str, int, int, bool]:
    return (d.consumer, d.offset, d.delivery_count, d.redelivered)
