"""One node's replica: the queue machine behind a hardened Raft member.

Every committed log entry is decoded and applied to this node's `Machine` with the
entry's Raft index and the time the leader stamped on it (`raft.base.LeaderClock`:
the leader's monotonic clock from the replicated time it took over, following its wall
clock within a second, so one node's wrong clock cannot move queue time). Of the
effects, the replica keeps those that are its own to run and hands them to
`on_effects`:

* a `Deliver` or `ConsumerDown` whose consumer lives on this node;
* as leader, also those whose consumer's node hosts no replica (the leader proxies).

Effects are not run for entries replayed from this node's journal at start-up (they
may have run before the crash; the consumer connections they name are gone), so
effects run at most once per process, and clients tolerate a redelivery. Only entries
that are still the ones on disk at start-up count as replayed: a node that led before
its restart may hold an uncommitted tail that the new leader's log replaces, and the
entries that replace it (say, a delivery to a consumer that just connected here) are new.

The node says which queues its reads wait on (`watch_ends`); when an applied entry
moves the end of one of them (`machine.ends_moved`), `on_ends_moved` is called, once
until the node takes the queues it names (`take_ends_moved`): a batch of entries applied
in a row costs the node one wake-up, and a queue no read waits on costs it nothing.

`on_effects` and `on_ends_moved` run on the Raft thread: hand the work over (trio token,
bounded queue), never block there. The machine is only mutated on that thread, under `lock`; other
threads read it with `query`.

As leader, the replica turns time and failure into log commands: `NodeDown(node)` when
a replica has not answered for `node_down_grace_s`, `NodeUp(node)` when it answers
again, and `Tick()` when time must move (`Machine.tick_due_ms`: every second with TTLs,
deliveries out or delays; when a producer expires), and as soon as a retry delay runs
out (`Machine.next_retry_ms`).

The replica's parts: `config` (its settings, `ReplicaConfig`), `outcomes` (what a
proposal can come to, and the proposals waiting for one: `InFlight`), `duties` (the
effects this node runs, and the leader's `NodeDown` / `NodeUp`); this module is the
`Replica` itself.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import logging
import math
import os
import select
import signal
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn, Protocol, TypeVar

from pysyncobj import FAIL_REASON

from .. import pathtiming
from ..codec import UNSTAMPED, CodecError, UnreadableEntryError, decode_entry, encode_entry
from ..machine import (
    Applied,
    Command,
    Effect,
    Enqueue,
    EnqueueBatch,
    Enqueued,
    Error,
    ErrorCode,
    Machine,
    Meta,
    NodeDown,
    Reply,
    Tick,
    ends_moved,
)
from ..raft.engine import RaftEngine
from ..raft.member import MAX_COMMAND_BYTES, NOT_APPLIED, RaftMember
from ..raft.rules import LeaderClock, RaftRules, wall_clock_ms
from .config import PROPOSAL_TIMEOUT_S, ConfigError, ReplicaConfig, file_usage, is_loopback
from .duties import failure_commands, local_effects
from .outcomes import (
    AuditBusyError,
    AuditFailedError,
    InFlight,
    NotAppliedError,
    OutcomeUnknownError,
    ProposalError,
    _membership_done,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")
E = TypeVar("E")

TICK_EVERY_S = 1.0
"""How often the leader proposes `Tick` while some queue has a message TTL."""
RETRY_TICK_EVERY_S = 0.05
STEADY_BEFORE_STEERING_S = 10.0
"""A leader hands its group to the group's preferred node (`steer_group`) only once it
has led this long and the preferred node has answered throughout: a node that comes
and goes (paused, flapping) is not handed leadership each time it is back."""
STEER_EVERY_S = 2.0
"""How often a leader not the preferred one asks it to take over (a transfer is refused
while the preferred node's log is behind, as under load it often is for a moment)."""
ANSWERING_WITHIN_S = 1.0
"""A peer counts as answering if it answered within this long (a quiet group's
heartbeats go every `QUIET_HEARTBEAT_S`, 0.5 s)."""
"""As leader, the shortest time between two `Tick`s proposed because a retry delay ran
out (`Machine.next_retry_ms`): a delay is kept to within this plus a commit."""
DUTIES_EVERY_S = 0.01
"""How often the leader looks at its peers' silence (the grace period is seconds: looking
on every Raft tick, one per message under load, cost a tenth of a tick)."""
AUDIT_DEADLINE_S = 300.0
"""An audit's child process that has not delivered the state by then is killed, and
the audit fails (about 1.3 s per million 100-byte messages is expected)."""


def _mark_applied(index: int, command: Command, reply: Reply) -> None:
    """Path timing: entry `index` applied here; for a publish, which messages it holds."""
    pathtiming.mark("raft.applied", ("i", index))
    if isinstance(reply, Enqueued) and reply.offset is not None and not reply.duplicate:
        if isinstance(command, Enqueue):
            first_seq = command.seq
        elif isinstance(command, EnqueueBatch) and command.seqs is None:
            first_seq = command.first_seq
        else:
            return
        if command.producer is not None and first_seq is not None:
            mapping = (index, command.producer, first_seq, reply.count, reply.offset)
            pathtiming.mark("map", mapping)


def _encode_in_child(machine: Machine, out: int) -> NoReturn:
    """In the forked child of `Replica.audit`: write `machine`'s snapshot encoding to
    `out`, then exit. Only the forking thread exists here, and other threads may have
    held locks at the fork, so it runs nothing but the encoder (pure Python: no
    logging, no locks, no OpenSSL, no I/O but `out`)."""
    code = 1
    try:
        gc.disable()  # no finalizer of the parent's objects runs here
        with contextlib.suppress(ValueError):  # default actions: a signal ends the child
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        # the parent's sockets: a connection the parent closes meanwhile closes now
        os.closerange(3, out)
        os.closerange(out + 1, os.sysconf("SC_OPEN_MAX"))
        view = memoryview(machine.snapshot())
        while view:
            view = view[os.write(out, view) :]
        code = 0
    finally:
        os._exit(code)


def _sha256_of_stream(fd: int, deadline: float) -> str:
    """The SHA-256 of everything read from `fd` until its end, 1 MiB at a time."""
    digest = hashlib.sha256()
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AuditFailedError(f"the state was not encoded within {AUDIT_DEADLINE_S} s")
        if not poller.poll(left * 1000):
            continue
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            return digest.hexdigest()
        digest.update(chunk)


class ReplicaObserver(Protocol):
    """Told what a replica applies and loads (the simulator's checker and history)."""

    def applied(
        self, replica: Replica, index: int, payload: bytes, command: Command, applied: Applied
    ) -> None: ...

    def snapshot_loaded(self, replica: Replica, applied: int, index: int) -> None: ...

    def proposed_duty(self, replica: Replica, command: Command) -> None:
        """As leader, the replica proposes `command` (`NodeDown`, `NodeUp`, `Tick`)."""


MemberFactory = Callable[..., RaftRules]
"""(apply=, snapshot=, restore=, on_tick=) -> the replica's Raft member."""
EffectFilter = Callable[..., tuple[Effect, ...]]
"""(effects, node, proxy=, replicas=) -> the effects this node runs (`local_effects`)."""


def _raft_member(
    config: ReplicaConfig, engine: RaftEngine | None = None, group: int = 0
) -> MemberFactory:
    """A real node's Raft member: `RaftMember` on files and sockets; of `group`, on the
    node's `engine` (`quorumq.replica.groups`), or alone on an engine of its own."""

    def make(**callbacks: Any) -> RaftMember:
        return RaftMember(
            config.node_id,
            config.peers,
            data_dir=group_dir(config.data_dir, group),
            node_dir=config.data_dir,
            engine=engine,
            group=group,
            password=config.secret or None,
            fsync=config.fsync,
            journal=config.journal,
            raft_timeouts=config.raft_timeouts,
            compaction_entries=config.compaction_entries,
            **callbacks,
        )

    return make


def group_dir(data_dir: str, group: int) -> str:
    """Where group `group` of a node keeps its files: group 0 in the data directory
    itself (as a node of one group), group g in `group-g` under it."""
    return data_dir if group == 0 else os.path.join(data_dir, f"group-{group}")


class Replica:
    """A node's member of the replicated queue machine."""

    def __init__(
        self,
        config: ReplicaConfig,
        on_effects: Callable[[int, tuple[Effect, ...]], None] | None = None,
        on_state_replaced: Callable[[], None] | None = None,
        *,
        wall_clock: Callable[[], int] = wall_clock_ms,
        monotonic: Callable[[], float] = time.monotonic,
        member_factory: MemberFactory | None = None,
        observer: ReplicaObserver | None = None,
        machine_factory: Callable[[], Machine] = Machine,
        effect_filter: EffectFilter = local_effects,
        on_ends_moved: Callable[[], None] | None = None,
    ) -> None:
        """`on_ends_moved`: see the module's docstring. `wall_clock`, `monotonic`: this
        node's clocks (tests give a wrong wall clock, the simulator its own clocks).
        `member_factory`: the Raft member (by default a
        `RaftMember` on real files and sockets; the simulator's on its disk and network).
        `observer`: told of every entry applied and snapshot loaded (the simulator's
        checker). `machine_factory` and `effect_filter`: test-only switches of the
        negative controls (a machine that loses messages, a node that runs others'
        effects); the defaults are the real thing."""
        self.config = config
        self.node_id = config.node_id
        self.lock = threading.Lock()
        self._monotonic = monotonic
        self._observer = observer
        self._effect_filter = effect_filter
        self.machine = machine_factory()
        self._on_effects = on_effects
        self._on_state_replaced = on_state_replaced
        self._on_ends_moved = on_ends_moved
        self._watched: frozenset[str] = frozenset()
        self._ends_moved: set[str] = set()
        """Queues of `_watched` whose end moved since the node last took them (under `lock`)."""
        self._effects_through = 0
        """The highest log index applied by this process: a snapshot install can take the
        machine back below it, and entries applied again must not run their effects again."""
        self.snapshots_loaded = 0
        """Snapshots loaded by this process: its own at start-up, the leader's to catch up."""
        self._pending: set[tuple[str, str]] = set()
        self._in_flight: InFlight[ProposalError] = InFlight(config.proposal_timeout_s)
        """Proposals in submission order, to answer those PySyncObj never answers."""
        self._last_tick_proposal = 0.0
        self._last_retry_tick = 0.0
        self._duties_due = 0.0
        self.steer_group: int | None = None
        """With many groups: this replica's group number g, whose preferred leader is the
        (g mod n)-th member by name, so that the n nodes lead as many groups each (a
        paused node stalls only the groups it leads). None: leaders stay where
        elections put them."""
        self._led_since: float | None = None
        self._preferred_answering_since: float | None = None
        self._steer_due = 0.0
        self._auditing = threading.Lock()
        """Held while an audit runs: one at a time."""
        self._audit_child: int | None = None
        """The process id of the running audit's child (`stop` ends it)."""
        factory = member_factory or _raft_member(config)
        self.member = factory(
            apply=self._apply, snapshot=self._snapshot, restore=self._restore, on_tick=self._on_tick
        )
        self.member.use_leader_clock(self._leader_clock(wall_clock, monotonic))
        self.member.replicated_time_ms = lambda: self.machine.now_ms  # type: ignore[method-assign]
        self.member.duty_due_s = self._duty_due_s
        self.member.start()

    def _leader_clock(
        self, wall_clock: Callable[[], int], monotonic: Callable[[], float]
    ) -> LeaderClock:
        """The clock this node stamps entries with as leader (the simulator observes it)."""
        return LeaderClock(wall_clock, monotonic)

    @property
    def replay_until(self) -> int:
        """Log entries up to this index are replayed from this node's journal: no effects.
        It drops when the journal is truncated: an entry that replaces one of ours is new."""
        return self.member.journal.replay_until

    # -------------------------------------------------------------- proposing

    def propose(
        self,
        command: Command,
        callback: Callable[[Reply | None, ProposalError | None], None] | None = None,
        *,
        leader_only: bool = False,
    ) -> None:
        """Submit from any thread; `callback(reply, error)` runs on the Raft thread.
        `leader_only`: a leader's duty, appended only while this node leads the term it
        leads now (`RaftRules.propose`)."""
        payload = encode_entry(UNSTAMPED, command)  # the leader stamps the time
        if len(payload) > MAX_COMMAND_BYTES:  # never a log entry: refused, not raised
            message = f"a command of {len(payload)} bytes exceeds {MAX_COMMAND_BYTES}"
            logger.warning("refusing to propose %s: %s", type(command).__name__, message)
            if callback is not None:
                callback(Error(code=ErrorCode.TOO_LARGE, message=message), None)
            return
        if callback is None:
            self.member.propose(payload, None, leader_only=leader_only)
            return

        once = self._in_flight.track(callback, self._monotonic())

        def done(result: Any, reason: int) -> None:
            if reason == FAIL_REASON.SUCCESS:
                once(result, None)
            elif reason in NOT_APPLIED:
                once(None, NotAppliedError(NOT_APPLIED[reason]))
            else:
                once(None, OutcomeUnknownError(f"the leader changed before a reply ({reason})"))

        self.member.propose(payload, done, leader_only=leader_only)

    def submit(self, command: Command, timeout: float = 10.0) -> Reply:
        """Propose and wait for the reply (from a thread that is not the Raft thread)."""
        finished = threading.Event()
        outcome: list[tuple[Reply | None, ProposalError | None]] = []

        def callback(reply: Reply | None, error: ProposalError | None) -> None:
            outcome.append((reply, error))
            finished.set()

        self.propose(command, callback)
        if not finished.wait(timeout):
            raise OutcomeUnknownError(f"no reply within {timeout} s")
        reply, error = outcome[0]
        if error is not None:
            raise error
        if reply is None:
            raise OutcomeUnknownError("the command was committed but could not be applied here")
        return reply

    # --------------------------------------------------------------- applying

    def _apply(self, index: int, payload: bytes) -> Reply:
        try:
            ts_ms, command = decode_entry(payload)
        except CodecError as e:
            # Every entry is encoded by a node's own codec from a checked command, so
            # one this node cannot read was written by another quorumq release (a newer
            # leader's new field, say). Skipping it, as this node once did, would make
            # this replica diverge from the others: it stops instead.
            raise UnreadableEntryError(
                f"log entry {index} cannot be read by this quorumq version ({e}): it was "
                "written by another release; upgrade this node (it stopped rather than "
                "skip the entry and diverge from the other replicas)"
            ) from None
        with self.lock:
            applied = self.machine.apply(Meta(index, ts_ms), command)
            tell = bool(self._watched) and self._note_ends_moved(command, applied)
        if tell and self._on_ends_moved is not None:
            self._on_ends_moved()
        if pathtiming.ENABLED:
            _mark_applied(index, command, applied.reply)
        if self._observer is not None:
            self._observer.applied(self, index, payload, command, applied)
        if index > self._effects_through:
            self._effects_through = index
            if self._on_effects is not None and applied.effects and index > self.replay_until:
                mine = self._mine(applied.effects)
                if mine:
                    self._on_effects(index, mine)
        return applied.reply

    def _note_ends_moved(self, command: Command, applied: Applied) -> bool:
        """Note the watched queues whose end `command` moved (under `lock`); whether the
        node is to be told (it has taken all it was told of before)."""
        moved = ends_moved(command, applied).intersection(self._watched)
        if not moved:
            return False
        told = bool(self._ends_moved)
        self._ends_moved |= moved
        return not told

    def watch_ends(self, queues: frozenset[str]) -> None:
        """Tell the node (`on_ends_moved`) of the entries applied from now on that move the
        end of one of `queues`, the queues its reads wait on. Call it before reading the
        ends it waits for: an entry applied in between is then seen by one or the other
        (the read takes `lock`, and an entry is noted under it)."""
        self._watched = queues

    def take_ends_moved(self) -> set[str]:
        """The watched queues whose end moved since the last call."""
        with self.lock:
            moved, self._ends_moved = self._ends_moved, set()
        return moved

    def _mine(self, effects: tuple[Effect, ...]) -> tuple[Effect, ...]:
        return self._effect_filter(
            effects, self.node_id, proxy=self.member.is_leader(), replicas=self.replicas()
        )

    def _snapshot(self) -> bytes:
        """The machine's snapshot encoding. Called on the Raft thread, the only one that
        changes the machine, or in a child forked from it (`RaftMember` writes snapshots
        there): it takes no lock, since another thread may have held it at the fork."""
        return self.machine.snapshot()

    def _restore(self, data: bytes) -> None:
        """Load a snapshot: this node's own at start-up, or the leader's when this node
        lags behind the leader's compacted log. The latter skips the entries between
        (their effects never run here) or goes back before entries already applied
        (their effects do not run again): `on_state_replaced` lets the node compare what
        it sent with what the machine now says."""
        machine = type(self.machine).restore(data)
        with self.lock:
            before = self.machine.last_index
            self.machine = machine
            self.snapshots_loaded += 1
        if self._observer is not None:
            self._observer.snapshot_loaded(self, before, machine.last_index)
        logger.info(
            "loaded a snapshot at index %d (applied before: %d)", machine.last_index, before
        )
        if self._on_state_replaced is not None:
            self._on_state_replaced()

    # ---------------------------------------------------------- leader duties

    def _on_tick(self) -> None:
        self._expire_proposals()
        self._leader_duties()

    def _expire_proposals(self) -> None:
        self._in_flight.expire(self._monotonic(), self._no_outcome)

    def _no_outcome(self) -> OutcomeUnknownError:
        return OutcomeUnknownError(f"no outcome within {self.config.proposal_timeout_s} s")

    def _leader_duties(self) -> None:
        """Turn silence and time into log commands (as leader)."""
        if not self.member.is_leader() or not self.member.isReady():
            self._led_since = None
            return
        now = self._monotonic()
        if now < self._duties_due:
            return
        if self._led_since is None:
            self._led_since = now
        self._duties_due = now + DUTIES_EVERY_S
        node_of_address = {a: n for n, a in self.member.members().items()}
        silence = {
            node_of_address[address]: silent_s
            for address, silent_s in self.member.peer_silence().items()
            if address in node_of_address
        }
        answered = {
            node_of_address[address]: ago
            for address, ago in self.member.peer_answered_ago().items()
            if address in node_of_address
        }
        for command in failure_commands(
            self.node_id,
            silence,
            self.machine.down_nodes(),
            self.config.node_down_grace_s,
            self.member.removed_members,
            answered,
        ):
            key = ("down" if isinstance(command, NodeDown) else "up", command.node)
            self._propose_once(key, command)
        if self.steer_group is not None:
            self._steer(now, answered)
        if now - self._last_tick_proposal >= TICK_EVERY_S:
            self._last_tick_proposal = now
            if self._tick_due():  # TTLs, deliveries out, delays; expiring producers
                self._propose_once(("tick", ""), Tick())
        elif now - self._last_retry_tick >= RETRY_TICK_EVERY_S and self._retry_due():
            self._last_retry_tick = now
            self._propose_once(("tick", ""), Tick())

    def _steer(self, now: float, answered: dict[str, float]) -> None:
        """As leader of group `steer_group`: hand leadership to the group's preferred
        node once it and this leader have been steady (`STEADY_BEFORE_STEERING_S`), by a
        targeted transfer (Raft's TimeoutNow, refused unless its log is whole)."""
        members = self.member.members()
        names = sorted(members)
        preferred = names[(self.steer_group or 0) % len(names)]
        if preferred == self.node_id or answered.get(preferred, math.inf) > ANSWERING_WITHIN_S:
            self._preferred_answering_since = None
            return
        if self._preferred_answering_since is None:
            self._preferred_answering_since = now
        steady_since = max(self._led_since or now, self._preferred_answering_since)
        if now < self._steer_due or now - steady_since < STEADY_BEFORE_STEERING_S:
            return
        self._steer_due = now + STEER_EVERY_S
        logger.info(
            "group %s: handing leadership to %s, its preferred leader", self.steer_group, preferred
        )
        self.member.transferLeadership(self.member.make_node(preferred, members[preferred]), None)

    def _duty_due_s(self) -> float | None:
        """Seconds until this node's duties next need a tick (None: none pending), so
        that a quiet member's Raft thread does not sleep past them: the `Tick` of a
        machine whose time must move, or the next message waiting for a retry delay. A
        peer's silence makes the leader busy by itself (`Quiescence.quiet_period_s`)."""
        if not self.member.is_leader():
            return None
        waits = []
        tick_due = self.machine.tick_due_ms()
        if tick_due is not None:
            stamp = self._stamp_now()
            ahead_s = 0.0 if stamp is None else max(0.0, (tick_due - stamp) / 1000)
            if tick_due <= self.machine.now_ms:
                ahead_s = 0.0  # a Tick a second
            next_look = self._last_tick_proposal + TICK_EVERY_S - self._monotonic()
            waits.append(max(next_look, ahead_s))
        retry_due = self.machine.next_retry_ms()
        if retry_due is not None:
            stamp = self._stamp_now()
            waits.append(RETRY_TICK_EVERY_S if stamp is None else (retry_due - stamp) / 1000)
        return max(0.0, min(waits)) if waits else None

    def _tick_due(self) -> bool:
        """Whether time must move now: every second while the machine's time is due at
        once (a new leader's clock may not be anchored yet: the `Tick` anchors it), or
        once this leader's clock reaches the time a producer expires."""
        due = self.machine.tick_due_ms()
        return due is not None and (due <= self.machine.now_ms or self._stamp_reached(due))

    def _retry_due(self) -> bool:
        """Whether a message waiting for a retry delay is due by the time this leader
        would stamp now (so a `Tick` now delivers it)."""
        return self._stamp_reached(self.machine.next_retry_ms())

    def _stamp_now(self) -> int | None:
        """The time this leader would stamp an entry with now (None: not yet known)."""
        clock = getattr(self.member, "leader_clock", None)
        return None if clock is None else clock.peek(self.member.raftCurrentTerm)

    def _stamp_reached(self, due_ms: int | None) -> bool:
        """Whether log time `due_ms` is reached by the time this leader would stamp now."""
        if due_ms is None:
            return False
        stamp = self._stamp_now()
        return stamp is not None and stamp >= due_ms

    def _propose_once(self, key: tuple[str, str], command: Command) -> None:
        if key in self._pending:
            return
        self._pending.add(key)
        logger.info("proposing %s", command)
        if self._observer is not None:
            self._observer.proposed_duty(self, command)
        self.propose(command, lambda _reply, _error: self._pending.discard(key), leader_only=True)

    # ------------------------------------------------------------- membership

    def members(self) -> dict[str, str]:
        """The replicas of the cluster as this node knows them: name -> Raft address."""
        return self.member.members()

    def replicas(self) -> frozenset[str]:
        return frozenset(self.member.members())

    def add_member(
        self, name: str, address: str, callback: Callable[[ProposalError | None], None]
    ) -> None:
        """Propose a new replica (Raft configuration change, one at a time); `callback`
        runs on the Raft thread once it is committed (None) or refused."""
        self.member.add_member(name, address, _membership_done(callback))

    def remove_member(self, name: str, callback: Callable[[ProposalError | None], None]) -> None:
        """Propose removing a replica. The leader cannot remove itself: ask it to step
        down first (`ask_leader_to_step_down`). Once removed, the node is marked down so
        its consumers' messages return to the queue (by whichever node leads: a node
        that consumers are placed on and that is no member is marked down)."""
        address = self.members().get(name)
        if address is None:  # removed meanwhile (by this request's earlier attempt, say)
            callback(NotAppliedError(f"{name} is not a member"))
            return
        self.member.remove_member(address, _membership_done(callback))

    def ask_leader_to_step_down(self) -> None:
        self.member.ask_leader_to_step_down()

    def membership_settled(self) -> bool:
        """Whether this node's log holds no configuration change past its commit index
        (after a barrier through the log, its configuration is then the committed one).
        Read from another thread, a log cut meanwhile reads as not settled (ask again)."""
        try:
            return not self.member.uncommitted_membership_change()
        except IndexError:
            return False

    # ----------------------------------------------------------------- status

    def query(self, read: Callable[[Machine], T]) -> T:
        """Read the machine consistently from any thread."""
        with self.lock:
            return read(self.machine)

    def audit(self) -> tuple[int, str]:
        """The state digest (`Machine.digest`: the SHA-256 of its snapshot encoding) and
        the log index it is of. It blocks: call it from a thread that may wait (seconds
        with millions of messages), never from the Raft thread or an event loop.

        Encoding the state costs 0.25 s at 200,000 messages of 100 bytes, and the Raft
        thread needs the lock for every entry it applies: holding the lock that long
        stopped heartbeats for longer than an election timeout. So the lock is held
        only while the process forks (about 4 ms there: the page tables are copied,
        the memory is shared copy-on-write). The child holds the state as it was at
        the fork, encodes it and streams it through a pipe; this thread hashes the
        stream 1 MiB at a time. While an audit runs, the pages the node writes are
        copied: at most one more copy of the state's memory, and one audit runs at a
        time (`AuditBusyError` for a second). A child that has not finished within
        `AUDIT_DEADLINE_S` is killed (`AuditFailedError`)."""
        if not self._auditing.acquire(blocking=False):
            raise AuditBusyError("an audit is already running on this node; try again later")
        try:
            read_end, write_end = os.pipe()
            try:
                with self.lock:
                    index, machine = self.machine.last_index, self.machine
                    pid = os.fork()  # (3.12's warning: see quorumq.raft.member)
                    if pid == 0:
                        _encode_in_child(machine, write_end)
            finally:
                os.close(write_end)
            self._audit_child = pid
            finished = False
            try:
                digest = _sha256_of_stream(read_end, time.monotonic() + AUDIT_DEADLINE_S)
                finished = True
            finally:
                os.close(read_end)
                if not finished:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                wait_status: int | None
                try:
                    _, wait_status = os.waitpid(pid, 0)
                except ChildProcessError:  # the program reaped it (SIGCHLD ignored, a wait())
                    wait_status = None
                finally:
                    self._audit_child = None
            if wait_status is None:
                raise AuditFailedError(
                    "the audit's child process was reaped by another part of the program, so "
                    "whether it wrote the whole state is unknown; try again"
                )
            code = os.waitstatus_to_exitcode(wait_status)
            if code != 0:
                raise AuditFailedError(f"the audit's child process ended with {code}")
            return index, digest
        finally:
            self._auditing.release()

    def status(self, *, audit: bool = False) -> dict[str, Any]:
        """The node's Raft and machine figures, costing O(queues). With `audit`, also the
        state digest (`audit`: blocking, only when asked, `quorumq status --audit`), and
        `machine_index` is then the index the digest is of."""
        audited = self.audit() if audit else None
        member = self.member
        leader = member.leader_address()
        members = member.members()
        node_of_address = {a: n for n, a in members.items()}
        with self.lock:
            last_index = self.machine.last_index
            down = sorted(self.machine.down_nodes())
        return {
            "node": self.node_id,
            "cluster": member.cluster_identity,
            "leader": node_of_address.get(leader) if leader else None,
            "is_leader": member.is_leader(),
            "role": member.role(),
            "term": member.raftCurrentTerm,
            "commit_index": member.raftCommitIndex,
            "last_applied": member.raftLastApplied,
            "machine_index": last_index if audited is None else audited[0],
            **({} if audited is None else {"digest": audited[1]}),
            "ready": member.isReady(),
            "down_nodes": down,
            "members": members,
            "connected": member.connected(),
            "snapshots_loaded": self.snapshots_loaded,
            "compaction_error": member.compaction_error,
            "journal": member.journal.usage(),
            "elections": member.elections,
            "pre_votes_lost": member.pre_votes_lost,
            "stalls": member.stalls,
            "learners": member.learner_progress(),
            "learners_joined": member.learners_joined,
            **file_usage(),
        }

    def stop(self) -> None:
        child = self._audit_child
        if child is not None:  # the audit fails at once rather than delay the stop
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        self.member.stop()


__all__ = [
    "PROPOSAL_TIMEOUT_S",
    "AuditBusyError",
    "AuditFailedError",
    "ConfigError",
    "InFlight",
    "MemberFactory",
    "NotAppliedError",
    "OutcomeUnknownError",
    "ProposalError",
    "Replica",
    "ReplicaConfig",
    "ReplicaObserver",
    "failure_commands",
    "file_usage",
    "is_loopback",
    "local_effects",
]
