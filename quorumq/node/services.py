"""What every part of the node core shares: the replica and the shell it is driven by
(`ReplicaHandle`, `NodeShell`), the clock and its timers, the consumers and connections
it serves, and the ways to answer a client (`push`, `error`, `reply`) and to propose a
request's command (`propose_for`, whose outcome is answered by `answer`).

`NodeCore` is a `Services`, and hands itself to each of its parts (`Publishes`,
`Settling`, `Reading`, `Serving`, `Admin`, `Membership`, `DiskWatch`): a part holds its
own state and uses these, and the other parts it is given, never the core's switchboard.
"""

from __future__ import annotations

import heapq
import itertools
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, TypeVar

from ..machine import (
    MAX_PLACEMENTS,
    Command,
    Declare,
    Enqueued,
    Error,
    ErrorCode,
    Forgotten,
    Place,
    Placed,
    QueueDeleted,
    QueuePurged,
    Reply,
    Tick,
)
from ..replica import NotAppliedError, ProposalError
from ..wire.protocol import Frame
from .config import NodeConfig, check_node_config
from .connection import ConnectionCore

T = TypeVar("T")

ProposalCallback = Callable[[Reply | None, ProposalError | None], None]
Routed = Callable[["ReplicaHandle | None", ProposalError | None], None]
"""What `Services.route` calls: the replica of a queue's group, or None and why."""
MAX_UNPLACED_WAITING = 10_000
"""Most calls that wait for a barrier on group 0 to learn where their queue is."""
PROPOSAL_COST = 256
"""What a proposal counts for besides its messages' bodies."""
RETRY_EVERY_S = 0.1
"""How soon a request a leader change refused is tried again (a settle, a membership
change)."""


class ReplicaHandle(Protocol):
    """The node's replica as the core uses it. Callbacks run on the core's loop: the
    shell hands them over (the trio token on a real node)."""

    node_id: str

    def propose(self, command: Command, callback: ProposalCallback | None = None) -> None: ...

    def query(self, read: Callable[[Any], T]) -> T: ...

    def members(self) -> dict[str, str]: ...

    def status(self, *, audit: bool = False) -> dict[str, Any]: ...

    def add_member(
        self, name: str, address: str, callback: Callable[[ProposalError | None], None]
    ) -> None: ...

    def remove_member(
        self, name: str, callback: Callable[[ProposalError | None], None]
    ) -> None: ...

    def ask_leader_to_step_down(self) -> None: ...

    def membership_settled(self) -> bool:
        """Whether this node's log holds no configuration change past its commit index."""
        ...

    def watch_ends(self, queues: frozenset[str]) -> None:
        """Say (`NodeCore.ends_moved`) when an entry applied from now on moves the end of
        one of `queues`."""

    def take_ends_moved(self) -> set[str]:
        """The watched queues whose end moved since the last call."""
        ...


class NodeShell(Protocol):
    """What the core asks of the code that drives it."""

    def wake(self, conn: ConnectionCore) -> None:
        """`conn` has frames to write, must close, or may be read again."""

    def timers_changed(self) -> None:
        """`NodeCore.next_timer` may be sooner than it was."""

    def run_in_worker(
        self, work: Callable[[], Any], done: Callable[[Any, BaseException | None], None]
    ) -> None:
        """Run `work` off the core's loop (it may take a while), then `done(result,
        error)` on it."""


