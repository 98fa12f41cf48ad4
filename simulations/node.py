# ruff: noqa: N802  (PySyncObj's camelCase Serializer and SyncObj methods)
"""One simulated quorumq node: a Raft member running the real rules on the real journal,
the real queue machine, and the duties of the node's server towards its clients.

* `SimMember` is `quorumq.raft.rules.RaftRules` (the same Raft rules a real node runs)
  on the simulated network, ticked by the simulator.
* `SimDisk` is the node's disk: its journal is the real `DurableJournal` on simulated
  files (`simulations.disk.SimFiles`), which a power loss takes back to what was synced
  (torn, with the `torn_power_loss` fault), and which can flip bits, write short and
  fail syncs; its snapshot is stored whole, synced, as the real node stores it. A node
  whose journal refuses to open stays down; one whose journal fails stops, and is
  started again (`Cluster.on_fatal`).
* `SimSerializer` is PySyncObj's snapshot store on that disk: log compaction
  (`logCompactionMinEntries`) writes the machine's snapshot there, at once and on the
  tick (no fork), as the real node's serializer does; the leader sends it in chunks
  to a follower behind its compacted log, through the simulated network; the follower
  installs it only if the shared Raft rules take it (`accept_leader_snapshot`). A
  restarted node checks that its snapshot and journal belong together
  (`RaftRules.check_stored_state`), loads its snapshot, then its journal. Its first
  configuration is recorded on the disk, and checked at every restart, by the real
  code (`quorumq.raft.first_configuration`).
* `SimNode` is one run of a node: the real `quorumq.replica.Replica` (on a `SimMember`)
  and the real `quorumq.node.NodeCore` serving its clients' connections, driven as the
  node's trio shell and Raft thread drive them: the replica's effects and outcomes
  handed to the core after each tick, the bytes clients sent read, what the core
  queued written, the core's timers run, the data disk's free space measured every
  second (the disk alarm). Nothing of the node is modelled: what the real node does
  with an effect, a snapshot load or a lost proposal, the simulated one does by the
  same code.

`Variant` holds the test-only switches of the negative controls: another machine, or
another effect filter. The default is the real thing.
"""

from __future__ import annotations

import random
import zlib
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import attrs
from pysyncobj import SyncObjConf
from pysyncobj.config import SERIALIZER_STATE

from quorumq.machine import (
    Applied,
    Command,
    Effect,
    Machine,
    NodeDown,
    NodeUp,
)
from quorumq.node import ConnectionCore, NodeConfig, NodeCore
from quorumq.node.config import DISK_CHECK_EVERY_S
from quorumq.node.core import ProposalCallback
from quorumq.raft.first_configuration import settle_first_configuration
from quorumq.raft.journal import DurableJournal, JournalDamagedError, JournalFailedError
from quorumq.raft.rules import (
    Entry,
    LeaderClock,
    RaftRules,
    decode_snapshot,
)
from quorumq.replica import ProposalError, Replica, ReplicaConfig, local_effects

from .disk import SimFiles
from .network import Network, SimTransport
from .world import World, first_micros_at, micros

T = TypeVar("T")

TICK_COST_US = 100
PER_MESSAGE_COST_US = 20
"""Simulated CPU time of a tick: what arrives meanwhile waits for the next tick, so
proposals group into one AppendEntries under load, as they do on a real node."""

EffectFilter = Callable[..., tuple[Effect, ...]]

ADMIN_TOKEN = "simulated-admin"
"""The nodes' admin token: the operator's client proves it for membership changes (the
workload's clients do not, and the node core refuses them administrative verbs)."""


@attrs.frozen(kw_only=True)
class Variant:
    """Test-only switches of the negative controls, given to the node's real Replica:
    another machine, or another effect filter. The defaults are the real thing. (Other
    controls patch the real node core in the test that runs them.)"""

    name: str = "real"
    machine: Callable[[], Machine] = Machine
    effect_filter: EffectFilter = local_effects
    """(effects, node, proxy=, replicas=) -> the effects this node runs."""


REAL = Variant()


# ---------------------------------------------------------------------- disk


