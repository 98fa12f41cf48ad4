"""Quiescence in whole simulated clusters (`quorumq.raft.quiescence`): an idle cluster
goes quiet, and a quiet cluster still notices a lost leader, or a lost follower, within
the bounds the docs state. Scripted runs: seed 3, no random faults, B leads from the
start, producers publish for 3 s and then rest for 6 s (`bursts`), so from about 4.5 s
(the slow consumers' last acks) the cluster is idle; each fault strikes at 6 s."""

from __future__ import annotations

import collections
from typing import Any

import pytest

from quorumq.raft.rules import QUIET, QUIET_HEARTBEAT_S, RaftRules
from simulations import network as sim_network
from simulations import node as sim_node
from simulations.faults import Fault
from simulations.runner import Result, RunConfig, run
from simulations.workload import WorkloadConfig

ELECTION_MAX_S = 0.6
"""The simulated nodes' longest election timeout."""
ELECTION_ROUND_S = 0.25
"""A pre-vote and a vote round, with ticks and latency, and room."""
FAULT_AT_S = 6.0


def _scripted(*faults: Fault, steps: int = 1200) -> RunConfig:
    workload = WorkloadConfig(rate=20, bursts=(3.0, 6.0))
    return RunConfig(seed=3, faults="none", steps=steps, workload=workload, scripted=faults)


def _run(config: RunConfig, monkeypatch: pytest.MonkeyPatch, *, quiescence: bool = True) -> Any:
    with monkeypatch.context() as patch:
        patch.setattr(RaftRules, "quiescence", quiescence)
        return run(config)


def _next_leader_after(result: Result, at_s: float, old: str) -> float:
    """Seconds from `at_s` until a node other than `old` became leader."""
    starts = [
        start
        for name, lane in result.history.lanes.items()
        if name != old
        for start, _end in lane.led
        if start >= at_s
    ]
    assert starts, result.summary()
    return min(starts) - at_s


class _Traffic:
    """Raft messages sent and ticks run, per simulated second."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.messages: collections.Counter[int] = collections.Counter()
        self.quiet: collections.Counter[int] = collections.Counter()
        self.ticks: collections.Counter[int] = collections.Counter()
        self.stalls = 0
        send, tick, look = sim_network.Network.send, sim_node.SimNode._run_tick, RaftRules._look

        def counted_send(network: Any, src: str, dst: str, message: Any, group: int = 0) -> bool:
            second = network.world.now_us // 1_000_000
            self.messages[second] += 1
            if isinstance(message, dict) and QUIET in message:
                self.quiet[second] += 1
            return bool(send(network, src, dst, message, group))

        def counted_tick(node: Any, body: Any) -> None:
            self.ticks[node.world.now_us // 1_000_000] += 1
            tick(node, body)

        def counted_look(member: RaftRules) -> float | None:
            stalled_from = look(member)
            self.stalls += stalled_from is not None
            return stalled_from

        monkeypatch.setattr(sim_network.Network, "send", counted_send)
        monkeypatch.setattr(RaftRules, "_look", counted_look)
        monkeypatch.setattr(sim_node.SimNode, "_run_tick", counted_tick)

    def per_second(self, counter: collections.Counter[int], seconds: range) -> float:
        return sum(counter[s] for s in seconds) / len(seconds)


IDLE = range(5, 8)
"""Whole simulated seconds in which the scripted cluster is idle."""


def test_an_idle_cluster_sends_and_ticks_a_fraction_of_a_busy_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Idle, a 3-node cluster sends quiet heartbeats 2.5 times a second per follower,
    their answers and the followers' keepalives (about 12 messages a second), and its
    nodes tick when something comes or is due. Switched off, the same idle seconds
    carry a heartbeat per follower every tick or two, and every node ticks 20 times a
    second. No node takes its own quiet wait for a stall (it would judge no peer's
    silence across it)."""
    traffic = _Traffic(monkeypatch)
    quiet = _run(_scripted(steps=900), monkeypatch)
    assert quiet.ok and quiet.leader_changes == 1, quiet.summary()  # B leads throughout
    quiet_messages = traffic.per_second(traffic.messages, IDLE)
    quiet_ticks = traffic.per_second(traffic.ticks, IDLE) / 3
    assert traffic.per_second(traffic.quiet, IDLE) >= 4, dict(traffic.quiet)
    assert quiet_messages <= 16, dict(traffic.messages)
    assert quiet_ticks <= 8, dict(traffic.ticks)
    assert traffic.stalls == 0  # a quiet tick's long wait is no stall

    traffic = _Traffic(monkeypatch)
    busy = _run(_scripted(steps=900), monkeypatch, quiescence=False)
    assert busy.ok, busy.summary()
    assert not traffic.quiet
    assert traffic.per_second(traffic.messages, IDLE) >= 3 * quiet_messages, dict(traffic.messages)
    assert traffic.per_second(traffic.ticks, IDLE) / 3 >= 2.5 * quiet_ticks, dict(traffic.ticks)


