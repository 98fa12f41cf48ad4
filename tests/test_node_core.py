"""The node core on its own: frames in, proposals out, with a replica that records what
is proposed and answers when the test says (the simulator runs the same core in whole
clusters)."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest

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
    ends_moved,
)
from quorumq.node import ConnectionCore, NodeConfig, NodeCore
from quorumq.node.deliveries import SENT_RECORD_MIN
from quorumq.replica import ReplicaConfig
from quorumq.wire.protocol import PROTOCOL_VERSION, copy_frame, encode_frame


class _Replica:
    """Records proposals; `answer(i)` answers the i-th with OK."""

    node_id = "A"

    def __init__(self) -> None:
        self.proposed: list[tuple[Command, Callable[..., None] | None]] = []
        self.watched: frozenset[str] = frozenset()
        self.moved: set[str] = set()
        self.calls: list[str] = []
        """"watch" and "query", in order."""

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

    def watch_ends(self, queues: frozenset[str]) -> None:
        self.calls.append("watch")
        self.watched = queues

    def take_ends_moved(self) -> set[str]:
        moved, self.moved = self.moved, set()
        return moved


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
    from quorumq.node.settling import ACKS_HELD_MAX, ACKS_HELD_S

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
    from quorumq.node.services import RETRY_EVERY_S
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
    from quorumq.wire.protocol import FrameDecoder

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
        """Apply `command`, noting the watched queues whose end it moved, as `Replica`."""
        applied = self.machine.apply(Meta(self.machine.last_index + 1, 0), command)
        self.moved |= ends_moved(command, applied) & self.watched
        return applied

    def query(self, read: Callable[[Any], Any]) -> Any:
        self.calls.append("query")
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


# ------------------------------------------------------------ reads that wait


def _reader(node: NodeCore) -> ConnectionCore:
    conn = node.connection_made()
    _send(node, conn, {"t": "hello", "v": PROTOCOL_VERSION, "client": "t"})
    _frames(conn)  # welcome, hello's reply
    return conn


def _read(request_id: int, queue: str, start: int, end: int, wait_ms: int) -> dict[str, Any]:
    return {
        "t": "read",
        "id": request_id,
        "queue": queue,
        "start": start,
        "end": end,
        "bucket": None,
        "buckets": None,
        "wait_ms": wait_ms,
    }


def _publish(replica: _MachineReplica, queue: str, count: int) -> None:
    replica.apply(EnqueueBatch(queue=queue, messages=[Message(body=b"m")] * count))


def _reads_node(clock: Callable[[], float], *queues: str) -> tuple[NodeCore, _MachineReplica]:
    replica = _MachineReplica()
    for queue in queues:
        replica.apply(Declare(queue=queue))
    node, _ = _node(clock, replica)
    return node, replica


def test_a_waiting_read_is_answered_when_the_replica_applies_its_range_and_not_before() -> None:
    """The replica says when an entry moves the end of a queue reads wait on; the node
    answers then, with no timer of the read's own (it polled, backing off to 20 ms)."""
    node, replica = _reads_node(lambda: 0.0, "q")
    conn = _reader(node)
    _send(node, conn, _read(7, "q", 0, 2, wait_ms=5000))
    assert _frames(conn) == [] and replica.watched == {"q"}
    assert node.next_timer() == 1.0  # the lost consumers' sweep: no poll
    _publish(replica, "q", 1)
    node.ends_moved()
    assert _frames(conn) == []  # one of two
    _publish(replica, "q", 1)
    node.ends_moved()
    (reply,) = _frames(conn)
    assert reply["id"] == 7 and [m[0] for m in reply["messages"]] == [0, 1]
    assert len(node.reads) == 0


def test_a_read_whose_range_is_applied_is_answered_at_once_watched_before_its_end_is_read() -> None:
    """The node watches a queue before it reads the queue's end: an entry applied in
    between is then seen by one or the other, never by neither."""
    node, replica = _reads_node(lambda: 0.0, "q")
    _publish(replica, "q", 3)
    conn = _reader(node)
    replica.calls.clear()
    _send(node, conn, _read(1, "q", 0, 3, wait_ms=5000))
    (reply,) = _frames(conn)
    assert len(reply["messages"]) == 3
    assert replica.calls[:2] == ["watch", "query"]


