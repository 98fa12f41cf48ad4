"""A real-process chaos run, as Wallaroo tested its system: real nodes, real faults,
and a check that compares what came out with what went in.

A 3-node cluster of OS processes runs on loopback. Producers send small unique records
(producer number, sequence number) with the client's idempotent retries; one consumer
per node records every delivery and acks it. A fault loop injects, every 1-5 s: SIGKILL
and restart of the leader or of any node, SIGSTOP for up to twice the node-down grace
period (so that the leader marks the node down and hands its consumers' messages to
others) then SIGCONT, and the death of a consumer. Then the faults stop, every node
runs, the queue drains, and the check runs:

* filter, then compare: per producer, the records delivered for the first time (marked
  redeliveries filtered out) are exactly the confirmed ones, plus any whose confirm was
  lost with a connection (counted as recovered). Nothing confirmed is lost, nothing is
  delivered twice unmarked, nothing arrives that was never sent;
* per consumer and ordering key, first deliveries come in increasing offset order;
* every replica ends with the same machine digest: each node is audited (its state
  digest and the log index it is of), all at once, again and again for up to 30 s, and
  some index must have been audited on every node with one digest. Two digests at one
  index is a divergence. When no index lines up, the report names, for each node, its
  applied and commit index, term, role, leader, last audit or why the audit failed,
  how far behind it is and since when, and the tail of its log.

While it runs, the harness polls every node's status and counts elections (terms with
a leader, from the nodes' "leading at term" log lines) and the nodes marked down; each
consumer's client tells it of a `node_down` cancellation. A node marked down that the
harness had not paused or killed within the node-down grace before (plus time to catch
up) is a false down, and fails the run.

Run it: `python -m simulations.chaos --duration 90` (CI runs a bounded run);
`--duration 8h` is the soak. `--faults none --cpu-hog 2 --duration 10m`: no fault, two
busy-looping processes beside the cluster, and the run fails on any election.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import attrs

from quorumq.client import Client, Consumer, QuorumqError
from quorumq.ops.local_cluster import Cluster

QUEUE = "chaos"
KEYS_PER_PRODUCER = 4
IN_FLIGHT = 32
"""Unconfirmed publishes each producer allows itself."""


@attrs.frozen
class Received:
    producer: int
    seq: int
    offset: int
    key: str
    redelivered: bool
    node: str
    consumer: str
    """Which consumer (node and life: one per kill) received it."""


CATCH_UP_S = 5.0
"""A node marked down while it was paused or dead may learn it (and cancel its
consumers) only once it runs again and has caught up, by a snapshot install at worst:
a down within the node-down grace plus this after a fault of the node is explained."""

LOG_TAIL_LINES = 12
LEADING = re.compile(rb"leading at term (\d+)")


@attrs.define
class Fault:
    node: str
    kind: str
    """"pause" (SIGSTOP until SIGCONT) or "kill" (SIGKILL until restarted and ready)."""
    start: float
    end: float | None = None
    """None: still under way. Times are seconds since the run began."""


class FaultLog:
    """When the harness paused or killed which node: the bookkeeping that tells a node
    marked down because the harness silenced it from a false down."""

    def __init__(self) -> None:
        self.faults: list[Fault] = []
        self._lock = threading.Lock()

    def begin(self, node: str, kind: str, at: float) -> Fault:
        fault = Fault(node, kind, at)
        with self._lock:
            self.faults.append(fault)
        return fault

    def end(self, fault: Fault, at: float) -> None:
        with self._lock:
            fault.end = at

    def end_all(self, node: str, at: float) -> None:
        """`node` runs again (the heal), whatever fault left it down."""
        with self._lock:
            for fault in self.faults:
                if fault.node == node and fault.end is None:
                    fault.end = at

    def explaining(self, node: str, at: float, window: float) -> Fault | None:
        """The latest fault of `node` under way at some moment of [at - window, at]."""
        with self._lock:
            hits = [
                f
                for f in self.faults
                if f.node == node and f.start <= at and (f.end is None or f.end >= at - window)
            ]
        return max(hits, key=lambda f: f.start, default=None)

    def last_before(self, node: str, at: float) -> Fault | None:
        with self._lock:
            before = [f for f in self.faults if f.node == node and f.start <= at]
        return max(before, key=lambda f: f.start, default=None)


@attrs.frozen(kw_only=True)
class Down:
    """A node seen marked down: a consumer on it cancelled with `node_down`, or the
    leader's status listing it among the down nodes."""

    at: float
    node: str
    seen_by: str


@attrs.frozen(kw_only=True)
class FalseDown:
    down: Down
    last_fault: Fault | None
    """The node's latest fault before it (too long before to explain it), if any."""
    leader: str | None
    """Who led then, as the status polls last saw it."""

    def render(self) -> str:
        d, f = self.down, self.last_fault
        if f is None:
            fault = "the harness never paused or killed it"
        elif f.end is None:
            fault = f"its last fault: {f.kind} from {f.start:.1f} s, not over"
        else:
            fault = (
                f"its last fault: {f.kind} {f.start:.1f}-{f.end:.1f} s, "
                f"over {d.at - f.end:.1f} s before"
            )
        return (
            f"  false down: {d.node} at {d.at:.1f} s, seen by {d.seen_by}; {fault}; "
            f"leader then {self.leader or 'unknown'}"
        )


