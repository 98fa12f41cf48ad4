"""What quorumq's Raft rules share (`rules`, `proposing`, `receiving`,
`elections`, `membership`):
the message keys and bounds, helper types (`LeaderClock`, the stamping queue, learners,
pre-vote rounds) and the snapshot encoding. PySyncObj 0.3.17 only."""

from __future__ import annotations

import collections
import logging
import queue as _queue
import threading
import time
import zlib
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from pysyncobj import FAIL_REASON, SyncObj
from pysyncobj.version import VERSION as _PYSYNCOBJ_VERSION

from ..machine import encoding
from .journal import RaftJournal

logger = logging.getLogger(__name__)

if _PYSYNCOBJ_VERSION != "0.3.17":
    raise ImportError(
        f"quorumq's Raft hardening is written against pysyncobj 0.3.17, not {_PYSYNCOBJ_VERSION}"
    )

RAW_COMMAND = 4
"""Our command type in PySyncObj's log (PySyncObj uses 0-3)."""
RAW_PREFIX = bytes([RAW_COMMAND])
MEMBERSHIP_PREFIX = bytes([2])
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
    over that lag, and messages enqueued meanwhile would expire early. A quiet leader
    stamps no entries but tells its time in its heartbeats (`heard`): the last one,
    if it came after that entry, is credited the same way.

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
        self._heard: tuple[int, float, int] | None = None
        """The time the last quiet heartbeat told (its leader's clock), when it arrived,
        and the leader's term."""
        self._last = 0
        self._lock = threading.Lock()

    @property
    def term(self) -> int | None:
        anchor = self._anchor
        return anchor[0] if anchor else None

    def seen(self, ts_ms: int) -> None:
        """An entry stamped `ts_ms` arrived now (or was stamped here now). A stamp seen
        again keeps its latest arrival: a restarted leader, behind, may stamp exactly the
        time it took over, and crediting that time's first arrival jumped over its lag
        (less credit is always safe)."""
        if ts_ms > 0:
            arrivals = self._arrivals
            arrivals[ts_ms] = self.monotonic()
            arrivals.move_to_end(ts_ms)
            if len(arrivals) > ARRIVALS_KEPT:
                arrivals.popitem(last=False)

    def heard(self, ts_ms: int, term: int) -> None:
        """A quiet heartbeat arrived now from the leader of `term`, whose clock read
        `ts_ms` when it sent it (an idle cluster stamps no entries: without it, a new
        leader elected after a quiet spell started from the last entry's time, and a
        node restarted during the spell, which saw no entry arrive, stamped messages
        that far behind)."""
        if ts_ms > 0:
            self._heard = (ts_ms, self.monotonic(), term)

    def following(self, term: int) -> None:
        """This node heard from the leader of `term` (entries, a snapshot, anything):
        what an earlier term's leader told is no longer its time. (Kept, it was credited
        over a snapshot from a leader whose clock ran an hour behind: hostile review.)"""
        heard = self._heard
        if heard is not None and heard[2] < term:
            self._heard = None

    def take_over(self, term: int, replicated_ms: int) -> None:
        """This node leads `term`; the replicated time so far is `replicated_ms` (0: none).

        The anchor is the replicated time (plus the credit for what was seen), never
        this node's own earlier anchor: that may have come from its wall clock (a new
        cluster) without any entry stamped then, and keeping it moved the whole
        cluster's time to this node's wrong clock when it led again."""
        base = replicated_ms
        arrived = self._arrivals.get(replicated_ms)
        heard = self._heard
        if heard is not None and replicated_ms > 0 and (arrived is None or heard[1] > arrived):
            # the last quiet heartbeat came after that entry: its leader's time then, told
            # no later than it arrived, credited as an entry's (and never below the log's)
            base = max(base, heard[0] + int((self.monotonic() - heard[1]) * 1000))
        elif arrived is not None:
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


class StampingQueue:
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


