"""A quorumq node on trio: its replica, and the trio shell around the node core.

Everything the node decides is in `quorumq.node.NodeCore`; this module is its I/O. It
starts the replica, listens for clients, and for each connection runs a reader (bytes
to the core, while the core wants them: back-pressure) and a writer (the core's frames
to the socket). A task runs the core's timers. The replica's Raft thread hands effects
and proposal outcomes to trio only through the trio token (`run_sync_soon`, which never
blocks it); the core only ever runs on the trio thread.

Clients in the node's own process (`quorumq.Node`) connect with `open_local_connection`:
the same reader and writer, over an in-process connection of frames
(`quorumq.wire.inprocess`) in place of a socket, under the same bounds.

Stopping (cancelling `serve`) ends every connection (their consumers' `Down` proposed),
waits for those to commit, hands leadership over if this node leads
(`Replica.ask_leader_to_step_down`, Raft's TimeoutNow), then stops the replica: the
journal closed, the Raft thread joined. Blocking work runs in threads of its own,
joined before `serve` returns, so a node leaves no thread behind in its process.

With a certificate (`NodeConfig.tls_cert`) the client port speaks TLS only
(`trio.SSLStream` over the standard library's `ssl`): each connection's handshake runs
before its reader and writer start, within the core's handshake deadline, and a failed
one ends that connection alone, with a log line.

The replica as the core sees it and one connection's bytes are `links.py`; taking the
data directory, threads of their own and the TLS context are `startup.py`.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import os
import socket
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import trio

from .. import pathtiming
from ..machine import Effect
from ..node import ConnectionCore, NodeConfig, NodeCore, check_node_config
from ..node.config import DISK_CHECK_EVERY_S, START_FREE_BYTES, disk_check_in_s
from ..replica import ConfigError, MemberFactory, Replica, file_usage
from ..replica.groups import NodeReplicas, check_group_count
from ..wire.inprocess import FrameChannel, open_connection
from ..wire.protocol import Frame, SizedFrame, encode_frame, keep_alive
from .counters import QueueCounters
from .file_budget import client_caps, current_file_limit, raise_file_limit
from .links import ClientStream, Link, LoopReplica, StreamTransport, peer_name
from .metrics import NodeMetrics
from .metrics_http import MetricsServer
from .startup import in_own_thread, lock_data_dir, tls_context

logger = logging.getLogger(__name__)

T = TypeVar("T")

DISK_WAIT_LOG_S = 30.0
WRITE_BYTES = 1024 * 1024
"""The writer joins queued frames into one write of about this many bytes at most."""
CLOSE_FLUSH_SECONDS = 5.0
"""How long a closing connection may take to send what it has queued."""
SETTLE_AT_STOP_S = 2.0
"""At a stop, how long the node waits for its consumers' `Down`s (proposed as their
connections ended) to be applied."""
HANDOVER_S = 3.0
"""At a stop, how long a leader tries to hand leadership over before it stops anyway
(then the others elect one after their election timeout)."""
FATAL_CHECK_EVERY_S = 5.0
"""The Raft member says when it stopped by itself (`on_fatal`); this is a backstop."""

TLS_HANDSHAKE_RECORD = 0x16
"""The first byte a TLS client sends (a handshake record): any other is not TLS."""


__all__ = ["NodeConfig", "NodeServer", "check_node_config", "lock_data_dir", "tls_context"]


_TLS_REQUIRED = {
    "t": "error",
    "id": None,
    "code": "tls_required",
    "message": "this node serves clients over TLS only: connect with TLS (tls=True, or "
    "tls= the CA file that signed its certificate; quorumq --tls or --tls-ca FILE)",
}
"""What a client without TLS is told, in plain text, in place of a `welcome`."""


class NodeServer:
    """A node's trio shell: `await serve()` runs it until cancelled."""

    def __init__(
        self,
        config: NodeConfig,
        *,
        metrics: tuple[str, int] | None = None,
        freeze_startup: bool = True,
    ) -> None:
        """`metrics`: serve Prometheus metrics over HTTP on this (host, port).
        `freeze_startup`: move what exists once the replica has started out of the
        garbage collector's sight (`gc.freeze`): right for a node process, not for a node
        in a program's own process, whose objects it would freeze too."""
        check_node_config(config)
        # A node process raises its own soft limit; a node in a program's process leaves
        # the program's as it is (raising it would let the program's select() break)
        self.file_limit = raise_file_limit() if freeze_startup else current_file_limit()
        opened = file_usage()["files_open"] or 0
        self.config = config = client_caps(config, self.file_limit, opened)
        self.tls = tls_context(config)
        """The client port's TLS context, or None (plain TCP)."""
        self.metrics = NodeMetrics() if metrics is not None else None
        self._metrics_address = metrics
        self._metrics_listeners: list[trio.SocketListener] = []
        self.metrics_server = MetricsServer(self.metrics.render) if self.metrics else None
        """The bounded HTTP server of the metrics (None without `metrics`)."""
        self.node_id = config.replica.node_id
        self._token: trio.lowlevel.TrioToken | None = None
        self._replica: Replica | None = None
        self._replicas: list[Replica] = []
        """Every group's replica, group 0's (`replica`) first."""
        self._groups: NodeReplicas | None = None
        self._core: NodeCore | None = None
        self._links: dict[ConnectionCore, Link] = {}
        self._timers_changed = trio.Event()
        self._nursery: trio.Nursery | None = None
        self.listeners: list[trio.SocketListener] = []
        self.counters = QueueCounters()
        """What the replica applied, per queue (status and metrics)."""
        self.freeze_startup = freeze_startup
        self._workers: set[threading.Thread] = set()
        """Threads of `run_in_worker` (audits) that may still run: joined at the stop."""

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
        """Start the replica, listen for clients; `task_status.started(listeners)`; serve
        until cancelled, then stop (see the module's docstring)."""
        await self.start()
        await self.run(task_status=task_status)

    async def start(self) -> None:
        """Start the replica (recovering what `data_dir` holds) and open the client port,
        if any. Errors are raised as they are (a Raft port in use, a damaged journal);
        then `run` serves."""
        self._token = trio.lowlevel.current_trio_token()
        if pathtiming.ENABLED:
            pathtiming.name_process(self.node_id)
        if self.freeze_startup and self.config.min_free_disk_bytes > 0:
            await self._wait_for_disk_space()  # (a node in a program fails at once instead)
        self._replica = await in_own_thread(
            self._start_replicas, name=f"quorumq-start-{self.node_id}"
        )
        try:
            if self.config.listen_port is not None:
                self.listeners = await _listen(
                    self.config.listen_host, self.config.listen_port, "the client port"
                )
            if self.metrics is not None and self._metrics_address is not None:
                host, port = self._metrics_address
                self._metrics_listeners = await _listen(host, port, "the metrics port")
                bound = self._metrics_listeners[0].socket.getsockname()
                self.metrics.address = (str(bound[0]), int(bound[1]))
        except BaseException:
            for listener in [*self.listeners, *self._metrics_listeners]:
                await listener.aclose()
            await in_own_thread(self._stop_replicas, name=f"quorumq-stop-{self.node_id}")
            raise
        if self.freeze_startup:
            # What start-up made (modules, the state loaded from disk) lives as long as
            # the node: out of the collector's sight, its full passes scan only what came
            # since (a full pass over it took 10-20 ms, a stall of every message in flight).
            gc.freeze()

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Serve clients, after `start`, until cancelled (`task_status.started(listeners)`
        once serving); then stop: end the connections, let their consumers' `Down`s
        land, hand leadership over if this node leads, stop the replica."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                timed = self.metrics.observe_proposal if self.metrics is not None else None
                groups = [LoopReplica(r, self._soon, timed) for r in self._replicas]
                self._core = NodeCore(
                    self.config, groups[0], self, trio.current_time, groups=groups
                )
                self._core.queue_counts = self.counters.counts
                if self.metrics is not None and self.metrics_server is not None:
                    core = self._core
                    self.metrics.attach(
                        self.replica,
                        self.counters,
                        lambda: len(core.connections),
                        lambda: (core.free_disk_bytes, core.disk_alarm),
                        self._replicas,
                    )
                    nursery.start_soon(self.metrics_server.serve, self._metrics_listeners)
                task_status.started(self.listeners)
                nursery.start_soon(self._run_timers)
                nursery.start_soon(self._watch_disk)
                nursery.start_soon(self._stop_if_raft_stopped)
                if not self.listeners:
                    await trio.sleep_forever()  # clients in this process only
                elif self.tls is None:
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
            self._nursery = None
            with trio.CancelScope(shield=True):
                if self._core is not None:
                    await self._settle_and_hand_over()
                for listener in [*self.listeners, *self._metrics_listeners]:
                    await listener.aclose()
                await in_own_thread(self._stop_replicas, name=f"quorumq-stop-{self.node_id}")
                for worker in list(self._workers):
                    await in_own_thread(worker.join, name=f"quorumq-stop-{self.node_id}")

    def _start_replicas(self) -> Replica:
        """Start this node's replica, or with groups every group's on one engine
        (`NodeReplicas`): group 0's."""
        config = self.config.replica

        def build(group: int, member_factory: MemberFactory | None = None) -> Replica:
            return Replica(
                config,
                self._on_effects,
                lambda: self._on_state_replaced(group),
                observer=self.counters,
                on_ends_moved=self._on_ends_moved,
                member_factory=member_factory,
            )

        check_group_count(config.data_dir, config.groups)  # (a node of one group too)
        if config.groups == 1:
            self._replicas = [build(0)]
        else:
            self._groups = NodeReplicas(config, build)
            self._replicas = self._groups.replicas
        return self._replicas[0]

    def _stop_replicas(self) -> None:
        if self._groups is not None:
            self._groups.stop()
        else:
            for replica in self._replicas:
                replica.stop()

    async def _wait_for_disk_space(self) -> None:
        """Before the replica starts: wait while the data disk has less than
        `START_FREE_BYTES` free. A node whose disk filled stopped at its next journal
        write; started again on the full disk it failed at once, and a supervisor
        restarted it in a loop. Now it waits, saying so every `DISK_WAIT_LOG_S`."""
        said = -math.inf
        while True:
            free = await self._free_disk_bytes()
            if free is None or free >= START_FREE_BYTES:
                # (None: no directory yet: the replica makes it, or says why not)
                return
            if trio.current_time() - said >= DISK_WAIT_LOG_S:
                said = trio.current_time()
                logger.warning(
                    "node %s: its data disk has %d KiB free: waiting for %d KiB before "
                    "starting (nothing is lost meanwhile)",
                    self.node_id,
                    free // 1024,
                    START_FREE_BYTES // 1024,
                )
            await trio.sleep(DISK_CHECK_EVERY_S)

    async def _watch_disk(self) -> None:
        """Tell the core the data disk's free space (the disk alarm, `NodeCore.disk_free`),
        every `DISK_CHECK_EVERY_S` near the limit, less often with room to spare
        (`disk_check_in_s`)."""
        limit = self.config.min_free_disk_bytes
        while True:
            free = await self._free_disk_bytes()
            self.core.disk_free(free)
            await trio.sleep(disk_check_in_s(free, limit))

    async def _free_disk_bytes(self) -> int | None:
        """The data disk's free space (statvfs, off the loop); None if unreadable."""
        try:
            st = await trio.to_thread.run_sync(os.statvfs, self.config.replica.data_dir)
        except OSError:
            return None
        return int(st.f_bavail * st.f_frsize)

    async def _settle_and_hand_over(self) -> None:
        """At a stop, once the connections ended: wait (up to `SETTLE_AT_STOP_S`) until
        the replica holds no consumer of this node, their `Down`s committed and applied
        (their messages go to other consumers now, not after the grace period that
        marks this node down); then, if this node leads and a peer is connected, ask it
        to hand leadership over, again until it no longer leads (up to `HANDOVER_S`):
        the others need not wait out an election timeout."""
        node = self.node_id
        replicas = self._replicas
        if any(r.member.fatal_error is not None for r in replicas):
            return
        with trio.move_on_after(SETTLE_AT_STOP_S):
            while any(r.query(lambda m: m.consumers_on(node)) for r in replicas):  # noqa: ASYNC110 - no event to wait on: polls the replicas
                await trio.sleep(0.02)

        def leading() -> list[Replica]:
            return [
                r for r in replicas if r.member.is_leader() and any(r.member.connected().values())
            ]

        if not leading():
            return
        with trio.move_on_after(HANDOVER_S):
            while led := leading():
                for replica in led:
                    replica.ask_leader_to_step_down()
                await trio.sleep(0.05)
        still = [g for g, r in enumerate(replicas) if r.member.is_leader()]
        if still:
            logger.warning(
                "stopping as leader of group(s) %s: no handover within %s s", still, HANDOVER_S
            )
        else:
            logger.info(
                "handed leadership over, stopping (leader now: %s)",
                self.replica.status()["leader"],
            )

    async def _stop_if_raft_stopped(self) -> None:
        """A member whose journal failed has stopped acknowledging: the node stops too
        (exit non-zero, with the reason) rather than answer every client "unknown".
        Told by the member (`on_fatal`), not by polling it: an idle node's loop sleeps."""
        members = [r.member for r in self._replicas]
        stopped = trio.Event()
        for member in members:  # any group's: the node cannot serve that group's queues
            member.on_fatal = lambda: self._soon(stopped.set)
        while (failed := next((m for m in members if m.fatal_error is not None), None)) is None:
            with trio.move_on_after(FATAL_CHECK_EVERY_S):  # (a backstop)
                await stopped.wait()
        assert failed.fatal_error is not None
        raise failed.fatal_error

    async def _run_timers(self) -> None:
        core = self.core
        while True:
            deadline = core.next_timer()
            with trio.move_on_at(math.inf if deadline is None else deadline):
                await self._timers_changed.wait()
            self._timers_changed = trio.Event()
            core.run_timers()

    async def _serve_client(self, stream: ClientStream) -> None:
        raw = stream.transport_stream if isinstance(stream, trio.SSLStream) else stream
        keep_alive(raw.socket)  # a client whose host vanished gives its consumers up
        conn = self.core.connection_made()
        conn.transport = stream
        tls = stream if isinstance(stream, trio.SSLStream) else None
        await self._serve_connection(conn, Link(StreamTransport(stream)), tls)

    def open_local_connection(self) -> tuple[FrameChannel[Frame], FrameChannel[SizedFrame]]:
        """A connection for a client in this process (call on the node's trio loop): the
        channels of the client's end, frames to it and frames to the node
        (`quorumq.wire.inprocess`). `ConfigError` if the node is not serving."""
        if self._nursery is None or self._token is None:
            raise ConfigError(f"node {self.node_id} is not serving")
        end, to_client, to_node = open_connection(self._token)
        conn = self.core.connection_made(local=True)
        self._nursery.start_soon(self._serve_connection, conn, Link(end), None)
        return to_client, to_node

    async def _serve_connection(
        self,
        conn: ConnectionCore,
        link: Link,
        tls: trio.SSLStream[trio.SocketStream] | None,
    ) -> None:
        """Run `conn`'s reader and writer until it ends (after the TLS handshake, if
        `tls`); then tell the core it is gone."""
        core = self.core
        self._links[conn] = link
        try:
            with link.scope:
                if tls is not None and not await self._start_tls(conn, link, tls):
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
                await link.transport.aclose()

    async def _start_tls(
        self, conn: ConnectionCore, link: Link, stream: trio.SSLStream[trio.SocketStream]
    ) -> bool:
        """The TLS handshake, before the connection's reader and writer start (its
        `welcome` waits in the outbox). It counts against the core's handshake deadline:
        the core closing the connection cancels it, so a peer that stalls mid-handshake
        is dropped as one that never says `hello`. A peer silent for `tls_silence_s`, or
        whose first byte cannot begin TLS, is a client without TLS: it gets a plain
        `tls_required` error frame. False, with a log line, if there is no TLS session."""
        raw = stream.transport_stream
        peer = peer_name(raw)
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

    async def _read(self, conn: ConnectionCore, link: Link) -> None:
        """Bytes to the core while it wants them (a client whose replies wait unread, or
        whose commands wait to commit, is not read: back-pressure)."""
        core = self.core
        feed: Callable[[ConnectionCore, Any], None] = (
            core.frames_received if conn.local else core.data_received
        )
        while not conn.done:
            if not conn.wants_data:
                await link.reader_waits()
                continue
            try:
                data = await link.transport.receive()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return
            if not data:
                return
            feed(conn, data)

    async def _write(self, conn: ConnectionCore, link: Link) -> None:
        core = self.core
        while not conn.aborted:
            if conn.outbox:
                data, frames, cost = conn.take_output(WRITE_BYTES)
                try:
                    await link.transport.send(data, cost)
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
        def run() -> None:
            try:
                result = work()
            except Exception as e:
                self._soon(done, None, e)
            else:
                self._soon(done, result, None)
            finally:
                self._workers.discard(thread)

        # a thread of its own (joined at the stop), not trio's: see `in_own_thread`
        thread = threading.Thread(target=run, name=f"quorumq-worker-{self.node_id}", daemon=True)
        self._workers.add(thread)
        thread.start()

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

    def _on_state_replaced(self, group: int = 0) -> None:
        self._soon(self._state_replaced, group)

    def _on_ends_moved(self) -> None:
        self._soon(self._ends_moved)

    def _ends_moved(self) -> None:
        if self._core is not None:
            self._core.ends_moved()

    def _state_replaced(self, group: int) -> None:
        if self._core is not None:  # the node's own snapshot at start-up: nobody is connected
            self._core.state_replaced(group)


async def _listen(host: str | None, port: int, what: str) -> list[trio.SocketListener]:
    """Listen on `host:port`; a port taken or refused says which address, and for what
    (the error said only "Address already in use")."""
    try:
        return await trio.open_tcp_listeners(port, host=host)
    except OSError as e:
        raise OSError(e.errno, f"{what}, {host or '*'}:{port}: {e.strerror}") from None
