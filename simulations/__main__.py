"""quorumq simulate (or python -m simulations) run | replay | sweep | scenario (see `--help`)."""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import math
import os
import shlex
import signal
import sys
import tempfile
import threading
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO, cast

import attrs

from quorumq.cli.args import Parser, backoff_ms
from quorumq.ops.scenarios import SCENARIOS
from quorumq.ops.scenarios import render as render_scenario

from .faults import (
    DISK_KINDS,
    GROUPS,
    KINDS,
    MEMBERSHIP_KINDS,
    PROFILES,
    SPACE_KINDS,
    Selection,
    kinds_of,
    select,
)
from .liveness import LivenessReport
from .node import REAL
from .pauses import Pauses, quantile
from .render import run_html, scenario_html
from .runner import Outcome, RunConfig, run, sweep
from .spark_sweep import SparkSweepError, spark_sweep
from .workload import WorkloadConfig


def _config(args: argparse.Namespace, seed: int) -> RunConfig:
    return RunConfig(
        seed=seed,
        nodes=args.nodes,
        faults=args.faults,
        steps=args.steps,
        fault_interval_s=args.fault_interval,
        workload=WorkloadConfig(
            rate=args.rate,
            message_ttl_ms=args.ttl,
            max_length=args.max_length,
            overflow=args.overflow,
            delivery_limit=args.delivery_limit,
            dead_letter=args.dead_letter,
            single_active_consumer=args.single_active_consumer,
            consumer_timeout_ms=args.consumer_timeout,
            retry_backoff_ms=args.retry_backoff,
            producers=args.producers,
            consumers=args.consumers,
            keys=args.keys,
            prefetch=args.prefetch,
            bursts=args.bursts,
        ),
        variant=REAL,
        compaction_entries=args.compaction,
        journal=args.journal,
        disk_faults=not args.no_disk_faults,
        disk_space_faults=not args.no_disk_space_faults,
        membership_faults=not args.no_membership_faults,
        spares=args.spares,
        groups=args.groups,
    )


def _selection(args: argparse.Namespace) -> Selection:
    return select(
        args.faults,
        disk=not args.no_disk_faults,
        space=not args.no_disk_space_faults,
        membership=not args.no_membership_faults,
    )


