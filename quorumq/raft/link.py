"""One Raft port and one connection per pair of nodes for every group an engine hosts
(issue 33): each message travels as `(group, message)` on the connection between the
two nodes, and reaches that group's member.

Without it, each group a node hosts needs a Raft port of its own, and every pair of
nodes a connection per group. `EngineLink` is our bounded, authenticated TCP
transport (`transport.Transport`: the handshake with the cluster secret, the limits on
peers that have not shown it, the message size cap) bound once at the node's Raft
address, its peers the union of every group's; each member's `GroupTransport` is
PySyncObj's transport interface over it. A group learns a peer connected or gone when
the link does; a message for a group the node does not host, or from a node that group
does not have, is dropped (as PySyncObj refuses a connection from an unknown node).
Every group's member has the node's Raft address as its own. camelCase names are
PySyncObj's.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from pysyncobj import SyncObjConf
from pysyncobj.node import TCPNode
from pysyncobj.tcp_connection import CONNECTION_STATE
from pysyncobj.tcp_server import SERVER_STATE
from pysyncobj.transport import Transport as PySyncObjTransport
from pysyncobj.transport import TransportNotReadyError

from .cipher import RaftCipher, ThrottledWarning
from .transport import Transport

logger = logging.getLogger(__name__)

JOINED = "quorumq-group-joined"
LEFT = "quorumq-group-left"
ABSENT = "quorumq-group-absent"
"""What a node's link tells its peers of one group's member: it is here now (at its
join, and to a node that connects), it left (closed), or a message came for it and it
is not here. A group's peer is connected for the member only once its member said it
joined: a member that stopped while its node goes on is gone for its peers, and a
member that joins late is told (and says hello) when the other's joins."""

BIND_ATTEMPTS = 5
BIND_RETRY_S = 0.2
"""A taken Raft port is tried again this often, this many times (as a member's was)."""


class _LinkHost:
    """What PySyncObj's TCP transport asks of the SyncObj it serves, for a link that
    serves an engine's groups."""

    def __init__(self, poller: Any, conf: SyncObjConf, password: str | None) -> None:
        self._poller = poller
        self.conf = conf
        self.encryptor = RaftCipher(password) if password else None
        self.tick_callbacks: list[Callable[[], None]] = []

    def addOnTickCallback(self, callback: Callable[[], None]) -> None:
        self.tick_callbacks.append(callback)


