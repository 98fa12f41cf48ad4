"""What a node and its machine keep stays bounded however many producers come and go
and however many consumers subscribe and cancel (issue 13, item 8)."""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

import quorumq.aio
from quorumq.machine import (
    Command,
    Declare,
    Enqueue,
    EnqueueBatch,
    Enqueued,
    Error,
    ForgetProducers,
    Machine,
    Message,
    Meta,
    QueueOptions,
    Subscribe,
    Tick,
)
from quorumq.machine.machine import (
    EVICT_SILENT_MS,
    IDLE_TICK_MS,
    MAX_PRODUCERS,
    PRODUCER_EXPIRY_MS,
)
from quorumq.node import ConnectionCore
from quorumq.server import NodeServer
from quorumq.wire.protocol import PROTOCOL_VERSION, Frame, FrameDecoder, encode_frame

from .test_server import _config, _serve_with
from .test_server_bounds import _wait_for


def _enqueue(producer: str, seq: int = 0) -> Enqueue:
    return Enqueue(queue="q", body=b"x", producer=producer, seq=seq)


def _gid(generation: int, n: int = 0) -> str:
    """A client producer id of `generation` (its wall clock in ms when made)."""
    return f"g{generation:x}-{n:032x}"


def test_a_queue_remembers_a_bounded_number_of_producers() -> None:
    """100,000 short-lived producers, one a second: every one was kept for 7 days before.
    Room is made by forgetting producers silent for an hour; a forgotten one's resend is
    refused, never enqueued again (client ids carry a generation: their creation time)."""
    m = Machine()
    m.apply(Meta(1, 0), Declare(queue="q"))
    for i in range(100_000):
        reply = m.apply(Meta(i + 2, i * 1000), _enqueue(_gid(i * 1000 + 1))).reply
        assert isinstance(reply, Enqueued) and not reply.duplicate
    assert len(m.producers("q")) <= MAX_PRODUCERS
    now = 100_000 * 1000
    recent = m.apply(Meta(10**6, now), _enqueue(_gid(99_999_001))).reply
    assert isinstance(recent, Enqueued) and recent.duplicate
    forgotten = m.apply(Meta(10**6 + 1, now), _enqueue(_gid(1))).reply  # its resend, say
    assert isinstance(forgotten, Error) and forgotten.code == "producer_forgotten"
    assert forgotten.generation is not None and forgotten.generation >= 0


def test_producers_active_within_the_hour_are_never_forgotten_to_make_room() -> None:
    """With every producer active, a new one is refused: before, the least recently active
    tenth was forgotten at once, a producer seconds old among them, and its client's
    resend of a first publish whose reply was lost was enqueued a second time."""
    m = Machine()
    m.apply(Meta(1, 0), Declare(queue="q"))
    for i in range(MAX_PRODUCERS):
        m.apply(Meta(i + 2, 1000), _enqueue(f"p{i}"))
    refused = m.apply(Meta(10**6, 2000), _enqueue("newcomer")).reply
    assert isinstance(refused, Error) and refused.code == "too_many_producers"
    again = m.apply(Meta(10**6 + 1, 2000), _enqueue("p0")).reply  # the resend of p0's first
    assert isinstance(again, Enqueued) and again.duplicate
    later = 1000 + EVICT_SILENT_MS
    assert isinstance(m.apply(Meta(10**6 + 2, later), _enqueue("newcomer")).reply, Enqueued)


