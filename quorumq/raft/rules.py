"""The Raft behaviour quorumq changes in PySyncObj 0.3.17, in one class that real nodes
(`RaftMember`) and the simulator's members share, so the simulator runs the same rules.

* prompt sends: the leader sends new entries right after appending them instead of on
  the next 100 ms heartbeat, and pushes a new commit index at once (`push_commit_index`,
  from a tick callback). Commands that arrive together still go out in one
  AppendEntries (group commit). The default, batched append path is kept:
  `appendEntriesUseBatch=False` makes followers truncate applied entries.
* the stale-reply fixes: with several AppendEntries in flight, a late success reply must
  not move the leader's `nextIndex` for that follower backwards (which makes the follower
  delete and re-add entries it already applied), and a late refusal must not move it
  forwards (which undoes the search for the index where the logs agree: a follower with
  a divergent tail under big entries never caught up). A late refusal may still send the
  leader back below what the follower holds: the follower's side copes (below).
* truncation only where logs conflict: Raft cuts a follower's log only at an entry that
  conflicts with the leader's; PySyncObj cuts everything after `prevLogIdx`, so a late
  AppendEntries made a follower delete entries it had acknowledged (even applied) and
  add fewer back. `trim_known_entries` rewrites such a message first.
* durability points: a follower calls `make_durable` before it acknowledges entries, a
  leader after appending its own (before the next tick counts them toward commit).
  Real nodes fsync there; the simulator marks its in-memory journal durable. A
  follower syncs once for all the AppendEntries it reads in one poll, then answers
  them (`hold_replies`): syncing per message let messages queue behind the syncs.
* raw commands: the log holds our codec's bytes under a command type of our own (4);
  nothing of ours is pickled. `apply_raw(index, payload)` gets the entry's Raft index.
* snapshots in our own encoding (`encode_snapshot` / `decode_snapshot`).
* replicated time comes from the leader: proposers leave an entry's time unstamped,
  and the leader stamps every raw entry as it appends it (`LeaderClock`: its monotonic
  clock from the replicated time it took over), so no node's wall clock moves the
  machines' clock after a cluster's first leader.
* stale snapshots refused: a leader sent back below what a follower holds (a late
  refusal) sends its snapshot again; a follower that installed it applied the entries
  after it a second time. Whoever stores the incoming snapshot asks
  `accept_leader_snapshot` first; a stale one is answered as what it is.
* a snapshot is written while the node goes on (`RaftMember`'s child process, the
  simulator's delayed write); the journal is compacted only once it is stored, and a
  follower behind the compacted log is sent the previous snapshot meanwhile.
* the commit index moves with a snapshot only when it is installed: PySyncObj moves a
  follower's commit index to the leader's (within its own log) on every message of a
  snapshot transfer, though the message checks nothing of the log. A follower with an
  uncommitted tail of an earlier term (an old leader back from a crash) applied that
  tail, entries no other replica has, while the snapshot was on its way.

* elections that do not disrupt a working cluster (`_pre_vote_gate`, `_start_election`):
  **pre-vote** (a node asks whether it could win before it raises its term, so a node
  cut off, stalled or behind never deposes a working leader), **leader stickiness** (a
  node that heard from its leader within the minimum election timeout, or a leader that
  heard from a majority, refuses pre-votes, and ignores votes, except for a leadership
  transfer), a **stale-term answer** (a node whose term is higher than a leader's tells
  it, so the cluster moves on instead of ignoring it), **check-quorum** (a leader that
  has not heard from a majority for the longest election timeout steps down:
  `leaderFallbackTimeout`), and votes and pre-votes refused to nodes outside this
  node's configuration (a removed server). See `_pre_vote_gate` for mixed versions.
* fast catch-up: a refusal names the first index of the conflicting term (or the
  follower's last index + 1), not one index back, and the leader sends again at once
  instead of on its next heartbeat (`_SyncObj__sendNextNodeIdx`, `_send_to`).
* silence judged only while awake: `peer_silence` counts a peer silent only from the
  later of its last answer and the end of this node's own last stall (`stalled_s`), so a
  leader paused past the node-down grace does not judge every peer down from
  timestamps taken before its pause; and a leader's duty (`propose_as_leader`) is
  appended only by the leader of the term that judged it, never forwarded to another.

The reasons, measured, are in docs/pysyncobj-notes.md. camelCase names here are
PySyncObj's; they stay inside quorumq/raft.
"""

from __future__ import annotations

import collections
import logging
import math
import queue as _queue
import threading
import time
import zlib
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import pysyncobj.syncobj as _syncobj
from pysyncobj import FAIL_REASON, SyncObj
from pysyncobj.node import Node
from pysyncobj.version import VERSION as _PYSYNCOBJ_VERSION

from .. import pathtiming
from ..codec import UnreadableEntryError, entry_time, stamp_entry
from ..machine import encoding
from .journal import DurableJournal, JournalDamagedError

logger = logging.getLogger(__name__)

if _PYSYNCOBJ_VERSION != "0.3.17":
    raise ImportError(
        f"quorumq's Raft hardening is written against pysyncobj 0.3.17, not {_PYSYNCOBJ_VERSION}"
    )

RAW_COMMAND = 4
"""Our command type in PySyncObj's log (PySyncObj uses 0-3)."""
_RAW_PREFIX = bytes([RAW_COMMAND])
_MEMBERSHIP_PREFIX = bytes([2])
"""PySyncObj's command type of a configuration change (`_COMMAND_TYPE.MEMBERSHIP`)."""
MAX_COMMAND_BYTES = 3 * 1024 * 1024
"""Commands must stay below PySyncObj's AppendEntries batch size (4 MiB here): its chunked
path for bigger single commands is broken."""

Entry = tuple[bytes, int, int]
"""A PySyncObj log entry: (command, index, term)."""


def trim_known_entries(message: dict[str, Any], log: Any) -> tuple[dict[str, Any], int | None]:
    """An AppendEntries `message` from the current leader, rewritten so that PySyncObj,
    which truncates the follower's `log` after `prevLogIdx`, truncates only where the
    log conflicts with the leader's (Raft's rule); and the index the follower must
    acknowledge itself, if PySyncObj must not (None: PySyncObj answers).

    Entries the log already holds with the same term are dropped from the front of the
    message. If nothing new is left and the log's last entry has the leader's term, the
    message is checked against that last entry: only the leader makes entries of its
    term, and it keeps them, so (log matching) the whole log is the leader's up to
    there. If nothing new is left and the log goes on in an earlier term, that tail may
    conflict with the leader's log, and may as well hold entries this follower
    acknowledged that are committed: Raft cuts only at a conflict, so nothing is cut.
    The message then keeps only what PySyncObj takes from every AppendEntries (the
    leader, its term, the commit index, capped at the last entry the message vouched
    for) and the follower acknowledges that entry itself. (PySyncObj cut the tail, and
    a tail below the commit index made the journal refuse and the node stop.)"""
    if "prevLogIdx" not in message or "transmission" in message or not len(log):
        return message, None
    first, last = log[0][1], log[-1][1]
    prev = message["prevLogIdx"]
    if not first <= prev < last or log[prev - first][2] != message["prevLogTerm"]:
        return message, None  # nothing to cut, or PySyncObj's refusal
    entries = message.get("entries") or []
    known = 0
    for entry in entries:
        idx = entry[1]
        if idx > last or log[idx - first][2] != entry[2]:
            break
        known += 1
    if known < len(entries):
        if not known:
            return message, None
        agreed = entries[known - 1]
        trimmed = {
            **message,
            "prevLogIdx": agreed[1],
            "prevLogTerm": agreed[2],
            "entries": entries[known:],
        }
        return trimmed, None
    if log[-1][2] == message["term"]:
        return {**message, "prevLogIdx": last, "prevLogTerm": log[-1][2], "entries": []}, None
    through = entries[-1][1] if entries else prev
    kept = {k: v for k, v in message.items() if k not in ("prevLogIdx", "prevLogTerm", "entries")}
    kept["commit_index"] = min(message["commit_index"], through)
    return kept, through


def wall_clock_ms() -> int:
    return int(time.time() * 1000)


STEP_DOWN = "quorumq_step_down"
"""A Raft message of ours: a member asks the leader to hand leadership over."""


def node_name(node: Any) -> str:
    """The quorumq name a Raft node carries (its address for nodes from before names)."""
    return str(getattr(node, "name", node.id))


ARRIVALS_KEPT = 256
"""Stamped times a node remembers the arrival of (a new leader credits the latest one)."""


