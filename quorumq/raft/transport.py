"""The Raft port and its connections on a real node: PySyncObj's TCP server and
transport bounded (a backlog of `RAFT_LISTEN_BACKLOG`, up to `ACCEPTS_PER_WAKE` accepts a
wake, a spare descriptor for EMFILE, `MAX_UNAUTHENTICATED` peers that have not shown the
cluster secret, `RAFT_HANDSHAKE_S` to show it, messages of at most
`MAX_RAFT_MESSAGE_BYTES`), sealed with our cipher and not zlib-compressed. camelCase
names are PySyncObj's."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import pickle
import socket
import struct
import zlib
from collections.abc import Callable
from typing import Any

import pysyncobj.tcp_connection as _tcp
from pysyncobj.poller import POLL_EVENT_TYPE
from pysyncobj.tcp_connection import CONNECTION_STATE, TcpConnection
from pysyncobj.tcp_server import TcpServer
from pysyncobj.transport import TCPTransport

from .cipher import ThrottledWarning

logger = logging.getLogger(__name__)

MAX_RAFT_MESSAGE_BYTES = 32 * 1024 * 1024
"""The longest Raft message a node reads (AppendEntries batches are at most 4 MiB plus
one entry of at most 3 MiB; snapshot chunks are smaller). PySyncObj read whatever length
a peer declared, up to 2 GiB, before it authenticated anything."""
MAX_UNAUTHENTICATED = 32
"""Incoming Raft connections that have not yet shown the cluster secret, at most: one
more closes the oldest of them."""
RAFT_HANDSHAKE_S = 5.0
"""An incoming Raft connection that has not shown the cluster secret by then is closed."""


RAFT_LISTEN_BACKLOG = 128
"""Pending connections the Raft port's socket queues (PySyncObj listened with 5: a flood
of connections filled it, and a real peer's dials were dropped until it drained)."""
ACCEPTS_PER_WAKE = 64
"""Connections the Raft port accepts each time it is readable (PySyncObj took one: a
backlog of 1,000 took longer than 30 s to drain, ahead of any real peer)."""


class BoundedTcpServer(TcpServer):  # type: ignore[misc]
    """PySyncObj's Raft server socket, with a real backlog, accepting what is queued
    (up to `ACCEPTS_PER_WAKE`) at each wake, and never unbinding because an accept
    failed for want of a descriptor or memory (PySyncObj unbound, and the node stopped
    hearing its peers until the next bind retry)."""

    _busy = ThrottledWarning(
        logger, "the Raft port cannot accept a connection: out of file descriptors or memory"
    )

    def bind(self) -> None:
        if "_spare" not in self.__dict__:
            with contextlib.suppress(OSError):
                self.__dict__["_spare"] = os.open(os.devnull, os.O_RDONLY)
        try:
            super().bind()
        except OSError:
            # PySyncObj left the socket it made open, referenced from a cycle: a failed
            # `quorumq.Node(...).start()` on a taken port kept it until a collection
            self.unbind()
            raise
        self._TcpServer__socket.listen(RAFT_LISTEN_BACKLOG)

    def unbind(self) -> None:
        super().unbind()
        spare = self.__dict__.pop("_spare", None)
        if spare is not None:
            os.close(spare)

    def _TcpServer__onNewConnection(self, descr: Any, event: int) -> None:
        if event & POLL_EVENT_TYPE.READ:
            for _ in range(ACCEPTS_PER_WAKE):
                try:
                    sock, _addr = self._TcpServer__socket.accept()
                except BlockingIOError:
                    break
                except OSError as e:
                    if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                        self._busy()
                        self._shed_one()  # (the socket stays readable: not a busy loop)
                        break
                    if e.errno == errno.ECONNABORTED:
                        continue
                    self.unbind()
                    return
                self._accepted(sock)
        if event & POLL_EVENT_TYPE.ERROR:
            self.unbind()

    def _shed_one(self) -> None:
        """Out of descriptors: free the spare one, accept the oldest waiting connection
        and close it at once, and take the spare back. PySyncObj's poller is level-
        triggered, so leaving it queued would wake the Raft thread in a loop."""
        spare = self.__dict__.pop("_spare", None)
        if spare is not None:
            os.close(spare)
        try:
            sock, _addr = self._TcpServer__socket.accept()
            sock.close()
        except OSError:
            pass
        with contextlib.suppress(OSError):
            self.__dict__["_spare"] = os.open(os.devnull, os.O_RDONLY)

    def _accepted(self, sock: socket.socket) -> None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self._TcpServer__sendBufferSize)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self._TcpServer__recvBufferSize)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setblocking(False)
        except OSError:
            sock.close()  # reset before it was set up
            return
        conn = TcpConnection(
            poller=self._TcpServer__poller,
            socket=sock,
            timeout=self._TcpServer__connectionTimeout,
            sendBufferSize=self._TcpServer__sendBufferSize,
            recvBufferSize=self._TcpServer__recvBufferSize,
            keepalive=self._TcpServer__keepalive,
        )
        self._TcpServer__onNewConnectionCallback(conn)


