"""The real-process chaos run (bounded for CI), and its checker on made-up histories."""

from __future__ import annotations

import pytest

from simulations.chaos import Producer, Received, check, run_chaos


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


@pytest.mark.slow
def test_a_bounded_chaos_run_loses_and_duplicates_nothing() -> None:
    # Compaction every 2,000 entries, so that followers that fall behind install the
    # leader's snapshot in every run. The harness's lines (faults, and what an
    # unfinished drain waited for) go into the failure message.
    lines: list[str] = []
    report = run_chaos(60.0, seed=2024, log=lines.append, compaction_entries=2000)
    print(report.summary())
    assert sum(report.faults.values()) >= 6
    assert report.confirmed > 1000
    assert report.passed, "\n".join([report.summary(), *lines[-40:]])
