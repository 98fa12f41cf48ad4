"""Connecting: why the endpoints could not be used (`ConnectFailures`, driven with
errors alone), and the clients over real sockets: an endpoint that takes the
connection and says nothing (a node's Raft port), one that refuses it."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import trio

import quorumq.aio
from quorumq.client import Client, ConnectionLostError, UnreachableError
from quorumq.client.core import (
    REFUSED_ROUNDS,
    WELCOME_S,
    ConnectFailures,
    NoWelcomeError,
    TlsError,
)
from quorumq.ops.local_cluster import Cluster, free_ports

REFUSED = ConnectionRefusedError(111, "Connection refused")


def test_refusals_end_the_attempt_after_a_few_rounds_when_not_waiting_for_nodes() -> None:
    failures = ConnectFailures(2, wait_for_nodes=False)
    for _ in range(REFUSED_ROUNDS - 1):
        failures.add("h:1", REFUSED)
        failures.add("h:2", REFUSED)
    failures.add("h:1", REFUSED)
    with pytest.raises(UnreachableError) as given_up:
        failures.add("h:2", REFUSED)
    assert str(given_up.value) == (
        "no quorumq node answered: h:1, h:2: connection refused (is a quorumq node running there?)"
    )
    assert given_up.value.refused == ["h:1", "h:2"] and given_up.value.silent == []


def test_trio_refusals_count_as_refusals() -> None:
    """trio's `open_tcp_stream` raises an OSError caused by a group of the refusals of
    every address it tried."""
    failures = ConnectFailures(1, wait_for_nodes=False)
    group = ExceptionGroup("all attempts failed", [REFUSED, REFUSED])
    trio_refused = OSError("all attempts to connect to h:1 failed")
    trio_refused.__cause__ = group
    with pytest.raises(UnreachableError):
        for _ in range(REFUSED_ROUNDS):
            failures.add("h:1", trio_refused)


def test_a_silent_endpoint_ends_the_attempt_with_the_first_round() -> None:
    failures = ConnectFailures(2, wait_for_nodes=False)
    failures.add("h:1", NoWelcomeError(2.5))
    with pytest.raises(UnreachableError) as given_up:
        failures.add("h:2", REFUSED)
    message = str(given_up.value)
    assert "h:1: took the connection but sent no quorumq welcome within 2.5 s" in message
    assert "h:2: connection refused" in message
    assert given_up.value.silent == ["h:1"] and given_up.value.refused == ["h:2"]


def test_another_failure_between_refusals_starts_the_count_again() -> None:
    """One endpoint that answers in some other way (a timeout: a host that may come
    back) keeps the client trying until its connect timeout."""
    failures = ConnectFailures(2, wait_for_nodes=False)
    for _ in range(3 * REFUSED_ROUNDS):
        failures.add("h:1", REFUSED)
        failures.add("h:2", TimeoutError("timed out"))
    message = str(failures.give_up())
    assert message == "no quorumq node answered: h:1: connection refused " + (
        "(is a quorumq node running there?); h:2: timed out"
    )


def test_waiting_for_nodes_never_gives_up_on_refusals_or_silence() -> None:
    """The default: a node being started refuses until it listens."""
    failures = ConnectFailures(1)
    for _ in range(10 * REFUSED_ROUNDS):
        failures.add("h:1", REFUSED)
        failures.add("h:1", NoWelcomeError(2.5))
    assert isinstance(failures.give_up(), ConnectionLostError)


def test_tls_failures_still_end_the_attempt_as_before() -> None:
    failures = ConnectFailures(1, wait_for_nodes=False)
    with pytest.raises(TlsError):
        failures.add("h:1", TlsError("TLS handshake failed: unknown ca"))


@pytest.fixture
def silent_port() -> Iterator[str]:
    """A port that takes connections and says nothing, as a node's Raft port does with
    a client's (it waits for its peer's secret, for 5 s)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()


def _aio_connect(endpoints: list[str], **options: object) -> None:
    async def run() -> None:
        async with quorumq.aio.connect(endpoints, **options):
            pass

    trio.run(run)


@pytest.mark.parametrize("connect", [Client, _aio_connect], ids=["blocking", "aio"])
def test_an_endpoint_that_sends_no_welcome_is_not_a_client_port(
    silent_port: str, connect: object
) -> None:
    """Issue 31: the client waited its whole connect timeout (10 s here), then said
    "timed out"; now 2.5 s, and what it may be."""
    started = time.monotonic()
    with pytest.raises(UnreachableError) as given_up:
        connect([silent_port], connect_timeout=10.0, wait_for_nodes=False)  # type: ignore[operator]
    took = time.monotonic() - started
    assert f"{silent_port}: took the connection but sent no quorumq welcome" in str(given_up.value)
    assert "not a quorumq client port (a node's Raft port" in str(given_up.value)
    assert took < 6.0, f"took {took:.1f} s"


