"""The trio server in this process: a one-node Raft group, listeners on port 0 started
by the test's nursery, the trio client, and fuzzed bytes on a live connection."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import quorumq.aio
from quorumq.client import Client, QuorumqError, ServerError
from quorumq.client.aio import StreamLink
from quorumq.client.wire import Wire
from quorumq.ops.local_cluster import free_ports
from quorumq.replica import ReplicaConfig
from quorumq.server import NodeConfig, NodeServer
from quorumq.wire.protocol import KEEPALIVE_IDLE_S


def _config(root: Path) -> NodeConfig:
    (raft,) = free_ports(1)
    replica = ReplicaConfig(
        node_id="solo",
        peers={"solo": f"127.0.0.1:{raft}"},
        data_dir=str(root),
        secret=None,
        insecure=True,
        raft_timeouts=(0.1, 0.2),
    )
    return NodeConfig(replica=replica, listen_port=0, insecure=True)


def _serve_with(server: NodeServer, body: object) -> None:
    async def run() -> None:
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(server.serve)
            host, port = listeners[0].socket.getsockname()[:2]
            try:
                await body(f"{host}:{port}")  # type: ignore[operator]
            finally:
                nursery.cancel_scope.cancel()

    trio.run(run)


def _serve(root: Path, body: object) -> None:
    _serve_with(NodeServer(_config(root)), body)


def test_a_one_node_group_serves_publish_subscribe_and_status(tmp_path: Path) -> None:
    async def body(endpoint: str) -> None:
        async with quorumq.aio.connect(endpoint) as client:
            with trio.fail_after(10):
                await client.declare("q")
                consumer = await client.subscribe("q", prefetch=5)
                assert await client.publish("q", b"hello", key="k") == 0
                delivery = await consumer.get()
                assert delivery is not None
                assert (delivery.body, delivery.node, delivery.key) == (b"hello", "solo", "k")
                await delivery.ack()
                with pytest.raises(QuorumqError, match="already acked"):
                    await delivery.ack()  # it would spoil the batch of acks it travels in
                status = await client.status()
                assert status["node"] == "solo" and status["is_leader"]

    _serve(tmp_path, body)


def test_reads_that_wait_are_answered_as_the_node_applies_their_range(tmp_path: Path) -> None:
    """The replica tells the node, from its Raft thread through the trio token, when an
    entry moves the end of a queue reads wait on: reads waiting up to 20 s are answered
    as their queue is declared and as the messages they need are published."""

    async def body(endpoint: str) -> None:
        async with quorumq.aio.connect(endpoint) as client:
            got: dict[str, list[bytes]] = {}

            async def read(queue: str, end: int) -> None:
                result = await client.read(queue, 0, end, wait=20)
                got[f"{queue}[:{end}]"] = [m.body for m in result.messages]

            with trio.fail_after(10):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(read, "later", 0)
                    nursery.start_soon(read, "q", 2)
                    nursery.start_soon(read, "q", 1)
                    await trio.sleep(0.2)  # they wait
                    await client.declare("later")
                    await client.declare("q")
                    await client.publish("q", b"a")
                    await client.publish("q", b"b")
            assert got == {"later[:0]": [], "q[:1]": [b"a"], "q[:2]": [b"a", b"b"]}

    _serve(tmp_path, body)


def test_forget_producers_forgets_by_prefix_and_the_status_counts_what_is_left(
    tmp_path: Path,
) -> None:
    async def body(endpoint: str) -> None:
        async with quorumq.aio.connect(endpoint) as client:
            with trio.fail_after(10):
                await client.declare("q")
                for producer in ("job-9-0", "job-9-1", "job-10-0"):
                    await client.publish_batch("q", [b"x"], producer=producer, first_seq=0)
                assert (await client.status())["queues"]["q"]["producers"] == 3
                assert await client.forget_producers("q", "job-9-") == 2
                assert await client.forget_producers("q", "job-9-") == 0
                assert (await client.status())["queues"]["q"]["producers"] == 1
                # forgotten: seq 0 is new again; remembered: seq 0 is a duplicate
                assert await client.publish_batch("q", [b"y"], producer="job-9-0", first_seq=0) == [
                    3
                ]
                assert await client.publish_batch(
                    "q", [b"y"], producer="job-10-0", first_seq=0
                ) == [2]
                with pytest.raises(ServerError, match="invalid"):
                    await client.forget_producers("q", "")
                with pytest.raises(ServerError, match="unknown_queue"):
                    await client.forget_producers("nope", "job-")

    _serve(tmp_path, body)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(garbage=st.lists(st.binary(min_size=1, max_size=200), min_size=1, max_size=6))
def test_random_bytes_never_take_the_server_down(tmp_path: Path, garbage: list[bytes]) -> None:
    async def body(endpoint: str) -> None:
        host, port = endpoint.rsplit(":", 1)
        with trio.fail_after(10):
            stream = await trio.open_tcp_stream(host, int(port))
            for chunk in garbage:
                try:
                    await stream.send_all(chunk)
                except trio.BrokenResourceError:
                    break  # the server closed it deliberately: fine
            await stream.aclose()
            async with quorumq.aio.connect(endpoint) as client:  # still serving
                assert (await client.status())["node"] == "solo"

    root = tmp_path / f"run-{abs(hash(tuple(garbage)))}"
    _serve(root, body)


def test_a_down_lost_on_its_way_to_the_log_is_proposed_again(tmp_path: Path) -> None:
    from quorumq.machine import Down

    server = NodeServer(_config(tmp_path))
    lost: list[object] = []

    async def body(endpoint: str) -> None:
        replica = server.replica
        real_propose = replica.propose

        def propose_losing_the_first_down(command: object, callback: object = None) -> None:
            if isinstance(command, Down) and not lost:
                lost.append(command)  # as if a leader change swallowed it
                return
            real_propose(command, callback)  # type: ignore[arg-type]

        replica.propose = propose_losing_the_first_down  # type: ignore[method-assign]
        with trio.fail_after(15):
            async with quorumq.aio.connect(endpoint) as client:
                await client.declare("q")
                holder = await client.subscribe("q", prefetch=1)
                await client.publish("q", b"held")
                assert (await holder.get()) is not None
            # the holder's connection is closed: its Down is lost, then proposed again
            async with quorumq.aio.connect(endpoint) as client:
                consumer = await client.subscribe("q", prefetch=1)
                again = await consumer.get()
                assert again is not None and again.body == b"held" and again.redelivered
        assert lost

    _serve_with(server, body)


def test_a_nack_whose_outcome_is_lost_is_sent_again_only_if_it_did_not_land(
    tmp_path: Path,
) -> None:
    from quorumq.machine import Nack
    from quorumq.replica import OutcomeUnknownError

    server = NodeServer(_config(tmp_path))
    fate = ["swallowed", "applied"]  # the first nack never lands; the second lands

    async def body(endpoint: str) -> None:
        replica = server.replica
        real_propose = replica.propose

        def propose(command: object, callback: object = None) -> None:
            if isinstance(command, Nack) and fate:
                how = fate.pop(0)
                unknown = OutcomeUnknownError("the leader changed before a reply")
                if how == "applied":  # it lands, but its reply is lost
                    real_propose(command, lambda _r, _e: callback(None, unknown))  # type: ignore[arg-type, operator]
                else:
                    callback(None, unknown)  # type: ignore[operator]
                return
            real_propose(command, callback)  # type: ignore[arg-type]

        replica.propose = propose  # type: ignore[method-assign]
        with trio.fail_after(15):
            async with quorumq.aio.connect(endpoint) as client:
                await client.declare("q")
                consumer = await client.subscribe("q", prefetch=1)
                await client.publish("q", b"m")
                first = await consumer.get()
                assert first is not None
                await first.nack(requeue=True)
                second = await consumer.get()  # the repeat landed: it comes back, once
                assert second is not None and second.redelivered and second.delivery_count == 1
                await second.nack(requeue=True)
                third = await consumer.get()
                assert third is not None and third.delivery_count == 2  # not requeued twice
                await third.ack()
                while True:  # acks are asynchronous: wait (under fail_after) for this one
                    stats = (await client.status())["queues"]["q"]
                    if (stats["ready"], stats["unacked"]) == (0, 0):
                        break
                    await trio.sleep(0.02)

    _serve_with(server, body)


def test_both_ends_of_a_client_connection_probe_a_silent_peer(tmp_path: Path) -> None:
    # A peer whose host vanishes sends no FIN: without keepalive the node would keep
    # that client's consumers (and their unacked messages) for good, and the client
    # would wait for that node for good.
    server = NodeServer(_config(tmp_path))

    def probing(sock: socket.socket) -> tuple[int, int]:
        return (
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
            sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
        )

    async def body(endpoint: str) -> None:
        async with quorumq.aio.connect(endpoint) as client:
            with trio.fail_after(10):
                await client.status()
                blocking = await trio.to_thread.run_sync(Client, [endpoint])
                try:
                    await trio.to_thread.run_sync(blocking.status)
                    assert isinstance(client._link, StreamLink)
                    assert isinstance(blocking._link, Wire)
                    assert probing(client._link.stream.socket) == (1, KEEPALIVE_IDLE_S)
                    assert probing(blocking._link.sock) == (1, KEEPALIVE_IDLE_S)
                    served = [conn.transport.socket for conn in server.connections]  # type: ignore[attr-defined]
                    assert len(served) == 2
                    assert all(probing(s) == (1, KEEPALIVE_IDLE_S) for s in served)
                finally:
                    blocking.close()

    _serve_with(server, body)


def test_a_nack_with_a_delay_comes_back_once_it_ran_out_with_its_key_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retry with backoff through the trio client: the node's leader proposes a `Tick`
    as soon as the delay runs out (the periodic one is switched off here, so nothing
    else could deliver it), the key's later message comes back behind it, in order, and
    another key is not held up meanwhile."""
    import quorumq.replica

    monkeypatch.setattr(quorumq.replica, "TICK_EVERY_S", 3600.0)

    async def body(endpoint: str) -> None:
        async with quorumq.aio.connect(endpoint) as client:
            with trio.fail_after(10):
                await client.declare("q", retry_backoff_ms=(10_000, 60_000))
                consumer = await client.subscribe("q", prefetch=10)
                for key in ("k", "k", "x"):
                    await client.publish("q", key.encode(), key=key)
                got = [await consumer.get() for _ in range(3)]
                first, _, other = got
                assert first is not None and other is not None
                with pytest.raises(ValueError, match="requeue"):
                    await first.nack(requeue=False, delay_ms=5)
                nacked_at = trio.current_time()
                await first.nack(delay_ms=300)  # its own delay, not the queue's 10 s
                await other.ack()
                again = [await consumer.get() for _ in range(2)]
                waited = trio.current_time() - nacked_at
                assert [(d.offset, d.redelivered) for d in again if d] == [(0, True), (1, True)]
                assert 0.3 <= waited < 9, waited  # its own 300 ms, not the queue's 10 s
                for d in again:
                    await d.ack()  # type: ignore[union-attr]
                await client.publish("q", b"k", key="k")
                fourth = await consumer.get()
                assert fourth is not None
                await fourth.nack()  # the queue's backoff: 10 s
                while True:  # the nack travels without an answer: wait until it landed
                    if (await client.status())["queues"]["q"]["ready"] == 1:
                        break
                    await trio.sleep(0.02)
                with trio.move_on_after(1):
                    await consumer.get()
                    raise AssertionError("redelivered before the queue's backoff ran out")

    _serve(tmp_path, body)


def test_the_trio_client_purges_and_deletes_and_its_consumer_is_told_why(
    tmp_path: Path,
) -> None:
    async def body(endpoint: str) -> None:
        async with quorumq.aio.connect(endpoint) as client:
            with trio.fail_after(10):
                await client.declare("q")
                consumer = await client.subscribe("q", prefetch=1)
                for body in (b"a", b"b", b"c"):
                    await client.publish("q", body)
                assert await consumer.get() is not None
                assert await client.purge_queue("q") == 2
                with pytest.raises(ServerError, match="queue_in_use"):
                    await client.delete_queue("q")
                deleted = await client.delete_queue("q", force=True)
                assert deleted == {"messages": 1, "consumers": 1}
                assert await consumer.get() is None
                assert consumer.cancel_reason == "queue_deleted"
                assert "q" not in (await client.status())["queues"]
                await client.declare("q")  # a new queue: this client publishes to it afresh
                assert await client.publish("q", b"again") == 3

    _serve(tmp_path, body)
