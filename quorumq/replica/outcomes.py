"""What a proposal can come to besides its reply (`ProposalError`: not applied, outcome
unknown; an audit busy or failed), and the proposals waiting for an outcome, each
answered once, by PySyncObj or by a timeout (`InFlight`)."""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from pysyncobj import FAIL_REASON

from ..machine import (
    Reply,
)
from ..raft.member import NOT_APPLIED

logger = logging.getLogger(__name__)

E = TypeVar("E")


class ProposalError(Exception):
    """A command did not get a reply."""


class NotAppliedError(ProposalError):
    """The command is known not to be in the log: retrying cannot duplicate it."""


class OutcomeUnknownError(ProposalError):
    """The command may or may not have been applied: retry only if it is idempotent
    (enqueues carry a producer id and sequence number for exactly this)."""


class AuditBusyError(Exception):
    """An audit is already running on this node: one at a time."""


class AuditFailedError(Exception):
    """The audit's child process did not deliver the state's encoding."""


class _Once(Generic[E]):
    """A proposal's callback, called at most once: by PySyncObj or by the timeout."""

    __slots__ = ("callback", "deadline")

    def __init__(self, callback: Callable[[Reply | None, E | None], None], deadline: float) -> None:
        self.callback: Callable[[Reply | None, E | None], None] | None = callback
        self.deadline = deadline

    def __call__(self, reply: Reply | None, error: E | None) -> None:
        callback, self.callback = self.callback, None
        if callback is not None:
            callback(reply, error)


class InFlight(Generic[E]):
    """Proposals waiting for an outcome, in submission order. Each is answered once: by
    PySyncObj, or with an "outcome unknown" error once `timeout_s` has passed without
    one (PySyncObj never answers some, e.g. when a snapshot install skips past their
    index). Shared with the simulator's model of a node, which has its own clock and
    error type."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._queue: collections.deque[_Once[E]] = collections.deque()

    def track(
        self, callback: Callable[[Reply | None, E | None], None], now: float
    ) -> Callable[[Reply | None, E | None], None]:
        """`callback`, to be called at most once, from now on watched for its deadline."""
        once: _Once[E] = _Once(callback, now + self.timeout_s)
        self._queue.append(once)
        return once

    def expire(self, now: float, error: Callable[[], E]) -> None:
        """Answer `error()` to the proposals past their deadline (forget the answered)."""
        queue = self._queue
        while queue and (queue[0].callback is None or queue[0].deadline < now):
            queue.popleft()(None, error())


def _membership_done(
    callback: Callable[[ProposalError | None], None],
) -> Callable[[Any, int], None]:
    def done(_result: Any, reason: int) -> None:
        if reason == FAIL_REASON.SUCCESS:
            callback(None)
        elif reason == FAIL_REASON.REQUEST_DENIED:
            callback(
                NotAppliedError(
                    "refused by the leader: another membership change is not yet committed, "
                    "the node is already a member, or the leader was asked to remove itself"
                )
            )
        elif reason in NOT_APPLIED:
            callback(NotAppliedError(NOT_APPLIED[reason]))
        else:
            callback(OutcomeUnknownError(f"the leader changed before a reply ({reason})"))

    return done
