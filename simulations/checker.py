"""The checker: what must hold of a run, checked as it goes and at the end.

As entries are applied (cheap checks, every entry):

* every replica applies the same command at the same log index, and replicas at an
  equal applied index have equal state digests (sampled every `digest_every` entries);
* a replica's state never goes back: a snapshot it loads is ahead of what it applied
  (`rollback`; a stale one would make it apply entries, and run effects, again);
* an independent model of holds, fed the log in order (the first replica to apply an
  index feeds it): a message is given to one consumer at a time (no message held by
  two live consumers); an acked message is never delivered again; `redelivered` is
  set exactly when the message was delivered before; prefetch is respected;
* queue time (the machine's clock, which TTLs, expiry and timeouts read), compared
  with the true time when it was stamped, never gets further ahead of it than at
  genesis (the first time a leader stamped, from its wall clock: a new cluster's time
  starts there) by more than 2 ms per term so far (`time_ahead`: it never runs faster
  than true time), whatever the hosts' wall clocks say (the clock faults, some from
  before the first election): a clock ahead is what
  expired messages early and forgot producers (second offsets);
* with a message TTL, a record expires only after its TTL of true time has passed
  since it was published (`early_expiry`: queue time ran fast);
* with a single active consumer, a message is given to a consumer only while no
  other consumer holds one (`single_active`);
* with retry backoff, a message returned as failed (nacked with requeue, or its
  consumer removed) is not given again before its delay has run out in queue time: the
  nack's `delay_ms`, else the queue's backoff for its failure count (`retry_early`);
* a record leaves the queue undelivered only as the queue's options say: dropped
  (expired, pushed out by max_length, over its delivery limit) or dead-lettered; a
  publish refused because the queue is full (`reject-publish`) is no violation, but
  it must never land (`phantom`);
* first deliveries (not marked redelivered) come in increasing offset order per
  consumer for unkeyed messages and per key for keyed ones: only a return restarts
  a key, and a returned message is marked.

As nodes tick (every tick of every node):

* an entry a node holds committed is the one every node holds committed at that index
  (`log`, for every entry: the check as entries are applied sees only commands, not
  configuration changes);
* no node's log ever holds two configuration changes that are not committed
  (`config`): Raft changes membership one server at a time, each change committed
  before the next is appended, so the quorums of any two configurations in use at
  once overlap. (Two concurrent adds to {A,B,C} made {A..E}, whose quorum {A,D,E}
  misses the old quorum {B,C}: two leaders could commit at one index.) Committed
  means at or below the highest commit index any node has reached.

As consumers receive (the clients' view):

* a record received twice unmarked is a duplicate (`duplicated`); a body nobody
  published is `unexpected`;
* a consumer receives each delivery the log made as often as the log made it, and no
  more (`resent`: effects run twice, say a log entry applied again). A delivery is
  (consumer, offset, delivery count, redelivered mark): a nack of a keyed message can
  give the key's later messages to the same consumer again with the same count.

At the end (Jepsen's total-queue counts, after heal and drain):

* `lost`: confirmed to its producer, never received by a consumer, nor dropped or
  dead-lettered by the queue's options (`dropped`, `dead_lettered`);
* `refused` and `fatal` (not violations): nodes that refused to start from a damaged
  disk, and nodes that stopped themselves after a failed journal write or sync. A
  committed entry lost to damage shows as `log` (a replica applies another command at
  an index) or as lost records;
* `unsettled`: received but never acked (a liveness failure);
* `recovered`: received although never confirmed (allowed: the outcome was unknown);
* every confirmed record was acked before the liveness deadline; every replica ends
  at the same index with the same digest; no record got two offsets. With membership
  changes, "every replica" is every running member (a removed node is cut off, and
  stopped by its operator).

The replica-side checks (everything checked as entries are applied and as nodes tick,
and nodes refused or stopped) are
`ReplicaChecks` (`replica_checks.py`), with the checker's state; `Checker` here adds
what the clients report and the end of the run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from quorumq.machine import (
    Deliver,
)

from .replica_checks import Record, ReplicaChecks, Violation, delivery_key
from .world import seconds

if TYPE_CHECKING:
    from .node import SimNode


class Checker(ReplicaChecks):
    def published(self, body: bytes, key: str | None) -> None:
        self.records[body] = Record(key=key, published_ms=self.world.now_ms)

    def confirmed(self, body: bytes, offset: int | None) -> None:
        record = self.records[body]
        if not record.confirmed:
            self.confirm_times_s.append(seconds(self.world.now_us))
        record.confirmed = True
        if offset is not None:
            record.offsets.add(offset)

    def outcome_unknown(self, body: bytes) -> None:
        """Its producer was told the outcome is unknown: it may or may not land (once)."""
        self.records[body].unknown = True

    def refused(self, body: bytes, reason: str, *, expected: bool = False) -> None:
        """Its producer was told it was not published; `expected`: for a reason the
        queue's options give (full, with `reject-publish`), no violation then."""
        self.records[body].refused = True
        if body in self.landed:
            self.violation("phantom", f"{body!r} landed, and its producer was told it did not")
        if not expected:
            self.violation("refused", f"{body!r} was refused for good: {reason}")

    def subscribed(self, consumer: str, node: str) -> None:
        pass

    def received(self, delivery: Deliver, node: str) -> None:
        record = self.records.get(delivery.body)
        self.world.trace(f"recv {delivery.consumer} {delivery.offset} {int(delivery.redelivered)}")
        if record is None:
            self.violation("unexpected", f"{delivery.consumer} received {delivery.body!r}")
            return
        record.received += 1
        if record.received == 1:
            self.first_delivery_times_s.append(seconds(self.world.now_us))
        record.offsets.add(delivery.offset)
        if record.refused and record.received == 1:
            self.violation(
                "phantom",
                f"{delivery.body!r} was reported not published to its producer, and landed",
            )
        key = delivery_key(delivery)
        got = self.got[key] = self.got.get(key, 0) + 1
        if got > self.made.get(key, 0):
            self.violation(
                "resent",
                f"{delivery.consumer} received offset {delivery.offset} (count "
                f"{delivery.delivery_count}) via {node} {got} times; the log made it "
                f"{self.made.get(key, 0)} times",
            )
        if not delivery.redelivered:
            record.received_unmarked += 1
            if record.received_unmarked == 2:
                self.violation(
                    "duplicated",
                    f"{delivery.body!r} (offset {delivery.offset}) received again by "
                    f"{delivery.consumer} via {node}, not marked redelivered",
                )

    def settled_all(self) -> bool:
        """Every confirmed record acked (or explicitly dropped): the drain is done."""
        return all(r.acked or r.dropped for r in self.records.values() if r.confirmed)

    def finish(
        self, nodes: list[SimNode], drained: bool, *, stopped: bool = False
    ) -> dict[str, int]:
        """Final checks; the Jepsen counts. `stopped`: the run stopped at its first
        violation, before its drain: records still in flight are counted (lost,
        unsettled) but are no violations, and nothing is checked of the drain."""
        counts = {
            "published": len(self.records),
            "confirmed": 0,
            "received": 0,
            "acked": 0,
            "lost": 0,
            "unsettled": 0,
            "duplicated": 0,
            "recovered": 0,
            "dropped": 0,
            "dead_lettered": 0,
            "refused": 0,
            "consumers_timed_out": self.consumers_removed["consumer_timeout"],
            "retries_held": self.retries_held,
            "unexpected": sum(1 for v in self.violations if v.kind == "unexpected"),
            "refused_start": self.refused_starts,
            "fatal_stop": self.fatal_stops,
        }
        for body, r in self.records.items():
            counts["confirmed"] += r.confirmed
            counts["received"] += r.received > 0
            counts["acked"] += r.acked
            counts["duplicated"] += r.received_unmarked > 1
            counts["dead_lettered"] += r.dead_lettered
            counts["dropped"] += r.dropped and not r.dead_lettered
            counts["refused"] += r.refused
            if r.confirmed and not r.received and not r.dropped:
                counts["lost"] += 1
                if counts["lost"] <= 5 and not stopped:
                    self.violation("lost", f"{body!r} was confirmed and never received")
            if r.received and not r.acked and not r.dropped:
                counts["unsettled"] += 1
                if counts["unsettled"] <= 5 and not stopped:
                    self.violation("unsettled", f"{body!r} was received and never acked")
            if r.received and not r.confirmed:
                counts["recovered"] += 1
            if len(r.offsets) > 1:
                self.violation("two_offsets", f"{body!r} has offsets {sorted(r.offsets)}")
        if stopped:
            return counts
        if not drained:
            self.violation("liveness", "not every confirmed record was acked by the deadline")
        for (queue, offset), body in sorted(self.dead_lettered_at.items()):
            there = nodes[0].machine.read(queue, offset, offset + 1) if nodes else ()
            if not there or there[0].body != body:
                self.violation(
                    "dead_letter",
                    f"{body!r} was dead-lettered to {queue} at {offset}, and is not there",
                )
        indexes = {n.name: n.machine.last_index for n in nodes}
        digests = {n.name: n.machine.digest() for n in nodes}
        if len(set(indexes.values())) > 1 or len(set(digests.values())) > 1:
            self.violation("converge", f"replicas end apart: applied indexes {indexes}")
        return counts


__all__ = ["Checker", "Violation"]