@pytest.mark.parametrize("connect", [Client, _aio_connect], ids=["blocking", "aio"])
def test_endpoints_that_refuse_are_given_up_on_at_once(connect: object) -> None:
    """Issue 31: 5 s (the whole connect timeout; here 10 s) for a port nothing listens
    on; now a few rounds, 0.1 s apart."""
    endpoints = [f"127.0.0.1:{port}" for port in free_ports(2)]
    started = time.monotonic()
    with pytest.raises(UnreachableError) as given_up:
        connect(endpoints, connect_timeout=10.0, wait_for_nodes=False)  # type: ignore[operator]
    took = time.monotonic() - started
    assert sorted(given_up.value.refused) == sorted(endpoints)
    assert took < 2.0, f"took {took:.1f} s"


class SlowWelcome:
    """A proxy on 127.0.0.1 in front of a real node's client port that holds back what
    the node sends for `delay` seconds on each new connection: a node too loaded to
    send its welcome at once."""

    def __init__(self, target: tuple[str, int], delay: float) -> None:
        self.target = target
        self.delay = delay
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.sockets: list[socket.socket] = [self.listener]
        self.threads: list[threading.Thread] = []
        self._closed = False
        self._spawn(self._accept)

    def _spawn(self, target: Any, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self.threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            node = socket.create_connection(self.target)
            self.sockets += [client, node]
            self._spawn(self._pipe, client, node, 0.0)
            self._spawn(self._pipe, node, client, self.delay)

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket, delay: float) -> None:
        time.sleep(delay)  # the proxy's own behaviour, not a test's wait
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                sink.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._closed = True
        for sock in self.sockets:
            with contextlib.suppress(OSError):
                sock.close()
        for thread in self.threads:
            thread.join(timeout=5)


@pytest.fixture(scope="module")
def slow_node() -> Iterator[SlowWelcome]:
    """One real node, reached through a proxy that delays its welcome by 3.5 s: longer
    than `WELCOME_S`, shorter than the connect timeouts below."""
    with Cluster(1) as cluster:
        host, port = cluster.endpoint("A").rsplit(":", 1)
        proxy = SlowWelcome((host, int(port)), delay=WELCOME_S + 1.0)
        try:
            yield proxy
        finally:
            proxy.close()


def test_a_client_waiting_for_nodes_takes_a_late_welcome(slow_node: SlowWelcome) -> None:
    """A loaded node slow to welcome is still a node: the default client waits for it up
    to its connect timeout, not `WELCOME_S` (which cut every attempt, for good)."""
    started = time.monotonic()
    with Client(slow_node.endpoint, connect_timeout=10) as client:
        assert client.node == "A"
        # on the first attempt, once the welcome arrives: not after retries, nor at 10 s
        assert time.monotonic() - started < slow_node.delay + 3.0


def test_a_trio_client_waiting_for_nodes_takes_a_late_welcome(slow_node: SlowWelcome) -> None:
    async def main() -> str | None:
        async with quorumq.aio.connect(slow_node.endpoint, connect_timeout=10) as client:
            return client.node

    started = time.monotonic()
    assert trio.run(main) == "A"
    assert time.monotonic() - started < slow_node.delay + 3.0


def test_a_client_not_waiting_for_nodes_gives_up_on_a_late_welcome(
    slow_node: SlowWelcome,
) -> None:
    """The command line's client: an endpoint silent past `WELCOME_S` is reported."""
    started = time.monotonic()
    with pytest.raises(UnreachableError) as given_up:
        Client(slow_node.endpoint, connect_timeout=10, wait_for_nodes=False)
    assert given_up.value.silent == [slow_node.endpoint]
    assert time.monotonic() - started < WELCOME_S + 2.0


def test_a_client_that_keeps_trying_keeps_only_the_last_failures() -> None:
    """A hostile review: every failed attempt of a client that keeps trying (for its
    `timeout`, which may be hours) was kept, about ten a second per endpoint."""
    failures = ConnectFailures(2)
    for _ in range(10_000):
        failures.add("h:1", REFUSED)
        failures.add("h:2", OSError("timed out"))
    assert len(failures._errors) <= 12 and len(failures._stuck) <= REFUSED_ROUNDS * 2
    assert "h:2: timed out" in failures._message()