def false_downs(
    downs: list[Down], faults: FaultLog, window: float, leader_at: Callable[[float], str | None]
) -> list[FalseDown]:
    """The downs that no pause or kill of their node within `window` before explains."""
    return [
        FalseDown(down=d, last_fault=faults.last_before(d.node, d.at), leader=leader_at(d.at))
        for d in downs
        if faults.explaining(d.node, d.at, window) is None
    ]


@attrs.frozen(kw_only=True)
class NodeEvidence:
    """What one node said when the replicas did not agree."""

    node: str
    alive: bool
    status: dict[str, Any] | None
    """Its latest status (from the polls), or None if it never answered one."""
    status_age_s: float | None
    status_error: str | None
    """Why its latest poll failed, if it did."""
    behind: int | None
    """Entries: the highest commit index any node reports, less its applied index."""
    stalled_s: float | None
    """Seconds since its applied index last moved (as the polls saw it)."""
    audits: int
    last_audit: tuple[int, str] | None
    audit_error: str | None
    audit_errors: int
    audit_s: float
    """The longest any of its audits (or failed audits) took."""
    log_tail: tuple[str, ...]

    def render(self) -> list[str]:
        s = self.status
        head = f"  {self.node} ({'running' if self.alive else 'NOT RUNNING'}): "
        if s is None:
            head += "no status ever"
        else:
            role = (
                "leader"
                if s.get("is_leader")
                else f"follower of {s['leader']}"
                if s.get("leader")
                else "no leader known (follower or candidate)"
            )
            head += (
                f"applied {s['last_applied']}, machine {s['machine_index']}, "
                f"commit {s['commit_index']}, term {s['term']}, {role}, "
                f"connected {s.get('connected')}, snapshots loaded {s.get('snapshots_loaded')}"
                + "".join(f", {c} {s[c]}" for c in COUNTERS if s.get(c) is not None)
                + (
                    f", compaction error {s['compaction_error']}"
                    if s.get("compaction_error")
                    else ""
                )
                + f" (status {self.status_age_s:.1f} s old)"
            )
        lines = [head]
        if self.status_error is not None:
            lines.append(f"    latest status poll failed: {self.status_error}")
        behind = "?" if self.behind is None else str(self.behind)
        stalled = "?" if self.stalled_s is None else f"{self.stalled_s:.1f} s"
        lines.append(f"    behind by {behind} entries; applied index last moved {stalled} ago")
        audit = (
            "none succeeded"
            if self.last_audit is None
            else f"last (index {self.last_audit[0]}, digest {self.last_audit[1][:16]})"
        )
        lines.append(
            f"    audits: {self.audits} tried, {self.audit_errors} failed, "
            f"the longest {self.audit_s:.2f} s; {audit}"
            + (f"; last failure: {self.audit_error}" if self.audit_error else "")
        )
        lines.append(f"    log tail ({len(self.log_tail)} lines):")
        lines.extend(f"      {line}" for line in self.log_tail)
        return lines


@attrs.frozen(kw_only=True)
class Agreement:
    verdict: str
    """"agree": some index was audited on every node with one digest; "diverged": two
    nodes audited one index with different digests; "inconclusive": no index lined up."""
    detail: str
    evidence: tuple[NodeEvidence, ...] = ()

    @property
    def agreed(self) -> bool:
        return self.verdict == "agree"


def decide(audited: dict[str, dict[int, str]]) -> tuple[str, str]:
    """(verdict, detail) from each node's audits, index -> digest (see `Agreement`)."""
    digests: dict[int, dict[str, str]] = collections.defaultdict(dict)
    for node, by_index in audited.items():
        for index, digest in by_index.items():
            digests[index][node] = digest
    for index in sorted(digests):
        if len(set(digests[index].values())) > 1:
            pairs = ", ".join(f"{n} {d[:16]}" for n, d in sorted(digests[index].items()))
            return "diverged", f"at index {index}: {pairs}"
    common = [i for i, by_node in digests.items() if set(by_node) == set(audited)]
    if audited and common:
        index = max(common)
        return "agree", f"index {index}, digest {digests[index][next(iter(audited))][:16]}"
    ranges = ", ".join(
        f"{n} {min(d)}-{max(d)}" if d else f"{n} none" for n, d in sorted(audited.items())
    )
    return "inconclusive", f"no index audited on every node (audited: {ranges})"


