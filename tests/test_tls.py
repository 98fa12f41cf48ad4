"""TLS on the client port: a node with a certificate serves clients over TLS only.

In this process, a one-node group behind the trio server: first against the standard
library's TLS client and raw sockets (the welcome over TLS, what a peer without TLS, a
client that rejects the certificate and a stalled handshake get), then our clients (both
over TLS, what a client without TLS, a wrong CA, a wrong host name and a node without
TLS give them, and the bytes a tap in front of the node sees). Then a real 3-node
cluster with TLS on: a consumer on a follower, failover after SIGKILL of the leader, a
plain client and a wrong CA refused while others are served, the tap again, and the
CLI. Certificates come from throwaway CAs (`quorumq.ops.local_cluster.make_certificates`).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

import quorumq
import quorumq.aio
from quorumq.client import Client, TlsError
from quorumq.ops.local_cluster import Certificates, Cluster, free_ports, make_certificates
from quorumq.replica import ConfigError, ReplicaConfig
from quorumq.server import NodeConfig, NodeServer
from quorumq.server.node import tls_context
from quorumq.wire.protocol import FrameDecoder


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    """A CA, and a certificate it signed for 127.0.0.1 and localhost."""
    return make_certificates(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The certificate of a CA that signed none of the nodes' certificates."""
    return str(make_certificates(tmp_path_factory.mktemp("other")).ca)


def _config(root: Path, certs: Certificates | None, **limits: Any) -> NodeConfig:
    (raft,) = free_ports(1)
    replica = ReplicaConfig(
        node_id="solo",
        peers={"solo": f"127.0.0.1:{raft}"},
        data_dir=str(root),
        secret=None,
        insecure=True,
        raft_timeouts=(0.1, 0.2),
    )
    tls = {} if certs is None else {"tls_cert": str(certs.cert), "tls_key": str(certs.key)}
    return NodeConfig(replica=replica, listen_port=0, insecure=True, **tls, **limits)


def _serve(server: NodeServer, body: Callable[[str], Awaitable[None]]) -> None:
    """Run `server` in a nursery, `body(endpoint)` against it, then stop it."""

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(server.serve)
            host, port = listeners[0].socket.getsockname()[:2]
            try:
                await body(f"{host}:{port}")
            finally:
                nursery.cancel_scope.cancel()

    trio.run(run)


