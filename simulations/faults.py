"""Faults as data: a schedule drawn from the seed, then played on the cluster.

A run has three phases: faults (the schedule plays), heal (every crashed node restarts,
paused and stalled ones resume, partitions and slow links end) and drain (producers stop sending
new records, everyone finishes; the liveness check wants every confirmed record acked
within a bound).

Fault kinds:

* `crash`: a node's process dies and restarts `duration` later (unsynced writes lost);
* `kill_leader`: the same, aimed at whoever leads when it fires;
* `partition`: the nodes split into two sides for `duration` (a side may be one node);
* `link_reset`: one Raft connection breaks (its in-flight messages are lost);
* `slow_link`: one direction of a link gets `delay` extra latency for `duration`;
* `pause`: SIGSTOP for `duration`, often past the node-down grace period;
* `consumer_death`: a consumer's process dies; another takes its place later;

and, for liveness (how fast the cluster comes back, whom it marks down):

* `slow_host`: the node's Raft thread stalls for `duration` (50 ms to 5 s, most of
  them short: a GC pause, a starved CPU): its ticks and reads come late, but unlike a
  pause its process keeps its connections, and it reads its backlog when it resumes;
* `pause_mid_tick`: a pause (as `pause`) that begins at the seam of the node's next
  tick: after PySyncObj's election and leader checks, before the node's duties and
  the poll (`SimMember.at_seam`). It resumes believing what it believed, on a clock
  that jumped, and does its duties before it reads anything;
  (half of these two hit whoever leads when they fire: no node named);
* `one_way_delay`: one direction of a link is `amount` seconds late (0.7-1.8 s: more
  than an election timeout, less than PySyncObj's 2 s connection timeout), the other
  is not, for `duration`;
* `lone_candidate`: a follower (the node drawn, or the next one if it leads) is cut
  from every other node for `duration` (1-4 s: long enough to stand for election
  alone, a few times), then rejoins, with its higher term;
* hostile, TCP never does this and PySyncObj assumes it does not happen:
  `duplicate`, `reorder`, `drop` of single Raft messages for `duration`.

Disk faults (`disk_schedule`) and clock faults come on top of every profile's schedule,
each from a random stream of its own (so they leave the other faults of a seed as they
were). A list of kinds (`--faults kill_leader,partition`) runs those kinds and no other:
`select` says which kinds each schedule draws from.
Disk faults: `torn_power_loss` (the host loses power: what was not synced is lost,
part of it may stay, torn), `short_write` (the next journal write is short, the next
fails: the node stops, and is started again), `sync_failure` (the next fdatasync
fails: the same), `bit_flip` and `meta_ahead` (damage a restarting node must refuse:
it stays down, so only one node's disk is damaged per run). Disk space faults
(`disk_space_schedule`, a stream of their own): `disk_alarm` (a host's free space drops
below the node's `--min-free-disk` limit for `duration`: it raises its disk alarm, and
publishes are refused cluster-wide, as expected refusals, while deliveries and acks go
on) and `disk_full` (no space left for `duration`: the node's next journal write fails
with ENOSPC, it stops, and it waits for space before it starts again, as the real node
does). Clock faults: `clock_skew`
sets a host's wall clock off by `amount` ms (up to 30 days either way), `clock_jump`
moves it by `amount` ms (up to 2 days either way). Monotonic time stays true; only
wall clocks go wrong. A run's `Genesis` (a stream of its own too) sets wall clocks off
before the cluster starts, and may hand leadership over before the first proposal.

Membership faults (`membership_schedule`, a stream of its own too, on every run of a
profile other than `none`) are changes an operator makes (`simulations.operator`),
through the node's real administrative path (`add_member` / `remove_member` frames
with the admin token, the real `NodeCore`):

* `remove_member`: a host (any of A..D; skipped if it is no member) is removed, and
  added back `duration` after; `remove_leader`: the same, aimed at whoever leads when
  it fires (the node core asks it to hand leadership over first). A removed node keeps
  running, cut off (the members drop it and refuse its connections), until its
  operator stops it a moment later; its clients then reconnect to members; its
  consumers are marked down by whichever node leads. It comes back empty (its data
  directory moved away) at a new Raft address (`C@2`): back at its old address, a
  member that missed its removal could count the empty node's vote in its old
  configuration.
* `add_spare`: the spare host (D, no member at first) is started on an empty disk with
  every member as peers, added, and removed again `duration` after.
* `concurrent_changes`: two changes (adds of non-members, removals of members other
  than the leader) sent to the leader in one write: it takes one and refuses the other
  while the first is uncommitted; the node core tries it again. Both are undone
  `duration` after.

A change is skipped if it cannot be made safely: a change of that node already in
flight, or a configuration that would be left (whatever order the changes in flight
commit in) with fewer than two members or without a majority of members whose disk is
not damaged beyond repair (damage faults are skipped for the same reason). An add
waits until every member is up, connected to the leader, caught up and has its
configuration (the README's rule: a member that misses the add of a node can never
talk to it, PySyncObj refusing connections from nodes it does not know). At heal the
operator starts no new change; those in flight finish, the first members it removed
are added back, and a member whose disk is damaged beyond repair is removed and added
back empty: the cluster ends with a working majority.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from .disk import PLENTY
from .operator import Change
from .world import micros

if TYPE_CHECKING:
    import random

    from .cluster import Cluster
    from .node import SimNode
    from .operator import Operator
    from .workload import SimConsumer

TCP_KINDS = (
    "crash",
    "kill_leader",
    "partition",
    "link_reset",
    "slow_link",
    "pause",
    "consumer_death",
)
LIVENESS_KINDS = ("slow_host", "pause_mid_tick", "one_way_delay", "lone_candidate")
HOSTILE_KINDS = ("duplicate", "reorder", "drop")
MEMBERSHIP_KINDS = ("remove_member", "remove_leader", "add_spare", "concurrent_changes")
CLOCK_KINDS = ("clock_skew", "clock_jump")
DISK_KINDS = ("torn_power_loss", "short_write", "sync_failure", "bit_flip", "meta_ahead")
DAMAGE_KINDS = ("bit_flip", "meta_ahead")
"""Disk faults a node must refuse to start from: it stays down for the rest of the run."""
SPACE_KINDS = ("disk_alarm", "disk_full")
DAY_MS = 86_400_000
ONE_WAY_DELAY_S = (0.7, 1.8)
"""A one-way delay: past the longest election timeout (0.6 s), short of PySyncObj's
connection timeout (2 s: a connection read from no sooner is closed, and the link is
then as good as cut)."""
# "tcp": the default profile before the liveness kinds (issue 27): the seeds of the
# negative controls in tests/test_sim.py were found with it.
DEFAULT_WEIGHTS = {
    **dict.fromkeys(TCP_KINDS, 2),
    "slow_host": 2,
    "pause_mid_tick": 1,
    "one_way_delay": 1,
    "lone_candidate": 1,
}
"""How often each kind is drawn in the default profile, relative to the others (a
quarter of its faults are the liveness kinds)."""


def _weighted(weights: dict[str, int]) -> tuple[str, ...]:
    """A profile drawing each kind in proportion to its weight (a kind appears that
    many times: the schedule draws an entry uniformly)."""
    return tuple(kind for kind, weight in weights.items() for _ in range(weight))


PROFILES: dict[str, tuple[str, ...]] = {
    "default": _weighted(DEFAULT_WEIGHTS),
    "tcp": TCP_KINDS,
    "hostile": _weighted({**DEFAULT_WEIGHTS, **dict.fromkeys(HOSTILE_KINDS, 2)}),
    "crash": ("crash", "kill_leader"),
    "network": ("partition", "link_reset", "slow_link"),
    "liveness": ("kill_leader", "partition", *LIVENESS_KINDS),
    "none": (),
}


@attrs.frozen(kw_only=True)
class Fault:
    at_s: float
    kind: str
    nodes: tuple[str, ...] = ()
    """The target node(s); for a partition, one side."""
    duration_s: float = 0.0
    amount: float = 0.0
    """slow_link, one_way_delay: extra seconds; duplicate/drop: probability;
    consumer_death: the slot; clock_skew, clock_jump: milliseconds."""

    def describe(self) -> str:
        """One line, with units: `  12.30 s one_way_delay A->B +1.20 s for 3.00 s`."""
        parts = [f"{self.at_s:7.2f} s {self.kind}"]
        kind, nodes = self.kind, ",".join(self.nodes)
        if kind in ("slow_link", "one_way_delay"):
            parts.append(f"{self.nodes[0]}->{self.nodes[1]} +{self.amount:.3g} s")
        elif kind == "partition":
            parts.append(f"{nodes} | the rest")
        elif kind == "link_reset":
            parts.append("-".join(self.nodes))
        elif kind in ("clock_skew", "clock_jump"):
            parts.append(
                f"{nodes} {'off by' if kind == 'clock_skew' else 'by'} {span_ms(self.amount)}"
            )
        elif kind in ("duplicate", "drop"):
            parts.append(f"p={self.amount:g}")
        elif kind == "consumer_death":
            parts.append(f"slot {int(self.amount)}")
        elif kind == "disk_alarm":
            parts.append(f"{nodes} {self.amount / (1 << 20):.1f} MiB free")
        elif nodes:
            parts.append(nodes)
        elif kind in ("slow_host", "pause_mid_tick"):
            parts.append("(the leader)")
        if self.duration_s:
            parts.append(f"{'stalls' if kind == 'slow_host' else 'for'} {self.duration_s:.2f} s")
        return " ".join(parts)


def human_s(seconds: float) -> str:
    """A duration in the unit that reads best: `160 ms`, `4.85 s`, `2.5 min`."""
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 120:
        return f"{seconds:.2f} s"
    return f"{seconds / 60:.1f} min"


def span_ms(ms: float) -> str:
    """Milliseconds, in the unit that reads best: `+3.2 h`, `-12.0 d`, `+250 ms`."""
    sign = "-" if ms < 0 else "+"
    ms = abs(ms)
    for unit, size in (("d", DAY_MS), ("h", 3_600_000), ("min", 60_000), ("s", 1000)):
        if ms >= size:
            return f"{sign}{ms / size:.1f} {unit}"
    return f"{sign}{ms:g} ms"


DRAWN_KINDS = TCP_KINDS + LIVENESS_KINDS + HOSTILE_KINDS
"""The kinds `schedule` draws (one every `--fault-interval` on average); the others come
from schedules of their own."""
GROUPS = {
    "clock": CLOCK_KINDS,
    "disk": DISK_KINDS,
    "disk_space": SPACE_KINDS,
    "membership": MEMBERSHIP_KINDS,
}
"""In a list of kinds, a name for every kind of one of those schedules."""
KINDS = DRAWN_KINDS + CLOCK_KINDS + DISK_KINDS + SPACE_KINDS + MEMBERSHIP_KINDS


def kinds_of(profile: str) -> tuple[str, ...]:
    """A profile name, or kinds (and `GROUPS`) separated by commas: the kinds named. A
    list that names no kind (`""`, `","`) is refused: it ran no fault and passed; so
    is one that names a kind twice (itself, or in a group). A name with a comma after
    it is a list even alone: `crash,` is the kind crash, `crash` the profile."""
    if profile in PROFILES:
        return PROFILES[profile]
    names = [k.strip() for k in profile.split(",") if k.strip()]
    if not names:
        raise ValueError(
            f"{profile!r} names no fault kind; a profile ({', '.join(sorted(PROFILES))}) "
            "or fault kinds separated by commas (`none` runs the clock faults alone)"
        )
    unknown = [k for k in names if k not in KINDS and k not in GROUPS]
    if unknown:
        raise ValueError(
            f"unknown fault kinds {unknown}; profiles: {sorted(PROFILES)}; groups: {sorted(GROUPS)}"
        )
    kinds = tuple(kind for k in names for kind in GROUPS.get(k, (k,)))
    twice = list(dict.fromkeys(k for k in kinds if kinds.count(k) > 1))
    if twice:
        raise ValueError(f"{', '.join(twice)} named more than once in {profile!r}")
    return kinds


@attrs.frozen(kw_only=True)
class Selection:
    """The kinds each of a run's schedules draws from (none: it is not drawn)."""

    drawn: tuple[str, ...]
    clock: tuple[str, ...]
    disk: tuple[str, ...]
    space: tuple[str, ...]
    membership: tuple[str, ...]

    @property
    def kinds(self) -> set[str]:
        return {*self.drawn, *self.clock, *self.disk, *self.space, *self.membership}


