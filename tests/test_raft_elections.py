"""Elections that do not disrupt a working cluster, and a follower that catches up in
one round trip per term: quorumq's rules on one real `RaftMember`, fed messages by hand
(the simulator's sweeps run them inside whole clusters, with their negative controls in
tests/test_sim_elections.py).

Each test turns the rule it checks off (the member's switch) and sees it fail, so none
of them can pass by accident."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pysyncobj.syncobj as _syncobj
import pytest
from pysyncobj import FAIL_REASON

from quorumq.raft.rules import (
    HELLO,
    PRE_VOTE,
    PRE_VOTE_ANSWER,
    PROPOSALS_HELD_S,
    QUIESCES,
    SPEAKS_PRE_VOTE,
    STALE_TERM,
    TRANSFER,
)

from .test_raft_rules import _member

FOLLOWER, CANDIDATE, LEADER = 0, 1, 2


class Clock:
    """PySyncObj's monotonic clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(_syncobj, "monotonicTime", fake)
    return fake


@pytest.fixture
def cluster(tmp_path: Any, clock: Clock) -> Iterator[tuple[Any, list[Any], list[tuple[Any, Any]]]]:
    """Member A of {A, B, C}, not ticking by itself, every peer taken as connected (its
    transport does not dial them), its sends recorded."""
    member, _ = _member(tmp_path, size=3)
    sent: list[tuple[Any, Any]] = []
    transport = member._SyncObj__transport
    transport.send = lambda node, message: sent.append((node, message))
    member.removeOnTickCallback(transport._onTick)  # no dials to the peers, who are not there
    peers = sorted(member.otherNodes, key=lambda n: n.name)
    member._SyncObj__connectedNodes.update(peers)
    member._SyncObj__setCurrentTerm(5, None)
    try:
        yield member, peers, sent
    finally:
        member.stop()


def _log(member: Any, terms: list[int]) -> None:
    """Entries 2.. of the given terms after PySyncObj's first entry (index 1, term 0)."""
    log = member._SyncObj__raftLog
    for index, term in enumerate(terms, start=2):
        log.add(b"\x04c%d" % index, index, term)


def _answer(term: int, *, granted: bool, current: int, round_: int = 1) -> dict[str, Any]:
    return {
        "type": PRE_VOTE_ANSWER,
        "term": term,
        "round": round_,
        "granted": granted,
        "current_term": current,
    }


def _of(sent: list[tuple[Any, Any]], kind: str) -> list[tuple[Any, Any]]:
    return [(node, m) for node, m in sent if m.get("type") == kind]


def _heartbeat(term: int) -> dict[str, Any]:
    """An empty AppendEntries of `term` after PySyncObj's first entry."""
    return {
        "type": "append_entries",
        "term": term,
        "commit_index": 0,
        "entries": [],
        "prevLogIdx": 1,
        "prevLogTerm": 0,
    }


def _heard_from_leader(member: Any, leader: Any, clock: Clock) -> None:
    member._SyncObj__raftLeader = leader
    member.leader_heard_at = clock.now


# ------------------------------------------------------------------ pre-vote


def test_a_follower_past_its_deadline_asks_for_pre_votes_and_keeps_its_term(
    cluster: Any, clock: Clock
) -> None:
    member, peers, sent = cluster
    member._SyncObj__raftElectionDeadline = clock.now - 0.01
    member._pre_vote_gate()
    asked = _of(sent, PRE_VOTE)
    assert sorted(n.name for n, _ in asked) == ["B", "C"]
    assert asked[0][1]["term"] == 6
    assert member.raftCurrentTerm == 5 and member.role() == "follower"
    assert not _of(sent, "request_vote")

    member._SyncObj__onMessageReceived(peers[0], _answer(6, granted=True, current=5))
    assert member.role() == "candidate" and member.raftCurrentTerm == 6
    votes = _of(sent, "request_vote")
    assert len(votes) == 2 and votes[0][1][SPEAKS_PRE_VOTE] and TRANSFER not in votes[0][1]