@attrs.define
class ChaosReport:
    seed: int
    duration_s: float
    faults: dict[str, int]
    sent: int
    confirmed: int
    unconfirmed: int
    delivered: int
    lost: int
    duplicated: int
    unexpected: int
    recovered: int
    order_violations: int
    redeliveries: int
    agreement: Agreement
    drained: bool
    fault_mode: str = "mixed"
    cpu_hogs: int = 0
    elections: int = 0
    """Elections won while the faults ran (terms with a leader)."""
    elections_after: int = 0
    """Elections won after the faults, while the run drained and checked."""
    leader_terms: tuple[tuple[int, str], ...] = ()
    """(term, leader) of the elections counted in `elections`."""
    terms: tuple[int, int] = (0, 0)
    """The highest term the polls saw when the faults began, and at the end."""
    cancels: int = 0
    """Consumers cancelled with `node_down`."""
    marks: int = 0
    """Nodes newly among the down nodes of the leader's status (as polled)."""
    false_downs: tuple[FalseDown, ...] = ()
    load: tuple[float, float] = (0.0, 0.0)
    """The 1-minute load average when the faults began and when they ended."""
    counters: dict[str, dict[str, int]] = attrs.Factory(dict)
    """Per node, its `COUNTERS` at the last poll (since its latest start)."""

    @property
    def replicas_agree(self) -> bool:
        return self.agreement.agreed

    @property
    def faults_per_hour(self) -> float:
        return sum(self.faults.values()) * 3600.0 / self.duration_s

    @property
    def elections_per_hour(self) -> float:
        return self.elections * 3600.0 / self.duration_s

    @property
    def passed(self) -> bool:
        return (
            self.lost == self.duplicated == self.unexpected == self.order_violations == 0
            and self.replicas_agree
            and self.drained
            and not self.false_downs
            and (self.fault_mode != "none" or self.elections == 0)
        )

    def summary(self) -> str:
        faults = ", ".join(f"{k} {v}" for k, v in sorted(self.faults.items())) or "none"
        verdict = "PASS" if self.passed else "FAIL"
        hogs = f", {self.cpu_hogs} CPU hog(s) beside it" if self.cpu_hogs else ""
        lines = [
            f"chaos run: seed {self.seed}, {self.duration_s:.0f} s of faults, "
            f"{self.faults_per_hour:.0f} faults/hour ({faults}){hogs}; "
            f"load average {self.load[0]:.2f} at the start, {self.load[1]:.2f} at the end",
            f"  sent {self.sent}, confirmed {self.confirmed}, "
            f"unconfirmed {self.unconfirmed}, delivered {self.delivered} "
            f"(+{self.redeliveries} marked redeliveries)",
            f"  lost {self.lost}, duplicated {self.duplicated}, "
            f"unexpected {self.unexpected}, recovered {self.recovered}, "
            f"order violations {self.order_violations}",
            f"  elections {self.elections} ({self.elections_per_hour:.0f}/hour"
            + (", a run without faults expects none" if self.fault_mode == "none" else "")
            + f"), {self.elections_after} after the faults; terms {self.terms[0]} -> "
            f"{self.terms[1]}",
            f"  downs: {self.cancels} node_down cancels of consumers, {self.marks} nodes "
            f"marked down in the leader's status; false downs {len(self.false_downs)}",
        ]
        if self.counters:
            lines.append(
                "  node counters since each node's latest start: "
                + "; ".join(
                    f"{c.replace('_', ' ')} "
                    + ", ".join(f"{n} {v[c]}" for n, v in sorted(self.counters.items()))
                    for c in COUNTERS
                )
            )
        if self.fault_mode == "none" and self.leader_terms:
            lines.append(
                "  leaders: " + ", ".join(f"{n} at term {t}" for t, n in self.leader_terms[:20])
            )
        lines.extend(f.render() for f in self.false_downs[:20])
        lines.append(
            f"  queue drained: {self.drained}; replicas agree: {self.replicas_agree} "
            f"({self.agreement.verdict}: {self.agreement.detail})"
        )
        for evidence in self.agreement.evidence:
            lines.extend(evidence.render())
        lines.append(
            f"  verdict: {verdict}"
            + ("" if self.passed else f"  (replay: python -m simulations.chaos --seed {self.seed})")
        )
        return "\n".join(lines)


class Producer:
    """Publishes records `p:seq` with ordering keys, confirmed through the client."""

    def __init__(self, number: int, client: Client, rate: float) -> None:
        self.number = number
        self.client = client
        self.rate = rate
        self.sent = 0
        self.confirmed: set[int] = set()
        self.unconfirmed: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"producer-{number}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=180)

    def _run(self) -> None:
        window: collections.deque[tuple[int, Future[dict[str, Any]]]] = collections.deque()
        started = time.monotonic()
        seq = 0
        while not self._stop.is_set():
            key = f"p{self.number}k{seq % KEYS_PER_PRODUCER}"
            try:
                future = self.client.publish_async(QUEUE, b"%d:%d" % (self.number, seq), key)
            except QuorumqError:  # the key is paused after a failure: we handled it
                if key in self.client.settling_keys():
                    self._stop.wait(0.05)  # a publish of it may still land: let it settle
                else:
                    self.client.resume(key)
                continue
            window.append((seq, future))
            self.sent += 1
            seq += 1
            while len(window) >= IN_FLIGHT:
                self._settle(*window.popleft())
            pause = started + seq / self.rate - time.monotonic()
            if pause > 0:
                self._stop.wait(pause)
        while window:
            self._settle(*window.popleft())

    def _settle(self, seq: int, future: Future[dict[str, Any]]) -> None:
        try:
            future.result(timeout=120)
        except Exception:  # connection lost for good, or an error: outcome unknown
            self.unconfirmed.add(seq)
        else:
            self.confirmed.add(seq)


