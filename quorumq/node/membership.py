"""Membership changes (administrative): `members add` and `members remove`, each
decided against the cluster's committed configuration, waiting for a leader and for an
earlier change (`MEMBERSHIP_DEADLINE_S`); a removal of the leader first asks it to hand
leadership over. On a node with many Raft groups a change is made in every group, one
after the other from group 0, and answered once every group has it; a change that
failed part way names the groups that have it, and the same request sent again
finishes it (a group that has the change answers at once)."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

from ..machine import (
    Reply,
    Tick,
)
from ..replica import (
    OutcomeUnknownError,
    ProposalError,
    is_loopback,
)
from ..wire.protocol import Frame
from .admin import Admin
from .connection import ConnectionCore
from .services import RETRY_EVERY_S, ReplicaHandle, Services

logger = logging.getLogger(__name__)

MEMBERSHIP_DEADLINE_S = 20.0
"""How long a membership change may wait for a leader and for an earlier change."""


class MembershipError(Exception):
    """A membership change the node refuses or could not complete; `code` says why."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class Membership:
    """Adding and removing members (see the module's docstring)."""

    def __init__(self, core: Services, admin: Admin) -> None:
        self.core = core
        self.admin = admin
        self.under_way: Counter[Change] = Counter()
        """With groups: the changes this node is making now, (node, its address, None
        for a removal), each with how many requests for it (one sent again while the
        first goes on)."""

    def add_member(self, conn: ConnectionCore, frame: Frame) -> None:
        if self.admin.admin_refused(conn, frame):
            return
        request_id, name, address = frame["id"], frame["node"], frame["raft_address"]
        if not (self.core.config.replica.secret or is_loopback(address)):
            self.core.error(
                conn,
                request_id,
                "invalid",
                f"{address} is not loopback: a cluster without a secret stays local",
            )
            return

        def refused(members: dict[str, str]) -> MembershipError | None:
            if name in members and members[name] != address:
                return MembershipError("member_exists", f"{name} is a member at {members[name]}")
            for other, other_address in members.items():
                if other_address == address and other != name:
                    return MembershipError("member_exists", f"{address} is {other}'s Raft address")
            return None

        hint = (
            f": the leader adds {name} once it has caught up with the log; is it "
            f"running at {address}, with every member as --peer and the cluster "
            "secret? Ask again: its catching up goes on"
        )
        _InEveryGroup(
            self,
            conn,
            request_id,
            (name, address),
            lambda replica, done, deadline: _MembershipChange(
                self.core,
                replica,
                lambda proposed: replica.add_member(name, address, proposed),
                made=lambda members: members.get(name) == address,
                refused=refused,
                done=done,
                deadline=deadline,
                timeout_hint=hint,
            ),
        ).start()

    def remove_member(self, conn: ConnectionCore, frame: Frame) -> None:
        """Remove a replica (asking it to hand leadership over first if it leads), and
        answer once the change is committed. The node itself keeps running, cut off."""
        if self.admin.admin_refused(conn, frame):
            return
        request_id, name = frame["id"], frame["node"]
        if name == self.core.node_id:
            self.core.error(
                conn,
                request_id,
                "target_is_self",
                f"{name} cannot remove itself: send the request to another member",
            )
            return

        member_of = [False]

        def refused(members: dict[str, str]) -> MembershipError | None:
            # Each group decides at its own barrier, its configuration settled: one it
            # left already has the change (a removal that failed part way, sent again,
            # finishes in the others); a member of no group is refused at the end. (It
            # was refused at the first group without the member, or looked at the
            # others' members unsettled: simulator, seeds 23 and 10 of `--groups`: the
            # operator took the refusal for done and stopped a member of the others.)
            member_of[0] |= name in members
            return None

        def not_a_member() -> MembershipError | None:
            if member_of[0]:
                return None
            return MembershipError("unknown_member", f"{name} is not a member")

        _InEveryGroup(
            self,
            conn,
            request_id,
            (name, None),
            lambda replica, done, deadline: _MembershipChange(
                self.core,
                replica,
                lambda proposed: replica.remove_member(name, proposed),
                made=lambda members: name not in members,
                refused=refused,
                done=done,
                deadline=deadline,
                step_down_first=name,
            ),
            check_at_end=not_a_member,
        ).start()