def test_a_waiting_read_past_its_deadline_is_answered_lagging_once() -> None:
    clock = _Clock()
    node, replica = _reads_node(clock, "q")
    conn = _reader(node)
    _send(node, conn, _read(3, "q", 0, 5, wait_ms=200))
    _send(node, conn, _read(4, "nowhere", 0, 1, wait_ms=300))
    assert node.next_timer() == 0.2
    clock.now = 0.19
    node.run_timers()
    assert _frames(conn) == []
    _publish(replica, "q", 2)
    clock.now = 0.2
    node.run_timers()
    (lagging,) = _frames(conn)
    assert (lagging["id"], lagging["code"]) == (3, "lagging")
    assert "has applied 'q' up to offset 2, short of 5 after waiting 200 ms" in lagging["message"]
    assert node.next_timer() == 0.3
    clock.now = 0.3
    node.run_timers()
    (unknown,) = _frames(conn)
    assert unknown["id"] == 4 and "does not know queue 'nowhere'" in unknown["message"]
    _publish(replica, "q", 5)
    node.ends_moved()
    assert _frames(conn) == [] and node.next_timer() == 1.0 and len(node.reads) == 0


def test_a_read_whose_range_is_applied_as_its_time_runs_out_is_answered_with_it() -> None:
    """A replica that never says (or says late) costs a read its wait, not its answer."""
    clock = _Clock()
    node, replica = _reads_node(clock, "q")
    conn = _reader(node)
    _send(node, conn, _read(3, "q", 0, 1, wait_ms=100))
    _publish(replica, "q", 1)  # ends_moved not called
    clock.now = 0.1
    node.run_timers()
    (reply,) = _frames(conn)
    assert reply["t"] == "reply" and len(reply["messages"]) == 1


