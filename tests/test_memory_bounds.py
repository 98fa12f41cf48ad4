"""What a node and its machine keep stays bounded however many producers come and go
and however many consumers subscribe and cancel (issue 13, item 8)."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

import quorumq.aio
from quorumq.machine import Declare, Enqueue, Machine, Meta, Subscribe
from quorumq.machine.machine import MAX_PRODUCERS
from quorumq.server import NodeServer

from .test_server import _config, _serve_with


def test_a_queue_remembers_a_bounded_number_of_producers() -> None:
    """100,000 short-lived producers: every one was kept for 7 days before."""
    m = Machine()
    m.apply(Meta(1, 0), Declare(queue="q"))
    for i in range(100_000):
        m.apply(Meta(i + 2, i), Enqueue(queue="q", body=b"x", producer=f"p{i}", seq=0))
    assert len(m.producers("q")) <= MAX_PRODUCERS
    recent = Enqueue(queue="q", body=b"x", producer="p99999", seq=0)
    assert m.apply(Meta(10**6, 10**6), recent).reply.duplicate  # type: ignore[union-attr]
    forgotten = Enqueue(queue="q", body=b"x", producer="p0", seq=1)  # a resend, say
    assert m.apply(Meta(10**6 + 1, 10**6), forgotten).reply.code == "out_of_order"  # type: ignore[union-attr]


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