Done = Callable[[dict[str, str] | None, "MembershipError | None"], None]
"""What a change in one group calls once it ends: its members, or why it failed."""
Change = tuple[str, str | None]
"""A membership change: the node, and its Raft address (None: its removal)."""
SENT_AGAIN_FINISHES = ("timeout", "outcome_unknown")
"""Failures that the same request, sent again, may get past."""
ANSWER_GRACE_S = 5.0
"""Past the request's deadline, how long its answer may wait for a change a group
was asked to make (the proposal's own outcome) before the request is answered
`timeout` all the same (a lost outcome must not hold the node's changes for good)."""


class _InEveryGroup:
    """One membership change in each of the node's groups, one after the other from
    group 0 (a node of one group: in that one); answered with group 0's members once
    every group has it, or with the first failure, naming the groups that have it."""

    def __init__(
        self,
        membership: Membership,
        conn: ConnectionCore,
        request_id: int,
        what: Change,
        change: Callable[[ReplicaHandle, Done, float], _MembershipChange],
        check_at_end: Callable[[], MembershipError | None] = lambda: None,
    ) -> None:
        """`change(replica, done, deadline)`: the change in one group; every group's
        shares the request's deadline (`MEMBERSHIP_DEADLINE_S` from now: a client's
        request timeout is longer). `check_at_end`: once every group has the change, a
        refusal instead of the answer (a removal of a member of no group)."""
        self.core = core = membership.core
        self.under_way = membership.under_way
        self.what = what
        self.deadline = core.clock() + MEMBERSHIP_DEADLINE_S
        self._check_at_end = check_at_end
        self.conn = conn
        self.request_id = request_id
        self._change = change
        self._group = 0
        self._over = False

    def start(self) -> None:
        other = self._half_made()
        if other is not None:
            self.core.error(self.conn, self.request_id, "change_in_progress", other)
            return
        if len(self.core.groups) > 1:
            self.under_way[self.what] += 1
            self.core.call_later(MEMBERSHIP_DEADLINE_S + ANSWER_GRACE_S, self._no_answer_in_time)
        self._change(self.core.groups[0], self._group_done, self.deadline).start()

    def _no_answer_in_time(self) -> None:
        if not self._over:
            self._group_done(
                None,
                MembershipError(
                    "timeout",
                    f"the change got no outcome within {MEMBERSHIP_DEADLINE_S} s "
                    f"(+{ANSWER_GRACE_S} s)",
                ),
            )

    def _end(self) -> bool:
        """Mark the request answered (False if it was already: a late outcome)."""
        if self._over:
            return False
        self._over = True
        if len(self.core.groups) > 1:
            self.under_way[self.what] -= 1
            if not self.under_way[self.what]:
                del self.under_way[self.what]
        return True

    def _half_made(self) -> str | None:
        """Why this change must wait, with groups: another change this node is making,
        or another node's change that some of this node's groups have and others not,
        unless this change is one such (it may always be finished) or is made in every
        group already (or, a removal, in none). A node added meanwhile would be
        started without that node, which could then lead a group it is being added
        to, and never be heard (simulator, seed 87 of `--groups 8`); an add and a
        removal of one node made at once could each answer success and leave the
        groups apart (a review). Best effort: each group as this node applied it, so
        two changes started at once on two nodes both pass."""
        groups = self.core.groups
        if len(groups) == 1:
            return None
        node, address = self.what
        configurations = [g.members() for g in groups]
        if all(c.get(node) == address for c in configurations):
            return None  # (made in every group, or a removal of a node none has)
        busy = sorted(c for c in self.under_way if c != self.what)
        if busy:
            return f"this node is making the change of {busy[0][0]}: send this one once it is made"
        first = configurations[0]
        differing: dict[str, int] = {}  # node -> a group that differs from group 0 on it
        for group, members in enumerate(configurations[1:], start=1):
            for n in set(first) | set(members):
                if first.get(n) != members.get(n):
                    differing.setdefault(n, group)
        if not differing or node in differing:
            return None  # (a change half made may always be finished, whatever else is)
        other = min(differing)
        return (
            f"the change of {other} is made in some groups only (group 0 and group "
            f"{differing[other]} differ, as this node applied them): send it again to "
            "finish it, then this one"
        )

    def _group_done(self, members: dict[str, str] | None, error: MembershipError | None) -> None:
        core, groups = self.core, self.core.groups
        if self._over:
            return  # (answered already: `_no_answer_in_time`)
        if error is not None:
            if len(groups) > 1:
                made = f"groups 0 to {self._group - 1}" if self._group > 1 else "group 0"
                again = (
                    ": send the same request again to finish it"
                    if error.code in SENT_AGAIN_FINISHES
                    else ""
                )
                error = MembershipError(
                    error.code,
                    f"group {self._group} of {len(groups)}: {error.message}"
                    + (f" ({made} made the change{again})" if self._group else ""),
                )
            self._end()
            core.error(self.conn, self.request_id, error.code, error.message)
            return
        self._group += 1
        if self._group < len(groups):
            self._change(groups[self._group], self._group_done, self.deadline).start()
            return
        self._end()
        refusal = self._check_at_end()
        if refusal is not None:
            core.error(self.conn, self.request_id, refusal.code, refusal.message)
            return
        members = groups[0].members()  # (now: group 0's as every group has the change)
        core.push(self.conn, {"t": "reply", "id": self.request_id, "members": members})