def _bursts(text: str) -> tuple[float, float]:
    """`--bursts BUSY,IDLE`: two positive numbers of seconds."""
    try:
        busy, idle = (float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not BUSY,IDLE (seconds)") from None
    if not (0 < busy < math.inf and 0 < idle < math.inf):
        raise argparse.ArgumentTypeError(f"{text!r}: both must be positive seconds")
    return busy, idle


def _setup_file(path: str, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """A run's setup from a TOML file: the same names as the options, with `_` for
    `-` (`nodes = 5`, `faults = "kill_leader,partition"` or a list of kinds,
    `fault_interval = 10`, `rate = 1000`, `no_membership_faults = true`, ...). Options
    given on the command line win. A value goes through the option's own checks, as if
    typed (`nodes = "five"` is refused as `--nodes five` is), a switch must be `true` or
    `false` (a string `"false"` switched it on)."""
    try:
        with open(path, "rb") as f:
            setup = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        parser.error(f"--setup {path}: {e}")
    actions = {a.dest: a for a in parser._actions}
    known = set(actions) - {"help", "setup", "command", "seed", "seeds"}
    unknown = sorted(set(setup) - known)
    if unknown:
        parser.error(f"--setup {path}: unknown settings {unknown}; known: {sorted(known)}")
    where = f"--setup {path}"
    return {name: _setting(where, parser, actions[name], v) for name, v in setup.items()}


def _setting(
    where: str, parser: argparse.ArgumentParser, action: argparse.Action, value: Any
) -> Any:
    """A setup file's value for `action`, as the command line would give it."""
    name = action.dest
    if name == "faults" and isinstance(value, list):
        return _fault_list(where, parser, value)
    if action.nargs == 0:  # a switch
        if not isinstance(value, bool):
            parser.error(f"{where}: {name} must be true or false, not {value!r}")
        return value
    if isinstance(value, bool | list | dict):
        parser.error(f"{where}: {name} = {value!r} is not a value of {name}")
    text = str(value)  # converted and checked by the option's type, as if typed
    if action.choices is not None and text not in action.choices:
        choices = ", ".join(str(c) for c in action.choices)
        parser.error(f"{where}: {name} must be one of {choices}, not {text!r}")
    return text


def _fault_list(where: str, parser: argparse.ArgumentParser, value: list[Any]) -> str:
    """A setup file's list of fault kinds as `--faults` takes it. A list names kinds
    (and groups of them) only: `["crash"]` is the kind crash alone (`--faults crash,`),
    not the profile `crash`; a profile is a string (`faults = "crash"`), and a profile
    named in a list is refused, as are an empty list and a kind named twice."""
    if not value:
        parser.error(f"{where}: faults = [] names no fault kind")
    others = [v for v in value if not isinstance(v, str) or (v not in KINDS and v not in GROUPS)]
    if others:
        profiles = [v for v in others if isinstance(v, str) and v in PROFILES]
        why = (
            f"{', '.join(profiles)}: a profile, not a kind (a profile is a string: "
            f'faults = "{profiles[0]}")'
            if profiles
            else f"not fault kinds: {others!r}"
        )
        parser.error(f"{where}: faults = {value!r} is a list of kinds; {why}")
    text = ",".join(value)
    try:
        kinds_of(text)
    except ValueError as e:
        parser.error(f"{where}: faults = {value!r}: {e}")
    return text + "," if text in PROFILES else text


def _seeds(text: str) -> range:
    """An argparse type: `start:end` (end excluded) or one seed; a range with no seed in
    it is refused (it "passed" every one of none)."""
    start, sep, end = text.partition(":")
    try:
        seeds = range(int(start), int(end)) if sep else range(int(start), int(start) + 1)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not START:END or SEED (whole numbers, END excluded)"
        ) from None
    if not seeds:
        raise argparse.ArgumentTypeError(f"{text!r} holds no seed (END must be above START)")
    return seeds


def _writable_path(text: str) -> Path:
    """An argparse type: a file this run can write (checked before the run, not after)."""
    path = Path(text)
    folder = path.parent
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"{path}: no directory {folder}")
    if not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"{path}: {folder} is not writable")
    return path