class WatchedClient(Client):
    """A client that tells `on_cancelled(consumer id, reason)` of each cancellation a
    node sends it. After a `node_down` the client subscribes again on its own, so its
    consumer never shows one: the harness reads the frame as the session receives it
    (the client has no public hook for that)."""

    def __init__(
        self, *args: Any, on_cancelled: Callable[[str, str], None], **options: Any
    ) -> None:
        super().__init__(*args, **options)
        receive = self._session.receive

        def watched(frame: dict[str, Any]) -> list[Any]:
            if frame.get("t") == "cancelled":
                on_cancelled(str(frame.get("consumer")), str(frame.get("reason")))
            return receive(frame)

        self._session.receive = watched  # type: ignore[method-assign]


class ConsumerSlot:
    """The consumer attached to one node; replaced by a new one when it is killed."""

    def __init__(
        self,
        cluster: Cluster,
        node: str,
        record: Callable[[Received], None],
        on_cancelled: Callable[[str, str, str], None] = lambda _node, _consumer, _why: None,
    ) -> None:
        """`on_cancelled(node, consumer id, reason)`: its node cancelled the consumer."""
        self.cluster = cluster
        self.node = node
        self.record = record
        self.on_cancelled = on_cancelled
        self.lives = 0
        self._client: Client | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self) -> None:
        self.lives += 1
        # connected to its own node only: it waits for that node through its restarts
        client = WatchedClient(
            [self.cluster.endpoint(self.node)],
            self.cluster.token,
            timeout=120,
            on_cancelled=lambda consumer, why: self.on_cancelled(self.node, consumer, why),
        )
        self._client, self._stop = client, threading.Event()
        self._thread = threading.Thread(
            target=self._subscribe_and_run, args=(client, self.lives, self._stop), daemon=True
        )
        self._thread.start()

    def _subscribe_and_run(self, client: Client, life: int, stop: threading.Event) -> None:
        """Subscribe until the node takes it (a node marked down refuses until it is up
        again), then consume; if the consumer ends (it could not subscribe again after
        its node was cut off), the slot subscribes anew, as a new life."""
        while not stop.is_set():
            try:
                consumer = client.subscribe(QUEUE, prefetch=20)
            except QuorumqError:
                stop.wait(0.2)
                continue
            self._run(consumer, life, stop)
            self.lives += 1
            life = self.lives

    def kill(self) -> None:
        """The consumer dies with what it holds (its connection closes, unacked)."""
        self._halt()
        self.start()

    def _halt(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._client is not None:
            self._client.close()

    def stop(self) -> None:
        self._halt()

    def _run(self, consumer: Consumer, life: int, stop: threading.Event) -> None:
        name = f"{self.node}#{life}"
        while not stop.is_set():
            d = consumer.get(timeout=0.1)
            if d is None:
                if consumer.cancelled:
                    return
                continue
            producer, seq = map(int, d.body.split(b":"))
            self.record(Received(producer, seq, d.offset, d.key or "", d.redelivered, d.node, name))
            if stop.is_set():
                return  # dying: this one stays unacked and must come back
            with contextlib.suppress(QuorumqError):  # if the connection is gone, it comes back
                d.ack()


def check(
    producers: list[Producer], received: list[Received]
) -> tuple[int, int, int, int, int, int]:
    """(delivered, lost, duplicated, unexpected, recovered, order violations)."""
    first: dict[tuple[int, int], int] = collections.Counter()
    sent = {p.number: p for p in producers}
    unexpected = 0
    for r in received:
        producer = sent.get(r.producer)
        if producer is None or r.seq >= producer.sent:
            unexpected += 1
        elif not r.redelivered:
            first[(r.producer, r.seq)] += 1
    seen = {(r.producer, r.seq) for r in received}
    lost = sum(1 for p in producers for s in p.confirmed if (p.number, s) not in seen)
    duplicated = sum(n - 1 for n in first.values() if n > 1)
    recovered = sum(1 for p in producers for s in p.unconfirmed if (p.number, s) in seen)
    last: dict[tuple[str, str], int] = {}
    violations = 0
    for r in received:
        if r.redelivered:
            continue
        lane = (r.consumer, r.key)
        if r.offset <= last.get(lane, -1):
            violations += 1
        last[lane] = r.offset
    return len(first), lost, duplicated, unexpected, recovered, violations


def duplicate_examples(received: list[Received], limit: int = 5) -> list[str]:
    """Every reception of the first few records delivered twice without the mark."""
    firsts: dict[tuple[int, int], list[Received]] = collections.defaultdict(list)
    for r in received:
        firsts[(r.producer, r.seq)].append(r)
    lines = []
    for (producer, seq), seen in firsts.items():
        if sum(not r.redelivered for r in seen) > 1:
            lines.append(
                f"  record {producer}:{seq}: "
                + "; ".join(
                    f"offset {r.offset} to {r.consumer} via {r.node}"
                    + (" (redelivered)" if r.redelivered else "")
                    for r in seen
                )
            )
            if len(lines) >= limit:
                break
    return lines


STATUS_FIELDS = (
    "term",
    "leader",
    "is_leader",
    "commit_index",
    "last_applied",
    "machine_index",
    "down_nodes",
    "connected",
    "snapshots_loaded",
    "compaction_error",
    "elections",
    "pre_votes_lost",
    "stalls",
)
COUNTERS = ("elections", "pre_votes_lost", "stalls")
"""What a node counts since its process started (nodes with issue 27's Raft rules)."""


class RaftWatch:
    """Polls every node's status every `every_s`, each node from a thread of its own (a
    paused node holds up only its own poll). Keeps each node's latest status and why
    its latest poll failed, when its applied index last moved, every (term, leader)
    first seen, the highest term, and the nodes the leader's status marks down."""

    def __init__(self, cluster: Cluster, clock: Callable[[], float], every_s: float = 0.5) -> None:
        self.cluster = cluster
        self.clock = clock
        self.every_s = every_s
        self.lock = threading.Lock()
        self.latest: dict[str, tuple[float, dict[str, Any]]] = {}
        self.errors: dict[str, str | None] = {}
        self.advanced_at: dict[str, float] = {}
        self.leaders: list[tuple[float, int, str]] = []
        """(when first seen, term, leader)."""
        self.max_term = 0
        self.downs: list[Down] = []
        self._seen: set[tuple[int, str]] = set()
        self._down: set[str] = set()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._poll, args=(n,), name=f"watch-{n}", daemon=True)
            for n in cluster.nodes
        ]

    def start(self, timeout_s: float = 10.0) -> None:
        """Start polling, and wait (up to `timeout_s`) for a first status of each node."""
        for thread in self._threads:
            thread.start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                if len(self.latest) == len(self._threads):
                    return
            time.sleep(0.05)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=10)

    def leader_at(self, at: float) -> str | None:
        with self.lock:
            seen = [leader for when, _term, leader in self.leaders if when <= at]
        return seen[-1] if seen else None

    def _poll(self, node: str) -> None:
        client: Client | None = None
        while not self._stop.wait(self.every_s):
            try:
                if client is None:
                    client = Client(
                        [self.cluster.endpoint(node)],
                        self.cluster.token,
                        timeout=2.0,
                        connect_timeout=1.0,
                        tls=self.cluster.tls_ca,
                    )
                status = client.status()
            except (QuorumqError, OSError) as e:
                with self.lock:
                    self.errors[node] = f"{type(e).__name__}: {e}"
                if client is not None:  # a new connection next time
                    client.close()
                    client = None
                continue
            self.saw(node, {k: status.get(k) for k in STATUS_FIELDS}, self.clock())
        if client is not None:
            client.close()

    def saw(self, node: str, status: dict[str, Any], at: float) -> None:
        with self.lock:
            previous = self.latest.get(node)
            self.latest[node] = (at, status)
            self.errors[node] = None
            if previous is None or previous[1]["last_applied"] != status["last_applied"]:
                self.advanced_at[node] = at
            term, leader = status["term"], status["leader"]
            self.max_term = max(self.max_term, term)
            if leader is not None and (term, leader) not in self._seen:
                self._seen.add((term, leader))
                self.leaders.append((at, term, leader))
            if status["is_leader"]:
                down = set(status["down_nodes"])
                self.downs.extend(
                    Down(at=at, node=d, seen_by=f"leader {node}'s status at term {term}")
                    for d in sorted(down - self._down)
                )
                self._down = down


