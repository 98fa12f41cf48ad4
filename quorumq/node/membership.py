"""Membership changes (administrative): `members add` and `members remove`, each
decided against the cluster's committed configuration, waiting for a leader and for an
earlier change (`MEMBERSHIP_DEADLINE_S`); a removal of the leader first asks it to hand
leadership over."""

from __future__ import annotations

import logging
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
from .services import RETRY_EVERY_S, Services

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

    def _groups_refused(self, conn: ConnectionCore, frame: Frame) -> bool:
        """A membership change of a node with many Raft groups must reach every group
        (or the groups end with different members): not built yet, so refused whole."""
        if len(self.core.groups) == 1:
            return False
        self.core.error(
            conn,
            frame["id"],
            "not_supported",
            f"this node hosts {len(self.core.groups)} Raft groups: adding and removing "
            "members of a node with groups is not built yet (docs/internals/groups.md)",
        )
        return True

    def add_member(self, conn: ConnectionCore, frame: Frame) -> None:
        if self.admin.admin_refused(conn, frame) or self._groups_refused(conn, frame):
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

        _MembershipChange(
            self.core,
            conn,
            request_id,
            lambda done: self.core.replica.add_member(name, address, done),
            made=lambda members: members.get(name) == address,
            refused=refused,
            timeout_hint=(
                f": the leader adds {name} once it has caught up with the log; is it "
                f"running at {address}, with every member as --peer and the cluster "
                "secret? Ask again: its catching up goes on"
            ),
        ).start()

    def remove_member(self, conn: ConnectionCore, frame: Frame) -> None:
        """Remove a replica (asking it to hand leadership over first if it leads), and
        answer once the change is committed. The node itself keeps running, cut off."""
        if self.admin.admin_refused(conn, frame) or self._groups_refused(conn, frame):
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

        def refused(members: dict[str, str]) -> MembershipError | None:
            if name not in members:
                return MembershipError("unknown_member", f"{name} is not a member")
            return None

        change = _MembershipChange(
            self.core,
            conn,
            request_id,
            lambda done: self.core.replica.remove_member(name, done),
            made=lambda members: name not in members,
            refused=refused,
        )
        change.step_down_first = name
        change.start()


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
        conn: ConnectionCore,
        request_id: int,
        start: Callable[[Callable[[ProposalError | None], None]], None],
        *,
        made: Callable[[dict[str, str]], bool],
        refused: Callable[[dict[str, str]], MembershipError | None],
        timeout_hint: str = "",
    ) -> None:
        self.core = core
        self._timeout_hint = timeout_hint
        self.conn = conn
        self.request_id = request_id
        self._start = start
        self._made = made
        self._refused = refused
        self.attempts = 0
        self.deadline = core.clock() + MEMBERSHIP_DEADLINE_S
        self.step_down_first: str | None = None

    def start(self) -> None:
        self._attempt()

    def _later(self) -> None:
        if self.core.clock() + RETRY_EVERY_S < self.deadline:
            self.core.call_later(RETRY_EVERY_S, self._attempt)
        else:
            self._timed_out()

    def _attempt(self) -> None:
        replica = self.core.replica
        leader = self.step_down_first is not None and (
            replica.status()["leader"] == self.step_down_first
        )
        if leader:
            replica.ask_leader_to_step_down()
            self._later()
            return
        replica.propose(Tick(), self._barrier_passed)

    def _barrier_passed(self, _reply: Reply | None, error: ProposalError | None) -> None:
        replica = self.core.replica
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
        members = self.core.replica.members()
        self.core.push(self.conn, {"t": "reply", "id": self.request_id, "members": members})

    def _fail(self, error: MembershipError) -> None:
        self.core.error(self.conn, self.request_id, error.code, error.message)
