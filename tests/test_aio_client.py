"""The trio client against a real cluster, with the blocking client's verbs."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import trio
from trio.testing import MockClock, wait_all_tasks_blocked

import quorumq.aio
from quorumq.client import QuorumqError, ServerError
from quorumq.client.aio import AsyncClient, AsyncConsumer
from quorumq.client.core import delivery_from
from quorumq.ops.local_cluster import Cluster
from quorumq.wire.protocol import FrameDecoder

from .helpers import wait_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster() -> Any:
    with Cluster(3, node_down_grace=30.0) as c:
        c.leader()
        yield c


def test_an_error_inside_the_block_comes_out_as_itself(cluster: Cluster) -> None:
    """trio's nursery wrapped every exception raised inside `async with connect()` in an
    `ExceptionGroup`, a `ServerError` of a request and the caller's own `ValueError`
    included, so `except ServerError` around the block missed them."""

    async def refused() -> None:
        async with quorumq.aio.connect(cluster.endpoints) as client:
            await client.declare("aio-mismatch", max_length=3)
            await client.declare("aio-mismatch", max_length=4)

    async def mine() -> None:
        async with quorumq.aio.connect(cluster.endpoints):
            raise ValueError("the caller's own")

    with pytest.raises(ServerError) as mismatch:
        trio.run(refused)
    assert mismatch.value.code == "options_mismatch"
    with pytest.raises(ValueError, match="the caller's own"):
        trio.run(mine)


def test_publish_subscribe_ack_read_and_status(cluster: Cluster) -> None:
    async def main() -> None:
        async with quorumq.aio.connect(cluster.endpoints) as client:
            assert await client.declare("aio") is True
            offsets = [await client.publish("aio", b"m%d" % i, key="k") for i in range(5)]
            assert offsets == [0, 1, 2, 3, 4]
            assert await client.publish_batch("aio", [b"x", (b"y", "k")]) == [5, 6]
            consumer = await client.subscribe("aio", prefetch=10)
            got = []
            with trio.fail_after(10):
                async for delivery in consumer:
                    got.append(delivery.offset)
                    await delivery.ack()
                    if len(got) == 7:
                        break
            assert got == list(range(7))
            read = await client.read("aio", 0, 100)
            assert [m.body for m in read][:2] == [b"m0", b"m1"]
            status = await client.status()
            assert status["queues"]["aio"]["next_offset"] == 7
            with pytest.raises(ServerError, match="unknown_queue"):
                await client.publish("nope", b"x")

    trio.run(main)


def test_concurrent_publishes_survive_a_leader_kill_without_duplicates(cluster: Cluster) -> None:
    leader = cluster.leader()

    async def main() -> list[int]:
        offsets: list[int] = []
        async with quorumq.aio.connect(
            [cluster.endpoint(leader)] + [cluster.endpoint(n) for n in cluster.nodes]
        ) as client:
            await client.declare("aio-kill")

            flowing = trio.Event()

            async def publish_range(first: int) -> None:
                for i in range(first, first + 100):
                    offsets.append(await client.publish("aio-kill", b"%d" % i))
                    if len(offsets) >= 200:
                        flowing.set()

            async with trio.open_nursery() as nursery:
                for first in range(0, 1000, 100):
                    nursery.start_soon(publish_range, first)
                with trio.fail_after(30):
                    await flowing.wait()  # kill it mid-stream, with confirms flowing
                await trio.to_thread.run_sync(cluster.kill, leader)
        return offsets

    offsets = trio.run(main)
    assert sorted(offsets) == list(range(1000))  # each exactly one offset
    cluster.restart(leader)


def test_closing_the_client_returns_what_its_full_consumer_held(cluster: Cluster) -> None:
    node = cluster.leader()

    def held() -> int:
        return int(cluster.status(node)["queues"]["aio-close"]["unacked"])

    async def main() -> None:
        async with quorumq.aio.connect([cluster.endpoint(node)]) as client:
            await client.declare("aio-close")
            for i in range(5):
                await client.publish("aio-close", b"%d" % i)
            consumer = await client.subscribe("aio-close", prefetch=5)
            with trio.fail_after(10):
                for _ in range(5):
                    await consumer.get()
            await trio.to_thread.run_sync(wait_for, lambda: held() == 5, "5 held")

    trio.run(main)
    wait_for(lambda: held() == 0, "returned on close", 10)


def test_an_ack_cancelled_while_it_waits_to_be_written_is_written_all_the_same() -> None:
    """Delivery.ack() marks the delivery settled before the frame is written: an ack
    cancelled while it waited for the send lock was lost, and could not be sent again
    ("already acked"). No node here: a stream that records what is written."""
    written: list[dict[str, object]] = []

    class Recording:
        async def receive_frame(self) -> None:
            await trio.sleep_forever()

        async def send_frame(self, frame: dict[str, object]) -> None:
            await trio.lowlevel.checkpoint()
            written.append(frame)

        async def aclose(self) -> None:
            pass

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            client = AsyncClient("127.0.0.1:1", None, nursery)
            client._session.connection_made()
            client._link = Recording()
            consumer = AsyncConsumer(client, "q", 10)
            consumer.id = "n.1"
            client._session.consumers["n.1"] = consumer
            frame = {"consumer": "n.1", "offset": 7, "key": None, "body": b"m", "headers": None}
            more = {"redelivered": False, "delivery_count": 0, "node": "A"}
            delivery = delivery_from({**frame, **more}, "q", client._settle)

            async def ack_within_a_second() -> None:
                with trio.move_on_after(1):
                    await delivery.ack()

            async with client._send_lock:  # another frame is being written
                nursery.start_soon(ack_within_a_second)
                await trio.sleep(5)  # the ack's caller gives up meanwhile
            await wait_all_tasks_blocked()
            assert written == [{"t": "ack", "consumer": "n.1", "offsets": [7]}]
            with pytest.raises(QuorumqError, match="already acked"):
                await delivery.ack()

    trio.run(main, clock=MockClock(autojump_threshold=0))


def test_a_client_closed_while_it_reconnects_does_not_connect_again(cluster: Cluster) -> None:
    """Closed while its reader was reconnecting, the trio client once installed the new
    connection all the same, and subscribed its consumers again on it: a closed client
    held messages nobody read. Here the reconnect's handshake waits at a forwarder until
    the client is closed; the client must then drop that connection at once."""
    node = cluster.endpoint(cluster.leader())
    host, port = node.rsplit(":", 1)

    async def main() -> None:
        gate = trio.Event()
        downstream: list[trio.SocketStream] = []
        closed_by_client = trio.Event()
        reconnecting = trio.Event()

        async def forward(source: trio.SocketStream, sink: trio.SocketStream) -> None:
            try:
                async for data in source:
                    await sink.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            if source is downstream[-1] and len(downstream) == 2:
                closed_by_client.set()
            await sink.aclose()

        async def serve(stream: trio.SocketStream) -> None:
            downstream.append(stream)
            if len(downstream) == 2:
                reconnecting.set()
                await gate.wait()  # the reconnect's welcome waits here
            upstream = await trio.open_tcp_stream(host, int(port))
            async with trio.open_nursery() as pumps:
                pumps.start_soon(forward, stream, upstream)
                pumps.start_soon(forward, upstream, stream)

        async with trio.open_nursery() as nursery:
            (listener,) = await nursery.start(
                functools.partial(trio.serve_tcp, serve, 0, host="127.0.0.1")
            )
            endpoint = f"127.0.0.1:{listener.socket.getsockname()[1]}"
            async with quorumq.aio.connect(endpoint, cluster.token, timeout=30) as client:
                await client.declare("closed-while-reconnecting")
                await downstream[0].aclose()  # the connection breaks: the client reconnects
                with trio.fail_after(10):
                    await reconnecting.wait()
                await client.aclose()
                gate.set()
                with trio.fail_after(10):  # it closes the new connection, does not keep it
                    await closed_by_client.wait()
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_consumer_waiting_to_subscribe_again_ends_when_the_client_closes() -> None:
    """Closed while it reconnected (its caller's `async with` ending cancels the
    reconnect), the trio client never ended a consumer of the lost connection that was
    waiting to be subscribed again: the session no longer held it, and its `get()`
    waited for good (second review, 5). A fake node: the second connection's hello is
    answered only once the client is closed."""
    from quorumq.wire.protocol import encode_frame

    async def main() -> None:
        connections = 0
        reconnecting, closed = trio.Event(), trio.Event()

        async def fake_node(stream: trio.SocketStream) -> None:
            nonlocal connections
            connections += 1
            number, decoder = connections, FrameDecoder()
            welcome = {"t": "welcome", "v": 1, "node": "n1", "nonce": b"x" * 16, "auth": False}
            await stream.send_all(encode_frame(welcome))
            async for data in stream:
                decoder.feed(data)
                for frame in decoder.frames():
                    if frame["t"] == "hello":
                        if number == 2:
                            reconnecting.set()
                            await closed.wait()
                        await stream.send_all(encode_frame({"t": "reply", "id": 0, "node": "n1"}))
                    elif frame["t"] == "subscribe":
                        reply = {"t": "reply", "id": frame["id"], "consumer": "c1"}
                        await stream.send_all(encode_frame(reply))
                        await stream.aclose()  # the node drops the connection
                        return

        async with trio.open_nursery() as outer:
            serve = functools.partial(trio.serve_tcp, fake_node, 0, host="127.0.0.1")
            (listener,) = await outer.start(serve)
            endpoint = f"127.0.0.1:{listener.socket.getsockname()[1]}"
            async with quorumq.aio.connect(endpoint, timeout=30) as client:
                consumer = await client.subscribe("q", 1)
                with trio.fail_after(10):
                    await reconnecting.wait()
            closed.set()  # (the `async with` closed the client and cancelled its reconnect)
            with trio.fail_after(5):
                assert await consumer.get() is None
            assert consumer.cancelled
            outer.cancel_scope.cancel()

    trio.run(main)
