"""Quiescence, rule by rule, on one real member whose sends are recorded and whose clock
is set by hand (`quorumq.raft.quiescence`; whole clusters in test_sim_quiescence); and
the answers to proposals a deposed leader will never apply itself, which an idle
cluster's log no longer reaches within a second (`Receiving._answer_cut_proposals`)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from quorumq.raft.rules import (
    HELLO,
    QUIESCES,
    QUIET,
    QUIET_HEARTBEAT_S,
    QUIET_KEEPALIVE_S,
    QUIET_TICK_S,
    SPEAKS_PRE_VOTE,
)

from . import test_raft_elections as elections
from .test_raft_elections import Clock, _heartbeat, _log, _of

clock = elections.clock  # the fixtures: a member of {A, B, C} on a clock set by hand
cluster = elections.cluster


def _quiet_leader(member: Any, peers: list[Any], clock: Clock) -> None:
    """Leading, its log (PySyncObj's first entry and its own no-op) committed, applied,
    held by both peers, who said hello and answered just now; of a cluster that chose
    its identity (a leader that knows none proposes one, and is busy until then)."""
    member.cluster_identity = "0123456789abcdef0123456789abcdef"
    member._SyncObj__onBecomeLeader()
    last = member._SyncObj__getCurrentLogIndex()
    member._SyncObj__raftCommitIndex = member._SyncObj__raftLastApplied = last
    for peer in peers:
        member._SyncObj__raftMatchIndex[peer] = last
        member._SyncObj__raftNextIndex[peer] = last + 1
        member._SyncObj__onMessageReceived(
            peer, {"type": HELLO, SPEAKS_PRE_VOTE: True, QUIESCES: True}
        )
        member._answered_at[peer] = clock.now


def test_a_caught_up_leader_heartbeats_quietly_and_anything_unsettled_makes_it_busy(
    cluster: Any, clock: Clock
) -> None:
    member, peers, sent = cluster
    _quiet_leader(member, peers, clock)
    sent.clear()
    member._SyncObj__sendAppendEntries()
    beats = _of(sent, "append_entries")
    assert sorted(n.name for n, _ in beats) == ["B", "C"]
    assert all(m[QUIET] == QUIET_HEARTBEAT_S and m["entries"] == [] for _, m in beats)
    assert beats[0][1]["prevLogIdx"] == member._SyncObj__getCurrentLogIndex()
    assert member._SyncObj__newAppendEntriesTime == clock.now + QUIET_HEARTBEAT_S
    assert member.quiet

    def busy_after(change: Any) -> bool:
        _quiet_leader(member, peers, clock)
        change()
        return member.quiet_period_s() == 0

    assert busy_after(lambda: member._SyncObj__raftMatchIndex.__setitem__(peers[0], 1))
    assert busy_after(lambda: member._SyncObj__connectedNodes.discard(peers[1]))
    assert busy_after(lambda: member._SyncObj__onNodeDisconnected(peers[1]))
    assert busy_after(lambda: setattr(clock, "now", clock.now + 2.01 * QUIET_HEARTBEAT_S))
    assert busy_after(lambda: member._quiet_speakers.discard(peers[0]))  # an older version
    assert busy_after(lambda: setattr(member, "_SyncObj__raftCommitIndex", 1))
    assert busy_after(lambda: setattr(member, "_SyncObj__transferInProgress", True))
    member._SyncObj__transferInProgress = False
    assert busy_after(lambda: member._applyCommand(b"\x04x", None))
    member.quiescence = False
    assert busy_after(lambda: None)


def test_a_leader_sends_a_heartbeat_to_a_peer_that_connects_at_once(
    cluster: Any, clock: Clock
) -> None:
    member, peers, _ = cluster
    _quiet_leader(member, peers, clock)
    member._SyncObj__sendAppendEntries()
    member._SyncObj__onNodeConnected(peers[0])
    assert member._SyncObj__newAppendEntriesTime == 0.0


def test_a_quiet_heartbeat_moves_a_followers_deadline_and_lease_out_by_its_period(
    cluster: Any, clock: Clock
) -> None:
    member, peers, _ = cluster
    leader = peers[0]
    member._SyncObj__onMessageReceived(leader, _heartbeat(5))
    busy_deadline = member._SyncObj__raftElectionDeadline - clock.now
    assert 0.25 <= busy_deadline <= 0.6 and member.leader_quiet_s == 0

    member._SyncObj__onMessageReceived(leader, {**_heartbeat(5), QUIET: QUIET_HEARTBEAT_S})
    quiet_deadline = member._SyncObj__raftElectionDeadline - clock.now
    assert QUIET_HEARTBEAT_S + 0.25 <= quiet_deadline <= QUIET_HEARTBEAT_S + 0.6
    assert member.leader_quiet_s == QUIET_HEARTBEAT_S and member.quiet
    clock.now += 0.25 + QUIET_HEARTBEAT_S - 0.01
    assert member.in_lease()  # a pre-vote now would be refused: the leader may be quiet
    clock.now += 0.02
    assert not member.in_lease()

    for nonsense in (1e9, -1.0, "0.5", True, None, 10**400, math.nan, math.inf):
        member._SyncObj__onMessageReceived(leader, {**_heartbeat(5), QUIET: nonsense})
        assert member.leader_quiet_s == 0, nonsense
        assert member._SyncObj__raftElectionDeadline - clock.now <= 0.6

    member._SyncObj__onMessageReceived(leader, {**_heartbeat(5), QUIET: QUIET_HEARTBEAT_S})
    member._SyncObj__onMessageReceived(leader, {**_heartbeat(5), "entries": []})
    assert member.leader_quiet_s == 0  # any busy message: the busy deadline again


def test_a_quiet_followers_tick_waits_for_its_deadline_not_a_whole_quiet_tick(
    cluster: Any, clock: Clock
) -> None:
    """The engine's poll after the tick waits until just past the election deadline (it
    waited up to a whole quiet tick longer when the wait was decided while `_onTick`
    held the deadline aside, and a stopped leader was replaced in 1.5 s, not 0.5)."""
    member, peers, _ = cluster
    waits: list[float] = []
    engine = member._engine
    engine.add(member)
    engine.poller.poll = waits.append
    member._SyncObj__onMessageReceived(peers[0], {**_heartbeat(5), QUIET: QUIET_HEARTBEAT_S})
    member._keepalive_due = clock.now + QUIET_KEEPALIVE_S
    member._SyncObj__raftElectionDeadline = clock.now + 0.3
    engine._round()
    assert waits and math.isclose(waits[-1], 0.301), waits

    member._SyncObj__raftElectionDeadline = clock.now + 5.0  # (not a real one: the cap)
    engine._round()
    assert math.isclose(waits[-1], min(QUIET_TICK_S, QUIET_KEEPALIVE_S)), waits

    member._SyncObj__onMessageReceived(peers[0], _heartbeat(5))  # busy again
    engine._round()
    assert waits[-1] == engine.tick_period == 0.05


def test_a_long_quiet_wait_is_no_stall_and_a_longer_one_is(cluster: Any, clock: Clock) -> None:
    member, _, _ = cluster
    member._look()
    member.planned_wait_s = QUIET_TICK_S
    clock.now += QUIET_TICK_S + 0.1
    assert member._look() is None
    member.planned_wait_s = QUIET_TICK_S
    clock.now += QUIET_TICK_S + 0.2
    assert member._look() is not None


@pytest.mark.parametrize("quiet", [True, False])
def test_a_followers_keepalives_slow_down_only_while_its_leader_is_quiet(
    cluster: Any, clock: Clock, quiet: bool
) -> None:
    member, peers, _ = cluster
    extra = {QUIET: QUIET_HEARTBEAT_S} if quiet else {}
    member._SyncObj__onMessageReceived(peers[0], {**_heartbeat(5), **extra})
    member._keepalive_due = 0.0
    member.keep_peer_connections_alive()
    assert member._keepalive_due - clock.now == (QUIET_KEEPALIVE_S if quiet else 0.5)


def test_proposals_of_a_deposed_leader_cut_from_its_log_are_answered_at_once(
    cluster: Any, clock: Clock
) -> None:
    """Entries 2-4 appended while leading term 5, with callbacks waiting; a leader of
    term 6 replaces them from index 2: all three are answered now, outcome unknown
    (`LEADER_CHANGED`), not when the log next reaches their indices (an idle cluster's
    log may take long to), and never twice."""
    from pysyncobj import FAIL_REASON

    member, peers, _ = cluster
    _log(member, [5, 5, 5])
    answers: list[tuple[int, int]] = []
    waiting = member._SyncObj__commandsWaitingCommit
    for index in (2, 3, 4):
        waiting[index].append((5, lambda _r, why, i=index: answers.append((i, why))))
    replace = {**_heartbeat(6), "entries": [(b"\x04new", 2, 6)]}
    member._SyncObj__onMessageReceived(peers[0], replace)
    assert sorted(answers) == [(i, FAIL_REASON.LEADER_CHANGED) for i in (2, 3, 4)]
    assert not waiting
    member._SyncObj__onMessageReceived(peers[0], {**_heartbeat(6), "commit_index": 2})
    assert len(answers) == 3


def test_a_proposal_still_in_the_followers_log_keeps_waiting(cluster: Any, clock: Clock) -> None:
    member, peers, _ = cluster
    _log(member, [5, 5])
    answers: list[int] = []
    member._SyncObj__commandsWaitingCommit[3].append((5, lambda _r, why: answers.append(why)))
    # and one forwarded to the leader of this term, past this log's end: it comes
    member._SyncObj__commandsWaitingCommit[6].append((5, lambda _r, why: answers.append(why)))
    keep = {**_heartbeat(5), "prevLogIdx": 3, "prevLogTerm": 5}
    member._SyncObj__onMessageReceived(peers[0], keep)
    assert not answers and member._SyncObj__commandsWaitingCommit[3]
    assert member._SyncObj__commandsWaitingCommit[6]


def test_a_new_leader_credits_the_last_quiet_heartbeat_not_a_stale_one() -> None:
    """C hears A's quiet heartbeats (A's clock), then B, behind (restarted, it saw no
    entry arrive), leads and stamps an entry C receives; C then takes over. The entry
    came after the heartbeat: C continues B's time, or queue time would jump 10 s in
    half a second of true time (a TTL counted from B's stamps would end early). A node
    restarted during a quiet spell (it saw nothing arrive) continues the heartbeat's."""
    from quorumq.raft.rules import LeaderClock

    true_ms = [1_000_000]

    def node() -> LeaderClock:
        return LeaderClock(wall_ms=lambda: 0, monotonic=lambda: true_ms[0] / 1000)

    a, b, c = node(), node(), node()
    a.take_over(1, 1_000)
    true_ms[0] += 10_000
    told = a.peek(1)
    assert told == 11_000
    c.heard(told, 1)
    true_ms[0] += 1_000
    b.take_over(2, 1_000)  # behind: it saw no entry arrive
    true_ms[0] += 1_000
    stamped = b.now(2)
    assert stamped == 2_000
    c.seen(stamped)
    true_ms[0] += 500
    c.take_over(3, stamped)
    assert c.now(3) == 2_500

    restarted = node()
    restarted.heard(told, 1)
    true_ms[0] += 700
    restarted.take_over(2, 1_000)  # its log's last stamp, arrived before its restart
    assert restarted.now(2) == told + 700  # not 1,000 and on


def test_quiet_heartbeats_tell_the_leaders_time_and_followers_keep_it(
    cluster: Any, clock: Clock
) -> None:
    from quorumq.raft.rules import QUIET_TIME, LeaderClock

    member, peers, sent = cluster
    _quiet_leader(member, peers, clock)
    member.leader_clock = LeaderClock(wall_ms=lambda: 0, monotonic=lambda: clock.now)
    member.leader_clock.take_over(member.raftCurrentTerm, 5_000)
    member.replicated_time_ms = lambda: 5_000
    sent.clear()
    clock.now += 0.5
    for peer in peers:
        member._answered_at[peer] = clock.now
    member._SyncObj__sendAppendEntries()
    assert {m[QUIET_TIME] for _, m in _of(sent, "append_entries")} == {5_500}

    follower = LeaderClock(wall_ms=lambda: 0, monotonic=lambda: clock.now)
    member._SyncObj__setState(0)  # a follower again, of peers[0]
    member.leader_clock = follower
    beat = {**_heartbeat(member.raftCurrentTerm), QUIET: QUIET_HEARTBEAT_S, QUIET_TIME: 5_500}
    member._SyncObj__onMessageReceived(peers[0], beat)
    assert follower._heard == (5_500, clock.now, member.raftCurrentTerm)
    clock.now += 0.5
    for nonsense in ("6000", 2**70, -1, True):
        member._SyncObj__onMessageReceived(peers[0], {**beat, QUIET_TIME: nonsense})
    assert follower._heard == (5_500, clock.now - 0.5, member.raftCurrentTerm)  # nonsense ignored


def test_what_an_earlier_terms_leader_told_is_forgotten_once_a_later_one_is_heard() -> None:
    """F hears A's quiet heartbeats for an hour; B, restarted an hour behind, leads term
    2 and F installs its snapshot (no entry arrives); F then takes over. Crediting A's
    heartbeat would move queue time an hour in a second (hostile review): hearing from
    term 2's leader forgets it."""
    from quorumq.raft.rules import LeaderClock

    true_ms = [1_800_000_000_000]

    def node() -> LeaderClock:
        return LeaderClock(wall_ms=lambda: true_ms[0], monotonic=lambda: true_ms[0] / 1000)

    a, f = node(), node()
    a.take_over(1, 0)
    e1 = a.now(1)
    assert e1 is not None
    f.seen(e1)
    true_ms[0] += 3_600_000
    told = a.peek(1)
    assert told is not None
    f.heard(told, 1)
    b = node()  # restarted: it saw nothing arrive
    b.take_over(2, e1)
    true_ms[0] += 10
    e2 = b.now(2)
    assert e2 is not None
    stamped_at = true_ms[0]
    f.following(2)  # B's snapshot arrives
    true_ms[0] += 1_000
    f.take_over(3, e2)
    e3 = f.now(3)
    assert e3 is not None and e3 - e2 <= true_ms[0] - stamped_at + 1