def _parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The command line's parser, and its parsers by command (`common`: the options of
    a run)."""
    parser = Parser(
        prog="quorumq simulate",
        description="Deterministic failover simulations of a quorumq cluster.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    common = Parser(add_help=False)
    common.add_argument("--nodes", type=int, default=3)
    common.add_argument(
        "--faults",
        default="default",
        help=f"a profile ({', '.join(sorted(PROFILES))}): its kinds, the clock faults and, "
        "but for none, the disk, disk space and membership faults; or fault kinds separated "
        f"by commas, each once, and only those run ({', '.join(KINDS)}; or a group of "
        f"them: {', '.join(GROUPS)}). 'crash' alone is the profile, 'crash,' the kind "
        "alone; a setup file's list names kinds only: faults = ['crash'] is the kind",
    )
    common.add_argument(
        "--steps", type=int, default=3000, help="fault phase, in 10 ms steps (default 30 s)"
    )
    common.add_argument(
        "--fault-interval",
        type=float,
        default=attrs.fields(RunConfig).fault_interval_s.default,
        help="mean seconds between faults",
    )
    common.add_argument("--rate", type=float, default=WorkloadConfig().rate, help="records/s")
    workload = WorkloadConfig()
    common.add_argument("--producers", type=int, default=workload.producers)
    common.add_argument("--consumers", type=int, default=workload.consumers)
    common.add_argument("--keys", type=int, default=workload.keys, help="distinct ordering keys")
    common.add_argument("--prefetch", type=int, default=workload.prefetch)
    common.add_argument(
        "--bursts",
        type=_bursts,
        metavar="BUSY,IDLE",
        help="producers publish BUSY seconds, then nothing for IDLE seconds, in turn "
        "(faults then also strike a quiet cluster; default: they publish throughout)",
    )
    common.add_argument(
        "--setup", metavar="FILE.toml", help="settings from a TOML file (options given win)"
    )
    common.add_argument(
        "--compaction",
        type=int,
        metavar="ENTRIES",
        help="compact a node's log into a snapshot past this many entries (default: never)",
    )
    common.add_argument(
        "--journal",
        choices=("file", "wal"),
        default="file",
        help="each node's journal: a file of its own, or group 0 of the shared "
        "write-ahead log (default: file)",
    )
    common.add_argument(
        "--ttl", type=int, metavar="MS", help="give the queue a message TTL (default: none)"
    )
    common.add_argument(
        "--max-length", type=int, metavar="N", help="at most N ready records in the queue"
    )
    common.add_argument(
        "--overflow",
        choices=("drop-head", "reject-publish"),
        default="drop-head",
        help="past --max-length: drop the oldest, or refuse publishes",
    )
    common.add_argument(
        "--delivery-limit",
        type=int,
        metavar="N",
        help="drop (or dead-letter) a record returned N times",
    )
    common.add_argument(
        "--dead-letter",
        action="store_true",
        help="dead-letter what the queue drops to a second queue",
    )
    common.add_argument(
        "--single-active-consumer",
        action="store_true",
        help="one consumer at a time receives the queue",
    )
    common.add_argument(
        "--consumer-timeout",
        type=int,
        metavar="MS",
        help="remove a consumer that holds a record this long (slow ones ack after 0.2-1.5 s)",
    )
    common.add_argument(
        "--retry-backoff",
        type=backoff_ms,
        metavar="MIN:MAX",
        help="the queue's retry backoff in ms (doubling per failure); consumers then nack "
        "with a delay of their own half the time",
    )
    common.add_argument(
        "--no-disk-faults",
        action="store_true",
        help="leave out the disk faults (and the disk space faults)",
    )
    common.add_argument(
        "--no-disk-space-faults",
        action="store_true",
        help="leave out the disk space faults (a disk alarm, a full disk)",
    )
    common.add_argument(
        "--no-membership-faults",
        action="store_true",
        help="leave out the membership changes (a member whose disk a bit_flip or "
        "meta_ahead damaged is still removed and added back empty at the heal)",
    )
    common.add_argument(
        "--spares",
        type=int,
        default=attrs.fields(RunConfig).spares.default,
        help="hosts that are no members at first, for the operator to add",
    )
    common.add_argument(
        "--groups",
        type=int,
        default=1,
        choices=range(1, 9),
        metavar="G",
        help="Raft groups every node hosts (quorumq node --groups): the workload's queue "
        "in the last, one idle queue in each other",
    )
    one = sub.add_parser(
        "run",
        parents=[common],
        help="run one seed and print a summary (its options recorded for `replay`)",
    )
    one.add_argument("--seed", type=int, required=True)
    one.add_argument("--render", type=_writable_path, help="write an HTML timeline of the run here")
    one.add_argument("--schedule", action="store_true", help="print the fault schedule too")
    again = sub.add_parser(
        "replay",
        parents=[common],
        help="run one seed again, as `run` last ran it here, and print every event of it",
        description="Run one seed again and print every event of it. Given only --seed "
        "(and --out), it replays the seed as `run --seed N` last ran it here, with the "
        "same options (`run` records them under $XDG_CACHE_HOME/quorumq/simulate, "
        "~/.cache if it is unset or relative; a sweep records its failing seeds; the "
        f"{MAX_RECORDS:,} most recent are kept), and says whether the trace is the "
        "recorded one. Given options of a run too, it runs exactly those.",
    )
    again.add_argument("--seed", type=int, required=True)
    again.add_argument("--out", type=_writable_path, help="write the events here (default: print)")
    many = sub.add_parser(
        "sweep", parents=[common], help="run many seeds; report the first failure"
    )
    many.add_argument(
        "--seeds", type=_seeds, default=range(0, 100), help="start:end (end excluded)"
    )
    many.add_argument("--jobs", type=int, default=1, help="worker processes")
    many.add_argument(
        "--spark",
        type=_spark_master,
        metavar="MASTER",
        help="run the seeds as Spark tasks on this master (local[2], spark://host:7077, "
        "yarn, ...) instead of --jobs processes: every executor's Python needs the same "
        "quorumq (pip install 'quorumq[spark]'); the report is a local sweep's",
    )
    many.add_argument(
        "--keep-going", action="store_true", help="run every seed; list every failing one"
    )
    many.add_argument(
        "--json",
        type=_writable_path,
        metavar="FILE",
        help="write failing seeds, recoveries and every seed's verdict and trace hash here",
    )
    scenario = sub.add_parser("scenario", help="replay the RabbitMQ post's event sequences")
    scenario.add_argument("name", choices=["rabbitmq-post"])
    scenario.add_argument("--render", type=_writable_path, help="write the HTML rendering here")
    return parser, {"run": one, "replay": again, "sweep": many, "common": common}


def _spark_master(text: str) -> str:
    """A master Spark can start: `local...`, `spark://`, `k8s://`, `yarn` (checked here,
    before a JVM starts, which would only say so in a stack trace)."""
    if text == "yarn" or text.startswith(("local", "spark://", "k8s://")):
        return text
    raise argparse.ArgumentTypeError(
        f"{text!r} is no Spark master: local[N], spark://HOST:PORT, k8s://..., or yarn"
    )


def _parse(argv: list[str]) -> argparse.Namespace:
    """The arguments, the setup file's settings with them, all checked (one line on
    standard error and exit status 2 for anything wrong)."""
    parser, subparsers = _parsers()
    args = parser.parse_args(argv)
    if getattr(args, "setup", None):
        subparser = subparsers[args.command]
        subparser.set_defaults(**_setup_file(args.setup, subparser))
        args = parser.parse_args(argv)
    if args.command != "scenario" and not 1 <= args.nodes <= 7:
        parser.error("--nodes must be 1 to 7")
    if args.command != "scenario":
        try:
            _config(args, 0).workload.queue_options()
        except (TypeError, ValueError) as e:
            parser.error(f"queue options: {e}")
        try:
            named = kinds_of(args.faults)
        except ValueError as e:
            parser.error(f"--faults: {e}")
        left_out = sorted(set(named) - _selection(args).kinds)
        if left_out:
            space = "--no-disk-space-faults" if args.no_disk_space_faults else "--no-disk-faults"
            by = {
                **dict.fromkeys(DISK_KINDS, "--no-disk-faults"),
                **dict.fromkeys(SPACE_KINDS, space),
                **dict.fromkeys(MEMBERSHIP_KINDS, "--no-membership-faults"),
            }
            switches = " and ".join(sorted({by[k] for k in left_out}))
            parser.error(f"--faults: {', '.join(left_out)} named, and left out by {switches}")
    return args


def config_of(argv: list[str]) -> RunConfig:
    """The run that `run` or `replay` with these arguments plays."""
    args = _parse(argv)
    return _config(args, args.seed)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parse(argv)
    stdout = sys.stdout
    sys.stdout = cast(TextIO, _Stdout(stdout))
    try:
        return _command(argv, args)
    except _StdoutClosedError:  # `quorumq simulate replay --seed 7 | head`: the reader left
        os.dup2(os.open(os.devnull, os.O_WRONLY), stdout.fileno())
        return 1
    finally:
        sys.stdout = stdout


class _StdoutClosedError(Exception):
    """Standard output's reader left (`| head`): the command ends quietly."""