@pytest.mark.parametrize(
    "fault",
    [
        Fault(at_s=FAULT_AT_S, kind="partition", nodes=("B",), duration_s=3.0),
        Fault(at_s=FAULT_AT_S, kind="pause", nodes=("B",), duration_s=3.0),
        Fault(at_s=FAULT_AT_S, kind="slow_host", nodes=("B",), duration_s=3.0),
    ],
    ids=lambda f: f.kind,
)
def test_a_quiet_leader_lost_with_its_connections_open_is_replaced_within_the_bound(
    fault: Fault, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The leader (B) cut off, paused or stalled on an idle cluster, its connections
    open: a follower notices within the quiet heartbeat period plus the longest
    election timeout, and A or C leads a pre-vote and a vote later. Busy (quiescence
    off), a heartbeat period less; the run passes every check either way."""
    quiet = _run(_scripted(fault), monkeypatch)
    assert quiet.ok, quiet.summary()
    took = _next_leader_after(quiet, FAULT_AT_S, "B")
    assert took <= QUIET_HEARTBEAT_S + ELECTION_MAX_S + ELECTION_ROUND_S, quiet.summary()

    busy = _run(_scripted(fault), monkeypatch, quiescence=False)
    assert busy.ok, busy.summary()
    assert _next_leader_after(busy, FAULT_AT_S, "B") <= 0.1 + ELECTION_MAX_S + ELECTION_ROUND_S


def test_a_quiet_leader_that_crashes_is_replaced_as_fast_as_a_busy_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A crash closes the leader's connections, and a follower that sees its leader's
    connection close elects within two busy heartbeat periods: quiet or busy, the same
    time (about 0.55 s here: the followers' dials to B are refused, in turn)."""
    crash = Fault(at_s=FAULT_AT_S, kind="crash", nodes=("B",), duration_s=3.0)
    quiet = _run(_scripted(crash), monkeypatch)
    assert quiet.ok, quiet.summary()
    busy = _run(_scripted(crash), monkeypatch, quiescence=False)
    assert busy.ok, busy.summary()
    took, busy_took = (_next_leader_after(r, FAULT_AT_S, "B") for r in (quiet, busy))
    assert took <= busy_took + 0.05 and took <= ELECTION_MAX_S + ELECTION_ROUND_S, (took, busy_took)


def test_a_follower_lost_on_a_quiet_cluster_is_marked_down_after_the_grace_and_no_other(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A (a follower) paused for 7 s on an idle cluster, past the 5 s node-down grace:
    its silence ends the leader's quiet, and it is marked down once, legitimately (the
    liveness check fails a run with a false down)."""
    pause = Fault(at_s=FAULT_AT_S, kind="pause", nodes=("A",), duration_s=7.0)
    result = _run(_scripted(pause, steps=1500), monkeypatch)
    assert result.ok, result.summary()
    assert result.liveness.downs >= 1 and not result.liveness.false_downs, result.summary()
