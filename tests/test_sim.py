"""The deterministic simulator: its parts, determinism, negative controls, and the seed
sweep CI runs (real machine, real PySyncObj, simulated clock and network)."""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import attrs
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from pysyncobj.config import SERIALIZER_STATE

from quorumq.machine import (
    Applied,
    DeadLettered,
    Declare,
    Down,
    EnqueueBatch,
    Enqueued,
    Machine,
    Message,
    Meta,
    Tick,
)
from quorumq.machine.commands import Command
from quorumq.raft.journal import JournalDamagedError, JournalFailedError
from quorumq.raft.rules import LeaderClock, RaftRules, encode_snapshot
from quorumq.raft.wal import GroupJournal
from simulations.__main__ import main
from simulations.checker import Checker
from simulations.faults import PROFILES, kinds_of, schedule
from simulations.node import Variant
from simulations.runner import RunConfig, outcome, run
from simulations.storage import SimDisk, SimSerializer
from simulations.workload import WorkloadConfig
from simulations.world import US, World, first_micros_at

CI_SEEDS = range(200)
OPEN_FAILURES: set[int] = set()
"""Seeds of the CI sweep that fail today. Replay one with
`quorumq simulate run --seed N --steps 2400 --fault-interval 0.6 --rate 10`
(and `--compaction 30` or `100` for the seeds that compact: `CI_COMPACTION`).
The sweep test fails if this set changes either way (a new failure, or a fix).
(176 and 183 failed the liveness checks until issue 27's election rules: 176 changed
leader 3.3 s after its heal and kept doing so, a node standing for election disrupting
a working leader; in 183 C restarted empty with peers that lacked D, the leader, and
never caught up, until a refused pre-vote named the leader. 78 failed with them, until
a follower held each proposal for its unreachable leader for 15 s of its own. 24 and
155 failed until a restarted ex-leader ran the effects of the entries that replaced its
uncommitted journal tail: see `DurableJournal.replay_until`.)"""
CI_WORKLOAD = WorkloadConfig(rate=10)
CI_COMPACTION = (None, 30, None, 100)
"""Seed N compacts the log past `CI_COMPACTION[N % 4]` entries (None: never, as a real
node within 24 s): half the seeds write snapshots every few seconds, and a follower
that falls behind (crash, pause, partition) catches up by installing the leader's.
Replay one with `--compaction 30`."""


CI_TTL_MS = (None, None, 4000)
"""A third of the seeds give the queue a 4 s message TTL: records starved that long
expire (dropped, not lost), and none may expire early (`early_expiry`). The rest keep
the full liveness check (no record may sit in the queue for good)."""


def ci_config(seed: int, **changes: object) -> RunConfig:
    """What CI sweeps: 24 s of faults, one every 0.6 s on average, 10 records/s, log
    compaction on half the seeds."""
    config = RunConfig(
        seed=seed,
        steps=2400,
        fault_interval_s=0.6,
        workload=attrs.evolve(CI_WORKLOAD, message_ttl_ms=CI_TTL_MS[seed % len(CI_TTL_MS)]),
        compaction_entries=CI_COMPACTION[seed % len(CI_COMPACTION)],
    )
    return attrs.evolve(config, **changes)


def control_config(seed: int, **changes: object) -> RunConfig:
    """`ci_config` with the fault profile the negative controls' seeds were found with
    (`tcp`: the default profile before the liveness faults; no disk space faults, which
    came later and move every event after the first)."""
    return ci_config(seed, **{"faults": "tcp", "disk_space_faults": False, **changes})


# ------------------------------------------------------------------ the parts


def _disk(name: str = "A") -> SimDisk:
    return SimDisk(name, random.Random(7))


def test_a_power_loss_takes_the_journal_back_to_what_was_synced() -> None:
    """The simulated disk under the real journal: a process crash keeps every write (the
    page cache), a power loss keeps what was synced, and term and vote are synced when
    they are stored."""
    disk = _disk()
    journal = disk.open_journal()
    journal.setCurrentTerm(2, "B")
    journal.add(b"a", 1, 2)
    journal.add(b"b", 2, 2)
    journal.sync()
    journal.add(b"c", 3, 2)
    disk.crash()
    assert disk.files.read(disk.JOURNAL) is not None
    disk.power_loss()
    reopened = disk.open_journal()
    assert [e[1] for e in reopened] == [1, 2]
    assert reopened.last_index_at_open == 2
    assert (reopened.getCurrentTerm(), reopened.getVotedForNodeId()) == (2, "B")


def test_opening_after_a_crash_syncs_what_the_crashed_process_wrote() -> None:
    """A restarted node may answer for entries its crashed process wrote and never
    synced (the leader asks again for what it holds): opening syncs them first, so a
    power loss after the restart keeps them."""
    disk = _disk()
    journal = disk.open_journal()
    journal.setCurrentTerm(2, "B")
    journal.add(b"a", 1, 2)
    journal.sync()
    journal.add(b"b", 2, 2)
    disk.crash()
    assert [e[1] for e in disk.open_journal()] == [1, 2]
    disk.power_loss()
    assert [e[1] for e in disk.open_journal()] == [1, 2]