class LeaderClock:
    """Replicated time, as leaders stamp it on the entries they take in.

    A new cluster's time starts at its first leader's wall clock. From then on no wall
    clock moves it: a leader stamps the replicated time it took over (the latest time
    stamped in its log), advanced by its monotonic clock. Taking over, a leader credits
    the time since that latest entry arrived here (`seen`): it was stamped no later
    than it arrived, so the election gap is not lost and the time still never runs
    ahead. Only that entry's arrival counts: crediting from another (an earlier leader's
    entry, seen when the latest came from a leader whose time ran behind) would jump
    over that lag, and messages enqueued meanwhile would expire early.

    So between any two stamps, queue time moves no more than true time, whatever any
    node's wall clock says or does (a wall clock followed within a second per term let
    a node days ahead gain a second per term it led: 3x true speed over short terms, and
    TTLs expired early). It may run behind: while no leader exists, after a restart,
    across a whole cluster's outage, it stands still (a TTL then lasts longer, never
    shorter). It never runs back."""

    def __init__(
        self,
        wall_ms: Callable[[], int] = wall_clock_ms,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.wall_ms = wall_ms
        self.monotonic = monotonic
        self._anchor: tuple[int, int, float] | None = None
        """(term, replicated time, monotonic time) when this node took over."""
        self._arrivals: collections.OrderedDict[int, float] = collections.OrderedDict()
        """The latest stamped times seen here, each with the monotonic time it arrived."""
        self._last = 0
        self._lock = threading.Lock()

    @property
    def term(self) -> int | None:
        anchor = self._anchor
        return anchor[0] if anchor else None

    def seen(self, ts_ms: int) -> None:
        """An entry stamped `ts_ms` arrived now (or was stamped here now)."""
        arrivals = self._arrivals
        if ts_ms > 0 and ts_ms not in arrivals:
            arrivals[ts_ms] = self.monotonic()
            if len(arrivals) > ARRIVALS_KEPT:
                arrivals.popitem(last=False)

    def take_over(self, term: int, replicated_ms: int) -> None:
        """This node leads `term`; the replicated time so far is `replicated_ms` (0: none).

        The anchor is the replicated time (plus the credit for what was seen), never
        this node's own earlier anchor: that may have come from its wall clock (a new
        cluster) without any entry stamped then, and keeping it moved the whole
        cluster's time to this node's wrong clock when it led again."""
        base = replicated_ms
        arrived = self._arrivals.get(replicated_ms)
        if arrived is not None:
            base += int((self.monotonic() - arrived) * 1000)
        if base <= 0:
            base = max(0, self.wall_ms())  # a new cluster: its time starts here
        with self._lock:
            self._last = base
            self._anchor = (term, base, self.monotonic())

    def peek(self, term: int) -> int | None:
        """What `now(term)` would stamp at this moment, recording nothing (None: not
        anchored for `term`): the leader asks whether a retry delay has run out."""
        anchor = self._anchor
        if anchor is None or anchor[0] != term:
            return None
        _, base, since = anchor
        return max(base + int((self.monotonic() - since) * 1000), self._last)

    def now(self, term: int) -> int | None:
        """The time to stamp on an entry taken in as leader of `term` (None: not anchored
        for that term yet; the entry stays unstamped)."""
        anchor = self._anchor
        if anchor is None or anchor[0] != term:
            return None
        _, base, since = anchor
        ts = base + int((self.monotonic() - since) * 1000)
        with self._lock:
            self._last = ts = max(ts, self._last)
        self.seen(ts)
        return ts


PROPOSALS_HELD_S = 15.0
"""How long a follower keeps each proposal while its leader is unreachable: the
replica's own timeout (`quorumq.replica.PROPOSAL_TIMEOUT_S`), after which its caller was
told the outcome is unknown."""


class Queued:
    """The callback of a local proposal while it waits in PySyncObj's queue: when it was
    proposed (a follower holds proposals while its leader is unreachable, each for
    `PROPOSALS_HELD_S` at most), and `term` if only the leader of that term may append it
    (`RaftRules.propose(leader_only=True)`: a node that no longer leads that term answers
    it NOT_LEADER instead of forwarding it to whoever leads now). Taken from the queue,
    the proposal goes on with its own callback."""

    __slots__ = ("at", "callback", "term")

    def __init__(
        self, callback: Callable[[Any, int], None] | None, at: float, term: int | None = None
    ) -> None:
        self.callback = callback
        self.at = at
        self.term = term

    def __call__(self, result: Any, reason: int) -> None:
        if self.callback is not None:
            self.callback(result, reason)


class _StampingQueue:
    """PySyncObj's queue of commands to append, stamping each as it is taken, dropping a
    leader's duty once that node no longer leads the term that judged it, and holding
    what waits while the leader is unreachable (`RaftRules._holds_proposals`)."""

    def __init__(
        self,
        queue: Any,
        stamp: Callable[[bytes], bytes],
        leads: Callable[[int], bool],
        holds: Callable[[], bool],
    ) -> None:
        self.queue = queue
        self._stamp = stamp
        self._leads = leads
        self._holds = holds

    def get_nowait(self) -> tuple[bytes, Any]:
        while True:
            if self._holds():
                raise _queue.Empty  # PySyncObj's loop stops taking: they wait here
            command, callback = self.queue.get_nowait()
            if isinstance(callback, Queued):
                if callback.term is not None and not self._leads(callback.term):
                    callback(None, FAIL_REASON.NOT_LEADER)
                    continue
                callback = callback.callback
            return self._stamp(command), callback

    def take_overdue(self, now: float) -> list[Queued]:
        """Out of the queue while its proposals are held: the local proposals held longer
        than `PROPOSALS_HELD_S` (they fail, never sent), wherever they wait. Peers'
        requests forwarded here stay, as PySyncObj keeps them: answered once this node
        knows a leader (refused at once, the node core gave up their acks after 20 tries
        0.1 s apart while an election went on, and their messages stayed held: seeds
        200, 330, 336 and 350 of the default profile)."""
        queue = self.queue
        overdue: list[Queued] = []
        with queue._FastQueue__lock:
            waiting = queue._FastQueue__queue
            if not any(
                isinstance(cb, Queued) and now - cb.at > PROPOSALS_HELD_S for _, cb in waiting
            ):
                return overdue
            kept: collections.deque[tuple[Any, Any]] = collections.deque()
            for command, callback in waiting:
                if isinstance(callback, Queued) and now - callback.at > PROPOSALS_HELD_S:
                    overdue.append(callback)
                else:
                    kept.append((command, callback))
            waiting.clear()
            waiting.extend(kept)
        return overdue

    def __getattr__(self, name: str) -> Any:
        return getattr(self.queue, name)


LEARNER_IDLE_S = 30.0
"""A learner (a node caught up before it is added) is dropped when no `members add`
has asked for it that long (the node core asks every 0.1 s for 20 s)."""
MAX_LEARNERS = 4
"""Nodes a leader catches up at once; an add of one more is refused until one leaves."""


class _Learner:
    """A node a leader catches up before it adds it (`RaftRules._caught_up_to_join`)."""

    __slots__ = ("asked_at", "round_started", "target")

    def __init__(self, now: float, target: int) -> None:
        self.asked_at = now
        """When an add of it was last asked for (monotonic seconds)."""
        self.round_started = now
        """When its current round of catching up began."""
        self.target = target
        """The leader's last index when the round began: the round ends once the
        learner has it."""


PEER_KEEPALIVE_S = 0.5
"""How often a follower sends a keepalive to each peer other than its leader."""
KEEPALIVE = "quorumq_keepalive"
COMMIT_NOTICE = "quorumq_commit_notice"
"""Marks an AppendEntries that only brings a new commit index (`push_commit_index`):
answered only if refused. A node that does not know the mark answers it, as before."""

PRE_VOTE = "quorumq_pre_vote"
"""A node about to stand for election asks whether it could win (Raft thesis 9.6):
{term it would stand in, its last log index and term}. Answered, never acted on."""
PRE_VOTE_ANSWER = "quorumq_pre_vote_answer"
"""{term asked, granted, the answering node's current term}."""
STALE_TERM = "quorumq_stale_term"
"""A node at a higher term tells a leader of a lower term so (PySyncObj ignores such a
leader's messages in silence, and the two never meet again)."""
HELLO = "quorumq_hello"
"""Sent once per new Raft connection: the sender speaks pre-vote (a node of an earlier
version ignores it, and is never asked to)."""
SPEAKS_PRE_VOTE = "quorumq_pre_votes"
ADDED_AT = "quorumq_added_at"
"""In a (pre-)vote request: the index of the entry in the asker's log that added it (0:
none there), so a member that missed that entry may vote for it (`_elects_outsider`)."""
MEMBERS = "quorumq_members"
"""In a pre-vote answer: the answerer's configuration, [[address, name], ...]."""
MAX_REACHED = 16
"""Nodes outside its configuration a node connects to at most, on its peers' word."""
TRANSFER = "quorumq_transfer"
"""Marks a vote request of a leadership transfer: granted whatever the stickiness."""
STALL_S = 0.2
"""Two consecutive looks of a node's Raft thread further apart than this: it stalled (a
pause, a GC, a starved CPU), and it judges no peer's silence across the stall."""

_FOLLOWER, _CANDIDATE, _LEADER = 0, 1, 2
"""PySyncObj's `_RAFT_STATE`."""


class _PreVoteRound:
    """One round of pre-votes this node asked for."""

    __slots__ = ("granted", "number", "refused", "term")

    def __init__(self, number: int, term: int, me: Any) -> None:
        self.number = number
        self.term = term
        self.granted: set[Any] = {me}
        self.refused: set[Any] = set()


LEADER_SILENT_PERIODS = 2
"""A follower whose connection to its leader closed elects if no AppendEntries comes
within this many heartbeat periods (a live leader redials at once and sends its next
heartbeat within one)."""
LEADER_LOST_TURN_S = 0.05
LEADER_LOST_JITTER_S = 0.02
"""The followers of a lost leader take turns to elect: their rank among the remaining
members by address, times `LEADER_LOST_TURN_S`, plus a random jitter within
`LEADER_LOST_JITTER_S`."""


class RaftRules(SyncObj):  # type: ignore[misc]
    """PySyncObj with quorumq's Raft rules. Subclasses give `apply_raw` and
    `make_durable`, call `push_commit_index` and `keep_peer_connections_alive` from a tick
    callback, and ask
    `accept_leader_snapshot` before they install a snapshot from the leader."""

    _sent_commit = 0
    """The highest commit index sent to the followers (in any AppendEntries)."""
    _handling_notice = False
    _marked_commit = 0
    """Path timing: the commit index last marked."""
    """The message being handled is a commit notice (`push_commit_index`)."""
    _held_replies: list[tuple[Any, bool, int, bool]] | None = None
    """Answers to AppendEntries waiting for one sync (`hold_replies`); None: not holding."""
    _message_from: Any = None
    """The peer whose message is being handled (the tick thread handles one at a time)."""
    _kept_after_snapshot: list[Entry] = []
    """The entries after an accepted leader snapshot's last one, kept (Raft's rule)."""
    _keepalive_due = 0.0
    _last_leader: Any = None
    _leader_closed: Any = None
    """The leader whose open connection closed, until it is heard from again."""
    """The last leader this node knew (`_SyncObj__onNodeDisconnected`)."""
    _answer_after_install: int | None = None
    """The next index to answer right after a snapshot install (its last index + 1)."""

    leader_clock: LeaderClock | None = None
    """Stamps the time on the entries this node appends as leader (`use_leader_clock`)."""
    journal: DurableJournal
    """This member's journal (subclasses open it)."""
    _snapshot: Callable[[], bytes]
    """The machine's state, for a snapshot (subclasses set it)."""
    leader_heard_at: float | None = None
    """When a message from the leader last arrived (monotonic seconds; metrics)."""
    fatal_error: BaseException | None = None
    """Why this member stopped by itself (its journal failed): the node must stop."""
    compaction_error: str | None = None
    """Why the last snapshot could not be written (None: the last one was), for status."""

    pre_vote = True
    """Ask for pre-votes before standing for election (a negative control turns it off:
    the node then elects as PySyncObj does)."""
    leader_stickiness = True
    """Refuse pre-votes, and ignore votes of nodes that speak pre-vote, while this node
    heard from its leader (or, leading, from a majority) within the minimum election
    timeout."""
    conflict_hints = True
    """A refusal names the first index of the conflicting term, not one index back."""
    resend_after_refusal = True
    """A leader sends again at once after a refusal, not on its next heartbeat."""
    stall_aware_silence = True
    """`peer_silence` counts no time across this node's own stalls."""
    learner_stage = True
    """Add a node only once it has caught up as a learner (`_caught_up_to_join`)."""

    _SyncObj__raftLeader: Any
    _SyncObj__raftElectionDeadline: float
    """(PySyncObj's fields, typed for the rules that set them.)"""
    _pre_vote_round: _PreVoteRound | None = None
    _deadline_in_tick: float | None = None
    """The election deadline `_onTick` set aside while PySyncObj ticks."""
    _deadline_pushed = False
    """The election deadline was pushed past a stall once (until a leader is heard or
    this node stands)."""
    _leader_since = 0.0
    """When this node last became leader (monotonic seconds)."""
    _last_look = 0.0
    """When this node's Raft thread last looked at the time (`_look`)."""
    awake_since = 0.0
    """When this node's Raft thread last came back from a stall (monotonic seconds)."""
    stalls = 0
    """Stalls of this node's Raft thread seen (longer than `STALL_S`)."""
    elections = 0
    """Elections this node stood in (after a pre-vote, a transfer, or as PySyncObj)."""
    pre_vote_rounds = 0
    """Pre-vote rounds this node asked for."""
    pre_votes_lost = 0
    """Pre-vote rounds that did not win: elections that did not disrupt anyone."""
    learners_joined = 0
    """Nodes this node caught up as learners and then added, as leader."""

    def start(self) -> None:
        """Start ticking (the owner is set up by then)."""

    def stop(self) -> None:
        """Stop ticking; close connections and the journal."""

    def use_leader_clock(self, clock: LeaderClock) -> None:
        """Stamp raw entries with `clock` as they are appended as leader (call before the
        first tick). Stamped at append, on the tick thread, after the new leader took
        the time over: an entry stamped when proposed (on any thread) could be left
        unstamped before that, or stamped while it waited in the queue, and then took
        the machine's time of an earlier entry, seconds old after a failover: a TTL
        counted from there expired early."""
        self.leader_clock = clock
        self._take_commands_through_rules()

    def _take_commands_through_rules(self) -> None:
        """PySyncObj's command queue, taken through `_StampingQueue` (once)."""
        queue: Any = getattr(self, "_SyncObj__commandsQueue")  # noqa: B009 (name-mangled)
        if not isinstance(queue, _StampingQueue):
            self._SyncObj__commandsQueue = _StampingQueue(
                queue, self._stamp_taken_command, self._leads, self._holds_proposals
            )

    def _leads(self, term: int) -> bool:
        return bool(self._isLeader()) and self.raftCurrentTerm == term

    def _settle_held_proposals(self) -> None:
        """As a follower holding proposals (`_holds_proposals`) or knowing no leader
        (PySyncObj's loop then takes nothing at all): fail each local proposal held past
        `PROPOSALS_HELD_S` (MISSING_LEADER). Without it a node that knew no leader (a
        leader isolated, stepped down by check-quorum) kept its proposals for as long as
        the partition lasted, and appended them after the clients' retries once it
        healed."""
        if self._isLeader() or not (self._SyncObj__raftLeader is None or self._holds_proposals()):
            return
        queue: Any = self._SyncObj__commandsQueue
        if not isinstance(queue, _StampingQueue):
            return
        for proposal in queue.take_overdue(_syncobj.monotonicTime()):
            proposal(None, FAIL_REASON.MISSING_LEADER)

    def _holds_proposals(self) -> bool:
        """Whether proposals wait in the queue: a follower whose connection to its
        leader is down keeps each for up to `PROPOSALS_HELD_S` (PySyncObj sent them on
        the connection that was down, where they were lost, and their callers heard
        nothing until their timeout), then fails it as never sent (MISSING_LEADER:
        certainly not applied), rather than keep it until the link heals, maybe hours
        later (a follower cut off from a leader the others still hear: pre-vote keeps it
        from standing, so the leader it knows stays). Each proposal its own time, not
        the connection's: the node core settles an ack refused as not applied again only
        20 times, 0.1 s apart, and acks failed at once once the leader had been gone
        long were given up during an 18 s outage, their messages held by a live
        consumer for good (simulator, CI seed 78; seed 20 of the liveness sweep with a
        1.2 s hold)."""
        leader = self._SyncObj__raftLeader
        return (
            leader is not None
            and not self._isLeader()
            and leader not in self._SyncObj__connectedNodes
        )

    def _stamp_taken_command(self, command: bytes) -> bytes:
        """`command`, taken from the queue to append: stamped if it is a raw entry and this
        node leads (a follower forwards it unstamped, and the leader stamps it)."""
        clock = self.leader_clock
        if clock is None or command[:1] != _RAW_PREFIX or not self._isLeader():
            return command
        ts = clock.now(self.raftCurrentTerm)
        if ts is None:
            return command
        return _RAW_PREFIX + stamp_entry(command[1:], ts)

    def apply_raw(self, index: int, payload: bytes) -> Any:
        """Apply one committed raw command; what it returns goes to the proposer's callback."""
        raise NotImplementedError

    def replicated_time_ms(self) -> int:
        """The machine's clock (the largest time applied so far): a new leader's floor."""
        return 0

    def make_durable(self) -> None:
        """Every journal entry written so far must survive a crash once this returns."""
        raise NotImplementedError

    def tick_soon(self) -> None:
        """Have the next tick come at once rather than after a tick period (the simulator
        ticks on its own schedule)."""

    # -------------------------------------------------------------- proposing

    def propose(
        self,
        payload: bytes,
        callback: Callable[[Any, int], None] | None,
        *,
        leader_only: bool = False,
    ) -> None:
        """Submit `payload` for the log. `callback(result, FAIL_REASON)` runs on the tick
        thread: SUCCESS with what `apply_raw` returned on this node.

        `leader_only`: a leader's judgement (a node down, time passing), appended only
        by this node while it still leads the term it leads now; otherwise answered
        NOT_LEADER. A duty queued just before its leader was deposed (a leader paused
        in the middle of a tick judged every peer down, and the next tick forwarded
        those `NodeDown`s to the new leader, which committed them) is never forwarded."""
        if len(payload) > MAX_COMMAND_BYTES:
            raise ValueError(f"command of {len(payload)} bytes exceeds {MAX_COMMAND_BYTES}")
        if leader_only:
            term = self.raftCurrentTerm
            if not self._leads(term):
                if callback is not None:
                    callback(None, FAIL_REASON.NOT_LEADER)
                return
            self._take_commands_through_rules()
            at = _syncobj.monotonicTime()
            self._applyCommand(payload, Queued(callback, at, term), RAW_COMMAND)
            return
        self._applyCommand(payload, callback, RAW_COMMAND)

    def _applyCommand(self, command: bytes, callback: Any, commandType: int | None = None) -> None:
        """PySyncObj's, with each local proposal's time (`Queued`)."""
        if not isinstance(callback, Queued | tuple):  # (a tuple: a peer's, forwarded here)
            callback = Queued(callback, _syncobj.monotonicTime())
        super()._applyCommand(command, callback, commandType)

    def _anchor_leader_clock(self) -> None:
        """On the tick thread: a new leader takes the replicated time over."""
        clock = self.leader_clock
        term = self.raftCurrentTerm
        if clock is None or clock.term == term or not self._isLeader():
            return
        log = self._SyncObj__raftLog
        latest = 0
        for pos in range(len(log) - 1, max(-1, len(log) - 1000), -1):
            command = log[pos][0]
            if command[:1] == _RAW_PREFIX:
                latest = entry_time(command[1:])
                if latest:
                    break
        clock.take_over(term, max(latest, self.replicated_time_ms()))

    def _checkCommandsToApply(self) -> None:
        self._take_commands_through_rules()
        self._settle_held_proposals()
        self._anchor_leader_clock()
        if not self._commands_waiting():
            return  # most ticks (a message read, a timer): PySyncObj's loop takes nothing
        log = self._SyncObj__raftLog
        before = log[-1][1] if len(log) else 0
        super()._checkCommandsToApply()
        if self._isLeader() and len(log) and log[-1][1] != before:
            timed = range(before + 1, log[-1][1] + 1) if pathtiming.ENABLED else range(0)
            for index in timed:
                pathtiming.mark("raft.appended", ("i", index))
            self._SyncObj__sendAppendEntries()  # send at once, not on the next heartbeat
            for index in timed:
                pathtiming.mark("raft.sent", ("i", index))
            self.make_durable()  # overlaps with the round trip; done before commit counts us
            for index in timed:
                pathtiming.mark("raft.synced", ("i", index))
            if not self._SyncObj__otherNodes:
                # A lone member commits its entries at the next tick, and no answer comes
                # to wake it: it waited a whole tick period (50 ms) per proposal
                self.tick_soon()

    def _mark_commit(self) -> None:
        """Path timing: the commit index this node knows moved (a covering mark)."""
        commit = self.raftCommitIndex
        if commit > self._marked_commit:
            self._marked_commit = commit
            pathtiming.mark("raft.committed", ("i", commit))

    def _commands_waiting(self) -> bool:
        """Whether a proposal waits in PySyncObj's queue (read without its lock: a
        proposal that lands just after is taken on the tick its wake-up starts)."""
        queue: Any = self._SyncObj__commandsQueue
        if isinstance(queue, _StampingQueue):
            queue = queue.queue
        return bool(queue._FastQueue__queue)

    def push_commit_index(self) -> None:
        """As leader, tell followers a new commit index at once (they apply promptly).

        A follower that has every entry gets a commit notice: an empty AppendEntries,
        checked and taken as any other, that it answers only if it refuses it. Its
        answer would tell the leader nothing new, and answering every commit made a
        quarter of a cluster's messages. Any follower behind: every follower gets
        PySyncObj's AppendEntries, entries included, answered as always."""
        commit = self.raftCommitIndex
        if not self._isLeader() or commit <= self._sent_commit:
            return
        self._sent_commit = commit
        log = self._SyncObj__raftLog
        last = self._SyncObj__getCurrentLogIndex()
        connected = self._SyncObj__connectedNodes
        next_index = self._SyncObj__raftNextIndex
        followers = [
            node
            for node in self._SyncObj__otherNodes | self._SyncObj__readonlyNodes
            if node in connected
        ]
        if any(not log[0][1] < next_index[node] == last + 1 for node in followers):
            self._SyncObj__sendAppendEntries()
            return
        prev_index, prev_term = self._SyncObj__getPrevLogIndexTerm(last + 1)
        notice = {
            "type": "append_entries",
            "term": self.raftCurrentTerm,
            "commit_index": commit,
            "entries": [],
            "prevLogIdx": prev_index,
            "prevLogTerm": prev_term,
            COMMIT_NOTICE: True,
        }
        transport = self._SyncObj__transport
        for node in sorted(followers, key=lambda n: n.id):
            transport.send(node, notice)
        if pathtiming.ENABLED:
            pathtiming.mark("raft.notice", ("i", commit))

    def _SyncObj__applyLogEntries(self) -> bool:
        # A leader tells followers of a new commit before it applies the entries, not
        # after (and after its tick's callbacks): they deliver to their consumers
        # meanwhile.
        if self._isLeader():
            self.push_commit_index()
        return bool(super()._SyncObj__applyLogEntries())

    def _SyncObj__sendAppendEntries(self) -> None:
        # every AppendEntries carries the commit index: no notice needed for it
        self._sent_commit = max(self._sent_commit, self.raftCommitIndex)
        super()._SyncObj__sendAppendEntries()

    def _SyncObj__sendNextNodeIdx(
        self, node: Any, reset: bool = False, nextNodeIdx: int | None = None, success: bool = False
    ) -> None:
        if success and self._handling_notice:
            return  # a commit notice taken: the leader knows this log already
        next_index = nextNodeIdx
        if reset and not success and next_index is not None and self.conflict_hints:
            next_index = self._conflict_hint(next_index)  # PySyncObj named prevLogIdx
        after_install, self._answer_after_install = self._answer_after_install, None
        if next_index is None and after_install is not None:
            next_index = after_install  # a snapshot was installed (see _SyncObj__loadDumpFile)
        elif next_index is None:  # PySyncObj's default, taken now
            next_index = self._SyncObj__getCurrentLogIndex() + 1
        reply = (node, reset, next_index, success)
        if self._held_replies is not None:
            self._held_replies.append(reply)
        else:
            self._send_replies([reply])

    def _send_replies(self, replies: list[tuple[Any, bool, int, bool]]) -> None:
        """A follower acknowledges only what is durable: one sync, then the answers."""
        if any(success for *_, success in replies):
            self.make_durable()
            if pathtiming.ENABLED:
                acked = max(i for _, _, i, success in replies if success) - 1
                pathtiming.mark("raft.synced", ("i", acked))
        for node, reset, next_index, success in replies:
            super()._SyncObj__sendNextNodeIdx(
                node, reset=reset, nextNodeIdx=next_index, success=success
            )
            if pathtiming.ENABLED and success:
                pathtiming.mark("raft.answered", ("i", next_index - 1))

    def hold_replies(self) -> None:
        """Group commit on a follower: until `release_replies`, answers to AppendEntries
        wait, and one sync then covers every message read in between (a follower that
        synced per message let them queue behind the syncs)."""
        self._held_replies = []

    def release_replies(self) -> None:
        """Apply what became committed, then sync what the held answers acknowledge,
        send them in order, stop holding. A follower that read a commit notice and the
        next AppendEntries in one poll applied the committed entry only after syncing
        the new one (its local consumers waited a whole fdatasync, about 1 ms)."""
        if self.raftCommitIndex > self.raftLastApplied and not self._isLeader():
            self._SyncObj__applyLogEntries()
        self._send_held_replies()
        self._held_replies = None

    def _send_held_replies(self) -> None:
        held = self._held_replies
        if held:
            self._held_replies = []
            self._send_replies(held)

    def keep_peer_connections_alive(self) -> None:
        """Send each peer but the leader a keepalive every `PEER_KEEPALIVE_S` (call from
        a tick callback). PySyncObj closes a connection it has read nothing from for
        `connectionTimeout` (2 s), and checks when it next sends on it. Followers never
        talk to one another, so when a leader died, the first vote request a follower
        sent closed its idle connection to the other follower instead of going out: the
        election failed, and the cluster waited a whole election timeout (0.4-0.6 s of
        every failover; seen with timestamps in the real cluster, not in the simulator,
        which did not close idle connections)."""
        if self._isLeader():
            return
        now = _syncobj.monotonicTime()
        if now < self._keepalive_due:
            return
        self._keepalive_due = now + PEER_KEEPALIVE_S
        leader = self._SyncObj__raftLeader
        transport = self._SyncObj__transport
        for node in self._SyncObj__otherNodes & self._SyncObj__connectedNodes:
            if node != leader:
                transport.send(node, {"type": KEEPALIVE})

    def _SyncObj__onNodeDisconnected(self, node: Any) -> None:
        """A connection to a peer closed, or a dial to it failed. For this follower's
        leader (or, with no leader known, the last one: a candidate's vote request can
        come in before the news of the close, and a follower that refuses that vote,
        its log being longer, must not wait out a timeout):

        * its open connection closed: its process died, or the connection was reset. A
          live leader redials at once and sends its next heartbeat within a period, so
          elect if none comes within `LEADER_SILENT_PERIODS` periods (not after a whole
          election timeout, 0.25-0.6 s), a slow leader keeps its connection anyway;
        * then a dial to it failed (its port refuses: the process is gone): elect now.

        The followers take turns (`LEADER_LOST_TURN_S`) so that they do not all ask for
        votes at once and split them. An election is always safe: this only moves when."""
        was_connected = node in self._SyncObj__connectedNodes
        super()._SyncObj__onNodeDisconnected(node)
        if node in self.learners:  # it may come back empty: it proves its log again
            self._SyncObj__raftMatchIndex[node] = 0
            self._SyncObj__raftNextIndex[node] = self._SyncObj__getCurrentLogIndex() + 1
        me = self._SyncObj__selfNode
        leader = self._SyncObj__raftLeader
        if me is None or self._isLeader():
            return
        if was_connected and node == leader:
            # proposals forwarded to it are answered on this connection or never: fail
            # them now (outcome unknown), not after the caller's 15 s timeout
            self._SyncObj__onLeaderChanged()
        if was_connected and node == (leader if leader is not None else self._last_leader):
            self._leader_closed = node
            period: float = self._SyncObj__conf.appendEntriesPeriod
            self._elect_within(node, LEADER_SILENT_PERIODS * period, "its connection closed")
        elif not was_connected and node == self._leader_closed:
            self._leader_closed = None  # once: a minority side must not elect at every dial
            self._elect_within(node, 0.0, "it refuses connections")

    def _elect_within(self, lost: Any, wait_s: float, why: str) -> None:
        """Pull this follower's election deadline in to `wait_s` plus its turn."""
        me = self._SyncObj__selfNode
        voters = sorted(n.id for n in self._SyncObj__otherNodes if n != lost)
        rank = sorted([*voters, me.id]).index(me.id)
        delay = wait_s + rank * LEADER_LOST_TURN_S + LEADER_LOST_JITTER_S * _syncobj.random.random()
        deadline: float = getattr(self, "_SyncObj__raftElectionDeadline")  # noqa: B009
        if deadline == math.inf and self._deadline_in_tick is not None:
            deadline = self._deadline_in_tick  # (set aside by `_onTick` while PySyncObj ticks)
        setattr(  # noqa: B010 (PySyncObj's private field, untyped)
            self, "_SyncObj__raftElectionDeadline", min(deadline, _syncobj.monotonicTime() + delay)
        )
        logger.info("the leader lost (%s): an election within %.3f s", why, delay)

    def _SyncObj__onBecomeLeader(self) -> None:
        self._drop_reached()  # a leader dials its own configuration only
        self._sent_commit = 0  # (a snapshot install may have taken the commit index back)
        self._leader_since = _syncobj.monotonicTime()
        self._answered_at.clear()  # answers to an earlier term of leadership say nothing now
        super()._SyncObj__onBecomeLeader()
        logger.info("leading at term %d", self.raftCurrentTerm)

    def until_election_s(self) -> float | None:
        """Seconds until this follower or candidate starts an election if nothing comes
        (None as leader): the tick loop waits no longer than this."""
        if self._isLeader() or not self._SyncObj__connectedNodes:
            return None  # (connected to no one, PySyncObj does not elect: no need to wake)
        deadline: float = self._SyncObj__raftElectionDeadline
        return max(0.0, deadline - float(_syncobj.monotonicTime()))

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

    def _handled_election_message(self, node: Any, message: dict[str, Any]) -> bool:
        """Our election messages, and the vote requests and AppendEntries they change;
        True if the message needs nothing more."""
        kind = message.get("type")
        if kind == HELLO:
            self._speakers.add(node)
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
            return self._ignores_vote(node, message)
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
            if command[:1] == _RAW_PREFIX:
                ts = entry_time(command[1:])
                if ts:
                    clock.seen(ts)
                    return

    def _set_commit_index(self, index: int) -> None:
        self._SyncObj__raftCommitIndex = index
        self._SyncObj__raftLog.setRaftCommitIndex(index)

    def snapshot_bytes(self, data: tuple[Entry, Entry, Any]) -> bytes:
        """The snapshot PySyncObj asks for (its last entry, the one before, its
        configuration), in our encoding: the machine's state, the members as of its
        last entry, the removed members. For the subclasses' serializers."""
        last, prev, cluster = data
        members = [(str(n.id), node_name(n)) for n in self.configuration_at(last[1], cluster)]
        return encode_snapshot(last, prev, members, self._snapshot(), self.removed_members)

    def accept_leader_snapshot(self, last_index: int, last_term: int) -> bool:
        """The leader's snapshot, up to entry (`last_index`, `last_term`), has arrived
        whole: whether to install it. One not ahead of what this node applied is refused
        and answered.

        Installed the Raft way: if this log holds the snapshot's last entry (same index,
        same term), the entries after it are kept (`_SyncObj__loadDumpFile`); only a log
        that does not hold it is discarded. PySyncObj cleared the whole journal, so a
        follower that had acknowledged more than it had applied lost entries that may be
        committed (a crash then lost them for good).

        A late refusal can send the leader back below what a follower holds, and the
        leader then sends its snapshot again; a follower that installed it applied the
        entries after it a second time, and ran their effects again: deliveries its
        consumers had had. A stale snapshot is answered as what it is: this node holds,
        committed, everything up to what it applied. The caller keeps its own snapshot
        as it is (and the commit index stays: `_SyncObj__onMessageReceived`)."""
        applied = self.raftLastApplied
        if last_index > applied:
            self._kept_after_snapshot = entries_after(self._SyncObj__raftLog, last_index, last_term)
            return True
        logger.info(
            "not installing the leader's snapshot at index %d: applied up to %d already",
            last_index,
            applied,
        )
        self._SyncObj__sendNextNodeIdx(self._message_from, nextNodeIdx=applied + 1, success=True)
        return False

    # -------------------------------------------------------------- elections

    @property
    def _speakers(self) -> set[Any]:
        """Peers known to speak pre-vote (they said hello, or asked or answered one)."""
        speakers: set[Any] | None = self.__dict__.get("_speakers_set")
        if speakers is None:
            speakers = self.__dict__["_speakers_set"] = set()
        return speakers

    def _look(self) -> float | None:
        """The Raft thread looks at the clock. A gap since its last look is a stall of
        this node: what it heard before is as old as the stall, and says nothing of its
        peers meanwhile (`peer_silence` counts no silence across it). Returns when the
        stall began (None: no stall)."""
        now = _syncobj.monotonicTime()
        before = self._last_look
        self._last_look = now
        if not before or now - before <= STALL_S:
            return None
        self.awake_since = now
        self.stalls += 1
        return before

    def _onTick(self, timeToWait: float = 0.0) -> None:
        stalled_from = self._look()
        self._drop_learners()
        if stalled_from is not None and self.stall_aware_silence and not self._isLeader():
            # A follower whose deadline ran out during its own stall reads what its
            # leader sent before it judges the leader gone (PySyncObj looks at the
            # deadline before it reads); once, or a node whose every tick comes late
            # would never stand at all.
            deadline: float = self._SyncObj__raftElectionDeadline
            if stalled_from < deadline <= self.awake_since and not self._deadline_pushed:
                period: float = self._SyncObj__conf.appendEntriesPeriod
                self._SyncObj__raftElectionDeadline = self.awake_since + 2 * period
                self._deadline_pushed = True
        self._pre_vote_gate()
        if not self.pre_vote or self._isLeader():
            super()._onTick(timeToWait)
            return
        # PySyncObj looks at the deadline again, a moment later: it must never stand for
        # election by itself (without pre-vote) when the deadline falls in between, or a
        # stall there. What its poll sets (a heartbeat, a vote, a transfer) is kept.
        deadline = self._deadline_in_tick = self._SyncObj__raftElectionDeadline
        self._SyncObj__raftElectionDeadline = math.inf
        try:
            super()._onTick(timeToWait)
        finally:
            self._deadline_in_tick = None
            if self._SyncObj__raftElectionDeadline == math.inf:
                self._SyncObj__raftElectionDeadline = deadline

    def _pre_vote_gate(self) -> None:
        """Before PySyncObj's tick: if this follower's election deadline has passed, ask
        for pre-votes instead of raising its term; stand for election only once a
        majority said it could win (`_on_pre_vote_answer`), or for a leadership
        transfer. A node cut off, paused or behind so never raises its term, and never
        deposes a leader that a majority still hears (the lagging follower of issue 27
        took the term from 5 to 102 in 33 s, and each new leader began its search for
        the follower's match point again).

        Mixed versions (a rolling upgrade): a peer of an earlier version ignores
        pre-votes and never says hello. After a whole round without a majority, the
        connected peers never heard to speak pre-vote count as granting (they vote as
        before), so a cluster with old nodes elects as it did before; stickiness holds
        only against nodes known to speak pre-vote, so an old node with a higher term
        is never locked out (etcd #8501: stickiness without pre-vote on the other side
        left a node out for good); and a new node at a higher term than a new leader
        tells it (`STALE_TERM`), where an old one still deposes it with its vote
        request, as before."""
        if self._SyncObj__raftState == _LEADER or self._SyncObj__selfNode is None:
            self._pre_vote_round = None
            return
        now = _syncobj.monotonicTime()
        if self._SyncObj__raftElectionDeadline >= now or not self._SyncObj__connectedToAnyone():
            return
        if not self.pre_vote:
            self.elections += 1
            return  # PySyncObj stands for election in this tick
        transfer = bool(self._SyncObj__transferInProgress)
        round_ = self._pre_vote_round
        if transfer or not self._SyncObj__otherNodes:
            self._start_election(transfer=transfer)
        elif round_ is not None and self._with_earlier_versions(round_):
            self._start_election(transfer=False)
        else:
            if round_ is not None:
                self.pre_votes_lost += 1
            self._start_pre_vote(now)

    def _majority(self, votes: int) -> bool:
        return votes > (len(self._SyncObj__otherNodes) + 1) / 2

    def _with_earlier_versions(self, round_: _PreVoteRound) -> bool:
        """Whether the round's grants, with the connected peers never heard to speak
        pre-vote, make a majority."""
        others = self._SyncObj__otherNodes
        connected = self._SyncObj__connectedNodes
        earlier = {n for n in others if n in connected and n not in self._speakers}
        return bool(earlier) and self._majority(1 + len((round_.granted & others) | earlier))

    def _start_pre_vote(self, now: float) -> None:
        self._deadline_pushed = False
        me = self._SyncObj__selfNode
        self.pre_vote_rounds += 1
        round_ = _PreVoteRound(self.pre_vote_rounds, self.raftCurrentTerm + 1, me)
        self._pre_vote_round = round_
        self._SyncObj__raftElectionDeadline = now + self._SyncObj__generateRaftTimeout()
        request = {
            "type": PRE_VOTE,
            "term": round_.term,
            "round": round_.number,
            "last_log_index": self._SyncObj__getCurrentLogIndex(),
            "last_log_term": self._SyncObj__getCurrentLogTerm(),
            ADDED_AT: self._own_add_index(),
        }
        transport = self._SyncObj__transport
        for node in sorted(self._SyncObj__otherNodes, key=lambda n: n.id):
            transport.send(node, request)

    def _start_election(self, *, transfer: bool) -> None:
        """PySyncObj's election, with vote requests that say who asks and why."""
        self._pre_vote_round = None
        self.elections += 1
        self._SyncObj__raftElectionDeadline = (
            _syncobj.monotonicTime() + self._SyncObj__generateRaftTimeout()
        )
        self._SyncObj__transferInProgress = False
        self._SyncObj__raftLeader = None
        self._SyncObj__setState(_CANDIDATE)
        self._SyncObj__setCurrentTerm(self.raftCurrentTerm + 1, self._SyncObj__selfNode.id)
        self._SyncObj__votesCount = 1
        request = {
            "type": "request_vote",
            "term": self.raftCurrentTerm,
            "last_log_index": self._SyncObj__getCurrentLogIndex(),
            "last_log_term": self._SyncObj__getCurrentLogTerm(),
            SPEAKS_PRE_VOTE: True,
            ADDED_AT: self._own_add_index(),
        }
        if transfer:
            request[TRANSFER] = True
        transport = self._SyncObj__transport
        for node in sorted(self._SyncObj__otherNodes, key=lambda n: n.id):
            transport.send(node, request)
        self._SyncObj__onLeaderChanged()
        if self._majority(self._SyncObj__votesCount):
            self._SyncObj__onBecomeLeader()

    def _log_up_to_date(self, last_index: Any, last_term: Any) -> bool:
        """Raft's election restriction: a log at least as up to date as this one's."""
        my_term: int = self._SyncObj__getCurrentLogTerm()
        if type(last_index) is not int or type(last_term) is not int:
            return False
        return last_term > my_term or (
            last_term == my_term and last_index >= self._SyncObj__getCurrentLogIndex()
        )

    def in_lease(self) -> bool:
        """Whether this node heard from its leader within the minimum election timeout,
        or, leading, from a majority within it: the cluster works, and a pre-vote or a
        vote (other than for a transfer) would only disrupt it."""
        now = _syncobj.monotonicTime()
        window: float = self._SyncObj__conf.raftMinTimeout
        if self._isLeader():
            answered = self._answered_at
            since = max(now - window, self.awake_since)
            heard = sum(1 for n in self._SyncObj__otherNodes if answered.get(n, 0.0) > since)
            return self._majority(1 + heard)
        heard_at = self.leader_heard_at
        return bool(
            self._SyncObj__raftLeader is not None
            and self._leader_closed is None  # its connection closed: it may be gone
            and heard_at is not None
            and now - heard_at < window
        )

    def _is_member(self, node: Any) -> bool:
        return node in self._SyncObj__otherNodes

    def _elects_outsider(self, message: dict[str, Any]) -> bool:
        """Whether this node may vote for an asker outside its configuration: one whose
        log holds the entry that added it, past this log's end (this node missed it).
        A removed node, a learner or a stranger holds no such entry, and stays ignored.
        Raft's votes never depended on the voter's configuration (thesis 4.1); ignoring
        outsiders only kept removed nodes from disrupting. Without this, {A, B, C, D}
        with B lost for good, A behind the add of D, and D's log longer than C's, could
        never elect: A ignored D, D refused C (simulator, seed 140)."""
        added_at = message.get(ADDED_AT)
        return type(added_at) is int and added_at > self._SyncObj__getCurrentLogIndex()

    def took_snapshot(self, stored: StoredSnapshot) -> None:
        """A snapshot was read (this node's own at start-up, or its leader's): the
        members it removed, and whether its configuration has this node."""
        self.removed_members.clear()
        self.removed_members.update(stored.removed)
        me = self._SyncObj__selfNode
        has_me = me is not None and any(a == str(me.id) for a, _ in stored.members)
        self._member_at_snapshot = int(stored.last[1]) if has_me else 0

    _member_at_snapshot = 0
    """The last index of the last snapshot read, if its configuration has this node."""

    def _own_add_index(self) -> int:
        """The index of the entry in this log that added this node, or, if no entry of
        this log names it, the last index of a snapshot whose configuration has it (it
        was added by then: in the first configuration, or by an entry compacted away;
        CI sweep seed 14: D's add was in its snapshot, and A gone for good, B ignored
        it). 0: none of them; it is no member (a learner, a removed node)."""
        me = self._SyncObj__selfNode
        log = self._SyncObj__raftLog
        for pos in range(len(log) - 1, -1, -1):
            command, idx, _ = log[pos]
            if command[:1] != _MEMBERSHIP_PREFIX:
                continue
            change = self._SyncObj__parseChangeClusterRequest(command)
            if change is None or len(change) < 2:
                continue
            if str(getattr(change[1], "id", change[1])) == str(me.id):
                return int(idx) if change[0] == "add" else 0
        return self._member_at_snapshot

    def _SyncObj__setCurrentTerm(self, term: int, votedForNodeId: Any) -> None:
        if term != self.raftCurrentTerm:
            self._pre_vote_round = None  # its grants were for a term that is gone
        super()._SyncObj__setCurrentTerm(term, votedForNodeId)

    def _set_higher_term(self, term: int) -> None:
        """Take a higher term seen on the wire and follow (as PySyncObj does for a vote)."""
        self._SyncObj__setCurrentTerm(term, None)
        self._SyncObj__setState(_FOLLOWER)
        self._SyncObj__raftLeader = None
        self._pre_vote_round = None

    def _on_pre_vote(self, node: Any, message: dict[str, Any]) -> None:
        """Could `node` win an election? Yes only for a member whose term would be past
        this node's, whose log is up to date, while this node hears no working leader.
        Nothing changes here either way."""
        self._speakers.add(node)
        term = message.get("term")
        granted = (
            type(term) is int
            and term > self.raftCurrentTerm
            and (self._is_member(node) or self._elects_outsider(message))
            and self._log_up_to_date(message.get("last_log_index"), message.get("last_log_term"))
            and not (self.leader_stickiness and self.in_lease())
        )
        answer: dict[str, Any] = {
            "type": PRE_VOTE_ANSWER,
            "term": term,
            "round": message.get("round"),
            "granted": granted,
            "current_term": self.raftCurrentTerm,
        }
        leader = self._SyncObj__raftLeader
        if not granted and leader is not None:
            answer["leader"] = [str(leader.id), node_name(leader)]
        me = self._SyncObj__selfNode
        answer[MEMBERS] = [[str(n.id), node_name(n)] for n in [me, *self._SyncObj__otherNodes]]
        self._SyncObj__transport.send(node, answer)

    def _on_pre_vote_answer(self, node: Any, message: dict[str, Any]) -> None:
        self._speakers.add(node)
        self._reach_leader(message.get("leader"))
        members = message.get(MEMBERS)
        if isinstance(members, list):
            for member in members[:MAX_REACHED]:
                self._reach_leader(member, why="a member of a peer's configuration")
        current = message.get("current_term")
        if type(current) is int and current > self.raftCurrentTerm and not self._isLeader():
            # A node is at a higher term: take it, or no round of ours could be granted
            # by it (and a log only this node has could never lead again).
            self._set_higher_term(current)
            return
        round_ = self._pre_vote_round
        if (
            round_ is None
            or message.get("term") != round_.term
            or round_.term != self.raftCurrentTerm + 1
            or message.get("round") != round_.number
            or self._isLeader()
        ):
            return  # late: an answer to an earlier round, or from before a new term
        (round_.granted if message.get("granted") else round_.refused).add(node)
        if self._majority(len(round_.granted & self._SyncObj__otherNodes) + 1):
            self._start_election(transfer=False)

    def _reach_leader(self, leader: Any, why: str = "a leader") -> None:
        """A member that refused this node a pre-vote named its leader: if this node's
        configuration lacks that leader (it missed the entry adding it, or installed a
        snapshot from before it), connect to it all the same; its AppendEntries bring
        that entry. PySyncObj connects only to the members of its configuration, so
        such a follower never heard from that leader, and (once pre-vote kept it from
        deposing the leader) stayed behind for good (simulator, seed 43 of the CI
        sweep: a node wiped and added back, whose first snapshot predated the leader's
        own add). The name comes from an authenticated member; the connection is
        authenticated as any other."""
        if not (
            isinstance(leader, list | tuple)
            and len(leader) == 2
            and all(isinstance(part, str) for part in leader)
        ):
            return
        address, name = leader
        me = self._SyncObj__selfNode
        known = {str(n.id) for n in self._SyncObj__otherNodes}
        if me is None or address == str(me.id) or address in known or self._isLeader():
            return
        reached: dict[str, Any] = self.__dict__.setdefault("_reached_leaders", {})
        if address in reached or len(reached) >= MAX_REACHED:
            return
        reached[address] = node = self.make_node(name, address)
        logger.info("reaching %s %s at %s, which this configuration lacks", why, name, address)
        self._SyncObj__transport.addNode(node)

    def _forget_reached_leaders(self) -> None:
        """A leader of this configuration is heard: leaders reached outside it that are
        still not members are dropped from the transport (it redialled them for good),
        and any may be reached again later."""
        leader = self._SyncObj__raftLeader
        if leader is not None and leader in self._SyncObj__otherNodes:
            self._drop_reached()

    def _drop_reached(self) -> None:
        reached: dict[str, Any] | None = self.__dict__.get("_reached_leaders")
        if not reached:
            return
        members = {str(n.id) for n in self._SyncObj__otherNodes}
        for address in sorted(set(reached) - members):
            self._SyncObj__transport.dropNode(reached[address])
        reached.clear()

    def _ignores_vote(self, node: Any, message: dict[str, Any]) -> bool:
        """Whether a vote request is dropped unread (no term taken, no vote): from a node
        outside this configuration (a removed server), or, while this node is in its
        lease, from a node that speaks pre-vote and was not asked to take over."""
        if self._SyncObj__selfNode is None:
            return False
        if not self._is_member(node) and not self._elects_outsider(message):
            return True
        speaks = bool(message.get(SPEAKS_PRE_VOTE)) or node in self._speakers
        return (
            self.leader_stickiness
            and speaks
            and not message.get(TRANSFER)
            and message.get("term", 0) > self.raftCurrentTerm
            and self.in_lease()
        )

    def _SyncObj__onNodeConnected(self, node: Any) -> None:
        super()._SyncObj__onNodeConnected(node)
        if self.pre_vote:
            self._SyncObj__transport.send(node, {"type": HELLO, SPEAKS_PRE_VOTE: True})

    def _conflict_hint(self, prev_index: int) -> int:
        """Where the leader should send from after this follower refused an
        AppendEntries whose previous entry (`prev_index`) has another term here: the
        first index of that term in this log (Raft thesis 5.3: all of a term's entries
        are skipped in one round trip, not one index per heartbeat), never below what
        is committed here, nor below this log's second entry (a refusal named the
        first, and the leader's next message would be refused for lack of it)."""
        log = self._SyncObj__raftLog
        if not len(log):
            return prev_index
        first = log[0][1]
        pos = prev_index - first
        if not 0 <= pos < len(log):
            return prev_index
        term = log[pos][2]
        lo, hi = 0, pos  # terms never decrease along a log: the first of `term`
        while lo < hi:
            mid = (lo + hi) // 2
            if log[mid][2] < term:
                lo = mid + 1
            else:
                hi = mid
        hint: int = max(log[lo][1], self.raftCommitIndex + 1, first + 1)
        return min(prev_index, hint)

    def _send_to(self, node: Any) -> None:
        """As leader, send `node` its next AppendEntries now (after its refusal). One
        that needs a snapshot or a chunked entry is left to the next tick, which sends
        at once."""
        if node not in self._SyncObj__connectedNodes:
            return
        next_index = self._SyncObj__raftNextIndex.get(node)
        log = self._SyncObj__raftLog
        batch = self._SyncObj__conf.appendEntriesBatchSizeBytes
        last = self._SyncObj__getCurrentLogIndex()
        entries: list[Entry] = []
        if next_index is not None and log[0][1] < next_index <= last:
            entries = self._SyncObj__getEntries(next_index, None, batch)
        if (
            next_index is None
            or next_index <= log[0][1]
            or (len(entries) == 1 and len(entries[0][0]) >= batch)
        ):
            self._SyncObj__newAppendEntriesTime = 0.0
            self.tick_soon()
            return
        prev_index, prev_term = self._SyncObj__getPrevLogIndexTerm(next_index)
        if entries:
            self._SyncObj__raftNextIndex[node] = entries[-1][1] + 1
        self._SyncObj__transport.send(
            node,
            {
                "type": "append_entries",
                "term": self.raftCurrentTerm,
                "commit_index": self.raftCommitIndex,
                "entries": entries,
                "prevLogIdx": prev_index,
                "prevLogTerm": prev_term,
            },
        )

    # ------------------------------------------------------------- membership

    def make_node(self, name: str, address: str) -> Any:
        """A PySyncObj node for member `name` at `address` (subclasses: of their transport)."""
        raise NotImplementedError

    def run_on_tick_thread(self, call: Callable[[], None]) -> None:
        """Run `call` where PySyncObj's state may be touched (a real member: on its tick
        thread, soon; a simulated one: now)."""
        raise NotImplementedError

    def members(self) -> dict[str, str]:
        """The current Raft configuration as seen here: node name -> Raft address."""
        nodes = [self.selfNode, *self.otherNodes]
        return {node_name(n): str(n.id) for n in nodes}

    def add_member(self, name: str, address: str, callback: Callable[[Any, int], None]) -> None:
        """Propose adding a replica (one change at a time: the leader refuses a second
        while one is uncommitted, `_SyncObj__changeCluster`). `callback(None,
        FAIL_REASON)` on commit or refusal."""
        self.addNodeToCluster(self.make_node(name, address), callback)

    def remove_member(self, address: str, callback: Callable[[Any, int], None]) -> None:
        """Propose removing the replica at `address` (a node cannot remove itself)."""
        node = next((n for n in self.otherNodes if str(n.id) == address), None)
        if node is None:
            callback(None, FAIL_REASON.REQUEST_DENIED)  # not a member (any more)
            return
        self.removeNodeFromCluster(node, callback)

    def connected(self) -> dict[str, bool]:
        """Per peer name: whether this node has a live Raft connection to it."""
        return {node_name(n): bool(self.isNodeConnected(n)) for n in self.otherNodes}

    def ask_leader_to_step_down(self) -> None:
        """Ask the leader (this node or another) to hand leadership to its most caught-up
        follower now (Raft's TimeoutNow). Best effort: watch the leader to see it happen."""

        def ask() -> None:
            leader = self._getLeader()
            if leader is None:
                return
            if self._isLeader():
                self.transferLeadership(None, None)
            else:
                self._SyncObj__transport.send(leader, {"type": STEP_DOWN})

        self.run_on_tick_thread(ask)

    def _SyncObj__changeCluster(self, request: Any) -> bool:
        """As leader, append a configuration change only if no earlier one is still
        uncommitted (Raft's single-server changes), and add a node only once it has
        caught up as a learner (`_caught_up_to_join`). PySyncObj 0.3.17 reads its
        `__changeClusterIDx` but never sets it, so two concurrent `members add` gave
        {A..E} from {A,B,C}, whose quorum {A,D,E} does not overlap the old quorum {B,C}:
        two leaders could commit at the same index. Refused, the request is answered
        REQUEST_DENIED and may be tried again (the node core does, until its deadline)."""
        if self.uncommitted_membership_change():
            logger.info("refusing a membership change: an earlier one is not committed yet")
            return False
        if not self._caught_up_to_join(request):
            return False
        accepted = bool(super()._SyncObj__changeCluster(request))
        if accepted and request[0] == "add":
            self._promote_learner(request[2])
        return accepted

    @property
    def learners(self) -> dict[Any, _Learner]:
        """Leader only: nodes being caught up before they are added, by node."""
        learners: dict[Any, _Learner] | None = self.__dict__.get("_learners")
        if learners is None:
            learners = self.__dict__["_learners"] = {}
        return learners

    def _caught_up_to_join(self, request: Any) -> bool:
        """The learner stage (as RabbitMQ and etcd have it): the first `add` of a node
        makes it a learner, which this leader sends the log to (a snapshot first, if
        the log was compacted) without counting it in any majority. It catches up in
        rounds (Raft thesis 4.2.1): a round ends when the learner has the leader's last
        index of the round's start; the add is refused (the node core asks again every
        0.1 s) until a round has ended within the longest election timeout, so the new
        voter is as far behind as one round trip. Adding an empty node straight away
        made it a voter that the new majority needed before anything else could commit:
        with a member down, the cluster stopped until the new node had the whole log,
        or for good if it never came up. (A target moved to the commit index at each
        ask was never reached by a learner more than 0.1 s away: each ask commits a
        barrier first.)"""
        if not self.learner_stage or request[0] != "add" or len(request) < 3:
            return True
        node = request[2]
        if not isinstance(node, Node) or node == self._SyncObj__selfNode:
            return True
        if node in self._SyncObj__otherNodes:
            return True  # (PySyncObj refuses it: nothing to add)
        now = _syncobj.monotonicTime()
        learner = self.learners.get(node)
        if learner is None:
            if len(self.learners) >= MAX_LEARNERS:
                logger.info("refusing to add %s: %d nodes are catching up", node, MAX_LEARNERS)
                return False
            self.learners[node] = _Learner(now, self._SyncObj__getCurrentLogIndex())
            self._SyncObj__readonlyNodes.add(node)
            self._SyncObj__raftNextIndex[node] = self._SyncObj__getCurrentLogIndex() + 1
            self._SyncObj__raftMatchIndex[node] = 0
            self._SyncObj__transport.addNode(node)
            logger.info("catching %s up before adding it (a learner)", node)
            return False
        learner.asked_at = now
        matched: int = self._SyncObj__raftMatchIndex.get(node, 0)
        if node not in self._SyncObj__connectedNodes or matched < learner.target:
            return False
        round_s = now - learner.round_started
        if round_s <= self._SyncObj__conf.raftMaxTimeout:
            logger.info("%s caught up (through %d): adding it", node, matched)
            return True
        learner.round_started, learner.target = now, self._SyncObj__getCurrentLogIndex()
        return False

    def learner_progress(self) -> dict[str, int]:
        """Leader only: per node being caught up, the last index it has (status)."""
        matched = self._SyncObj__raftMatchIndex
        return {node_name(n): int(matched.get(n, 0)) for n in list(self.learners)}

    def _promote_learner(self, node: Any) -> None:
        """The add of a learner is appended: it is a voter now (kept connected)."""
        if self.learners.pop(node, None) is not None:
            self._SyncObj__readonlyNodes.discard(node)
            self.learners_joined += 1

    def _drop_learners(self) -> None:
        """Forget learners nobody asked to add for `LEARNER_IDLE_S`, and every learner
        once this node no longer leads (the next leader starts its own when asked)."""
        learners = self.learners
        if not learners:
            return
        idle_since = _syncobj.monotonicTime() - LEARNER_IDLE_S
        leads = self._isLeader()
        for node, learner in list(learners.items()):
            if leads and learner.asked_at > idle_since:
                continue
            del learners[node]
            self._SyncObj__readonlyNodes.discard(node)
            self._SyncObj__serializer.cancelTransmisstion(node)  # (sic: PySyncObj's name)
            if node not in self._SyncObj__otherNodes:
                self.__dict__.get("_reached_leaders", {}).pop(str(node.id), None)
                self._SyncObj__raftNextIndex.pop(node, None)
                self._SyncObj__raftMatchIndex.pop(node, None)
                self._answered_at.pop(node, None)
                self._SyncObj__transport.dropNode(node)
            logger.info("no longer catching %s up", node)

    @property
    def removed_members(self) -> set[str]:
        """Names of the members removed from the configuration (and not added back),
        as this log says, kept in snapshots: whichever node leads marks them down."""
        removed: set[str] | None = self.__dict__.get("_removed_members")
        if removed is None:
            removed = self.__dict__["_removed_members"] = set()
        return removed

    def _SyncObj__doChangeCluster(self, request: Any, reverse: bool = False) -> bool:
        # a removal names the node by its address: its name is known while it is a member
        names = {str(n.id): node_name(n) for n in self.otherNodes}
        changed = bool(super()._SyncObj__doChangeCluster(request, reverse))
        if changed:
            node = request[2] if len(request) >= 3 else request[1]
            address = str(getattr(node, "id", node))
            name = names.get(address) or str(getattr(node, "name", address))
            if (request[0] == "add") != reverse:
                self.removed_members.discard(name)
            else:
                self.removed_members.add(name)
        return changed

    def configuration_at(self, index: int, cluster: Iterable[Any]) -> set[Any]:
        """The configuration as of log index `index`: `cluster` (this node's now) with
        every configuration entry after `index` undone, newest first. A snapshot of the
        log up to `index` stores this one: changes take effect when appended, so the
        node's configuration may hold changes after it, and one a new leader then cut
        came back from the snapshot at the next start-up (second review, 1)."""
        nodes = {str(n.id): n for n in cluster}
        log = self._SyncObj__raftLog
        for pos in range(len(log) - 1, -1, -1):
            command, idx, _ = log[pos]
            if idx <= index:
                break
            if command[:1] != _MEMBERSHIP_PREFIX:
                continue
            change = self._SyncObj__parseChangeClusterRequest(command)
            if change is None or change[0] not in ("add", "rem"):
                continue
            node = change[2] if len(change) >= 3 else change[1]
            if not isinstance(node, Node):
                node = self._SyncObj__nodeClass(node)
            if change[0] == "add":
                nodes.pop(str(node.id), None)
            else:
                nodes[str(node.id)] = node
        return set(nodes.values())

    def uncommitted_membership_change(self) -> bool:
        """Whether this log holds a configuration entry after the commit index."""
        log = self._SyncObj__raftLog
        commit = self._SyncObj__raftCommitIndex
        for pos in range(len(log) - 1, -1, -1):
            command, idx, _ = log[pos]
            if idx <= commit:
                return False
            if command[:1] == _MEMBERSHIP_PREFIX:
                return True
        return False

    def stored_snapshot(self) -> tuple[Entry, Entry] | None:
        """The last and the previous entry of the snapshot this node has stored, or None
        (subclasses read their snapshot store; `SnapshotDamagedError` if it is damaged)."""
        return None

    def check_stored_state(self) -> None:
        """Before the first tick: this node's snapshot and journal belong together.

        A journal compacted past its first entries with no snapshot to hold them would
        make the node apply the rest to an empty machine: refused. A crash after the
        snapshot was written and before the journal was compacted behind it (or after a
        leader's snapshot was stored and before the journal was replaced) leaves a
        journal that does not start at the snapshot: if it holds the snapshot's last
        entry, the compaction is finished here, keeping every entry after it. (PySyncObj
        cleared such a journal at start-up, taking entries this node had acknowledged,
        and committed ones, with it.)"""
        log = self._SyncObj__raftLog
        stored = self.stored_snapshot()
        if stored is None:
            if len(log) and log[0][1] > 1:
                raise JournalDamagedError(
                    f"the journal starts at entry {log[0][1]} (compacted), but there is no "
                    "snapshot holding the entries before it: the node would apply the rest "
                    "to an empty state. Restore the snapshot file, or remove the node from "
                    "the cluster, move its data directory away and add it again empty, at "
                    "a new Raft address (a member that missed its removal must not count "
                    "the empty node's vote)"
                )
            self._take_configuration_from_log(after=0)
            return
        last, prev = stored
        if len(log) >= 2 and tuple(log[0]) == prev and tuple(log[1]) == last:
            return
        pos = last[1] - log[0][1] if len(log) else -1
        if 1 <= pos < len(log) and tuple(log[pos]) == last and tuple(log[pos - 1]) == prev:
            logger.info(
                "finishing a compaction a crash interrupted: the journal now starts at %d",
                prev[1],
            )
            log.deleteEntriesTo(pos - 1)

    _snapshot_load_error: BaseException | None = None
    """Why the last snapshot load failed (PySyncObj only logs it, and goes on empty)."""
    _installed_through: int | None = None
    """The last index of a leader's snapshot installed while handling one message."""

    def _take_configuration_from_log(self, after: int) -> None:
        """At start-up: the configuration is the one the log ends with, committed or not
        (Raft's rule): the first configuration (`--peer`, or the snapshot's, which holds
        the log up to `after`), changed by every configuration entry after it.

        PySyncObj started from the first configuration and changed it only as entries
        were committed, so a node that had appended `remove A` and `add D` and restarted
        before it learned they were committed counted votes in {A, B, C}: with A, cut off
        in the old configuration, it was elected while the leader of {B, C, D} committed
        with C and D, and the two overwrote each other's entries (simulator, seed 169).
        The entries change the configuration here once (`_SyncObj__doApplyCommand`
        leaves them alone when they are committed)."""
        log = self._SyncObj__raftLog
        for pos in range(len(log)):
            command, index, _ = log[pos]
            if index > after and command[:1] == _MEMBERSHIP_PREFIX:
                change = self._SyncObj__parseChangeClusterRequest(command)
                if change is not None:
                    self._SyncObj__doChangeCluster(change)

    def _SyncObj__loadDumpFile(self, clearJournal: bool) -> None:
        kept, self._kept_after_snapshot = self._kept_after_snapshot, []
        self._snapshot_load_error = None
        super()._SyncObj__loadDumpFile(clearJournal)
        if self._snapshot_load_error is not None:
            # PySyncObj logged it and went on with an empty machine, voting and leading
            error = self._snapshot_load_error
            raise JournalDamagedError(f"the snapshot could not be loaded: {error}")
        if not clearJournal:  # this node's own snapshot, at start-up
            self._take_configuration_from_log(after=self._SyncObj__raftLastApplied)
        if clearJournal:
            self._installed_through = self._SyncObj__raftLastApplied
            # The answer acknowledges the snapshot's last entry only, as Raft's does: the
            # kept entries after it may conflict with the leader's log (an old leader's
            # uncommitted tail), and the leader must not count them as replicated. It
            # sends from there on, and a conflict cuts them as any AppendEntries would.
            self._answer_after_install = self._SyncObj__raftLastApplied + 1
        log = self._SyncObj__raftLog
        if not kept or not len(log) or log[-1][1] != kept[0][1] - 1:
            return
        for entry in kept:
            log.add(*entry)
            change = self._SyncObj__parseChangeClusterRequest(entry[0])
            if change is not None:  # the snapshot's configuration is older than these
                self._SyncObj__doChangeCluster(change)

    # --------------------------------------------------------------- applying

    def _SyncObj__doApplyCommand(self, command: bytes) -> Any:
        if pathtiming.ENABLED:
            self._mark_commit()  # a leader's commit index moved in this tick, just before
        if command[:1] == _MEMBERSHIP_PREFIX:
            # the configuration changed when the entry was appended (or at start-up,
            # `_take_configuration_from_log`); changing it again as the entry is
            # committed undid later changes (add D, remove D, add D: D removed until
            # the last add was committed too)
            return None
        if command[:1] == _RAW_PREFIX:
            index = self.raftLastApplied + 1
            try:
                return self.apply_raw(index, command[1:])
            except UnreadableEntryError:
                raise  # the node must stop (its tick loop stops it), not skip the entry
            except Exception:  # an exception here would re-apply the entry forever
                logger.exception("applying log entry %d failed", index)
                return None
        return super()._SyncObj__doApplyCommand(command)

    # ----------------------------------------------------------------- status

    def leader_address(self) -> str | None:
        leader = self._getLeader()
        return None if leader is None else str(leader.id)

    def is_leader(self) -> bool:
        return bool(self._isLeader())

    def role(self) -> str:
        """ "follower", "candidate" or "leader" (PySyncObj's Raft state; metrics)."""
        return ("follower", "candidate", "leader")[self._SyncObj__raftState]

    @property
    def _answered_at(self) -> dict[Any, float]:
        """Per peer: when its last answer to an AppendEntries arrived (monotonic
        seconds). PySyncObj's `lastResponseTime` also holds when this node became leader,
        which is no answer."""
        answered: dict[Any, float] | None = self.__dict__.get("_answered_at_map")
        if answered is None:
            answered = self.__dict__["_answered_at_map"] = {}
        return answered

    def peer_silence(self) -> dict[str, float]:
        """Leader only: seconds each peer has been silent, for judging it down: since its
        last answer, or since this node became leader or last woke from a stall
        (`_look`), whichever is latest. A leader paused past the node-down grace (a GC, a
        starved CPU, a SIGSTOP, in the middle of a tick too) judged every peer down from
        answers it had not read yet; now a peer must stay silent a whole grace after the
        judge wakes."""
        self._look()
        now = _syncobj.monotonicTime()
        answered = self._answered_at
        since = max(self._leader_since, self.awake_since if self.stall_aware_silence else 0.0)
        return {str(n.id): now - max(answered.get(n, 0.0), since) for n in self.otherNodes}

    def peer_answered_ago(self) -> dict[str, float]:
        """Leader only: seconds since each peer last answered an AppendEntries (infinity:
        never, to this node), for judging a down node up again: only a real answer
        counts (a leader back from a stall, or newly elected, marked long-dead nodes up:
        PySyncObj counts its election as an answer from every peer)."""
        now = _syncobj.monotonicTime()
        answered = self._answered_at
        return {str(n.id): now - answered.get(n, -math.inf) for n in self.otherNodes}


# ------------------------------------------------------------------ snapshots


SNAPSHOT_VERSION = 3
"""1: members as Raft addresses; 2: members as [Raft address, node name] pairs; 3: and
the names of removed members."""
_SNAPSHOT_MAGIC = b"QQS1"
"""A snapshot file: this, a CRC-32 of the rest, then the encoded snapshot. (Before it a
bit flipped in a message body loaded cleanly, and the replica served and passed on
wrong data; one that broke the encoding was ignored, and the node ran empty.)"""


def entries_after(log: Any, index: int, term: int) -> list[Entry]:
    """The entries after (`index`, `term`) if `log` holds that entry, else none: what a
    follower keeps when it installs a snapshot that ends there (Raft's rule)."""
    if not len(log):
        return []
    pos = index - log[0][1]
    if pos < 0 or pos >= len(log) or log[pos][1] != index or log[pos][2] != term:
        return []
    return [(e[0], e[1], e[2]) for e in log[pos + 1 :]]


class StoredSnapshot(NamedTuple):
    last: Entry
    prev: Entry
    members: list[tuple[str, str]]
    """(Raft address, node name) of each member."""
    machine: bytes
    removed: list[str]
    """Names of the members removed from the cluster (`RaftRules.removed_members`)."""


def encode_snapshot(
    last: Entry,
    prev: Entry,
    members: list[tuple[str, str]],
    machine: bytes,
    removed: Iterable[str] = (),
) -> bytes:
    """A snapshot file's bytes: the last two applied entries, the members (Raft address
    and node name), the machine, the names of removed members."""
    payload = encoding.encode(
        [
            "quorumq-snapshot",
            SNAPSHOT_VERSION,
            [last[0], last[1], last[2]],
            [prev[0], prev[1], prev[2]],
            sorted([address, name] for address, name in members),
            machine,
            sorted(removed),
        ]
    )
    return _SNAPSHOT_MAGIC + zlib.crc32(payload).to_bytes(4, "little") + payload


def decode_snapshot(data: bytes, source: str) -> StoredSnapshot:
    """What `encode_snapshot` wrote, read from `source`; a version 1 snapshot's members
    are named by their addresses. `ValueError` for a damaged one."""
    if data[:4] == _SNAPSHOT_MAGIC:
        payload = data[8:]
        if zlib.crc32(payload) != int.from_bytes(data[4:8], "little"):
            raise ValueError(f"{source} fails its checksum: it is damaged")
        data = payload
    value = encoding.decode(data)
    if not (isinstance(value, list) and len(value) in (6, 7) and value[0] == "quorumq-snapshot"):
        raise ValueError(f"{source} is not a quorumq snapshot")
    _, version, last, prev, cluster, machine, *rest = value
    if version == 1:
        members = [(address, address) for address in cluster]
    elif version in (2, SNAPSHOT_VERSION):
        members = [(address, name) for address, name in cluster]
    else:
        raise ValueError(f"unsupported snapshot version {version}")
    return StoredSnapshot(
        (last[0], last[1], last[2]),
        (prev[0], prev[1], prev[2]),
        members,
        machine,
        list(rest[0]) if rest else [],
    )