def test_a_refused_pre_vote_raises_no_term_and_the_next_round_asks_again(
    cluster: Any, clock: Clock
) -> None:
    member, peers, sent = cluster
    member._SyncObj__raftElectionDeadline = clock.now - 0.01
    member._pre_vote_gate()
    for peer in peers:
        member._SyncObj__onMessageReceived(peer, _answer(6, granted=False, current=5))
    assert member.raftCurrentTerm == 5 and member.role() == "follower"
    clock.now = member._SyncObj__raftElectionDeadline + 0.01
    member._pre_vote_gate()
    assert len(_of(sent, PRE_VOTE)) == 4 and member.pre_votes_lost == 1
    assert member.raftCurrentTerm == 5


def test_without_pre_vote_the_follower_raises_its_term_alone(cluster: Any, clock: Clock) -> None:
    """The negative control of the two tests above: PySyncObj's election."""
    member, _, sent = cluster
    member.pre_vote = False
    member._SyncObj__raftElectionDeadline = clock.now - 0.01
    member._onTick(0)
    assert member.raftCurrentTerm == 6 and not _of(sent, PRE_VOTE)


def test_a_node_at_a_higher_term_lifts_the_askers_term_so_its_next_round_can_win(
    cluster: Any, clock: Clock
) -> None:
    member, peers, _ = cluster
    member._SyncObj__raftElectionDeadline = clock.now - 0.01
    member._pre_vote_gate()
    member._SyncObj__onMessageReceived(peers[0], _answer(6, granted=False, current=9))
    assert member.raftCurrentTerm == 9 and member.role() == "follower"


def _ask(member: Any, node: Any, sent: list[Any], **fields: Any) -> bool:
    request = {"type": PRE_VOTE, "term": 6, "last_log_index": 1, "last_log_term": 0, **fields}
    sent.clear()
    member._SyncObj__onMessageReceived(node, request)
    ((to, answer),) = _of(sent, PRE_VOTE_ANSWER)
    assert to == node and answer["term"] == request["term"]
    assert member.raftCurrentTerm == 5  # a pre-vote changes nothing here
    return bool(answer["granted"])


def test_a_pre_vote_is_granted_only_to_an_up_to_date_member_while_no_leader_is_heard(
    cluster: Any, clock: Clock
) -> None:
    member, peers, sent = cluster
    assert _ask(member, peers[0], sent)
    assert not _ask(member, peers[0], sent, term=5)  # no term past this node's
    _log(member, [4])
    assert not _ask(member, peers[0], sent)  # a log behind this one's
    assert _ask(member, peers[0], sent, last_log_index=2, last_log_term=4)

    from pysyncobj.node import Node

    stranger = Node("127.0.0.1:1", name="X")
    assert not _ask(member, stranger, sent, last_log_index=2, last_log_term=4)


def test_stickiness_a_follower_that_hears_its_leader_refuses_pre_votes(
    cluster: Any, clock: Clock
) -> None:
    member, peers, sent = cluster
    leader, asker = peers
    _heard_from_leader(member, leader, clock)
    assert not _ask(member, asker, sent)
    clock.now += member._SyncObj__conf.raftMinTimeout + 0.01
    assert _ask(member, asker, sent)

    _heard_from_leader(member, leader, clock)
    member.leader_stickiness = False
    assert _ask(member, asker, sent)  # the negative control


def test_stickiness_a_vote_request_is_ignored_in_the_lease_except_for_a_transfer(
    cluster: Any, clock: Clock
) -> None:
    """A node that speaks pre-vote and still asks for votes while this node hears its
    leader is ignored: no term taken, no vote. A transfer's request is granted; a node
    of an earlier version (untagged, never said hello) is handled as before."""
    member, peers, sent = cluster
    leader, asker = peers
    request = {"type": "request_vote", "term": 7, "last_log_index": 1, "last_log_term": 0}

    _heard_from_leader(member, leader, clock)
    member._SyncObj__onMessageReceived(asker, {**request, SPEAKS_PRE_VOTE: True})
    assert member.raftCurrentTerm == 5 and not _of(sent, "response_vote")

    member._SyncObj__onMessageReceived(asker, {**request, SPEAKS_PRE_VOTE: True, TRANSFER: True})
    assert member.raftCurrentTerm == 7 and len(_of(sent, "response_vote")) == 1

    member._SyncObj__setCurrentTerm(7, None)
    _heard_from_leader(member, leader, clock)
    member._speakers.discard(asker)
    member._SyncObj__onMessageReceived(leader, {**request, "term": 8})  # an earlier version
    assert member.raftCurrentTerm == 8 and len(_of(sent, "response_vote")) == 2