class _MembershipChange:
    """One `members add` or `members remove`, decided against the cluster's committed
    configuration. Each attempt first passes a barrier through the log (a `Tick`,
    which only lets time act): once this node applies it, its configuration holds every
    change committed before the request. If a change is still uncommitted in its log
    (`membership_settled`), it waits and tries again. Then it answers if the change is
    made already (the same change sent through another node, or an earlier attempt
    refused to us and committed all the same), refuses it if it cannot be made
    (`refused`: a removal of a node that is no member, an add of a name or address in
    use), or proposes it; proposed again while the leader refuses it (an earlier change
    not yet committed), until the deadline. A removal of the leader first asks it to
    hand leadership over (again if it leads again).

    (It proposed at once, against whatever this node's log said: a retried removal of
    a node removed meanwhile looked its address up, failed with KeyError in the core's
    timer, and stopped the node serving the request; a node that lagged behind, paused
    and not yet aware, answered "unknown_member" for a node added since, and its
    operator stopped a member. Simulator, seeds 17 and 104.)"""

    def __init__(
        self,
        core: Services,
        replica: ReplicaHandle,
        start: Callable[[Callable[[ProposalError | None], None]], None],
        *,
        made: Callable[[dict[str, str]], bool],
        refused: Callable[[dict[str, str]], MembershipError | None],
        done: Done,
        deadline: float,
        timeout_hint: str = "",
        step_down_first: str | None = None,
    ) -> None:
        """`replica`: the group's; `done(members, error)` once the change is made
        (members: the group's) or failed; `deadline`: the whole request's (`clock`)."""
        self.core = core
        self.replica = replica
        self._timeout_hint = timeout_hint
        self._start = start
        self._made = made
        self._refused = refused
        self._finished = done
        self.attempts = 0
        self.deadline = deadline
        self.step_down_first = step_down_first

    def start(self) -> None:
        self._attempt()

    def _later(self) -> None:
        if self.core.clock() + RETRY_EVERY_S < self.deadline:
            self.core.call_later(RETRY_EVERY_S, self._attempt)
        else:
            self._timed_out()

    def _attempt(self) -> None:
        replica = self.replica
        leader = self.step_down_first is not None and (
            replica.status()["leader"] == self.step_down_first
        )
        if leader:
            replica.ask_leader_to_step_down()
            self._later()
            return
        replica.propose(Tick(), self._barrier_passed)

    def _barrier_passed(self, _reply: Reply | None, error: ProposalError | None) -> None:
        replica = self.replica
        if error is not None or not replica.membership_settled():
            self._later()
            return
        members = replica.members()
        if self.attempts and self._made(members):
            self._done()
            return
        refusal = self._refused(members)
        if refusal is not None:
            self._fail(refusal)
        elif self._made(members):
            self._done()
        else:
            self.attempts += 1
            self._start(self._outcome)

    def _outcome(self, error: ProposalError | None) -> None:
        core = self.core
        if error is None:
            self._done()
        elif isinstance(error, OutcomeUnknownError):
            self._fail(MembershipError("outcome_unknown", f"{error}: check the members"))
        elif core.clock() + RETRY_EVERY_S < self.deadline:
            logger.info("membership change not applied (%s); trying again", error)
            core.call_later(RETRY_EVERY_S, self._attempt)
        else:
            self._timed_out()

    def _timed_out(self) -> None:
        self._fail(
            MembershipError(
                "timeout",
                f"the change was not committed within {MEMBERSHIP_DEADLINE_S} s"
                + self._timeout_hint,
            )
        )

    def _done(self) -> None:
        self._finished(self.replica.members(), None)

    def _fail(self, error: MembershipError) -> None:
        self._finished(None, error)
