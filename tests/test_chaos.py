"""The real-process chaos run (bounded for CI), and its checker on made-up histories."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from quorumq.client import ServerError
from simulations.chaos import RaftWatch, _agreement, run_chaos
from simulations.chaos_checks import (
    Agreement,
    ChaosReport,
    Down,
    FaultLog,
    check,
    decide,
    false_downs,
)
from simulations.chaos_clients import Producer, Received


def producer(number: int, sent: int, confirmed: set[int], unconfirmed: set[int]) -> Producer:
    p = Producer.__new__(Producer)
    p.number, p.sent, p.confirmed, p.unconfirmed = number, sent, confirmed, unconfirmed
    return p


def got(seq: int, offset: int, redelivered: bool = False, consumer: str = "A#1") -> Received:
    return Received(0, seq, offset, "k", redelivered, consumer[0], consumer)


def test_the_checker_passes_a_clean_history_with_marked_redeliveries() -> None:
    p = producer(0, 3, {0, 1}, {2})
    history = [got(0, 0), got(1, 1), got(1, 1, redelivered=True, consumer="B#1"), got(2, 2)]
    assert check([p], history) == (3, 0, 0, 0, 1, 0)  # seq 2's confirm was lost: recovered


def test_the_checker_catches_loss_duplicates_strangers_and_disorder() -> None:
    p = producer(0, 3, {0, 1, 2}, set())
    assert check([p], [got(0, 0), got(1, 1)])[1] == 1  # seq 2 lost
    assert check([p], [got(0, 0), got(1, 1), got(2, 2), got(2, 2, consumer="B#1")])[2] == 1
    assert check([p], [got(0, 0), got(1, 1), got(2, 2), got(7, 9)])[3] == 1  # never sent
    assert check([p], [got(0, 0), got(2, 2), got(1, 1)])[5] == 1  # out of order


def test_agreement_needs_one_index_audited_everywhere_with_one_digest() -> None:
    # the index moves on between audits (a Tick a second): any index seen on every node
    assert decide({"A": {5: "x", 6: "y"}, "B": {6: "y"}, "C": {4: "w", 6: "y"}})[0] == "agree"
    assert decide({"A": {5: "x"}, "B": {6: "y"}, "C": {6: "y"}})[0] == "inconclusive"
    assert decide({"A": {5: "x"}, "B": {5: "x"}, "C": {}})[0] == "inconclusive"
    verdict, detail = decide({"A": {5: "x"}, "B": {5: "z"}, "C": {6: "y"}})
    assert verdict == "diverged" and "at index 5" in detail


class FakeCluster:
    """What the agreement check asks of a cluster: C is 40 entries behind, and its
    audit fails."""

    nodes = ["A", "B", "C"]

    def __init__(self, root: Path) -> None:
        self.root = root
        for node in self.nodes:
            lines = [f"{node} line {i}" for i in range(30)] + ["x INFO proposing Tick()"] * 5
            self.log_path(node).write_text("\n".join(lines) + "\n")

    def log_path(self, node: str) -> Path:
        return self.root / f"{node}.log"

    def alive(self, node: str) -> bool:
        return True

    def status(self, node: str, *, audit: bool = False) -> dict[str, Any]:
        if node == "C":
            raise ServerError("audit_failed", "the audit's child process ended with -9")
        return {"machine_index": 100, "digest": "d" * 64}


def status(term: int, leader: str, applied: int, *, down: tuple[str, ...] = ()) -> dict[str, Any]:
    return {
        "term": term,
        "leader": leader,
        "is_leader": False,
        "commit_index": applied,
        "last_applied": applied,
        "machine_index": applied,
        "down_nodes": list(down),
        "connected": [],
        "snapshots_loaded": 0,
        "compaction_error": None,
    }


def report(**changes: Any) -> ChaosReport:
    fields: dict[str, Any] = dict(
        seed=1, duration_s=60.0, faults={}, sent=10, confirmed=10, unconfirmed=0,
        delivered=10, lost=0, duplicated=0, unexpected=0, recovered=0, order_violations=0,
        redeliveries=0, agreement=Agreement(verdict="agree", detail="index 1"), drained=True,
    )  # fmt: skip
    return ChaosReport(**{**fields, **changes})


def test_a_failed_agreement_names_each_nodes_figures_audit_and_log_tail(tmp_path: Path) -> None:
    cluster = FakeCluster(tmp_path)
    watch = RaftWatch(cluster, lambda: 0.0)  # type: ignore[arg-type]
    watch.saw("A", {**status(7, "A", 140), "is_leader": True}, at=0.0)
    watch.saw("B", status(7, "A", 140), at=0.0)
    watch.saw("C", status(6, "A", 100), at=0.0)
    agreement = _agreement(cluster, watch, lambda: 31.0, timeout_s=0.0)  # type: ignore[arg-type]
    assert agreement.verdict == "inconclusive"
    text = report(agreement=agreement).summary()
    assert "replicas agree: False (inconclusive: no index audited on every node" in text
    assert "A (running): applied 140, machine 140, commit 140, term 7, leader" in text
    assert "C (running): applied 100, machine 100, commit 100, term 6, follower of A" in text
    assert "behind by 40 entries; applied index last moved 31.0 s ago" in text
    assert "audits: 1 tried, 1 failed, the longest " in text
    assert "s; none succeeded; last failure: ServerError" in text
    assert "the audit's child process ended with -9" in text
    assert "      C line 29" in text and "(5 'proposing Tick()' lines left out)" in text
    assert "verdict: FAIL" in text


def test_the_watch_counts_leaders_once_and_sees_the_leader_mark_a_node_down() -> None:
    watch = RaftWatch(FakeCluster.__new__(FakeCluster), lambda: 0.0)  # type: ignore[arg-type]
    leading = {**status(3, "A", 10), "is_leader": True}
    watch.saw("B", status(3, "A", 10), at=1.0)
    watch.saw("A", leading, at=1.2)
    watch.saw("A", {**leading, "down_nodes": ["C"]}, at=2.0)
    watch.saw("B", status(3, "A", 9), at=2.2)  # a follower behind: C not down there yet
    watch.saw("A", {**leading, "down_nodes": ["C"], "last_applied": 11}, at=2.5)
    watch.saw("B", status(4, "B", 12), at=3.0)
    assert [(t, leader) for _, t, leader in watch.leaders] == [(3, "A"), (4, "B")]
    assert watch.max_term == 4 and watch.advanced_at["A"] == 2.5
    assert watch.downs == [Down(at=2.0, node="C", seen_by="leader A's status at term 3")]
    assert watch.leader_at(2.9) == "A" and watch.leader_at(3.0) == "B"


def test_a_down_no_pause_or_kill_of_its_node_explains_is_a_false_down() -> None:
    faults = FaultLog()
    faults.end(faults.begin("A", "pause", 10.0), 13.0)
    faults.begin("B", "kill", 20.0)  # never restarted: still under way
    downs = [
        Down(at=12.5, node="A", seen_by="leader B's status"),  # during the pause
        Down(at=19.0, node="A", seen_by="consumer A.1's cancel"),  # within 2 + 5 s after
        Down(at=30.0, node="B", seen_by="leader C's status"),  # B is still down
        Down(at=21.0, node="A", seen_by="consumer A.2's cancel"),  # 8 s after: false
        Down(at=5.0, node="C", seen_by="leader A's status"),  # C never faulted: false
    ]
    wrong = false_downs(downs, faults, 2.0 + 5.0, lambda at: "B")
    assert [(f.down.node, f.down.at) for f in wrong] == [("A", 21.0), ("C", 5.0)]
    assert "its last fault: pause 10.0-13.0 s, over 8.0 s before" in wrong[0].render()
    assert "the harness never paused or killed it" in wrong[1].render()
    text = report(false_downs=tuple(wrong), cancels=2, marks=3).summary()
    assert "downs: 2 node_down cancels of consumers, 3 nodes marked down" in text
    assert "in the leader's status; false downs 2" in text
    assert "verdict: FAIL" in text
    assert "false down: C at 5.0 s, seen by leader A's status" in text


def test_the_summary_shows_the_nodes_counters_when_they_report_them() -> None:
    assert "node counters" not in report().summary()  # nodes from before issue 27
    counts = {"elections": 0, "pre_votes_lost": 3, "stalls": 1}
    text = report(counters={"A": counts, "B": {**counts, "stalls": 4}}).summary()
    assert "elections A 0, B 0; pre votes lost A 3, B 3; stalls A 1, B 4" in text


def test_a_run_without_faults_fails_on_an_election() -> None:
    assert report(fault_mode="none").passed
    assert report(fault_mode="mixed", elections=3).passed
    failed = report(fault_mode="none", elections=1, leader_terms=((5, "B"),))
    assert not failed.passed
    assert "a run without faults expects none" in failed.summary()
    assert "leaders: B at term 5" in failed.summary()


@pytest.mark.slow
def test_a_bounded_chaos_run_loses_and_duplicates_nothing() -> None:
    # Compaction every 2,000 entries, so that followers that fall behind install the
    # leader's snapshot in every run. The harness's lines (faults, and what an
    # unfinished drain waited for) go into the failure message.
    lines: list[str] = []
    report = run_chaos(60.0, seed=2024, log=lines.append, compaction_entries=2000)
    print(report.summary())
    assert sum(report.faults.values()) >= 6
    assert report.confirmed > 200  # the workload ran (about 17/s on a loaded CI at least)
    assert report.passed, "\n".join([report.summary(), *lines[-40:]])
