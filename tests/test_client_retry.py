"""Subscribing through a time without a quorum, when every subscribe fails for a while:
both clients against a two-node group of real node servers in this process (real Raft,
sockets and data dirs) that the test stops and starts again, and the blocking client
against real node processes killed with SIGKILL."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

import quorumq.aio
from quorumq.client import Client, Consumer, QuorumqError
from quorumq.ops.local_cluster import Cluster, free_ports
from quorumq.replica import ReplicaConfig
from quorumq.server import NodeConfig, NodeServer

from .helpers import wait_for

PROPOSAL_TIMEOUT_S = 0.5
"""A node with no leader fails a proposal after this long (outcome_unknown)."""


class Node:
    """One node server, run by a task of the test's nursery; `stop` returns once its
    replica has stopped, and `start` runs it again on the same ports and data dir."""

    def __init__(self, root: Path, name: str, peers: dict[str, str], port: int) -> None:
        replica = ReplicaConfig(
            node_id=name,
            peers=peers,
            data_dir=str(root / name),
            secret=None,
            insecure=True,
            raft_timeouts=(0.1, 0.2),
            proposal_timeout_s=PROPOSAL_TIMEOUT_S,
        )
        self.config = NodeConfig(replica=replica, listen_port=port, insecure=True)
        self.endpoint = f"127.0.0.1:{port}"
        self._scope = trio.CancelScope()
        self._stopped = trio.Event()

    async def start(self, nursery: trio.Nursery) -> None:
        self._scope, self._stopped = trio.CancelScope(), trio.Event()
        await nursery.start(self._serve)

    async def _serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        try:
            with self._scope:
                await NodeServer(self.config).serve(task_status=task_status)
        finally:
            self._stopped.set()

    async def stop(self) -> None:
        self._scope.cancel()
        await self._stopped.wait()


async def _until(condition: Callable[[], bool]) -> None:
    """Poll `condition` (the caller's cancel scope bounds the wait)."""
    while True:
        if condition():
            return
        await trio.sleep(0.02)


def test_consumers_and_a_new_subscribe_outlast_subscribes_that_fail_without_a_quorum(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """While the group has no quorum, a subscribe fails with `outcome_unknown`. Both
    clients' consumers, whose node restarted, keep subscribing again, and so does a
    new `subscribe`; once the other node is back, all three receive. (Before the retry,
    the consumers ended at the first failure and the new subscribe raised.)"""
    caplog.set_level(logging.INFO, logger="quorumq.client")
    raft_x, raft_y, port_x, port_y = free_ports(4)
    peers = {"X": f"127.0.0.1:{raft_x}", "Y": f"127.0.0.1:{raft_y}"}
    x = Node(tmp_path, "X", peers, port_x)
    y = Node(tmp_path, "Y", peers, port_y)
    blocking: list[Client] = []

    def retried(queue: str) -> bool:
        said = f"subscribing to {queue!r} again"
        return any(said in r.getMessage() for r in caplog.records)

    async def scenario(nursery: trio.Nursery) -> None:
        async with quorumq.aio.connect([x.endpoint, y.endpoint], timeout=30) as admin:
            while True:
                if (await admin.status())["leader"] is not None:
                    break
                await trio.sleep(0.02)
            for queue in ("held", "held-aio", "new"):
                await admin.declare(queue)

            def consumer_on_x() -> Consumer:
                client = Client([x.endpoint], timeout=30)
                blocking.append(client)
                return client.subscribe("held", prefetch=5)

            held = await trio.to_thread.run_sync(consumer_on_x)
            async with quorumq.aio.connect([x.endpoint], timeout=30) as aio_client:
                held_aio = await aio_client.subscribe("held-aio", prefetch=5)

                await y.stop()
                await x.stop()  # both consumers' connections break
                await x.start(nursery)  # alone: no leader, so no subscribe can land

                subscribed: list[Consumer | QuorumqError] = []

                def subscribe_new() -> None:
                    newcomer = Client([x.endpoint], timeout=30)
                    blocking.append(newcomer)
                    try:
                        subscribed.append(newcomer.subscribe("new", prefetch=5))
                    except QuorumqError as e:
                        subscribed.append(e)

                async with trio.open_nursery() as waiting:
                    waiting.start_soon(trio.to_thread.run_sync, subscribe_new)
                    # each has failed once (or, without the retry, given up)
                    await _until(lambda: retried("held") or held.cancelled)
                    await _until(lambda: retried("held-aio") or held_aio.cancelled)
                    await _until(lambda: retried("new") or bool(subscribed))
                    await y.start(nursery)

                for queue in ("held", "held-aio", "new"):
                    await admin.publish(queue, queue.encode())
                outcome: dict[str, object] = {}
                got = await trio.to_thread.run_sync(held.get, 20)
                outcome["held"] = got.body if got else f"ended: {held.cancel_reason}"
                got = None
                with trio.move_on_after(20):
                    got = await held_aio.get()
                outcome["held-aio"] = got.body if got else f"ended: {held_aio.cancel_reason}"
                (new,) = subscribed
                if isinstance(new, Consumer):
                    got = await trio.to_thread.run_sync(new.get, 20)
                    outcome["new"] = got.body if got else f"ended: {new.cancel_reason}"
                else:
                    outcome["new"] = f"subscribe failed: {new}"
                assert outcome == {"held": b"held", "held-aio": b"held-aio", "new": b"new"}
                assert all(map(retried, outcome)), "each had a subscribe fail"
                assert not (held.cancelled or held_aio.cancelled)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await x.start(nursery)
            await y.start(nursery)
            try:
                with trio.fail_after(60):
                    await scenario(nursery)
            finally:
                for client in blocking:
                    await trio.to_thread.run_sync(client.close)
                nursery.cancel_scope.cancel()  # stops the nodes

    trio.run(main)


@pytest.mark.slow
def test_a_consumer_outlasts_its_node_coming_back_to_a_cluster_without_quorum(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Real node processes, killed with SIGKILL. The consumer's node comes back alone:
    its subscribe waits for a leader until the node's proposal timeout (15 s) says
    outcome_unknown. The consumer subscribes again until a second node is back, then
    gets the message it held before (redelivered) and a new one. The Subscribes that
    landed after their outcome was reported unknown leave consumers no connection
    serves; the node downs them, so nothing stays with them."""
    caplog.set_level(logging.INFO, logger="quorumq.client")
    with Cluster(3, node_down_grace=60.0) as cluster:  # no NodeDown comes to help
        x, y, z = cluster.nodes
        cluster.leader()
        cluster.client().declare("q")
        consumer_client = Client([cluster.endpoint(x)], timeout=60)  # only there
        try:
            consumer = consumer_client.subscribe("q", prefetch=5)
            cluster.client().publish("q", b"before")
            before = consumer.get(timeout=10)
            assert before is not None and before.body == b"before"  # held, not acked

            for node in (y, z, x):
                cluster.kill(node)
            cluster.restart(x)  # alone: no leader
            wait_for(
                lambda: (
                    consumer.cancelled
                    or any("subscribing to 'q' again" in r.getMessage() for r in caplog.records)
                ),
                "a subscribe of the consumer to fail (or the consumer to end)",
                45,
            )
            assert not consumer.cancelled, consumer.cancel_reason
            cluster.restart(y)
            with Client([cluster.endpoint(x), cluster.endpoint(y)], timeout=60) as publisher:
                publisher.publish("q", b"after")
            got = {d.body: d for d in (consumer.get(timeout=30) for _ in range(2)) if d}
            assert not consumer.cancelled, consumer.cancel_reason
            assert sorted(got) == [b"after", b"before"]
            assert got[b"before"].redelivered  # ("after" may have gone to an orphan first)
        finally:
            consumer_client.close()