class EngineLink(Transport):
    """The node's Raft port and its connections, shared by every group (see the
    module's docstring). Ticked by the engine at each round (`tick`)."""

    def __init__(
        self,
        address: str,
        password: str | None,
        poller: Any,
        guard: Callable[[Any, Callable[[], Any], str], bool],
    ) -> None:
        """`guard(member, step, what)`: runs a member's step as the engine does (a
        failure stops that member only)."""
        self.guard = guard
        conf = SyncObjConf(
            password=password,
            bindAddress=address,
            connectionRetryTime=0.5,
            connectionTimeout=2.0,
            bindRetryTime=BIND_RETRY_S / 2,  # (each attempt below is past it)
        )
        self._host = _LinkHost(poller, conf, password)
        self.address = address
        self.password = password or None
        self._groups: dict[int, GroupTransport] = {}
        self._wanted: dict[str, int] = {}
        """Peer address -> how many groups have it."""
        self._remote: dict[str, set[int]] = {}
        """Connected node's address -> the groups it said are there (`JOINED`)."""
        self._unknown_group = ThrottledWarning(
            logger, "a Raft message for a group this node does not host was dropped"
        )
        self._tick_failed = ThrottledWarning(
            logger, "the Raft port's tick failed (dialling a peer: out of descriptors?)"
        )
        super().__init__(self._host, TCPNode(address), [])
        self.setOnMessageReceivedCallback(self._deliver)
        self.setOnNodeConnectedCallback(self._connected)
        self.setOnNodeDisconnectedCallback(self._disconnected)
        for attempt in range(BIND_ATTEMPTS):
            with contextlib.suppress(TransportNotReadyError):
                self.tryGetReady()
            if self.ready:
                return
            if attempt + 1 < BIND_ATTEMPTS:
                time.sleep(BIND_RETRY_S)
        self.destroy()
        raise OSError(f"cannot listen for Raft traffic on {address} (in use?)")

    def tick(self) -> None:
        """Bind again if the port stopped listening, dial the peers it should, close
        handshakes that took too long (once a round). A failure (out of descriptors
        for a dial) is logged at most every few seconds, and the round goes on."""
        server: Any = self._server
        ready = bool(self.ready)
        if ready and server is not None and server._TcpServer__state == SERVER_STATE.UNBINDED:
            # its socket failed (an error event, an accept error): every group would be
            # deaf for good, as PySyncObj binds only until it first succeeds
            logger.warning("the Raft port %s stopped listening; binding it again", self.address)
            self._ready = False
        try:
            for callback in self._host.tick_callbacks:
                callback()
        except Exception:
            self._tick_failed()

    # --------------------------------------------------------------- groups

    def group_transport(self, group: int) -> Callable[..., GroupTransport]:
        """PySyncObj's `transportClass` for `group`'s member."""

        def make(sync_obj: Any, self_node: Any, other_nodes: Any) -> GroupTransport:
            return GroupTransport(self, group, sync_obj, self_node, other_nodes)

        return make

    def attach(self, group: int, transport: GroupTransport) -> None:
        if group in self._groups:
            raise ValueError(f"group {group} already has a member on this node")
        self._groups[group] = transport

    def detach(self, group: int) -> None:
        self._groups.pop(group, None)

    def want(self, address: str) -> None:
        """A group has `address` as a peer: connect to it (once for every group)."""
        self._wanted[address] = self._wanted.get(address, 0) + 1
        if self._wanted[address] == 1:
            self.addNode(TCPNode(address))

    def unwant(self, address: str) -> None:
        """A group no longer has `address`: drop the connection once no group does."""
        left = self._wanted.get(address, 0) - 1
        if left > 0:
            self._wanted[address] = left
            return
        self._wanted.pop(address, None)
        node = self._nodeAddrToNode.get(address)
        if node is not None:
            self.dropNode(node)

    def connected_to(self, address: str, group: int) -> bool:
        """Whether `group`'s member at `address` is there: the link is connected to
        the node and that node said the group joined (and not that it left)."""
        return group in self._remote.get(address, ())

    def send_to(self, address: str, group: int, message: Any) -> bool:
        node = self._nodeAddrToNode.get(address)
        if node is None:
            return False
        return bool(super().send(node, (group, message)))

    def _control(self, address: str, group: int, message: str) -> None:
        """Send a presence message on the connection as it is: without a secret,
        PySyncObj reports a dialled connection connected while it is still
        connecting, and its `send` refuses anything not yet connected (the dialler's
        JOINEDs were lost, and its groups never heard)."""
        node = self._nodeAddrToNode.get(address)
        conn = self._connections.get(node) if node is not None else None
        if conn is not None and conn.state != CONNECTION_STATE.DISCONNECTED:
            conn.send((group, message))

    def tell_joined(self, group: int, addresses: list[str]) -> None:
        """Tell the connected nodes among `addresses` that `group` is here now."""
        for address in addresses:
            if address in self._remote:
                self._control(address, group, JOINED)

    def tell_left(self, group: int, addresses: list[str]) -> None:
        for address in addresses:
            if address in self._remote:
                self._control(address, group, LEFT)

    # --------------------------------------------------------------- events

    def _onIncomingMessageReceived(self, conn: Any, message: Any) -> None:
        """PySyncObj's, refusing a peer that names itself "readonly" (a read-only
        PySyncObj node: no group has one, and it has no address to route by)."""
        if message == "readonly" and conn in self._unknownConnections:
            self._drop_unauthenticated(conn, "a read-only node asked to join")
            self._unknownConnections.discard(conn)
            return
        super()._onIncomingMessageReceived(conn, message)

    def _deliver(self, node: Any, message: Any) -> None:
        address: str = node.address
        if not (type(message) is tuple and len(message) == 2 and type(message[0]) is int):
            logger.warning("dropping a Raft message with no group from %s", address)
            return
        group, payload = message
        transport = self._groups.get(group)
        live = transport is not None and transport.live
        if payload == JOINED:
            if address not in self._remote:
                return  # (a late message of a connection replaced since)
            self._remote[address].add(group)
            if transport is not None:
                transport.peer_connected(address)
        elif payload in (LEFT, ABSENT):
            there = self._remote.get(address, set())
            if group in there:
                there.discard(group)
                if transport is not None:
                    transport.peer_disconnected(address)
        elif not live:
            # its member is gone (or not here yet): the sender stops taking it as there
            self._unknown_group()
            self._control(address, group, ABSENT)
        else:
            assert transport is not None
            transport.deliver(address, payload)

    def _connected(self, node: Any) -> None:
        address: str = node.address
        # a connection that replaces one not seen closed: what the old one said is gone
        for group in self._remote.pop(address, set()):
            transport = self._groups.get(group)
            if transport is not None:
                transport.peer_disconnected(address)
        self._remote[address] = set()
        for group, transport in list(self._groups.items()):
            if transport.live and address in transport.peers:
                self._control(address, group, JOINED)

    def _disconnected(self, node: Any) -> None:
        there = self._remote.pop(node.address, set())
        for group in there:
            transport = self._groups.get(group)
            if transport is not None:
                transport.peer_disconnected(node.address)


