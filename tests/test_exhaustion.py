"""Exhausted resources and hostile neighbours, on real node processes under a small
open file limit (256, as `ulimit -n 256`): each port (client, Raft, metrics) flooded
with idle, slow and garbage connections, many more than the limit. The node keeps
serving its authenticated clients, refuses (never dies), and loses nothing."""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from quorumq.ops.local_cluster import Cluster

from .helpers import wait_for
from .test_cluster import converged

pytestmark = pytest.mark.slow

FILE_LIMIT = 256
FLOOD = 1_000
"""Connections each flood opens: four times the nodes' file limit."""


@pytest.fixture(scope="module", autouse=True)
def _room_for_the_flood() -> None:
    """This process holds the flood's sockets: its own limit must allow them."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < FLOOD + 200:
        if hard != resource.RLIM_INFINITY and hard < FLOOD + 200:
            pytest.skip(f"this process may open {hard} files, the flood needs {FLOOD + 200}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (FLOOD + 200, hard))


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Cluster(3, token="t0ken", metrics=True, file_limit=FILE_LIMIT) as cluster:
        cluster.client().declare("q")
        yield cluster


@contextlib.contextmanager
def flood(port: int, *, send: bytes = b"", count: int = FLOOD) -> Iterator[list[socket.socket]]:
    """`count` connections to `port` on 127.0.0.1, each sending `send` (then idle);
    those the node refuses or closes are counted by the caller from what is left."""
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.setblocking(False)
            with contextlib.suppress(BlockingIOError, InterruptedError):
                sock.connect(("127.0.0.1", port))
            socks.append(sock)
        deadline = time.monotonic() + 5
        for sock in socks:
            if not send:
                continue
            sock.setblocking(True)
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            with contextlib.suppress(OSError):
                sock.sendall(send)
        yield socks
    finally:
        for sock in socks:
            sock.close()


def still_open(socks: list[socket.socket]) -> int:
    """How many of `socks` the peer has not closed (a closed one reads b"" or fails)."""
    alive = 0
    for sock in socks:
        sock.setblocking(False)
        try:
            while sock.recv(65536):  # (what the node said before it closed: an error)
                pass
        except BlockingIOError:
            alive += 1  # nothing more to read, not closed
        except OSError:
            pass  # reset
    return alive


def serves(cluster: Cluster, count: int = 50) -> list[int]:
    """Publish `count` messages through a fresh authenticated client; their offsets."""
    with cluster.client(timeout=30) as client:
        return [client.publish("q", b"m") for _ in range(count)]


def files_open(cluster: Cluster, node: str) -> int:
    return len(os.listdir(f"/proc/{cluster._procs[node].pid}/fd"))


def all_alive(cluster: Cluster) -> bool:
    return all(cluster.alive(n) for n in cluster.nodes)


def test_a_node_under_a_small_file_limit_caps_its_clients_below_it(cluster: Cluster) -> None:
    status = cluster.status(cluster.nodes[0])
    assert status["files_limit"] == FILE_LIMIT
    assert 16 <= status["max_clients"] <= FILE_LIMIT - 150
    assert status["files_open"] < FILE_LIMIT // 2


@pytest.mark.parametrize(
    "send", [b"", b"GET /metr", os.urandom(64)], ids=["idle", "slow", "garbage"]
)
def test_the_metrics_port_flooded_never_starves_the_node(cluster: Cluster, send: bytes) -> None:
    """prometheus_client's server held a thread and a descriptor per connection: about
    1,007 idle sockets stopped a node (its next journal write failed with EMFILE)."""
    node = cluster.leader()
    with flood(cluster.metrics_ports[node], send=send) as socks:
        wait_for(
            lambda: still_open(socks) <= 16, "the metrics port closing what it cannot hold", 15
        )
        assert files_open(cluster, node) < FILE_LIMIT - 32
        assert len(serves(cluster)) == 50
        assert all_alive(cluster)
    wait_for(lambda: _scrapes(cluster, node), "a scrape once the flood is gone", 15)


def _scrapes(cluster: Cluster, node: str) -> bool:
    try:
        with urllib.request.urlopen(cluster.metrics_url(node), timeout=5) as response:
            return b"quorumq_raft_term" in response.read()
    except (urllib.error.URLError, OSError):
        return False


@pytest.mark.parametrize(
    "send", [b"", b"\x00\x00\x00", os.urandom(64)], ids=["idle", "slow", "garbage"]
)
def test_the_client_port_flooded_keeps_serving_authenticated_clients(
    cluster: Cluster, send: bytes
) -> None:
    node = cluster.leader()
    with flood(cluster.client_ports[node], send=send) as socks:
        wait_for(
            lambda: files_open(cluster, node) < FILE_LIMIT - 32,
            "the node holding no more connections than its budget",
            15,
        )
        assert len(serves(cluster)) == 50  # (the client may be sent to another node)
        with cluster.client(node, timeout=30) as client:  # this node's own
            assert client.publish("q", b"own") >= 0
        assert all_alive(cluster)
        assert still_open(socks) <= cluster.status(node)["max_clients"]


@pytest.mark.parametrize(
    "send", [b"", b"\x00\x00", os.urandom(64)], ids=["idle", "slow", "garbage"]
)
def test_the_raft_port_flooded_keeps_the_cluster_committing(cluster: Cluster, send: bytes) -> None:
    """The flooded node's peers still connect to it: a peer restarted meanwhile dials it
    (the node with the lower address is the one dialled) and gets through. PySyncObj
    listened with a backlog of 5 and accepted one connection per wake: a real peer's
    dial waited behind the flood for longer than 30 s."""
    address = {n: f"127.0.0.1:{cluster.raft_ports[n]}" for n in cluster.nodes}
    target = min(cluster.nodes, key=address.__getitem__)
    dialler = next(n for n in cluster.nodes if n != target)
    with flood(cluster.raft_ports[target], send=send) as socks:
        wait_for(
            lambda: files_open(cluster, target) < FILE_LIMIT - 32,
            "the Raft port holding at most its 32 unauthenticated connections",
            15,
        )
        assert len(serves(cluster)) == 50
        cluster.kill(dialler)
        cluster.restart(dialler)
        wait_for(
            lambda: cluster.status(dialler)["connected"].get(target) is True,
            f"{dialler} connecting to {target} through the flood",
            15,
        )
        serves(cluster)
        wait_for(lambda: converged(cluster), "the restarted node catching up", 30)
        assert all_alive(cluster) and files_open(cluster, target) < FILE_LIMIT - 32
        assert socks


def test_nothing_confirmed_was_lost_through_the_floods(cluster: Cluster) -> None:
    """Every node applies the same log, and the queue holds every publish confirmed."""
    offsets: list[int] = []
    with cluster.client(timeout=30) as client:
        last = client.publish("q", b"last")
        while len(offsets) <= last:
            got = client.read("q", len(offsets), last + 1, wait=10)
            assert got.rows, f"nothing to read from {len(offsets)} (last {last})"
            offsets += [row[0] for row in got.rows]
    assert offsets == list(range(last + 1))
    assert all_alive(cluster)
