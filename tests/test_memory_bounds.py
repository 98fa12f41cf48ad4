"""What a node and its machine keep stays bounded however many producers come and go
and however many consumers subscribe and cancel (issue 13, item 8)."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

import quorumq.aio
from quorumq.machine import (
    Declare,
    Enqueue,
    Enqueued,
    Error,
    ForgetProducers,
    Machine,
    Meta,
    Subscribe,
    Tick,
)
from quorumq.machine.machine import EVICT_SILENT_MS, MAX_PRODUCERS, PRODUCER_EXPIRY_MS
from quorumq.server import NodeServer

from .test_server import _config, _serve_with


def _enqueue(producer: str, seq: int = 0) -> Enqueue:
    return Enqueue(queue="q", body=b"x", producer=producer, seq=seq)


def test_a_queue_remembers_a_bounded_number_of_producers() -> None:
    """100,000 short-lived producers, one a second: every one was kept for 7 days before.
    Room is made by forgetting producers silent for an hour; a forgotten one's resend is
    refused, never enqueued again (client ids carry a generation: their creation time)."""
    m = Machine()
    m.apply(Meta(1, 0), Declare(queue="q"))
    for i in range(100_000):
        reply = m.apply(Meta(i + 2, i * 1000), _enqueue(f"g{i * 1000 + 1:x}-c")).reply
        assert isinstance(reply, Enqueued) and not reply.duplicate
    assert len(m.producers("q")) <= MAX_PRODUCERS
    now = 100_000 * 1000
    recent = m.apply(Meta(10**6, now), _enqueue(f"g{99_999_001:x}-c")).reply
    assert isinstance(recent, Enqueued) and recent.duplicate
    forgotten = m.apply(Meta(10**6 + 1, now), _enqueue("g1-c")).reply  # its resend, say
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
    m.apply(Meta(1, 0), Declare(queue="q"))
    m.apply(Meta(2, 0), _enqueue("g10-a"))
    m.apply(Meta(3, 0), _enqueue("g20-b"))
    m.apply(Meta(4, 0), ForgetProducers(queue="q", prefix="g20-"))
    reply = m.apply(Meta(5, 0), _enqueue("g20-b")).reply
    assert isinstance(reply, Error) and reply.code == "producer_forgotten"
    m.apply(Meta(6, PRODUCER_EXPIRY_MS + 1), Tick())  # g10-a: 7 days silent
    reply = m.apply(Meta(7, PRODUCER_EXPIRY_MS + 2), _enqueue("g10-a")).reply
    assert isinstance(reply, Error) and reply.code == "producer_forgotten"
    fresh = m.apply(Meta(8, PRODUCER_EXPIRY_MS + 3), _enqueue("g21-new")).reply
    assert isinstance(fresh, Enqueued) and fresh.offset == 2
    restored = Machine.restore(m.snapshot())  # every replica knows it, restored too
    assert isinstance(restored.apply(Meta(9, 0), _enqueue("g15-x")).reply, Error)


def test_time_moves_while_producers_are_remembered_so_they_can_expire() -> None:
    m = Machine()
    m.apply(Meta(1, 0), Declare(queue="q"))
    assert not m.needs_tick()
    m.apply(Meta(2, 0), Enqueue(queue="q", body=b"x", producer="p", seq=0))
    assert m.needs_tick()  # no TTL queue: before, Tick was never proposed here


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
                for _ in range(100):  # swept every second: 5 s at most
                    if not server.consumers:
                        break
                    await trio.sleep(0.05)
                (conn,) = server.connections
                assert conn.consumers == {} and conn.prefetches == {}
                assert conn.prefetch_allowance == 0 and not conn.cancelling
                assert len(server._downed) == 0

    _serve_with(server, body)


def test_reads_waiting_to_be_applied_are_bounded_per_connection(tmp_path: Path) -> None:
    """Each read with `wait_ms` was a task waiting up to 30 s, with no bound."""
    from quorumq.client import ServerError
    from quorumq.server.connection import MAX_WAITING_READS

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