def select(
    faults: str, *, disk: bool = True, space: bool = True, membership: bool = True
) -> Selection:
    """Which faults a run plays. A profile: its kinds, the clock faults, and but for
    `none` the disk, disk space and membership faults (what a switch leaves out
    aside). A list of kinds: those kinds and no other (the same switches apply, and the
    disk space faults go with the disk faults)."""
    named = kinds_of(faults)
    space = space and disk
    if faults in PROFILES:
        more = faults != "none"
        return Selection(
            drawn=named,
            clock=CLOCK_KINDS,
            disk=DISK_KINDS if disk and more else (),
            space=SPACE_KINDS if space and more else (),
            membership=MEMBERSHIP_KINDS if membership and more else (),
        )

    def of(kinds: tuple[str, ...], wanted: bool = True) -> tuple[str, ...]:
        return tuple(k for k in kinds if k in named) if wanted else ()

    return Selection(
        drawn=tuple(k for k in named if k in DRAWN_KINDS),
        clock=of(CLOCK_KINDS),
        disk=of(DISK_KINDS, disk),
        space=of(SPACE_KINDS, space),
        membership=of(MEMBERSHIP_KINDS, membership),
    )


def _another(names: Sequence[str], node: str, other: str) -> str:
    """`other`, or the node after `node` if the two are the same: a link has two ends."""
    return names[(names.index(node) + 1) % len(names)] if other == node else other