class SimDisk:
    """A node's durable storage: what a restarted node finds. Its journal is the real
    `DurableJournal` on `files` (this disk's `SimFiles`); its snapshot is stored whole
    and synced before PySyncObj compacts the journal behind it, as the real node writes
    its file."""

    JOURNAL = "/raft.log"

    def __init__(self, name: str, rng: random.Random) -> None:
        self.name = name
        self.files = SimFiles(rng)
        self.snapshot: bytes | None = None
        """The node's snapshot (`encode_snapshot` bytes)."""
        self.damaged: str | None = None
        """Why the node refused to start from this disk (it stays down), if it did."""
        self.doomed = False
        """A fault damaged this disk: the node will refuse to start from it (until its
        operator wipes it)."""

    def open_journal(self) -> DurableJournal:
        """The journal a starting node opens: `JournalDamagedError` if it must refuse."""
        return DurableJournal(self.JOURNAL, files=self.files)

    def crash(self) -> None:
        self.files.crash()

    def power_loss(self, *, torn: bool = False) -> None:
        self.files.power_loss(torn=torn)


class SimSerializer:
    """PySyncObj's `Serializer` (its snapshot store) for a simulated member, on the
    node's `SimDisk`, behaving as `RaftMember`'s does:

    * `serialize` takes the snapshot of the state as it is (the real node forks), and
      the write ends later, after `write_ms` (a random span: encoding the real state
      takes 0.25-1.9 s), while the node goes on. Only then is the snapshot on the disk
      and does PySyncObj learn it is done (`checkSerializing`) and compact the journal.
      A crash meanwhile loses the write; the previous snapshot stays.
    * the leader sends a follower behind its compacted log the snapshot it has on its
      disk (the previous one while a write runs), in chunks of
      `logCompactionBatchSize` (the first flagged, then an empty last one); a new
      snapshot starts every transfer over.
    * the follower gathers the chunks in memory (lost if it crashes) and stores the
      snapshot only once whole and taken by `accept` (the shared rule that refuses a
      stale one), as `RaftMember` does with its ".incoming" file. A write of its own
      still running then is dropped: it is behind what was installed.

    `write(data)` turns PySyncObj's (last entry, previous entry, members) into the
    snapshot's bytes; `read(bytes)` loads them and gives that triple back."""

    def __init__(
        self,
        disk: SimDisk,
        batch_size: int,
        write: Callable[[Any], bytes],
        read: Callable[[bytes], Any],
        counts: Counter[str],
        now_ms: Callable[[], int],
        write_ms: Callable[[], int],
    ) -> None:
        self.disk = disk
        self.batch_size = batch_size
        self._write = write
        self._read = read
        self.counts = counts
        self._now_ms = now_ms
        self._write_ms = write_ms
        self.accept: Callable[[bytes], bool] = lambda _data: True
        self._writing: tuple[int, bytes, int] | None = None
        """(log index, bytes, when the write ends) of the snapshot being written."""
        self._sending: dict[Any, tuple[bytes, int]] = {}
        """Per follower: the snapshot being sent to it and how many bytes are sent."""
        self._receiving: bytearray | None = None

    def checkSerializing(self) -> tuple[int, int | None]:
        if self._writing is None:
            return SERIALIZER_STATE.NOT_SERIALIZING, None
        index, snapshot, ends_ms = self._writing
        if self._now_ms() < ends_ms:
            return SERIALIZER_STATE.SERIALIZING, index
        self._writing = None
        self.disk.snapshot = snapshot
        self.counts["written"] += 1
        self._sending = {}  # as PySyncObj's: transfers start over with the new snapshot
        return SERIALIZER_STATE.SUCCESS, index

    def serialize(self, data: Any, index: int) -> None:
        if self._writing is not None:
            return
        self._writing = (index, self._write(data[1:]), self._now_ms() + self._write_ms())

    def deserialize(self) -> Any:
        assert self.disk.snapshot is not None
        return (None, *self._read(self.disk.snapshot))

    def getTransmissionData(self, follower: Any) -> tuple[bytes, bool, bool] | None:
        if self.disk.snapshot is None:
            # PySyncObj's would answer None (no snapshot file to open), and PySyncObj
            # then sends empty snapshot messages until appendEntriesPeriod has passed:
            # for ever on the simulated clock, which stands still during a tick. Say so.
            raise RuntimeError(f"{self.disk.name} was asked to send a snapshot it does not have")
        snapshot, sent = self._sending.get(follower) or (self.disk.snapshot, 0)
        chunk = snapshot[sent : sent + self.batch_size]
        last = not chunk
        if last:
            self._sending.pop(follower, None)
            self.counts["sent"] += 1
        else:
            self._sending[follower] = (snapshot, sent + len(chunk))
        return chunk, sent == 0, last

    def setTransmissionData(self, data: tuple[bytes, bool, bool] | None) -> bool:
        if data is None:
            return False
        chunk, first, last = data
        if first:
            self._receiving = bytearray()
        elif self._receiving is None:
            return False
        self._receiving += chunk
        if not last:
            return False
        snapshot, self._receiving = bytes(self._receiving), None
        if not self.accept(snapshot):
            self.counts["refused"] += 1
            return False
        if self._writing is not None:  # behind the snapshot installed: it must not land
            self._writing = None
            self.counts["write dropped"] += 1
        self.disk.snapshot = snapshot
        self.counts["installed"] += 1
        return True

    def cancelTransmisstion(self, follower: Any) -> None:  # sic: PySyncObj's spelling
        self._sending.pop(follower, None)