class _Stdout:
    """Standard output, whose BrokenPipeError alone means that its reader left: one
    from any other pipe (a worker's) is an error like any other."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            raise _StdoutClosedError from None

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            raise _StdoutClosedError from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _command(argv: list[str], args: argparse.Namespace) -> int:

    if args.command == "scenario":
        scenarios = list(SCENARIOS.values())
        print("\n\n".join(render_scenario(s) for s in scenarios))
        if args.render:
            args.render.write_text(scenario_html(scenarios))
            print(f"\nwrote {args.render}")
        return 0

    if args.command == "replay":
        return _replay(argv, args)

    if args.command == "run":
        result = run(_config(args, args.seed))
        _record(result.config, result.trace_hash)
        if args.schedule:
            print("\n".join(result.schedule_lines()))
        print(result.summary())
        if args.render:
            args.render.write_text(run_html(result))
            print(f"wrote {args.render}")
        return 0 if result.ok else 1

    return _sweep(args)


def _replay(argv: list[str], args: argparse.Namespace) -> int:
    """`replay`: the seed as `run` last ran it here (given only --seed and --out), or
    with the options given; every event, the summary, and whether the trace is the
    recorded run's."""
    recorded = None
    bad = None
    if not _run_options_in(argv):
        try:
            recorded = _recorded(args.seed, argv)
        except _BadRecordError as e:
            bad = e
        if recorded is not None:
            args = recorded[0]
    config = _config(args, args.seed)
    options = shlex.join(config.replay_args())
    if recorded is not None:
        print(f"replaying seed {args.seed} as `run` last ran it here: {options}")
    elif _run_options_in(argv):
        print(f"replaying seed {args.seed} with the options given: {options}")
    elif bad is not None:
        print(
            f"the record of seed {args.seed} in {bad.path} is {bad.what} ({bad.why}): "
            f"replaying it with the default options: {options}"
        )
    else:
        print(
            f"no run of seed {args.seed} recorded in {_records()}: replaying it with the "
            f"default options: {options}"
        )
    if args.out is not None:
        with args.out.open("w") as history:
            result = run(config, history)
        print(f"wrote every event of the run to {args.out}")
    else:
        result = run(config, sys.stdout)
    print(result.summary())
    if recorded is not None and recorded[1] != result.trace_hash:
        print(
            f"not the run recorded: its trace was {recorded[1]} (the simulator or "
            "the code it runs changed since?)"
        )
        return 1
    if recorded is not None:
        print("the same run as recorded (the same trace)")
    return 0 if result.ok else 1


