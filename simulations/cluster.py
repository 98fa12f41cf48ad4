"""A simulated cluster: N nodes on one world, network and set of disks.

The cluster starts, crashes, restarts, pauses and resumes nodes, carries messages
between nodes and their clients, and reports what happens (applies, leadership,
failure commands) to its observers: the checker and the history.

Membership. The cluster starts with N members (`names`: A, B, C) and may have spare
hosts (`spares`: D) that an operator starts and adds later (`simulations.operator`).
`membership` is what the operator knows: the members it started with, changed as each
`members add` / `members remove` it sends is confirmed. It is what clients are given
as endpoints (`serving`): a client connects only to a running member. Each host has a
Raft address (`address`): its name, until its operator wipes it to add it back
(`wipe`: an empty disk at a new address, `C@2`). A node is started with the peers an
operator gives it (`peers_for`): a node started on an empty disk gets every current
member and itself (as the README says); a node restarted on its data gets the peers
it was first started with (its `--peer` flags do not change: membership after the
first start lives in the log and snapshots). A node removed from the cluster keeps
running, cut off, until its operator stops it (`stop`, and it is `retired`: no fault
restarts it).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol

from quorumq.machine import Applied, Command, NodeDown, NodeUp
from quorumq.node.config import DISK_CHECK_EVERY_S, START_FREE_BYTES
from quorumq.raft.journal import JournalDamagedError, RaftJournal

from .network import Network, name_at
from .node import REAL, SimNode, Variant
from .storage import SimDisk, SimSerializer
from .world import WALL_EPOCH_MS, World, micros

SNAPSHOT_WRITE_MS = (5, 2000)
"""How long a node's snapshot write takes, drawn per write: the real node encodes and
fsyncs it in a forked child while the node goes on (0.25-1.3 s at 15-30 MB)."""


class Observer(Protocol):
    def on_applied(
        self, node: SimNode, index: int, crc: int, command: Command, applied: Applied
    ) -> None: ...

    def on_leadership(self, node: SimNode, leader: bool) -> None: ...

    def on_failure_command(self, node: SimNode, command: NodeDown | NodeUp) -> None: ...

    def on_stamp(self, ts_ms: int) -> None: ...

    def on_node(self, name: str, running: bool) -> None: ...

    def on_snapshot_loaded(self, node: SimNode, applied: int, index: int) -> None: ...

    def on_refused(self, name: str, reason: str) -> None: ...

    def on_fatal(self, name: str, reason: str) -> None: ...

    def on_ticked(self, node: SimNode) -> None: ...

    def on_change_cluster(self, node: SimNode, request: Any, accepted: bool) -> None: ...


class GroupObserver(Protocol):
    """What observes the groups but the model group (`group_checks.GroupChecks`)."""

    def on_ticked(self, node: SimNode) -> None: ...

    def on_applied(self, node: SimNode, group: int, index: int, payload: bytes) -> None: ...

    def on_snapshot_loaded(self, node: SimNode, group: int, applied: int, index: int) -> None: ...

    def on_leadership(self, node: SimNode, group: int, leader: bool) -> None: ...


class Cluster:
    def __init__(
        self,
        world: World,
        n: int,
        *,
        spares: int = 0,
        variant: Variant = REAL,
        grace_s: float = 5.0,
        raft_timeouts: tuple[float, float] = (0.25, 0.6),
        compaction_entries: int | None = None,
        wal: bool = False,
        groups: int = 1,
        model_group: int | None = None,
    ) -> None:
        """`wal`: every node's journal is group 0 of the shared write-ahead log
        (`quorumq.raft.wal`) instead of a journal file of its own. `groups`: how many
        Raft groups every node hosts (`quorumq node --groups`): the workload's queue
        is placed in `model_group` (by default the last), which the observers watch; the others
        are checked by `group_checks`."""
        if groups > 1 and wal:
            raise ValueError("the simulator runs nodes with groups on journal files")
        self.world = world
        self.groups = groups
        self.model_group = groups - 1 if model_group is None else model_group
        self.group_checks: GroupObserver | None = None
        """The checks of the groups but the model group (set by the run)."""
        self.names = [chr(ord("A") + i) for i in range(n)]
        """The first members (the fault schedules draw their targets from them)."""
        self.spares = [chr(ord("A") + n + i) for i in range(spares)]
        """Hosts that are no members at first: an operator may start and add them."""
        self.hosts = self.names + self.spares
        self.membership: set[str] = set(self.names)
        """The members, as the operator knows them (see the module's docstring)."""
        self.retired: set[str] = set()
        """Hosts removed from the cluster whose node the operator stopped."""
        self._waiting_for_space: set[str] = set()
        """Hosts whose node waits for space on its data disk before starting."""
        self.space_fault_ran = False
        """Whether a disk space fault (`disk_alarm`, `disk_full`) has run: the workload
        expects publishes refused for a disk alarm only once one has."""
        self.address: dict[str, str] = {name: name for name in self.hosts}
        """Each host's Raft address (see the module's docstring)."""
        self.first_peers: dict[str, dict[str, str]] = {}
        """The peers (name -> address) each host's node was first started with (since
        its disk was wiped)."""
        self.wipes: Counter[str] = Counter()
        self.variant = variant
        self.grace_s = grace_s
        self.raft_timeouts = raft_timeouts
        self.compaction_entries = compaction_entries
        """PySyncObj's `logCompactionMinEntries` (None: it never compacts)."""
        self.network = Network(world, self.names)
        self.network.on_arrival = self._woken
        self.disks = {
            name: SimDisk(name, world.stream(f"disk-{name}"), wal=wal) for name in self.hosts
        }
        self.wall_offset_ms: dict[str, int] = dict.fromkeys(self.hosts, 0)
        """How far each host's wall clock is off (the `clock_skew` and `clock_jump`
        faults); it stays off across the node's restarts, as a host's clock does."""
        self.snapshot_counts: Counter[str] = Counter()
        """Snapshots written, sent, installed and refused, all nodes together."""
        self.nodes: dict[str, SimNode | None] = dict.fromkeys(self.hosts)
        self.incarnations = dict.fromkeys(self.hosts, 0)
        self.observers: list[Observer] = []
        self.consumers: dict[str, Any] = {}
        """Every consumer id ever subscribed -> its client (for proxied deliveries)."""
        self.client_random = world.stream("clients")
        self.producer_ids = world.stream("producer-ids")
        self._opening: str | None = None
        """The node starting: PySyncObj asks for its journal and serializer."""
        self.links: dict[Any, None] = {}
        """Open client connections (`SimLink`), in the order they opened."""

    # ------------------------------------------------------------------ disks

    def create_journal(self, path: str) -> RaftJournal:
        """PySyncObj's `createJournal`, patched for a run: the real journal, opened on the
        disk of the node starting (`JournalDamagedError` if it refuses)."""
        return self._disk_of_starting(path).open_journal()

    def create_serializer(
        self,
        path: str,
        batch_size: int,
        _use_fork: bool,
        write: Callable[[Any], bytes],
        read: Callable[[bytes], Any],
        _checker: Any,
    ) -> SimSerializer:
        """PySyncObj's `Serializer`, patched for a run: the snapshot store of the node starting."""
        disk = self._disk_of_starting(path)
        rng = self.world.stream(
            f"snapshot-{disk.name}{disk.directory}-{self.incarnations[disk.name]}"
        )
        return SimSerializer(
            disk,
            batch_size,
            write,
            read,
            self.snapshot_counts,
            now_ms=lambda: self.world.now_ms,
            write_ms=lambda: rng.randint(*SNAPSHOT_WRITE_MS),
        )

    def _disk_of_starting(self, path: str) -> SimDisk:
        """The disk (of its Raft group: `sim:A/group-2/raft.log`) of the node starting."""
        name = self._opening
        parts = path.split("/")
        if name is None or parts[0] != f"sim:{name}":
            raise RuntimeError(f"{path!r} was asked for outside a node start")
        group = int(parts[1].removeprefix("group-")) if len(parts) > 2 else 0
        return self.disks[name].group(group)

    def wall_ms(self, name: str) -> int:
        """Host `name`'s wall clock: simulated time from an epoch, plus its offset."""
        return WALL_EPOCH_MS + self.world.now_ms + self.wall_offset_ms[name]

    # ------------------------------------------------------------------ nodes

    def start(self, name: str) -> SimNode | None:
        """Start (or restart) a node from what its disk holds; None if the node refuses to
        start (its journal or snapshot is damaged: it stays down, as a real node does
        until an operator rebuilds it)."""
        assert self.nodes[name] is None, f"{name} is running"
        disk = self.disks[name]
        if disk.damaged is not None:
            return None
        if disk.files.free_bytes < START_FREE_BYTES:
            self._wait_for_space(name)
            return None
        self.incarnations[name] += 1
        self.network.add_host(self.address[name])
        self._opening = name
        try:
            node = SimNode(
                self,
                name,
                self.incarnations[name],
                disk,
                grace_s=self.grace_s,
                raft_timeouts=self.raft_timeouts,
                compaction_entries=self.compaction_entries,
                groups=self.groups,
                model_group=self.model_group,
            )
        except JournalDamagedError as e:
            disk.damaged = str(e).split(". The journal lost")[0]
            self.world.trace(f"refused {name} {disk.damaged}")
            for o in self.observers:
                o.on_refused(name, disk.damaged)
            return None
        finally:
            self._opening = None
        self.nodes[name] = node
        self.network.attach(self.address[name], node.transports())
        self.world.trace(f"start {name} {node.incarnation}")
        for o in self.observers:
            o.on_node(name, True)
        node.wake()
        return node

    def crash(self, name: str, *, power_loss: bool = True, torn: bool = False) -> None:
        """The node's process dies: its clients' connections close. With `power_loss` (the
        host's), what its disk had not synced is lost (`torn`: part of it stays)."""
        node = self.nodes[name]
        if node is None:
            return
        disk = self.disks[name]
        if power_loss:
            disk.power_loss(torn=torn)
        else:
            disk.crash()
        node.alive = False
        self.nodes[name] = None
        self.network.detach(self.address[name])
        self.world.trace(f"crash {name}")
        for o in self.observers:
            o.on_node(name, False)
        if node.was_leader:
            for o in self.observers:
                o.on_leadership(node, False)
        for link in self.links_of(node):
            link.broken_by_node()

    def stop(self, name: str) -> None:
        """The operator stops a node it removed from the cluster (a clean exit: what it
        wrote stays on its disk); no fault starts it again."""
        self.retired.add(name)
        if self.nodes[name] is not None:
            self.world.trace(f"stop {name}")
            self.crash(name, power_loss=False)

    def wipe(self, name: str, *, new_address: bool = True) -> None:
        """The operator moves the (stopped) node's data directory away: it starts empty,
        with a new first configuration, at a new Raft address (`new_address`)."""
        assert self.nodes[name] is None, f"{name} is running"
        self.wipes[name] += 1
        self.disks[name] = SimDisk(
            name, self.world.stream(f"disk-{name}-{self.wipes[name]}"), wal=self.disks[name].wal
        )
        if new_address:
            self.address[name] = f"{name}@{self.wipes[name] + 1}"
        self.first_peers.pop(name, None)
        self.retired.discard(name)
        self.world.trace(f"wipe {name} {self.address[name]}")

    def peers_for(self, name: str) -> dict[str, str]:
        """The peers (name -> Raft address) the operator starts `name`'s node with (see
        the module's docstring)."""
        peers = self.first_peers.get(name)
        if peers is None:
            members = sorted(self.membership | {name})
            peers = self.first_peers[name] = {n: self.address[n] for n in members}
        return peers

    def on_fatal(self, node: SimNode, error: BaseException) -> None:
        """`node` stopped itself (its journal failed): its process exits, as a real node's
        does, and its supervisor starts it again a moment later."""
        self.world.trace(f"fatal {node.name} {type(error).__name__}")
        for o in self.observers:
            o.on_fatal(node.name, str(error))
        self.crash(node.name, power_loss=False)
        incarnation = node.incarnation
        self.world.after(micros(1.0), self._supervise, node.name, incarnation)

    def _wait_for_space(self, name: str) -> None:
        """As `NodeServer` before its replica starts: the process waits, measuring its
        data disk every `DISK_CHECK_EVERY_S`, until `START_FREE_BYTES` are free, then
        starts (unless it started meanwhile, or its operator stopped it)."""
        if name in self._waiting_for_space:
            return
        self._waiting_for_space.add(name)
        self.world.trace(f"waits for space {name}")

        def check() -> None:
            if self.nodes[name] is not None or name in self.retired:
                self._waiting_for_space.discard(name)
            elif self.disks[name].files.free_bytes < START_FREE_BYTES:
                self.world.after(micros(DISK_CHECK_EVERY_S), check)
            else:
                self._waiting_for_space.discard(name)
                self.start(name)

        self.world.after(micros(DISK_CHECK_EVERY_S), check)

    def _supervise(self, name: str, incarnation: int) -> None:
        if (
            self.nodes[name] is None
            and self.incarnations[name] == incarnation
            and name not in self.retired
        ):
            self.start(name)

    def pause(self, name: str) -> None:
        node = self.nodes[name]
        if node is None or node.paused:
            return
        node.paused = True
        self.network.pause(self.address[name])
        self.world.trace(f"pause {name}")

    def resume(self, name: str) -> None:
        node = self.nodes[name]
        if node is None or not node.paused:
            return
        node.paused = False
        self.world.trace(f"resume {name}")
        self.network.resume(self.address[name])
        node.resumed()

    def running(self) -> list[SimNode]:
        return [n for n in self.nodes.values() if n is not None]

    def leader(self) -> SimNode | None:
        """The running, unpaused node that believes it leads with the highest term (of
        the model group: `model_group`)."""
        leaders = [n for n in self.running() if not n.paused and n.member.is_leader()]
        return max(leaders, key=lambda n: n.member.raftCurrentTerm, default=None)

    def leader_of(self, group: int) -> SimNode | None:
        """`leader` of Raft group `group`."""
        leaders = [
            n for n in self.running() if not n.paused and n.replicas[group].member.is_leader()
        ]
        return max(leaders, key=lambda n: n.replicas[group].member.raftCurrentTerm, default=None)

    def _woken(self, address: str) -> None:
        node = self.nodes.get(name_at(address))
        if node is not None and node.member.address == address:
            node.wake()

    def addresses(self, names: list[str]) -> list[str]:
        return [self.address[n] for n in names]

    # ---------------------------------------------------------------- clients

    def links_of(self, node: SimNode) -> list[Any]:
        """The open client connections to `node`, in the order they opened."""
        return [link for link in self.links if link.node is node]

    def serving(self) -> list[SimNode]:
        """The running members: the nodes a client may connect to (its endpoints)."""
        return [n for n in self.running() if n.name in self.membership]

    # -------------------------------------------------------------- observing

    def on_applied(
        self, node: SimNode, index: int, crc: int, command: Command, applied: Applied
    ) -> None:
        for o in self.observers:
            o.on_applied(node, index, crc, command, applied)

    def on_leadership(self, node: SimNode, leader: bool) -> None:
        self.world.trace(f"leader {node.name} {leader} {node.member.raftCurrentTerm}")
        for o in self.observers:
            o.on_leadership(node, leader)

    def on_snapshot_loaded(self, node: SimNode, applied: int, index: int) -> None:
        """`node`, which had applied the log up to `applied`, loaded a snapshot up to `index`."""
        self.snapshot_counts["loaded"] += 1
        self.world.trace(f"snapshot {node.name} {applied} {index}")
        for o in self.observers:
            o.on_snapshot_loaded(node, applied, index)

    def on_stamp(self, ts_ms: int) -> None:
        """A leader stamped time `ts_ms` on an entry, now."""
        for o in self.observers:
            o.on_stamp(ts_ms)

    def on_failure_command(self, node: SimNode, command: NodeDown | NodeUp) -> None:
        self.world.trace(f"propose {node.name} {command}")
        for o in self.observers:
            o.on_failure_command(node, command)

    def on_ticked(self, node: SimNode) -> None:
        """`node` ticked: its Raft state may have changed."""
        for o in self.observers:
            o.on_ticked(node)
        if self.group_checks is not None:
            self.group_checks.on_ticked(node)

    # the groups but the model group (`group_checks`)

    def on_group_applied(self, node: SimNode, group: int, index: int, payload: bytes) -> None:
        if self.group_checks is not None:
            self.group_checks.on_applied(node, group, index, payload)

    def on_group_snapshot_loaded(self, node: SimNode, group: int, applied: int, index: int) -> None:
        self.snapshot_counts["loaded"] += 1
        self.world.trace(f"snapshot {node.name} group {group} {applied} {index}")
        if self.group_checks is not None:
            self.group_checks.on_snapshot_loaded(node, group, applied, index)

    def on_group_leadership(self, node: SimNode, group: int, leader: bool) -> None:
        term = node.replicas[group].member.raftCurrentTerm
        self.world.trace(f"leader {node.name} group {group} {leader} {term}")
        if self.group_checks is not None:
            self.group_checks.on_leadership(node, group, leader)

    def on_change_cluster(
        self, node: SimNode, request: Any, accepted: bool, group: int = 0
    ) -> None:
        """`node`, leading (Raft group `group`), appended the configuration change
        `request`, or refused it."""
        where = f" group {group}" if self.groups > 1 else ""
        self.world.trace(f"change {node.name} {request[0]} {request[1]} {accepted}{where}")
        for o in self.observers:
            o.on_change_cluster(node, request, accepted)