def schedule(
    rng: random.Random,
    kinds: Sequence[str],
    names: Sequence[str],
    consumers: int,
    *,
    duration_s: float,
    mean_interval_s: float = 2.0,
) -> list[Fault]:
    """Faults at random times in [1 s, duration - 1 s], about one per `mean_interval_s`."""
    if not kinds or duration_s <= 2:
        return []
    count = max(1, round((duration_s - 2) / mean_interval_s))
    times = sorted(rng.uniform(1.0, duration_s - 1.0) for _ in range(count))
    faults = []
    for at in times:
        kind = kinds[rng.randrange(len(kinds))]
        node = names[rng.randrange(len(names))]
        other = names[rng.randrange(len(names))]
        if kind in ("crash", "kill_leader"):
            faults.append(Fault(at_s=at, kind=kind, nodes=(node,), duration_s=rng.uniform(0.2, 8)))
        elif kind == "partition":
            side = tuple(n for n in names if rng.random() < 0.5) or (node,)
            faults.append(Fault(at_s=at, kind=kind, nodes=side, duration_s=rng.uniform(0.5, 10)))
        elif kind in ("link_reset", "slow_link"):
            other = _another(names, node, other)
            faults.append(
                Fault(
                    at_s=at,
                    kind=kind,
                    nodes=(node, other),
                    duration_s=rng.uniform(0.5, 5) if kind == "slow_link" else 0.0,
                    amount=round(rng.uniform(0.02, 0.4), 3) if kind == "slow_link" else 0.0,
                )
            )
        elif kind == "pause":
            faults.append(Fault(at_s=at, kind=kind, nodes=(node,), duration_s=rng.uniform(0.5, 9)))
        elif kind == "consumer_death":
            faults.append(Fault(at_s=at, kind=kind, amount=rng.randrange(max(consumers, 1))))
        elif kind == "slow_host":  # log-uniform: most stalls are short
            stall = math.exp(rng.uniform(math.log(0.05), math.log(5.0)))
            target = (node,) if rng.random() < 0.5 else ()  # (): whoever leads then
            faults.append(Fault(at_s=at, kind=kind, nodes=target, duration_s=stall))
        elif kind == "pause_mid_tick":
            target = (node,) if rng.random() < 0.5 else ()
            duration = rng.uniform(0.5, 9)
            faults.append(Fault(at_s=at, kind=kind, nodes=target, duration_s=duration))
        elif kind == "one_way_delay":
            other = _another(names, node, other)
            faults.append(
                Fault(
                    at_s=at,
                    kind=kind,
                    nodes=(node, other),
                    duration_s=rng.uniform(1, 8),
                    amount=round(rng.uniform(*ONE_WAY_DELAY_S), 3),
                )
            )
        elif kind == "lone_candidate":
            faults.append(Fault(at_s=at, kind=kind, nodes=(node,), duration_s=rng.uniform(1, 4)))
        else:
            amount = round(rng.uniform(0.01, 0.2), 3) if kind != "reorder" else 0.0
            faults.append(Fault(at_s=at, kind=kind, duration_s=rng.uniform(0.5, 4), amount=amount))
    return faults