def test_stickiness_off_a_vote_request_deposes_in_the_lease(cluster: Any, clock: Clock) -> None:
    member, peers, _ = cluster
    leader, asker = peers
    member.leader_stickiness = False
    _heard_from_leader(member, leader, clock)
    request = {"type": "request_vote", "term": 7, "last_log_index": 1, "last_log_term": 0}
    member._SyncObj__onMessageReceived(asker, {**request, SPEAKS_PRE_VOTE: True})
    assert member.raftCurrentTerm == 7


def test_a_vote_request_from_outside_the_configuration_is_ignored(
    cluster: Any, clock: Clock
) -> None:
    """A removed server that missed its removal keeps asking: it is never heard."""
    from pysyncobj.node import Node

    member, _, sent = cluster
    stranger = Node("127.0.0.1:1", name="X")
    request = {"type": "request_vote", "term": 9, "last_log_index": 1, "last_log_term": 0}
    member._SyncObj__onMessageReceived(stranger, request)
    assert member.raftCurrentTerm == 5 and not _of(sent, "response_vote")


def test_a_member_that_missed_an_add_votes_for_the_node_it_added(
    cluster: Any, clock: Clock
) -> None:
    """{A, B, C, D}, B lost for good, A (this node) behind the entry adding D, and D's
    log longer than C's: A ignored D as an outsider, D refused C (its log behind), and
    no one could be elected again (simulator, seed 140). D says where it was added;
    past A's log, A votes for it. A removed node, a learner or a stranger, added
    nowhere A has not seen, stays ignored."""
    from pysyncobj.node import Node

    member, _, sent = cluster
    _log(member, [4] * 9)  # entries 2-10
    added = Node("127.0.0.1:1", name="D")
    assert _ask(member, added, sent, last_log_index=14, last_log_term=4, quorumq_added_at=12)
    assert not _ask(member, added, sent, last_log_index=14, last_log_term=4, quorumq_added_at=9)
    assert not _ask(member, added, sent, last_log_index=14, last_log_term=4)
    request = {"type": "request_vote", "term": 9, "last_log_index": 14, "last_log_term": 4}
    member._SyncObj__onMessageReceived(added, {**request, "quorumq_added_at": 10})
    assert member.raftCurrentTerm == 5  # (an entry A has: A would know D)
    member._SyncObj__onMessageReceived(added, {**request, "quorumq_added_at": 12})
    assert member.raftCurrentTerm == 9 and _of(sent, "response_vote")


def test_a_pre_vote_answer_names_the_members_and_the_asker_reaches_those_it_lacks(
    cluster: Any, clock: Clock
) -> None:
    member, peers, sent = cluster
    _ask(member, peers[0], sent)
    ((_, answer),) = _of(sent, PRE_VOTE_ANSWER)
    assert sorted(name for _, name in answer["quorumq_members"]) == ["A", "B", "C"]

    member._SyncObj__raftElectionDeadline = clock.now - 0.01
    member._pre_vote_gate()
    told = {
        **_answer(6, granted=False, current=5),
        "quorumq_members": [["127.0.0.1:1", "D"], *answer["quorumq_members"]],
    }
    member._SyncObj__onMessageReceived(peers[0], told)
    transport = member._SyncObj__transport
    assert "127.0.0.1:1" in transport._nodeAddrToNode
    assert "127.0.0.1:1" not in {str(n.id) for n in member.otherNodes}  # not a member


def test_a_leader_of_an_earlier_term_is_told_and_steps_down(cluster: Any, clock: Clock) -> None:
    member, peers, sent = cluster
    old_leader = peers[0]
    heartbeat = _heartbeat(term=4)
    member._SyncObj__onMessageReceived(old_leader, heartbeat)
    assert [m["term"] for _, m in _of(sent, STALE_TERM)] == [5]

    member._SyncObj__onBecomeLeader()
    assert member.role() == "leader"
    member._SyncObj__onMessageReceived(peers[1], {"type": STALE_TERM, "term": 8})
    assert member.role() == "follower" and member.raftCurrentTerm == 8


def test_peers_learn_who_speaks_pre_vote_from_a_hello_on_each_connection(
    cluster: Any, clock: Clock
) -> None:
    member, peers, sent = cluster
    member._SyncObj__onNodeConnected(peers[0])
    assert _of(sent, HELLO) == [(peers[0], {"type": HELLO, SPEAKS_PRE_VOTE: True, QUIESCES: True})]
    member._SyncObj__onMessageReceived(peers[1], {"type": HELLO, SPEAKS_PRE_VOTE: True})
    assert peers[1] in member._speakers
    assert peers[1] not in member._quiet_speakers  # an earlier version's hello