# -------------------------------------------------------------------- member


class SimPoller:
    """PySyncObj's poller for a simulated member: `poll`, at the end of each tick,
    reads the messages that arrived since the last one. As a real node's poll, it
    answers the AppendEntries it read after one sync (`RaftRules.hold_replies`)."""

    def __init__(self, network: Network, address: str, member: RaftRules) -> None:
        self.network = network
        self.address = address
        self.member = member
        self.handled = 0

    def poll(self, _timeout: float) -> None:
        if self.member.duties_deferred:
            self.handled = 0  # the tick stopped before its poll: it reads when resumed
            return
        self.handled = self.read()

    def read(self) -> int:
        self.member.hold_replies()
        try:
            return self.network.read(self.address)
        finally:
            self.member.release_replies()

    def subscribe(self, *_args: Any) -> None:
        raise NotImplementedError("a simulated member has no descriptors to poll")

    def unsubscribe(self, *_args: Any) -> None:
        raise NotImplementedError("a simulated member has no descriptors to poll")


class SimMember(RaftRules):
    """The real Raft rules on the simulated network and disk, ticked by the simulator."""

    def __init__(
        self,
        network: Network,
        name: str,
        disk: SimDisk,
        *,
        apply: Callable[[int, bytes], Any],
        snapshot: Callable[[], bytes],
        restore: Callable[[bytes], None],
        on_tick: Callable[[], None],
        raft_timeouts: tuple[float, float],
        compaction_entries: int | None = None,
        peers: Mapping[str, str] | None = None,
        on_change_cluster: Callable[[Any, bool], None] = lambda request, accepted: None,
    ) -> None:
        """`peers`: name -> Raft address of every member this node starts with, itself
        included (by default every host of the network, at its name)."""
        peers = settle_first_configuration(  # the real record, on this node's disk
            disk.files,
            "/",
            peers or {n: n for n in network.names},
            holds_raft_state=disk.snapshot is not None
            or disk.files.read(disk.JOURNAL + ".meta") is not None,
        )
        self.name = name
        self.address = address = peers[name]
        self.network = network
        self._on_change_cluster = on_change_cluster
        self.disk = disk
        self._apply = apply
        self._snapshot = snapshot
        self._restore = restore
        self._on_tick = on_tick
        self.transport = SimTransport(network, address, list(peers.values()))
        conf = SyncObjConf(
            autoTick=False,
            journalFile=f"sim:{name}/raft.log",
            fullDumpFile=f"sim:{name}/snapshot",
            serializer=self._write_snapshot,
            deserializer=self._read_snapshot,
            logCompactionMinEntries=compaction_entries or 10**12,
            logCompactionMinTime=10**12,
            raftMinTimeout=raft_timeouts[0],
            raftMaxTimeout=raft_timeouts[1],
            appendEntriesPeriod=min(0.1, raft_timeouts[0] / 4),
            leaderFallbackTimeout=2 * raft_timeouts[1],  # check-quorum: see RaftRules
            appendEntriesBatchSizeBytes=4 * 1024 * 1024,
            commandsWaitLeader=True,
            dynamicMembershipChange=True,
        )
        others = [network.node(a) for n, a in peers.items() if n != name]
        super().__init__(network.node(address), others, conf, transport=self.transport)
        self.journal: DurableJournal = self._SyncObj__raftLog
        self.check_stored_state()
        self.poller = SimPoller(network, address, self)
        self._poller = self.poller
        self.serializer: SimSerializer = self._SyncObj__serializer
        self.serializer.accept = self._leader_snapshot_arrived
        self.at_seam: Callable[[], bool] = lambda: False
        """Asked in each tick between its Raft part and the node's duties: True if the
        process stops there (`pause_mid_tick`); the tick's rest runs when it resumes."""
        self.duties_deferred = False
        self.addOnTickCallback(self._tick_callback)

    def _onTick(self, time_to_wait: float = 0.0) -> None:
        if self._SyncObj__needLoadDumpFile:
            # PySyncObj looks for its snapshot file on the real disk at the first tick:
            # this node's is on its simulated disk
            self._SyncObj__needLoadDumpFile = False
            if self.disk.snapshot is not None:
                self._SyncObj__loadDumpFile(clearJournal=False)
        super()._onTick(time_to_wait)

    def _tick_callback(self) -> None:
        self.journal.sync()  # the no-op of a new term, as RaftMember's tick syncs
        self.push_commit_index()
        self.keep_peer_connections_alive()
        # The seam: PySyncObj's election and leader checks, applies, AppendEntries and
        # commands are done; the node's duties (NodeDown, Tick) and the poll are not.
        # A process stopped here wakes up believing what it believed before the stop,
        # on a clock that jumped: the duties run first, the poll reads what came.
        if self.at_seam():
            self.duties_deferred = True
            return
        self._on_tick()

    def finish_tick(self) -> int:
        """The rest of a tick stopped at the seam: the duties, then the poll. Returns
        how many messages the poll read."""
        self.duties_deferred = False
        self._on_tick()
        self.poller.poll(0)
        handled: int = self.poller.handled
        return handled

    def apply_raw(self, index: int, payload: bytes) -> Any:
        return self._apply(index, payload)

    def _SyncObj__changeCluster(self, request: Any) -> bool:
        """The real rule (as leader: append a configuration change, or refuse it), told
        to the simulation (the run counts changes accepted and refused)."""
        accepted = bool(super()._SyncObj__changeCluster(request))
        self._on_change_cluster(request, accepted)
        return accepted

    def make_durable(self) -> None:
        self.journal.sync()

    def make_node(self, name: str, address: str) -> Any:
        return self.network.node(address)

    def run_on_tick_thread(self, call: Callable[[], None]) -> None:
        call()  # one thread: the simulator's

    # -------------------------------------------------------------- snapshots

    def _write_snapshot(self, data: tuple[Entry, Entry, Any]) -> bytes:
        """As `RaftMember._write_snapshot`, to bytes."""
        return self.snapshot_bytes(data)

    def _read_snapshot(self, data: bytes) -> tuple[Entry, Entry, set[Any]]:
        try:
            stored = decode_snapshot(data, f"{self.name}'s snapshot")
            self._restore(stored.machine)
        except Exception as e:
            self._snapshot_load_error = e  # PySyncObj swallows it: RaftRules raises it
            raise
        self.took_snapshot(stored)
        return stored.last, stored.prev, {self.network.node(a) for a, _ in stored.members}

    def stored_snapshot(self) -> tuple[Entry, Entry] | None:
        if self.disk.snapshot is None:
            return None
        try:
            stored = decode_snapshot(self.disk.snapshot, f"{self.name}'s snapshot")
        except ValueError as e:
            raise JournalDamagedError(str(e)) from None
        return stored.last, stored.prev

    def _leader_snapshot_arrived(self, data: bytes) -> bool:
        try:
            last = decode_snapshot(data, "the leader's snapshot").last
        except ValueError:  # its chunks came out of order (the hostile `reorder` fault)
            self.serializer.counts["garbled"] += 1
            return False
        return self.accept_leader_snapshot(last[1], last[2])


