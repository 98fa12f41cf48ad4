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
from collections.abc import Callable, Iterable
from typing import Any, Protocol, TypeVar

from ..machine import (
    Command,
    Enqueued,
    Error,
    Forgotten,
    QueueDeleted,
    QueuePurged,
    Reply,
)
from ..replica import NotAppliedError, ProposalError
from ..wire.protocol import Frame
from .config import NodeConfig, check_node_config
from .connection import ConnectionCore

T = TypeVar("T")

ProposalCallback = Callable[[Reply | None, ProposalError | None], None]
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
    ) -> None:
        """`clock`: monotonic seconds (trio's, the simulator's). `random_bytes`: for
        nonces and this run's consumer ids (the simulator's are seeded)."""
        check_node_config(config)
        self.config = config
        self.replica = replica
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

        self.replica.propose(command, done)

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