def _run_options_in(argv: list[str]) -> bool:
    """Whether `argv` gives a run's options (those of `run` but --seed, and --setup),
    or a prefix of one (argparse takes `--node 5` for `--nodes 5`)."""
    _, subparsers = _parsers()
    options = {o for a in subparsers["common"]._actions for o in a.option_strings}
    names = [arg.split("=")[0] for arg in argv if arg.startswith("--")]
    return any(o.startswith(name) for name in names for o in options - {"--help"})


MAX_RECORDS = 1000
"""The records kept: writing one removes the oldest (by modification time) past it."""
STALE_S = 3600.0
"""A temporary record file this old is a write that was killed: it is removed."""


def _records() -> Path:
    """Where `run` records the options of each seed it ran, for `replay`: under
    $XDG_CACHE_HOME, or ~/.cache if that is unset, empty or relative (the XDG base
    directory spec: a relative path is invalid, and ignored)."""
    cache = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(cache):
        cache = os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "quorumq" / "simulate"


def _record(config: RunConfig, trace: str) -> None:
    """Record how `config`'s seed ran (the last run of a seed replaces the one before;
    a cache that cannot be written records nothing). The record is written whole to a
    file of its own, then renamed over the seed's: runs of one seed at once (a sweep
    and a run) leave the one or the other, never a mix or a half."""
    folder = _records()
    text = json.dumps({"args": config.replay_args(), "trace": trace}) + "\n"
    with contextlib.suppress(OSError):
        folder.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=folder, prefix=f".seed-{config.seed}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(temporary, folder / f"seed-{config.seed}.json")
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise
        _prune(folder)


def _prune(folder: Path) -> None:
    """Keep the `MAX_RECORDS` most recent records (one file per seed ever run grew
    without end), and no temporary file of a write killed long ago."""
    records: list[tuple[float, str, Path]] = []
    stale = time.time() - STALE_S
    for path in folder.iterdir():
        with contextlib.suppress(OSError):
            modified = path.stat().st_mtime
            if path.name.startswith("seed-") and path.name.endswith(".json"):
                records.append((modified, path.name, path))
            elif path.name.startswith(".seed-") and path.name.endswith(".tmp") and modified < stale:
                path.unlink()
    records.sort()
    for _, _, path in records[: max(0, len(records) - MAX_RECORDS)]:
        with contextlib.suppress(OSError):
            path.unlink()