def leading_terms(cluster: Cluster) -> dict[int, str]:
    """Term -> the node that logged "leading at term" for it (nodes logging at info)."""
    terms: dict[int, str] = {}
    for node in cluster.nodes:
        with contextlib.suppress(OSError):
            for m in LEADING.finditer(cluster.log_path(node).read_bytes()):
                terms[int(m.group(1))] = node
    return terms


def log_tail(path: os.PathLike[str] | str, lines: int = LOG_TAIL_LINES) -> tuple[str, ...]:
    """The last `lines` lines of a node's log, less the leader's "proposing Tick()"
    lines (one a second: they would fill the tail)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 256 * 1024))
            data = f.read()
    except OSError as e:
        return (f"(no log: {e})",)
    kept = [line for line in data.splitlines() if b"proposing Tick()" not in line]
    ticks = data.count(b"proposing Tick()")
    tail = tuple(line.decode(errors="replace") for line in kept[-lines:])
    return tail + ((f"({ticks} 'proposing Tick()' lines left out)",) if ticks else ())


@contextlib.contextmanager
def cpu_hogs(n: int) -> Iterator[list[int]]:
    """`n` processes that busy-loop beside the cluster (at the harness's niceness), killed
    by PID at the end."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(n):
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL
                )
            )
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait(timeout=10)