def test_with_peers_of_an_earlier_version_a_whole_round_without_answers_elects(
    cluster: Any, clock: Clock
) -> None:
    """Peers never heard to speak pre-vote ignore pre-votes: after a round without a
    majority they count as granting, so a mixed cluster elects as before (a new node
    alone among old ones must not be left unable to stand for ever)."""
    member, peers, sent = cluster
    member._SyncObj__raftElectionDeadline = clock.now - 0.01
    member._pre_vote_gate()
    assert member.raftCurrentTerm == 5
    clock.now = member._SyncObj__raftElectionDeadline + 0.01
    member._pre_vote_gate()
    assert member.raftCurrentTerm == 6 and len(_of(sent, "request_vote")) == 2

    # with both peers known to speak pre-vote, silence is no grant
    member._SyncObj__setState(FOLLOWER)
    member._speakers.update(peers)
    clock.now = member._SyncObj__raftElectionDeadline + 0.01
    member._pre_vote_gate()
    clock.now = member._SyncObj__raftElectionDeadline + 0.01
    member._pre_vote_gate()
    assert member.raftCurrentTerm == 6


# ---------------------------------------------------------------- catching up


def _refusal(member: Any, leader: Any, sent: list[Any], prev: int, prev_term: int) -> int:
    sent.clear()
    replies: list[Any] = []
    member._send_replies = replies.extend
    member._SyncObj__onMessageReceived(
        leader,
        {
            "type": "append_entries",
            "term": 9,
            "commit_index": 0,
            "entries": [],
            "prevLogIdx": prev,
            "prevLogTerm": prev_term,
        },
    )
    ((_, reset, next_index, success),) = replies
    assert reset and not success
    return int(next_index)


def test_a_refusal_names_the_first_index_of_the_conflicting_term(
    cluster: Any, clock: Clock
) -> None:
    """Entries 2-4 of term 1, 5-9 of term 2, 10-40 of term 3: a leader whose entry 30 is
    of term 4 hears 10 at once (not 30, then 29, ... one per round trip); one whose
    entry 7 is of term 1 hears 5."""
    member, peers, sent = cluster
    _log(member, [1] * 3 + [2] * 5 + [3] * 31)
    leader = peers[0]
    assert _refusal(member, leader, sent, 30, 4) == 10
    assert _refusal(member, leader, sent, 7, 1) == 5
    assert _refusal(member, leader, sent, 50, 3) == 41  # past the log: its last + 1

    member._SyncObj__raftCommitIndex = 12
    assert _refusal(member, leader, sent, 30, 4) == 13  # never below what is committed

    member.conflict_hints = False
    assert _refusal(member, leader, sent, 30, 4) == 30  # PySyncObj's: one back


def test_a_leader_sends_again_at_once_after_a_refusal(cluster: Any, clock: Clock) -> None:
    member, peers, sent = cluster
    _log(member, [5] * 20)
    member._SyncObj__onBecomeLeader()
    follower = peers[0]
    member._SyncObj__raftNextIndex[follower] = 23
    sent.clear()
    refusal = {"type": "next_node_idx", "next_node_idx": 10, "reset": True, "success": False}
    member._SyncObj__onMessageReceived(follower, refusal)
    ((to, message),) = _of(sent, "append_entries")
    assert to == follower and message["prevLogIdx"] == 9
    assert [e[1] for e in message["entries"]][:1] == [10]

    member.resend_after_refusal = False
    member._SyncObj__raftNextIndex[follower] = 23
    sent.clear()
    member._SyncObj__onMessageReceived(follower, refusal)
    assert not _of(sent, "append_entries")


# ------------------------------------------------------ a leader that stalled


