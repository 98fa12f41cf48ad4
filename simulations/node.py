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
  (`RaftRules.check_stored_state`), loads its snapshot, then its journal.
* `SimNode` is what `quorumq.replica.Replica` and `quorumq.server.node.NodeServer` do
  for one node: apply committed entries to the machine, run only this node's effects
  (`local_effects`), turn a delivery to a consumer it does not have into `Down`, and as
  leader propose `NodeDown`/`NodeUp` (`failure_commands`). Entries replayed from the
  node's own journal at start-up run no effects, nor do entries applied a second time.
  The node keeps what it sent each consumer (`quorumq.deliveries`, the server's code);
  after a snapshot load it sends what the machine says its consumers hold and were not
  sent, and cancels those the machine removed (`_resync_consumers`, as
  `NodeServer._resync_consumers`). A proposal PySyncObj never answers is answered
  "unknown" after 15 s (`quorumq.replica.InFlight`, the replica's code).

`Variant` holds the test-only switches of the negative controls: another machine, or
another effect filter. The default is the real thing.
"""

from __future__ import annotations

import random
import zlib
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs
from pysyncobj import FAIL_REASON, SyncObjConf
from pysyncobj.config import SERIALIZER_STATE

from quorumq.codec import UNSTAMPED, CodecError, decode_entry, encode_entry
from quorumq.deliveries import SentDeliveries
from quorumq.deliveries import missing as missing_deliveries
from quorumq.machine import (
    OK,
    Ack,
    Command,
    ConsumerDown,
    Deliver,
    Down,
    Effect,
    Error,
    ErrorCode,
    Machine,
    Meta,
    Nack,
    NodeDown,
    Reply,
    Subscribe,
)
from quorumq.raft.journal import DurableJournal, JournalDamagedError, JournalFailedError
from quorumq.raft.member import NOT_APPLIED
from quorumq.raft.rules import Entry, LeaderClock, RaftRules, decode_snapshot, encode_snapshot
from quorumq.replica import PROPOSAL_TIMEOUT_S, InFlight, failure_commands, local_effects

from .disk import SimFiles
from .network import Network, SimTransport
from .world import World, micros

if TYPE_CHECKING:
    from .workload import SimConsumer

TICK_COST_US = 100
PER_MESSAGE_COST_US = 20
"""Simulated CPU time of a tick: what arrives meanwhile waits for the next tick, so
proposals group into one AppendEntries under load, as they do on a real node."""

SETTLE_ATTEMPTS = 20
"""As the real server: an ack or nack is proposed again this often after a failure."""

EffectFilter = Callable[..., tuple[Effect, ...]]


@attrs.frozen(kw_only=True)
class Variant:
    """What a node runs. The defaults are quorumq's; tests swap in broken ones."""

    name: str = "real"
    machine: Callable[[], Machine] = Machine
    effect_filter: EffectFilter = local_effects
    """(effects, node, proxy=, replicas=) -> the effects this node runs."""
    down_stale_consumers: bool = True
    """A restarted node proposes `Down` for the consumers of its earlier runs once it has
    caught up. The real server (quorumq/server/node.py) does not do this yet: a node
    restarted within the node-down grace period leaves them in the queue holding their
    messages forever (found by seed 2, see `AS_IS`). Proposed fix, modelled here."""
    retry_down: bool = True
    """A `Down` the node proposes for a closed consumer is proposed again when a leader
    change loses it. The real server proposes it once, with no callback: a lost `Down`
    leaves the dead consumer holding its messages forever (found by seed 7, `AS_IS`).
    Proposed fix, modelled here."""
    retry_unknown_nack: bool = True
    """A requeueing `Nack` whose outcome is unknown (leader change) is proposed again if
    this node's replica, caught up, shows the consumer still holding the messages. The
    real server gives up on it and tells no one: if it was lost, the live consumer holds
    the message until it disconnects (found by seed 27, `AS_IS`). Proposed fix."""
    resettle_refused_batch: bool = True
    """An ack (nack) refused because one of its offsets is no longer held is proposed
    again for the offsets still held. The real server refuses the whole gathered `Ack`
    (`Connection._gather_ack`) and answers the refusal: when a consumer acks a message
    that its own nack of an earlier one returned with its key, together with others
    read in the same read, those others stay held by the live consumer forever (found
    by seed 1 at 1,000 records/s, `AS_IS`). Proposed fix, modelled here."""


REAL = Variant()
AS_IS = Variant(
    name="as-is",
    down_stale_consumers=False,
    retry_down=False,
    retry_unknown_nack=False,
    resettle_refused_batch=False,
)
"""The node's server exactly as quorumq/server/node.py is today."""


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

    def open_journal(self) -> DurableJournal:
        """The journal a starting node opens: `JournalDamagedError` if it must refuse."""
        return DurableJournal(self.JOURNAL, files=self.files)

    def crash(self) -> None:
        self.files.crash()

    def power_loss(self, *, torn: bool = False) -> None:
        self.files.power_loss(torn=torn)


class SimSerializer:
    """PySyncObj's `Serializer` (its snapshot store) for a simulated member, on the
    node's `SimDisk`, behaving as PySyncObj's does with a serializer of ours (the real
    node's configuration, which never forks):

    * `serialize` writes the snapshot at once, on the tick; PySyncObj learns it is
      done, and compacts the journal, from `checkSerializing` (which `RaftRules` calls
      again at once). A new snapshot starts every transfer over.
    * the leader sends a follower behind its compacted log the snapshot it has now,
      in chunks of `logCompactionBatchSize` (the first flagged, then an empty last one);
    * the follower gathers the chunks in memory (lost if it crashes) and stores the
      snapshot only once whole and taken by `accept` (the shared rule that refuses a
      stale one), as `RaftMember` does with its ".incoming" file.

    `write(data)` turns PySyncObj's (last entry, previous entry, members) into the
    snapshot's bytes; `read(bytes)` loads them and gives that triple back."""

    def __init__(
        self,
        disk: SimDisk,
        batch_size: int,
        write: Callable[[Any], bytes],
        read: Callable[[bytes], Any],
        counts: Counter[str],
    ) -> None:
        self.disk = disk
        self.batch_size = batch_size
        self._write = write
        self._read = read
        self.counts = counts
        self.accept: Callable[[bytes], bool] = lambda _data: True
        self._written: int | None = None
        """The index of the snapshot written and not yet reported to PySyncObj."""
        self._sending: dict[Any, tuple[bytes, int]] = {}
        """Per follower: the snapshot being sent to it and how many bytes are sent."""
        self._receiving: bytearray | None = None

    def checkSerializing(self) -> tuple[int, int | None]:
        written, self._written = self._written, None
        if written is None:
            return SERIALIZER_STATE.NOT_SERIALIZING, None
        self._sending = {}  # as PySyncObj's: transfers start over with the new snapshot
        return SERIALIZER_STATE.SUCCESS, written

    def serialize(self, data: Any, index: int) -> None:
        if self._written is not None:
            return
        self.disk.snapshot = self._write(data[1:])
        self._written = index
        self.counts["written"] += 1

    def deserialize(self) -> Any:
        assert self.disk.snapshot is not None
        return (None, *self._read(self.disk.snapshot))

    def getTransmissionData(self, follower: Any) -> tuple[bytes, bool, bool] | None:
        if self._written is not None or self.disk.snapshot is None:
            # PySyncObj's would answer None (still serializing, or no snapshot file to
            # open), and PySyncObj then sends empty snapshot messages until
            # appendEntriesPeriod has passed: for ever on the simulated clock, which
            # stands still during a tick. Say so instead.
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

    def __init__(self, network: Network, name: str, member: RaftRules) -> None:
        self.network = network
        self.name = name
        self.member = member
        self.handled = 0

    def poll(self, _timeout: float) -> None:
        self.handled = self.read()

    def read(self) -> int:
        self.member.hold_replies()
        try:
            return self.network.read(self.name)
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
        restore: Callable[[bytes, int], None],
        on_tick: Callable[[], None],
        raft_timeouts: tuple[float, float],
        compaction_entries: int | None = None,
    ) -> None:
        self.name = name
        self.network = network
        self.disk = disk
        self._apply = apply
        self._snapshot = snapshot
        self._restore = restore
        self._on_tick = on_tick
        self.transport = SimTransport(network, name)
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
            leaderFallbackTimeout=max(2.0, raft_timeouts[1] * 2),
            appendEntriesBatchSizeBytes=4 * 1024 * 1024,
            commandsWaitLeader=True,
        )
        others = [network.nodes[n] for n in network.names if n != name]
        super().__init__(network.nodes[name], others, conf, transport=self.transport)
        self.journal: DurableJournal = self._SyncObj__raftLog
        self.check_stored_state()
        self.poller = SimPoller(network, name, self)
        self._poller = self.poller
        self.serializer: SimSerializer = self._SyncObj__serializer
        self.serializer.accept = self._leader_snapshot_arrived
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
        self._on_tick()

    def apply_raw(self, index: int, payload: bytes) -> Any:
        return self._apply(index, payload)

    def make_durable(self) -> None:
        self.journal.sync()

    # -------------------------------------------------------------- snapshots

    def _write_snapshot(self, data: tuple[Entry, Entry, Any]) -> bytes:
        """As `RaftMember._write_snapshot`, to bytes (a node's name is its Raft address)."""
        last, prev, cluster = data
        members = [(str(n.id), str(n.id)) for n in cluster]
        return encode_snapshot(last, prev, members, self._snapshot(), self.removed_members)

    def _read_snapshot(self, data: bytes) -> tuple[Entry, Entry, set[Any]]:
        try:
            stored = decode_snapshot(data, f"{self.name}'s snapshot")
            self._restore(stored.machine, stored.last[1])
        except Exception as e:
            self._snapshot_load_error = e  # PySyncObj swallows it: RaftRules raises it
            raise
        self.removed_members.clear()
        self.removed_members.update(stored.removed)
        return stored.last, stored.prev, {self.network.nodes[a] for a, _ in stored.members}

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