class _BadRecordError(Exception):
    """A record of a seed that is there and cannot be used: `what` (unreadable,
    unusable) and `why`."""

    def __init__(self, path: Path, why: str, what: str = "unreadable") -> None:
        super().__init__(f"{path}: {what} ({why})")
        self.path = path
        self.why = why
        self.what = what


def _recorded(seed: int, argv: list[str]) -> tuple[argparse.Namespace, str] | None:
    """`replay`'s arguments as `run` last ran `seed` here (with `argv`, replay's own:
    --seed and --out), and that run's trace; None if no run of it is recorded. A
    record that is there and cannot be used raises `_BadRecordError`: one that cannot
    be read, and one that `_record` did not write as it writes now (its options are
    those `RunConfig.replay_args` gives, and they pass the options' checks)."""
    path = _records() / f"seed-{seed}.json"
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise _BadRecordError(path, str(e)) from None
    try:
        record = json.loads(text)
    except ValueError as e:
        raise _BadRecordError(path, f"not JSON: {e}") from None
    if not isinstance(record, dict) or not isinstance(record.get("args"), list):
        raise _BadRecordError(path, "no list of options in it")
    options, trace = record["args"], record.get("trace")

    def unusable(why: str) -> _BadRecordError:
        return _BadRecordError(path, why, what="unusable")

    if not all(isinstance(o, str) for o in options):
        raise unusable(f"options that are not strings: {options!r}")
    if not isinstance(trace, str):
        raise unusable("no trace in it" if trace is None else f"its trace is {trace!r}")
    unknown = [o for o in options if o.startswith("-") and not _number(o)]
    unknown = [o for o in unknown if o.split("=")[0] not in _recorded_options()]
    if unknown:
        raise unusable(f"options a run does not take now: {' '.join(unknown)}")
    seeds = [v for o, v in itertools.pairwise(options) if o == "--seed"]
    if seeds != [str(seed)]:
        raise unusable(f"the seeds in it are {seeds}, not [{seed}]")
    refused = io.StringIO()
    try:
        with contextlib.redirect_stderr(refused):
            args = _parse(["replay", *options, *argv[1:]])
    except SystemExit:
        why = refused.getvalue().strip().removeprefix("quorumq simulate replay: ")
        raise unusable(f"refused: {why.split(' (see quorumq simulate')[0]}") from None
    return args, trace