def run_chaos(
    duration_s: float = 90.0,
    *,
    seed: int = 0,
    producers: int = 3,
    rate: float = 100.0,
    node_down_grace: float = 2.0,
    drain_timeout_s: float = 120.0,
    data_dir: str | None = None,
    log_level: str = "info",
    compaction_entries: int = 50_000,
    fault_mode: str = "mixed",
    hogs: int = 0,
    log: Callable[[str], None] = print,
) -> ChaosReport:
    """Run a cluster under faults for `duration_s` (`fault_mode` "none": no fault, the
    run fails on any election), with `hogs` busy-looping processes beside it while the
    faults run; drain it and check what came out."""
    if fault_mode not in ("mixed", "none"):
        raise ValueError(f"fault_mode must be 'mixed' or 'none', not {fault_mode!r}")
    rng = random.Random(seed)
    faults: collections.Counter[str] = collections.Counter()
    fault_log = FaultLog()
    received: list[Received] = []
    cancelled: list[Down] = []
    lock = threading.Lock()

    def record(r: Received) -> None:
        with lock:
            received.append(r)

    began = time.monotonic()
    plain_log = log

    def clock() -> float:
        return time.monotonic() - began

    def log(line: str) -> None:  # when, and how many confirms so far: a stall shows
        confirmed = sum(len(w.confirmed) for w in workers)
        plain_log(f"{clock():6.1f}s {confirmed:7d} confirmed {line}")

    def on_cancelled(node: str, consumer: str, reason: str) -> None:
        if reason == "node_down":
            at = clock()
            with lock:
                cancelled.append(Down(at=at, node=node, seen_by=f"consumer {consumer}'s cancel"))
            log(f"  consumer {consumer} on {node} cancelled: node_down")

    workers: list[Producer] = []
    with Cluster(
        3,
        data_dir,
        node_down_grace=node_down_grace,
        log_level=log_level,
        compaction_entries=compaction_entries,
    ) as cluster:
        watch = RaftWatch(cluster, clock)
        watch.start()
        try:
            setup = cluster.client()
            setup.declare(QUEUE)
            slots = [ConsumerSlot(cluster, node, record, on_cancelled) for node in cluster.nodes]
            for slot in slots:
                slot.start()
            for i in range(producers):
                order = cluster.nodes[i % 3 :] + cluster.nodes[: i % 3]
                client = Client([cluster.endpoint(n) for n in order], cluster.token, timeout=120)
                workers.append(Producer(i, client, rate))
            for w in workers:
                w.start()

            terms_before = leading_terms(cluster)
            first_term = watch.max_term
            load_before = os.getloadavg()[0]
            started = time.monotonic()
            interrupted = threading.Event()
            with _stop_on_interrupt(interrupted, log), cpu_hogs(hogs) as hog_pids:
                if hog_pids:
                    log(f"  CPU hogs running: PIDs {hog_pids}")
                while time.monotonic() - started < duration_s and not interrupted.is_set():
                    if fault_mode == "none":
                        interrupted.wait(min(1.0, duration_s - (time.monotonic() - started)))
                        continue
                    if interrupted.wait(rng.uniform(1.0, 5.0)):
                        break
                    kind = rng.choices(
                        ["kill_leader", "kill_node", "pause_node", "kill_consumer"],
                        weights=[35, 20, 25, 20],
                    )[0]
                    try:
                        _inject(cluster, slots, kind, rng, node_down_grace, log, fault_log, clock)
                    except Exception as e:  # a fault that could not be injected is not counted
                        log(f"  fault {kind} not injected: {e}")
                        continue
                    faults[kind] += 1
            faulted_s = time.monotonic() - started
            load_after = os.getloadavg()[0]
            terms_faulted = leading_terms(cluster)

            for w in workers:
                w.stop()
            for node in cluster.nodes:  # heal: everything runs
                if not cluster.alive(node):
                    cluster.restart(node)
                cluster.resume(node)
                fault_log.end_all(node, clock())
            log("  faults over: draining")
            drained = _drain(cluster, workers, received, lock, drain_timeout_s)
            if not drained:
                for line in _stuck(cluster, workers, received, lock):
                    log(line)
            for slot in slots:
                slot.stop()
            agreement = _agreement(cluster, watch, clock)
            terms_after = leading_terms(cluster)
            for w in workers:
                w.client.close()
        finally:
            watch.stop()

    if log_level in ("info", "debug"):
        won = sorted((t, n) for t, n in terms_faulted.items() if t not in terms_before)
        after = sum(1 for t in terms_after if t not in terms_faulted)
    else:  # no "leading at term" lines: the (term, leader) pairs the polls saw
        won = sorted(
            (t, n) for when, t, n in watch.leaders if 0 < when - (started - began) <= faulted_s
        )
        after = sum(1 for when, _t, _n in watch.leaders if when - (started - began) > faulted_s)
    with lock:
        downs = sorted([*cancelled, *watch.downs], key=lambda d: d.at)
    wrong = false_downs(downs, fault_log, node_down_grace + CATCH_UP_S, watch.leader_at)
    for f in wrong:
        log(f.render())

    with lock:
        delivered, lost, duplicated, unexpected, recovered, violations = check(workers, received)
        if duplicated:
            for line in duplicate_examples(received):
                log(line)
        redeliveries = sum(1 for r in received if r.redelivered)
    return ChaosReport(
        seed=seed,
        duration_s=faulted_s,
        faults=dict(faults),
        sent=sum(w.sent for w in workers),
        confirmed=sum(len(w.confirmed) for w in workers),
        unconfirmed=sum(len(w.unconfirmed) for w in workers),
        delivered=delivered,
        lost=lost,
        duplicated=duplicated,
        unexpected=unexpected,
        recovered=recovered,
        order_violations=violations,
        redeliveries=redeliveries,
        agreement=agreement,
        drained=drained,
        fault_mode=fault_mode,
        cpu_hogs=hogs,
        elections=len(won),
        elections_after=after,
        leader_terms=tuple(won),
        terms=(first_term, watch.max_term),
        cancels=len(cancelled),
        counters={
            n: {c: s[c] for c in COUNTERS}
            for n, (_at, s) in watch.latest.items()
            if all(s.get(c) is not None for c in COUNTERS)
        },
        marks=len(watch.downs),
        false_downs=tuple(wrong),
        load=(load_before, load_after),
    )


