"""`quorumq simulate` (`python -m simulations`) as a user runs it: interrupting a sweep,
fault kinds and switches from flags and setup files, the summary's counts, replay, the
timeline (issue 31)."""

from __future__ import annotations

import contextlib
import html
import json
import multiprocessing
import multiprocessing.util
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import attrs
import pytest

from simulations.__main__ import config_of, main
from simulations.faults import (
    CLOCK_KINDS,
    HOSTILE_KINDS,
    KINDS,
    PROFILES,
    Fault,
    Selection,
    kinds_of,
    select,
)
from simulations.render import fault_text
from simulations.runner import RunConfig
from simulations.workers import WorkerError, Workers
from simulations.workload import WorkloadConfig
from tests.helpers import wait_for

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where runs record their options for `replay`: a cache of the test's own."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "quorumq" / "simulate"


# ------------------------------------------------------------- interrupting a sweep


PROC = Path("/proc")


def _start_time(pid: int) -> int | None:
    """The process's start time (clock ticks after boot), None if it is gone or a
    zombie: a pid with another start time is another process."""
    try:
        fields = (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else int(fields[19])


def _children(pid: int) -> dict[int, int]:
    """The live children of `pid`, with their start times. A kernel built without
    CONFIG_PROC_CHILDREN lists none (no /proc/PID/task/TID/children): the test skips,
    saying so, rather than waiting for children it can never see."""
    own = PROC / str(os.getpid()) / "task" / str(os.getpid()) / "children"
    if not own.exists():
        pytest.skip(f"no {own}: this kernel lists no children (no CONFIG_PROC_CHILDREN)")
    found: dict[int, int] = {}
    try:
        threads = os.listdir(PROC / str(pid) / "task")
    except OSError:
        return found
    for thread in threads:
        try:
            pids = [
                int(p) for p in (PROC / str(pid) / "task" / thread / "children").read_text().split()
            ]
        except OSError:  # the thread ended
            continue
        for child in pids:
            started = _start_time(child)
            if started is not None:
                found[child] = started
    return found


def _alive(processes: dict[int, int]) -> list[int]:
    return [pid for pid, started in processes.items() if _start_time(pid) == started]


def test_a_kernel_that_lists_no_children_skips_the_tests_that_wait_for_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without CONFIG_PROC_CHILDREN there is no /proc/PID/task/TID/children: the tests
    that wait for a sweep's workers saw none and failed after 60 s; they skip, saying
    why (red before, checked: `_children` found nothing and raised nothing)."""
    (tmp_path / str(os.getpid()) / "task" / str(os.getpid())).mkdir(parents=True)
    monkeypatch.setattr(f"{__name__}.PROC", tmp_path)
    with pytest.raises(pytest.skip.Exception, match="no CONFIG_PROC_CHILDREN"):
        _children(os.getpid())


class _Sweep:
    """A `simulate sweep` subprocess, its workers once they run; `stop()` ends whatever
    of them is left (by pid, checked by start time)."""

    def __init__(self, *args: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "simulations", "sweep", *args],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.workers: dict[int, int] = {}

    def wait_for_workers(self, jobs: int) -> dict[int, int]:
        def running() -> bool:
            self.workers = _children(self.process.pid)
            return len(self.workers) >= jobs or self.process.poll() is not None

        wait_for(running, "the sweep's workers", timeout=60)
        assert self.process.poll() is None, self.process.communicate()
        return self.workers

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        for pid in _alive(self.workers):
            os.kill(pid, signal.SIGKILL)
        self.process.communicate()  # (the workers hold its output's pipes too)


@pytest.fixture
def sweep() -> Iterator[Callable[..., _Sweep]]:
    """Starts sweeps; stops what is left of them after the test."""
    started: list[_Sweep] = []

    def start(*args: str) -> _Sweep:
        started.append(_Sweep(*args))
        return started[-1]

    yield start
    for one in started:
        one.stop()


def _ended(process: subprocess.Popen[str], within_s: float) -> tuple[str, str]:
    began = time.monotonic()
    out, err = process.communicate(timeout=within_s)
    assert time.monotonic() - began < within_s
    return out, err


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ctrl_c_stops_a_sweep_and_its_workers_and_says_how_far_it_got(
    sweep: Callable[..., _Sweep],
) -> None:
    """A terminal's Ctrl-C (SIGINT to the sweep and to each of its workers, the
    foreground group): one line, exit status 130 within seconds, no worker left. It
    printed a traceback, and waited for the seeds already queued (a hang at 0% CPU in
    the issue); red before `simulations.workers` (checked)."""
    run = sweep("--seeds", "0:40", "--jobs", "2")
    workers = run.wait_for_workers(2)
    for pid in [run.process.pid, *workers]:
        os.kill(pid, signal.SIGINT)
    out, err = _ended(run.process, within_s=10)
    assert run.process.returncode == 130, out + err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("interrupted (Ctrl-C): 0 of 40 seeds"), err
    assert "the rest: --seeds 0:40" in lines[0]
    wait_for(lambda: not _alive(workers), "the workers to end", timeout=5)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_sigterm_of_the_sweep_alone_ends_its_workers(sweep: Callable[..., _Sweep]) -> None:
    """A SIGTERM of the sweep's process alone (its workers not signalled) ends them too;
    before, a SIGTERM left them running their seeds (red, checked)."""
    run = sweep("--seeds", "0:40", "--jobs", "2")
    workers = run.wait_for_workers(2)
    run.process.send_signal(signal.SIGTERM)
    out, err = _ended(run.process, within_s=10)
    assert run.process.returncode == 143, out + err
    assert err.strip().startswith("interrupted (SIGTERM): 0 of 40 seeds"), err
    wait_for(lambda: not _alive(workers), "the workers to end", timeout=5)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_workers_of_a_killed_sweep_end_with_it(sweep: Callable[..., _Sweep]) -> None:
    """SIGKILL of the sweep: nothing of it runs to stop the workers; they notice
    (PR_SET_PDEATHSIG) and end. Before, they were orphaned (red, checked)."""
    run = sweep("--seeds", "0:40", "--jobs", "2")
    workers = run.wait_for_workers(2)
    run.process.kill()
    run.process.wait(timeout=10)
    wait_for(lambda: not _alive(workers), "the orphaned workers to end", timeout=5)


def _square(n: int) -> int:
    if n < 0:
        raise ValueError(f"no square of {n} today")
    return n * n


def test_workers_answer_in_the_items_order_and_name_the_item_that_failed() -> None:
    with Workers(2, _square) as workers:
        assert list(workers.map(range(7))) == [0, 1, 4, 9, 16, 25, 36]
    with (
        Workers(2, _square) as workers,
        pytest.raises(WorkerError, match=r"running -3:\n(.|\n)*no square of -3 today"),
    ):
        list(workers.map([1, 2, -3, 4]))


def _square_or_die_on_2(n: int) -> int:
    if n == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return n * n


def _zombies(pid: int) -> list[int]:
    """The children of `pid` that ended and were not waited for."""
    children = PROC / str(pid) / "task" / str(pid) / "children"
    return [c for c in map(int, children.read_text().split()) if _start_time(c) is None]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_worker_that_dies_is_reaped_and_replaced_and_its_item_named() -> None:
    """A worker killed while it ran an item (SIGKILL, the OOM killer) ended the whole
    map: `WorkerError: worker N ended (exit code None)`, the item unnamed, the items
    after it lost. Its item now gives `died(item, how)`, the dead worker is reaped and
    another takes the next items (one job here: the rest ran, so a new worker ran
    them). Red before (checked)."""
    _children(os.getpid())  # (skips where the kernel lists no children)
    with Workers(1, _square_or_die_on_2, died=lambda n, how: f"{n}: {how}") as workers:
        assert list(workers.map(range(5))) == [0, 1, "2: signal 9, SIGKILL", 9, 16]
        assert not _zombies(os.getpid())
    with (
        Workers(2, _square_or_die_on_2) as workers,
        pytest.raises(WorkerError, match=r"a worker died running 2 \(signal 9, SIGKILL\)"),
    ):
        list(workers.map(range(5)))


@pytest.mark.parametrize("keep_going", [True, False])
def test_a_sweep_whose_worker_dies_reports_its_seed_as_failed_and_goes_on(
    keep_going: bool, tmp_path: Path
) -> None:
    """A worker dying mid-seed aborted the sweep with a traceback (`WorkerError: worker
    N ended (exit code None)`): no summary, no --json, the seed unnamed, and with
    --keep-going every seed left was lost. The seed fails, with its replay command, and
    the sweep goes on as after any failing seed: to the end with --keep-going, else it
    stops there with the usual lines. Red before (checked: a traceback, exit 1, no
    json)."""
    report = tmp_path / "sweep.json"
    args = ["--seeds", "0:4", "--jobs", "2", "--steps", "100", "--json", str(report)]
    swept = subprocess.run(
        [sys.executable, "-m", "simulations", "sweep", *args]
        + (["--keep-going"] if keep_going else []),
        cwd=ROOT,
        env={**os.environ, "QUORUMQ_SIM_TEST_DIE_ON_SEED": "1"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    out = swept.stdout
    assert swept.returncode == 1 and "Traceback" not in swept.stderr, out + swept.stderr
    assert "worker died while running seed 1 (signal 9, SIGKILL): no result" in out, out
    assert "replay: quorumq simulate replay --seed 1 --nodes 3 --faults default" in out
    died = {"seed": 1, "violations": {}, "worker_died": "signal 9, SIGKILL"}
    failed = json.loads(report.read_text())["failed"]
    assert [{k: f[k] for k in died} for f in failed] == [died]
    if keep_going:
        assert "1 of 4 seeds fail: " in out
        assert "  seed 1 fails: its worker died (signal 9, SIGKILL)" in out
        assert json.loads(report.read_text())["passed"] == 3
    else:
        assert "first failing seed: 1 (after 1 passing)" in out


class _Hook:
    """A key for `multiprocessing.util.register_after_fork` (weak: the hook goes with
    it)."""


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="forks")
def test_a_ctrl_c_that_reaches_a_worker_as_it_starts_runs_no_handler_of_the_sweeps() -> None:
    """A Ctrl-C (SIGINT to the whole group) that reached a worker after its fork and
    before it ignored SIGINT ran the handler it inherited: a KeyboardInterrupt, a
    `Process ForkProcess-1:` traceback, the worker gone. Each worker starts with the
    signal blocked, until it has set its own dispositions. Here the SIGINT comes in the
    worker's first steps (`multiprocessing`'s after-fork hooks), red before (checked:
    the worker died, exit code 1)."""
    hook = _Hook()
    multiprocessing.util.register_after_fork(hook, lambda _: os.kill(os.getpid(), signal.SIGINT))
    try:
        with Workers(2, _square) as workers:
            assert list(workers.map(range(4))) == [0, 1, 4, 9]
    finally:
        del hook


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_ctrl_c_while_the_workers_start_leaves_none_of_them_running(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Ctrl-C in the sweep as it started its second worker (just after the fork)
    left the first one, and the second one that it never counted, running: nothing
    stopped them (no `with` yet). The signal is held until the worker is counted,
    and a pool that does not start stops those it started. Red before (checked: both
    alive after 5 s)."""
    fork = os.fork
    forked: dict[int, int] = {}

    def interrupted_fork() -> int:
        pid = fork()
        if pid:  # the sweep: a Ctrl-C, at the second
            forked[pid] = _start_time(pid) or 0
            if len(forked) == 2:
                signal.raise_signal(signal.SIGINT)
        return pid

    monkeypatch.setattr(os, "fork", interrupted_fork)
    try:
        with pytest.raises(KeyboardInterrupt) as caught:  # (held: it holds the pool)
            Workers(3, _square)
        monkeypatch.undo()
        assert len(forked) == 2
        wait_for(lambda: not _alive(forked), "the started workers to end", timeout=5)
        del caught
    finally:
        for pid in _alive(forked):
            os.kill(pid, signal.SIGKILL)
        for pid in forked:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