def test_reads_past_the_nodes_bound_are_refused_with_a_reason() -> None:
    """128 connections at their bound of 64 fill the node's; one more read is refused
    (`node_reads_full`, ask another node), and room comes back as reads are answered."""
    from quorumq.node.reading import MAX_WAITING_READS, MAX_WAITING_READS_PER_NODE

    node, replica = _reads_node(lambda: 0.0, "q", "idle")
    conns = [_reader(node) for _ in range(MAX_WAITING_READS_PER_NODE // MAX_WAITING_READS)]
    for conn in conns:
        for i in range(MAX_WAITING_READS):
            _send(node, conn, _read(i, "idle", 0, 1, wait_ms=30_000))
    _send(node, conns[0], _read(99, "q", 0, 1, wait_ms=30_000))
    (per_connection,) = _frames(conns[0])
    assert per_connection["code"] == "too_many_reads"
    late = _reader(node)
    _send(node, late, _read(5, "q", 0, 1, wait_ms=30_000))
    (refused,) = _frames(late)
    assert (refused["t"], refused["id"], refused["code"]) == ("error", 5, "node_reads_full")
    assert f"{MAX_WAITING_READS_PER_NODE} waiting reads" in refused["message"]
    assert "ask another node" in refused["message"]
    _publish(replica, "q", 1)
    _send(node, late, _read(6, "q", 0, 1, wait_ms=30_000))  # applied: answered, not held
    assert _frames(late)[0]["t"] == "reply"
    node.connection_lost(conns[0])
    _send(node, late, _read(7, "q", 0, 2, wait_ms=30_000))
    assert _frames(late) == [] and len(node.reads) == MAX_WAITING_READS_PER_NODE - 63


def test_a_closed_connections_waiting_reads_leave_every_index() -> None:
    from quorumq.node.reading import MAX_WAITING_READS

    node, replica = _reads_node(lambda: 0.0, "q", "p")
    gone, stays = _reader(node), _reader(node)
    for i in range(MAX_WAITING_READS):
        _send(node, gone, _read(i, "q", 0, 1 + i, wait_ms=1000 + i))
    _send(node, stays, _read(1, "p", 0, 1, wait_ms=1000))
    node.connection_lost(gone)
    assert node.reads.waiting(gone) == 0 and node.reads.queues() == {"p"}
    assert node.reads.held() <= 3  # the read that stays, in each index
    _publish(replica, "q", 100)
    node.ends_moved()
    assert gone.take_output(1 << 20)[1] == 0  # nothing for it
    assert replica.watched == {"p"}  # the queue no read waits on is watched no more
    node.connection_lost(stays)
    assert len(node.reads) == 0 and node.reads.held() == 0
    assert node.next_timer() == 1.0


def test_reads_applied_while_their_connection_is_full_are_answered_once_it_has_room() -> None:
    """Up to 64 replies of 768 KiB could come due at once: they wait for room, still
    counted against the bounds, and go before the requests that wait."""
    node, replica = _reads_node(lambda: 0.0, "q")
    conn = _reader(node)
    _send(node, conn, _read(1, "q", 0, 2, wait_ms=5000))
    _publish(replica, "q", 2)
    conn.push({"t": "filler", "body": b"x" * conn.pause_bytes})
    assert conn.full
    node.ends_moved()
    assert len(node.reads) == 1 and node.reads.waiting(conn) == 1
    _, count, cost = conn.take_output(1 << 30)
    assert count == 1  # the filler alone
    node.sent(conn, count, cost)  # written: room
    (reply,) = _frames(conn)
    assert reply["id"] == 1 and len(reply["messages"]) == 2 and len(node.reads) == 0


def _work_of_one_apply(unrelated: int) -> tuple[int, int]:
    """Heap steps and replica queries of an apply that answers one read, while
    `unrelated` others wait: on an idle queue, and on the same queue further on."""
    from quorumq.node.reading import MAX_WAITING_READS

    node, replica = _reads_node(lambda: 0.0, "q", "idle")
    waiting = 0
    while waiting < unrelated:
        conn = _reader(node)
        for i in range(min(MAX_WAITING_READS, unrelated - waiting)):
            queue, end = ("idle", 1 + i) if i % 2 else ("q", 10**6 + i)
            _send(node, conn, _read(i, queue, 0, end, wait_ms=30_000))
        waiting += MAX_WAITING_READS
    wanted = _reader(node)
    _send(node, wanted, _read(1, "q", 0, 1, wait_ms=30_000))
    steps, queries = node.reads.steps, replica.calls.count("query")
    _publish(replica, "q", 1)
    node.ends_moved()
    assert _frames(wanted)[0]["id"] == 1
    return node.reads.steps - steps, replica.calls.count("query") - queries


def test_the_work_of_an_apply_does_not_grow_with_the_reads_that_still_wait() -> None:
    """Each read polled on a timer of its own and was looked for in a list of all of
    them: 100 connections with 64 waiting reads each took a leader's publish p50 from
    3.4 to 310 ms. Counted, not timed."""
    assert _work_of_one_apply(100) == _work_of_one_apply(8000)


def test_a_snapshot_install_that_covers_a_waiting_read_answers_it() -> None:
    """An install moves ends with no entry applied here (so the replica says nothing)."""
    node, replica = _reads_node(lambda: 0.0, "q")
    conn = _reader(node)
    _send(node, conn, _read(2, "q", 0, 3, wait_ms=5000))
    leader = Machine()
    leader.apply(Meta(1, 0), Declare(queue="q"))
    leader.apply(Meta(2, 0), EnqueueBatch(queue="q", messages=[Message(body=b"m")] * 3))
    replica.machine = Machine.restore(leader.snapshot())
    node.state_replaced()
    (reply,) = _frames(conn)
    assert reply["id"] == 2 and len(reply["messages"]) == 3


def test_a_publish_a_disk_alarm_refuses_is_answered_without_a_log_entry() -> None:
    """Refused in the log, every retry of a publish during a disk alarm was a journal
    entry carrying its body, on every node, on the disk the alarm is for (clients retry
    a refused resend every second). The node answers `disk_alarm` itself now; a resend
    of what landed is still proposed (answered as a duplicate), and once the alarm
    clears publishes are proposed again."""
    from quorumq.machine import DiskAlarm, Enqueue

    node, replica = _node_on_a_machine("q")
    conn = node.connection_made()
    _send(node, conn, {"t": "hello", "v": PROTOCOL_VERSION, "client": "t"})
    landed = Enqueue(queue="q", body=b"m0", producer="p", seq=0)
    replica.apply(landed)
    replica.apply(DiskAlarm(node="B", raised=True))
    node.disk_free(1 << 40)  # the measure that sees the alarm in the log
    before = len(replica.proposed)

    def publish(request_id: int, seq: int) -> dict[str, Any]:
        frame = {"t": "publish", "id": request_id, "queue": "q", "body": b"m%d" % seq}
        return {**frame, "key": None, "headers": None, "producer": "p", "seq": seq}

    _send(node, conn, publish(1, 1))
    _send(node, conn, {**publish(2, 0), "retry": True})  # landed already
    proposed = [c for c, _ in replica.proposed[before:]]
    assert [(c.seq, type(c).__name__) for c in proposed] == [(0, "Enqueue")]
    (refused,) = [f for f in _frames(conn) if f.get("id") == 1]
    assert refused["t"] == "error" and refused["code"] == "disk_alarm"
    replica.apply(DiskAlarm(node="B", raised=False))
    _send(node, conn, publish(3, 1))
    assert [c.seq for c, _ in replica.proposed[before:]] == [0, 1]