@contextlib.contextmanager
def _stop_on_interrupt(interrupted: threading.Event, log: Callable[[str], None]) -> Iterator[None]:
    """Ctrl-C ends the fault phase (the run still heals, drains and reports); a second
    Ctrl-C interrupts as usual."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_interrupt(_signum: int, _frame: object) -> None:
        log("  interrupted: no more faults; healing and draining (Ctrl-C again to abort)")
        interrupted.set()
        signal.signal(signal.SIGINT, previous)

    previous = signal.signal(signal.SIGINT, on_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _inject(
    cluster: Cluster,
    slots: list[ConsumerSlot],
    kind: str,
    rng: random.Random,
    grace: float,
    log: Callable[[str], None],
    fault_log: FaultLog,
    clock: Callable[[], float],
) -> None:
    if kind == "kill_consumer":
        slot = rng.choice(slots)
        log(f"  kill consumer on {slot.node}")
        slot.kill()
        return
    node = cluster.leader(timeout=30) if kind == "kill_leader" else rng.choice(cluster.nodes)
    if kind == "pause_node":
        pause_s = rng.uniform(0.5, 2 * grace)
        log(f"  SIGSTOP {node} for {pause_s:.1f} s")
        fault = fault_log.begin(node, "pause", clock())
        cluster.pause(node)
        try:
            time.sleep(pause_s)
        finally:
            cluster.resume(node)
            fault_log.end(fault, clock())
        return
    log(f"  SIGKILL {node}" + (" (leader)" if kind == "kill_leader" else ""))
    fault = fault_log.begin(node, "kill", clock())  # over once restarted (else at the heal)
    cluster.kill(node)
    time.sleep(rng.uniform(0.2, 2.0))
    cluster.restart(node)
    fault_log.end(fault, clock())


def _drain(
    cluster: Cluster,
    workers: list[Producer],
    received: list[Received],
    lock: threading.Lock,
    timeout_s: float,
) -> bool:
    """Wait until every confirmed record arrived and nothing is ready or unacked."""
    deadline = time.monotonic() + timeout_s
    wanted = {(w.number, s) for w in workers for s in w.confirmed}
    while time.monotonic() < deadline:
        with lock:
            seen = {(r.producer, r.seq) for r in received}
        if wanted <= seen:
            try:
                queue = cluster.status(cluster.leader())["queues"][QUEUE]
            except (QuorumqError, OSError, RuntimeError):
                queue = None
            if queue is not None and queue["ready"] == 0 and queue["unacked"] == 0:
                return True
        time.sleep(0.2)
    return False


def _stuck(
    cluster: Cluster, workers: list[Producer], received: list[Received], lock: threading.Lock
) -> list[str]:
    """What a drain that did not finish was waiting for: records never received, and
    what each node says the queue holds and for whom."""
    with lock:
        seen = {(r.producer, r.seq) for r in received}
    missing = sorted(
        (w.number, s) for w in workers for s in w.confirmed if (w.number, s) not in seen
    )
    lines = [f"  not drained: {len(missing)} confirmed records never received {missing[:10]}"]
    for node in cluster.nodes:
        try:
            status = cluster.status(node)
            queue = status["queues"][QUEUE]
        except (QuorumqError, OSError, RuntimeError, KeyError) as e:
            lines.append(f"  {node}: no status ({e})")
            continue
        lines.append(
            f"  {node}: leader {status['leader']}, applied {status['machine_index']}, "
            f"ready {queue['ready']}, unacked {queue['unacked']}, "
            f"consumers {queue['consumer_ids']}"
        )
    return lines


def _agreement(
    cluster: Cluster, watch: RaftWatch, clock: Callable[[], float], timeout_s: float = 30.0
) -> Agreement:
    """Audit every node at once, again and again, until some index was audited on every
    node (the leader proposes a `Tick` every second while the queue remembers producers,
    so the index moves on while the audits run) or `timeout_s` passed."""
    nodes = list(cluster.nodes)
    audited: dict[str, dict[int, str]] = {n: {} for n in nodes}
    tried: collections.Counter[str] = collections.Counter()
    failed: collections.Counter[str] = collections.Counter()
    last_error: dict[str, str] = {}
    last_audit: dict[str, tuple[int, str]] = {}
    took: dict[str, float] = dict.fromkeys(nodes, 0.0)

    def audit(node: str) -> tuple[str, tuple[int, str] | None, str | None]:
        began = time.monotonic()
        try:
            status = cluster.status(node, audit=True)
        except (QuorumqError, OSError) as e:
            return node, None, f"{type(e).__name__}: {e}"
        finally:
            took[node] = max(took[node], time.monotonic() - began)
        return node, (status["machine_index"], status["digest"]), None

    deadline = time.monotonic() + timeout_s
    with ThreadPoolExecutor(len(nodes)) as pool:
        while True:
            for node, result, error in pool.map(audit, nodes):
                tried[node] += 1
                if result is None:
                    failed[node] += 1
                    last_error[node] = error or ""
                else:
                    audited[node][result[0]] = result[1]
                    last_audit[node] = result
            verdict, detail = decide(audited)
            if verdict != "inconclusive" or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    rounds = max(tried.values(), default=0)
    detail += f"; {rounds} round(s), the longest audit " + ", ".join(
        f"{n} {took[n]:.2f} s" for n in nodes
    )
    if verdict == "agree":
        return Agreement(verdict=verdict, detail=detail)
    now = clock()
    with watch.lock:
        latest, errors = dict(watch.latest), dict(watch.errors)
        advanced = dict(watch.advanced_at)
    top = max((s["commit_index"] for _, s in latest.values()), default=None)
    evidence = []
    for node in nodes:
        seen = latest.get(node)
        status = seen[1] if seen else None
        evidence.append(
            NodeEvidence(
                node=node,
                alive=cluster.alive(node),
                status=status,
                status_age_s=now - seen[0] if seen else None,
                status_error=errors.get(node),
                behind=None if status is None or top is None else top - status["last_applied"],
                stalled_s=now - advanced[node] if node in advanced else None,
                audits=tried[node],
                last_audit=last_audit.get(node),
                audit_error=last_error.get(node),
                audit_errors=failed[node],
                audit_s=took[node],
                log_tail=log_tail(cluster.log_path(node)),
            )
        )
    return Agreement(verdict=verdict, detail=detail, evidence=tuple(evidence))


def _duration(text: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600}
    if text and text[-1] in units:
        return float(text[:-1]) * units[text[-1]]
    return float(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m simulations.chaos",
        description="Run a real 3-node cluster under faults and check every message.",
    )
    parser.add_argument("--duration", type=_duration, default=90.0, help="e.g. 90, 10m, 8h")
    parser.add_argument("--seed", type=int, default=0, help="seeds the fault schedule")
    parser.add_argument("--producers", type=int, default=3)
    parser.add_argument("--rate", type=float, default=100.0, help="msg/s per producer")
    parser.add_argument("--node-down-grace", type=float, default=2.0, metavar="SECONDS")
    parser.add_argument("--quiet", action="store_true", help="no line per fault")
    parser.add_argument(
        "--data-dir", help="keep the nodes' data and logs here (default: a temporary dir)"
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning"],
        help="the nodes' log level (info or debug: elections are counted from the logs)",
    )
    parser.add_argument(
        "--faults",
        choices=["mixed", "none"],
        default="mixed",
        help="none: no fault at all, and the run fails on any election",
    )
    parser.add_argument(
        "--cpu-hog",
        type=int,
        default=0,
        metavar="N",
        help="N busy-looping processes beside the cluster while the faults (or none) run",
    )
    parser.add_argument(
        "--compaction-entries",
        type=int,
        default=50_000,
        help="log entries between snapshots (lower: more snapshot installs)",
    )
    args = parser.parse_args(argv)
    report = run_chaos(
        args.duration,
        seed=args.seed,
        producers=args.producers,
        rate=args.rate,
        node_down_grace=args.node_down_grace,
        data_dir=args.data_dir,
        log_level=args.log_level,
        compaction_entries=args.compaction_entries,
        fault_mode=args.faults,
        hogs=args.cpu_hog,
        log=(lambda _line: None) if args.quiet else print,
    )
    print(report.summary())
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