def test_a_broken_pipe_other_than_standard_outputs_is_no_reader_leaving(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Any BrokenPipeError ended the command quietly with status 1, as if standard
    output's reader had left: a worker's pipe too (a sweep whose idle worker died
    stopped, saying nothing). Only standard output's is taken so (red before,
    checked)."""

    def broken(*_: object) -> None:
        raise BrokenPipeError(32, "a pipe that is not standard output")

    monkeypatch.setattr("simulations.__main__.run", broken)
    with pytest.raises(BrokenPipeError):
        main(["run", "--seed", "1"])


# ------------------------------------------------------- fault kinds and switches


def _simulate(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    code = main(list(args))
    out = capsys.readouterr().out
    assert code == 0, out
    return out


def _line(out: str, start: str) -> str:
    return next(line for line in out.splitlines() if line.startswith(start))


def _fault_kinds(out: str) -> set[str]:
    """The kinds in the summary's `faults injected (N): kind n, ...` line."""
    injected = _line(out, "faults injected (").split("; skipped")[0]
    return set(_counts(injected.split(": ", 1)[1]))


@pytest.mark.parametrize("given", ["flags", "setup file"])
def test_the_fault_kinds_named_are_the_only_ones_that_run(
    given: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`faults = "kill_leader,partition"` ran clock skews and jumps, disk faults (a bit
    flip, a meta file ahead), disk space faults and membership changes besides; and
    with a bit flip, `no_membership_faults` still saw the members change (the heal
    rebuilds a member whose disk is damaged). A list of kinds runs those kinds alone,
    from a setup file as from flags (red before `faults.select`, checked)."""
    args = ["run", "--seed", "7", "--steps", "1500"]
    if given == "flags":
        args += ["--faults", "kill_leader,partition", "--no-membership-faults"]
    else:
        setup = tmp_path / "setup.toml"
        setup.write_text('faults = "kill_leader,partition"\nno_membership_faults = true\n')
        args += ["--setup", str(setup)]
    out = _simulate(capsys, *args)
    assert _fault_kinds(out) == {"kill_leader", "partition"}, out
    assert _line(out, "membership: ").startswith("membership: 0 changes accepted"), out
    assert _line(out, "disk: ").startswith("disk: 0 starts refused"), out


def test_groups_of_kinds_can_be_named_and_a_profile_runs_what_it_did() -> None:
    assert kinds_of("partition,clock") == ("partition", "clock_skew", "clock_jump")
    only = select("partition,clock,bit_flip,add_spare", membership=False)
    assert only == Selection(
        drawn=("partition",),
        clock=("clock_skew", "clock_jump"),
        disk=("bit_flip",),
        space=(),
        membership=(),
    )
    default = select("default")  # every schedule, as before
    assert default.drawn == PROFILES["default"]
    assert default.kinds == set(KINDS) - set(HOSTILE_KINDS)
    assert select("none", disk=False).kinds == set(CLOCK_KINDS)  # (as before, too)


def test_a_kind_named_and_switched_off_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit:
        main(["run", "--seed", "1", "--faults", "crash,bit_flip", "--no-disk-faults"])
    assert exit.value.code == 2
    assert "bit_flip named, and left out by --no-disk-faults" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("given", "said"),
    [
        (["--faults", ","], "--faults: ',' names no fault kind"),
        (["--faults", ""], "--faults: '' names no fault kind"),
        (["--faults", " , "], "--faults: ' , ' names no fault kind"),
        ("faults = []", "faults = [] names no fault kind"),
        ('faults = ","', "--faults: ',' names no fault kind"),
    ],
)
def test_a_list_of_fault_kinds_that_names_none_is_refused(
    given: list[str] | str, said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--faults ,`, `--faults ""` and `faults = []` ran no fault at all and said PASS;
    they are refused in one line, exit status 2 (red before, checked: exit 0)."""
    if isinstance(given, str):
        setup = tmp_path / "setup.toml"
        setup.write_text(given + "\n")
        given = ["--setup", str(setup)]
    with pytest.raises(SystemExit) as exit:
        main(["run", "--seed", "1", "--steps", "100", *given])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert said in err and len(err.strip().splitlines()) == 1, err


def test_a_setup_files_list_of_one_kind_runs_that_kind_not_the_profile_of_its_name(
    tmp_path: Path,
) -> None:
    """`faults = ["crash"]` was joined into "crash", the profile (crash and kill_leader,
    the clock, disk and membership faults); a list names kinds, so it is the kind crash
    alone, `--faults crash,`, and so it replays (red before, checked)."""
    setup = tmp_path / "setup.toml"
    setup.write_text('faults = ["crash"]\n')
    config = config_of(["run", "--seed", "1", "--setup", str(setup)])
    assert config.faults == "crash,"
    assert select(config.faults).kinds == {"crash"}
    assert config_of(["replay", *config.replay_args()]) == config
    assert config_of(["run", "--seed", "1", "--faults", "crash,"]) == config
    assert (
        select(config_of(["run", "--seed", "1", "--faults", "crash"]).faults).drawn
        == (PROFILES["crash"])
    )


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ('faults = ["network"]', "network: a profile, not a kind"),
        ('faults = ["crash", "crash"]', "crash named more than once"),
        ('faults = ["clock", "clock_skew"]', "clock_skew named more than once"),
        ('faults = ["crash,pause"]', "not fault kinds: ['crash,pause']"),
        ("faults = [1]", "not fault kinds: [1]"),
        (["--faults", "pause,crash,pause"], "--faults: pause named more than once"),
    ],
)
def test_a_list_of_fault_kinds_with_a_profile_or_a_kind_twice_is_refused(
    given: list[str] | str, said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A profile's name in a setup file's list ran the profile (`["network"]`), a kind
    named twice ran as if named once (red before, checked)."""
    if isinstance(given, str):
        setup = tmp_path / "setup.toml"
        setup.write_text(given + "\n")
        given = ["--setup", str(setup)]
    with pytest.raises(SystemExit) as exit:
        config_of(["run", "--seed", "1", *given])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert said in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(
    "switch", ["no_disk_faults", "no_disk_space_faults", "no_membership_faults"]
)
def test_a_setup_files_switch_acts_as_its_flag(
    switch: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    setup = tmp_path / "setup.toml"
    setup.write_text(f"{switch} = true\nsteps = 600\n")
    run = ["run", "--seed", "5"]
    from_file = _line(_simulate(capsys, *run, "--setup", str(setup)), "trace ")
    flag = "--" + switch.replace("_", "-")
    from_flag = _line(_simulate(capsys, *run, "--steps", "600", flag), "trace ")
    without = _line(_simulate(capsys, *run, "--steps", "600"), "trace ")
    assert from_file == from_flag != without


@pytest.mark.parametrize(
    ("setting", "said"),
    [
        ('no_membership_faults = "false"', "no_membership_faults must be true or false"),
        ('nodes = "five"', "argument --nodes: invalid int value: 'five'"),
        ('overflow = "drop-tail"', "overflow must be one of drop-head, reject-publish"),
    ],
)
def test_a_setup_files_values_are_checked_as_the_options_are(
    setting: str, said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A switch given as the string "false" switched it on, and a value was not
    checked against the option's choices (red before `_setting`, checked; a number
    given as a string was converted and checked already)."""
    setup = tmp_path / "setup.toml"
    setup.write_text(setting + "\n")
    with pytest.raises(SystemExit) as exit:
        main(["run", "--seed", "1", "--setup", str(setup)])
    assert exit.value.code == 2
    assert said in capsys.readouterr().err


# ------------------------------------------------------------------ what is counted


def _counts(text: str) -> dict[str, int]:
    """`crash 3, pause 4` -> {"crash": 3, "pause": 4}."""
    return {kind: int(n) for kind, n in (part.split() for part in text.split(", "))}


def test_the_summary_the_pause_table_and_the_schedule_count_the_same_faults(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The schedule (`--schedule`) listed 8 pauses where the summary counted 4 (the
    others were skipped: their node was down or paused already; once, the pause table
    counted the schedule too), and nothing said so. The summary counts the faults
    injected, as the pause table does, and names the skipped ones; the schedule says
    why each was skipped (red before, checked: no `faults injected`, no mark)."""
    out = _simulate(
        capsys, "run", "--seed", "3", "--faults", "crash,pause", "--steps", "1500", "--schedule"
    )
    lines = out.splitlines()
    schedule = lines[: lines.index(_line(out, "seed 3: "))]
    injected_text, _, skipped_text = _line(out, "faults injected (").partition("; skipped")
    injected = _counts(injected_text.split(": ", 1)[1])
    skipped = _counts(skipped_text.split(": ", 1)[1])
    table = {
        line.split()[0]: int(line.split()[1][1:])
        for line in lines
        if line.startswith("  ") and " charged " in line
    }
    played = Counter(line.split()[2] for line in schedule if "(skipped: " not in line)
    passed_over = [line for line in schedule if "(skipped: " in line]
    assert injected == table == dict(played), out
    assert skipped == dict(Counter(line.split()[2] for line in passed_over)) == {"pause": 4}
    assert all(line.endswith(("was down)", "was paused)")) for line in passed_over), out


# ------------------------------------------------------------------------ replay


def test_replay_after_a_run_replays_that_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`replay --seed 7` after `run --seed 7 --nodes 5` replayed a 3-node run of seed 7
    (the defaults), saying nothing. It replays the run of seed 7 recorded here, with its
    options, and says so, and that the trace is the same (red before, checked)."""
    ran = _simulate(capsys, "run", "--seed", "7", "--nodes", "5", "--steps", "300")
    events = tmp_path / "events.txt"
    replayed = _simulate(capsys, "replay", "--seed", "7", "--out", str(events))
    assert replayed.startswith("replaying seed 7 as `run` last ran it here: --seed 7 --nodes 5")
    assert _line(replayed, "seed 7: ").startswith("seed 7: 5 nodes")
    assert _line(replayed, "trace ") == _line(ran, "trace ")
    assert replayed.rstrip().endswith("the same run as recorded (the same trace)")
    assert "start E 1" in events.read_text()


def test_replay_with_options_of_its_own_runs_exactly_those(
    capsys: pytest.CaptureFixture[str],
) -> None:
    _simulate(capsys, "run", "--seed", "7", "--nodes", "5", "--steps", "300")
    replayed = _simulate(capsys, "replay", "--seed", "7", "--steps", "300", "--out", os.devnull)
    assert replayed.startswith("replaying seed 7 with the options given: --seed 7 --nodes 3")
    assert _line(replayed, "seed 7: ").startswith("seed 7: 3 nodes")


def test_a_replay_that_is_not_the_recorded_run_says_so_and_fails(
    records: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    records.mkdir(parents=True)
    (records / "seed-4.json").write_text(
        json.dumps({"args": ["--seed", "4", "--steps", "200"], "trace": "0" * 64})
    )
    assert main(["replay", "--seed", "4", "--out", os.devnull]) == 1
    out = capsys.readouterr().out
    assert f"not the run recorded: its trace was {'0' * 64}" in out


class _StoppedBeforeRunError(Exception):
    """What `replay` would have run (it was not run)."""


def _replay_plan(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str
) -> tuple[str, RunConfig]:
    """What `replay` says before it runs, and the config it runs (not played)."""

    def play(config: RunConfig, *_: object) -> None:
        raise _StoppedBeforeRunError(config)

    monkeypatch.setattr("simulations.__main__.run", play)
    with pytest.raises(_StoppedBeforeRunError) as played:
        main(["replay", *args])
    return capsys.readouterr().out.strip(), played.value.args[0]


def test_a_record_written_in_part_leaves_the_one_before_whole(
    records: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`run` wrote its record in place: a write cut short (here a file size limit of
    40 bytes; a disk full; another run of the seed reading or writing it meanwhile)
    left half a record, which replay then took for none. It writes a file of its own
    and renames it over the record: the record before stays whole, and nothing of the
    cut write is left (red before, checked: 40 bytes of the new record)."""
    _simulate(capsys, "run", "--seed", "4", "--nodes", "5", "--steps", "100")
    before = (records / "seed-4.json").read_text()
    limited = (
        "import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (40, 40)); "
        "sys.argv = ['simulations', 'run', '--seed', '4', '--steps', '100']; "
        "runpy.run_module('simulations', run_name='__main__')"
    )
    cut = subprocess.run(
        [sys.executable, "-c", limited],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert cut.returncode == 0 and "verdict: PASS" in cut.stdout, cut.stdout + cut.stderr
    assert (records / "seed-4.json").read_text() == before
    assert sorted(p.name for p in records.iterdir()) == ["seed-4.json"]


@pytest.mark.parametrize(
    ("record", "why"),
    [
        ('{"args": ["--seed", "4", "--no', "not JSON: "),
        ("\udcff", "'utf-8' codec can't decode byte 0xff"),
        ('["--seed", "4"]', "no list of options in it"),
    ],
)
def test_an_unreadable_record_is_named_and_the_defaults_replayed(
    record: str,
    why: str,
    records: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A torn or damaged record was taken for none ("no run of seed 4 recorded"): it
    is named, with what is wrong, and replay says it runs the defaults (red before,
    checked)."""
    records.mkdir(parents=True)
    (records / "seed-4.json").write_text(record, errors="surrogateescape")
    said, config = _replay_plan(monkeypatch, capsys, "--seed", "4", "--out", os.devnull)
    assert said.startswith(
        f"the record of seed 4 in {records / 'seed-4.json'} is unreadable ({why}"
    ), said
    assert said.endswith(
        "replaying it with the default options: --seed 4 --nodes 3 --faults default --steps 3000"
    ), said
    assert config == RunConfig(seed=4)


_TRACE = "0" * 64


@pytest.mark.parametrize(
    ("record", "why"),
    [
        ({"args": ["--seed", "4", "--out", "x"], "trace": _TRACE}, "not take now: --out"),
        ({"args": ["--seed", "4", "--setup", "x.toml"], "trace": _TRACE}, "now: --setup"),
        ({"args": ["--seed", "4", "--help"], "trace": _TRACE}, "not take now: --help"),
        ({"args": ["--seed", "4", "-h"], "trace": _TRACE}, "not take now: -h"),
        ({"args": ["--seed", "4", "--node", "5"], "trace": _TRACE}, "not take now: --node"),
        ({"args": ["--seed", "4", "--fault-rate", "2"], "trace": _TRACE}, "now: --fault-rate"),
        ({"args": ["--seed", "4", "--nodes", "9"], "trace": _TRACE}, "--nodes must be 1 to 7"),
        ({"args": ["--seed", "4", "--nodes", "five"], "trace": _TRACE}, "invalid int value"),
        ({"args": ["--seed", "4", "x"], "trace": _TRACE}, "unrecognized arguments: x"),
        ({"args": ["--seed", "5"], "trace": _TRACE}, "the seeds in it are ['5'], not [4]"),
        ({"args": ["--seed", 4], "trace": _TRACE}, "options that are not strings"),
        ({"args": ["--seed", "4"]}, "no trace in it"),
        ({"args": ["--seed", "4"], "trace": 7}, "its trace is 7"),
    ],
)
def test_a_record_that_run_would_not_write_is_named_and_the_defaults_replayed(
    record: dict[str, object],
    why: str,
    records: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A stale or hostile record steered replay or crashed it: `--out` in it wrote the
    events where it said, `--help` printed the help and exited 0, an option renamed
    since or a value refused ended replay with an error that did not name the record,
    no trace crashed it after the run. Only what `_record` writes is replayed: the
    options `replay_args` gives, for this seed, that pass the options' checks, and a
    trace; else the record is named with what is wrong, and the defaults replayed
    (red before, checked)."""
    records.mkdir(parents=True)
    (records / "seed-4.json").write_text(json.dumps(record))
    said, config = _replay_plan(monkeypatch, capsys, "--seed", "4", "--out", os.devnull)
    assert said.startswith(f"the record of seed 4 in {records / 'seed-4.json'} is unusable ("), said
    assert why in said and len(said.splitlines()) == 1, said
    assert said.endswith(
        "): replaying it with the default options: " + shlex.join(RunConfig(seed=4).replay_args())
    ), said
    assert config == RunConfig(seed=4)


def test_a_record_as_run_writes_it_is_replayed(
    records: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """(Every option `replay_args` gives is taken from a record.)"""
    config = config_of(["run", "--seed", "4", "--steps", "100"])
    full = attrs.evolve(
        config,
        nodes=5,
        faults="crash,",
        fault_interval_s=0.5,
        compaction_entries=30,
        disk_space_faults=False,
        membership_faults=False,
        spares=2,
        workload=attrs.evolve(
            config.workload,
            rate=20.0,
            producers=2,
            message_ttl_ms=4000,
            max_length=100,
            overflow="reject-publish",
            delivery_limit=3,
            dead_letter=True,
            single_active_consumer=True,
            consumer_timeout_ms=5000,
            retry_backoff_ms=(100, 1000),
        ),
    )
    records.mkdir(parents=True)
    record = {"args": full.replay_args(), "trace": _TRACE}
    (records / "seed-4.json").write_text(json.dumps(record))
    said, replayed = _replay_plan(monkeypatch, capsys, "--seed", "4", "--out", os.devnull)
    assert said.startswith("replaying seed 4 as `run` last ran it here: "), said
    assert replayed == full


def test_the_records_kept_are_the_most_recent_ones(
    records: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """One record per seed ever run, kept forever: the cache grew without end. A run
    keeps the `MAX_RECORDS` most recent (by modification time), and removes the
    temporary file of a write killed over an hour ago (red before, checked: every
    file left)."""
    monkeypatch.setattr("simulations.__main__.MAX_RECORDS", 3)
    records.mkdir(parents=True)
    now = time.time()
    for seed, age_s in [(1, 50), (2, 10), (3, 40), (4, 20), (5, 30)]:
        path = records / f"seed-{seed}.json"
        path.write_text(json.dumps({"args": ["--seed", str(seed)], "trace": _TRACE}))
        os.utime(path, (now - age_s, now - age_s))
    killed, writing = records / ".seed-6.abc.tmp", records / ".seed-7.def.tmp"
    killed.write_text("{")
    writing.write_text("{")
    os.utime(killed, (now - 7200, now - 7200))
    _simulate(capsys, "run", "--seed", "9", "--steps", "100")
    assert sorted(p.name for p in records.iterdir()) == [
        ".seed-7.def.tmp",
        "seed-2.json",
        "seed-4.json",
        "seed-9.json",
    ]


@pytest.mark.parametrize("cache_home", ["relative/cache", ""])
def test_a_relative_cache_home_is_ignored_for_the_home_directorys(
    cache_home: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """XDG_CACHE_HOME=relative/cache recorded runs under the directory of the moment;
    the XDG base directory spec says a relative path is invalid and to be ignored:
    ~/.cache, as when it is unset (red before, checked: relative/cache/quorumq)."""
    monkeypatch.setenv("XDG_CACHE_HOME", cache_home)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    _simulate(capsys, "run", "--seed", "9", "--steps", "100")
    assert (tmp_path / "home" / ".cache" / "quorumq" / "simulate" / "seed-9.json").exists()
    assert not (tmp_path / "relative").exists()


def test_a_replay_command_gives_back_the_config_it_was_made_from() -> None:
    """The replay command a failing run prints (and `run` records) names every option
    of its run: read back, the same config (`--fault-interval 0.123456789` was printed
    as 0.123457: another run)."""
    config = RunConfig(
        seed=12,
        nodes=5,
        faults="kill_leader,partition,disk",
        steps=1234,
        fault_interval_s=0.123456789,
        compaction_entries=30,
        disk_space_faults=False,
        membership_faults=False,
        spares=2,
        workload=WorkloadConfig(
            rate=33.3,
            producers=3,
            consumers=5,
            keys=7,
            prefetch=9,
            message_ttl_ms=4000,
            max_length=100,
            overflow="reject-publish",
            delivery_limit=3,
            dead_letter=True,
            single_active_consumer=True,
            consumer_timeout_ms=5000,
            retry_backoff_ms=(100, 1000),
        ),
    )
    assert config_of(["replay", *config.replay_args()]) == config
    assert config_of(["run", *RunConfig(seed=3).replay_args()]) == RunConfig(seed=3)


def test_a_replay_piped_into_a_reader_that_leaves_ends_quietly() -> None:
    """`quorumq simulate replay --seed 7 | head` printed a BrokenPipeError traceback."""
    with subprocess.Popen(
        [sys.executable, "-m", "simulations", "replay", "--seed", "2", "--steps", "300"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as replay:
        assert replay.stdout is not None and replay.stderr is not None
        try:
            assert replay.stdout.readline().startswith("replaying seed 2 with the options")
            replay.stdout.close()  # as `head -1` does
            assert replay.wait(timeout=60) == 1
            assert "Traceback" not in replay.stderr.read()
        finally:
            if replay.poll() is None:
                replay.kill()


# ---------------------------------------------------------------------- timeline

_NUMBER = re.compile(r"(?<![\w.@-])[-+]?\d+(?:\.\d+)?(?![\w.])")
_UNIT = re.compile(r"( (ms|s|min|h|d|MiB)\b|%)")


def _bare_numbers(text: str) -> list[str]:
    """Numbers in `text` with no unit after them (a slot number aside)."""
    return [
        m.group()
        for m in _NUMBER.finditer(text)
        if not _UNIT.match(text, m.end()) and not text[: m.start()].endswith("slot ")
    ]


def _one_of_each_kind() -> list[Fault]:
    amounts = {"slow_link": 0.273, "one_way_delay": 1.2, "duplicate": 0.05, "drop": 0.1}
    amounts |= {"clock_skew": 2_516_650, "clock_jump": -13_320_000, "disk_alarm": 19 << 20}
    two = ("slow_link", "one_way_delay", "link_reset")
    return [
        Fault(
            at_s=12.3,
            kind=kind,
            nodes=("C", "A") if kind in two else ("B",),
            duration_s=0.242 if kind == "slow_host" else 4.85,
            amount=amounts.get(kind, 0.0),
        )
        for kind in KINDS
    ]


def test_every_fault_reads_in_words_with_units_at_a_human_scale() -> None:
    """The timeline listed `clock_skew B (2.51665e+06)`-like details: every fault now
    says what it did, each quantity with its unit, at a scale that reads (red before:
    no `fault_text`, checked)."""
    texts = {
        f.kind: fault_text(f, "B" if f.kind == "kill_leader" else "") for f in _one_of_each_kind()
    }
    assert texts["clock_skew"] == "clock skew on B: wall clock off by +41.9 min"
    assert texts["clock_jump"] == "clock jump on B: wall clock moves -3.7 h"
    assert texts["slow_link"] == "slow link C to A: +273 ms for 4.85 s"
    assert texts["slow_host"] == "slow host B: its Raft thread stalls 242 ms"
    assert texts["disk_alarm"] == "disk alarm on B: 19.0 MiB free for 4.85 s"
    assert texts["duplicate"] == "duplicated Raft messages: 5% of them for 4.85 s"
    for kind, text in texts.items():
        assert not _bare_numbers(text), (kind, text)
        assert "e+" not in text and "e-0" not in text, text


def test_the_timeline_wraps_its_summary_and_lists_each_fault_in_words(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The summary ran off the right edge of the page (a <pre> that never wraps); the
    faults were listed as the trace's terse lines, the nodes that refused to start
    among them. Red before (checked)."""
    page = tmp_path / "timeline.html"
    out = _simulate(capsys, "run", "--seed", "7", "--steps", "1500", "--render", str(page))
    text = page.read_text()
    assert "white-space: pre-wrap" in text and "viewBox=" in text
    injected = int(_line(out, "faults injected (").split("(")[1].split(")")[0])
    table = text.split(f"<h2>Faults injected ({injected})</h2>")[1].split("</table>")[0]
    rows = re.findall(r"<tr><td class='s'>([\d.]+)</td><td>(.*?)</td></tr>", table)
    assert len(rows) == injected
    for _, fault in rows:
        assert not _bare_numbers(html.unescape(fault)), fault
    assert ">0 s</text>" in text and ">10 s</text>" in text  # a time axis