class Tap:
    """A TCP forwarder on 127.0.0.1 in front of `upstream`, keeping every byte that
    crosses it, each way. Closed (its threads joined) by `close` or the `with` block."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.rsplit(":", 1)
        self._upstream = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self.to_node = bytearray()
        self.to_client = bytearray()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            node = socket.create_connection(self._upstream)
            with self._lock:
                self._sockets += [client, node]
                pumps = [
                    threading.Thread(target=self._pump, args=(client, node, self.to_node)),
                    threading.Thread(target=self._pump, args=(node, client, self.to_client)),
                ]
                self._threads += pumps
            for pump in pumps:
                pump.start()

    def _pump(self, source: socket.socket, sink: socket.socket, record: bytearray) -> None:
        while True:
            try:
                data = source.recv(65536)
                if not data:
                    break
                with self._lock:
                    record += data
                sink.sendall(data)
            except OSError:
                break
        for s in (source, sink):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def seen(self) -> bytes:
        """Everything that crossed, both ways."""
        with self._lock:
            return bytes(self.to_node + self.to_client)

    def close(self) -> None:
        self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept (Linux)
        self._listener.close()
        with self._lock:
            sockets, threads = list(self._sockets), list(self._threads)
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        for thread in threads:
            thread.join(timeout=10)
            assert not thread.is_alive()
        for s in sockets:
            s.close()

    def __enter__(self) -> Tap:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


MARKERS = (b"marker-body-7f3a", b"marker-queue-7f3a", b"marker-key-7f3a")


def _publish_and_consume_markers(endpoint: str, tls: str | None) -> None:
    """Declare, publish and consume one message whose queue, key and body are `MARKERS`."""
    body, queue, key = MARKERS
    with quorumq.connect(endpoint, tls=tls) as client:
        client.declare(queue.decode())
        consumer = client.subscribe(queue.decode())
        client.publish(queue.decode(), body, key=key.decode())
        delivery = consumer.get(timeout=10)
        assert delivery is not None and delivery.body == body
        delivery.ack()


# ------------------------------------------------------- the node, in process


def _welcome_over_tls(endpoint: str, ca: str) -> dict[str, Any]:
    """The node's first frame, as the standard library's TLS client reads it (not ours)."""
    host, port = endpoint.rsplit(":", 1)
    context = ssl.create_default_context(cafile=ca)
    with (
        socket.create_connection((host, int(port)), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname=host) as tls,
    ):
        decoder = FrameDecoder()
        while not (frames := list(decoder.frames())):
            data = tls.recv(65536)
            assert data, "closed before the welcome"
            decoder.feed(data)
        return frames[0]


async def _until_closed(stream: trio.SocketStream) -> list[dict[str, Any]]:
    """The frames the node sent before it closed the connection (with bytes of ours
    unread in its buffer its close is a reset: what came before it is still read)."""
    received = b""
    with contextlib.suppress(trio.BrokenResourceError):
        while data := await stream.receive_some(4096):
            received += data
    await stream.aclose()
    decoder = FrameDecoder()
    decoder.feed(received)
    return list(decoder.frames())


def test_a_tls_node_welcomes_a_standard_tls_client_over_tls(
    tmp_path: Path, certs: Certificates
) -> None:
    server = NodeServer(_config(tmp_path, certs))

    async def body(endpoint: str) -> None:
        with trio.fail_after(10):
            welcome = await trio.to_thread.run_sync(_welcome_over_tls, endpoint, str(certs.ca))
        assert (welcome["t"], welcome["node"]) == ("welcome", "solo")

    _serve(server, body)


def test_a_silent_peer_is_told_in_plain_text_that_the_port_is_tls_only(
    tmp_path: Path, certs: Certificates, caplog: pytest.LogCaptureFixture
) -> None:
    # A quorumq client without TLS waits for the node's welcome, and the node waits for
    # a TLS ClientHello: without `tls_silence_s` both would wait out their timeouts, and
    # the client would say only "timed out".
    server = NodeServer(_config(tmp_path, certs, tls_silence_s=0.3))

    async def body(endpoint: str) -> None:
        host, port = endpoint.rsplit(":", 1)
        with trio.fail_after(10):
            opened = trio.current_time()
            frames = await _until_closed(await trio.open_tcp_stream(host, int(port)))
            assert trio.current_time() - opened >= 0.25
            assert [(f["t"], f["code"]) for f in frames] == [("error", "tls_required")]
            assert "TLS only" in frames[0]["message"]
            welcome = await trio.to_thread.run_sync(_welcome_over_tls, endpoint, str(certs.ca))
            assert welcome["t"] == "welcome"  # and the node serves others

    with caplog.at_level(logging.WARNING, logger="quorumq.server.node"):
        _serve(server, body)
    told = [r.getMessage() for r in caplog.records]
    assert any("sent nothing (a client without TLS?)" in m for m in told), told


def test_bytes_that_cannot_begin_tls_get_a_plain_tls_required_error_at_once(
    tmp_path: Path, certs: Certificates
) -> None:
    server = NodeServer(_config(tmp_path, certs, tls_silence_s=30.0))

    async def body(endpoint: str) -> None:
        host, port = endpoint.rsplit(":", 1)
        stream = await trio.open_tcp_stream(host, int(port))
        with trio.fail_after(5):  # not the silence of 30 s: the first byte says it
            await stream.send_all(b"GET / HTTP/1.1\r\nHost: node\r\n\r\n")
            frames = await _until_closed(stream)
        assert [(f["t"], f["code"]) for f in frames] == [("error", "tls_required")]

    _serve(server, body)


def test_a_peer_that_stalls_in_the_tls_handshake_is_dropped_at_the_handshake_deadline(
    tmp_path: Path, certs: Certificates, caplog: pytest.LogCaptureFixture
) -> None:
    server = NodeServer(_config(tmp_path, certs, handshake_timeout_s=1.0))

    async def body(endpoint: str) -> None:
        host, port = endpoint.rsplit(":", 1)
        stalled = await trio.open_tcp_stream(host, int(port))
        # the start of a TLS handshake record that promises 512 bytes, and nothing more
        await stalled.send_all(b"\x16\x03\x01\x02\x00")
        opened = trio.current_time()
        with trio.fail_after(10):
            welcome = await trio.to_thread.run_sync(_welcome_over_tls, endpoint, str(certs.ca))
            assert welcome["t"] == "welcome"  # others are served meanwhile
            assert await stalled.receive_some(100) == b""  # closed by the node
        waited = trio.current_time() - opened
        assert 0.9 <= waited < 8, waited  # the 1 s deadline, not fail_after's 10 s
        assert not server.connections
        await stalled.aclose()

    with caplog.at_level(logging.WARNING, logger="quorumq.server.node"):
        _serve(server, body)
    logged = [r.getMessage() for r in caplog.records]
    assert any("no TLS handshake in time (no hello in time)" in m for m in logged), logged


def test_a_client_that_rejects_the_certificate_is_logged_and_others_are_served(
    tmp_path: Path, certs: Certificates, other_ca: str, caplog: pytest.LogCaptureFixture
) -> None:
    server = NodeServer(_config(tmp_path, certs))

    async def body(endpoint: str) -> None:
        with trio.fail_after(10):
            with pytest.raises(ssl.SSLCertVerificationError):
                await trio.to_thread.run_sync(_welcome_over_tls, endpoint, other_ca)
            welcome = await trio.to_thread.run_sync(_welcome_over_tls, endpoint, str(certs.ca))
            assert welcome["t"] == "welcome"

    with caplog.at_level(logging.WARNING, logger="quorumq.server.node"):
        _serve(server, body)
    logged = [r.getMessage() for r in caplog.records]
    assert any("TLS handshake failed" in m and "unknown ca" in m for m in logged), logged


def test_tls_needs_a_certificate_and_its_key_that_load(tmp_path: Path, certs: Certificates) -> None:
    config = _config(tmp_path, certs)
    with pytest.raises(ConfigError, match="both a certificate and its key"):
        NodeServer(NodeConfig(replica=config.replica, insecure=True, tls_cert=str(certs.cert)))
    with pytest.raises(ConfigError, match="cannot load the TLS certificate"):
        tls_context(
            NodeConfig(
                replica=config.replica,
                insecure=True,
                tls_cert=str(certs.ca),  # a certificate without this key
                tls_key=str(certs.key),
            )
        )
    context = tls_context(config)
    assert context is not None and context.minimum_version == ssl.TLSVersion.TLSv1_2
    assert certs.key.stat().st_mode & 0o077 == 0  # the key is its owner's alone


def test_a_node_refuses_to_start_with_a_certificate_it_cannot_load(tmp_path: Path) -> None:
    (client_port, raft_port) = free_ports(2)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "quorumq",
            "node",
            "--id",
            "A",
            "--data-dir",
            str(tmp_path / "A"),
            "--listen",
            f"127.0.0.1:{client_port}",
            "--raft",
            f"127.0.0.1:{raft_port}",
            "--insecure",
            "--tls-cert",
            str(tmp_path / "missing.pem"),
            "--tls-key",
            str(tmp_path / "missing.key"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert len(result.stderr.splitlines()) == 1
    assert "cannot load the TLS certificate" in result.stderr


# ----------------------------------------------------- the clients, one node in process


def test_both_clients_publish_and_consume_over_tls(tmp_path: Path, certs: Certificates) -> None:
    server = NodeServer(_config(tmp_path, certs))

    async def body(endpoint: str) -> None:
        async with quorumq.aio.connect(endpoint, tls=str(certs.ca)) as client:
            with trio.fail_after(10):
                await client.declare("q")
                consumer = await client.subscribe("q", prefetch=5)

                def blocking_publish() -> int:
                    with Client(endpoint, tls=str(certs.ca)) as blocking:
                        return blocking.publish("q", b"from the blocking client")

                assert await trio.to_thread.run_sync(blocking_publish) == 0
                assert await client.publish("q", b"from the trio client") == 1
                bodies = []
                for _ in range(2):
                    delivery = await consumer.get()
                    assert delivery is not None
                    bodies.append(delivery.body)
                    await delivery.ack()
                assert bodies == [b"from the blocking client", b"from the trio client"]
                served = [conn.transport for conn in server.connections]
                assert served and all(isinstance(t, trio.SSLStream) for t in served)

    _serve(server, body)


def test_a_client_without_tls_is_told_the_port_is_tls_only_and_others_are_served(
    tmp_path: Path, certs: Certificates, caplog: pytest.LogCaptureFixture
) -> None:
    server = NodeServer(_config(tmp_path, certs, tls_silence_s=0.3))

    async def body(endpoint: str) -> None:
        async with quorumq.aio.connect(endpoint, tls=str(certs.ca)) as client:
            with trio.fail_after(20):
                await client.declare("q")
                consumer = await client.subscribe("q")
                started = trio.current_time()
                with pytest.raises(TlsError, match="serves clients over TLS only") as plain:
                    await trio.to_thread.run_sync(lambda: Client(endpoint, connect_timeout=10))
                with pytest.raises(TlsError, match="serves clients over TLS only") as aio_plain:
                    async with quorumq.aio.connect(endpoint, connect_timeout=10):
                        pass
                assert trio.current_time() - started < 9  # told, not a 10 s timeout
                for error in (plain.value, aio_plain.value):
                    assert "\n" not in str(error) and error.__cause__ is None
                assert await client.publish("q", b"still served") == 0
                delivery = await consumer.get()
                assert delivery is not None and delivery.body == b"still served"

    with caplog.at_level(logging.WARNING, logger="quorumq.server.node"):
        _serve(server, body)
    told = [r for r in caplog.records if "a client without TLS?" in r.getMessage()]
    assert len(told) == 2


def test_a_certificate_from_another_ca_or_for_another_host_fails_with_one_tls_error(
    tmp_path: Path, certs: Certificates, other_ca: str
) -> None:
    elsewhere = make_certificates(tmp_path / "elsewhere", hosts=("elsewhere.example",))
    cases = [
        ("another-ca", certs, other_ca, "did not verify: unable to get local issuer certificate"),
        ("another-host", elsewhere, str(elsewhere.ca), "did not verify: IP address mismatch"),
    ]
    for name, node_certs, ca, why in cases:
        server = NodeServer(_config(tmp_path / name, node_certs))

        async def body(endpoint: str, ca: str = ca, why: str = why) -> None:
            with pytest.raises(TlsError, match=why) as blocking:
                await trio.to_thread.run_sync(lambda: Client(endpoint, tls=ca))
            with pytest.raises(TlsError, match=why) as aio:
                async with quorumq.aio.connect(endpoint, tls=ca):
                    pass
            for error in (blocking.value, aio.value):  # one line, no ssl traceback
                assert "\n" not in str(error) and error.__cause__ is None
                assert error.__suppress_context__

        _serve(server, body)


def test_a_tls_client_against_a_node_without_tls_fails_with_a_tls_error(
    tmp_path: Path, certs: Certificates
) -> None:
    server = NodeServer(_config(tmp_path, None))

    async def body(endpoint: str) -> None:
        why = "did not answer in TLS .* serves plain text"
        with pytest.raises(TlsError, match=why):
            await trio.to_thread.run_sync(lambda: Client(endpoint, tls=str(certs.ca)))
        with pytest.raises(TlsError, match=why):
            async with quorumq.aio.connect(endpoint, tls=str(certs.ca)):
                pass
        async with quorumq.aio.connect(endpoint) as client:  # and it serves plain clients
            await client.declare("q")

    _serve(server, body)


def test_what_crosses_the_wire_is_tls_not_the_protocol(tmp_path: Path, certs: Certificates) -> None:
    seen: dict[str, bytes] = {}
    for name, node_certs in (("tls", certs), ("plain", None)):
        server = NodeServer(_config(tmp_path / name, node_certs))
        ca = str(certs.ca) if node_certs is not None else None

        async def body(endpoint: str, name: str = name, ca: str | None = ca) -> None:
            with Tap(endpoint) as tap:
                await trio.to_thread.run_sync(_publish_and_consume_markers, tap.endpoint, ca)
            seen[name] = tap.seen()
            if name == "tls":  # both sides open with a TLS handshake record, not a frame
                assert tap.to_node[:2] == b"\x16\x03" and tap.to_client[:2] == b"\x16\x03"

        _serve(server, body)
    assert all(marker in seen["plain"] for marker in MARKERS)  # the tap sees plain text
    assert not any(marker in seen["tls"] for marker in MARKERS)
    assert b"welcome" in seen["plain"] and b"welcome" not in seen["tls"]


def test_a_ca_file_that_does_not_load_is_a_tls_error(tmp_path: Path) -> None:
    with pytest.raises(TlsError, match="cannot load the TLS CA file"):
        Client("127.0.0.1:1", tls=str(tmp_path / "no-such-ca.pem"))


# ------------------------------------------------- a real 3-node cluster, with TLS


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """Three node processes that serve clients over TLS only, with a client token."""
    with Cluster(3, tls=True, token=secrets.token_hex(16)) as cluster:
        cluster.leader()
        yield cluster


@pytest.mark.slow
def test_over_tls_a_follower_delivers_and_both_clients_fail_over_when_the_leader_dies() -> None:
    with Cluster(3, tls=True, token=secrets.token_hex(16), node_down_grace=30.0) as cluster:
        leader = cluster.leader()
        follower = next(n for n in cluster.nodes if n != leader)
        producer = cluster.client(leader)
        assert producer.node == leader
        producer.declare("q")
        consumer = cluster.client(follower).subscribe("q", prefetch=500)
        leader_first = [cluster.endpoint(leader)] + [
            cluster.endpoint(n) for n in cluster.nodes if n != leader
        ]

        async def main() -> list[int]:
            async with quorumq.aio.connect(
                leader_first, cluster.token, tls=cluster.tls_ca
            ) as client:
                assert client.node == leader
                offsets = [await client.publish("q", b"aio-before-%d" % i) for i in range(20)]
                for i in range(20):
                    offsets.append(
                        await trio.to_thread.run_sync(producer.publish, "q", b"before-%d" % i)
                    )
                await trio.to_thread.run_sync(cluster.kill, leader)
                # both reconnect to another node; every node serves TLS only, so over TLS
                with trio.fail_after(30):
                    for i in range(20):
                        offsets.append(await client.publish("q", b"aio-after-%d" % i))
                        offsets.append(
                            await trio.to_thread.run_sync(producer.publish, "q", b"after-%d" % i)
                        )
                assert client.node not in (None, leader)
                return offsets

        offsets = trio.run(main)
        assert producer.node not in (None, leader)
        assert sorted(offsets) == list(range(80))
        got: list[int] = []
        deadline = time.monotonic() + 30
        while len(got) < 80 and time.monotonic() < deadline:
            delivery = consumer.get(timeout=1)
            if delivery is not None:
                assert delivery.node == follower  # from the follower's own replica
                got.append(delivery.offset)
                delivery.ack()
        assert sorted(set(got)) == list(range(80))


@pytest.mark.slow
def test_on_a_tls_cluster_a_plain_client_and_a_wrong_ca_fail_clearly_and_others_are_served(
    cluster: Cluster, other_ca: str
) -> None:
    client = cluster.client()
    client.declare("served")
    consumer = cluster.client(cluster.nodes[-1]).subscribe("served")
    with pytest.raises(TlsError, match="serves clients over TLS only"):
        quorumq.connect(cluster.endpoints, cluster.token)
    with pytest.raises(TlsError, match="certificate did not verify"):
        quorumq.connect(cluster.endpoints, cluster.token, tls=other_ca)
    with pytest.raises(TlsError, match="certificate did not verify"):
        quorumq.connect(cluster.endpoints, cluster.token, tls=True)  # not a system CA
    offset = client.publish("served", b"still served")
    delivery = consumer.get(timeout=10)
    assert delivery is not None and delivery.offset == offset
    delivery.ack()
    for node in cluster.nodes:
        log = cluster.log_path(node).read_text()
        assert "a client without TLS?" in log
        assert "alert unknown ca" in log


@pytest.mark.slow
def test_on_a_tls_cluster_the_bytes_on_the_wire_are_not_the_protocol(cluster: Cluster) -> None:
    with Tap(cluster.endpoint(cluster.nodes[1])) as tap:
        body, queue, key = MARKERS
        with quorumq.connect(tap.endpoint, cluster.token, tls=cluster.tls_ca) as client:
            client.declare(queue.decode())
            consumer = client.subscribe(queue.decode())
            client.publish(queue.decode(), body, key=key.decode())
            delivery = consumer.get(timeout=10)
            assert delivery is not None and delivery.body == body
            delivery.ack()
    assert tap.to_node[:2] == b"\x16\x03" and tap.to_client[:2] == b"\x16\x03"
    assert len(tap.seen()) > 2 * len(body)
    assert not any(marker in tap.seen() for marker in MARKERS)


@pytest.mark.slow
def test_the_cli_connects_over_tls_with_tls_ca_and_says_what_is_wrong_without(
    cluster: Cluster, tmp_path: Path
) -> None:
    assert cluster.token is not None and cluster.tls_ca is not None
    env = {"QUORUMQ_TOKEN": cluster.token, "PATH": ""}

    def quorumq_cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "quorumq", *args, "--endpoints", ",".join(cluster.endpoints)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            env=env,
            cwd=tmp_path,
        )

    published = quorumq_cli("publish", "cli-q", "over tls", "--tls-ca", cluster.tls_ca)
    assert published.returncode == 2 and "declare it" in published.stderr  # it connected
    assert quorumq_cli("declare", "cli-q", "--tls-ca", cluster.tls_ca).returncode == 0
    published = quorumq_cli("publish", "cli-q", "over tls", "--tls-ca", cluster.tls_ca)
    assert published.returncode == 0, published.stderr
    consumed = quorumq_cli("consume", "cli-q", "--wait", "1", "--tls-ca", cluster.tls_ca)
    assert '"body": "over tls"' in consumed.stdout
    for extra, why in (((), "TLS only"), (("--tls",), "certificate did not verify")):
        refused = quorumq_cli("publish", "cli-q", "x", *extra)
        assert refused.returncode == 2
        assert len(refused.stderr.splitlines()) == 1 and why in refused.stderr, refused.stderr
