"""What a chaos run (`simulations.chaos`) checks and reports: the deliveries recorded, the
faults played and the nodes marked down (false downs among them), the evidence of each
node and the agreement of their digests, and the report (`ChaosReport`, from `check`)."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any

import attrs

from .chaos_clients import Producer, Received

CATCH_UP_S = 5.0
"""A node marked down while it was paused or dead may learn it (and cancel its
consumers) only once it runs again and has caught up, by a snapshot install at worst:
a down within the node-down grace plus this after a fault of the node is explained."""

COUNTERS = ("elections", "pre_votes_lost", "stalls")
"""What a node counts since its process started (nodes with issue 27's Raft rules)."""


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
