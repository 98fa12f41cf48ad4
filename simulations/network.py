"""The in-memory network between simulated Raft members, with TCP's shape.

Each pair of nodes has one connection, as PySyncObj's TCP transport does. A connection
is up or down; each time it comes up it gets a new epoch, and a message still in flight
from an older epoch is lost, like the bytes of a closed socket. On an up connection,
messages arrive in order (unless the hostile `reorder` fault is on).

* A crashed node's connections drop at once: its peers see the socket close.
* A partition stalls traffic on the cut connections; after `connection_timeout_s` of
  silence they drop (what was stalled is lost). A partition healed sooner lets the
  stalled messages through, late, as TCP's retransmissions would. A node can also be
  isolated (`isolate`: cut from every other, whatever partition is in force, until
  `rejoin`).
* A direction of a link can be delayed (`delay`): every message on it arrives that
  much later, in order; delays on one direction do not add up, the longest counts.
* Arriving messages wait in the node's socket buffer until its next tick reads them
  (`poll`, called by PySyncObj at the end of each tick, as its real poller is). A
  paused node (SIGSTOP) does not tick: its messages wait, and its connections drop
  after `connection_timeout_s`.
* Dropped connections come back after a retry delay, once both ends are running and
  not cut off.
* Membership, as PySyncObj's TCP transport has it: a connection comes up only between
  two nodes that each have the other in their configuration (the one that dials sends
  its address, and the other closes a connection from an address it does not know).
  A node removed from the cluster is dropped by the members (`dropNode`), and knows
  them still: it stays cut off, and cannot disturb their elections. A node added is
  connected once both ends know each other (`addNode`).

Every message arrives as a copy of what was sent, taken when it was sent (its dict and
its lists; the values in them, bytes, numbers and tuples, cannot change), so no member
changes what another holds: one copy per message sent, as the real wire pickles each
once (a duplicated one gets a copy of its own). The simulator does not pickle every
message as PySyncObj's wire does (that was a twentieth of a run): the first message of
each kind and shape goes through pickle, so one the wire could not send fails the run.

The network knows hosts by their Raft address: a host's name (A, B, ...) until its
operator wipes it and adds it back at a new address (`C@2`: `Cluster.wipe`).
"""

from __future__ import annotations

import pickle
import zlib
from collections.abc import Callable
from typing import Any

from pysyncobj.node import Node
from pysyncobj.transport import Transport

from .world import World, micros


def _copied(message: dict[str, Any]) -> dict[str, Any]:
    """What the receiver gets: a new dict, with new lists (PySyncObj's messages hold
    only these, bytes, numbers, strings and tuples of them)."""
    return {k: list(v) if type(v) is list else v for k, v in message.items()}


def name_at(address: str) -> str:
    """The name of the node at a Raft address (`C@2`: C, at its second address)."""
    return address.partition("@")[0]


class StableNode(Node):  # type: ignore[misc]
    """A PySyncObj node whose hash does not depend on PYTHONHASHSEED: PySyncObj iterates
    sets of nodes to send, so the hash decides the order of messages. Its id is the
    node's Raft address; it carries the node's name too (as a real node's does)."""

    def __init__(self, address: str) -> None:
        super().__init__(address, name=name_at(address))
        self._stable_hash = zlib.crc32(address.encode())

    def __hash__(self) -> int:
        return self._stable_hash


class SimTransport(Transport):  # type: ignore[misc]
    """PySyncObj's transport for one member: `send` goes into the network. It knows the
    nodes of the member's configuration (`known`): PySyncObj adds and drops them as the
    configuration changes (`addNode`, `dropNode`). A member of Raft group `group` sends
    on its node's connections, each message tagged with its group (as the real link
    tags them), and reads only its group's."""

    def __init__(self, network: Network, name: str, known: list[str], group: int = 0) -> None:
        super().__init__(None, None, [])
        self.network = network
        self.name = name
        self.group = group
        self.known = {n for n in known if n != name}

    announce: Callable[[dict[str, Any]], None] | None = None
    """Stamps every message sent, as the real transport does (`stamp_identity`)."""

    def send(self, node: Any, message: Any) -> bool:
        if self.announce is not None and type(message) is dict:
            self.announce(message)
        return self.network.send(self.name, str(node.id), message, self.group)

    def addNode(self, node: Any) -> None:  # noqa: N802 (PySyncObj's name)
        name = str(node.id)
        if name != self.name and name not in self.known:
            self.known.add(name)
            self.network.known_changed(self.name, name, self.group)

    def dropNode(self, node: Any) -> None:  # noqa: N802 (PySyncObj's name)
        name = str(node.id)
        if name in self.known:
            self.known.discard(name)
            self.network.known_changed(self.name, name, self.group)