def test_a_torn_power_loss_leaves_a_tail_the_journal_cuts() -> None:
    for seed in range(40):
        disk = SimDisk("A", random.Random(seed))
        journal = disk.open_journal()
        journal.setCurrentTerm(1, None)
        for i in range(1, 4):
            journal.add(b"synced-%d" % i, i, 1)
        journal.sync()
        for i in range(4, 9):
            journal.add(b"x" * 600, i, 1)
        disk.power_loss(torn=True)
        entries = [e[1] for e in disk.open_journal()]
        assert entries[:3] == [1, 2, 3] and entries == list(range(1, len(entries) + 1))


def test_a_flipped_bit_or_a_meta_file_ahead_makes_the_journal_refuse_to_open() -> None:
    for seed in range(20):
        disk = SimDisk("A", random.Random(seed))
        journal = disk.open_journal()
        journal.setCurrentTerm(1, None)
        for i in range(1, 30):
            journal.add(b"entry-%d" % i, i, 1)
        journal.sync()
        disk.power_loss()
        assert disk.files.flip_bit(SimDisk.JOURNAL)
        with pytest.raises(JournalDamagedError):
            disk.open_journal()
    disk = _disk()
    journal = disk.open_journal()
    journal.setCurrentTerm(1, None)
    journal.add(b"a", 1, 1)
    journal.setRaftCommitIndex(1)
    journal._destroy()
    assert disk.files.set_commit_index(SimDisk.JOURNAL + ".meta", 5)
    with pytest.raises(JournalDamagedError, match="commit index 5"):
        disk.open_journal()


def test_a_short_write_or_a_failed_sync_breaks_the_journal() -> None:
    disk = _disk()
    journal = disk.open_journal()
    journal.setCurrentTerm(1, None)
    disk.files.fail_next_write()
    with pytest.raises(JournalFailedError):
        journal.add(b"half of it lands", 1, 1)
    disk.crash()
    assert len(disk.open_journal()) == 0  # the half record is a torn tail
    journal = disk.open_journal()
    journal.add(b"a", 1, 1)
    disk.files.fail_next_sync()
    with pytest.raises(JournalFailedError):
        journal.sync()
    with pytest.raises(JournalFailedError):
        journal.sync()  # never retried


def _snapshot(last: int) -> bytes:
    return encode_snapshot((b"x", last, 1), (b"x", last - 1, 1), [("A", "A")], b"machine")


def _serializer(
    disk: SimDisk, counts: Counter[str], clock: list[int] | None = None
) -> SimSerializer:
    now = clock if clock is not None else [0]
    return SimSerializer(
        disk,
        4,
        lambda data: _snapshot(data[0][1]),
        lambda b: b,
        counts,
        now_ms=lambda: now[0],
        write_ms=lambda: 100,
    )


def test_a_snapshot_is_stored_when_its_write_ends_and_survives_a_crash() -> None:
    disk, counts, clock = _disk(), Counter[str](), [0]
    serializer = _serializer(disk, counts, clock)
    assert serializer.checkSerializing() == (SERIALIZER_STATE.NOT_SERIALIZING, None)
    serializer.serialize((None, (b"x", 9, 1), (b"x", 8, 1), set()), 8)
    clock[0] = 99
    assert serializer.checkSerializing() == (SERIALIZER_STATE.SERIALIZING, 8)
    assert disk.snapshot is None  # not before the write ends
    clock[0] = 100
    assert serializer.checkSerializing() == (SERIALIZER_STATE.SUCCESS, 8)
    disk.power_loss()
    assert disk.snapshot == _snapshot(9)
    assert counts["written"] == 1


def test_a_snapshot_write_a_leader_snapshot_overtakes_is_dropped() -> None:
    disk, counts, clock = _disk(), Counter[str](), [0]
    serializer = _serializer(disk, counts, clock)
    serializer.serialize((None, (b"x", 9, 1), (b"x", 8, 1), set()), 8)
    assert serializer.setTransmissionData((_snapshot(30), True, True))
    clock[0] = 1000
    assert serializer.checkSerializing() == (SERIALIZER_STATE.NOT_SERIALIZING, None)
    assert disk.snapshot == _snapshot(30)
    assert counts["write dropped"] == 1


def test_a_snapshot_goes_to_a_follower_in_chunks_and_is_kept_only_if_accepted() -> None:
    counts: Counter[str] = Counter()
    leader, follower = _disk("A"), _disk("B")
    leader.snapshot = _snapshot(9)
    sending, receiving = _serializer(leader, counts), _serializer(follower, counts)
    offered: list[bytes] = []

    def refuse(data: bytes) -> bool:
        offered.append(data)
        return False

    def transfer() -> bool:
        while True:
            chunk = sending.getTransmissionData("B")
            assert chunk is not None
            if receiving.setTransmissionData(chunk):
                return True
            if chunk[2]:
                return False

    receiving.accept = refuse
    assert not transfer()  # refused (stale): the follower keeps what it had
    assert follower.snapshot is None
    receiving.accept = lambda data: True
    assert transfer()
    assert follower.snapshot == leader.snapshot
    assert offered == [leader.snapshot]  # whole, from the chunks
    assert (counts["sent"], counts["refused"], counts["installed"]) == (2, 1, 1)


