"""Group commit: G Raft groups' appends made durable by one write-ahead log, or by a
journal each (issue 33).

    python -m benchmarks.bench_wal [--groups 1,3,8] [--rounds 300] [--entries 10]
                                   [--bytes 200] [--repeat 3] [--dir PATH]

A round is what a Raft thread does in one tick: every group appends `--entries`
entries of `--bytes` bytes, then everything is made durable. "journals" gives each
group its own `DurableJournal` and syncs each (G fdatasyncs a round, as separate
groups would); "wal" appends every group to one `WriteAheadLog` and syncs it once.
Rows give rounds and entries per second of wall time and fdatasyncs per round
(counted, the segments' rollovers included); the
ratio line divides the two, per group count, medians of the repeats, interleaved so
that the shared disk's mood falls on both. The data directory is on the disk the
benchmark runs from (`--dir`, default a temporary directory): fdatasync is the cost
measured, so it must be a real disk, not tmpfs.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import tempfile
import time

from quorumq.raft.files import OS_FILES
from quorumq.raft.journal import DurableJournal, RaftJournal
from quorumq.raft.wal import WriteAheadLog
from quorumq.server.metrics import TimedFiles


class _Counted:
    """fdatasyncs counted through the files both kinds write (`TimedFiles` observes
    each `sync`)."""

    def __init__(self) -> None:
        self.syncs = 0
        self.files = TimedFiles(OS_FILES, self._saw)

    def _saw(self, _seconds: float) -> None:
        self.syncs += 1


Run = tuple[float, int]
"""Seconds for the rounds, and the fdatasyncs they made."""


def _rounds(kind: str, root: str, groups: int, rounds: int, entries: int, body: bytes) -> Run:
    """`rounds` rounds through a journal per group ("journals") or one log ("wal")."""
    counted = _Counted()
    if kind == "journals":
        journals: list[RaftJournal] = [
            DurableJournal(os.path.join(root, f"g{g}.log"), files=counted.files)
            for g in range(groups)
        ]
        durable = journals
    else:
        wal = WriteAheadLog(root, files=counted.files)
        journals = [wal.journal(g) for g in range(groups)]
        durable = journals[:1]  # one sync covers every group
    for journal in journals:
        journal.setCurrentTerm(1, None)
    idx = 1
    counted.syncs = 0
    start = time.perf_counter()
    for _ in range(rounds):
        for journal in journals:
            for i in range(entries):
                journal.add(body, idx + i, 1)
        idx += entries
        for journal in durable:
            journal.sync()
    elapsed, syncs = time.perf_counter() - start, counted.syncs
    for journal in journals:
        journal._destroy()
    return elapsed, syncs


def measure(base: str, kind: str, groups: int, rounds: int, entries: int, size: int) -> Run:
    """`rounds` rounds of `kind` ("journals" or "wal") in a fresh directory."""
    root = tempfile.mkdtemp(prefix=f"{kind}-", dir=base)
    try:
        return _rounds(kind, root, groups, rounds, entries, os.urandom(size))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", default="1,3,8")
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--entries", type=int, default=10)
    parser.add_argument("--bytes", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the data goes (a real disk)")
    args = parser.parse_args(argv)
    counts = [int(g) for g in args.groups.split(",")]
    base = tempfile.mkdtemp(prefix="bench-wal-", dir=args.dir or os.getcwd())
    print(
        f"# bench_wal: {platform.node()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, load {os.getloadavg()[0]:.2f}, data in {base}"
    )
    print(f"# {args.rounds} rounds of {args.entries} entries of {args.bytes} bytes per group")
    print("| groups | durable by | rounds/s | entries/s | fdatasyncs/round |")
    print("|---:|---|---:|---:|---:|")
    try:
        results: dict[tuple[int, str], list[float]] = {}
        syncs: dict[tuple[int, str], int] = {}
        for _ in range(args.repeat):
            for groups in counts:
                for kind in ("journals", "wal"):
                    seconds, synced = measure(
                        base, kind, groups, args.rounds, args.entries, args.bytes
                    )
                    results.setdefault((groups, kind), []).append(seconds)
                    syncs[(groups, kind)] = synced
        for groups in counts:
            for kind in ("journals", "wal"):
                rate = args.rounds / statistics.median(results[(groups, kind)])
                print(
                    f"| {groups} | {'a journal each' if kind == 'journals' else 'one log'} "
                    f"| {rate:,.0f} | {rate * groups * args.entries:,.0f} "
                    f"| {syncs[(groups, kind)] / args.rounds:.2f} |"
                )
        for groups in counts:
            ratio = statistics.median(results[(groups, "journals")]) / statistics.median(
                results[(groups, "wal")]
            )
            print(f"wal / journals, {groups} groups (rounds/s, medians): {ratio:.2f}x")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