class HostTransports:
    """The transports of every Raft group a node runs (`groups[g]`: group g's), on the
    node's one connection to each peer, as the real link (`quorumq.raft.link`): the
    connection is up while any group of each end has the other; a group's member sees
    its peer connected only while that group of both ends has the other (the link's
    JOINED and LEFT), and a message reaches its group only then."""

    def __init__(self, groups: list[SimTransport]) -> None:
        self.groups = groups

    @property
    def known(self) -> set[str]:
        if len(self.groups) == 1:
            return self.groups[0].known
        return set().union(*(t.known for t in self.groups))


Pair = tuple[str, str]


def _pair(a: str, b: str) -> Pair:
    return (a, b) if a < b else (b, a)


RESET_REDIAL_US = (1_000, 5_000)
"""After a reset, the connection is made again within this (a dial and its handshake)."""


class Network:
    def __init__(
        self,
        world: World,
        names: list[str],
        *,
        latency_s: tuple[float, float] = (0.0002, 0.001),
        connection_timeout_s: float = 2.0,
        retry_s: tuple[float, float] = (0.05, 0.5),
    ) -> None:
        self.world = world
        self.names = list(names)
        self.random = world.stream("network")
        self.latency_us = (micros(latency_s[0]), micros(latency_s[1]))
        self.connection_timeout_us = micros(connection_timeout_s)
        self.retry_us = (micros(retry_s[0]), micros(retry_s[1]))
        self.nodes = {n: StableNode(n) for n in names}
        self.transports: dict[str, HostTransports] = {}
        """Running nodes' transports, one per Raft group (a crashed node has none)."""
        self.on_arrival: Callable[[str], None] = lambda name: None
        """Called after a message is handed to a member (the simulator wakes it)."""
        self.paused: set[str] = set()
        self.inbox: dict[str, list[list[tuple[str, int, dict[str, Any]]]]] = {
            n: [[]] for n in names
        }
        """Messages arrived at a node and not read yet, per Raft group."""
        self.cut: set[Pair] = set()
        """Pairs cut by the partition in force or by an isolation."""
        self._partition_cut: set[Pair] = set()
        self.isolated: set[str] = set()
        self._sides: dict[str, int] = {}
        """The side of each address in the partition in force (none: empty)."""
        self._last_side = 0
        self.epoch: dict[Pair, int] = {}
        self.up: set[Pair] = set()
        self.group_links: set[tuple[Pair, int]] = set()
        """(connection, group) for each group whose members at both ends have each other
        on a connection that is up (`HostTransports`)."""
        self.stalled: dict[Pair, list[tuple[str, str, int, int, dict[str, Any]]]] = {}
        self._last_arrival: dict[tuple[str, str], int] = {}
        self.extra_delay_us: dict[tuple[str, str], int] = {}
        """Slow directions (`delay`): added to every message's latency, order kept."""
        self._delays: dict[tuple[str, str], list[int]] = {}
        self.duplicate_p = 0.0
        self.drop_p = 0.0
        self.reorder = False
        """Hostile faults TCP never makes: PySyncObj assumes they do not happen."""
        self.sent = 0
        self._pickled_kinds: set[tuple[Any, ...]] = set()
        self._last_read: dict[tuple[str, str], int] = {}
        """(reader, peer) -> when the reader last read a message from the peer on their
        connection. As PySyncObj's TcpConnection, a node closes a connection it has read
        nothing from for `connection_timeout_s`, when it next sends on it or data
        arrives on it (the message is lost): followers that never talk to one another
        lose their connection at the first vote request, unless they keep it alive."""

    # ------------------------------------------------------------ membership

    def node(self, address: str) -> StableNode:
        """The PySyncObj node at `address` (an address seen later gets one here)."""
        node = self.nodes.get(address)
        if node is None:
            self.add_host(address)
            node = self.nodes[address]
        return node

    def add_host(self, address: str) -> None:
        """A new address joins the network (a node added to the cluster runs there)."""
        if address in self.nodes:
            return
        self.names.append(address)
        self.nodes[address] = StableNode(address)
        self.inbox[address] = [[]]
        if self._sides:  # a partition is on: the new address is on its last side
            self._sides[address] = self._last_side
            for other in self.names:
                if self._sides.get(other, self._last_side) != self._last_side:
                    self._partition_cut.add(_pair(address, other))
                    self.cut.add(_pair(address, other))
        for other in self.isolated:
            self.cut.add(_pair(address, other))

    def attach(self, name: str, transports: HostTransports) -> None:
        """A node starts: its connections come up after a retry delay."""
        self.transports[name] = transports
        self.inbox[name] = [[] for _ in transports.groups]
        for other in self.names:
            if other != name:
                self._connect_later(_pair(name, other))

    def detach(self, name: str) -> None:
        """A member crashes: its connections drop now."""
        self.transports.pop(name, None)
        self.paused.discard(name)
        self.inbox[name] = [[]]
        for other in self.names:
            if other != name:
                self._drop(_pair(name, other))

    def pause(self, name: str) -> None:
        self.paused.add(name)
        for other in self.names:
            if other != name:
                self._drop_after_timeout(_pair(name, other))

    def resume(self, name: str) -> None:
        """A paused member runs again (it reads what waited for it on its next tick)."""
        self.paused.discard(name)
        for other in self.names:
            if other != name:
                self._connect_later(_pair(name, other))

    def partition(self, groups: list[list[str]]) -> None:
        """Cut every connection between nodes of different groups (and heal the rest).
        An address that joins later is in the last group."""
        self._sides = side = {n: i for i, g in enumerate(groups) for n in g}
        self._last_side = len(groups) - 1
        self._partition_cut = {
            _pair(a, b)
            for a in self.names
            for b in self.names
            if a < b and side.get(a, -1) != side.get(b, -2)
        }
        self._recut()

    def isolate(self, address: str) -> None:
        """Cut `address` from every other node (on top of any partition)."""
        self.isolated.add(address)
        self._recut()

    def rejoin(self, address: str) -> None:
        """An isolated node is connected again (as the partition in force allows)."""
        self.isolated.discard(address)
        self._recut()

    def _recut(self) -> None:
        cut = self._partition_cut | {
            _pair(a, b) for a in self.isolated for b in self.names if b != a
        }
        for pair in sorted(cut - self.cut):
            self.cut.add(pair)
            self._drop_after_timeout(pair)
        for pair in sorted(self.cut - cut):
            self._heal(pair)

    def delay(self, src: str, dst: str, delay_us: int) -> None:
        """Messages from `src` to `dst` arrive `delay_us` late (until `undelay`)."""
        delays = self._delays.setdefault((src, dst), [])
        delays.append(delay_us)
        self.extra_delay_us[(src, dst)] = max(delays)

    def undelay(self, src: str, dst: str, delay_us: int) -> None:
        """One `delay` of `src` to `dst` ends (a no-op after the heal)."""
        delays = self._delays.get((src, dst), [])
        if delay_us in delays:
            delays.remove(delay_us)
        if delays:
            self.extra_delay_us[(src, dst)] = max(delays)
        else:
            self._delays.pop((src, dst), None)
            self.extra_delay_us.pop((src, dst), None)

    def heal(self) -> None:
        self._sides = {}
        self._partition_cut = set()
        self.isolated.clear()
        for pair in sorted(self.cut):
            self._heal(pair)
        self.extra_delay_us.clear()
        self._delays.clear()
        self.duplicate_p = self.drop_p = 0.0
        self.reorder = False

    def reset(self, a: str, b: str) -> None:
        """The connection between `a` and `b` breaks (in-flight messages are lost). The
        dialling side dials again at once, as PySyncObj's does: connected again within
        a TCP handshake (the retry delay is for dials that fail)."""
        pair = _pair(a, b)
        self._drop(pair)
        self.world.after(self.random.randint(*RESET_REDIAL_US), self._connect, pair)

    def is_up(self, a: str, b: str) -> bool:
        return _pair(a, b) in self.up

    def reachable(self, a: str, b: str) -> bool:
        """Whether `a` and `b` can talk: both run, neither is paused, each knows the
        other, no partition cuts them and neither direction is delayed by a connection
        timeout or more (a connection that stays silent that long is closed). The
        connection itself may be down for a moment (a reset, a redial)."""
        delay = max(self.extra_delay_us.get((a, b), 0), self.extra_delay_us.get((b, a), 0))
        return self._wanted(_pair(a, b)) and delay < self.connection_timeout_us

    # ------------------------------------------------------------ connections

    def _heal(self, pair: Pair) -> None:
        self.cut.discard(pair)
        stalled = self.stalled.pop(pair, [])
        if pair in self.up:
            for src, dst, epoch, group, data in stalled:
                self._schedule(src, dst, epoch, group, data)
        else:
            self._connect_later(pair)

    def _wanted(self, pair: Pair) -> bool:
        a, b = pair
        ta, tb = self.transports.get(a), self.transports.get(b)
        return (
            ta is not None
            and tb is not None
            and b in ta.known
            and a in tb.known
            and a not in self.paused
            and b not in self.paused
            and pair not in self.cut
        )

    def known_changed(self, name: str, other: str, group: int = 0) -> None:
        """`name`'s configuration (of Raft group `group`) gained or lost `other`: a
        connection they both want comes up after a retry delay; one that `name` dropped
        closes now (PySyncObj's `dropNode` disconnects; the peer sees the socket close).
        On a connection that stays up (another group of each end has the other), the
        group's members see each other come or go (the link's JOINED and LEFT)."""
        pair = _pair(name, other)
        if pair in self.up and self._known_both_ways(pair):
            self._group_changed(pair, group)  # (paused or cut off: it stays, as the link's)
        elif self._wanted(pair):
            self._connect_later(pair)
        elif pair in self.up and name in self.transports:
            self._drop(pair)

    def _known_both_ways(self, pair: Pair) -> bool:
        """Whether some group of each end of `pair` has the other."""
        a, b = pair
        ta, tb = self.transports.get(a), self.transports.get(b)
        return ta is not None and tb is not None and b in ta.known and a in tb.known

    def _linked(self, pair: Pair, group: int) -> bool:
        """Whether group `group` of both ends of connection `pair` has the other."""
        a, b = pair
        ta, tb = self.transports.get(a), self.transports.get(b)
        return (
            ta is not None
            and tb is not None
            and group < len(ta.groups)
            and group < len(tb.groups)
            and b in ta.groups[group].known
            and a in tb.groups[group].known
        )

    def _group_changed(self, pair: Pair, group: int) -> None:
        linked = self._linked(pair, group)
        if linked == ((pair, group) in self.group_links):
            return
        a, b = pair
        self.world.trace(f"{'join' if linked else 'leave'} {a} {b} group {group}")
        if linked:
            self.group_links.add((pair, group))
        else:
            self.group_links.discard((pair, group))
        for me, other in ((a, b), (b, a)):
            transport = self.transports[me].groups[group]
            if linked:
                transport._onNodeConnected(self.nodes[other])
            else:
                transport._onNodeDisconnected(self.nodes[other])
            self.on_arrival(me)

    def _connect_later(self, pair: Pair) -> None:
        self.world.after(self.random.randint(*self.retry_us), self._connect, pair)

    def _connect(self, pair: Pair) -> None:
        if pair in self.up or not self._wanted(pair):
            return
        self.up.add(pair)
        self.epoch[pair] = self.epoch.get(pair, 0) + 1
        a, b = pair
        self.world.trace(f"connect {a} {b}")
        self._last_read[(a, b)] = self._last_read[(b, a)] = self.world.now_us
        for group in range(max(len(self.transports[a].groups), len(self.transports[b].groups))):
            if self._linked(pair, group):
                self.group_links.add((pair, group))
                self.transports[a].groups[group]._onNodeConnected(self.nodes[b])
                self.transports[b].groups[group]._onNodeConnected(self.nodes[a])
        self.on_arrival(a)
        self.on_arrival(b)

    def _drop(self, pair: Pair) -> None:
        self.stalled.pop(pair, None)
        if pair not in self.up:
            return
        self.up.discard(pair)
        self.epoch[pair] += 1
        a, b = pair
        self.world.trace(f"disconnect {a} {b}")
        linked = {g for p, g in self.group_links if p == pair}
        self.group_links -= {(pair, g) for g in linked}
        for me, other in ((a, b), (b, a)):
            transports = self.transports.get(me)
            if transports is not None:
                for group in sorted(linked):
                    transports.groups[group]._onNodeDisconnected(self.nodes[other])
                if me not in self.paused:
                    self.on_arrival(me)  # as a closed socket ends a real node's poll

    def _idle_too_long(self, reader: str, peer: str) -> bool:
        """Whether `reader` has read nothing from `peer` for the connection timeout: if
        so, the connection closes now (and is made again later), as PySyncObj's does."""
        last = self._last_read.get((reader, peer), self.world.now_us)
        if self.world.now_us - last <= self.connection_timeout_us:
            return False
        self.reset(reader, peer)
        return True

    def _drop_after_timeout(self, pair: Pair) -> None:
        epoch = self.epoch.get(pair, 0)

        def timeout() -> None:
            if self.epoch.get(pair, 0) == epoch and not self._wanted(pair):
                self._drop(pair)
                self._connect_later(pair)

        self.world.after(self.connection_timeout_us, timeout)

    # --------------------------------------------------------------- traffic

    def _check_picklable(self, message: dict[str, Any]) -> None:
        """The first message of each kind goes through pickle, as PySyncObj's wire sends
        every message: one it cannot send fails the run here."""
        kind = (message.get("type"), tuple(message))  # (keys in any order: pickled again)
        if kind not in self._pickled_kinds:
            self._pickled_kinds.add(kind)
            pickle.loads(pickle.dumps(message))

    def send(self, src: str, dst: str, message: Any, group: int = 0) -> bool:
        pair = _pair(src, dst)
        if pair not in self.up or (pair, group) not in self.group_links:
            return False  # (the link sends a group's messages only to its members)
        if self._idle_too_long(src, dst):
            return False
        data = _copied(message)
        self._check_picklable(message)
        self.sent += 1
        epoch = self.epoch[pair]
        if pair in self.cut:
            self.stalled.setdefault(pair, []).append((src, dst, epoch, group, data))
            return True
        if self.drop_p and self.random.random() < self.drop_p:
            return True
        self._schedule(src, dst, epoch, group, data)
        if self.duplicate_p and self.random.random() < self.duplicate_p:
            self._schedule(src, dst, epoch, group, _copied(data))  # each its own copy
        return True

    def _schedule(self, src: str, dst: str, epoch: int, group: int, data: dict[str, Any]) -> None:
        low, high = self.latency_us
        when = self.world.now_us + low + int(self.random.random() * (high - low))
        direction = (src, dst)
        if self.extra_delay_us:
            when += self.extra_delay_us.get(direction, 0)
        if self.reorder:
            when += self.random.randint(0, 20_000)
        else:
            last = self._last_arrival.get(direction, 0)
            when = max(when, last)
            self._last_arrival[direction] = when
        self.world.at(when, self._arrive, src, dst, epoch, group, data)

    def _arrive(self, src: str, dst: str, epoch: int, group: int, data: dict[str, Any]) -> None:
        if self.epoch.get(_pair(src, dst)) != epoch or dst not in self.transports:
            return  # the connection it travelled on is gone
        self.inbox[dst][group].append((src, epoch, data))
        if dst not in self.paused:
            self.on_arrival(dst)

    def read(self, dst: str, group: int = 0) -> int:
        """Hand `dst`'s member of Raft group `group` every message waiting for it, in
        arrival order; how many."""
        inbox = self.inbox[dst]
        waiting = inbox[group]
        if not waiting:
            return 0
        inbox[group] = []
        transport = self.transports[dst].groups[group]
        world, epochs, last_read, nodes = self.world, self.epoch, self._last_read, self.nodes
        handled = 0
        for src, epoch, message in waiting:  # (each its own copy: `send`)
            if epochs.get(_pair(src, dst)) != epoch:
                continue  # the connection closed before the node read it
            if (_pair(src, dst), group) not in self.group_links:
                continue  # the group left (its member dropped the sender, or was dropped)
            if self._idle_too_long(dst, src):
                continue  # it closed now, unread
            last_read[(dst, src)] = world.now_us
            world.trace(f"msg {src} {dst} {message.get('type')}")
            transport._onMessageReceived(nodes[src], message)
            handled += 1
        return handled