def clock_schedule(
    rng: random.Random,
    names: Sequence[str],
    *,
    duration_s: float,
    mean_interval_s: float = 3.0,
    kinds: Sequence[str] = CLOCK_KINDS,
) -> list[Fault]:
    """Wall-clock faults at random times in [0.5 s, duration]: skews and jumps (of
    `kinds`)."""
    count = max(1, round(duration_s / mean_interval_s))
    faults = []
    for at in sorted(rng.uniform(0.5, duration_s) for _ in range(count)):
        node = names[rng.randrange(len(names))]
        skew = rng.random() < 0.5 if len(kinds) > 1 else kinds[0] == "clock_skew"
        if skew:
            amount = rng.choice([0, rng.randint(-30 * DAY_MS, 30 * DAY_MS)])
            faults.append(Fault(at_s=at, kind="clock_skew", nodes=(node,), amount=amount))
        else:
            amount = rng.randint(-2 * DAY_MS, 2 * DAY_MS)
            faults.append(Fault(at_s=at, kind="clock_jump", nodes=(node,), amount=amount))
    return faults


@attrs.frozen(kw_only=True)
class Genesis:
    """How a run's cluster is born: hosts' wall clocks already off when it starts, and
    how many leaders hand leadership over at once, before anything is proposed (so a
    node may lead, anchor its clock at its wall clock, stamp nothing, and lead again
    later: a leader's state from an earlier term must not leak into a later one)."""

    wall_offsets_ms: dict[str, int] = attrs.field(factory=dict)
    handovers: int = 0