class ObservedLeaderClock(LeaderClock):
    """The real leader clock, telling the simulation every time it stamps (the checker
    compares an applied time with the true time when it was stamped)."""

    def __init__(
        self,
        wall_ms: Callable[[], int],
        monotonic: Callable[[], float],
        on_stamp: Callable[[int], None],
    ) -> None:
        super().__init__(wall_ms, monotonic)
        self._on_stamp = on_stamp

    def now(self, term: int) -> int | None:
        ts = super().now(term)
        if ts is not None:
            self._on_stamp(ts)
        return ts


# ---------------------------------------------------------------------- node


class SimReplica(Replica):
    """The real replica; its leader clock tells the simulation when it stamps."""

    def __init__(self, node: SimNode, *args: Any, **kwargs: Any) -> None:
        self._sim_node = node
        super().__init__(*args, **kwargs)

    def _leader_clock(
        self, wall_clock: Callable[[], int], monotonic: Callable[[], float]
    ) -> LeaderClock:
        return ObservedLeaderClock(wall_clock, monotonic, self._sim_node.sim.on_stamp)


class _SimReplicaHandle:
    """The replica as the core sees it: outcomes arrive as events of their own, after
    the tick that produced them (as the trio token hands them over on a real node), and
    not at all once the node's process is gone."""

    def __init__(self, node: SimNode) -> None:
        self._node = node
        self.node_id = node.name

    def _soon(self, fn: Callable[..., None], *args: Any) -> None:
        self._node.soon(fn, *args)

    def propose(self, command: Command, callback: ProposalCallback | None = None) -> None:
        replica = self._node.replica
        if callback is None:
            replica.propose(command)
        else:
            replica.propose(command, lambda reply, error: self._soon(callback, reply, error))
        self._node.wake()

    def query(self, read: Callable[[Machine], T]) -> T:
        return self._node.replica.query(read)

    def members(self) -> dict[str, str]:
        return self._node.replica.members()

    def status(self, *, audit: bool = False) -> dict[str, Any]:
        return self._node.replica.status()

    def add_member(
        self, name: str, address: str, callback: Callable[[ProposalError | None], None]
    ) -> None:
        self._node.replica.add_member(name, address, lambda error: self._soon(callback, error))
        self._node.wake()

    def remove_member(self, name: str, callback: Callable[[ProposalError | None], None]) -> None:
        self._node.replica.remove_member(name, lambda error: self._soon(callback, error))
        self._node.wake()

    def ask_leader_to_step_down(self) -> None:
        self._node.replica.ask_leader_to_step_down()
        self._node.wake()

    def membership_settled(self) -> bool:
        return self._node.replica.membership_settled()

    def watch_ends(self, queues: frozenset[str]) -> None:
        self._node.replica.watch_ends(queues)

    def take_ends_moved(self) -> set[str]:
        return self._node.replica.take_ends_moved()


