# ruff: noqa: N802  (PySyncObj's camelCase Serializer and SyncObj methods)
"""A simulated node's Raft member: the real `RaftRules` on the simulated network
(`SimPoller`, `SimMember`), ticked by the simulator, and the leader clock the simulator
observes (`ObservedLeaderClock`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pysyncobj import SyncObjConf

from quorumq.raft.first_configuration import settle_first_configuration
from quorumq.raft.journal import JournalDamagedError, RaftJournal
from quorumq.raft.rules import (
    Entry,
    LeaderClock,
    RaftRules,
    decode_snapshot,
    leader_fallback_s,
)

from .network import Network, SimTransport
from .storage import SimDisk, SimSerializer

# -------------------------------------------------------------------- member


class SimPoller:
    """PySyncObj's poller for a simulated member: `poll`, at the end of each tick,
    reads the messages that arrived since the last one. As a real node's poll, it
    answers the AppendEntries it read after one sync (`RaftRules.hold_replies`)."""

    def __init__(self, network: Network, address: str, member: RaftRules, group: int = 0) -> None:
        self.network = network
        self.address = address
        self.member = member
        self.group = group
        self.handled = 0

    def poll(self, _timeout: float) -> None:
        if self.member.duties_deferred:
            self.handled = 0  # the tick stopped before its poll: it reads when resumed
            return
        self.handled = self.read()

    def read(self) -> int:
        self.member.hold_replies()
        try:
            return self.network.read(self.address, self.group)
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
        group: int = 0,
    ) -> None:
        """`peers`: name -> Raft address of every member this node starts with, itself
        included (by default every host of the network, at its name). `group`: the
        node's Raft group this member belongs to (`disk` is that group's part)."""
        directory = disk.directory or "/"
        peers = settle_first_configuration(  # the real record, on this node's disk
            disk.files,
            directory,
            peers or {n: n for n in network.names},
            holds_raft_state=disk.snapshot is not None
            or disk.files.read(disk.meta_path) is not None,
        )
        self.name = name
        self.group = group
        self.keep_identity_in(disk.files, directory)
        self.address = address = peers[name]
        self.network = network
        self._on_change_cluster = on_change_cluster
        self.disk = disk
        self._apply = apply
        self._snapshot = snapshot
        self._restore = restore
        self._on_tick = on_tick
        self.transport = SimTransport(network, address, list(peers.values()), group)
        conf = SyncObjConf(
            autoTick=False,
            journalFile=f"sim:{name}{disk.directory}/raft.log",
            fullDumpFile=f"sim:{name}{disk.directory}/snapshot",
            serializer=self._write_snapshot,
            deserializer=self._read_snapshot,
            logCompactionMinEntries=compaction_entries or 10**12,
            logCompactionMinTime=10**12,
            raftMinTimeout=raft_timeouts[0],
            raftMaxTimeout=raft_timeouts[1],
            appendEntriesPeriod=min(0.1, raft_timeouts[0] / 4),
            leaderFallbackTimeout=leader_fallback_s(raft_timeouts),  # check-quorum: RaftRules
            appendEntriesBatchSizeBytes=4 * 1024 * 1024,
            commandsWaitLeader=True,
            dynamicMembershipChange=True,
        )
        others = [network.node(a) for n, a in peers.items() if n != name]
        super().__init__(network.node(address), others, conf, transport=self.transport)
        self.announce_identity()
        self.journal: RaftJournal = self._SyncObj__raftLog
        self.check_stored_state()
        self.poller = SimPoller(network, address, self, group)
        self._poller = self.poller
        self.serializer: SimSerializer = self._SyncObj__serializer
        self.serializer.accept = self._leader_snapshot_arrived
        self.at_seam: Callable[[], bool] = lambda: False
        """Asked in each tick between its Raft part and the node's duties: True if the
        process stops there (`pause_mid_tick`); the tick's rest runs when it resumes."""
        self.duties_deferred = False
        self.addOnTickCallback(self._tick_callback)

    def new_cluster_identity(self) -> str:
        return f"{self.network.world.identity_random.getrandbits(128):032x}"

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