def test_a_forgotten_producers_resend_is_refused_not_enqueued_twice() -> None:
    """Forgotten by expiry (7 days silent) or by `forget_producers`, a producer's resend
    of seq 0 was taken for a new producer's first publish: a second offset."""
    m = Machine()
    day = 86_400_000
    m.apply(Meta(1, day), Declare(queue="q"))
    m.apply(Meta(2, day), _enqueue(_gid(day - 20, 1)))
    m.apply(Meta(3, day), _enqueue(_gid(day - 10, 2)))
    m.apply(Meta(4, day), ForgetProducers(queue="q", prefix=_gid(day - 10, 2)))
    reply = m.apply(Meta(5, day), _enqueue(_gid(day - 10, 2))).reply
    assert isinstance(reply, Error) and reply.code == "producer_forgotten"
    assert reply.generation == day - 10
    later = day + PRODUCER_EXPIRY_MS + 1
    m.apply(Meta(6, later), Tick())  # the first: 7 days silent
    reply = m.apply(Meta(7, later), _enqueue(_gid(day - 20, 1))).reply
    assert isinstance(reply, Error) and reply.code == "producer_forgotten"
    fresh = m.apply(Meta(8, later), _enqueue(_gid(later, 3))).reply
    assert isinstance(fresh, Enqueued) and fresh.offset == 2
    restored = Machine.restore(m.snapshot())  # every replica knows it, restored too
    assert isinstance(restored.apply(Meta(9, later), _enqueue(_gid(day - 15, 4))).reply, Error)


def test_no_producer_id_can_move_the_forgotten_generation_past_the_queues_time() -> None:
    """A client without the admin token published under `gffffffffffffffff-...` and had
    it forgotten (its own prefix is long enough): the mark went to 2**64 - 1, and every
    client's first publish to the queue was refused for good. The mark stops at the
    queue's time; ids not of the client's exact form carry no generation (a caller's
    own `gc-nightly` was read as generation 12, `g0-loader` refused on a new queue)."""
    m = Machine()
    now = 1_800_000_000_000
    m.apply(Meta(1, now), Declare(queue="q"))
    poison = _gid(2**64 - 1, 7)
    m.apply(Meta(2, now), _enqueue(poison))
    m.apply(Meta(3, now), ForgetProducers(queue="q", prefix=poison))
    honest = m.apply(Meta(4, now + 5), _enqueue(_gid(now + 1, 8))).reply
    assert isinstance(honest, Enqueued)
    slow = m.apply(Meta(5, now + 5), _enqueue(_gid(now - 1, 9))).reply
    assert isinstance(slow, Error) and slow.generation == now
    for index, own in enumerate(("gc-nightly", "g0-loader", "gbad-idea", f"g0-{0:032x}"), 6):
        assert isinstance(m.apply(Meta(index, now + 5), _enqueue(own)).reply, Enqueued), own


def test_time_moves_while_producers_are_remembered_so_they_can_expire() -> None:
    m = Machine()
    assert m.tick_due_ms() is None  # nothing needs time
    m.apply(Meta(1, 0), Declare(queue="q"))
    assert m.tick_due_ms() == IDLE_TICK_MS  # a minute after the last command at most
    m.apply(Meta(2, 0), Enqueue(queue="q", body=b"x", producer="p", seq=0))
    assert m.needs_tick()  # no TTL queue: before, Tick was never proposed here
    # ... but not one a second for the week it is remembered: a minute on, still
    assert m.tick_due_ms() == IDLE_TICK_MS < PRODUCER_EXPIRY_MS
    m.apply(Meta(3, 10), Declare(queue="ttl", options=QueueOptions(message_ttl_ms=60_000)))
    assert m.tick_due_ms() == 10  # a TTL queue: time must move now (a Tick a second)


def test_a_prefetch_over_65535_is_refused() -> None:
    with pytest.raises(ValueError, match="at most 65535"):
        Subscribe(queue="q", consumer="c", node="A", prefetch=10**9)


def test_a_node_keeps_no_record_of_cancelled_consumers(tmp_path: Path) -> None:
    """Cancelled consumers stayed in the node's and the connection's records, and their
    prefetch in the connection's allowance, until the connection closed."""
    server = NodeServer(_config(tmp_path))

    async def body(endpoint: str) -> None:
        async with quorumq.aio.connect(endpoint) as client:
            with trio.fail_after(120):
                await client.declare("q")
                for _ in range(300):
                    consumer = await client.subscribe("q", prefetch=1000)
                    await consumer.cancel()
                with trio.move_on_after(5):  # swept every second
                    for _ in range(100):
                        if not server.consumers:
                            break
                        await trio.sleep(0.05)
                assert not server.consumers, f"{len(server.consumers)} records kept"
                (conn,) = server.connections
                assert conn.consumers == {} and conn.prefetches == {}
                assert conn.prefetch_allowance == 0 and not conn.cancelling
                assert len(server.core.serving._downed) == 0

    _serve_with(server, body)