def test_world_runs_events_in_time_then_scheduling_order() -> None:
    world = World(1)
    seen: list[str] = []
    world.at(20, seen.append, "late")
    world.at(10, seen.append, "first")
    world.at(10, seen.append, "second")
    world.run_until(15)
    assert seen == ["first", "second"]
    assert world.now_us == 15
    world.run_until(30)
    assert seen == ["first", "second", "late"]


@given(
    st.one_of(
        st.floats(0, 1e6, allow_nan=False),
        st.tuples(st.integers(0, 10**11), st.floats(0, 100)).map(lambda t: t[0] / US + t[1]),
        # a microsecond and the next float up: 4.2964780000000005 s, seed 125's
        st.integers(0, 10**9).map(lambda us: math.nextafter(us / US, math.inf)),
    )
)
@example(4.2964780000000005)
def test_a_timer_is_run_at_the_first_microsecond_the_clock_reads_its_time(when_s: float) -> None:
    """The node core's timers are in seconds (floats); `ceil(when_s * US)` alone once
    rounded down, and a node ran its due timers at the same instant for ever (seed 125)."""
    when = first_micros_at(when_s)
    assert when / US >= when_s
    assert when == 0 or (when - 1) / US < when_s


def test_random_streams_depend_only_on_seed_and_name() -> None:
    a, b = World(5), World(5)
    assert a.stream("x").random() == b.stream("x").random()
    assert a.stream("x").random() != a.stream("y").random()


def test_fault_schedule_is_data_drawn_from_the_seed() -> None:
    names = ["A", "B", "C"]
    one = schedule(World(3).stream("faults"), PROFILES["default"], names, 4, duration_s=30)
    two = schedule(World(3).stream("faults"), PROFILES["default"], names, 4, duration_s=30)
    assert one == two
    assert len(one) >= 10
    assert {f.kind for f in one} <= set(PROFILES["default"])
    assert [f.at_s for f in one] == sorted(f.at_s for f in one)


def test_fault_kinds_can_be_listed() -> None:
    assert kinds_of("crash,pause") == ("crash", "pause")
    with pytest.raises(ValueError, match="unknown fault kinds"):
        kinds_of("meteor")


# ------------------------------------------------------------------- runs


def test_a_run_without_faults_delivers_and_acks_every_record() -> None:
    result = run(ci_config(1, faults="none", steps=500))
    assert result.ok, result.summary()
    assert result.counts["published"] > 30  # about 50: 10 records/s for 5 s
    assert result.counts["acked"] == result.counts["confirmed"] == result.counts["published"]
    assert result.counts["lost"] == result.counts["duplicated"] == 0
    assert result.deliveries >= result.counts["published"]


def test_a_run_with_faults_injects_them_and_passes() -> None:
    result = run(ci_config(3))
    assert result.ok, result.summary()
    assert result.fault_count >= 20
    assert result.leader_changes >= 2
    assert result.drained_after_s is not None


def test_the_followers_of_a_killed_leader_elect_at_once() -> None:
    """A follower whose connection to its leader closes elects after two heartbeat
    periods without one, taking turns with the other followers
    (`RaftRules._SyncObj__onNodeDisconnected`), instead of waiting out an election
    timeout of 0.25-0.6 s; and followers keep their connections to one another open
    (`keep_peer_connections_alive`: PySyncObj closed an idle one at the first vote
    request, and the simulated network now does too). Confirms and deliveries paused
    p50 0.55 s per kill before; with either change undone this test fails."""
    result = run(
        RunConfig(
            seed=1,
            nodes=5,
            faults="kill_leader",
            fault_interval_s=5.0,
            steps=3000,
            disk_faults=False,
            membership_faults=False,
            workload=WorkloadConfig(rate=150),
        )
    )
    assert result.ok, result.summary()
    kills = result.confirm_pauses["kill_leader"]
    assert kills.count >= 3
    assert kills.max < 0.3, result.summary()
    assert result.delivery_pauses["kill_leader"].max < 0.3, result.summary()