class GroupTransport(PySyncObjTransport):  # type: ignore[misc]
    """One group's member's transport: PySyncObj's interface over the node's link."""

    announce: Callable[[dict[str, Any]], None] | None = None
    """As `transport.Transport.announce`: stamps what the member says of its cluster."""

    def __init__(
        self, link: EngineLink, group: int, sync_obj: Any, self_node: Any, other_nodes: Any
    ) -> None:
        super().__init__(sync_obj, self_node, other_nodes)
        self._syncObj = sync_obj
        self._link = link
        self.group = group
        self.live = False
        self._peers: dict[str, Any] = {}
        link.attach(group, self)
        for node in other_nodes:
            self.addNode(node)

    @property
    def ready(self) -> bool:
        return True  # the link bound the port when the engine was made

    @property
    def peers(self) -> dict[str, Any]:
        return self._peers

    def join(self) -> None:
        """The member joined the engine: from now on it hears its peers (before, a
        message or a connection would call into a member whose owner is not set up:
        dropped, as a socket not yet polled would hold them); its peers are told it
        is here, and those whose member is there are connected for it."""
        self.live = True
        self._link.tell_joined(self.group, list(self._peers))
        for address, node in list(self._peers.items()):
            if self._link.connected_to(address, self.group):
                self._onNodeConnected(node)

    def addNode(self, node: Any) -> None:
        if node.address in self._peers:
            return
        self._peers[node.address] = node
        self._link.want(node.address)
        if self.live:
            self._link.tell_joined(self.group, [node.address])
            if self._link.connected_to(node.address, self.group):
                self._onNodeConnected(node)

    def dropNode(self, node: Any) -> None:
        """Forget `node`, telling the member it is gone if it was connected."""
        address: str = node.address
        if address not in self._peers:  # (PySyncObj passes equal nodes, not the same objects)
            return
        del self._peers[address]
        connected = self._link.connected_to(address, self.group)
        if self.live:
            self._link.tell_left(self.group, [address])  # (its messages would go nowhere)
        self._link.unwant(address)
        if connected and self.live:
            self._onNodeDisconnected(node)

    def send(self, node: Any, message: Any) -> bool:
        if self.announce is not None and type(message) is dict:
            self.announce(message)
        address: str = node.address
        if address not in self._peers or not self._link.connected_to(address, self.group):
            return False
        return self._link.send_to(address, self.group, message)

    def deliver(self, address: str, message: Any) -> None:
        node = self._peers.get(address)
        if node is not None and self._hears():  # (not a peer of this group: dropped)
            self._link.guard(
                self._syncObj, lambda: self._onMessageReceived(node, message), "handling a message"
            )

    def peer_connected(self, address: str) -> None:
        node = self._peers.get(address)
        if node is not None and self._hears():
            self._link.guard(self._syncObj, lambda: self._onNodeConnected(node), "a connection")

    def peer_disconnected(self, address: str) -> None:
        node = self._peers.get(address)
        if node is not None and self._hears():
            self._link.guard(self._syncObj, lambda: self._onNodeDisconnected(node), "a close")

    def _hears(self) -> bool:
        return self.live and not self._syncObj.stopping

    def destroy(self) -> None:
        if self.live:
            self._link.tell_left(self.group, list(self._peers))
        self.live = False
        self.setOnMessageReceivedCallback(None)
        self.setOnNodeConnectedCallback(None)
        self.setOnNodeDisconnectedCallback(None)
        self._link.detach(self.group)
        for address in list(self._peers):
            self._link.unwant(address)
        self._peers.clear()
