"""Receiving (`Receiving`): every Raft message a node reads, first through quorumq's rules
(trimming what the log already holds, the stale-term answer, pre-votes and votes, the
leader's times), then PySyncObj's handling.

A part of `RaftRules` (see `rules`): a mixin over PySyncObj's `SyncObj`."""

from __future__ import annotations

import logging
from typing import Any

import pysyncobj.syncobj as _syncobj
from pysyncobj import FAIL_REASON

from .. import pathtiming
from ..codec import entry_time
from .base import (
    COMMIT_NOTICE,
    HELLO,
    KEEPALIVE,
    PRE_VOTE,
    PRE_VOTE_ANSWER,
    RAW_PREFIX,
    SPEAKS_PRE_VOTE,
    STALE_TERM,
    STEP_DOWN,
    RaftFields,
    trim_known_entries,
)

logger = logging.getLogger(__name__)


class Receiving(RaftFields):
    """Receiving Raft messages (see the module's docstring)."""

    def _SyncObj__onMessageReceived(self, node: Any, message: Any) -> None:
        if isinstance(message, dict) and message.get("type") == KEEPALIVE:
            return  # it was read: the connection stays open
        if isinstance(message, dict) and message.get("type") == STEP_DOWN:
            if self._isLeader():
                logger.info("handing leadership over, as %s asked", node)
                self.transferLeadership(None, None)
            return
        append = isinstance(message, dict) and message.get("type") == "append_entries"
        if self._held_replies and not (
            append and message.get("term") == self.raftCurrentTerm and "serialized" not in message
        ):
            # Held answers hold for this term's leader, whose entries never conflict with
            # what it sent before. Anything else (a new term, a vote, a snapshot that may
            # replace the log) comes after they are out: PySyncObj's answers carry no
            # term, and a deposed leader must not count entries this log no longer has.
            self._send_held_replies()
        if isinstance(message, dict) and self._handled_election_message(node, message):
            return
        answer_through = None
        if pathtiming.ENABLED:
            self._mark_received(node, message)
        if append and message.get("term", -1) >= self.raftCurrentTerm:
            self._saw_times(message.get("entries"))
            message, answer_through = trim_known_entries(message, self._SyncObj__raftLog)
        next_index = self._SyncObj__raftNextIndex
        before = next_index.get(node)
        self._message_from = node
        snapshot_chunk = append and "serialized" in message
        commit, applied = (self.raftCommitIndex, self.raftLastApplied) if snapshot_chunk else (0, 0)
        self._installed_through = None
        self._handling_notice = append and bool(message.get(COMMIT_NOTICE))
        try:
            super()._SyncObj__onMessageReceived(node, message)
        finally:
            self._handling_notice = False
        if append and not self._isLeader():
            self._answer_cut_proposals()
        if pathtiming.ENABLED:
            self._mark_commit()
        if self._SyncObj__raftLeader is not None:
            self._last_leader = self._SyncObj__raftLeader
            if node == self._last_leader:
                self._leader_closed = None  # heard from: it lives
            if (
                node == self._last_leader
                and append
                and message.get("term") == self.raftCurrentTerm
                and not self._isLeader()
            ):
                # Only the leader's AppendEntries of this term say it leads: any other
                # message from it (an answer to a proposal forwarded to a node that no
                # longer led, refused at once) kept a follower "in its lease" for good,
                # refusing the pre-votes of the node it took for leader (liveness run of
                # CI's consumer_timeout options, seed 1: no leader after the heal)
                self.leader_heard_at = _syncobj.monotonicTime()  # (metrics, stickiness)
                self.heard_leader(message)  # a quiet heartbeat moves the deadline out
                self._pre_vote_round = None  # a late grant must not depose it
                self._deadline_pushed = False
                self._forget_reached_leaders()
        if snapshot_chunk and self.raftLastApplied == applied:
            # no snapshot was installed: the commit index stays (PySyncObj takes it to
            # the leader's, within this log, which this message did not check)
            self._set_commit_index(commit)
        installed, self._installed_through = self._installed_through, None
        if installed is not None and self.raftCommitIndex > installed:
            # the entries kept after the snapshot may be an old leader's uncommitted
            # tail: committed only once an AppendEntries vouches for them (PySyncObj took
            # the commit index to the leader's, within this log, and applied that tail)
            self._set_commit_index(installed)
        if answer_through is not None:
            self._SyncObj__sendNextNodeIdx(node, nextNodeIdx=answer_through + 1, success=True)
        answer = isinstance(message, dict) and message.get("type") == "next_node_idx"
        if answer and self._isLeader():
            self._answered_at[node] = _syncobj.monotonicTime()
        if (
            isinstance(message, dict)
            and message.get("type") == "next_node_idx"
            and before is not None
        ):
            now = next_index.get(node, 0)
            if message.get("success") and not message.get("reset") and now < before:
                next_index[node] = before  # a stale ack must not rewind nextIndex
            elif message.get("reset") and not message.get("success") and now > before:
                # a stale refusal must not undo the search for where the logs agree: with
                # big entries several AppendEntries are in flight, and each refusal of an
                # older one named a higher index, so a lagging follower never caught up
                next_index[node] = before
            elif (
                message.get("reset")
                and not message.get("success")
                and self._isLeader()
                and self.resend_after_refusal
            ):
                self._send_to(node)  # not a heartbeat period later

    def _answer_cut_proposals(self) -> None:
        """Proposals this node appended as leader that it will never apply itself:
        their entries cut from its log by its new leader, or inside a snapshot it
        installed. Answered now, "outcome unknown" (`LEADER_CHANGED`). PySyncObj answers
        the first only when the log next reaches their index (discarded, or applied if
        the entry comes back), and an idle cluster's log may take long to grow there;
        the second never (the replica's proposals expire after 15 s; a membership
        change did not: an operator's removal of a member, appended by a leader deposed
        at the heal and skipped by a snapshot install, went unanswered for 27 s,
        simulator, CI seed 169). Not "not applied": a node that still holds the entry
        may lead and commit it, until the new leader commits past it."""
        waiting: dict[int, list[tuple[int, Any]]] = self._SyncObj__commandsWaitingCommit
        if not waiting:
            return
        log = self._SyncObj__raftLog
        first, last = log[0][1], log[-1][1]
        commit = self.raftCommitIndex
        current = self.raftCurrentTerm

        def gone(index: int, term: int) -> bool:
            """Not to be applied here as this proposal's entry, as far as this log
            knows. An entry of this term past the log's end is the leader's (a proposal
            forwarded to it): it comes. One of an earlier term past the end may come
            too, while this log is behind, or never: "unknown" is the truth either way."""
            if index <= first:
                return True  # inside a snapshot: never applied here one by one
            if index <= last:
                return bool(log[index - first][2] != term)
            return bool(term < current)

        for index in sorted(waiting):
            if first < index <= commit:
                continue  # applied next, and answered then
            kept = [(term, cb) for term, cb in waiting[index] if not gone(index, term)]
            cut = [cb for term, cb in waiting[index] if gone(index, term)]
            if kept:
                waiting[index] = kept
            else:
                del waiting[index]
            for callback in cut:
                callback(None, FAIL_REASON.LEADER_CHANGED)

    def _handled_election_message(self, node: Any, message: dict[str, Any]) -> bool:
        """Our election messages, and the vote requests and AppendEntries they change;
        True if the message needs nothing more."""
        kind = message.get("type")
        if kind == HELLO:
            if message.get(SPEAKS_PRE_VOTE):
                self._speakers.add(node)
            self.heard_hello(node, message)
            return True
        if kind == PRE_VOTE:
            if self._SyncObj__selfNode is not None:
                self._on_pre_vote(node, message)
            return True
        if kind == PRE_VOTE_ANSWER:
            self._on_pre_vote_answer(node, message)
            return True
        if kind == STALE_TERM:
            term = message.get("term")
            if type(term) is int and term > self.raftCurrentTerm:
                logger.info("%s is at term %d, past this node's: following", node, term)
                self._set_higher_term(term)
            return True
        if kind == "request_vote":
            if message.get(SPEAKS_PRE_VOTE):
                self._speakers.add(node)
            return bool(self._ignores_vote(node, message))
        if kind == "append_entries" and message.get("term", 0) < self.raftCurrentTerm:
            # PySyncObj ignores a leader of an earlier term: tell it, or it leads on
            # and this node stays out (a candidate its voters ignore while they hear it)
            self._SyncObj__transport.send(node, {"type": STALE_TERM, "term": self.raftCurrentTerm})
            return True
        return False

    def _mark_received(self, node: Any, message: Any) -> None:
        """Path timing: entries arrived (a follower), or a follower's answer (a leader)."""
        if not isinstance(message, dict):
            return
        kind = message.get("type")
        if kind == "append_entries":
            for entry in message.get("entries") or ():
                pathtiming.mark("raft.received", ("i", entry[1]))
        elif kind == "next_node_idx" and message.get("success"):
            pathtiming.mark("raft.reply", ("i", message["next_node_idx"] - 1))

    def _saw_times(self, entries: Any) -> None:
        """Tell the leader clock the time of the last stamped entry that arrived."""
        clock = self.leader_clock
        if clock is None or not entries:
            return
        for command, _, _ in reversed(entries):
            if command[:1] == RAW_PREFIX:
                ts = entry_time(command[1:])
                if ts:
                    clock.seen(ts)
                    return