def _recorded_options() -> set[str]:
    """The options a record holds: those `RunConfig.replay_args` gives (a run's options
    but --setup, and --seed)."""
    _, subparsers = _parsers()
    options = {o for a in subparsers["common"]._actions for o in a.option_strings}
    return (options - {"--setup", "-h", "--help"}) | {"--seed"}


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _sweep(args: argparse.Namespace) -> int:
    """`sweep`: the seeds in `--jobs` processes, a summary of them all. Ctrl-C (or a
    SIGTERM) stops the workers and says how far the sweep got (exit status 130, 143)."""
    seeds = args.seeds
    started = time.perf_counter()
    passed = faults = skipped = 0
    failed: list[Outcome] = []
    sim_s = 0.0
    kinds: dict[str, int] = {}
    pauses: dict[str, list[Pauses]] = {}
    slowest: dict[str, tuple[float, int]] = {}
    """Per fault kind: its longest charged recovery and the seed it was in."""
    records: dict[str, int] = {}
    reports: list[tuple[int, LivenessReport]] = []
    every: list[tuple[int, bool, str]] = []
    """(seed, verdict, trace hash) of every seed: all a sweep keeps of a passing one."""
    progress = _Progress(len(seeds))
    try:
        configs = (_config(args, s) for s in seeds)
        if args.spark is not None:
            outcomes = spark_sweep(list(configs), args.spark)
        else:
            outcomes = sweep(configs, jobs=args.jobs)
        with _interruptible(), contextlib.closing(outcomes) as runs:
            for outcome in runs:
                every.append((outcome.seed, outcome.ok, outcome.trace_hash))
                if not outcome.ok:
                    if outcome.worker_died is None:  # (a seed with no trace is not recorded)
                        _record(_config(args, outcome.seed), outcome.trace_hash)
                    progress.done()
                    print(outcome.summary)
                    if not args.keep_going:
                        print(f"first failing seed: {outcome.seed} (after {passed} passing)")
                        _write_json(args.json, [outcome], passed, pauses, slowest, reports, every)
                        return 1
                    failed.append(outcome)
                else:
                    passed += 1
                faults += outcome.faults
                skipped += outcome.skipped
                sim_s += outcome.sim_s
                for kind, n in outcome.fault_kinds.items():
                    kinds[kind] = kinds.get(kind, 0) + n
                for kind, pause in outcome.confirm_pauses.items():
                    pauses.setdefault(kind, []).append(pause)
                    if pause.max is not None and pause.max > slowest.get(kind, (-1.0, 0))[0]:
                        slowest[kind] = (pause.max, outcome.seed)
                for name, n in outcome.records.items():
                    records[name] = records.get(name, 0) + n
                if outcome.liveness is not None:
                    reports.append((outcome.seed, outcome.liveness))
                progress.show(passed, len(failed), time.perf_counter() - started)
    except SparkSweepError as e:
        progress.done()
        print(f"quorumq simulate: {e}", file=sys.stderr)
        return 2
    except Interrupted as e:
        progress.done()
        done = passed + len(failed)
        rest = f"; the rest: --seeds {seeds[done]}:{seeds.stop}" if done < len(seeds) else ""
        print(
            f"interrupted ({e.name}): {done} of {len(seeds)} seeds finished ({passed} pass, "
            f"{len(failed)} fail){rest}",
            file=sys.stderr,
        )
        return 128 + e.signum
    progress.done()
    wall = time.perf_counter() - started
    verdict = (
        f"all {passed} seeds pass" if not failed else f"{len(failed)} of {len(seeds)} seeds fail"
    )
    print(
        f"{verdict}: {faults} faults injected ({skipped} skipped when due, with no target "
        f"then), {sim_s / 3600:.2f} simulated hours "
        f"in {wall:.0f} s wall ({sim_s / max(wall, 1e-9):.0f}x)"
    )
    for outcome in failed:
        reasons = ", ".join(f"{k} {n}" for k, n in outcome.violation_kinds.items())
        if outcome.worker_died is not None:
            reasons = f"its worker died ({outcome.worker_died})"
        print(f"  seed {outcome.seed} fails: {reasons}")
    print(", ".join(f"{name} {n}" for name, n in records.items()))
    print(liveness_line([r for _, r in reports]))
    print("\n".join(recovery_table(pauses, slowest)))
    _write_json(args.json, failed, passed, pauses, slowest, reports, every)
    return 1 if failed else 0


def liveness_line(reports: list[LivenessReport]) -> str:
    """After the heal, over the seeds: when the cluster came back; the false downs."""
    caught = [r.caught_up_after_s for r in reports if r.caught_up_after_s is not None]
    confirmed = [r.confirmed_after_s for r in reports if r.confirmed_after_s is not None]
    bounds = [r.bound.total_s for r in reports if r.bound is not None]
    churned = sum(1 for r in reports if r.leaderships_after_bound)
    false_downs = sum(len(r.false_downs) for r in reports)
    downs = sum(r.downs for r in reports)
    return (
        f"after heal (p50 / max over seeds): caught up {_s(quantile(caught, 0.5))} / "
        f"{_s(max(caught, default=None))} (bounds {_s(min(bounds, default=None))} to "
        f"{_s(max(bounds, default=None))}; {len(reports) - len(caught)} seeds never), first "
        f"confirm {_s(quantile(confirmed, 0.5))} / {_s(max(confirmed, default=None))}; "
        f"{churned} seeds changed leader past the bound; node downs {downs}, false "
        f"{false_downs} (in {sum(1 for r in reports if r.false_downs)} seeds)"
    )