def test_a_stalled_leader_judges_no_peer_silent_across_its_own_stall(
    cluster: Any, clock: Clock
) -> None:
    """Paused 4 s (a GC, a SIGSTOP, in the middle of a tick), a leader whose peers
    answered just before judged them silent 4 s, past a 3 s node-down grace, and marked
    every healthy node down. Silence now counts from when it woke."""
    member, _, _ = cluster
    member._SyncObj__onBecomeLeader()
    member.peer_silence()
    clock.now += 4.0
    silence = member.peer_silence()
    assert max(silence.values()) < 0.01 and member.stalls == 1
    assert not member.in_lease()  # no answer read since it woke
    for _ in range(20):  # awake, looking every 50 ms, and no answer comes
        clock.now += 0.05
        silence = member.peer_silence()
    assert min(silence.values()) == pytest.approx(1.0)

    member.stall_aware_silence = False  # silence since its election, stalls and all
    clock.now += 4.0
    assert min(member.peer_silence().values()) == pytest.approx(9.0)


def test_a_leader_duty_is_appended_only_by_the_leader_of_the_term_that_judged_it(
    cluster: Any, clock: Clock
) -> None:
    """Queued just before its leader was deposed, a `NodeDown` went on to the new
    leader with the next tick's commands (PySyncObj forwards a follower's proposals),
    and was committed there."""
    member, peers, sent = cluster
    member._SyncObj__onBecomeLeader()
    outcomes: list[int] = []
    member.propose(b"down", lambda _r, reason: outcomes.append(reason), leader_only=True)
    member._set_higher_term(6)
    member._SyncObj__raftLeader = peers[0]
    sent.clear()
    member._checkCommandsToApply()
    assert outcomes == [FAIL_REASON.NOT_LEADER]
    assert not _of(sent, "apply_command")

    member.propose(b"x", lambda _r, reason: outcomes.append(reason), leader_only=True)
    assert outcomes[-1] == FAIL_REASON.NOT_LEADER  # refused at once, as a follower

    member.propose(b"plain", None)
    member._checkCommandsToApply()
    assert len(_of(sent, "apply_command")) == 1  # an ordinary proposal is forwarded


# ------------------------------------------------- reaching a missed leader


def test_a_follower_told_of_a_leader_its_configuration_lacks_connects_to_it(
    cluster: Any, clock: Clock
) -> None:
    """A node wiped and added back installed a snapshot from before the leader's own
    add: its configuration lacked the leader, PySyncObj connected only to members, and
    (pre-vote keeping it from deposing anyone) it stayed behind for good (seed 43). A
    refused pre-vote names the leader; the node connects to it."""
    member, peers, _ = cluster
    member._SyncObj__raftElectionDeadline = clock.now - 0.01
    member._pre_vote_gate()
    answer = {**_answer(6, granted=False, current=5), "leader": ["127.0.0.1:1", "D"]}
    member._SyncObj__onMessageReceived(peers[0], answer)
    transport = member._SyncObj__transport
    assert "127.0.0.1:1" in transport._nodeAddrToNode
    assert "127.0.0.1:1" not in {str(n.id) for n in member.otherNodes}  # not a member
    member._SyncObj__onMessageReceived(peers[1], answer)  # told twice: added once
    assert sum(1 for n in transport._nodes if str(n.id) == "127.0.0.1:1") == 1


def test_proposals_wait_while_the_leader_is_not_connected(cluster: Any, clock: Clock) -> None:
    """PySyncObj sent a follower's proposals to its leader on a connection that was down,
    where they were lost, and the callers heard nothing for 15 s. They wait now; and
    those already sent fail at once (outcome unknown) when the connection closes."""
    member, peers, sent = cluster
    leader = peers[0]
    member._SyncObj__raftLeader = leader
    outcomes: list[int] = []
    member.propose(b"sent", lambda _r, reason: outcomes.append(reason))
    member._checkCommandsToApply()
    assert len(_of(sent, "apply_command")) == 1

    member._SyncObj__onNodeDisconnected(leader)
    assert outcomes == [FAIL_REASON.LEADER_CHANGED]

    member.propose(b"waits", lambda _r, reason: outcomes.append(reason))
    member._checkCommandsToApply()
    assert len(_of(sent, "apply_command")) == 1  # held, not lost on a closed connection
    member._SyncObj__onNodeConnected(leader)
    member._checkCommandsToApply()
    assert len(_of(sent, "apply_command")) == 2


class TickingClock(Clock):
    """A clock that moves 1 ms each time it is read."""

    def __call__(self) -> float:
        self.now += 0.001
        return self.now