def test_reads_waiting_to_be_applied_are_bounded_per_connection(tmp_path: Path) -> None:
    """Each read with `wait_ms` was a task waiting up to 30 s, with no bound."""
    from quorumq.client import ServerError
    from quorumq.node.reading import MAX_WAITING_READS

    async def body(endpoint: str) -> None:
        async with quorumq.aio.connect(endpoint) as client:
            await client.declare("q")
            refused: list[ServerError] = []

            async def read_ahead() -> None:
                try:
                    await client.read("q", 0, 10, wait=1.0)  # nothing there: waits
                except ServerError as e:
                    refused.append(e)

            with trio.fail_after(20):
                async with trio.open_nursery() as nursery:
                    for _ in range(MAX_WAITING_READS + 10):
                        nursery.start_soon(read_ahead)
            codes = sorted(e.code for e in refused)
            assert codes.count("too_many_reads") == 10
            assert codes.count("lagging") == MAX_WAITING_READS

    _serve_with(NodeServer(_config(tmp_path)), body)


# ---------------------------------------------------- what one client makes a node hold


def _waiting_bytes(conn: ConnectionCore) -> int:
    """Encoded bytes the node holds for `conn`, waiting to be sent (trio's channel)."""
    return sum(len(data) for data in conn.outbox)


async def _raw_client(endpoint: str) -> tuple[trio.SocketStream, FrameDecoder]:
    """A client that says hello, then reads only when the test says so (a receive
    buffer of 4 KiB, so the kernel does not read for it either)."""
    host, port = endpoint.rsplit(":", 1)
    sock = trio.socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    await sock.connect((host, int(port)))
    stream = trio.SocketStream(sock)
    decoder = FrameDecoder()
    await _until_frame(stream, decoder, lambda f: f["t"] == "welcome")
    hello = {"t": "hello", "v": PROTOCOL_VERSION, "client": "raw", "proof": None}
    await stream.send_all(encode_frame(hello))
    await _until_frame(stream, decoder, lambda f: f.get("id") == 0)
    return stream, decoder


async def _until_frame(
    stream: trio.SocketStream, decoder: FrameDecoder, wanted: Callable[[Frame], bool]
) -> list[Frame]:
    """Read frames until one is `wanted`; all of them, that one last."""
    frames: list[Frame] = []
    with trio.fail_after(10):
        while True:
            for frame in decoder.frames():
                frames.append(frame)
                if wanted(frame):
                    return frames
            decoder.feed(await stream.receive_some(65536))


async def _submit(server: NodeServer, command: Command) -> None:
    await trio.to_thread.run_sync(server.replica.submit, command)


def _small_node(tmp_path: Path, **options: int) -> NodeServer:
    """A node whose limits are small enough for the attacks to cross them quickly."""
    return NodeServer(attrs.evolve(_config(tmp_path), max_body=64 * 1024, **options))


def test_a_consumer_that_does_not_read_is_cut_off_by_bytes_whatever_its_prefetch(
    tmp_path: Path,
) -> None:
    """The cut-off counted frames (20,000 plus the sum of the prefetches), so ten
    subscriptions at prefetch 65,535 turned it off: everything published was queued
    for a client that read nothing."""
    budget = 4 * 1024 * 1024
    server = _small_node(tmp_path, outbound_bytes=budget)

    async def body(endpoint: str) -> None:
        async with quorumq.aio.connect(endpoint) as publisher:
            await publisher.declare("q")
            stream, decoder = await _raw_client(endpoint)
            async with stream:
                for i in range(1, 11):
                    subscribe = {"t": "subscribe", "id": i, "queue": "q", "prefetch": 65535}
                    await stream.send_all(encode_frame(subscribe))
                    await _until_frame(stream, decoder, lambda f, i=i: f.get("id") == i)
                (conn,) = [c for c in server.connections if c.consumers]
                peak = 0

                async def watch() -> None:
                    nonlocal peak
                    while not conn.closed and peak <= budget:
                        peak = max(peak, _waiting_bytes(conn))
                        await trio.sleep(0.002)
                    peak = max(peak, _waiting_bytes(conn))

                with trio.fail_after(60):
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(watch)
                        rows = [Message(body=b"x" * (60 * 1024))] * 15
                        for _ in range(20):  # 18 MB, a few of it within kernel buffers
                            if conn.closed or peak > budget:
                                break
                            await _submit(server, EnqueueBatch(queue="q", messages=rows))
                assert peak <= budget, f"{peak} bytes waited for a client that reads nothing"
                assert conn.close_reason.startswith("slow consumer"), conn.close_reason
                # its consumers are down: their messages return to the queue
                await _wait_for(lambda: not server.consumers, 10, "its consumers down")

    _serve_with(server, body)


