"""How the trio shell connects the node core to the world: the replica as the core sees
it, its outcomes handed to the trio thread (`LoopReplica`), and one client connection's
bytes between its stream and its `ConnectionCore` (`Link`, over a `StreamTransport`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import trio

from ..machine import Command, Machine, Reply
from ..node.core import ProposalCallback
from ..replica import ProposalError, Replica
from ..wire.protocol import SizedFrame

logger = logging.getLogger(__name__)

T = TypeVar("T")

RECEIVE_CHUNK = 256 * 1024
ClientStream = trio.SocketStream | trio.SSLStream[trio.SocketStream]


def peer_name(stream: trio.SocketStream) -> str:
    try:
        host, port = stream.socket.getpeername()[:2]
    except OSError:
        return "a peer gone already"
    return f"{host}:{port}"


class LoopReplica:
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

    def watch_ends(self, queues: frozenset[str]) -> None:
        self._replica.watch_ends(queues)

    def take_ends_moved(self) -> set[str]:
        return self._replica.take_ends_moved()


class LinkTransport(Protocol):
    """What a connection's reader and writer use: a socket's stream, or the node's end
    of an in-process connection (`inprocess.TrioEnd`)."""

    async def receive(self) -> bytes | bytearray | list[SizedFrame]:
        """What came (empty once the peer is gone)."""
        ...

    async def send(self, data: Any, cost: int) -> None:
        """Write `data` (what `ConnectionCore.take_output` gave), which counts for `cost`."""

    async def aclose(self) -> None: ...


class StreamTransport:
    def __init__(self, stream: ClientStream) -> None:
        self.stream = stream

    async def receive(self) -> bytes | bytearray:
        return await self.stream.receive_some(RECEIVE_CHUNK)

    async def send(self, data: Any, cost: int) -> None:
        await self.stream.send_all(data)

    async def aclose(self) -> None:
        await self.stream.aclose()


class Link:
    """One connection's trio side: its transport, and what wakes its reader and writer."""

    def __init__(self, transport: LinkTransport) -> None:
        self.transport = transport
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