def genesis(rng: random.Random, names: Sequence[str]) -> Genesis:
    """Half the runs start with skewed wall clocks; a third hand leadership over once or
    twice before the first proposal."""
    offsets = {}
    if rng.random() < 0.5:
        for name in names:
            if rng.random() < 0.5:
                offsets[name] = rng.randint(-30 * DAY_MS, 30 * DAY_MS)
    handovers = rng.choice([0, 0, 0, 0, 1, 2])
    return Genesis(wall_offsets_ms=offsets, handovers=handovers)


def _times(rng: random.Random, duration_s: float, mean_interval_s: float) -> list[float]:
    """About one time per `mean_interval_s` (at least one), at random in
    [1 s, duration - 1 s], in order; none if the phase is 2 s or shorter."""
    if duration_s <= 2:
        return []
    count = max(1, round((duration_s - 2) / mean_interval_s))
    return sorted(rng.uniform(1.0, duration_s - 1.0) for _ in range(count))


def disk_schedule(
    rng: random.Random,
    names: Sequence[str],
    *,
    duration_s: float,
    mean_interval_s: float = 6.0,
    kinds: Sequence[str] = DISK_KINDS,
) -> list[Fault]:
    """Disk faults (of `kinds`) at random times in [1 s, duration - 1 s]: torn power
    losses, short writes and failed syncs (the node stops, and is started again), and
    damage a restarting node must refuse (a flipped bit, a meta file ahead of its
    journal)."""
    faults = []
    for at in _times(rng, duration_s, mean_interval_s):
        kind = kinds[rng.randrange(len(kinds))]
        node = names[rng.randrange(len(names))]
        duration = rng.uniform(0.2, 4) if kind in (*DAMAGE_KINDS, "torn_power_loss") else 0.0
        faults.append(Fault(at_s=at, kind=kind, nodes=(node,), duration_s=duration))
    return faults


def disk_space_schedule(
    rng: random.Random,
    names: Sequence[str],
    *,
    duration_s: float,
    mean_interval_s: float = 15.0,
    kinds: Sequence[str] = SPACE_KINDS,
) -> list[Fault]:
    """Disk space faults (of `kinds`) at random times in [1 s, duration - 1 s]: a host's
    free space below the disk alarm's limit (`amount`: the bytes left, 4-64 MiB, enough
    to write), or none at all, for 0.5-5 s."""
    faults = []
    for at in _times(rng, duration_s, mean_interval_s):
        kind = kinds[rng.randrange(len(kinds))]
        node = names[rng.randrange(len(names))]
        left = rng.randint(4 << 20, (64 << 20) - 1) if kind == "disk_alarm" else 0
        faults.append(
            Fault(at_s=at, kind=kind, nodes=(node,), duration_s=rng.uniform(0.5, 5), amount=left)
        )
    return faults


