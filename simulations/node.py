"""One simulated quorumq node: a Raft member running the real rules on the real journal,
the real queue machine, and the duties of the node's server towards its clients.

* `SimMember` (`member.py`) is `quorumq.raft.rules.RaftRules` (the same Raft rules a
  real node runs) on the simulated network, ticked by the simulator.
* `SimDisk` (`storage.py`) is the node's disk: its journal is the real `DurableJournal` on simulated
  files (`simulations.disk.SimFiles`), which a power loss takes back to what was synced
  (torn, with the `torn_power_loss` fault), and which can flip bits, write short and
  fail syncs; its snapshot is stored whole, synced, as the real node stores it. A node
  whose journal refuses to open stays down; one whose journal fails stops, and is
  started again (`Cluster.on_fatal`).
* `SimSerializer` (`storage.py`) is PySyncObj's snapshot store on that disk: log compaction
  (`logCompactionMinEntries`) takes the machine's snapshot at once and stores it
  `write_ms` later, as the real node's forked child does; the leader sends it in chunks
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

import zlib
from collections.abc import Callable
from typing import Any, TypeVar, cast

import attrs

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
from quorumq.raft.journal import JournalDamagedError, JournalFailedError
from quorumq.raft.rules import (
    LeaderClock,
)
from quorumq.replica import ProposalError, Replica, ReplicaConfig, local_effects

from .member import ObservedLeaderClock, SimMember
from .network import HostTransports
from .storage import SimDisk
from .world import World, first_micros_at, micros, seconds

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

    def __init__(self, node: SimNode, group: int = 0) -> None:
        self._node = node
        self._group = group
        self.node_id = node.name

    @property
    def _replica(self) -> Replica:
        return self._node.replicas[self._group]

    def _soon(self, fn: Callable[..., None], *args: Any) -> None:
        self._node.soon(fn, *args)

    def propose(self, command: Command, callback: ProposalCallback | None = None) -> None:
        replica = self._replica
        if callback is None:
            replica.propose(command)
        else:
            replica.propose(command, lambda reply, error: self._soon(callback, reply, error))
        self._node.wake()

    def query(self, read: Callable[[Machine], T]) -> T:
        return self._replica.query(read)

    def members(self) -> dict[str, str]:
        return self._replica.members()

    def status(self, *, audit: bool = False) -> dict[str, Any]:
        return self._replica.status()

    def add_member(
        self, name: str, address: str, callback: Callable[[ProposalError | None], None]
    ) -> None:
        self._replica.add_member(name, address, lambda error: self._soon(callback, error))
        self._node.wake()

    def remove_member(self, name: str, callback: Callable[[ProposalError | None], None]) -> None:
        self._replica.remove_member(name, lambda error: self._soon(callback, error))
        self._node.wake()

    def ask_leader_to_step_down(self) -> None:
        self._replica.ask_leader_to_step_down()
        self._node.wake()

    def membership_settled(self) -> bool:
        return self._replica.membership_settled()

    def watch_ends(self, queues: frozenset[str]) -> None:
        self._replica.watch_ends(queues)

    def take_ends_moved(self) -> set[str]:
        return self._replica.take_ends_moved()


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
        groups: int = 1,
        model_group: int = 0,
    ) -> None:
        """`groups`: how many Raft groups the node hosts (`quorumq node --groups`);
        `model_group`: the one the run's observers watch (`model_group`)."""
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
        self.groups = groups
        self.model_group = model_group
        """The group of the workload's queue: the one the checker, the history and
        the liveness watch (`replica`, `member`, `machine`); every group's log is
        checked for agreement (`GroupChecks`)."""
        self.host_disk = disk
        self.disk = disk.group(model_group)
        """The model group's part of the node's disk (the host's whole disk: `host_disk`)."""
        self.leading = [False] * groups
        """Whether this node's member of each group led after its last tick."""
        self._config = replica_config = ReplicaConfig(
            node_id=name,
            peers=sim.peers_for(name),
            data_dir=f"/sim/{name}",
            secret="simulated",
            node_down_grace_s=grace_s,
            raft_timeouts=raft_timeouts,
            compaction_entries=compaction_entries or 10**12,
            groups=groups,
        )
        # group 0 first, as `NodeReplicas` builds them
        self.replicas = [self._build_replica(group) for group in range(groups)]
        self.replica = self.replicas[model_group]
        if groups > 1:
            for group, replica in enumerate(self.replicas):
                replica.steer_group = group
        rng = self.world.stream(f"node-{name}-{incarnation}")
        handles = [_SimReplicaHandle(self, group) for group in range(groups)]
        self.core = NodeCore(
            NodeConfig(replica=replica_config, insecure=True, admin_token=ADMIN_TOKEN),
            handles[0],
            _SimShell(self),
            self.world.monotonic,
            random_bytes=rng.randbytes,
            groups=handles if groups > 1 else (),
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

    def _build_replica(self, group: int) -> SimReplica:
        """Group `group`'s real replica, its member on the group's part of the disk."""
        variant: Variant = self.sim.variant
        return SimReplica(
            self,
            self._config,
            lambda index, effects: self.soon(self._effects, index, effects),
            lambda: self.soon(self._state_replaced, group),
            wall_clock=lambda: self.sim.wall_ms(self.name),
            monotonic=self.world.monotonic,
            member_factory=lambda **callbacks: self._make_member(group, **callbacks),
            observer=self,
            machine_factory=variant.machine,
            effect_filter=variant.effect_filter,
            on_ends_moved=lambda: self.soon(self._ends_moved),
        )

    def _make_member(self, group: int, **callbacks: Any) -> SimMember:
        member = SimMember(
            self.sim.network,
            self.name,
            self.host_disk.group(group),
            raft_timeouts=self._config.raft_timeouts,
            compaction_entries=self._config.compaction_entries,
            peers=self._config.peers,
            on_change_cluster=lambda request, accepted: self.sim.on_change_cluster(
                self, request, accepted, group
            ),
            group=group,
            **callbacks,
        )
        member.at_seam = self._at_seam
        return member

    @property
    def was_leader(self) -> bool:
        """Whether its member of the model group led after its last tick."""
        return self.leading[self.model_group]

    @property
    def members(self) -> list[SimMember]:
        """Every group's member, group 0's first."""
        return [cast(SimMember, replica.member) for replica in self.replicas]

    def _group_of(self, replica: Replica) -> int:
        return next(g for g, r in enumerate(self.replicas) if r is replica)

    def transports(self) -> HostTransports:
        """Every group's transport, on the node's one connection to each peer."""
        return HostTransports([member.transport for member in self.members])

    @property
    def member(self) -> SimMember:
        return cast(SimMember, self.replica.member)

    @property
    def machine(self) -> Machine:
        return self.replica.machine

    @property
    def replay_until(self) -> int:
        return self.replica.replay_until

    def soon(self, fn: Callable[..., None], *args: Any) -> None:
        """Run `fn(*args)` after the current event, if this run of the node is alive."""
        self.world.after(0, self._if_alive, fn, args)

    def _if_alive(self, fn: Callable[..., None], args: tuple[Any, ...]) -> None:
        if self.alive:
            fn(*args)

    # -------------------------------------------------------------- observing

    def applied(
        self, replica: Replica, index: int, payload: bytes, command: Command, applied: Applied
    ) -> None:
        if replica is self.replica:
            self.sim.on_applied(self, index, zlib.crc32(payload), command, applied)
        else:
            self.sim.on_group_applied(self, self._group_of(replica), index, payload)

    def snapshot_loaded(self, replica: Replica, applied: int, index: int) -> None:
        if replica is self.replica:
            self.sim.on_snapshot_loaded(self, applied, index)
        else:
            self.sim.on_group_snapshot_loaded(self, self._group_of(replica), applied, index)

    def proposed_duty(self, replica: Replica, command: Command) -> None:
        if isinstance(command, NodeDown | NodeUp):
            if replica is self.replica:
                self.sim.on_failure_command(self, command)
            else:
                self.world.trace(f"propose {self.name} group {self._group_of(replica)} {command}")

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
        if self.world.now_us < self.stalled_until_us:
            self.wake()  # when the stall ends
            return
        self._run_tick(self._tick_whole)

    def _tick_whole(self) -> int:
        if self._inbound:
            self._read_clients()
        # the wait in the last poll ends: each group's member reads what arrived, then
        # ticks (as the engine's round ticks every group's, then polls once)
        handled = 0
        for member in self.members:
            handled += member.poller.read()
            member.doTick(0)
            handled += member.poller.handled
            if self.paused:
                break  # stopped at the seam of this member's tick (`pause_mid_tick`)
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
        for group, replica in enumerate(self.replicas):
            leader = replica.member.is_leader()
            if leader != self.leading[group]:
                self.leading[group] = leader
                if group == self.model_group:
                    self.sim.on_leadership(self, leader)
                else:
                    self.sim.on_group_leadership(self, group, leader)
        wait_us = self._next_tick_us()  # planned as the real poll plans it, woken or not
        self.wake(0 if self._woken_in_tick else wait_us)

    def _next_tick_us(self) -> int:
        """As RaftMember's tick loop (the engine's, with groups: the soonest of every
        group's): a tick period from now (longer when the group is quiet,
        `tick_wait_s`), or sooner, just past the election deadline of a follower or
        candidate."""
        wait_us = self.tick_us * 1000
        for member in self.members:
            wait_us = min(wait_us, self._member_wait_us(member))
        for member in self.members:
            member.planned_wait_s = seconds(wait_us)  # as the real loop plans: the election too
        return wait_us

    def _member_wait_us(self, member: SimMember) -> int:
        wait_us = max(1, micros(member.tick_wait_s(seconds(self.tick_us), election=False)))
        if member.until_election_s() is not None:
            deadline = member._SyncObj__raftElectionDeadline
            at = first_micros_at(deadline) + 1000  # the real loop's 1 ms past it
            wait_us = max(1, min(wait_us, at - self.world.now_us))
        return wait_us

    def resumed(self) -> None:
        """A paused node runs again: it finishes a tick stopped at its seam, ticks, and
        its core's timers run."""
        deferred = [m for m in self.members if m.duties_deferred]
        if deferred:
            self._run_tick(deferred[0].finish_tick)
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

    def _state_replaced(self, group: int) -> None:
        self.core.state_replaced(group)

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