class Transport(TCPTransport):  # type: ignore[misc]
    """PySyncObj's TCP transport, saying why a peer hangs up during the handshake, and
    bounding what peers that have not authenticated can make a node hold: at most
    `MAX_UNAUTHENTICATED` such connections, each for `RAFT_HANDSHAKE_S` at most (3
    connections each sending a 2 GiB length and 100 MiB took a node from 31 to 427 MiB,
    for good; messages are capped at `MAX_RAFT_MESSAGE_BYTES` on every connection).

    A dialling node sends its key sealed with its cluster secret; a peer with another
    secret cannot open it and closes the connection without a word. Seen from the
    dialling side, that is a connection accepted and then closed before the peer's key
    came back, again at every retry: log it, so the node with the wrong secret says so
    whichever side dials. (A peer that dies or restarts mid-handshake hangs up once.)"""

    HANG_UPS_BEFORE_WARNING = 3
    announce: Callable[[dict[str, Any]], None] | None = None
    """Stamps every message sent with what the member says of its cluster identity
    (`ClusterIdentity.stamp_identity`)."""

    def send(self, node: Any, message: Any) -> bool:
        if self.announce is not None and type(message) is dict:
            self.announce(message)
        return bool(super().send(node, message))

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._handshaking: set[int] = set()
        self._arrived: dict[Any, float] = {}
        """Incoming connections not yet authenticated, by the time they arrived (in order)."""
        self._hang_ups: dict[Any, int] = {}
        """Per peer: handshakes in a row it hung up on."""
        self._hung_up = ThrottledWarning(
            logger,
            "a Raft peer keeps hanging up during the handshake: it failed authentication: "
            "a peer uses another cluster secret (or is not a quorumq node)",
        )
        super().__init__(*args, **kwargs)

    def _createServer(self) -> None:
        super()._createServer()
        self._server.__class__ = BoundedTcpServer  # (not bound yet: binds as ours)

    def _onNewIncomingConnection(self, conn: Any) -> None:
        super()._onNewIncomingConnection(conn)
        self._arrived[conn] = _tcp.monotonicTime()
        while len(self._arrived) > MAX_UNAUTHENTICATED:
            oldest = next(iter(self._arrived))
            self._drop_unauthenticated(oldest, "too many connections without the secret")

    def _onIncomingMessageReceived(self, conn: Any, message: Any) -> None:
        super()._onIncomingMessageReceived(conn, message)
        if conn not in self._unknownConnections:  # it named itself: authenticated
            self._arrived.pop(conn, None)

    def _onTick(self) -> None:
        super()._onTick()
        if self._arrived:
            deadline = _tcp.monotonicTime() - RAFT_HANDSHAKE_S
            for conn, arrived in list(self._arrived.items()):
                if arrived < deadline:
                    self._drop_unauthenticated(conn, "no handshake in time")

    def _drop_unauthenticated(self, conn: Any, why: str) -> None:
        self._arrived.pop(conn, None)
        logger.info("closing an incoming Raft connection: %s", why)
        conn.disconnect()

    def _onOutgoingConnected(self, conn: Any) -> None:
        if self._syncObj.encryptor:
            self._handshaking.add(id(conn))
        super()._onOutgoingConnected(conn)

    def _onOutgoingMessageReceived(self, conn: Any, message: Any) -> None:
        if id(conn) in self._handshaking:
            self._handshaking.discard(id(conn))
            self._hang_ups.pop(self._connToNode(conn), None)
        super()._onOutgoingMessageReceived(conn, message)

    def addNode(self, node: Any) -> None:
        """Once per node: a leader reached outside the configuration
        (`RaftRules._reach_leader`) is added again when its entry is applied, and
        PySyncObj's second connection object would orphan the first."""
        if node in self._nodes:
            return
        super().addNode(node)

    def dropNode(self, node: Any) -> None:
        """PySyncObj's, telling the member the connection is gone: it forgot the
        connection before closing it, so the member took the node as connected for
        good (and forwarded proposals to a leader it no longer had a connection to)."""
        connected = node in self._connections and self._connections[node].state == (
            CONNECTION_STATE.CONNECTED
        )
        super().dropNode(node)
        if connected:
            self._onNodeDisconnected(node)

    def _onDisconnected(self, conn: Any) -> None:
        self._arrived.pop(conn, None)
        if id(conn) in self._handshaking:
            self._handshaking.discard(id(conn))
            peer = self._connToNode(conn)
            self._hang_ups[peer] = self._hang_ups.get(peer, 0) + 1
            if self._hang_ups[peer] >= self.HANG_UPS_BEFORE_WARNING:
                self._hung_up()
        super()._onDisconnected(conn)


