"""The blocking client's connection to a node: a socket, plain or TLS (`Wire`), or an
in-process one (`Link`, `Dialer`: what the client needs of either).

TLS runs over memory BIOs (`ssl.SSLObject`), not an `ssl.SSLSocket`: the client's
reader thread waits in `recv` while other threads write, and OpenSSL does not allow one
SSL object to be used by two threads at once. Here every call into the SSL object is
made under a lock, and the socket is read and written outside it, so the socket keeps
what the plain client relies on: writes that end by a deadline (`send_by`), and a
`hang_up` that wakes the reader at once.
"""

from __future__ import annotations

import contextlib
import math
import select
import socket
import ssl
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from ..wire.protocol import FrameDecoder, encode_frame, keep_alive
from .core import ConnectionLostError
from .tls import handshake_failed

SendFailure = type[TimeoutError] | type[OSError] | None
"""What `send_by` returns: None once written, or why not."""
ANSWER_TIMEOUT_S = 30.0
"""How long the reader may take to send what TLS answers a post-handshake message with;
past it the connection is dropped (the node has stopped reading)."""
RECEIVE_BYTES = 262144


class Link(Protocol):
    """A connection to a node, as the blocking client uses it: a socket's (`Wire`), or
    one to a node in the same process (`quorumq.wire.inprocess.ThreadEnd`)."""

    def frames(self) -> Iterator[dict[str, Any]]:
        """The node's frames, checked, as they come (it blocks); ends once the
        connection is closed. `ProtocolError` for a bad one: iterate again to go on."""
        ...

    def send_frame_by(self, frame: dict[str, Any], deadline: float) -> SendFailure:
        """Send `frame` whole by `deadline` (monotonic): None once sent, else why not
        (the connection must go then)."""
        ...

    def serve(self) -> None:
        """The handshake is over: reads wait as long as it takes from now on."""

    def hang_up(self) -> None:
        """End the connection now, waking a reader of `frames`."""


class Dialer(Protocol):
    """How a client reaches nodes: `targets` names each (for errors), `dial` connects to
    one, within `timeout` seconds for each step."""

    @property
    def targets(self) -> Sequence[str]: ...

    def dial(self, target: int, timeout: float, welcome_s: float | None = None) -> Link: ...


class TcpDialer:
    """Nodes at "host:port" endpoints, over TCP (TLS with a `context`)."""

    def __init__(self, endpoints: list[tuple[str, int]], context: ssl.SSLContext | None) -> None:
        self.endpoints = endpoints
        self.targets = [f"{host}:{port}" for host, port in endpoints]
        self.context = context

    def dial(self, target: int, timeout: float, welcome_s: float | None = None) -> Wire:
        """The connection, its reads timing out after `timeout` from now on, or
        `welcome_s` if shorter: the handshake waits no longer for the node's welcome."""
        host, port = self.endpoints[target]
        wire = Wire.open(host, port, timeout=timeout, context=self.context)
        wire.settimeout(timeout if welcome_s is None else min(timeout, welcome_s))
        return wire


