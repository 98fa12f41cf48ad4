"""One simulated run from one seed, and sweeps over many seeds.

`run(RunConfig(seed=7))` builds the world, the cluster (N replicas of the real machine
on the real PySyncObj, and a spare host), the workload, the operator (membership
changes), the fault schedule and the checker from the seed, plays the phases (faults,
heal, drain) and returns a `Result`: counts, faults injected, membership changes,
violations, the verdict and the trace hash. The same seed gives the same trace hash in
any process, under any PYTHONHASHSEED, on Python 3.11+.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import shlex
import signal
import time
from collections import Counter
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Any, Literal, TextIO

import attrs

from .checker import Checker, Violation
from .cluster import Cluster
from .faults import (
    Fault,
    Injector,
    clock_schedule,
    disk_schedule,
    disk_space_schedule,
    genesis,
    membership_schedule,
    schedule,
    select,
)
from .group_checks import GroupChecks, SideProducer
from .history import History
from .liveness import Liveness, LivenessReport
from .names import QUEUE
from .node import REAL, SimNode, Variant
from .operator import Operator
from .pauses import Pauses, fault_pauses, pause_table
from .workers import Workers
from .workload import SimConsumer, SimProducer, WorkloadConfig, declare, start_workload
from .world import US, World, micros, patched_pysyncobj, seconds

STEP_S = 0.01
"""A step is 10 ms of simulated time; `steps` sets the length of the fault phase."""


@attrs.frozen(kw_only=True)
class RunConfig:
    seed: int
    nodes: int = 3
    faults: str = "default"
    steps: int = 3000
    """Length of the fault phase, in 10 ms steps (3000: 30 simulated seconds)."""
    fault_interval_s: float = 1.2
    """Mean time between two faults."""
    drain_s: float = 60.0
    """Liveness bound: after heal, every confirmed record must be acked within this."""
    converge_s: float = 120.0
    """After the drain, every replica must reach the same applied index within this.
    (PySyncObj repairs a follower's divergent log one entry per heartbeat.)"""
    grace_s: float = 5.0
    compaction_entries: int | None = None
    """PySyncObj's `logCompactionMinEntries`: a node writes a snapshot and compacts its
    journal when it holds more entries than this (None: never, as the real node's
    50,000 within a run). Small values make lagging followers install snapshots."""
    journal: Literal["file", "wal"] = "file"
    """Each node's journal: a file of its own (`DurableJournal`), or group 0 of the
    shared write-ahead log (`quorumq.raft.wal`, issue 33), under the same disk faults."""
    disk_faults: bool = True
    """Add the disk faults (`faults.disk_schedule`) to the schedule."""
    disk_space_faults: bool = True
    """Add the disk space faults (`faults.disk_space_schedule`: a disk alarm, a full
    disk) to the schedule, with the disk faults."""
    membership_faults: bool = True
    """Add the membership changes (`faults.membership_schedule`) to the schedule."""
    spares: int = 1
    """Hosts that are no members at first (D): the operator may add them."""
    groups: int = 1
    """Raft groups every node hosts (`quorumq node --groups`): the workload's queue is
    placed in one (`model_group`), and one idle queue in each other (`GroupChecks`);
    each group's journal is a file (`journal` "file")."""
    scripted: tuple[Fault, ...] = ()
    """Faults played on top of the drawn schedule (a test scripts its faults here)."""
    workload: WorkloadConfig = attrs.field(factory=WorkloadConfig)
    variant: Variant = REAL
    stop_at_violation: bool = True

    @property
    def model_group(self) -> int:
        """The group of the workload's queue: the seed's, modulo `groups` (group 0, the
        directory's, is one in `groups` runs)."""
        return self.seed % self.groups

    def __attrs_post_init__(self) -> None:
        if self.groups > 1 and self.journal != "file":
            raise ValueError("a run with groups keeps each group's journal in a file")

    def replay_args(self) -> list[str]:
        """The options of `quorumq simulate replay` (or `run`) that give this config
        (but its variant and scripted faults, which no option gives)."""
        args = ["--seed", str(self.seed), "--nodes", str(self.nodes)]
        args += ["--faults", self.faults, "--steps", str(self.steps)]
        if self.fault_interval_s != attrs.fields(RunConfig).fault_interval_s.default:
            args += ["--fault-interval", f"{self.fault_interval_s!r}"]
        defaults = WorkloadConfig()
        if self.workload.rate != defaults.rate:
            args += ["--rate", f"{self.workload.rate!r}"]
        if self.compaction_entries is not None:
            args += ["--compaction", str(self.compaction_entries)]
        for name in ("producers", "consumers", "keys", "prefetch"):
            if getattr(self.workload, name) != getattr(defaults, name):
                args += [f"--{name}", str(getattr(self.workload, name))]
        if self.workload.bursts is not None:
            args += ["--bursts", ",".join(f"{s!r}" for s in self.workload.bursts)]
        args += shlex.split(self.workload.queue_option_flags())
        if self.journal != "file":
            args += ["--journal", self.journal]
        if not self.disk_faults:
            args.append("--no-disk-faults")
        elif not self.disk_space_faults:
            args.append("--no-disk-space-faults")
        if not self.membership_faults:
            args.append("--no-membership-faults")
        if self.spares != attrs.fields(RunConfig).spares.default:
            args += ["--spares", str(self.spares)]
        if self.groups != 1:
            args += ["--groups", str(self.groups)]
        return args

    def replay_command(self) -> str:
        command = f"quorumq simulate replay {shlex.join(self.replay_args())}"
        if self.variant is not REAL:
            command += f"  (variant: {self.variant.name})"
        if self.scripted:
            command += "  (and the scripted faults)"
        return command


@attrs.frozen(kw_only=True)
class Result:
    config: RunConfig
    sim_s: float
    wall_s: float
    faults: dict[str, int]
    skipped_faults: dict[str, int]
    """Faults skipped when due, by kind: they had no target then (their node down or
    paused, no leader, a membership change not safe then)."""
    counts: dict[str, int]
    violations: tuple[Violation, ...]
    violation_count: int
    trace_hash: str
    leader_changes: int
    deliveries: int
    redeliveries: int
    raft_messages: int
    events: int
    drained_after_s: float | None
    schedule: tuple[Fault, ...]
    """Every fault scheduled (at simulated seconds, as in the rest of the summary),
    injected or skipped: `schedule_lines` says which."""
    fired: tuple[Fault, ...]
    """The faults injected (`faults` counts them by kind)."""
    passed_over: tuple[tuple[Fault, str], ...]
    """The faults skipped when due, and why (`skipped_faults` counts them by kind)."""
    end_state: tuple[str, ...]
    raft_log: dict[str, int]
    """PySyncObj's and the journal's warnings during the run, by message (kept out of
    the output)."""
    converged_after_s: float
    snapshots: dict[str, int]
    """Snapshots written (compactions), sent to followers, installed and refused (stale),
    and loaded (the leader's, or a node's own at start-up)."""
    wal_segments_freed: int
    """Write-ahead log segments the nodes removed (`--journal wal`; 0 otherwise)."""
    membership: dict[str, int]
    """Configuration changes leaders accepted and refused; the operator's requests
    sent, confirmed and failed (then sent again)."""
    members: tuple[str, ...]
    """The members at the end."""
    confirm_pauses: dict[str, Pauses]
    """Per fault kind: how long publishers waited for a confirm after its faults
    (`pauses`: from a fault's end, or its start for a crash, with no other fault active)."""
    delivery_pauses: dict[str, Pauses]
    """Per fault kind: how long consumers waited for a first delivery, likewise."""
    liveness: LivenessReport
    """After the heal: the bound, when the cluster came back; the false downs."""
    longest_confirm_gap: tuple[float, float]
    """The longest wait between two confirms in the run, in seconds, and when it began
    (whatever the faults: how long the cluster was unavailable to publishers at worst)."""
    history: Any = attrs.field(eq=False, repr=False)
    groups: dict[str, dict[int, int]] = attrs.field(factory=dict)
    """With groups, per group but the model group: entries applied (all replicas
    together), leaderships, and records the side producer had confirmed (its idle
    queue); none with one group."""

    @property
    def ok(self) -> bool:
        return self.violation_count == 0

    def _group_lines(self) -> list[str]:
        if not self.groups:
            return []
        applied, leaderships, confirmed = (
            self.groups[k] for k in ("applied", "leaderships", "confirmed")
        )
        return [
            f"groups: {self.config.groups}, the workload's queue in group "
            f"{self.config.model_group}; the others (entries applied, leaderships, side "
            "records confirmed): "
            + ", ".join(
                f"group {g} {applied[g]} / {leaderships[g]} / {confirmed[g]}" for g in applied
            )
        ]

    @property
    def fault_count(self) -> int:
        return sum(self.faults.values())

    def schedule_lines(self) -> list[str]:
        """The schedule, a line per fault, each skipped one saying why (and any the run
        did not reach: it stopped at a violation)."""
        fired = {id(f) for f in self.fired}
        why = {id(f): reason for f, reason in self.passed_over}
        lines = []
        for fault in self.schedule:
            if id(fault) in fired:
                lines.append(fault.describe())
            elif id(fault) in why:
                lines.append(f"{fault.describe()}  (skipped: {why[id(fault)]})")
            else:
                lines.append(f"{fault.describe()}  (not reached: the run stopped)")
        return lines

    def summary(self) -> str:
        c = self.counts
        faults = ", ".join(f"{k} {v}" for k, v in sorted(self.faults.items())) or "none"
        lines = [
            f"seed {self.config.seed}: {self.config.nodes} nodes, faults {self.config.faults}, "
            f"variant {self.config.variant.name}",
            f"simulated {self.sim_s:.1f} s in {self.wall_s:.1f} s wall "
            f"({self.sim_s / max(self.wall_s, 1e-9):.0f}x), {self.events} events, "
            f"{self.raft_messages} Raft messages, {self.leader_changes} leaderships",
            f"faults injected ({self.fault_count}): {faults}"
            + (
                "; skipped when due, with no target then (run --schedule says why): "
                + ", ".join(f"{k} {v}" for k, v in self.skipped_faults.items())
                if self.skipped_faults
                else ""
            ),
            f"records: published {c['published']}, confirmed {c['confirmed']}, "
            f"received {c['received']}, acked {c['acked']}; deliveries {self.deliveries} "
            f"({self.redeliveries} redelivered)",
            f"lost {c['lost']}, unexpected {c['unexpected']}, duplicated {c['duplicated']}, "
            f"recovered {c['recovered']}, unsettled {c['unsettled']}; by the queue's "
            f"options: dropped {c['dropped']}, dead-lettered {c['dead_lettered']}, "
            f"refused {c['refused']}; consumers timed out {c['consumers_timed_out']}",
            f"disk: {c['refused_start']} starts refused (damaged journal or snapshot), "
            f"{c['fatal_stop']} nodes stopped (a failed write or sync)",
            *self._group_lines(),
            f"membership: {self.membership.get('accepted', 0)} changes accepted and "
            f"{self.membership.get('refused', 0)} refused by leaders; the operator sent "
            f"{self.membership.get('sent', 0)}, {self.membership.get('confirmed', 0)} "
            f"confirmed, {self.membership.get('failed', 0)} failed (sent again)"
            + (
                f"; {rebuilt} rebuilt at the heal (a disk damaged beyond repair: the "
                "member removed, and added back empty)"
                if (rebuilt := self.membership.get("rebuilt", 0))
                else ""
            )
            + f"; members at the end {','.join(self.members)}",
            (
                f"drained {self.drained_after_s:.1f} s after heal"
                if self.drained_after_s is not None
                else "not drained"
            )
            + f"; replicas converged {self.converged_after_s:.1f} s later; longest wait "
            f"between confirms {self.longest_confirm_gap[0]:.2f} s (from "
            f"{self.longest_confirm_gap[1]:.1f} s)",
            f"trace {self.trace_hash}",
        ]
        lines[-1:-1] = self.liveness.lines()
        if self.confirm_pauses:
            lines[-1:-1] = pause_table(self.confirm_pauses, self.delivery_pauses)
        if self.config.workload.retry_backoff_ms is not None:
            lines.insert(5, f"retry backoff: {c['retries_held']} redeliveries held to a delay")
        if self.snapshots:
            lines.insert(
                -1, "snapshots: " + ", ".join(f"{k} {v}" for k, v in self.snapshots.items())
            )
        for message, n in self.raft_log.items():
            lines.append(f"logged {n}x: {message}")
        if self.ok:
            lines.append("verdict: PASS")
        else:
            lines.append(f"verdict: FAIL ({self.violation_count} violations)")
            if self.config.stop_at_violation:
                lines.append(
                    "  (the run stopped at its first violation: records still in flight "
                    "then count as lost or unsettled above, and are no violations)"
                )
            for v in self.violations[:10]:
                lines.append(f"  {v.at_s:8.3f}s {v.kind}: {v.detail}")
            lines.append("end state:")
            lines += [f"  {line}" for line in self.end_state]
            lines.append(f"replay: {self.config.replay_command()}")
        return "\n".join(lines)


def run(config: RunConfig, history: TextIO | None = None) -> Result:
    """Play one seed: faults, heal, drain; check everything; return the result.
    `history`: where to write every event of the run, one line each (`replay`)."""
    started = time.perf_counter()
    world = World(config.seed, history)
    cluster = Cluster(
        world,
        config.nodes,
        spares=config.spares,
        variant=config.variant,
        grace_s=config.grace_s,
        compaction_entries=config.compaction_entries,
        wal=config.journal == "wal",
        groups=config.groups,
        model_group=config.model_group,
    )
    checker = Checker(
        world,
        message_ttl_ms=config.workload.message_ttl_ms,
        single_active=config.workload.single_active_consumer,
        retry_backoff_ms=config.workload.retry_backoff_ms,
    )
    group_checks = None
    if config.groups > 1:
        group_checks = GroupChecks(config.groups, cluster.model_group, checker.violation)
        cluster.group_checks = group_checks
    history = History(world, cluster.hosts, QUEUE)
    liveness = Liveness(cluster, checker, grace_s=config.grace_s)
    cluster.observers += [checker, history, liveness]
    stop: Callable[[], bool] = (
        (lambda: checker.violation_count > 0) if config.stop_at_violation else (lambda: False)
    )
    drained_at: int | None = None
    raft_log = _CountingHandler()
    with (
        patched_pysyncobj(world, cluster.create_journal, cluster.create_serializer),
        raft_log.attached(),
    ):
        born = genesis(world.stream("genesis"), cluster.names)
        cluster.wall_offset_ms.update(born.wall_offsets_ms)
        for name in cluster.names:
            cluster.start(name)
        liveness.start()
        _hand_leadership_over(cluster, born.handovers)
        idle = idle_queues(config.groups, config.model_group)
        declare(
            cluster,
            config.workload.queue_options(),
            first=idle[: config.model_group],
            then=idle[config.model_group :],
        )
        world.run_until(world.now_us + 30 * US, lambda: QUEUE in _queues(cluster))
        if QUEUE not in _queues(cluster):
            raise RuntimeError(f"seed {config.seed}: the queue was not declared within 30 s")
        _check_placed(cluster, world)
        clients = start_workload(cluster, checker, config.workload)
        side = None
        if config.groups > 1:
            side = SideProducer(cluster, idle, world.stream("side"))
            side.start()
        consumers = [c for c in clients if isinstance(c, SimConsumer)]
        producers = [c for c in clients if isinstance(c, SimProducer)]
        operator = Operator(cluster, world.stream("operator"))
        injector = Injector(cluster, consumers, history, operator)
        fault_phase_s = config.steps * STEP_S
        chosen = select(
            config.faults,
            disk=config.disk_faults,
            space=config.disk_space_faults,
            membership=config.membership_faults,
        )
        faults = schedule(
            world.stream("faults"),
            chosen.drawn,
            cluster.names,
            len(consumers),
            duration_s=fault_phase_s,
            mean_interval_s=config.fault_interval_s,
        )
        for kinds, stream, drawn_by in (  # each from a stream of its own, in this order
            (chosen.clock, "clock-faults", clock_schedule),
            (chosen.disk, "disk-faults", disk_schedule),
            (chosen.space, "disk-space-faults", disk_space_schedule),
        ):
            if kinds:
                faults += drawn_by(
                    world.stream(stream), cluster.names, duration_s=fault_phase_s, kinds=kinds
                )
        if chosen.membership:
            faults += membership_schedule(
                world.stream("membership-faults"),
                cluster.names,
                cluster.spares,
                duration_s=fault_phase_s,
                kinds=chosen.membership,
            )
        faults += config.scripted
        start = world.now_us
        played = [attrs.evolve(f, at_s=f.at_s + seconds(start)) for f in faults]
        injector.play(played)
        heal_at = start + micros(fault_phase_s)
        world.run_until(heal_at, stop)
        injector.heal()
        for p in producers:
            p.last_batch()
        if side is not None:
            side.heal()
        liveness.heal(
            confirm_expected=any(p.unconfirmed for p in producers),
            client_s=config.workload.request_timeout_s + config.workload.reconnect_s[1],
        )
        for c in consumers:
            c.slow = False  # slowness is a fault too: it ends with the heal
        drained = [False]

        def probe() -> None:
            if all(not p.unconfirmed for p in producers) and checker.settled_all():
                drained[0] = True
            else:
                world.after(micros(0.25), probe)

        probe()
        world.run_until(heal_at + micros(config.drain_s), lambda: drained[0] or stop())
        if drained[0]:
            drained_at = world.now_us
        if not stop():  # the leadership is watched this long at least
            world.run_until(max(world.now_us, liveness.watch_until_us()), stop)
        converged = [False]

        def converge_probe() -> None:
            replicas = _members_running(cluster)
            applied = {n.machine.last_index for n in replicas}
            sent = [n for n in operator.in_flight if operator.changing(n)]
            if (
                len(applied) == 1
                and not any(n.member.raftCommitIndex > min(applied) for n in replicas)
                and not sent  # the changes sent after the heal are made too
                and (group_checks is None or group_checks.converged(replicas))
            ):
                converged[0] = True
            else:
                world.after(micros(0.25), converge_probe)

        end = world.now_us
        converge_probe()
        world.run_until(end + micros(config.converge_s), lambda: converged[0] or stop())
        converged_after = seconds(world.now_us - end)
        windows = [(f.kind, f.at_s, f.duration_s) for f in injector.fired]
        stopped = config.stop_at_violation and checker.violation_count > 0
        counts = checker.finish(_members_running(cluster), drained[0], stopped=stopped)
        if group_checks is not None and not stopped:
            group_checks.finish(_members_running(cluster), side)
        end_state = tuple(describe_node(n) for n in cluster.running())
        members = tuple(sorted(_members(cluster)))
    return Result(
        config=config,
        sim_s=seconds(world.now_us),
        wall_s=time.perf_counter() - started,
        faults=dict(sorted(injector.injected.items())),
        skipped_faults=dict(sorted(injector.skipped.items())),
        counts=counts,
        violations=tuple(checker.violations),
        violation_count=checker.violation_count,
        trace_hash=world.trace_hash(),
        leader_changes=history.leader_changes,
        deliveries=checker.deliveries,
        redeliveries=checker.redeliveries,
        raft_messages=cluster.network.sent,
        events=world.events_run,
        drained_after_s=None if drained_at is None else seconds(drained_at - heal_at),
        schedule=tuple(played),
        fired=tuple(injector.fired),
        passed_over=tuple(injector.passed_over),
        end_state=end_state,
        raft_log=dict(sorted(raft_log.counts.items())),
        converged_after_s=converged_after,
        snapshots=dict(sorted(cluster.snapshot_counts.items())),
        wal_segments_freed=sum(
            log.segments_freed for disk in cluster.disks.values() for log in disk.wals
        ),
        membership=dict(sorted((checker.config_changes + operator.counts).items())),
        members=members,
        confirm_pauses=fault_pauses(windows, checker.confirm_times_s, seconds(heal_at)),
        delivery_pauses=fault_pauses(windows, checker.first_delivery_times_s, seconds(heal_at)),
        liveness=liveness.report(),
        longest_confirm_gap=longest_gap(checker.confirm_times_s),
        history=history,
        groups=_group_counts(group_checks, side),
    )


def _group_counts(
    checks: GroupChecks | None, side: SideProducer | None
) -> dict[str, dict[int, int]]:
    if checks is None or side is None:
        return {}
    return {
        "applied": dict(checks.applies),
        "leaderships": dict(checks.leader_changes),
        "confirmed": {
            g: len(side.confirmed[queue])
            for g, queue in zip(checks.groups, side.queues, strict=True)
        },
    }


def longest_gap(times_s: list[float]) -> tuple[float, float]:
    """The longest gap between consecutive times (seconds) and when it began."""
    gaps = [(b - a, a) for a, b in itertools.pairwise(sorted(times_s))]
    return max(gaps, default=(0.0, 0.0))


def _hand_leadership_over(cluster: Cluster, times: int) -> None:
    """Before anything is proposed: let a leader be elected, and ask it to hand over
    (Raft's TimeoutNow), `times` times. The first leaders stamp nothing."""
    world = cluster.world
    for _ in range(times):
        world.run_until(world.now_us + 30 * US, lambda: cluster.leader() is not None)
        old = cluster.leader()
        if old is None:
            return
        world.trace(f"genesis handover from {old.name}")
        deadline = world.now_us + 30 * US

        def handed_over(old: SimNode = old) -> bool:
            return (new := cluster.leader()) is not None and new is not old

        while not handed_over() and world.now_us < deadline:
            # PySyncObj denies the transfer until a follower has caught up (a leader
            # elected a moment ago has not sent its first entry yet): ask again
            if cluster.leader() is old:
                old.member.transferLeadership(None, None)
            world.run_until(min(deadline, world.now_us + micros(0.05)), handed_over)


def idle_queues(groups: int, model_group: int) -> list[str]:
    """One queue for each group but the model group, in group order: declared in that
    order around the workload's queue (`RunConfig.model_group`), each is placed in a
    group of its own (the least loaded, ties to the lowest)."""
    return [f"{QUEUE}-idle-{group}" for group in range(groups) if group != model_group]


def _check_placed(cluster: Cluster, world: World) -> None:
    """The workload's queue is in the model group (the one the observers watch), as
    the first node of group 0 to apply its placement says."""
    if cluster.groups == 1:
        return

    def placement() -> int | None:
        placed = (n.replicas[0].machine.placement(QUEUE) for n in cluster.running())
        return next((g for g in placed if g is not None), None)

    world.run_until(world.now_us + 30 * US, lambda: placement() is not None)
    group = placement()
    if group != cluster.model_group:
        raise RuntimeError(f"{QUEUE} is in group {group}, not {cluster.model_group}")


def _members(cluster: Cluster) -> set[str]:
    """The configuration the leader has (committed by the end of a run), or without a
    leader the members as the operator knows them."""
    leader = cluster.leader()
    return set(leader.replica.members()) if leader is not None else set(cluster.membership)


def _members_running(cluster: Cluster) -> list[SimNode]:
    """The running members: the replicas that must converge (a removed node is cut off)."""
    members = _members(cluster)
    return [n for n in cluster.running() if n.name in members]


def describe_node(node: SimNode) -> str:
    """One line: the node's Raft and queue state (for a failed run's report)."""
    m, machine = node.member, node.machine
    status = m.getStatus()
    line = (
        f"{node.name}#{node.incarnation}: state {status['state']} term {status['raft_term']} "
        f"leader {status['leader']} commit {status['commit_idx']} applied "
        f"{status['last_applied']} log {status['log_len']}"
    )
    if QUEUE in machine.queues():
        stats = machine.stats(QUEUE)
        line += (
            f"; {QUEUE}: ready {stats.ready} unacked {stats.unacked} consumers "
            f"{list(machine.consumers(QUEUE))} SQ {list(machine.service_queue(QUEUE))} "
            f"down {sorted(machine.down_nodes())}"
        )
    return line


def _queues(cluster: Cluster) -> Iterable[str]:
    leader = cluster.leader()
    return leader.machine.queues() if leader is not None else ()


class _CountingHandler(logging.Handler):
    """Counts PySyncObj's warnings during a run instead of printing them."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.counts: dict[str, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage().split(" from index")[0]
        self.counts[message] = self.counts.get(message, 0) + 1

    @contextlib.contextmanager
    def attached(self) -> Iterator[None]:
        names = (
            "pysyncobj",
            "quorumq.raft.journal",
            "quorumq.raft.wal",
            "quorumq.client",
            "quorumq.node",
        )
        logs = [logging.getLogger(name) for name in names]
        propagate = [log.propagate for log in logs]
        for log in logs:
            log.addHandler(self)
            log.propagate = False
        try:
            yield
        finally:
            for log, before in zip(logs, propagate, strict=True):
                log.removeHandler(self)
                log.propagate = before


@attrs.frozen(kw_only=True)
class Outcome:
    """What a sweep keeps of a run (it crosses process boundaries)."""

    seed: int
    ok: bool
    sim_s: float
    wall_s: float
    faults: int
    trace_hash: str
    summary: str
    fault_kinds: dict[str, int] = attrs.field(factory=dict)
    """Faults injected, by kind."""
    skipped: int = 0
    """Faults skipped when due (no target then)."""
    records: dict[str, int] = attrs.field(factory=dict)
    """published, confirmed, lost, duplicated, redelivered."""
    confirm_pauses: dict[str, Pauses] = attrs.field(factory=dict)
    """Per fault kind, the confirm recoveries of its faults (`pauses`)."""
    violation_kinds: dict[str, int] = attrs.field(factory=dict)
    """Violations by kind (a failing run's reasons)."""
    liveness: LivenessReport | None = None
    wal_segments_freed: int = 0
    """Write-ahead log segments the nodes removed (`--journal wal`)."""
    groups: dict[str, dict[int, int]] = attrs.field(factory=dict)
    """With groups: `Result.groups`."""
    worker_died: str | None = None
    """How the worker running this seed died (`signal 9, SIGKILL`): a failed seed
    with no result, no trace."""


def outcome(config: RunConfig) -> Outcome:
    result = run(config)
    c = result.counts
    return Outcome(
        seed=config.seed,
        ok=result.ok,
        sim_s=result.sim_s,
        wall_s=result.wall_s,
        faults=result.fault_count,
        trace_hash=result.trace_hash,
        summary=result.summary(),
        fault_kinds=dict(result.faults),
        skipped=sum(result.skipped_faults.values()),
        records={
            "published": c["published"],
            "confirmed": c["confirmed"],
            "lost": c["lost"],
            "duplicated": c["duplicated"],
            "redelivered": result.redeliveries,
        },
        confirm_pauses=dict(result.confirm_pauses),
        violation_kinds=dict(sorted(Counter(v.kind for v in result.violations).items())),
        liveness=result.liveness,
        wal_segments_freed=result.wal_segments_freed,
        groups=result.groups,
    )


def no_result(config: RunConfig, why: str, **fields: Any) -> Outcome:
    """A failing seed with no result (its worker died, its run raised): `why`, then the
    command that replays it."""
    return Outcome(
        seed=config.seed,
        ok=False,
        sim_s=0.0,
        wall_s=0.0,
        faults=0,
        trace_hash="",
        summary=f"{why}\nreplay: {config.replay_command()}",
        **fields,
    )


def died(config: RunConfig, how: str) -> Outcome:
    """The outcome of a seed whose worker died while running it (`how`)."""
    return no_result(
        config, f"worker died while running seed {config.seed} ({how}): no result", worker_died=how
    )


TEST_DIE_ON_SEED = "QUORUMQ_SIM_TEST_DIE_ON_SEED"
"""For tests only: a sweep's worker handed this seed kills itself (SIGKILL, as the OOM
killer would) instead of running it. Read in the workers alone: a sweep of one job
runs its seeds in its own process, and ignores it."""


def _worker_outcome(config: RunConfig) -> Outcome:
    if os.environ.get(TEST_DIE_ON_SEED) == str(config.seed):
        os.kill(os.getpid(), signal.SIGKILL)
    return outcome(config)


def sweep(configs: Iterable[RunConfig], jobs: int = 1) -> Generator[Outcome, None, None]:
    """Run configs, yielding outcomes in config order (in `jobs` processes, which end
    when the caller closes the generator: at the first failure, or an interrupt). A
    seed whose worker dies fails (`died`); another worker takes the next seeds."""
    if jobs <= 1:
        for config in configs:
            yield outcome(config)
        return
    with Workers(jobs, _worker_outcome, died=died) as workers:
        yield from workers.map(configs)