class _DropBindFailure(logging.Filter):
    """PySyncObj logs a traceback when it cannot bind, and a warning at every tick while
    compaction fails; RaftMember reports each in one line (`compaction_error`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() not in (
            "failed to perform initialization",
            "Failed to store full dump",
        )


logging.getLogger("pysyncobj.syncobj").addFilter(_DropBindFailure())


def _send(self: Any, message: Any) -> None:
    """PySyncObj's `TcpConnection.send`, without compression: zlib level 3 was the
    largest single cost of a busy leader (message bodies are often incompressible).
    The receiver's `zlib.decompress` reads the stored blocks as before."""
    if self.sendRandKey:
        message = (self.sendRandKey, message)
    data = zlib.compress(pickle.dumps(message), 0)
    if self.encryptor:
        data = self.encryptor.encrypt_at_time(data, int(_tcp.monotonicTime()))
    self._TcpConnection__writeBuffer += struct.pack("i", len(data)) + data
    self._TcpConnection__trySendBuffer()


_read_more = TcpConnection._TcpConnection__processRead


def _process_read(self: Any) -> bool:
    """PySyncObj's read, bounded: a declared length outside (0, `MAX_RAFT_MESSAGE_BYTES`]
    closes the connection, and reading stops once a whole message's worth is buffered
    (PySyncObj read everything the peer sent before it parsed anything)."""
    more = bool(_read_more(self))
    buffer = self._TcpConnection__readBuffer
    if len(buffer) >= 4:
        (length,) = struct.unpack_from("i", buffer)
        if not 0 < length <= MAX_RAFT_MESSAGE_BYTES:
            logger.warning("closing a Raft connection that announced a %d-byte message", length)
            self.disconnect()
            return False
        if len(buffer) > 4 + length:
            return False  # parse what is there first
    return more


TcpConnection.send = _send
TcpConnection._TcpConnection__processRead = _process_read