ProposalCallback = Callable[[Reply | None, str | None], None]
"""(reply, None) when applied here; (None, "not_applied" | "unknown") otherwise."""


class SimNode:
    """One run (incarnation) of a node: a Raft member, its machine, its server duties."""

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
        self.variant: Variant = sim.variant
        self.machine = self.variant.machine()
        self.replicas = frozenset(sim.names)
        self.grace_s = grace_s
        self.tick_us = micros(tick_s)
        self.consumers: dict[str, SimConsumer] = {}
        """Consumers connected to this node, by id."""
        self._queue_of: dict[str, str] = {}
        """The queue of each consumer connected here."""
        self._subscribing: dict[str, ProposalCallback] = {}
        """Consumers whose subscribe is not answered yet, and where the answer goes."""
        self._sent: dict[str, SentDeliveries] = {}
        """What each consumer connected here was sent and may still hold."""
        self._effects_through = 0
        """The highest log index this run applied: a snapshot install can take the machine
        back below it, and entries applied again must not run their effects again."""
        self.snapshots_loaded = 0
        self._downed: set[str] = set()
        self._pending_duties: set[tuple[str, str]] = set()
        self._downing: set[str] = set()
        self._stale_scanned: tuple[int, int] | None = None
        """(applied index, `Down`s lost) at the last scan for stale consumers."""
        self._downs_lost = 0
        self._in_flight: InFlight[str] = InFlight(PROPOSAL_TIMEOUT_S)
        """As the replica's: a proposal PySyncObj never answers is "unknown" after 15 s."""
        self.member = SimMember(
            sim.network,
            name,
            disk,
            apply=self._apply,
            snapshot=self._snapshot,
            restore=self._restore,
            on_tick=self._on_tick,
            raft_timeouts=raft_timeouts,
            compaction_entries=compaction_entries,
        )
        self.member.use_leader_clock(
            ObservedLeaderClock(lambda: sim.wall_ms(name), self.world.monotonic, sim.on_stamp)
        )
        self.member.replicated_time_ms = lambda: self.machine.now_ms  # type: ignore[method-assign]
        self.alive = True
        self.paused = False
        self._tick_at: int | None = None
        self._ticking = False
        self._woken_in_tick = False
        self._frames: dict[object, list[tuple[Callable[..., None] | None, tuple[Any, ...]]]] = {}
        """Client frames not read yet, by connection (in order of first arrival)."""
        self._busy_until = 0
        self._consumer_counter = 0
        self.was_leader = False

    @property
    def replay_until(self) -> int:
        """Entries up to here are replayed from this node's own journal: no effects (as
        `Replica.replay_until`, which drops when the journal is truncated)."""
        return self.member.journal.replay_until

    # ------------------------------------------------------------------ ticks

    def wake(self, delay_us: int = 0) -> None:
        """Tick at now + delay, once the last tick's CPU time is over (sooner ticks
        replace later ones). Woken during its own tick (a proposal from a callback), the
        node ticks again as soon as this tick's CPU time is over, as PySyncObj's thread
        loops straight into its next tick."""
        if self._ticking:
            self._woken_in_tick = True
            return
        when = max(self.world.now_us + delay_us, self._busy_until)
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
        self._ticking = True
        self._woken_in_tick = False
        try:
            self._read_clients()
            # the wait in the last tick's poll ends: it reads what arrived, then ticks again
            handled = self.member.poller.read()
            self.member.doTick(0)
            handled += self.member.poller.handled
        except (JournalFailedError, JournalDamagedError) as e:
            # as RaftMember's tick loop: nothing more may be acknowledged; the node stops
            self._ticking = False
            self.sim.on_fatal(self, e)
            return
        finally:
            self._ticking = False
        self._busy_until = when + TICK_COST_US + PER_MESSAGE_COST_US * handled
        leader = self.member.is_leader()
        if leader != self.was_leader:
            self.was_leader = leader
            self.sim.on_leadership(self, leader)
        self.wake(0 if self._woken_in_tick else self.tick_us)

    # ---------------------------------------------------------------- clients

    def receive(self, client: object, fn: Callable[..., None] | None, *args: Any) -> None:
        """A frame from `client` reaches this node's socket: read on the next tick (a
        paused node reads it when resumed). `fn` None: an ack or nack (`args[0]`)."""
        self._frames.setdefault(client, []).append((fn, args))
        if not self.paused:
            self.wake()

    def _read_clients(self) -> None:
        """Handle every frame that arrived since the last tick, one connection at a time
        in order of arrival, as `Connection._handle_available` handles one read: the
        acks (nacks) of a consumer read together become one `Ack` (`Nack`)."""
        frames, self._frames = self._frames, {}
        for read in frames.values():
            settles: dict[tuple[str, bool, bool], Ack | Nack] = {}
            for fn, args in read:
                if fn is not None:
                    self._flush_settles(settles)
                    fn(*args)
                    continue
                command: Ack | Nack = args[0]
                nack = isinstance(command, Nack)
                key = (command.consumer, nack, nack and command.requeue)
                gathered = settles.get(key)
                settles[key] = (
                    command
                    if gathered is None
                    else attrs.evolve(gathered, offsets=[*gathered.offsets, *command.offsets])
                )
            self._flush_settles(settles)

    def _flush_settles(self, settles: dict[tuple[str, bool, bool], Ack | Nack]) -> None:
        for command in settles.values():
            self.settle(command)
        settles.clear()

    # -------------------------------------------------------------- proposing

    def propose(self, command: Command, callback: ProposalCallback | None) -> None:
        """Submit a command through this node's member (it forwards to the leader)."""
        payload = encode_entry(UNSTAMPED, command)  # the leader stamps the time
        if callback is None:
            self.member.propose(payload, None)
        else:
            once = self._in_flight.track(callback, self.world.monotonic())

            def done(result: Any, reason: int) -> None:
                if reason == FAIL_REASON.SUCCESS:
                    once(result, None)
                else:
                    once(None, "not_applied" if reason in NOT_APPLIED else "unknown")

            self.member.propose(payload, done)
        self.wake()

    def settle(self, command: Ack | Nack, attempt: int = 1) -> None:
        """As the real server: propose an ack or nack, and again if a failure lost it
        (an ack is safe to repeat; a requeueing nack only when surely not applied)."""

        def done(reply: Reply | None, error: str | None) -> None:
            repeat = error == "not_applied" or (error == "unknown" and isinstance(command, Ack))
            if repeat and attempt < SETTLE_ATTEMPTS and self.alive:
                self.settle(command, attempt + 1)
            elif error == "unknown" and self.variant.retry_unknown_nack and self.alive:
                self._nack_if_still_held(command, attempt)
            elif (
                isinstance(reply, Error)
                and reply.code == ErrorCode.NOT_HELD
                and self.variant.resettle_refused_batch
            ):
                self._settle_still_held(command, attempt)

        self.propose(command, done)

    def _settle_still_held(self, command: Ack | Nack, attempt: int) -> None:
        """Refused whole because some offset is no longer held (a nack returned it with
        its key, or an earlier attempt landed): settle the offsets this replica, which
        has just applied the refusal, shows the consumer still holding."""
        if not self.alive or attempt >= SETTLE_ATTEMPTS:
            return
        if command.queue in self.machine.queues():
            held = set(self.machine.unacked(command.queue, command.consumer))
            offsets = [o for o in command.offsets if o in held]
            if offsets:
                self.settle(attrs.evolve(command, offsets=offsets), attempt + 1)

    def _nack_if_still_held(self, command: Ack | Nack, attempt: int) -> None:
        """Once this replica has caught up: nack again what the consumer still holds."""
        if not self.alive or attempt >= SETTLE_ATTEMPTS:
            return
        member = self.member
        if member.raftLastApplied < member.raftCommitIndex or member._getLeader() is None:
            self.world.after(micros(0.1), self._nack_if_still_held, command, attempt)
            return
        if command.queue in self.machine.queues():
            held = set(self.machine.unacked(command.queue, command.consumer))
            if set(command.offsets) <= held:
                self.settle(command, attempt + 1)

    def new_consumer_id(self) -> str:
        self._consumer_counter += 1
        return f"{self.name}.{self.incarnation}.{self._consumer_counter}"

    def subscribe(self, client: SimConsumer, command: Subscribe, reply: ProposalCallback) -> None:
        """A subscribe frame arrives (as `Connection._subscribe`): the consumer is served
        here from now on; its `Subscribe` is proposed."""
        consumer = command.consumer
        self.consumers[consumer] = client
        self._queue_of[consumer] = command.queue
        self._subscribing[consumer] = reply

        def done(result: Reply | None, error: str | None) -> None:
            answer = self._subscribing.pop(consumer, None)
            if answer is not None:  # else answered already (`_resync_consumers`)
                answer(result, error)

        self.propose(command, done)

    def consumer_gone(self, consumer: str) -> None:
        """The consumer's connection closed: its messages go back (`Down`)."""
        self._forget(consumer)
        self._down(consumer)

    def _forget(self, consumer: str) -> None:
        self.consumers.pop(consumer, None)
        self._queue_of.pop(consumer, None)
        self._subscribing.pop(consumer, None)
        self._sent.pop(consumer, None)

    def _down(self, consumer: str) -> None:
        if consumer in self._downed:
            return
        self._downed.add(consumer)
        if not self.variant.retry_down:
            self.propose(Down(consumer=consumer), None)
            return

        def done(_reply: Reply | None, error: str | None) -> None:
            if error is not None and self.alive:
                self._downed.discard(consumer)
                self._down(consumer)

        self.propose(Down(consumer=consumer), done)

    # --------------------------------------------------------------- applying

    def _apply(self, index: int, payload: bytes) -> Reply:
        try:
            ts_ms, command = decode_entry(payload)
        except CodecError as e:
            return Error(code=ErrorCode.INVALID, message=f"undecodable log entry: {e}")
        applied = self.machine.apply(Meta(index, ts_ms), command)
        self.sim.on_applied(self, index, zlib.crc32(payload), command, applied)
        if index > self._effects_through:
            self._effects_through = index
            if applied.effects and index > self.replay_until:
                mine = self.variant.effect_filter(
                    applied.effects,
                    self.name,
                    proxy=self.member.is_leader(),
                    replicas=self.replicas,
                )
                if mine:
                    self._route(index, mine)
        return applied.reply

    def _snapshot(self) -> bytes:
        return self.machine.snapshot()

    def _restore(self, data: bytes, last_index: int) -> None:
        """A snapshot load (as `Replica._restore`), up to log index `last_index`: this
        node's own at start-up, or the leader's when this node is behind the leader's
        compacted log. The node then compares what its consumers were sent with what the
        machine says they hold, soon, as the server's trio thread does."""
        applied = self.member.raftLastApplied
        self.machine = type(self.machine).restore(data)
        self.snapshots_loaded += 1
        self.sim.on_snapshot_loaded(self, applied, last_index)
        self.world.after(0, self._resync_consumers)

    def _resync_consumers(self) -> None:
        """As `NodeServer._resync_consumers`: send each consumer served here the held
        deliveries the snapshot skipped, and cancel those the machine removed."""
        if not self.alive:
            return
        index = self.machine.last_index
        for consumer, queue in list(self._queue_of.items()):
            held = self.machine.held_deliveries(queue, consumer)
            if held is not None and consumer in self._subscribing:
                # its Subscribe was among the skipped entries: PySyncObj will not answer it
                self._subscribing.pop(consumer)(OK, None)
            missing = missing_deliveries(held, self._sent_to(consumer), index)
            if missing is None:
                if consumer not in self._subscribing:  # else its Subscribe is not applied yet
                    down = ConsumerDown(
                        queue=queue, consumer=consumer, node=self.name, reason="node_down"
                    )
                    self._route(None, (down,))
            elif missing:
                self._route(None, missing)

    def _sent_to(self, consumer: str) -> SentDeliveries:
        sent = self._sent.get(consumer)
        if sent is None:
            sent = self._sent[consumer] = SentDeliveries()
        return sent

    def _route(self, index: int | None, effects: tuple[Effect, ...]) -> None:
        """Run this node's effects of log entry `index` (None: `_resync_consumers`'s)."""
        for e in effects:
            if type(e) is Deliver:
                consumer = self.consumers.get(e.consumer)
                if consumer is None and e.node != self.name:
                    consumer = self.sim.consumer_by_id(e.consumer)  # proxied by the leader
                if consumer is None or not consumer.connected:
                    self._down(e.consumer)
                    continue
                sent = self._sent_to(e.consumer)
                if index is not None and sent.covers(index):
                    continue  # `_resync_consumers` got there first
                sent.record(e)
                if sent.full() and e.queue in self.machine.queues():
                    sent.keep(self.machine.unacked(e.queue, e.consumer))
                self.sim.send_to_client(consumer.receive, self, index, e)
            elif type(e) is ConsumerDown:
                self._downed.discard(e.consumer)
                consumer = self.consumers.get(e.consumer)
                self._forget(e.consumer)
                if consumer is not None:
                    self.sim.send_to_client(consumer.cancelled, self, e.consumer, e.reason)

    # ---------------------------------------------------------- leader duties

    def _on_tick(self) -> None:
        self._in_flight.expire(self.world.monotonic(), lambda: "unknown")
        if self.variant.down_stale_consumers and self.member.isReady():
            self._down_stale_consumers()
        self._leader_duties()

    def _down_stale_consumers(self) -> None:
        """`Down` for this node's consumers from its earlier runs (their connections died
        with the process), proposed again until applied."""
        scan = (self.machine.last_index, self._downs_lost)
        if scan == self._stale_scanned:
            return  # nothing applied and no Down lost since the last scan: same answer
        self._stale_scanned = scan
        mine = f"{self.name}.{self.incarnation}."
        for queue in self.machine.queues():
            for consumer in self.machine.consumers(queue):
                if (
                    consumer.startswith(f"{self.name}.")
                    and not consumer.startswith(mine)
                    and consumer not in self._downing
                ):
                    self._downing.add(consumer)
                    self.propose(Down(consumer=consumer), self._down_stale_done(consumer))

    def _down_stale_done(self, consumer: str) -> ProposalCallback:
        def done(_reply: Reply | None, error: str | None) -> None:
            if error is not None:
                self._downing.discard(consumer)  # lost: propose it again next tick
                self._downs_lost += 1

        return done

    def _leader_duties(self) -> None:
        member = self.member
        if not member.is_leader() or not member.isReady():
            return
        for command in failure_commands(
            self.name,
            member.peer_silence(),
            self.machine.down_nodes(),
            self.grace_s,
            member.removed_members,
        ):
            key = ("down" if isinstance(command, NodeDown) else "up", command.node)
            if key not in self._pending_duties:
                self._pending_duties.add(key)
                self.sim.on_failure_command(self, command)
                self.propose(command, lambda _r, _e, key=key: self._pending_duties.discard(key))