class Wire:
    """One connection's bytes, plain or TLS; `open` makes it."""

    def __init__(self, sock: socket.socket, tls: ssl.SSLObject | None = None) -> None:
        self.sock = sock
        self._tls = tls
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self._lock = threading.Lock()
        """Guards the SSL object and its BIOs; never held while the socket blocks."""
        self._send_lock = threading.Lock()
        """Held from taking encrypted bytes out of the BIO until they are on the socket,
        so they go out in the order the SSL object made them."""
        self._decoder = FrameDecoder()

    @classmethod
    def open(cls, host: str, port: int, *, timeout: float, context: ssl.SSLContext | None) -> Wire:
        """Connect (and with a `context`, do the TLS handshake) within `timeout` seconds
        for each step; the socket stays in timeout mode until `settimeout(None)`. A
        handshake that fails raises `TlsError`."""
        sock = socket.create_connection((host, port), timeout=timeout)
        if context is None:
            return cls(sock)
        wire = cls(sock)
        try:
            wire._tls = context.wrap_bio(wire._incoming, wire._outgoing, server_hostname=host)
            wire._handshake(timeout)
        except ssl.SSLError as e:
            alert = wire._outgoing.read()  # why, for the node's log ("unknown ca")
            if alert:
                send_by(sock, alert, time.monotonic() + min(timeout, 1.0))
            sock.close()
            raise handshake_failed(e) from None
        except BaseException:
            sock.close()
            raise
        return wire

    def _handshake(self, timeout: float) -> None:
        """The TLS handshake, each step within `timeout` (nobody else uses it yet)."""
        assert self._tls is not None
        while True:
            try:
                self._tls.do_handshake()
            except ssl.SSLWantReadError:
                self._flush(timeout)
                data = self.sock.recv(65536)
                if not data:
                    raise ConnectionLostError(
                        "the node closed the connection during the TLS handshake"
                    ) from None
                self._incoming.write(data)
                continue
            self._flush(timeout)
            return

    def _flush(self, within: float = ANSWER_TIMEOUT_S) -> None:
        """Send what the SSL object has made (a handshake message, an answer to one)
        within `within` seconds; `OSError` if it could not be."""
        with self._send_lock:
            with self._lock:
                data = self._outgoing.read()
            if data and send_by(self.sock, data, time.monotonic() + within):
                raise OSError("could not send a TLS message to the node")

    def settimeout(self, timeout: float | None) -> None:
        self.sock.settimeout(timeout)

    def frames(self) -> Iterator[dict[str, Any]]:
        """As `Link.frames`: decoded from what `recv` reads."""
        decoder = self._decoder
        while True:
            yield from decoder.frames()
            data = self.recv(RECEIVE_BYTES)
            if not data:
                return
            decoder.feed(data)

    def send_frame_by(self, frame: dict[str, Any], deadline: float) -> SendFailure:
        """`send_by` of the frame's bytes."""
        return self.send_by(encode_frame(frame), deadline)

    def serve(self) -> None:
        """Blocking from now on, no Nagle delay, and TCP keepalive (a node whose host
        vanished is given up)."""
        self.sock.settimeout(None)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        keep_alive(self.sock)

    def recv(self, size: int) -> bytes:
        """Up to `size` bytes from the node (blocking); b"" once it closed the connection.
        TLS: a connection closed without TLS's close_notify ends the same way (the node
        sends none, as HTTPS servers do not; a frame cut short stays incomplete)."""
        tls = self._tls
        if tls is None:
            return self.sock.recv(size)
        while True:
            with self._lock:
                try:
                    data = tls.read(size)
                except ssl.SSLWantReadError:
                    data = None
                except ssl.SSLZeroReturnError:
                    data = b""
                answer = self._outgoing.pending > 0
            if answer:  # a post-handshake message wanted one (TLS 1.3's KeyUpdate)
                self._flush()
            if data is not None:
                return data
            raw = self.sock.recv(size)
            if not raw:
                return b""
            with self._lock:
                self._incoming.write(raw)

    def send_by(self, data: bytes, deadline: float) -> SendFailure:
        """Write all of `data` by `deadline` (monotonic time), without blocking past it:
        None once written; `TimeoutError` if the deadline passed first, `OSError` if the
        connection failed (either way part of `data` may be out, so the connection must
        go)."""
        tls = self._tls
        if tls is None:
            return send_by(self.sock, data, deadline)
        with self._send_lock:
            try:
                with self._lock:
                    view = memoryview(data)
                    while view:
                        view = view[tls.write(view) :]
                    records = self._outgoing.read()
            except (ssl.SSLError, ValueError):
                return OSError
            return send_by(self.sock, records, deadline)

    def hang_up(self) -> None:
        """End the connection now. `close()` alone does not while the reader thread waits
        in `recv` on it (Linux keeps the socket until that call returns): the node would
        keep this client's consumers, holding their unacked messages, until it sent
        something, and a consumer with a full prefetch is sent nothing."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


def send_by(sock: socket.socket, data: bytes, deadline: float) -> SendFailure:
    """Write all of `data` on `sock` by `deadline` (monotonic time), without blocking past
    it. None once written; `TimeoutError` if the deadline passed first, `OSError` if the
    connection failed (either way part of `data` may be out, so the connection must go)."""
    view = memoryview(data)
    try:
        poller = select.poll()
        poller.register(sock, select.POLLOUT)
        while view:
            try:
                sent = sock.send(view, socket.MSG_DONTWAIT)
            except BlockingIOError:
                left = deadline - time.monotonic()
                if left <= 0:
                    return TimeoutError
                poller.poll(math.ceil(left * 1000))
                continue
            view = view[sent:]
    except (OSError, ValueError):  # ValueError: closed meanwhile (no file descriptor)
        return OSError
    return None
