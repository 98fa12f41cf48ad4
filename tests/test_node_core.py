"""The node core on its own: frames in, proposals out, with a replica that records what
is proposed and answers when the test says (the simulator runs the same core in whole
clusters)."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest

from quorumq.deliveries import SENT_RECORD_MIN
from quorumq.machine import (
    OK,
    Ack,
    Applied,
    Command,
    ConsumerDown,
    Declare,
    DeleteQueue,
    Deliver,
    Down,
    EnqueueBatch,
    Machine,
    Message,
    Meta,
    Nack,
    NodeDown,
    Subscribe,
)
from quorumq.node import ConnectionCore, NodeConfig, NodeCore
from quorumq.protocol import PROTOCOL_VERSION, copy_frame, encode_frame
from quorumq.replica import ReplicaConfig


class _Replica:
    """Records proposals; `answer(i)` answers the i-th with OK."""

    node_id = "A"

    def __init__(self) -> None:
        self.proposed: list[tuple[Command, Callable[..., None] | None]] = []

    def propose(self, command: Command, callback: Callable[..., None] | None = None) -> None:
        self.proposed.append((command, callback))

    def answer(self, index: int) -> None:
        callback = self.proposed[index][1]
        assert callback is not None
        callback(OK, None)

    def commands(self, kind: type) -> list[Any]:
        return [c for c, _ in self.proposed if isinstance(c, kind)]

    def query(self, read: Callable[[Any], Any]) -> Any:
        raise AssertionError("not used here")


class _Shell:
    def wake(self, conn: ConnectionCore) -> None:
        pass

    def timers_changed(self) -> None:
        pass

    def run_in_worker(self, work: Callable[[], Any], done: Callable[..., None]) -> None:
        raise AssertionError("not used here")


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _node(clock: Callable[[], float], replica: _Replica | None = None) -> tuple[NodeCore, _Replica]:
    replica = _Replica() if replica is None else replica
    config = NodeConfig(
        replica=ReplicaConfig(
            node_id="A", peers={"A": "127.0.0.1:1"}, data_dir="/nonexistent", secret="s"
        ),
        insecure=True,
    )
    rng = random.Random(1)
    node = NodeCore(config, replica, _Shell(), clock, random_bytes=rng.randbytes)  # type: ignore[arg-type]
    return node, replica


@pytest.fixture
def core() -> tuple[NodeCore, _Replica]:
    return _node(lambda: 0.0)


def _subscribed(core: NodeCore, replica: _Replica) -> tuple[ConnectionCore, str]:
    conn = core.connection_made()
    core.data_received(conn, encode_frame({"t": "hello", "v": PROTOCOL_VERSION, "client": "t"}))
    core.data_received(conn, encode_frame({"t": "subscribe", "id": 1, "queue": "q", "prefetch": 9}))
    (subscribe,) = replica.commands(Subscribe)
    return conn, subscribe.consumer


def _send(core: NodeCore, conn: ConnectionCore, *frames: dict[str, Any]) -> None:
    core.data_received(conn, b"".join(encode_frame(f) for f in frames))


def test_acks_that_come_while_one_is_proposed_go_in_one_ack_once_it_is_answered(
    core: tuple[NodeCore, _Replica],
) -> None:
    """One log entry (one fdatasync on each replica) for the acks a consumer sends while
    its last ack commits, instead of one each; nothing waits when none is proposed."""
    node, replica = core
    conn, consumer = _subscribed(node, replica)
    _send(node, conn, {"t": "ack", "consumer": consumer, "offsets": [0]})
    _send(node, conn, {"t": "ack", "consumer": consumer, "offsets": [1]})
    _send(node, conn, {"t": "ack", "consumer": consumer, "offsets": [2, 3]})
    assert [a.offsets for a in replica.commands(Ack)] == [(0,)]
    replica.answer(next(i for i, (c, _) in enumerate(replica.proposed) if isinstance(c, Ack)))
    assert [a.offsets for a in replica.commands(Ack)] == [(0,), (1, 2, 3)]
    replica.answer(len(replica.proposed) - 1)
    _send(node, conn, {"t": "ack", "consumer": consumer, "offsets": [4]})
    assert [a.offsets for a in replica.commands(Ack)] == [(0,), (1, 2, 3), (4,)]


def test_a_nack_or_a_lost_connection_does_not_overtake_the_acks_that_wait(
    core: tuple[NodeCore, _Replica],
) -> None:
    """Acks waiting behind a proposed one are proposed before the consumer's nack, and
    before its `Down` when its connection goes: what it acked never comes back."""
    node, replica = core
    conn, consumer = _subscribed(node, replica)
    _send(node, conn, {"t": "ack", "consumer": consumer, "offsets": [0]})
    _send(node, conn, {"t": "ack", "consumer": consumer, "offsets": [1]})
    _send(node, conn, {"t": "nack", "consumer": consumer, "offsets": [2], "requeue": True})
    kinds = [
        (type(c).__name__, c.offsets) for c, _ in replica.proposed if isinstance(c, Ack | Nack)
    ]
    assert kinds == [("Ack", (0,)), ("Ack", (1,)), ("Nack", (2,))]
    _send(node, conn, {"t": "ack", "consumer": consumer, "offsets": [3]})
    node.connection_lost(conn)
    tail = [c for c, _ in replica.proposed[-2:]]
    assert isinstance(tail[0], Ack) and tail[0].offsets == (3,)
    assert isinstance(tail[1], Down) and tail[1].consumer == consumer


def _settled(replica: _Replica) -> list[tuple[str, tuple[int, ...]]]:
    return [(type(c).__name__, c.offsets) for c, _ in replica.proposed if isinstance(c, Ack | Nack)]


def test_held_acks_go_after_a_while_even_if_the_ack_they_wait_for_is_never_answered() -> None:
    """PySyncObj does not answer every proposal (a snapshot install can skip its entry;
    the replica's timeout answers after 15 s): acks held behind it go after
    `ACKS_HELD_S`, and at once past `ACKS_HELD_MAX` offsets (review of 74b7298)."""
    from quorumq.node.core import ACKS_HELD_MAX, ACKS_HELD_S

    clock = _Clock()
    node, replica = _node(clock)
    conn, consumer = _subscribed(node, replica)
    for offset in range(4):
        _send(node, conn, {"t": "ack", "consumer": consumer, "offsets": [offset, offset]})
    assert _settled(replica) == [("Ack", (0, 0))]
    clock.now = ACKS_HELD_S
    node.run_timers()
    assert _settled(replica) == [("Ack", (0, 0)), ("Ack", (1, 2, 3))]  # once each
    many = list(range(10, 10 + ACKS_HELD_MAX))
    _send(node, conn, {"t": "ack", "consumer": consumer, "offsets": many})
    assert _settled(replica)[-1] == ("Ack", tuple(many))


def test_a_nack_does_not_overtake_an_ack_a_leader_change_made_wait() -> None:
    """An ack refused as not applied goes again 0.1 s later; a nack of the same consumer
    in between brings it forward, so the ack lands first (a requeueing nack of a keyed
    message takes back the key's later messages: an acked one came back; review of
    74b7298)."""
    from quorumq.node.core import RETRY_EVERY_S
    from quorumq.replica import NotAppliedError

    clock = _Clock()
    node, replica = _node(clock)
    conn, consumer = _subscribed(node, replica)
    _send(node, conn, {"t": "ack", "consumer": consumer, "offsets": [1]})
    first = next(cb for c, cb in replica.proposed if isinstance(c, Ack))
    assert first is not None
    first(None, NotAppliedError("no leader"))
    _send(node, conn, {"t": "nack", "consumer": consumer, "offsets": [0], "requeue": True})
    assert _settled(replica) == [("Ack", (1,)), ("Ack", (1,)), ("Nack", (0,))]
    clock.now = RETRY_EVERY_S * 2
    node.run_timers()
    assert _settled(replica) == [("Ack", (1,)), ("Ack", (1,)), ("Nack", (0,))]  # not again


def test_nacks_read_together_go_in_one_command_per_delay_and_a_bad_delay_is_refused(
    core: tuple[NodeCore, _Replica],
) -> None:
    node, replica = core
    conn, consumer = _subscribed(node, replica)
    nack = {"t": "nack", "consumer": consumer, "requeue": True}
    _send(
        node,
        conn,
        {**nack, "offsets": [0], "delay_ms": 500},
        {**nack, "offsets": [1]},
        {**nack, "offsets": [2], "delay_ms": 500},
        {**nack, "offsets": [3], "delay_ms": 500, "requeue": False},
        {**nack, "offsets": [4], "delay_ms": 10**12},
    )
    assert [(n.offsets, n.delay_ms) for n in replica.commands(Nack)] == [
        ((0, 2), 500),
        ((1,), None),
    ]
    errors = [f for f in _frames(conn) if f["t"] == "error"]
    assert [f["code"] for f in errors] == ["invalid", "invalid"]
    assert "delay_ms" in errors[0]["message"]


def _frames(conn: ConnectionCore) -> list[dict[str, Any]]:
    from quorumq.protocol import FrameDecoder

    decoder = FrameDecoder()
    data, _frames_count, _cost = conn.take_output(1 << 20)
    decoder.feed(data)
    return list(decoder.frames())


class _MachineReplica(_Replica):
    """A replica whose queries read a real machine, which the test applies commands to
    (their effects reach the node only when the test hands them over)."""

    def __init__(self) -> None:
        super().__init__()
        self.machine = Machine()

    def apply(self, command: Command) -> Applied:
        return self.machine.apply(Meta(self.machine.last_index + 1, 0), command)

    def query(self, read: Callable[[Any], Any]) -> Any:
        return read(self.machine)


def _node_on_a_machine(*queues: str) -> tuple[NodeCore, _MachineReplica]:
    replica = _MachineReplica()
    for queue in queues:
        replica.apply(Declare(queue=queue))
    node, _ = _node(lambda: 0.0, replica)
    return node, replica


def _subscribe_on_machine(
    node: NodeCore, replica: _MachineReplica, conn: ConnectionCore, queue: str, prefetch: int
) -> str:
    """Subscribe through the node, apply the Subscribe, answer it: the consumer's id."""
    _send(node, conn, {"t": "subscribe", "id": 1, "queue": queue, "prefetch": prefetch})
    subscribe, callback = replica.proposed[-1]
    assert isinstance(subscribe, Subscribe) and callback is not None
    callback(replica.apply(subscribe).reply, None)
    return subscribe.consumer


def test_a_deleted_queues_consumer_is_told_why_and_late_deliveries_find_its_queue_gone() -> None:
    """The node runs an entry's effects after its replica may have applied more: here
    1,100 deliveries (past the record's trim, which asks the machine what the consumer
    holds) after the queue's delete. Nothing trips over the missing queue, and the
    consumer's `cancelled` says `queue_deleted`."""
    node, replica = _node_on_a_machine("q")
    conn = node.connection_made()
    _send(node, conn, {"t": "hello", "v": PROTOCOL_VERSION, "client": "t"})
    consumer = _subscribe_on_machine(node, replica, conn, "q", prefetch=0)
    batch = EnqueueBatch(queue="q", messages=[Message(body=b"m")] * (SENT_RECORD_MIN + 76))
    delivered = replica.apply(batch)
    deleted = replica.apply(DeleteQueue(queue="q", force=True))
    node.effects_applied(3, delivered.effects)
    node.effects_applied(4, tuple(e for e in deleted.effects if isinstance(e, ConsumerDown)))
    frames = _frames(conn)
    assert sum(f["t"] == "deliver" for f in frames) == SENT_RECORD_MIN + 76
    assert frames[-1] == {"t": "cancelled", "consumer": consumer, "reason": "queue_deleted"}
    assert consumer not in node.consumers and consumer not in conn.consumers


def test_after_a_snapshot_install_a_consumer_whose_queue_went_is_cancelled_as_deleted() -> None:
    """The entries a snapshot install skipped never ran their effects here: a consumer
    the machine no longer has is cancelled with `queue_deleted` if its queue is gone (its
    client must not subscribe again), else as though its node was marked down."""
    node, replica = _node_on_a_machine("gone", "kept")
    conn = node.connection_made()
    _send(node, conn, {"t": "hello", "v": PROTOCOL_VERSION, "client": "t"})
    on_gone = _subscribe_on_machine(node, replica, conn, "gone", prefetch=1)
    on_kept = _subscribe_on_machine(node, replica, conn, "kept", prefetch=1)
    _frames(conn)  # the subscribe replies
    replica.apply(DeleteQueue(queue="gone", force=True))
    replica.apply(NodeDown(node="A"))
    node.state_replaced()
    cancelled = {f["consumer"]: f["reason"] for f in _frames(conn) if f["t"] == "cancelled"}
    assert cancelled == {on_gone: "queue_deleted", on_kept: "node_down"}


def test_an_ack_whose_outcome_is_unknown_is_not_settled_again_once_its_queue_is_gone() -> None:
    """After "outcome unknown" the node settles again what the consumer still holds,
    asking its machine; a queue deleted meanwhile holds nothing."""
    from quorumq.replica import OutcomeUnknownError

    node, replica = _node_on_a_machine("q")
    conn = node.connection_made()
    _send(node, conn, {"t": "hello", "v": PROTOCOL_VERSION, "client": "t"})
    consumer = _subscribe_on_machine(node, replica, conn, "q", prefetch=2)
    replica.apply(EnqueueBatch(queue="q", messages=[Message(body=b"m")] * 2))
    _send(node, conn, {"t": "ack", "consumer": consumer, "offsets": [0, 1]})
    ack, callback = replica.proposed[-1]
    assert isinstance(ack, Ack) and callback is not None
    replica.apply(DeleteQueue(queue="q", force=True))
    callback(None, OutcomeUnknownError("lost with the leader"))
    assert replica.proposed[-1][0] is ack  # nothing proposed again


# ------------------------------------------------------------ in-process clients


def _local_node(**config: Any) -> tuple[NodeCore, _Replica]:
    replica = _Replica()
    settings: dict[str, Any] = {"insecure": True, **config}
    node_config = NodeConfig(
        replica=ReplicaConfig(
            node_id="A", peers={"A": "127.0.0.1:1"}, data_dir="/nonexistent", secret="s"
        ),
        **settings,
    )
    rng = random.Random(1)
    node = NodeCore(node_config, replica, _Shell(), lambda: 0.0, random_bytes=rng.randbytes)  # type: ignore[arg-type]
    return node, replica


def _taken(conn: ConnectionCore) -> list[dict[str, Any]]:
    """What the shell would hand a local client: everything queued, marked sent."""
    frames, count, cost = conn.take_output(1 << 30)
    assert isinstance(frames, list)
    conn.sent(count, cost)
    return frames


def _local_subscribed(node: NodeCore, replica: _Replica) -> tuple[ConnectionCore, str]:
    conn = node.connection_made(local=True)
    node.frames_received(conn, [copy_frame({"t": "hello", "v": PROTOCOL_VERSION, "client": "t"})])
    node.frames_received(
        conn, [copy_frame({"t": "subscribe", "id": 1, "queue": "q", "prefetch": 9})]
    )
    replica.answer(len(replica.proposed) - 1)
    (subscribe,) = replica.commands(Subscribe)
    _taken(conn)  # welcome, hello's reply, subscribe's reply
    return conn, subscribe.consumer


def _deliver(consumer: str, offset: int, body: bytes, headers: dict[str, str] | None) -> Deliver:
    return Deliver("q", consumer, "A", offset, None, body, headers, False, 0)


def test_a_local_client_is_handed_copies_that_share_nothing_with_the_replica() -> None:
    """A delivery's headers are the machine's own map: a local client changing what it
    was handed must not change the replica."""
    node, replica = _local_node()
    conn, consumer = _local_subscribed(node, replica)
    headers = {"trace": "t-1"}
    node.effects_applied(5, [_deliver(consumer, 0, b"m", headers)])
    (frame,) = _taken(conn)
    assert frame["t"] == "deliver" and frame["headers"] == headers
    frame["headers"]["trace"] = "changed by the client"
    assert headers == {"trace": "t-1"}


def test_a_local_client_needs_no_token_and_may_use_administrative_verbs() -> None:
    """In-process clients are trusted (the code that made them could read the node's
    data); a client over TCP still proves the token."""
    node, _ = _local_node(token="secret-token", insecure=False)
    local = node.connection_made(local=True)
    (welcome,) = _taken(local)
    assert welcome["auth"] is False
    node.frames_received(local, [copy_frame({"t": "hello", "v": PROTOCOL_VERSION, "client": "t"})])
    assert local.greeted and local.admin and not local.done
    remote = node.connection_made()
    node.data_received(remote, encode_frame({"t": "hello", "v": PROTOCOL_VERSION, "client": "t"}))
    assert not remote.greeted and remote.done and remote.close_reason == "authentication failed"


def test_a_local_client_that_takes_nothing_is_cut_off_as_a_slow_consumer_as_over_tcp() -> None:
    """The outbox bounds hold for a local client as for one over TCP (counted in sizes
    no smaller than the encoding's): a client that stops taking its deliveries is cut
    off, no later than one over TCP, and memory stays bounded."""
    node, replica = _local_node(outbound_bytes=5 * 1024 * 1024, max_body=256 * 1024)
    local, local_consumer = _local_subscribed(node, replica)
    remote = node.connection_made()
    _send(node, remote, {"t": "hello", "v": PROTOCOL_VERSION, "client": "t"})
    _send(node, remote, {"t": "subscribe", "id": 1, "queue": "q", "prefetch": 9})
    replica.answer(len(replica.proposed) - 1)
    remote_consumer = replica.commands(Subscribe)[-1].consumer
    body = b"x" * 100_000
    pushed = {}
    for conn, consumer in ((local, local_consumer), (remote, remote_consumer)):
        for offset in range(1000):
            node.effects_applied(offset + 10, [_deliver(consumer, offset, body, {"k": "v"})])
            if conn.done:
                break
        pushed[conn.local] = offset
        assert conn.closing and conn.close_reason.startswith("slow consumer")
        assert conn.queued_bytes <= 5 * 1024 * 1024
    assert pushed[True] <= pushed[False] <= pushed[True] + 1


def test_a_full_local_connection_handles_no_more_requests_until_there_is_room() -> None:
    """Back-pressure as over TCP: past a quarter of the outbound bound, the frames a
    local client handed over wait in its queue (and the shell hands no more)."""
    node, replica = _local_node(outbound_bytes=5 * 1024 * 1024, max_body=256 * 1024)
    conn, consumer = _local_subscribed(node, replica)
    for offset in range(14):  # 1.4 MB waits: more than a quarter of 5 MiB
        node.effects_applied(offset + 10, [_deliver(consumer, offset, b"x" * 100_000, None)])
    assert conn.full and not conn.wants_data
    declares = [
        copy_frame({"t": "declare", "id": 9 + i, "queue": "d", "options": {}}) for i in range(3)
    ]
    node.frames_received(conn, declares)  # (the shell hands none while it is full)
    assert len(conn.decoder) == 2 and len(replica.commands(Declare)) == 1  # as bytes read
    _, count, cost = conn.take_output(1 << 30)
    node.sent(conn, count, cost)  # the client took them: room again
    assert len(conn.decoder) == 0 and len(replica.commands(Declare)) == 3


def test_frames_from_a_local_client_are_checked_as_decoded_ones() -> None:
    """Nothing reaches the core from a local client that the wire would have refused: a
    frame with a mistyped field is answered with an error, and one larger than the frame
    limit (before hello, 4 KiB) ends the connection."""
    node, _ = _local_node()
    conn = node.connection_made(local=True)
    node.frames_received(conn, [copy_frame({"t": "hello", "v": PROTOCOL_VERSION, "client": "t"})])
    node.frames_received(conn, [copy_frame({"t": "declare", "id": 3, "queue": 7, "options": {}})])
    *_, error = _taken(conn)
    assert (error["t"], error["id"], error["code"]) == ("error", 3, "bad_frame")
    assert not conn.done
    early = node.connection_made(local=True)
    node.frames_received(early, [copy_frame({"t": "hello", "v": 1, "client": "x" * 5000})])
    assert early.closing and "exceeds the limit" in early.close_reason