class Learner:
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
"""A node's Raft thread looked at the clock this much later than it planned to (beyond
a busy tick's wait): it stalled (a pause, a GC, a starved CPU), and it judges no peer's
silence across the stall."""
TICK_S = 0.05
"""A busy member's tick period: its thread looks at the clock at least this often."""

QUIET_HEARTBEAT_S = 0.5
"""A quiet leader's heartbeat period (`quiescence`), and the time a follower that
read a quiet heartbeat adds to its election deadline and to its lease. Check-quorum
spans three (`leader_fallback_s`)."""
QUIET_TICK_S = 1.0
"""A quiet member's tick thread waits at most this long for a message or a deadline
(its connection retries, its journal's timer: nothing else needs it)."""
QUIET_KEEPALIVE_S = 1.0
"""A quiet follower's keepalive period to its other peers (PySyncObj closes a
connection it has read nothing from for 2 s, `connectionTimeout`: a second of room
for a stall, or the first vote request after a leader's loss closes it)."""


def leader_fallback_s(raft_timeouts: tuple[float, float]) -> float:
    """Check-quorum (`leaderFallbackTimeout`): a leader that heard from no majority for
    this long steps down. Twice the longest election timeout, and at least three quiet
    heartbeat periods (a quiet leader hears its followers' answers that often)."""
    return max(2 * raft_timeouts[1], 3 * QUIET_HEARTBEAT_S)


MAX_QUIET_S = 2.0
"""A heartbeat's quiet period above this is not believed (a follower would wait that
much longer before it stands)."""
QUIET = "quorumq_quiet"
"""In a quiet leader's heartbeat: its heartbeat period from now on, in seconds."""
QUIET_TIME = "quorumq_quiet_time"
"""In a quiet heartbeat: the leader's clock when it sent it (ms), which a follower
credits if it takes over (`LeaderClock.heard`)."""
CLUSTER = "quorumq_cluster"
"""In every Raft message of a node that keeps a cluster identity: the identity it
knows, or "" (`cluster_identity`)."""
PREV_CRC = "quorumq_prev_crc"
"""In an AppendEntries: the CRC-32 of the leader's entry at `prevLogIdx`, which a
follower holding an entry of that index and term compares with its own
(`cluster_identity`: two histories attach nowhere silently)."""
IDENTITY_ENTRY = "quorumq_identity_entry"
"""In every Raft message whose sender's log holds the cluster's identity entry: [its
index, its term, the identity] (`cluster_identity`)."""
QUIESCES = "quorumq_quiesces"
"""In a hello: the sender reads quiet heartbeats (a leader quiets only when all do)."""

FOLLOWER, CANDIDATE, LEADER = 0, 1, 2
"""PySyncObj's `_RAFT_STATE`."""


class PreVoteRound:
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


class RaftFields(SyncObj):  # type: ignore[misc]
    """The fields `RaftRules` and its parts (`Proposing`, `Elections`, `MembershipRules`)
    share: their defaults, the switches the negative controls turn, and PySyncObj's own
    fields the rules set, typed once."""

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
    journal: RaftJournal
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
    quiescence = True
    """An idle group heartbeats every `QUIET_HEARTBEAT_S` and ticks only when something
    is due (`Quiescence`)."""
    leader_quiet_s = 0.0
    """As follower: the quiet period of the leader's last AppendEntries (0: busy)."""
    _quiet_sent = False
    """As leader: the last heartbeat round was a quiet one."""
    planned_wait_s = 0.0
    """How long the tick thread planned to wait after its last tick (`tick_wait_s`; the
    simulator sets what it scheduled)."""

    _SyncObj__raftLeader: Any
    _SyncObj__raftElectionDeadline: float
    """(PySyncObj's fields, typed for the rules that set them.)"""
    _pre_vote_round: PreVoteRound | None = None
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

    _member_at_snapshot = 0
    """The last index of the last snapshot read, if its configuration has this node."""
    _snapshot_load_error: BaseException | None = None
    """Why the last snapshot load failed (PySyncObj only logs it, and goes on empty)."""
    _installed_through: int | None = None
    """The last index of a leader's snapshot installed while handling one message."""
