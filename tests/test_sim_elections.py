"""The election rules inside whole simulated clusters: the runs issue 27 found stuck
pass, and each rule switched off is caught by a seed named here."""

from __future__ import annotations

from simulations.runner import RunConfig, run


def test_a_removed_node_that_missed_its_removal_no_longer_trades_leadership() -> None:
    """Seed 110 of the default profile (`quorumq simulate run --seed 110`): after the
    heal, C (removed while cut off) and D took leadership from each other every 2-5 s
    for 180 s, 1,009 confirmed records were never delivered, and B ended 352 entries
    behind. Votes from outside the configuration are ignored now, and pre-vote keeps a
    node that cannot win from raising its term."""
    result = run(RunConfig(seed=110))
    assert result.ok, result.summary()
    assert result.leader_changes <= 10, result.summary()