class _SimShell:
    """What the core asks of its shell, done by the simulated node."""

    def __init__(self, node: SimNode) -> None:
        self._node = node

    def wake(self, conn: ConnectionCore) -> None:
        self._node.wake_conn(conn)

    def timers_changed(self) -> None:
        self._node.timers_changed()

    def run_in_worker(
        self, work: Callable[[], Any], done: Callable[[Any, BaseException | None], None]
    ) -> None:
        self._node.run_in_worker(work, done)


class SimNode:
    """One run (incarnation) of a node: the real `Replica` on a `SimMember`, and the real
    `NodeCore` serving its clients' connections (`SimLink`s), ticked by the simulator.
    What a real node's trio shell and Raft thread do, the simulator does here: it hands
    the replica's effects and outcomes to the core after the tick, reads the bytes that
    arrived from clients, writes what the core queued, runs the core's timers."""

    def __init__(
        self,
        sim: Any,
        name: str,
        incarnation: int,
        disk: SimDisk,
        *,
        grace_s: float,
        raft_timeouts: tuple[float, float],
        compaction_entries: int | None = None,
        tick_s: float = 0.05,
    ) -> None:
        self.sim = sim
        self.world: World = sim.world
        self.name = name
        self.incarnation = incarnation
        self.disk = disk
        self.tick_us = micros(tick_s)
        self.alive = True
        self.paused = False
        self.stalled_until_us = 0
        """Until then its Raft thread is held up (`slow_host`): no ticks, no reads."""
        self.pause_at_seam_us: int | None = None
        """`pause_mid_tick`: the next tick stops at its seam (`SimMember.at_seam`) and
        the process is paused this long."""
        self.was_leader = False
        self._tick_at: int | None = None
        self._ticking = False
        self._woken_in_tick = False
        self._busy_until = 0
        self._core_timer_at: int | None = None
        self._flushing: set[ConnectionCore] = set()
        self._accepting: list[Any] = []
        """Client connections that arrived while the node was paused."""
        self._inbound: dict[Any, list[bytes]] = {}
        """Bytes from client links, not read yet (in order of first arrival)."""
        variant: Variant = sim.variant
        self._config = replica_config = ReplicaConfig(
            node_id=name,
            peers=sim.peers_for(name),
            data_dir=f"/sim/{name}",
            secret="simulated",
            node_down_grace_s=grace_s,
            raft_timeouts=raft_timeouts,
            compaction_entries=compaction_entries or 10**12,
        )
        self.replica = SimReplica(
            self,
            replica_config,
            lambda index, effects: self.soon(self._effects, index, effects),
            lambda: self.soon(self._state_replaced),
            wall_clock=lambda: sim.wall_ms(name),
            monotonic=self.world.monotonic,
            member_factory=self._make_member,
            observer=self,
            machine_factory=variant.machine,
            effect_filter=variant.effect_filter,
            on_ends_moved=lambda: self.soon(self._ends_moved),
        )
        rng = self.world.stream(f"node-{name}-{incarnation}")
        self.core = NodeCore(
            NodeConfig(replica=replica_config, insecure=True, admin_token=ADMIN_TOKEN),
            _SimReplicaHandle(self),
            _SimShell(self),
            self.world.monotonic,
            random_bytes=rng.randbytes,
        )
        self.timers_changed()
        self.world.after(0, self._measure_disk)

    def _measure_disk(self) -> None:
        """As `NodeServer._watch_disk`: tell the core the data disk's free space now and
        every `DISK_CHECK_EVERY_S` (a paused process measures nothing; the node's loop
        runs while its Raft thread stalls)."""
        if not self.alive:
            return
        if not self.paused:
            self.core.disk_free(self.disk.files.free_bytes)
        self.world.after(micros(DISK_CHECK_EVERY_S), self._measure_disk)

    def _make_member(self, **callbacks: Any) -> SimMember:
        member = SimMember(
            self.sim.network,
            self.name,
            self.disk,
            raft_timeouts=self._config.raft_timeouts,
            compaction_entries=self._config.compaction_entries,
            peers=self._config.peers,
            on_change_cluster=lambda request, accepted: self.sim.on_change_cluster(
                self, request, accepted
            ),
            **callbacks,
        )
        member.at_seam = self._at_seam
        return member

    @property
    def member(self) -> SimMember:
        member: SimMember = self.replica.member  # type: ignore[assignment]
        return member

    @property
    def machine(self) -> Machine:
        return self.replica.machine

    @property
    def replay_until(self) -> int:
        return self.replica.replay_until

    def soon(self, fn: Callable[..., None], *args: Any) -> None:
        """Run `fn(*args)` after the current event, if this run of the node is alive."""

        def run() -> None:
            if self.alive:
                fn(*args)

        self.world.after(0, run)

    # -------------------------------------------------------------- observing

    def applied(
        self, replica: Replica, index: int, payload: bytes, command: Command, applied: Applied
    ) -> None:
        self.sim.on_applied(self, index, zlib.crc32(payload), command, applied)

    def snapshot_loaded(self, replica: Replica, applied: int, index: int) -> None:
        self.sim.on_snapshot_loaded(self, applied, index)

    def proposed_duty(self, replica: Replica, command: Command) -> None:
        if isinstance(command, NodeDown | NodeUp):
            self.sim.on_failure_command(self, command)

    # ------------------------------------------------------------------ ticks

    @property
    def stalled(self) -> bool:
        return self.world.now_us < self.stalled_until_us

    def stall(self, until_us: int) -> None:
        """Hold its Raft thread up until `until_us` (`slow_host`: a GC pause, a starved
        CPU). Unlike a pause the process keeps its connections: messages and client
        bytes wait in its buffers, and it reads them all when it runs again."""
        self.stalled_until_us = max(self.stalled_until_us, until_us)
        self.world.trace(f"stall {self.name} {until_us}")

    def unstall(self) -> None:
        """The heal: a stalled Raft thread runs again now, and the core's timers that
        waited for the stall's end are due now too (they kept waiting for it: seed 1627,
        a membership change asked the leader to step down again 3.4 s after the heal,
        not 0.1 s, and the new leader came past the heal bound)."""
        if self.stalled:
            self.stalled_until_us = self.world.now_us
            self.world.trace(f"unstall {self.name}")
            self.wake()
            self._core_timer_at = None
            self.timers_changed()

    def _at_seam(self) -> bool:
        """The tick reached its seam: stop here if a `pause_mid_tick` is due."""
        duration = self.pause_at_seam_us
        if duration is None:
            return False
        self.pause_at_seam_us = None
        self.world.trace(f"pause mid-tick {self.name}")
        self.sim.pause(self.name)
        self.world.after(duration, self.sim.resume, self.name)
        return True

    def wake(self, delay_us: int = 0) -> None:
        """Tick at now + delay, once the last tick's CPU time is over (sooner ticks
        replace later ones). Woken during its own tick (a proposal from a callback), the
        node ticks again as soon as this tick's CPU time is over, as PySyncObj's thread
        loops straight into its next tick."""
        if self._ticking:
            self._woken_in_tick = True
            return
        when = max(self.world.now_us + delay_us, self._busy_until, self.stalled_until_us)
        if self._tick_at is not None and self._tick_at <= when:
            return
        self._tick_at = when
        self.world.at(when, self._tick, when)

    def _tick(self, when: int) -> None:
        if self._tick_at != when:
            return  # replaced by a sooner tick
        self._tick_at = None
        if not self.alive or self.paused:
            return  # a resumed node is woken again
        if self.stalled:
            self.wake()  # when the stall ends
            return
        self._run_tick(self._tick_whole)

    def _tick_whole(self) -> int:
        self._read_clients()
        # the wait in the last tick's poll ends: it reads what arrived, then ticks again
        handled = self.member.poller.read()
        self.member.doTick(0)
        handled += self.member.poller.handled
        return handled

    def _run_tick(self, tick: Callable[[], int]) -> None:
        """Run `tick` (which says how many messages it read), then what follows a tick:
        its CPU time, the observers, the next tick."""
        self._ticking = True
        self._woken_in_tick = False
        try:
            handled = tick()
        except (JournalFailedError, JournalDamagedError) as e:
            # as RaftMember's tick loop: nothing more may be acknowledged; the node stops
            self._ticking = False
            self.sim.on_fatal(self, e)
            return
        finally:
            self._ticking = False
        if not self.alive:
            return
        self._busy_until = self.world.now_us + TICK_COST_US + PER_MESSAGE_COST_US * handled
        self.sim.on_ticked(self)
        leader = self.member.is_leader()
        if leader != self.was_leader:
            self.was_leader = leader
            self.sim.on_leadership(self, leader)
        self.wake(0 if self._woken_in_tick else self._next_tick_us())

    def _next_tick_us(self) -> int:
        """As RaftMember's tick loop: a tick period from now, or sooner, just past the
        election deadline of a follower or candidate."""
        if self.member.until_election_s() is None:
            return self.tick_us
        deadline = self.member._SyncObj__raftElectionDeadline
        at = first_micros_at(deadline) + 1000  # the real loop's 1 ms past it
        return max(1, min(self.tick_us, at - self.world.now_us))

    def resumed(self) -> None:
        """A paused node runs again: it finishes a tick stopped at its seam, ticks, and
        its core's timers run."""
        if self.member.duties_deferred:
            self._run_tick(self.member.finish_tick)
            if not self.alive:
                return
        self.wake()
        accepting, self._accepting = self._accepting, []
        for link in accepting:
            if link.open:
                self.accept(link)
        self._core_timer_at = None
        self.timers_changed()
        for conn in sorted(self.core.connections, key=lambda c: c.number):
            self.wake_conn(conn)

    # ---------------------------------------------------- from the replica

    def _effects(self, index: int, effects: tuple[Effect, ...]) -> None:
        self.core.effects_applied(index, effects)

    def _state_replaced(self) -> None:
        self.core.state_replaced()

    def _ends_moved(self) -> None:
        self.core.ends_moved()

    # ------------------------------------------------------- the core's shell

    def timers_changed(self) -> None:
        core: NodeCore | None = self.__dict__.get("core")
        if core is None:
            return  # the core is being built: asked once it is (`__init__`)
        when_s = core.next_timer()
        if when_s is None:
            return
        when = max(first_micros_at(when_s), self.world.now_us)
        if self._core_timer_at is not None and self._core_timer_at <= when:
            return
        self._core_timer_at = when
        self.world.at(when, self._core_timers_due, when)

    def _core_timers_due(self, when: int) -> None:
        if self._core_timer_at != when:
            return
        self._core_timer_at = None
        if not self.alive or self.paused:
            return  # `resumed` schedules them again
        if self.stalled:
            self._core_timer_at = self.stalled_until_us
            self.world.at(self.stalled_until_us, self._core_timers_due, self.stalled_until_us)
            return
        self.core.run_timers()
        self.timers_changed()

    def run_in_worker(
        self, work: Callable[[], Any], done: Callable[[Any, BaseException | None], None]
    ) -> None:
        def run() -> None:
            try:
                result = work()
            except Exception as e:
                done(None, e)
            else:
                done(result, None)

        self.soon(run)

    def wake_conn(self, conn: ConnectionCore) -> None:
        if conn not in self._flushing:
            self._flushing.add(conn)
            self.soon(self._flush, conn)

    # ---------------------------------------------------------------- clients

    def accept(self, link: Any) -> None:
        """A client connected (`SimLink`): the core's connection for it, in `link.conn`
        (a paused node accepts once it is resumed)."""
        if self.paused:
            self._accepting.append(link)
            return
        conn = self.core.connection_made()
        conn.transport = link
        link.conn = conn

    def receive(self, link: Any, data: bytes) -> None:
        """Bytes from `link` reach this node's socket: read on the next tick (a paused
        node reads them when resumed)."""
        self._inbound.setdefault(link, []).append(data)
        if not self.paused:
            self.wake()

    def link_closed(self, link: Any) -> None:
        """The client closed its connection (or its process died)."""
        self._inbound.pop(link, None)
        if link in self._accepting:
            self._accepting.remove(link)
        if link.conn is not None:
            self.core.connection_lost(link.conn)

    def _read_clients(self) -> None:
        """Hand the core the bytes that arrived since the last tick, connection by
        connection in order of arrival, while it wants them (back-pressure)."""
        inbound, self._inbound = self._inbound, {}
        for link, chunks in inbound.items():
            conn = link.conn
            if conn is None:
                self._inbound[link] = chunks  # not accepted yet (it was paused)
                continue
            if conn.done:
                continue
            if not conn.wants_data:
                self._inbound[link] = chunks  # read once there is room
                continue
            self.core.data_received(conn, b"".join(chunks))

    def _flush(self, conn: ConnectionCore) -> None:
        """Write what the core queued for `conn`; end the connection if the core ends it."""
        self._flushing.discard(conn)
        link = conn.transport
        if link is None or conn.closed:
            return
        if conn.aborted:
            link.broken_by_node()
            self.core.connection_lost(conn)
            return
        while conn.outbox:
            data, frames, cost = conn.take_output(1024 * 1024)
            link.to_client(data)
            self.core.sent(conn, frames, cost)
        if conn.done:
            link.broken_by_node()
            self.core.connection_lost(conn)
        elif conn.wants_data and link in self._inbound:
            self.wake()  # what waited for room is read on the next tick