def test_cli_run_prints_the_summary_and_renders(
    tmp_path: object, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # (where it records the run)
    out = os.path.join(str(tmp_path), "timeline.html")
    code = main(["run", "--seed", "2", "--steps", "300", "--rate", "20", "--render", out])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "seed 2: 3 nodes" in printed and "verdict: PASS" in printed
    with open(out) as f:
        page = f.read()
    assert "<svg" in page and "Service queue" in page


def test_cli_scenario_replays_the_rabbitmq_post(
    tmp_path: object, capsys: pytest.CaptureFixture[str]
) -> None:
    out = os.path.join(str(tmp_path), "post.html")
    assert main(["scenario", "rabbitmq-post", "--render", out]) == 0
    printed = capsys.readouterr().out
    assert "m1->c1" in printed and "alternate" in printed
    with open(out) as f:
        assert "sends m3" in f.read()


# ------------------------------------------------------------- determinism

_TRACE_SNIPPET = (
    "from simulations.runner import run;"
    "from tests.test_sim import ci_config, control_config;"
    "a = run(control_config(11, steps=1200, compaction_entries=None));"
    "b = run(control_config(0, steps=1200, compaction_entries=30));"
    "c = run(ci_config(34, steps=1200, faults='liveness', compaction_entries=None));"
    "print(a.trace_hash, a.ok, b.trace_hash, b.ok, b.snapshots['installed'], c.trace_hash)"
)
"""The runs of the test below, in another process (the same configurations: a copy of
them drifted once, when the controls' configuration changed)."""


@pytest.mark.slow
def test_same_seed_same_trace_across_processes_and_hash_seeds() -> None:
    """Seed 0 with compaction writes, sends, installs and refuses snapshots (found with
    the `tcp` profile; seed 22 before pre-vote, 52 before quiescence); seed 34 stalls,
    pauses mid-tick, delays and isolates nodes."""
    hashes = set()
    for hash_seed in ("0", "1", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        done = subprocess.run(
            [sys.executable, "-c", _TRACE_SNIPPET],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=300,
        )
        hashes.add(done.stdout.strip())
    a = run(control_config(11, steps=1200, compaction_entries=None))
    b = run(control_config(0, steps=1200, compaction_entries=30))
    c = run(ci_config(34, steps=1200, faults="liveness", compaction_entries=None))
    assert b.snapshots["installed"] >= 2 and b.snapshots["refused"] >= 1
    assert {"slow_host", "pause_mid_tick", "one_way_delay", "lone_candidate"} <= set(c.faults)
    expected = (
        f"{a.trace_hash} {a.ok} {b.trace_hash} {b.ok} {b.snapshots['installed']} {c.trace_hash}"
    )
    assert hashes == {expected}


def test_different_seeds_give_different_runs() -> None:
    a = run(ci_config(21, steps=300))
    b = run(ci_config(22, steps=300))
    assert a.trace_hash != b.trace_hash


# -------------------------------------------------------- negative controls


class DownKeepsMessages(Machine):
    """Broken on purpose: `Down` does nothing, so a dead consumer keeps what it holds."""

    def apply(self, meta: Meta, command: Command) -> Applied:
        if isinstance(command, Down):
            command = Tick()
        return super().apply(meta, command)


def deliver_everywhere(effects: tuple[object, ...], node: str, **_: object) -> tuple[object, ...]:
    """Broken on purpose: every replica sends every delivery, local consumer or not."""
    return effects


def _first_failure(variant: Variant, seeds: range) -> tuple[int, set[str]] | None:
    for seed in seeds:
        result = run(ci_config(seed, variant=variant))
        if not result.ok:
            return seed, {v.kind for v in result.violations}
    return None


def test_negative_control_down_that_keeps_messages_is_caught() -> None:
    broken = Variant(name="down-keeps-messages", machine=DownKeepsMessages)
    found = _first_failure(broken, range(3))
    assert found is not None, "the checker missed a Down that returns nothing"
    assert found[1] & {"unsettled", "liveness", "lost"}


def test_negative_control_delivering_to_non_local_consumers_is_caught() -> None:
    broken = Variant(name="deliver-everywhere", effect_filter=deliver_everywhere)
    found = _first_failure(broken, range(3))
    assert found is not None, "the checker missed replicas delivering to remote consumers"
    # The node core downs a consumer it does not serve that it is asked to deliver to:
    # every node downs every other node's consumers, and their records go round.
    assert found[1] & {"duplicated", "lost", "unsettled", "liveness"}


# ------------------------------------------- the node core's fixes (negative controls)
# Each breaks one fix of the real node core, replica or journal, as it was before, and
# a seed of the CI sweep that catches it must fail; the real thing passes. The
# simulator runs the node's own code (`NodeCore`, `Replica`, `RaftRules`,
# `DurableJournal`, `ClientSession`), so the patch is to the code a real node runs.
# A change that shifts the runs (say, a longer frame) can move which seeds catch a
# control: find them again by running the patched code over the first 100 CI seeds.
# The seeds were found with the `tcp` fault profile (the default one before issue 27
# added the liveness faults): `control_config` keeps it.


def _kinds(config: RunConfig) -> set[str]:
    return {v.kind for v in run(config).violations}


def test_consumers_served_nowhere_must_be_downed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the node core's sweep (`Serving._down_lost_consumers`), a consumer whose
    node restarted within the grace period, or whose `Down` was lost with a leader,
    keeps its messages for good (seed 1; 17 of the first 40 seeds). Only that rule is
    off (`Serving.down_lost_consumers`): the sweep still forgets removed consumers."""
    from quorumq.node.serving import Serving

    assert run(control_config(1)).ok
    monkeypatch.setattr(Serving, "down_lost_consumers", False)
    assert _kinds(control_config(1)) & {"unsettled", "lost", "liveness"}


def test_an_ack_lost_to_a_leader_change_is_proposed_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An ack or nack whose proposal failed (leader change, timeout) is proposed again
    by the node core: without it the consumer's messages stay held. Only that rule is
    off (`Settling.retry_lost_settles`); its control once also turned off the resettle
    of a batch refused whole, and its seed caught that instead (seeds 5, 11 and 29 of
    0-29 catch the retry alone)."""
    from quorumq.node.settling import Settling

    assert run(control_config(5)).ok
    monkeypatch.setattr(Settling, "retry_lost_settles", False)
    assert _kinds(control_config(5)) & {"unsettled", "liveness"}


def test_a_gathered_ack_refused_for_one_offset_is_settled_again_for_the_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by the simulator once it gathered acks as a node does: an `Ack` of two
    offsets, one of them returned by the consumer's own nack of an earlier message of
    its key, is refused whole (`not_held`); the node core must settle the other offset
    again, or it stays held. Only that rule is off (`Settling.resettle_refused_batches`;
    seed 8, the first of 0-8 since quiescence; seeds 0, 2 and 6 of 0-6 before)."""
    from quorumq.node.settling import Settling

    assert run(control_config(8)).ok
    monkeypatch.setattr(Settling, "resettle_refused_batches", False)
    assert _kinds(control_config(8)) & {"unsettled", "liveness"}


def test_an_ack_that_drops_an_offset_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checker's own sensitivity: a node core that loses the last offset of an ack
    batch leaves a record unsettled (seeds 1, 2 and 3 of the first 4)."""
    from quorumq.machine import Ack
    from quorumq.node.settling import Settling

    real = Settling.settle

    def settle(
        self: Settling,
        command: object,
        conn: object,
        attempt: int = 1,
        answered: Callable[[], None] | None = None,
    ) -> None:
        if isinstance(command, Ack) and len(command.offsets) > 1 and attempt == 1:
            command = attrs.evolve(command, offsets=command.offsets[:-1])
        real(self, command, conn, attempt, answered)  # type: ignore[arg-type]

    monkeypatch.setattr(Settling, "settle", settle)
    assert _kinds(control_config(1)) & {"unsettled", "liveness"}


def test_a_restarted_ex_leader_runs_the_effects_of_what_replaced_its_tail(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A restarted ex-leader whose uncommitted journal tail was replaced must run the
    effects of the entries that replaced it (`DurableJournal.replay_until`); counting
    every entry on disk at start-up as replayed strands them. Rare: seed 358 of the CI
    sweep was the only one of its first 359, and with pre-vote making leader changes
    rarer none of seeds 358-657 is; so this control runs kills, crashes, partitions and
    pauses at 60 records/s, where seed 377 catches it (the first of 0-377 since
    quiescence; 72 and 114 before)."""
    from quorumq.raft.journal import DurableJournal

    config = _hot(377)
    _before_the_learner_stage(monkeypatch)
    assert run(config).ok
    monkeypatch.setattr(
        DurableJournal, "replay_until", property(lambda self: self.last_index_at_open)
    )
    assert _kinds(config) & {"unsettled", "lost", "liveness"}


def _before_the_learner_stage(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rare controls' seeds were found before adds went through a learner stage,
    which moved every later event of a run with an add. What they guard does not
    depend on how a node is added, so they run with adds as they were (the leader
    adds at once)."""
    monkeypatch.setattr(RaftRules, "learner_stage", False)


def _hot(seed: int) -> RunConfig:
    """Leaders killed, nodes crashed, partitioned and paused, 60 records/s: where the
    rare controls' cases are less rare (with the clock, disk and membership faults a
    list of kinds ran with them before it ran only the kinds it names)."""
    return ci_config(
        seed,
        faults="kill_leader,crash,partition,pause,clock,disk,membership",
        workload=WorkloadConfig(rate=60),
        disk_space_faults=False,  # (found before them: see `control_config`)
    )


def test_a_node_that_installs_a_snapshot_must_send_what_it_skipped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without the resync after a snapshot install (`Serving.state_replaced`), a
    consumer on a follower that caught up from the leader's snapshot holds messages it
    was never sent (seed 45, the first of 0-45 since quiescence; 41 and 45 since pre-vote;
    seed 253, the only one of the first 500, before it: rare since snapshot writes take
    up to 2 s of simulated time, and it moves whenever Raft's timing does)."""
    from quorumq.node.serving import Serving

    assert run(control_config(45)).ok
    monkeypatch.setattr(Serving, "resync_after_snapshot", False)
    assert _kinds(control_config(45)) & {"lost", "liveness", "unsettled"}


def test_a_proposal_pysyncobj_never_answers_must_time_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A command proposed by an ex-leader whose entry a snapshot install then skipped is
    never answered by PySyncObj: without the replica's timeout (`InFlight.expire`)
    nobody proposes it again, and what it settles stays held. The ex-leader now answers
    such proposals itself once it installs the snapshot
    (`Receiving._answer_cut_proposals`, off here too): the timeout is the backstop of
    whatever else PySyncObj leaves unanswered. Rare, and it moves whenever Raft's timing
    does: seed 265 of the hot runs (`_hot`), the first of 0-265 since quiescence; seed
    25 of the CI configuration since pre-vote; seed 239, the only one of the first 240,
    before it."""
    from quorumq.raft.receiving import Receiving
    from quorumq.replica import InFlight

    _before_the_learner_stage(monkeypatch)
    assert run(_hot(265)).ok
    monkeypatch.setattr(InFlight, "expire", lambda self, now, error: None)
    monkeypatch.setattr(Receiving, "_answer_cut_proposals", lambda self: None)
    assert _kinds(_hot(265)) & {"lost", "unsettled", "liveness"}


def test_a_deposed_leader_answers_its_proposals_a_snapshot_skipped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """CI seed 169: an operator's removal of B, appended by A as leader of term 4 just
    before the heal, is skipped when A installs B's snapshot. PySyncObj never answers
    it, nor does the replica's timeout (membership changes have none): the operator
    waited 27 s, and B handed leadership over 28 s after the heal (`heal_leaders`).
    A now answers it at the install, "outcome unknown" (`_answer_cut_proposals`)."""
    from quorumq.raft.receiving import Receiving

    assert run(ci_config(169)).ok
    monkeypatch.setattr(Receiving, "_answer_cut_proposals", lambda self: None)
    assert "heal_leaders" in _kinds(ci_config(169))


def test_a_follower_must_refuse_a_leader_snapshot_older_than_what_it_applied(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without the refusal (`RaftRules.accept_leader_snapshot`) a follower goes back to
    an older state (seed 3, the first of 0-3 since quiescence; seeds 1 and 3 since
    pre-vote; seeds 21, 45 and 53 of the first 54 before it)."""
    assert run(control_config(3)).ok
    monkeypatch.setattr(RaftRules, "accept_leader_snapshot", lambda self, index, term: True)
    assert "rollback" in _kinds(control_config(3))


def test_a_retry_delay_the_machine_does_not_keep_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the queue's retry backoff (`--retry-backoff 100:2000`) and consumers that
    also nack with delays of their own, every redelivery waits its delay through the
    faults (seed 0: 115 held to one); a machine that returns a message at once is
    caught by the checker (`retry_early`, seed 0)."""
    from quorumq.machine.queue import QueueState

    config = control_config(0, workload=attrs.evolve(CI_WORKLOAD, retry_backoff_ms=(100, 2000)))
    result = run(config)
    assert result.ok, result.summary()
    assert result.counts["retries_held"] > 20
    monkeypatch.setattr(QueueState, "_wait", lambda _self, _off, _due: None)
    assert "retry_early" in _kinds(config)


def test_seeds_that_once_lost_an_overtaken_first_batch_pass() -> None:
    """Seeds 215, 315 and 382 (no compaction) lost confirmed records: a producer's
    second batch reached the log before its first, the queue took it as the producer's
    start, and the first was confirmed as a duplicate, never enqueued. Raft's timing
    has moved since: these seeds no longer reach the machine's first-seq rule (they
    pass with it removed), so they are only runs that once failed. The rule's own
    regression test, red without it, is
    tests/test_machine.py::test_a_new_producer_starts_at_seq_0_so_its_first_batch_cannot_be_overtaken."""
    for seed in (215, 315, 382):
        outcome = run(control_config(seed, compaction_entries=None))
        assert outcome.ok, outcome.summary


def test_queue_time_from_an_unclamped_wall_clock_is_caught_by_the_clock_faults(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every run skews and jumps the hosts' wall clocks. With the leader stamping its
    raw wall clock (no anchor, no bound), seed 2's queue time runs days ahead
    (`time_ahead`: TTLs expire early, producers are forgotten); the real clock passes."""
    assert run(control_config(2)).ok
    monkeypatch.setattr(LeaderClock, "now", lambda self, term: max(0, self.wall_ms()))
    assert "time_ahead" in _kinds(control_config(2))


def test_a_leader_that_anchored_at_its_wrong_wall_clock_and_leads_again_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Seed 18 starts with skewed wall clocks and hands leadership over before anything
    is proposed (`Genesis`). With `take_over` keeping the node's earlier anchor (its
    wall clock, from a term in which it stamped nothing), the node moves queue time by
    its skew when it leads again (`time_ahead`; found by a real-process test, CI); the
    real clock passes. Seeds 88, 173 and 182 of the first 200 catch it too."""
    assert run(control_config(18)).ok

    def keeps_its_earlier_anchor(self: LeaderClock, term: int, replicated_ms: int) -> None:
        base = replicated_ms if replicated_ms > 0 else max(0, self.wall_ms())
        self._last = max(self._last, base) if replicated_ms > 0 else base
        self._anchor = (term, self._last, self.monotonic())

    monkeypatch.setattr(LeaderClock, "take_over", keeps_its_earlier_anchor)
    assert "time_ahead" in _kinds(control_config(18))


def test_a_journal_that_cuts_at_damage_instead_of_refusing_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The journal as it was: a bad record anywhere (a flipped bit), or a log shorter
    than the stored commit index (a meta file ahead), was cut silently. The node then
    voted as if its log were short, and a lagging candidate overwrote committed entries:
    seeds 20 and 32 apply another command at a committed index (`log`; seeds 160 and
    212 before pre-vote). With the real journal the damaged node refuses to start."""
    from quorumq.raft.journal import DurableJournal

    assert run(control_config(20)).ok and run(control_config(32)).ok
    monkeypatch.setattr(DurableJournal, "_check_cut", lambda self, data, pos: None)
    monkeypatch.setattr(DurableJournal, "_check_commit_index", lambda self: None)
    assert "log" in _kinds(control_config(20))
    assert "log" in _kinds(control_config(32))


def test_a_leader_clock_that_follows_its_wall_clock_within_a_bound_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The leader clock as it was: the monotonic time since take-over, pulled toward the
    wall clock by up to a second. A node days ahead gained a second per term it led;
    seed 7 catches it since pre-vote (`time_ahead`; seed 4 before it)."""
    assert run(control_config(7)).ok

    def follows_the_wall_clock(self: LeaderClock, term: int) -> int | None:
        anchor = self._anchor
        if anchor is None or anchor[0] != term:
            return None
        expected = anchor[1] + round((self.monotonic() - anchor[2]) * 1000)
        ts = min(max(self.wall_ms(), expected - 1000), expected + 1000)
        self._last = ts = max(ts, self._last)
        self.seen(ts)
        return ts

    monkeypatch.setattr(LeaderClock, "now", follows_the_wall_clock)
    assert "time_ahead" in _kinds(control_config(7))


def test_entries_stamped_when_proposed_expire_early(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stamped when proposed (any thread) rather than when appended: an entry proposed
    before a new leader took the time over stayed unstamped and took the machine's time
    of an earlier entry, seconds old; its TTL, counted from there, ran out seconds early
    (seed 2, whose queue has a 4 s TTL: `early_expiry`; 11 of the first 90 seeds)."""
    from pysyncobj import SyncObj

    from quorumq.codec import stamp_entry
    from quorumq.raft.rules import RAW_COMMAND

    assert run(control_config(2)).ok

    def stamp_when_proposed(
        self: RaftRules, command: bytes, callback: object, kind: object = None
    ) -> None:
        clock = self.leader_clock
        if clock is not None and kind == RAW_COMMAND and self._isLeader():
            ts = clock.now(self.raftCurrentTerm)
            if ts is not None:
                command = stamp_entry(command, ts)
        SyncObj._applyCommand(self, command, callback, kind)

    monkeypatch.setattr(
        RaftRules, "use_leader_clock", lambda self, clock: setattr(self, "leader_clock", clock)
    )
    monkeypatch.setattr(RaftRules, "_stamp_taken_command", lambda self, command: command)
    monkeypatch.setattr(RaftRules, "_applyCommand", stamp_when_proposed)
    assert "early_expiry" in _kinds(control_config(2))


# ------------------------------------------------------------------- CI sweep


QUEUE_OPTION_RUNS = {
    "dead_letter": ({"delivery_limit": 1, "dead_letter": True}, "dead_lettered"),
    "max_length": ({"max_length": 3}, "dropped"),
    "reject_publish": ({"max_length": 3, "overflow": "reject-publish"}, "refused"),
    "consumer_timeout": ({"consumer_timeout_ms": 500}, "consumers_timed_out"),
    "single_active_consumer": ({"single_active_consumer": True}, None),
}


def _with_queue_options(seed: int, options: dict[str, object], **changes: object) -> RunConfig:
    config = ci_config(seed, **changes)
    return attrs.evolve(config, workload=attrs.evolve(config.workload, **options))


@pytest.mark.parametrize("name", sorted(QUEUE_OPTION_RUNS))
def test_a_run_with_queue_options_passes_and_the_options_act(name: str) -> None:
    """`quorumq simulate --delivery-limit/--dead-letter/--max-length/--overflow/
    --consumer-timeout/--single-active-consumer` under CI's faults: what the queue's
    options drop, dead-letter or refuse is counted, never lost, and they do act.
    (reject-publish with max_length 3 and batches of up to 5 found two client stalls:
    a resend refused by a full queue waited for a reconnect that never came, and a
    batch that can never fit was "full for now" for ever.)"""
    options, count = QUEUE_OPTION_RUNS[name]
    result = run(_with_queue_options(1, options))
    assert result.ok, result.summary()
    assert count is None or result.counts[count] > 0, result.summary()


class _IgnoresSingleActiveConsumer(Machine):
    """A machine that declares every queue without single active consumer."""

    def apply(self, meta: Meta, command: Command) -> Applied:
        if isinstance(command, Declare):
            options = attrs.evolve(command.options, single_active_consumer=False)
            command = attrs.evolve(command, options=options)
        return super().apply(meta, command)


def test_a_queue_that_ignores_single_active_consumer_is_caught() -> None:
    options = QUEUE_OPTION_RUNS["single_active_consumer"][0]
    variant = Variant(name="ignores-sac", machine=_IgnoresSingleActiveConsumer)
    result = run(_with_queue_options(1, options, variant=variant))
    assert "single_active" in {v.kind for v in result.violations}, result.summary()


class _DeadLettersNowhere(Machine):
    """Says it dead-lettered a message, and puts it nowhere."""

    def _dead_letter(self, q: Any, msg: Any, reason: str, dead_letter: bool, effects: Any) -> Any:
        target = q.options.dead_letter_queue
        if not dead_letter or target is None:
            return super()._dead_letter(q, msg, reason, dead_letter, effects)
        effects.append(
            DeadLettered(
                queue=q.name, offset=msg[0], reason=reason, target_queue=target, target_offset=0
            )
        )
        return None


def test_a_queue_that_dead_letters_into_nothing_is_caught() -> None:
    """The checker does not take `DeadLettered` on trust: the record must be in the
    dead-letter queue at the offset the effect names (a hostile review's variant passed
    with 8 confirmed records never received, counted as dead-lettered)."""
    options = QUEUE_OPTION_RUNS["dead_letter"][0]
    variant = Variant(name="dead-letters-nowhere", machine=_DeadLettersNowhere)
    result = run(_with_queue_options(1, options, variant=variant))
    assert "dead_letter" in {v.kind for v in result.violations}, result.summary()


def test_a_refused_record_that_lands_is_a_phantom_even_if_nobody_receives_it() -> None:
    """Told "not published", landed, then dropped before any delivery: flagged when the
    log takes it, in either order of the refusal and the landing."""
    for refused_first in (True, False):
        checker = Checker(World(1))
        checker.published(b"p0:0", None)
        if refused_first:
            checker.refused(b"p0:0", "queue_full", expected=True)
        batch = EnqueueBatch(queue="orders", messages=[Message(body=b"p0:0")])
        checker._model(batch, Applied(Enqueued(offset=0, count=1), ()), 0)
        if not refused_first:
            checker.refused(b"p0:0", "queue_full", expected=True)
        assert [v.kind for v in checker.violations] == ["phantom"]


IDLE_SEEDS = range(40)
IDLE_BURSTS = (3.0, 6.0)
"""The idle sweep's producers publish 3 s, then rest 6 s, in turn: a third of the time
the cluster is busy, and from about 1.5 s into each rest it is quiet (`quiescence`)."""


def idle_config(seed: int) -> RunConfig:
    """`ci_config` with producers that rest (`IDLE_BURSTS`): faults strike quiet clusters
    too, where the leader heartbeats every 0.5 s and followers wait that much longer."""
    workload = attrs.evolve(ci_config(seed).workload, bursts=IDLE_BURSTS)
    return ci_config(seed, workload=workload)


@pytest.mark.slow
def test_idle_sweep_faults_on_quiet_clusters_every_seed_passes() -> None:
    """Every check, the liveness bounds among them, on clusters that go quiet between
    bursts: a lost leader, a partition or a pause must be noticed and healed as on a
    busy one, within the bounds the liveness checks hold every run to."""
    with ProcessPoolExecutor(2) as pool:
        outcomes = list(pool.map(outcome, [idle_config(s) for s in IDLE_SEEDS]))
    failed = [o for o in outcomes if not o.ok]
    assert not failed, "\n\n".join(o.summary for o in failed[:3])
    assert min(o.faults for o in outcomes) >= 20


@pytest.mark.slow
def test_ci_sweep_every_seed_passes_with_at_least_20_faults() -> None:
    with ProcessPoolExecutor(2) as pool:
        outcomes = list(pool.map(outcome, [ci_config(s) for s in CI_SEEDS]))
    failed = [o for o in outcomes if not o.ok]
    new = [o for o in failed if o.seed not in OPEN_FAILURES]
    assert not new, "\n\n".join(o.summary for o in new[:3])
    assert {o.seed for o in failed} == OPEN_FAILURES, "an open failure passes now: update it"
    assert min(o.faults for o in outcomes) >= 20


WAL_SEEDS = range(40)


@pytest.mark.slow
def test_wal_sweep_every_seed_passes_under_the_disk_faults() -> None:
    """Issue 33's write-ahead log, one group in it, as every node's journal: the CI
    sweep's checks (no confirmed record lost or duplicated, order, bounded recovery)
    under the same faults, the disk's among them (torn power loss, short write, failed
    sync, flipped bit, a meta file ahead), with log compaction on every seed and 8 KiB
    segments, so that segments are freed (in at least half the seeds) and snapshots
    installed."""
    configs = [ci_config(s, journal="wal", compaction_entries=(30, 100)[s % 2]) for s in WAL_SEEDS]
    with ProcessPoolExecutor(2) as pool:
        outcomes = list(pool.map(outcome, configs))
    failed = [o for o in outcomes if not o.ok]
    assert not failed, "\n\n".join(o.summary for o in failed[:3])
    kinds: Counter[str] = Counter()
    for o in outcomes:
        kinds.update(o.fault_kinds)
    # the simulated disks' segments are small: runs roll over and free them
    assert sum(o.wal_segments_freed > 0 for o in outcomes) >= len(outcomes) // 2
    for kind in ("torn_power_loss", "short_write", "sync_failure", "bit_flip", "meta_ahead"):
        assert kinds[kind] >= 3, (kind, kinds)


def test_a_node_on_the_wal_keeps_its_journal_in_segments() -> None:
    """`journal="wal"` runs the real write-ahead log: a disk holds its segments and
    group 0's meta file, no journal file of its own, and a run replays with it."""
    disk = SimDisk("A", random.Random(3), wal=True)
    journal = disk.open_journal()
    assert isinstance(journal, GroupJournal) and journal.group == 0
    journal.setCurrentTerm(1, None)
    journal.add(b"x", 1, 1)
    journal.sync()
    assert disk.files.read(disk.meta_path) is not None
    assert disk.journal_data_path() == "/wal/wal-0000000001.log"
    assert disk.files.read(SimDisk.JOURNAL) is None
    result = run(ci_config(8, journal="wal", steps=600, compaction_entries=30))
    assert not result.violations, result.violations
    assert "--journal wal" in result.config.replay_command()