def test_pipelined_reads_wait_in_the_client_not_in_the_node(tmp_path: Path) -> None:
    """A client that pipelined `read`s and never read its socket made the node queue
    every reply (20,000 x 768 KiB = 15 GiB). Now the node stops reading its requests
    while a quarter of the byte budget waits, and answers the rest as it reads."""
    budget = 4 * 1024 * 1024
    server = _small_node(tmp_path, outbound_bytes=budget)
    reads = 50  # 38 MB of replies at once before

    async def body(endpoint: str) -> None:
        async with quorumq.aio.connect(endpoint) as publisher:
            await publisher.declare("q")
            rows = [Message(body=b"r" * (14 * 1024))] * 60  # 840 KB
            await _submit(server, EnqueueBatch(queue="q", messages=rows))
            stream, decoder = await _raw_client(endpoint)
            async with stream:
                (conn,) = [
                    c
                    for c in server.connections
                    if c.number == max(c.number for c in server.connections)
                ]
                frames = b"".join(
                    encode_frame(
                        {
                            "t": "read",
                            "id": i,
                            "queue": "q",
                            "start": 0,
                            "end": 60,
                            "bucket": None,
                            "buckets": None,
                        }
                    )
                    for i in range(1, reads + 1)
                )
                await stream.send_all(frames)
                peak = waiting = 0
                with trio.move_on_after(1):  # the node answers what it can, then waits
                    while True:
                        waiting = _waiting_bytes(conn)
                        peak = max(peak, waiting)
                        await trio.sleep(0.002)
                assert peak <= budget // 2, f"{peak} bytes of replies nobody reads"
                assert len(conn.decoder._buffer) <= 256 * 1024 + 4096
                assert not conn.closed  # not a slow consumer: it is simply not read
                replies = await _until_frame(stream, decoder, lambda f: f.get("id") == reads)
                got = [f for f in replies if f["t"] == "reply"]
                assert [f["id"] for f in got] == list(range(1, reads + 1))  # none lost
                assert all(len(f["messages"]) > 50 for f in got)

    _serve_with(server, body)


def test_a_connection_has_a_bounded_number_of_consumers(tmp_path: Path) -> None:
    """Consumers per connection had no cap (each with up to 65,535 prefetch)."""
    from quorumq.client import ServerError

    server = _small_node(tmp_path, max_consumers=4)

    async def body(endpoint: str) -> None:
        async with quorumq.aio.connect(endpoint) as client:
            with trio.fail_after(20):
                await client.declare("q")
                consumers = [await client.subscribe("q", prefetch=10) for _ in range(4)]
                try:
                    await client.subscribe("q", prefetch=10)
                    raise AssertionError("a fifth consumer on one connection")
                except ServerError as e:
                    assert e.code == "too_many_consumers" and "at most" in e.message
                (conn,) = server.connections
                assert len(conn.consumers) == 4
                await consumers[0].cancel()  # it holds nothing: its place comes back
                while True:
                    try:
                        await client.subscribe("q", prefetch=10)
                        break
                    except ServerError as e:
                        assert e.code == "too_many_consumers"
                        await trio.sleep(0.1)

    _serve_with(server, body)