def recovery_table(
    pauses: dict[str, list[Pauses]], slowest: dict[str, tuple[float, int]] | None = None
) -> list[str]:
    """Per fault kind, its faults' confirm recoveries pooled over the seeds (`pauses`),
    and the seed of the slowest (`slowest`: to replay it)."""
    slowest = slowest or {}
    lines = [
        "confirm recovery after a fault (faults: those injected of the kind, over the seeds; "
        "s from its end, from its start for a crash or a membership change; only faults "
        "with no other fault active meanwhile are charged):",
        "| fault kind | faults | charged | overlapped | p50 | p99 | max | max in seed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for kind in sorted(pauses):
        pooled = _pooled(pauses[kind])
        seed = str(slowest[kind][1]) if kind in slowest else "-"
        cells = [_s(pooled.p50), _s(pooled.p99), _s(pooled.max), seed]
        lines.append(
            f"| {kind} | {pooled.count} | {len(pooled.charged)} | {pooled.overlapped} | "
            + " | ".join(cells)
            + " |"
        )
    return lines


def _pooled(runs: list[Pauses]) -> Pauses:
    return Pauses(sum(p.count for p in runs), tuple(v for p in runs for v in p.charged))


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def _write_json(
    path: Path | None,
    failed: list[Outcome],
    passed: int,
    pauses: dict[str, list[Pauses]],
    slowest: dict[str, tuple[float, int]],
    reports: list[tuple[int, LivenessReport]],
    every: list[tuple[int, bool, str]],
) -> None:
    """The sweep's outcome for programs: failing seeds and why, recoveries per kind, and
    every seed's verdict and trace hash (`runs`: a sweep run elsewhere, on Spark, or by
    another version, compares seed by seed)."""
    if path is None:
        return
    recovery = {}
    for kind, runs in sorted(pauses.items()):
        pooled = _pooled(runs)
        recovery[kind] = {
            "faults": pooled.count,
            "charged": len(pooled.charged),
            "overlapped": pooled.overlapped,
            "p50_s": pooled.p50,
            "p99_s": pooled.p99,
            "max_s": pooled.max,
            "max_in_seed": slowest[kind][1] if kind in slowest else None,
        }
    data = {
        "passed": passed,
        "liveness": [
            {
                "seed": seed,
                "bound_s": r.bound.total_s if r.bound else None,
                "caught_up_after_s": r.caught_up_after_s,
                "confirmed_after_s": r.confirmed_after_s,
                "leaderships_after_heal": r.leaderships_after_heal,
                "leaderships_after_bound": r.leaderships_after_bound,
                "downs": r.downs,
                "false_downs": len(r.false_downs),
            }
            for seed, r in reports
        ],
        "failed": [
            {
                "seed": o.seed,
                "violations": o.violation_kinds,
                "worker_died": o.worker_died,
                "summary": o.summary,
            }
            for o in failed
        ],
        "recovery": recovery,
        "runs": [{"seed": seed, "ok": ok, "trace": trace} for seed, ok, trace in every],
    }
    path.write_text(json.dumps(data, indent=1) + "\n")


class Interrupted(KeyboardInterrupt):
    """A SIGINT (Ctrl-C) or a SIGTERM, while `_interruptible`."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum
        self.name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


@contextlib.contextmanager
def _interruptible() -> Iterator[None]:
    """SIGINT and SIGTERM raise `Interrupted` inside the block (the caller stops its
    workers and says how far it got); a second one ends the process at once, as if
    nothing caught them (its workers die with it)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupted(signum: int, _frame: object) -> None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise Interrupted(signum)

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for s in before:
        signal.signal(s, interrupted)
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


class _Progress:
    """A progress bar on a terminal (standard error); a line every 10 seeds elsewhere."""

    WIDTH = 30

    def __init__(self, total: int) -> None:
        self.total = total
        self.bar = sys.stderr.isatty()

    def show(self, passed: int, failed: int, elapsed_s: float) -> None:
        done = passed + failed
        what = f"{passed} seeds pass" + (f", {failed} fail" if failed else "")
        if self.bar:
            filled = self.WIDTH * done // max(self.total, 1)
            line = f"[{'#' * filled}{'.' * (self.WIDTH - filled)}] {done}/{self.total}"
            sys.stderr.write(f"\r{line}: {what} ({elapsed_s:.0f} s)")
            sys.stderr.flush()
        elif done % 10 == 0:
            print(f"{what} ({elapsed_s:.0f} s)", flush=True)

    def done(self) -> None:
        if self.bar:
            sys.stderr.write("\n")


if __name__ == "__main__":
    sys.exit(main())
