"""A quorumq node on trio: its replica, and the trio shell around the node core.

Everything the node decides is in `quorumq.node.NodeCore`; this module is its I/O. It
starts the replica, listens for clients, and for each connection runs a reader (bytes
to the core, while the core wants them: back-pressure) and a writer (the core's frames
to the socket). A task runs the core's timers. The replica's Raft thread hands effects
and proposal outcomes to trio only through the trio token (`run_sync_soon`, which never
blocks it); the core only ever runs on the trio thread.

With a certificate (`NodeConfig.tls_cert`) the client port speaks TLS only
(`trio.SSLStream` over the standard library's `ssl`): each connection's handshake runs
before its reader and writer start, within the core's handshake deadline, and a failed
one ends that connection alone, with a log line.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import socket
import ssl
import time
from collections.abc import Callable
from typing import Any, TypeVar

import trio

from .. import pathtiming
from ..counters import QueueCounters
from ..machine import Command, Effect, Machine, Reply
from ..metrics import NodeMetrics
from ..node import ConnectionCore, NodeConfig, NodeCore, check_node_config
from ..node.core import ProposalCallback
from ..protocol import encode_frame, keep_alive
from ..replica import ConfigError, ProposalError, Replica

logger = logging.getLogger(__name__)

T = TypeVar("T")

RECEIVE_CHUNK = 256 * 1024
WRITE_BYTES = 1024 * 1024
"""The writer joins queued frames into one write of about this many bytes at most."""
CLOSE_FLUSH_SECONDS = 5.0
"""How long a closing connection may take to send what it has queued."""

TLS_HANDSHAKE_RECORD = 0x16
"""The first byte a TLS client sends (a handshake record): any other is not TLS."""

ClientStream = trio.SocketStream | trio.SSLStream[trio.SocketStream]

__all__ = ["NodeConfig", "NodeServer", "check_node_config", "tls_context"]


def tls_context(config: NodeConfig) -> ssl.SSLContext | None:
    """The client port's TLS context (TLS 1.2 at least), or None without a certificate;
    `ConfigError` (one line) if the certificate or its key cannot be loaded."""
    if config.tls_cert is None or config.tls_key is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.options |= ssl.OP_NO_RENEGOTIATION
    try:
        context.load_cert_chain(config.tls_cert, config.tls_key)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(
            f"cannot load the TLS certificate {config.tls_cert} with the key {config.tls_key}: {e}"
        ) from None
    return context


_TLS_REQUIRED = {
    "t": "error",
    "id": None,
    "code": "tls_required",
    "message": "this node serves clients over TLS only: connect with TLS (tls=True, or "
    "tls= the CA file that signed its certificate; quorumq --tls or --tls-ca FILE)",
}
"""What a client without TLS is told, in plain text, in place of a `welcome`."""


def _peer_name(stream: trio.SocketStream) -> str:
    try:
        host, port = stream.socket.getpeername()[:2]
    except OSError:
        return "a peer gone already"
    return f"{host}:{port}"


class _LoopReplica:
    """The replica as the core sees it: outcomes arrive on the trio thread."""

    def __init__(
        self,
        replica: Replica,
        soon: Callable[..., None],
        timed: Callable[[Command, float], None] | None = None,
    ) -> None:
        """`timed(command, seconds)`: told how long each proposal with a callback took
        to commit and apply (the metrics' histogram), if given."""
        self._replica = replica
        self._soon = soon
        self._timed = timed
        self.node_id = replica.node_id

    def propose(self, command: Command, callback: ProposalCallback | None = None) -> None:
        if callback is None:
            self._replica.propose(command)
        elif self._timed is None:
            self._replica.propose(command, lambda reply, error: self._soon(callback, reply, error))
        else:
            timed, started = self._timed, time.perf_counter()

            def done(reply: Reply | None, error: ProposalError | None) -> None:
                if error is None:
                    timed(command, time.perf_counter() - started)
                self._soon(callback, reply, error)

            self._replica.propose(command, done)

    def query(self, read: Callable[[Machine], T]) -> T:
        return self._replica.query(read)

    def members(self) -> dict[str, str]:
        return self._replica.members()

    def status(self, *, audit: bool = False) -> dict[str, Any]:
        return self._replica.status(audit=audit)

    def add_member(
        self, name: str, address: str, callback: Callable[[ProposalError | None], None]
    ) -> None:
        self._replica.add_member(name, address, lambda error: self._soon(callback, error))

    def remove_member(self, name: str, callback: Callable[[ProposalError | None], None]) -> None:
        self._replica.remove_member(name, lambda error: self._soon(callback, error))

    def ask_leader_to_step_down(self) -> None:
        self._replica.ask_leader_to_step_down()

    def membership_settled(self) -> bool:
        return self._replica.membership_settled()


class _Link:
    """One connection's trio side: its stream, and what wakes its reader and writer."""

    def __init__(self, stream: ClientStream) -> None:
        self.stream = stream
        self.reader_event = trio.Event()
        self.writer_event = trio.Event()
        self.handshaking = trio.CancelScope()
        """The TLS handshake: the core ending the connection (its handshake deadline, an
        eviction) cancels it."""
        self.reading = trio.CancelScope()
        self.scope = trio.CancelScope()

    def poke(self) -> None:
        self.reader_event.set()
        self.writer_event.set()

    async def reader_waits(self) -> None:
        await self.reader_event.wait()
        self.reader_event = trio.Event()

    async def writer_waits(self) -> None:
        await self.writer_event.wait()
        self.writer_event = trio.Event()


class NodeServer:
    """A node's trio shell: `await serve()` runs it until cancelled."""

    def __init__(self, config: NodeConfig, *, metrics: tuple[str, int] | None = None) -> None:
        """`metrics`: serve Prometheus metrics over HTTP on this (host, port)."""
        check_node_config(config)
        self.config = config
        self.tls = tls_context(config)
        """The client port's TLS context, or None (plain TCP)."""
        self.metrics = NodeMetrics() if metrics is not None else None
        self._metrics_address = metrics
        self.node_id = config.replica.node_id
        self._token: trio.lowlevel.TrioToken | None = None
        self._replica: Replica | None = None
        self._core: NodeCore | None = None
        self._links: dict[ConnectionCore, _Link] = {}
        self._timers_changed = trio.Event()
        self._nursery: trio.Nursery | None = None
        self.listeners: list[trio.SocketListener] = []
        self.counters = QueueCounters()
        """What the replica applied, per queue (status and metrics)."""

    @property
    def replica(self) -> Replica:
        assert self._replica is not None, "the node is not serving"
        return self._replica

    @property
    def core(self) -> NodeCore:
        assert self._core is not None, "the node is not serving"
        return self._core

    # what tests look at
    @property
    def connections(self) -> set[ConnectionCore]:
        return self.core.connections

    @property
    def consumers(self) -> dict[str, ConnectionCore]:
        return self.core.consumers

    @property
    def unauthenticated(self) -> dict[ConnectionCore, None]:
        return self.core.unauthenticated

    def status(self) -> dict[str, Any]:
        return self.core.status()

    # ------------------------------------------------------------------ serve

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Start the replica, listen for clients; `task_status.started(listeners)`."""
        self._token = trio.lowlevel.current_trio_token()
        if pathtiming.ENABLED:
            pathtiming.name_process(self.node_id)
        self._replica = await trio.to_thread.run_sync(
            lambda: Replica(
                self.config.replica,
                self._on_effects,
                self._on_state_replaced,
                observer=self.counters,
            )
        )
        # What start-up made (modules, the state loaded from disk) lives as long as the
        # node: out of the collector's sight, its full passes scan only what came since
        # (a full pass over it took 10-20 ms, a stall of every message in flight).
        gc.freeze()
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                timed = self.metrics.observe_proposal if self.metrics is not None else None
                self._core = NodeCore(
                    self.config,
                    _LoopReplica(self.replica, self._soon, timed),
                    self,
                    trio.current_time,
                )
                self._core.queue_counts = self.counters.counts
                if self.metrics is not None and self._metrics_address is not None:
                    core = self._core
                    self.metrics.attach(self.replica, self.counters, lambda: len(core.connections))
                    self.metrics.serve(*self._metrics_address)
                self.listeners = await trio.open_tcp_listeners(
                    self.config.listen_port, host=self.config.listen_host
                )
                task_status.started(self.listeners)
                nursery.start_soon(self._run_timers)
                nursery.start_soon(self._stop_if_raft_stopped)
                if self.tls is None:
                    await trio.serve_listeners(self._serve_client, self.listeners)
                else:  # as trio.open_ssl_over_tcp_listeners, on the listeners opened above
                    # https_compatible: closing sends no close_notify, so a client that
                    # does not read cannot hold a closing connection (frames carry their
                    # length: a connection cut short cannot pass for a whole frame)
                    secure = [
                        trio.SSLListener(listener, self.tls, https_compatible=True)
                        for listener in self.listeners
                    ]
                    await trio.serve_listeners(self._serve_client, secure)
        finally:
            with trio.CancelScope(shield=True):
                if self.metrics is not None:
                    await trio.to_thread.run_sync(self.metrics.stop)
                await trio.to_thread.run_sync(self.replica.stop)

    async def _stop_if_raft_stopped(self) -> None:
        """A member whose journal failed has stopped acknowledging: the node stops too
        (exit non-zero, with the reason) rather than answer every client "unknown"."""
        while True:
            error = self.replica.member.fatal_error
            if error is not None:
                raise error
            await trio.sleep(0.2)

    async def _run_timers(self) -> None:
        core = self.core
        while True:
            deadline = core.next_timer()
            with trio.move_on_at(math.inf if deadline is None else deadline):
                await self._timers_changed.wait()
            self._timers_changed = trio.Event()
            core.run_timers()

    async def _serve_client(self, stream: ClientStream) -> None:
        core = self.core
        raw = stream.transport_stream if isinstance(stream, trio.SSLStream) else stream
        keep_alive(raw.socket)  # a client whose host vanished gives its consumers up
        conn = core.connection_made()
        conn.transport = stream
        link = self._links[conn] = _Link(stream)
        try:
            with link.scope:
                if isinstance(stream, trio.SSLStream) and not await self._start_tls(
                    conn, link, stream
                ):
                    return
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._write, conn, link)
                    with link.reading:
                        await self._read(conn, link)
                    if not conn.done:
                        conn.close("the client went away")
                    link.poke()
                    # the writer flushes what is queued (an error frame, say), then ends
                    nursery.cancel_scope.deadline = trio.current_time() + CLOSE_FLUSH_SECONDS
        except Exception:  # nothing here may take the node down: this connection only
            logger.exception("client connection %d failed; closing it", conn.number)
        finally:
            del self._links[conn]
            core.connection_lost(conn)
            with trio.CancelScope(shield=True):
                await stream.aclose()

    async def _start_tls(
        self, conn: ConnectionCore, link: _Link, stream: trio.SSLStream[trio.SocketStream]
    ) -> bool:
        """The TLS handshake, before the connection's reader and writer start (its
        `welcome` waits in the outbox). It counts against the core's handshake deadline:
        the core closing the connection cancels it, so a peer that stalls mid-handshake
        is dropped as one that never says `hello`. A peer silent for `tls_silence_s`, or
        whose first byte cannot begin TLS, is a client without TLS: it gets a plain
        `tls_required` error frame. False, with a log line, if there is no TLS session."""
        raw = stream.transport_stream
        peer = _peer_name(raw)
        why = None
        with link.handshaking:
            first = None
            with trio.move_on_after(self.config.tls_silence_s):
                try:
                    first = await raw.socket.recv(1, socket.MSG_PEEK)
                except OSError:
                    first = b""
            if first == b"":
                logger.info("client connection %d from %s left before TLS", conn.number, peer)
                return False
            if first is None or first[0] != TLS_HANDSHAKE_RECORD:
                logger.warning(
                    "client connection %d from %s %s (a client without TLS?): told it this "
                    "port is TLS only; closing it",
                    conn.number,
                    peer,
                    "sent nothing" if first is None else "did not begin a TLS handshake",
                )
                with trio.move_on_after(1.0), contextlib.suppress(trio.BrokenResourceError):
                    await raw.send_all(encode_frame(_TLS_REQUIRED))
                return False
            try:
                await stream.do_handshake()
            except trio.BrokenResourceError as e:
                why = f"TLS handshake failed: {e.__cause__ or e}"
                if getattr(e.__cause__, "reason", None) == "UNEXPECTED_EOF_WHILE_READING":
                    why = (
                        "the client hung up during the TLS handshake (does it trust the CA "
                        "that signed this node's certificate?)"
                    )
            else:
                return True
        if why is None:  # the core ended it: its handshake deadline, or an eviction
            why = f"no TLS handshake in time ({conn.close_reason})"
        logger.warning("client connection %d from %s: %s; closing it", conn.number, peer, why)
        return False

    async def _read(self, conn: ConnectionCore, link: _Link) -> None:
        """Bytes to the core while it wants them (a client whose replies wait unread, or
        whose commands wait to commit, is not read: back-pressure)."""
        core = self.core
        while not conn.done:
            if not conn.wants_data:
                await link.reader_waits()
                continue
            try:
                data = await link.stream.receive_some(RECEIVE_CHUNK)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return
            if not data:
                return
            core.data_received(conn, data)

    async def _write(self, conn: ConnectionCore, link: _Link) -> None:
        core = self.core
        while not conn.aborted:
            if conn.outbox:
                data, frames, cost = conn.take_output(WRITE_BYTES)
                try:
                    await link.stream.send_all(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    link.scope.cancel()
                    return
                core.sent(conn, frames, cost)
            elif conn.done:
                link.reading.cancel()  # everything is written: the connection ends
                return
            else:
                await link.writer_waits()
        link.scope.cancel()

    # ------------------------------------------------------ the core's shell

    def wake(self, conn: ConnectionCore) -> None:
        link = self._links.get(conn)
        if link is None:
            return  # not served yet: its writer starts with what is queued
        link.poke()
        if conn.aborted:
            link.scope.cancel()
        elif conn.done:
            link.handshaking.cancel()
            link.reading.cancel()

    def timers_changed(self) -> None:
        self._timers_changed.set()

    def run_in_worker(
        self, work: Callable[[], Any], done: Callable[[Any, BaseException | None], None]
    ) -> None:
        async def run() -> None:
            try:
                result = await trio.to_thread.run_sync(work, abandon_on_cancel=True)
            except Exception as e:
                done(None, e)
            else:
                done(result, None)

        assert self._nursery is not None
        self._nursery.start_soon(run)

    # ------------------------------------------------ from the Raft thread

    def _soon(self, fn: Any, *args: Any) -> None:
        assert self._token is not None
        with contextlib.suppress(trio.RunFinishedError):
            self._token.run_sync_soon(fn, *args)

    def _on_effects(self, index: int, effects: tuple[Effect, ...]) -> None:
        self._soon(self._effects, index, effects)

    def _effects(self, index: int, effects: tuple[Effect, ...]) -> None:
        if pathtiming.ENABLED:
            pathtiming.mark("node.effects", ("i", index))
        if self._core is not None:
            self._core.effects_applied(index, effects)

    def _on_state_replaced(self) -> None:
        self._soon(self._state_replaced)

    def _state_replaced(self) -> None:
        if self._core is not None:  # the node's own snapshot at start-up: nobody is connected
            self._core.state_replaced()