def test_pipelined_publishes_wait_in_the_client_while_the_cluster_commits(
    tmp_path: Path,
) -> None:
    """The node proposed every publish it read, however many were still waiting to be
    committed: a client that publishes faster than the cluster commits filled the
    node's Raft queue (it is capped at 100,000 entries of up to 1 MiB). Here nothing
    commits until the test lets it: the node stops reading the client's publishes once
    8 MiB of them wait, and takes the rest as they are answered."""
    server = _small_node(tmp_path)
    publishes = 400  # 60 KiB each: 24 MB

    async def body(endpoint: str) -> None:
        replica = server.replica
        real_propose = replica.propose
        held: list[tuple[Any, Any]] = []
        holding = True

        def propose(command: Any, callback: Any = None) -> None:
            if holding and isinstance(command, Enqueue | EnqueueBatch):
                held.append((command, callback))  # as if the cluster were slow to commit
            else:
                real_propose(command, callback)

        def held_bytes() -> int:
            return sum(
                len(c.body) if isinstance(c, Enqueue) else sum(len(m.body) for m in c.messages)
                for c, _ in held
            )

        replica.propose = propose  # type: ignore[method-assign]
        async with quorumq.aio.connect(endpoint) as setup:
            await setup.declare("q")
        stream, decoder = await _raw_client(endpoint)
        async with stream, trio.open_nursery() as nursery:
            frames = [
                encode_frame(
                    {
                        "t": "publish",
                        "id": i,
                        "queue": "q",
                        "body": b"p" * (60 * 1024),
                        "key": None,
                        "headers": None,
                        "producer": None,
                        "seq": None,
                    }
                )
                for i in range(1, publishes + 1)
            ]
            nursery.start_soon(stream.send_all, b"".join(frames))  # blocks when not read
            before, stable = -1, 0
            with trio.fail_after(20):
                while stable < 20:  # the node proposes no more: 0.2 s without a new one
                    stable = stable + 1 if len(held) == before else 0
                    before = len(held)
                    await trio.sleep(0.01)
            waiting = held_bytes()
            assert waiting <= 8 * 1024 * 1024 + 2 * 1024 * 1024, f"{waiting} bytes proposed"
            assert len(held) < publishes
            holding = False
            for command, callback in held:  # the cluster commits: the node reads on
                real_propose(command, callback)
            replies = await _until_frame(stream, decoder, lambda f: f.get("id") == publishes)
            assert sorted(f["id"] for f in replies if f["t"] == "reply") == list(
                range(1, publishes + 1)
            )
            assert replica.query(lambda m: m.stats("q").next_offset) == publishes

    _serve_with(server, body)


def test_a_client_that_goes_away_while_its_requests_wait_is_forgotten(tmp_path: Path) -> None:
    """While its requests wait for room the node does not read the connection; when the
    client goes away, the node must still notice, forget it and down its consumers."""
    server = _small_node(tmp_path, outbound_bytes=4 * 1024 * 1024)

    async def body(endpoint: str) -> None:
        await _submit(server, Declare(queue="q"))
        await _submit(server, EnqueueBatch(queue="q", messages=[Message(body=b"r" * 14336)] * 60))
        stream, decoder = await _raw_client(endpoint)
        subscribe = {"t": "subscribe", "id": 1, "queue": "q", "prefetch": 10}
        await stream.send_all(encode_frame(subscribe))
        await _until_frame(stream, decoder, lambda f: f.get("id") == 1)
        reads = b"".join(
            encode_frame(
                {"t": "read", "id": i, "queue": "q", "start": 0, "end": 60}
                | {"bucket": None, "buckets": None}
            )
            for i in range(2, 40)
        )
        await stream.send_all(reads)
        (conn,) = server.connections
        await _wait_for(lambda: _waiting_bytes(conn) > 0, 5, "replies waiting for the client")
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        await stream.aclose()  # a reset: the client is gone
        await _wait_for(lambda: not server.connections, 10, "the node forgets the connection")
        await _wait_for(lambda: not server.consumers, 10, "its consumer downed")

    _serve_with(server, body)