def membership_schedule(
    rng: random.Random,
    names: Sequence[str],
    spares: Sequence[str],
    *,
    duration_s: float,
    mean_interval_s: float = 3.0,
    kinds: Sequence[str] = MEMBERSHIP_KINDS,
) -> list[Fault]:
    """Membership changes (of `kinds`) at random times in [1 s, duration - 2 s]: a
    member removed (any host, or whoever leads then) and added back `duration` after, a
    spare added and removed again `duration` after, two changes sent to the leader at
    once (both undone `duration` after)."""
    if duration_s <= 3:
        return []
    hosts = [*names, *spares]
    count = max(1, round((duration_s - 3) / mean_interval_s))
    faults = []
    for at in sorted(rng.uniform(1.0, duration_s - 2.0) for _ in range(count)):
        kind = kinds[rng.randrange(len(kinds))]
        duration = rng.uniform(1.0, 6.0)
        if kind == "remove_member":
            nodes: tuple[str, ...] = (hosts[rng.randrange(len(hosts))],)
        elif kind == "add_spare":
            nodes = (spares[rng.randrange(len(spares))],) if spares else ()
        else:
            nodes = ()
        faults.append(Fault(at_s=at, kind=kind, nodes=nodes, duration_s=duration))
    return faults


class Injector:
    """Plays a fault schedule on a cluster; `heal()` ends every fault still running."""

    def __init__(
        self,
        cluster: Cluster,
        consumers: Sequence[SimConsumer],
        history: Any = None,
        operator: Operator | None = None,
    ) -> None:
        self.cluster = cluster
        self.operator = operator
        self.world = cluster.world
        self.network = cluster.network
        self.consumers = list(consumers)
        self.history = history
        self.injected: Counter[str] = Counter()
        self.skipped: Counter[str] = Counter()
        self.fired: list[Fault] = []
        """The faults injected (not skipped), at the times they fired."""
        self.passed_over: list[tuple[Fault, str]] = []
        """The faults skipped when due (no target then), and why."""
        self._down_until: dict[str, int] = {}
        self._space_until: dict[str, int] = {}
        self._partitions = 0
        self._healed = False

    def play(self, faults: Sequence[Fault]) -> None:
        for fault in faults:
            self.world.at(micros(fault.at_s), self._fire, fault)

    def _done(self, fault: Fault, detail: str = "") -> None:
        self.injected[fault.kind] += 1
        self.fired.append(fault)
        self.world.trace(f"fault {fault.describe()} {detail}")
        if self.history is not None:
            self.history.fault(fault, detail)

    def _skip(self, fault: Fault, why: str) -> None:
        self.skipped[fault.kind] += 1
        self.passed_over.append((fault, why))

    @staticmethod
    def _unready(fault: Fault, node: SimNode | None) -> str:
        """Why `node` (the fault's, or the leader's) could take no fault."""
        if node is None:
            return "no leader" if not fault.nodes else f"{fault.nodes[0]} was down"
        return f"{node.name} was {'paused' if node.paused else 'about to pause'}"

    def _fire(self, fault: Fault) -> None:
        if self._healed:
            return
        cluster, network = self.cluster, self.network
        kind = fault.kind
        end = self.world.now_us + micros(fault.duration_s)
        if kind in ("crash", "kill_leader"):
            target = None
            if kind == "kill_leader":
                leader = cluster.leader()
                target = leader.name if leader is not None else None
            elif cluster.nodes[fault.nodes[0]] is not None:
                target = fault.nodes[0]
            if target is None:
                self._skip(
                    fault, "no leader" if kind == "kill_leader" else f"{fault.nodes[0]} was down"
                )
                return
            cluster.crash(target)
            self._down_until[target] = end
            self.world.at(end, self._restart, target, end)
            self._done(fault, target)
        elif kind == "partition":
            side = list(fault.nodes)
            rest = [n for n in cluster.hosts if n not in side]
            network.partition([cluster.addresses(side), cluster.addresses(rest)])
            self._partitions += 1
            self.world.at(end, self._end_partition, self._partitions)
            self._done(fault)
        elif kind == "link_reset":
            a, b = cluster.addresses(list(fault.nodes))
            network.reset(a, b)
            self._done(fault)
        elif kind in ("slow_link", "one_way_delay"):
            a, b = cluster.addresses(list(fault.nodes))
            network.delay(a, b, micros(fault.amount))
            self.world.at(end, network.undelay, a, b, micros(fault.amount))
            self._done(fault)
            to = f"{fault.kind.replace('_', ' ')} to {fault.nodes[1]}"
            self._period(fault.nodes[0], fault, f"{to}: +{human_s(fault.amount)}")
        elif kind == "slow_host":
            node = self._node_or_leader(fault)
            if node is None or node.paused:
                self._skip(fault, self._unready(fault, node))
                return
            node.stall(end)
            self._done(fault, node.name)
            self._period(node.name, fault, "Raft thread stalled")
        elif kind == "pause_mid_tick":
            node = self._node_or_leader(fault)
            if node is None or node.paused or node.pause_at_seam_us is not None:
                self._skip(fault, self._unready(fault, node))
                return
            node.pause_at_seam_us = micros(fault.duration_s)
            self._done(fault, node.name)
            self._period(node.name, fault, "paused from the seam of its next tick")
        elif kind == "lone_candidate":
            target = self._follower(fault.nodes[0])
            if target is None:
                self._skip(fault, "no follower running")
                return
            address = cluster.address[target]
            network.isolate(address)
            self.world.at(end, network.rejoin, address)
            self._done(fault, target)
            self._period(target, fault, "cut off alone")
        elif kind == "pause":
            name = fault.nodes[0]
            node = cluster.nodes[name]
            if node is None or node.paused:
                self._skip(fault, self._unready(fault, node))
                return
            cluster.pause(name)
            self.world.at(end, cluster.resume, name)
            self._done(fault)
            self._period(name, fault, "paused")
        elif kind == "consumer_death":
            consumer = self.consumers[int(fault.amount)] if self.consumers else None
            if consumer is None or not consumer.die():
                self._skip(fault, "its consumer was not running")
                return
            self._done(fault, consumer.id or "")
        elif kind == "duplicate":
            network.duplicate_p = fault.amount
            self.world.at(end, setattr, network, "duplicate_p", 0.0)
            self._done(fault)
        elif kind == "drop":
            network.drop_p = fault.amount
            self.world.at(end, setattr, network, "drop_p", 0.0)
            self._done(fault)
        elif kind == "reorder":
            network.reorder = True
            self.world.at(end, setattr, network, "reorder", False)
            self._done(fault)
        elif kind in DISK_KINDS:
            self._disk_fault(fault)
        elif kind in SPACE_KINDS:
            self._space_fault(fault, end)
        elif kind == "clock_skew":
            cluster.wall_offset_ms[fault.nodes[0]] = int(fault.amount)
            self._done(fault)
        elif kind == "clock_jump":
            cluster.wall_offset_ms[fault.nodes[0]] += int(fault.amount)
            self._done(fault)
        elif kind in MEMBERSHIP_KINDS:
            self._membership_fault(fault)

    def _period(self, name: str, fault: Fault, what: str) -> None:
        """Show on `name`'s lane of the timeline what the fault does to it, how long."""
        if self.history is not None:
            self.history.period(name, fault.at_s, fault.at_s + fault.duration_s, what)

    def _node_or_leader(self, fault: Fault) -> SimNode | None:
        """The fault's node, or with none named, whoever leads when it fires."""
        if not fault.nodes:
            return self.cluster.leader()
        return self.cluster.nodes[fault.nodes[0]]

    def _follower(self, name: str) -> str | None:
        """`name` if it runs as a member and does not lead, else the next that does."""
        cluster = self.cluster
        leader = cluster.leader()
        hosts = cluster.hosts
        start = hosts.index(name)
        for other in hosts[start:] + hosts[:start]:
            node = cluster.nodes[other]
            if node is not None and node is not leader and other in cluster.membership:
                return other
        return None

    def _membership_fault(self, fault: Fault) -> None:
        """Hand the changes to the operator (skipped if they cannot be made now: a change
        of that node in flight, no leader, or no working majority after them)."""
        operator, kind = self.operator, fault.kind
        leader = self.cluster.leader()
        changes: list[Change] | None = None
        if kind == "remove_member":
            changes = [Change("remove", fault.nodes[0])]
        elif kind == "remove_leader" and leader is not None:
            changes = [Change("remove", leader.name)]
        elif kind == "add_spare" and fault.nodes:
            changes = [Change("add", fault.nodes[0])]
        elif kind == "concurrent_changes" and leader is not None and operator is not None:
            changes = self._two_changes(operator, leader.name)
        together = kind == "concurrent_changes"
        if (
            operator is None
            or changes is None
            or not operator.submit(changes, together=together, then_s=fault.duration_s)
        ):
            self._skip(
                fault,
                "not safe then (a change in flight, no leader, or no working majority after it)",
            )
            return
        self._done(fault, ", ".join(f"{c.kind} {c.node}" for c in changes))

    def _two_changes(self, operator: Operator, leader: str) -> list[Change] | None:
        """Two changes the operator may make together: adds of non-members, removals of
        members other than the leader (the node the changes are sent to)."""
        cluster = self.cluster
        changes = [
            Change("add", n) if n not in cluster.membership else Change("remove", n)
            for n in cluster.hosts
            if n != leader and not operator.busy(n)
        ]
        pairs = [
            [a, b]
            for i, a in enumerate(changes)
            for b in changes[i + 1 :]
            if operator.feasible([a, b])
        ]
        return pairs[operator.random.randrange(len(pairs))] if pairs else None

    def _disk_fault(self, fault: Fault) -> None:
        cluster, kind, name = self.cluster, fault.kind, fault.nodes[0]
        node = cluster.nodes[name]
        disk = cluster.disks[name]
        if node is None or node.paused:
            self._skip(fault, self._unready(fault, node))
            return
        if kind == "short_write":
            disk.files.fail_next_write()
            self._done(fault)
            return
        if kind == "sync_failure":
            disk.files.fail_next_sync()
            self._done(fault)
            return
        damaged = [n for n in cluster.hosts if cluster.disks[n].doomed]
        operator = self.operator
        if kind in DAMAGE_KINDS and (
            damaged or (operator is not None and not operator.feasible(damaged=[name]))
        ):
            # one node beyond repair is enough: a majority must live
            self._skip(fault, "a disk beyond repair already, or no working majority after it")
            return
        last_index = node.member.journal[-1][1] if len(node.member.journal) else 0
        group_disk = node.disk  # (with groups: the workload's queue's group's journal)
        cluster.crash(name, torn=True)
        if kind == "bit_flip":
            disk.files.flip_bit(group_disk.journal_data_path())
            disk.doomed = True
        elif kind == "meta_ahead":  # a disk that said the journal was synced, and lied
            disk.files.set_commit_index(group_disk.meta_path, last_index + 3)
            disk.doomed = True
        end = self.world.now_us + micros(fault.duration_s)
        self._down_until[name] = end
        self.world.at(end, self._restart, name, end)
        self._done(fault)

    def _space_fault(self, fault: Fault, end: int) -> None:
        """The host's free space drops to `amount` bytes until `end` (a later space
        fault of the same host replaces this one; the heal gives the space back)."""
        name = fault.nodes[0]
        files = self.cluster.disks[name].files
        files.free_bytes = int(fault.amount)
        self._space_until[name] = end
        self.cluster.space_fault_ran = True
        self.world.at(end, self._space_back, name, end)
        self._done(fault)
        left = "no space" if fault.amount <= 0 else f"{fault.amount / (1 << 20):.1f} MiB free"
        self._period(name, fault, f"data disk: {left}")

    def _space_back(self, name: str, until: int) -> None:
        if self._space_until.get(name) == until:
            del self._space_until[name]
            self.cluster.disks[name].files.free_bytes = PLENTY
            self.world.trace(f"space back {name}")

    def _restart(self, name: str, until: int) -> None:
        cluster = self.cluster
        if self._down_until.get(name) == until and cluster.nodes[name] is None:
            del self._down_until[name]
            if name not in cluster.retired:  # its operator stopped it meanwhile
                cluster.start(name)

    def _end_partition(self, number: int) -> None:
        if number == self._partitions:  # a later partition replaced this one
            self.network.partition([self.cluster.addresses(self.cluster.hosts)])

    def heal(self) -> None:
        """The end of the fault phase: everything runs and talks again. Every member,
        and every node being added or removed, runs; the operator starts no new change
        (those in flight finish, a node whose removal is confirmed is stopped) but adds
        back the first members it removed (`Operator.heal`)."""
        self._healed = True
        self.world.trace("heal")
        cluster, operator = self.cluster, self.operator
        self.network.heal()
        for name in list(self._space_until):
            self._space_back(name, self._space_until[name])
        for name in cluster.hosts:
            node = cluster.nodes[name]
            wanted = name in cluster.membership or (
                operator is not None and operator.changing(name)
            )
            if node is None and wanted and name not in cluster.retired:
                self._down_until.pop(name, None)
                cluster.start(name)
            elif node is not None:
                cluster.resume(name)
                node.unstall()  # a slow host is healed too (seed 287: D stalled past the heal)
        if operator is not None:
            operator.heal()