def test_pysyncobj_never_stands_for_election_by_itself_when_the_deadline_falls_mid_tick(
    cluster: Any, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pre-vote gate reads the clock, then PySyncObj reads it again: a deadline that
    falls in between (or a stall there) made PySyncObj raise the term without asking."""
    member, _, sent = cluster
    ticking = TickingClock()
    ticking.now = clock.now
    monkeypatch.setattr(_syncobj, "monotonicTime", ticking)
    member._last_look = ticking.now
    member._SyncObj__raftElectionDeadline = ticking.now + 0.0025  # past the gate's look
    member._onTick(0)
    assert member.raftCurrentTerm == 5 and not _of(sent, "request_vote")
    assert member._SyncObj__raftElectionDeadline < ticking.now  # kept: the next tick asks
    member._last_look = ticking.now  # (the clock moved with every read: no stall)
    member._onTick(0)
    assert _of(sent, PRE_VOTE) and member.raftCurrentTerm == 5


# ------------------------------------------- what a hostile review found (helper-5)


def test_only_a_real_answer_brings_a_down_node_up_after_a_stall_or_an_election(
    cluster: Any, clock: Clock
) -> None:
    """Silence restarts when the leader wakes from a stall or is elected, so a node
    dead for 100 s looked silent 0 s, and a leader back from a 0.3 s stall proposed
    `NodeUp` for it. Only a real answer counts for `NodeUp` now."""
    from quorumq.replica import failure_commands

    member, peers, _ = cluster
    member._SyncObj__onBecomeLeader()
    alive, dead = peers
    refusal = {"type": "next_node_idx", "next_node_idx": 2, "reset": False, "success": True}
    member._SyncObj__onMessageReceived(alive, refusal)
    clock.now += 0.3  # a stall
    names = {str(p.id): p.name for p in peers}
    silence = {names[a]: s for a, s in member.peer_silence().items()}
    answered = {names[a]: s for a, s in member.peer_answered_ago().items()}
    assert answered[dead.name] == float("inf") and answered[alive.name] == pytest.approx(0.3)
    commands = failure_commands("A", silence, frozenset({dead.name}), 3.0, (), answered)
    assert commands == []
    commands = failure_commands("A", silence, frozenset({dead.name}), 3.0, ())
    assert [type(c).__name__ for c in commands] == ["NodeUp"]  # judged by silence: wrong


def test_a_late_grant_from_before_a_new_term_does_not_make_this_node_stand(
    cluster: Any, clock: Clock
) -> None:
    """A's round for term 6 had one grant; C stood at term 6 and A voted for it; a late
    grant then completed A's round, and A stood at term 7, deposing C."""
    member, peers, sent = cluster
    member._SyncObj__raftElectionDeadline = clock.now - 0.01
    member._pre_vote_gate()
    request = {"type": "request_vote", "term": 6, "last_log_index": 1, "last_log_term": 0}
    member._SyncObj__onMessageReceived(peers[1], request)  # votes for C at term 6
    assert member.raftCurrentTerm == 6
    member._SyncObj__onMessageReceived(peers[0], _answer(6, granted=True, current=5))
    assert member.raftCurrentTerm == 6 and member.role() == "follower"
    assert not [m for _, m in _of(sent, "request_vote") if m["term"] == 7]


def test_proposals_held_for_an_unreachable_leader_fail_as_never_sent_after_a_timeout(
    cluster: Any, clock: Clock
) -> None:
    """Cut off from a leader the others still hear, a follower cannot stand (pre-vote),
    so the leader it knows stays, and its queue held every proposal until the link came
    back, maybe hours later. Each fails, not sent, past the replica's own timeout: acks
    failed at once after the leader had been gone long were given up by the node core
    during an 18 s outage, and their messages stayed held (CI seed 78)."""
    from quorumq.replica import PROPOSAL_TIMEOUT_S

    assert PROPOSALS_HELD_S == PROPOSAL_TIMEOUT_S
    member, peers, sent = cluster
    member._SyncObj__raftLeader = peers[0]
    member._SyncObj__connectedNodes.discard(peers[0])
    outcomes: list[int] = []
    member.propose(b"x", lambda _r, reason: outcomes.append(reason))
    member._checkCommandsToApply()
    assert outcomes == []  # held a moment: the connection may come back
    clock.now += 10.0
    member._checkCommandsToApply()
    assert outcomes == []  # still held: acks given up too soon left messages held
    clock.now += PROPOSALS_HELD_S
    member._checkCommandsToApply()
    assert outcomes == [FAIL_REASON.MISSING_LEADER] and not _of(sent, "apply_command")
    member.propose(b"later", lambda _r, reason: outcomes.append(reason))
    member._checkCommandsToApply()
    assert len(outcomes) == 1  # each its own time: a new one is held, not failed at once
    clock.now += PROPOSALS_HELD_S + 0.01
    member._checkCommandsToApply()
    assert outcomes == [FAIL_REASON.MISSING_LEADER] * 2


def test_a_follower_whose_every_tick_comes_late_still_stands(cluster: Any, clock: Clock) -> None:
    """Each tick 0.25 s after the last is a stall; pushing the deadline past every one
    meant no pre-vote in 50 s. It is pushed once per wait for a leader."""
    member, _, sent = cluster
    member._last_look = clock.now
    member._SyncObj__raftElectionDeadline = clock.now + 0.1
    for _ in range(8):
        clock.now += 0.25
        member._onTick(0)
    assert _of(sent, PRE_VOTE)


def test_a_leader_reached_outside_the_configuration_is_dropped_once_a_member_leads(
    cluster: Any, clock: Clock
) -> None:
    member, peers, _ = cluster
    member._SyncObj__raftElectionDeadline = clock.now - 0.01
    member._pre_vote_gate()
    answer = {**_answer(6, granted=False, current=5), "leader": ["127.0.0.1:1", "D"]}
    member._SyncObj__onMessageReceived(peers[0], answer)
    transport = member._SyncObj__transport
    assert "127.0.0.1:1" in transport._nodeAddrToNode
    heartbeat = _heartbeat(term=5)
    member._SyncObj__onMessageReceived(peers[0], heartbeat)  # a member leads
    assert "127.0.0.1:1" not in transport._nodeAddrToNode
    member._SyncObj__onMessageReceived(peers[0], answer)  # and may be reached again
    assert "127.0.0.1:1" in transport._nodeAddrToNode


# ------------------------------------------ what a second review found (helper-6)


def _forwarded_here(member: Any, peer: Any) -> None:
    """`peer` forwards a proposal to `member`, taking it for its leader."""
    member._SyncObj__onMessageReceived(
        peer, {"type": "apply_command", "command": b"\x04y", "request_id": 7}
    )


def test_proposals_on_a_node_that_knows_no_leader_fail_after_their_time(
    cluster: Any, clock: Clock
) -> None:
    """PySyncObj takes nothing from the queue while it knows no leader: a leader isolated
    and stepped down by check-quorum kept its proposals for as long as the partition
    lasted, and appended them after the clients' retries when it healed. A peer's
    request forwarded here waits, as PySyncObj keeps it, without holding the local ones
    back (refused at once, acks were given up by the node core during elections)."""
    member, peers, sent = cluster
    _forwarded_here(member, peers[0])
    outcomes: list[int] = []
    member.propose(b"x", lambda _r, reason: outcomes.append(reason))
    member._checkCommandsToApply()
    assert outcomes == [] and not _of(sent, "apply_command_response")
    clock.now += PROPOSALS_HELD_S + 0.01
    member._checkCommandsToApply()
    assert outcomes == [FAIL_REASON.MISSING_LEADER]
    assert not _of(sent, "apply_command_response")  # the peer's waits for a leader
    member._SyncObj__raftLeader = peers[1]
    member._checkCommandsToApply()
    assert [m["error"] for _, m in _of(sent, "apply_command_response")] == [FAIL_REASON.NOT_LEADER]


def test_answers_to_an_earlier_term_of_leadership_bring_no_dead_node_up(
    cluster: Any, clock: Clock
) -> None:
    """B answered leader A; A was deposed, B died; A, elected again a second later,
    took B's old answer for a new one and proposed NodeUp(B)."""
    member, peers, _ = cluster
    member._SyncObj__onBecomeLeader()
    answer = {"type": "next_node_idx", "next_node_idx": 2, "reset": False, "success": True}
    member._SyncObj__onMessageReceived(peers[0], answer)
    member._set_higher_term(6)
    clock.now += 1.0
    member._SyncObj__onBecomeLeader()
    assert min(member.peer_answered_ago().values()) == float("inf")


def test_only_the_leaders_appendentries_keep_a_follower_in_its_lease(
    cluster: Any, clock: Clock
) -> None:
    """C took B for leader after B had stopped leading; B refused C's forwarded
    proposals at once, and each answer counted as hearing from the leader: C stayed in
    its lease and refused B's pre-votes for good (no leader after the heal)."""
    member, peers, _ = cluster
    leader = peers[0]
    heartbeat = _heartbeat(term=5)
    member._SyncObj__onMessageReceived(leader, heartbeat)
    assert member.in_lease()
    clock.now += member._SyncObj__conf.raftMinTimeout + 0.01
    refusal = {"type": "apply_command_response", "request_id": 1, "error": 3}
    member._SyncObj__onMessageReceived(leader, refusal)
    assert not member.in_lease()
    member._SyncObj__onMessageReceived(leader, heartbeat)
    assert member.in_lease()


# ------------------------------------------------------------- the learner stage


def _ask_to_add(member: Any, node: Any) -> bool:
    return bool(member._SyncObj__changeCluster(["add", node.id, node]))


def test_a_node_is_added_only_once_it_has_caught_up_as_a_learner(
    cluster: Any, clock: Clock
) -> None:
    """The first add of D makes it a learner: the leader connects to it and sends it the
    log, but refuses the add (a voter that the new majority needs before anything can
    commit) until D has what was committed when the add was last asked for; then D
    joins, and is a voter like any other."""
    member, _, sent = cluster
    _log(member, [5] * 20)
    member._SyncObj__onBecomeLeader()
    member._SyncObj__raftCommitIndex = member._SyncObj__raftLastApplied = 22  # (its no-op)
    learner = member.make_node("D", "127.0.0.1:1")

    assert not _ask_to_add(member, learner)
    assert learner in member._SyncObj__readonlyNodes and learner not in member.otherNodes
    assert "127.0.0.1:1" in member._SyncObj__transport._nodeAddrToNode  # dialled
    member._SyncObj__connectedNodes.add(learner)
    sent.clear()
    member._SyncObj__sendAppendEntries()
    assert learner in {node for node, m in _of(sent, "append_entries")}  # sent the log

    assert not _ask_to_add(member, learner)  # not caught up yet: nothing answered
    _log_more(member, 23, 30)
    clock.now += 1.0  # a round (to 22) that took longer than an election timeout
    member._SyncObj__onMessageReceived(learner, _answer_through(22))
    assert not _ask_to_add(member, learner)  # the next round: to 30
    clock.now += 0.3
    member._SyncObj__onMessageReceived(learner, _answer_through(30))
    assert _ask_to_add(member, learner)
    assert learner in member.otherNodes and learner not in member._SyncObj__readonlyNodes
    assert not member.learners and member.learners_joined == 1


def _log_more(member: Any, first: int, last: int) -> None:
    term = member.raftCurrentTerm
    for index in range(first, last + 1):
        member._SyncObj__raftLog.add(b"\x04c%d" % index, index, term)


def _leads_with_its_no_op_applied(member: Any) -> None:
    """Member A leads, its no-op (entry 2) applied: it may change the configuration."""
    member._SyncObj__onBecomeLeader()
    member._SyncObj__raftLastApplied = member._SyncObj__raftCommitIndex = 2


def _answer_through(index: int) -> dict[str, Any]:
    return {"type": "next_node_idx", "next_node_idx": index + 1, "reset": False, "success": True}


def test_a_learner_nobody_asks_for_is_dropped_and_a_non_leader_keeps_none(
    cluster: Any, clock: Clock
) -> None:
    member, _, _ = cluster
    _leads_with_its_no_op_applied(member)
    learner = member.make_node("D", "127.0.0.1:1")
    assert not _ask_to_add(member, learner)
    clock.now += 29
    member._drop_learners()
    assert member.learners  # asked for within LEARNER_IDLE_S
    clock.now += 2
    member._drop_learners()
    assert not member.learners and learner not in member._SyncObj__readonlyNodes
    assert "127.0.0.1:1" not in member._SyncObj__transport._nodeAddrToNode

    assert not _ask_to_add(member, learner)
    member._SyncObj__setState(FOLLOWER)
    member._drop_learners()
    assert not member.learners


def test_without_the_learner_stage_an_empty_node_is_added_at_once(
    cluster: Any, clock: Clock
) -> None:
    member, _, _ = cluster
    _leads_with_its_no_op_applied(member)
    member.learner_stage = False
    learner = member.make_node("D", "127.0.0.1:1")
    assert _ask_to_add(member, learner)
    assert learner in member.otherNodes
