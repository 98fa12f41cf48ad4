"""A quorumq node: one replica and the trio server its clients connect to.

Threads: the replica's Raft thread applies the log and produces this node's effects and
proposal outcomes; it hands them to trio only through the trio token (`run_sync_soon`,
which never blocks it). Everything else runs on the trio thread.

A consumer's deliveries come from the replica of the node it is connected to. A
delivery for a consumer this node does not have (its connection closed before the
`Down` was applied, or it belonged to an earlier run of this node) is answered with a
`Down` proposal, so its messages go back to the queue.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterable
from typing import Any

import attrs
import trio

from ..deliveries import missing as missing_deliveries
from ..machine import (
    Ack,
    Command,
    ConsumerDown,
    Deliver,
    Down,
    Effect,
    Enqueued,
    Error,
    ErrorCode,
    Nack,
    Reply,
)
from ..protocol import DEFAULT_MAX_BODY, FRAME_OVERHEAD, encode_frame, keep_alive
from ..raft.member import MAX_COMMAND_BYTES
from ..replica import (
    ConfigError,
    NotAppliedError,
    OutcomeUnknownError,
    ProposalError,
    Replica,
    ReplicaConfig,
    is_loopback,
)
from .connection import READ_REPLY_BYTES, Connection, MembershipError

logger = logging.getLogger(__name__)

SETTLE_ATTEMPTS = 20
MEMBERSHIP_DEADLINE_S = 20.0
"""How long a membership change may wait for a leader and for an earlier change."""
RETRY_EVERY_S = 0.1
LOST_CONSUMERS_EVERY_S = 1.0


@attrs.frozen(kw_only=True)
class NodeConfig:
    replica: ReplicaConfig
    listen_host: str = "127.0.0.1"
    listen_port: int = 0
    token: str | None = None
    """Clients prove they know it (HMAC of a nonce); None: no client authentication, only
    with `insecure` on a loopback listen address."""
    admin_token: str | None = None
    """Administrative verbs (membership) need a proof of it too. None: refused, unless
    the node runs insecure on loopback (a local dev cluster)."""
    insecure: bool = False
    """Allow no client token (only when listening on loopback)."""
    max_body: int = DEFAULT_MAX_BODY
    """The largest message body; at most `MAX_BODY` (a message must fit one log entry)."""
    handshake_timeout_s: float = 5.0
    """A connection that has not said `hello` by then is closed."""
    max_connections: int = 1024
    """Client connections served at once. One more closes the oldest connection that has
    not said `hello`, if there is one; otherwise it is refused (`too_many_connections`)."""
    max_unauthenticated: int = 64
    """Connections that have not said `hello` yet, at once; one more closes the oldest of
    them (a real client says `hello` within one round trip, so silent peers cannot hold
    the connection cap and lock real clients out)."""
    outbound_frames: int = 20_000
    """Frames waiting for a client, besides its consumers' prefetch, before it counts as
    a slow consumer and is cut off."""
    outbound_bytes: int = 32 * 1024 * 1024
    """Bytes waiting for a client (frames' encoded bytes plus 128 each) before it counts
    as a slow consumer and is cut off. Past a quarter of it the node reads no more of
    the client's requests until it has caught up (back-pressure). At least four of the
    largest frames a node sends (a delivery of `max_body`, or a read reply of 768 KiB,
    plus 64 KiB)."""
    max_consumers: int = 1024
    """Consumers one connection may have (cancelled ones count until they hold nothing);
    one more subscribe is refused (`too_many_consumers`)."""


MAX_BODY = MAX_COMMAND_BYTES - FRAME_OVERHEAD
"""The largest `--max-body` a node takes: a body must fit one Raft log entry."""


def check_node_config(config: NodeConfig) -> None:
    """`ConfigError` for a configuration the node cannot serve."""
    if not config.token:
        if not config.insecure:
            raise ConfigError(
                "a client token is required (QUORUMQ_TOKEN or --token-file): without one "
                "anyone who reaches the client port may publish, consume and read"
            )
        if not is_loopback(f"{config.listen_host}:0"):
            raise ConfigError(
                f"insecure mode is for loopback only; the client address "
                f"{config.listen_host} is not"
            )
    if not 1 <= config.max_unauthenticated <= config.max_connections:
        raise ConfigError(
            f"max unauthenticated connections must be between 1 and max connections "
            f"({config.max_connections}), not {config.max_unauthenticated}"
        )
    if not 1 <= config.max_body <= MAX_BODY:
        raise ConfigError(
            f"max body must be between 1 and {MAX_BODY} bytes (a message must fit one log "
            f"entry of at most {MAX_COMMAND_BYTES}), not {config.max_body}"
        )
    largest_frame = max(config.max_body, READ_REPLY_BYTES) + FRAME_OVERHEAD  # sent
    if config.outbound_bytes < 4 * largest_frame:
        raise ConfigError(
            f"outbound bytes must be at least four of the largest frames a node sends "
            f"({4 * largest_frame} bytes with this max body), not {config.outbound_bytes}"
        )
    if config.max_consumers < 1:
        raise ConfigError(f"max consumers must be at least 1, not {config.max_consumers}")


class NodeServer:
    @property
    def open_admin(self) -> bool:
        """Administrative verbs need no admin proof: an insecure node on loopback."""
        return not self.config.token and not self.config.admin_token

    def __init__(self, config: NodeConfig) -> None:
        check_node_config(config)
        self.config = config
        self.node_id = config.replica.node_id
        self.consumer_prefix = f"{self.node_id}.{os.urandom(4).hex()}."
        """Consumer ids name this run of this node, so a replayed delivery finds no one."""
        self.consumers: dict[str, Connection] = {}
        self.connections: set[Connection] = set()
        self.unauthenticated: dict[Connection, None] = {}
        """The connections of `connections` that have not said `hello`, oldest first."""
        self._downed: set[str] = set()
        self._connection_counter = 0
        self._token: trio.lowlevel.TrioToken | None = None
        self._replica: Replica | None = None
        self.listeners: list[trio.SocketListener] = []

    @property
    def replica(self) -> Replica:
        assert self._replica is not None, "the node is not serving"
        return self._replica

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Start the replica, listen for clients; `task_status.started(listeners)`."""
        self._token = trio.lowlevel.current_trio_token()
        self._replica = await trio.to_thread.run_sync(
            lambda: Replica(self.config.replica, self._on_effects, self._on_state_replaced)
        )
        try:
            self.listeners = await trio.open_tcp_listeners(
                self.config.listen_port, host=self.config.listen_host
            )
            task_status.started(self.listeners)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._down_lost_consumers)
                nursery.start_soon(self._stop_if_raft_stopped)
                await trio.serve_listeners(self._serve_client, self.listeners)
        finally:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(self.replica.stop)

    async def _stop_if_raft_stopped(self) -> None:
        """A member whose journal failed has stopped acknowledging: the node stops too
        (exit non-zero, with the reason) rather than answer every client "unknown"."""
        while True:
            error = self.replica.member.fatal_error
            if error is not None:
                raise error
            await trio.sleep(0.2)

    async def _serve_client(self, stream: trio.SocketStream) -> None:
        if len(self.unauthenticated) >= self.config.max_unauthenticated:
            self._evict_oldest_unauthenticated()
        if len(self.connections) >= self.config.max_connections and self.unauthenticated:
            self._evict_oldest_unauthenticated()
        if len(self.connections) >= self.config.max_connections:
            limit = self.config.max_connections
            refusal = {
                "t": "error",
                "id": None,
                "code": "too_many_connections",
                "message": f"this node serves {limit} connections at most; try another node",
            }
            with trio.move_on_after(1), contextlib.suppress(trio.BrokenResourceError):
                await stream.send_all(encode_frame(refusal))
            await stream.aclose()
            return
        keep_alive(stream.socket)  # a client whose host vanished gives its consumers up
        self._connection_counter += 1
        conn = Connection(self, stream, self._connection_counter)
        self.connections.add(conn)
        self.unauthenticated[conn] = None
        await conn.run()

    def _evict_oldest_unauthenticated(self) -> None:
        """Close the oldest connection that has not said `hello`, at once, and stop
        counting it: a newer connection takes its place."""
        conn = next(iter(self.unauthenticated))
        del self.unauthenticated[conn]
        self.connections.discard(conn)
        conn.evict()

    def greeted(self, conn: Connection) -> None:
        """`conn` said `hello`: it no longer counts as unauthenticated."""
        self.unauthenticated.pop(conn, None)

    def forget(self, conn: Connection) -> None:
        """The connection is gone: its consumers are down."""
        self.connections.discard(conn)
        self.unauthenticated.pop(conn, None)
        for consumer in conn.consumers:
            if self.consumers.get(consumer) is conn:
                del self.consumers[consumer]
            self._down(consumer)
        conn.consumers.clear()

    async def _down_lost_consumers(self) -> None:
        """Propose `Down` for consumers in the log that this node serves no longer.

        A closed connection proposes its consumers' `Down` at once, but that proposal
        can be lost to a leader change. Consumers of an earlier run of this node died
        with it, and if the node came back within the grace period no `NodeDown`
        returns their messages. Neither may hold credit for a delivery that would
        reveal them. So, every second: a consumer the machine places on this node that
        no connection here serves, now and a second ago, gets its `Down` (again)."""
        node = self.node_id
        missing_before: set[str] = set()
        while True:
            placed = self.replica.query(lambda m: m.consumers_on(node))
            missing = {c for c in placed if c not in self.consumers}
            for consumer in sorted(missing & missing_before):
                logger.info("consumer %s is served nowhere: proposing its Down", consumer)
                self.replica.propose(Down(consumer=consumer))
            missing_before = missing
            self._forget_removed(set(placed))
            await trio.sleep(LOST_CONSUMERS_EVERY_S)

    def _forget_removed(self, placed: set[str]) -> None:
        """Drop the records of consumers the machine no longer has: a cancelled one once
        it held nothing (they stayed until the connection closed: 10,000 subscribe and
        cancel cycles on one connection kept 10,000 records), and `Down`s done."""
        for consumer, conn in list(self.consumers.items()):
            if consumer in conn.cancelling and consumer not in placed:
                del self.consumers[consumer]
                conn.drop_consumer(consumer)
        self._downed &= placed

    def _down(self, consumer: str) -> None:
        if consumer not in self._downed:
            self._downed.add(consumer)
            self.replica.propose(Down(consumer=consumer))

    # ------------------------------------------------ from the Raft thread

    def _soon(self, fn: Any, *args: Any) -> None:
        assert self._token is not None
        with contextlib.suppress(trio.RunFinishedError):
            self._token.run_sync_soon(fn, *args)

    def _on_effects(self, index: int, effects: tuple[Effect, ...]) -> None:
        self._soon(self._route, effects, index)

    def _on_state_replaced(self) -> None:
        self._soon(self._resync_consumers)

    def _route(self, effects: Iterable[Effect], index: int | None = None) -> None:
        """Run this node's effects of log entry `index` (None: `_resync_consumers`'s)."""
        for e in effects:
            if type(e) is Deliver:
                conn = self.consumers.get(e.consumer)
                if conn is None or conn.closed:
                    self._down(e.consumer)
                    continue
                sent = conn.sent_to(e.consumer)
                if index is not None and sent.covers(index):
                    continue  # `_resync_consumers` got there first
                sent.record(e)
                if sent.full():
                    self._prune_deliveries(conn, e.consumer)
                frame = {
                    "t": "deliver",
                    "consumer": e.consumer,
                    "offset": e.offset,
                    "key": e.key,
                    "body": e.body,
                    "headers": e.headers,
                    "redelivered": e.redelivered,
                    "delivery_count": e.delivery_count,
                    "node": self.node_id,
                }
                early = conn.awaiting_reply.get(e.consumer)
                if early is not None:  # the subscribe reply goes first
                    early.append(frame)
                else:
                    conn.push(frame)
            elif type(e) is ConsumerDown:
                self._downed.discard(e.consumer)
                conn = self.consumers.pop(e.consumer, None)
                if conn is not None:
                    conn.drop_consumer(e.consumer)
                    conn.push({"t": "cancelled", "consumer": e.consumer, "reason": e.reason})

    def _prune_deliveries(self, conn: Connection, consumer: str) -> None:
        """Keep, of what `consumer` was sent, what the machine says it still holds."""
        queue = conn.consumers[consumer]
        held = self.replica.query(lambda m: m.unacked(queue, consumer))
        conn.sent_to(consumer).keep(held)

    def _resync_consumers(self) -> None:
        """This node's replica jumped to the leader's snapshot: the log entries it skipped
        never ran their effects here (and entries it applies again must not run twice).
        Compare the machine with what each consumer here was sent: send the held
        deliveries it was not sent, and cancel the consumers the machine removed (their
        node was marked down meanwhile: the client subscribes again)."""
        if self._replica is None:
            return  # the node's own snapshot at start-up: nobody connected yet
        served = [
            (c, conn, conn.consumers[c])
            for c, conn in self.consumers.items()
            if not conn.closed and c in conn.consumers
        ]
        index, held = self.replica.query(
            lambda m: (m.last_index, [m.held_deliveries(q, c) for c, _, q in served])
        )
        for (c, conn, queue), deliveries in zip(served, held, strict=True):
            if c in conn.awaiting_reply and deliveries is not None:
                # its Subscribe was among the skipped entries: PySyncObj will not answer it
                self._answer(conn, conn.subscribe_requests.get(c), None, None, c)
            missing = missing_deliveries(deliveries, conn.sent_to(c), index)
            if missing is None:
                # not yet subscribed in the log, or cancelled by its client: nothing to say
                if c not in conn.awaiting_reply and c not in conn.cancelling:
                    self._route(
                        (
                            ConsumerDown(
                                queue=queue, consumer=c, node=self.node_id, reason="node_down"
                            ),
                        )
                    )
                continue
            if missing:
                logger.info(
                    "consumer %s: sending %d deliveries the snapshot install skipped",
                    c,
                    len(missing),
                )
                self._route(missing)

    # ------------------------------------------------------------- proposing

    def propose(
        self,
        command: Command,
        conn: Connection,
        request_id: int | None,
        consumer: str | None = None,
        cost: int = 0,
    ) -> None:
        """Propose `command` for `conn`; `cost`: what it counts for in `conn`'s
        `proposing_bytes`, given back with its outcome."""

        def done(reply: Reply | None, error: ProposalError | None) -> None:
            self._soon(self._answer, conn, request_id, reply, error, consumer)
            if cost:
                self._soon(conn.answered, cost)

        self.replica.propose(command, done)

    def settle(self, command: Ack | Nack, conn: Connection, attempt: int = 1) -> None:
        """Propose an ack or nack, again if a leader change lost it: the client sent it
        and moved on, and a lost one would leave the message held by a live consumer.

        After "not applied" the same command goes again. After "outcome unknown" it
        goes again for the offsets the consumer still holds on this replica (an ack is
        safe to repeat; a requeueing nack repeated after all is one more marked
        redelivery). A repeat refused because the offsets are no longer held means the
        first attempt did land: nothing to report.

        The machine refuses an ack or nack whole if one offset is not held (a nack of a
        keyed message takes back the key's later messages the consumer holds, and the
        client may ack one of those in the same read as others). The refusal is
        reported, and the offsets still held are settled again, so none is stranded."""

        def done(reply: Reply | None, error: ProposalError | None) -> None:
            if isinstance(reply, Error) and reply.code == ErrorCode.NOT_HELD:
                if attempt == 1:  # say which, then settle the offsets still held
                    self._soon(self._answer, conn, None, reply, None, None)
                if len(command.offsets) > 1 and attempt < SETTLE_ATTEMPTS:
                    self._soon(self._settle_held, command, conn, attempt + 1)
                return
            if attempt < SETTLE_ATTEMPTS:
                if isinstance(error, NotAppliedError):
                    self.settle(command, conn, attempt + 1)
                    return
                if isinstance(error, OutcomeUnknownError):
                    self._soon(self._settle_held, command, conn, attempt + 1)
                    return
            self._soon(self._answer, conn, None, reply, error, None)

        self.replica.propose(command, done)

    def _settle_held(self, command: Ack | Nack, conn: Connection, attempt: int) -> None:
        held = set(self.replica.query(lambda m: m.unacked(command.queue, command.consumer)))
        offsets = tuple(o for o in command.offsets if o in held)
        if offsets:
            self.settle(attrs.evolve(command, offsets=offsets), conn, attempt)

    def _answer(
        self,
        conn: Connection,
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
                conn.push({"t": "reply", "id": request_id, "consumer": consumer})
                for frame in early:
                    conn.push(frame)
                return
        if request_id is not None:
            conn.reply(request_id, reply, error)
        elif failed:  # acks and nacks carry no id: report what went wrong anyway
            message = str(error) if error is not None else reply.message  # type: ignore[union-attr]
            conn.error(None, "settle_failed", message)

    def propose_publishes(
        self, command: Command, conn: Connection, ids: list[int], cost: int
    ) -> None:
        def done(reply: Reply | None, error: ProposalError | None) -> None:
            self._soon(self._answer_publishes, conn, ids, reply, error)
            self._soon(conn.answered, cost)

        self.replica.propose(command, done)

    def _answer_publishes(
        self,
        conn: Connection,
        ids: list[int],
        reply: Reply | None,
        error: ProposalError | None,
    ) -> None:
        if isinstance(reply, Enqueued) and error is None:
            for i, request_id in enumerate(ids):
                offset = None if reply.offset is None else reply.offset + i
                conn.push(
                    {
                        "t": "reply",
                        "id": request_id,
                        "offset": offset,
                        "count": 1,
                        "duplicate": reply.duplicate,
                    }
                )
            return
        for request_id in ids:
            conn.reply(request_id, reply, error)

    # ------------------------------------------------------------- membership

    async def add_member(self, name: str, address: str) -> dict[str, str]:
        """Add a replica to the Raft configuration; wait until the change is committed.
        Start the new node first (its peers: the current members and itself)."""
        members = self.replica.members()
        if members.get(name) == address:
            return members
        if name in members:
            raise MembershipError("member_exists", f"{name} is a member at {members[name]}")
        for other, other_address in members.items():
            if other_address == address:
                raise MembershipError("member_exists", f"{address} is {other}'s Raft address")
        if not (self.config.replica.secret or is_loopback(address)):
            raise MembershipError(
                "invalid", f"{address} is not loopback: a cluster without a secret stays local"
            )
        await self._change_members(lambda done: self.replica.add_member(name, address, done))
        return self.replica.members()

    async def remove_member(self, name: str) -> dict[str, str]:
        """Remove a replica from the Raft configuration (asking it to hand leadership
        over first if it leads); wait until the change is committed. The node itself
        keeps running, cut off: stop it afterwards."""
        if name not in self.replica.members():
            raise MembershipError("unknown_member", f"{name} is not a member")
        if name == self.node_id:
            raise MembershipError(
                "target_is_self",
                f"{name} cannot remove itself: send the request to another member",
            )
        with trio.move_on_after(MEMBERSHIP_DEADLINE_S):
            while self.replica.status()["leader"] == name:
                self.replica.ask_leader_to_step_down()
                await trio.sleep(RETRY_EVERY_S)
        if name not in self.replica.members():
            return self.replica.members()
        await self._change_members(lambda done: self.replica.remove_member(name, done))
        return self.replica.members()

    async def _change_members(
        self, start: Callable[[Callable[[ProposalError | None], None]], None]
    ) -> None:
        """Propose a configuration change, again while the leader refuses it (no leader
        yet, or an earlier change not yet committed), until the deadline."""
        with trio.move_on_after(MEMBERSHIP_DEADLINE_S):
            while True:
                error = await self._outcome(start)
                if error is None:
                    return
                if isinstance(error, OutcomeUnknownError):
                    raise MembershipError("outcome_unknown", f"{error}: check the members")
                logger.info("membership change not applied (%s); trying again", error)
                await trio.sleep(RETRY_EVERY_S)
        raise MembershipError(
            "timeout", f"the change was not committed within {MEMBERSHIP_DEADLINE_S} s"
        )

    async def _outcome(
        self, start: Callable[[Callable[[ProposalError | None], None]], None]
    ) -> ProposalError | None:
        """Start a callback-style Raft operation and wait for its outcome."""
        finished = trio.Event()
        outcome: list[ProposalError | None] = []

        def done(error: ProposalError | None) -> None:
            outcome.append(error)
            self._soon(finished.set)

        start(done)
        await finished.wait()
        return outcome[0]

    # ----------------------------------------------------------------- status

    def status(self, replica_status: dict[str, Any] | None = None) -> dict[str, Any]:
        """What `quorumq status` shows, O(queues) (`replica_status`: one taken already,
        say with the audit digest, from a worker thread)."""
        status = replica_status if replica_status is not None else self.replica.status()

        def queues(m: Any) -> dict[str, Any]:
            return {
                q: {
                    **attrs.asdict(m.stats(q)),
                    "consumer_ids": list(m.consumers(q)),
                    "committed_offsets": m.committed_offsets(q),
                }
                for q in m.queues()
            }

        status["queues"] = self.replica.query(queues)
        status["clients"] = len(self.connections)
        return status