class Timer:
    __slots__ = ("args", "call", "cancelled", "when")

    def __init__(self, when: float, call: Callable[..., None], args: tuple[Any, ...]) -> None:
        self.when = when
        self.call = call
        self.args = args
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class Services:
    """The node core's shared state and services (see the module's docstring)."""

    def __init__(
        self,
        config: NodeConfig,
        replica: ReplicaHandle,
        shell: NodeShell,
        clock: Callable[[], float],
        *,
        random_bytes: Callable[[int], bytes] = os.urandom,
        groups: Sequence[ReplicaHandle] = (),
    ) -> None:
        """`clock`: monotonic seconds (trio's, the simulator's). `random_bytes`: for
        nonces and this run's consumer ids (the simulator's are seeded). `groups`: this
        node's replica of each Raft group, `replica` (group 0) first; none: one group."""
        check_node_config(config)
        self.config = config
        self.replica = replica
        self.groups: tuple[ReplicaHandle, ...] = tuple(groups) or (replica,)
        """This node's replica of each Raft group: `groups[0]` is `replica`, which holds
        the directory (`Place`) and whatever is not one queue's (nodes down, disk
        alarms, membership)."""
        if self.groups[0] is not replica:
            raise ValueError("groups[0] must be the replica")
        self._placed: dict[str, int] = {}
        """Queue -> its group, as group 0's replica here has applied it (placements never
        change, so this never goes stale; at most `MAX_PLACEMENTS` names)."""
        self._unplaced: list[tuple[int, str, Routed]] = []
        """Calls of `route` for queues not placed on this node's group 0, in the order
        they came: (the first barrier proposed after, the queue, what to call)."""
        self._unplaced_queues: set[str] = set()
        """The queues of `_unplaced`."""
        self._next_barrier = 1
        self._barrier_proposed = False
        self._declaring: dict[str, list[Any]] = {}
        """Queues whose declare this node has under way -> [declares under way, the
        calls of `route` waiting for them]: group 0 here may apply the placement before
        the `Place`'s answer comes back to propose the `Declare`, and a publish sent
        after the declare must not reach the group before it (found by review)."""
        self.shell = shell
        self.clock = clock
        self.random_bytes = random_bytes
        self.node_id = replica.node_id
        self.consumer_prefix = f"{self.node_id}.{random_bytes(4).hex()}."
        """Consumer ids name this run of this node, so a replayed delivery finds no one."""
        self.consumers: dict[str, ConnectionCore] = {}
        self.connections: set[ConnectionCore] = set()
        self.queue_counts: Callable[[Iterable[str]], dict[str, dict[str, int]]] | None = None
        """Per queue, what this node counted as it applied (`quorumq.server.counters`), for
        status."""
        self._timers: list[tuple[float, int, Timer]] = []
        self._timer_order = itertools.count()

    # ----------------------------------------------------------------- timers

    def call_later(self, delay: float, call: Callable[..., None], *args: Any) -> Timer:
        """Run `call(*args)` in `delay` seconds (`NodeCore.run_timers`)."""
        timer = Timer(self.clock() + delay, call, args)
        first = self._timers[0][0] if self._timers else None
        heapq.heappush(self._timers, (timer.when, next(self._timer_order), timer))
        if first is None or timer.when < first:
            self.shell.timers_changed()
        return timer

    # ---------------------------------------------------------------- routing

    def replica_of(self, queue: str) -> ReplicaHandle | None:
        """This node's replica of `queue`'s group, as far as this node's group 0 has
        applied the directory (None: not placed here, yet or ever)."""
        groups = self.groups
        if len(groups) == 1:
            return groups[0]
        group = self._placed.get(queue)
        if group is None:
            group = groups[0].query(lambda m: m.placement(queue))
            if group is None or not 0 <= group < len(groups):
                return None  # (`route` says why for a group this node does not host)
            if len(self._placed) < MAX_PLACEMENTS:  # (past it, names placed by their hash)
                self._placed[queue] = group
        return groups[group]

    def route(self, queue: str, then: Routed) -> None:
        """`then(replica of queue's group, None)`; for a queue this node has not seen
        placed, once a barrier on group 0 passed (its replica here has then applied
        every placement committed before the call: a client that declared on another
        node publishes here next), with `(None, None)` if the queue is still not placed
        (no such queue), or `(None, error)` if the barrier failed. Calls for one queue
        go on in the order they came. One barrier at a time, whatever the names, and
        at most `MAX_UNPLACED_WAITING` calls wait (past it, one is answered as a queue
        not placed, at once): names nobody declared cost group 0 one entry a round."""
        declaring = self._declaring.get(queue)
        if declaring is not None:
            declaring[1].append(then)
            return
        if queue not in self._unplaced_queues:
            replica = self.replica_of(queue)
            if replica is not None:
                then(replica, None)
                return
        if len(self._unplaced) >= MAX_UNPLACED_WAITING:
            then(None, None)
            return
        self._unplaced.append((self._next_barrier, queue, then))
        self._unplaced_queues.add(queue)
        if not self._barrier_proposed:
            self._propose_barrier()

    def _propose_barrier(self) -> None:
        barrier = self._next_barrier
        self._next_barrier += 1
        self._barrier_proposed = True
        self.replica.propose(Tick(), lambda _reply, error: self._barrier_passed(barrier, error))

    def _barrier_passed(self, barrier: int, error: ProposalError | None) -> None:
        self._barrier_proposed = False
        waited, self._unplaced, self._unplaced_queues = self._unplaced, [], set()
        for since, queue, then in waited:  # (the earlier calls for a queue first)
            replica = self.replica_of(queue)
            if replica is not None:
                then(replica, None)
            elif since <= barrier:
                then(None, error)
            else:  # came after this barrier was proposed: the next one
                self._unplaced.append((since, queue, then))
                self._unplaced_queues.add(queue)
        if self._unplaced:
            self._propose_barrier()

    def propose_to_queue(
        self, command: Any, done: ProposalCallback, conn: ConnectionCore | None = None
    ) -> None:
        """Propose `command` to the group of the queue it names (`route`); a queue never
        placed is answered as the machine answers one never declared. A command that
        waited for a barrier is not proposed if `conn` closed meanwhile (its consumers'
        `Down`s went already: a `Subscribe` after them would hold messages for no one)."""
        waited = False

        def then(replica: ReplicaHandle | None, error: ProposalError | None) -> None:
            if waited and conn is not None and conn.done:
                done(None, NotAppliedError("the connection closed while its queue was found"))
            elif replica is not None:
                replica.propose(command, done)
            elif error is not None:
                done(None, error)
            else:
                done(self._not_placed(command.queue), None)

        self.route(command.queue, then)
        waited = True

    def _not_placed(self, queue: str) -> Error:
        """The refusal of a command for a queue with no replica here: never declared,
        or (a node started with another group count) in a group this node lacks."""
        group = self.replica.query(lambda m: m.placement(queue))
        if group is None:
            return _unknown_queue(queue)
        return _error(
            f"queue {queue!r} is in Raft group {group}, and node {self.node_id} hosts "
            f"{len(self.groups)}: every node of a cluster must run with the same groups"
        )

    def declare(self, command: Declare, done: ProposalCallback) -> None:
        """Declare a queue: with groups, first its placement in group 0's directory
        (`Place`, with its dead-letter queue's), then the declare in its group."""
        groups = self.groups
        if len(groups) == 1:
            self.replica.propose(command, done)
            return
        queue = command.queue
        self._declaring.setdefault(queue, [0, []])[0] += 1

        def placed(reply: Reply | None, error: ProposalError | None) -> None:
            if not isinstance(reply, Placed):
                done(reply, error)
            elif not 0 <= reply.group < len(groups):
                done(self._not_placed(queue), None)
            else:
                if len(self._placed) < MAX_PLACEMENTS:
                    self._placed[queue] = reply.group
                groups[reply.group].propose(command, done)
            declaring = self._declaring[queue]
            declaring[0] -= 1
            if not declaring[0]:  # what waited for the declares goes, in order, after them
                del self._declaring[queue]
                for then in declaring[1]:
                    self.route(queue, then)

        place = Place(
            queue=queue, groups=len(groups), dead_letter_queue=command.options.dead_letter_queue
        )
        self.replica.propose(place, placed)

    # --------------------------------------------------------------- outgoing

    def push(self, conn: ConnectionCore, frame: Frame) -> None:
        if conn.push(frame) or conn.closing:
            self.shell.wake(conn)

    def error(self, conn: ConnectionCore, request_id: int | None, code: str, message: str) -> None:
        self.push(conn, {"t": "error", "id": request_id, "code": code, "message": message})

    def reply(
        self,
        conn: ConnectionCore,
        request_id: int,
        reply: Reply | None,
        error: ProposalError | None,
    ) -> None:
        """A proposal's outcome, to the client that asked."""
        if error is not None:
            code = "not_applied" if isinstance(error, NotAppliedError) else "outcome_unknown"
            self.error(conn, request_id, code, str(error))
        elif isinstance(reply, Error):
            self.push(
                conn,
                {
                    "t": "error",
                    "id": request_id,
                    "code": reply.code.value,
                    "message": reply.message,
                    "expected_seq": reply.expected_seq,
                    "generation": reply.generation,
                },
            )
        else:
            self.push(conn, {"t": "reply", "id": request_id, **_reply_fields(reply)})

    def close(self, conn: ConnectionCore, reason: str) -> None:
        conn.close(reason)
        self.shell.wake(conn)

    # --------------------------------------------------------------- requests

    def propose_for(
        self,
        conn: ConnectionCore,
        request_id: int | None,
        command: Command,
        *,
        consumer: str | None = None,
        cost: int = PROPOSAL_COST,
    ) -> None:
        """Propose `command` for `conn`'s request; `cost`: what it counts for in `conn`'s
        `proposing_bytes` until its outcome."""
        conn.proposing_bytes += cost

        def done(reply: Reply | None, error: ProposalError | None) -> None:
            self.answered(conn, cost)
            self.answer(conn, request_id, reply, error, consumer)

        if isinstance(command, Declare):
            self.declare(command, done)
        else:
            self.propose_to_queue(command, done, conn)

    def answered(self, conn: ConnectionCore, cost: int) -> None:
        """A proposal of `conn`'s that counted `cost` has its outcome: room again?"""
        was_full = conn.full
        conn.proposing_bytes -= cost
        if was_full and not conn.full and not conn.done:
            self.room_again(conn)

    def answer(
        self,
        conn: ConnectionCore,
        request_id: int | None,
        reply: Reply | None,
        error: ProposalError | None,
        consumer: str | None,
    ) -> None:
        failed = error is not None or isinstance(reply, Error)
        if consumer is not None:
            if consumer not in conn.awaiting_reply:
                return  # answered already: the Subscribe was in a snapshot this node installed
            early = conn.awaiting_reply.pop(consumer)
            conn.subscribe_requests.pop(consumer, None)
            if failed:
                conn.drop_consumer(consumer)
                self.consumers.pop(consumer, None)
            elif request_id is not None:
                self.push(conn, {"t": "reply", "id": request_id, "consumer": consumer})
                for frame in early:
                    self.push(conn, frame)
                return
        if request_id is not None:
            self.reply(conn, request_id, reply, error)
        elif failed:  # acks and nacks carry no id: report what went wrong anyway
            message = str(error) if error is not None else reply.message  # type: ignore[union-attr]
            self.error(conn, None, "settle_failed", message)

    def room_again(self, conn: ConnectionCore) -> None:
        """`conn` may take more: the core answers the reads and requests that waited."""
        raise NotImplementedError


def _unknown_queue(queue: str) -> Error:
    return Error(code=ErrorCode.UNKNOWN_QUEUE, message=f"no queue named {queue!r}")


def _error(message: str) -> Error:
    return Error(code=ErrorCode.INVALID, message=message)


def _reply_fields(reply: Reply | None) -> dict[str, Any]:
    if isinstance(reply, Enqueued):
        return {"offset": reply.offset, "count": reply.count, "duplicate": reply.duplicate}
    if isinstance(reply, Forgotten):
        return {"forgotten": reply.count}
    if isinstance(reply, QueuePurged):
        return {"messages": reply.messages}
    if isinstance(reply, QueueDeleted):
        return {"messages": reply.messages, "consumers": reply.consumers}
    created = getattr(reply, "created", None)
    return {} if created is None else {"created": created}
