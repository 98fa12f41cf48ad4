"""How long confirms and deliveries paused around each kind of fault (`quorumq simulate`
prints it): the gap arithmetic, and a run whose leader is killed."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from simulations.pauses import Pauses, fault_pauses, longest_gap
from simulations.runner import RunConfig, run
from simulations.workload import WorkloadConfig


def test_the_longest_gap_that_overlaps_the_window_counts_whole() -> None:
    times = [0.0, 0.1, 0.2, 1.5, 1.6, 3.0]
    assert longest_gap(times, 0.15, 0.3) == 1.5 - 0.2  # starts inside, ends after
    assert longest_gap(times, 1.0, 1.2) == 1.5 - 0.2  # the window inside one gap
    assert round(longest_gap(times, 1.55, 1.58), 9) == 0.1
    assert round(longest_gap(times, 2.0, 2.5), 9) == 1.4  # 1.6 .. 3.0
    assert longest_gap(times, 3.5, 4.0) == 1.0  # nothing since 3.0: open until the end
    assert longest_gap([], 1.0, 2.0) == 1.0


@given(
    st.lists(st.floats(0, 100, allow_nan=False), max_size=40).map(sorted),
    st.floats(0, 100, allow_nan=False),
    st.floats(0, 10, allow_nan=False),
)
def test_a_gap_is_never_shorter_than_any_gap_inside_the_window(
    times: list[float], start: float, length: float
) -> None:
    end = start + length
    gap = longest_gap(times, start, end)
    inside = [b - a for a, b in itertools.pairwise(times) if b >= start and a <= end]
    assert all(gap >= g for g in inside)
    assert gap >= 0


def test_each_fault_kind_gets_the_quantiles_of_its_faults_pauses() -> None:
    times = [x / 100 for x in range(0, 1000)]  # an event every 10 ms for 10 s...
    times = [t for t in times if not 2.0 < t < 2.5 and not 6.0 < t < 7.0]  # ...but two
    faults = [("kill_leader", 2.0, 0.0), ("kill_leader", 6.0, 0.0), ("pause", 9.0, 0.2)]
    pauses = fault_pauses(faults, times, until_s=10.0)  # (events run until 9.99)
    assert pauses["kill_leader"].count == 2
    assert round(pauses["kill_leader"].max, 6) == 1.0  # 6.0 .. 7.0
    assert round(pauses["pause"].max, 6) == 0.01
    assert "late" not in fault_pauses([("late", 30.0, 1.0)], times, until_s=20.0)


def test_a_killed_leader_pauses_confirms_and_the_summary_says_how_long() -> None:
    result = run(
        RunConfig(
            seed=1,
            faults="kill_leader",
            steps=1200,
            fault_interval_s=4.0,
            disk_faults=False,
            membership_faults=False,
            workload=WorkloadConfig(rate=200),
        )
    )
    assert result.ok, result.summary()
    kill = result.confirm_pauses["kill_leader"]
    assert isinstance(kill, Pauses) and kill.count >= 2
    assert 0.1 < kill.max < 5  # an election, not the 10 ms between confirms
    assert result.delivery_pauses["kill_leader"].max > 0.1
    assert "pauses around faults" in result.summary()
