"""Where one message's time goes, step by step, and where the nodes' CPU goes.

    python -m benchmarks.bench_path [--rate 1000] [--seconds 5] [--profile]

Starts an embedded 3-node cluster (fsync=always) with path timing on
(`quorumq.pathtiming`: every node and this client mark each step of every message with
the wall clock), publishes at `--rate` msg/s to the leader with one consumer on a
follower (as `compare`'s latency workload does), stops the nodes, joins the marks of
the four processes message by message and prints, for the confirm path and the
delivery path, each step's median and p99 time since the publish call and the median
time of the step itself.

`--profile` then runs the end-to-end workload (publish -> consume -> ack) with py-spy
sampling each node process, and prints each node's top functions by own time and by
inclusive time (py-spy must be installed: `pip install py-spy`).
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

CONFIRM_PATH = [
    ("client.publish", "client", "the application calls publish"),
    ("client.sent", "client", "frame encoded and written"),
    ("node.read", "leader", "leader's core reads the frame"),
    ("node.proposed", "leader", "proposed (to the Raft thread's queue)"),
    ("raft.appended", "leader", "Raft thread appends it"),
    ("raft.sent", "leader", "AppendEntries sent"),
    ("raft.synced", "leader", "leader's fdatasync done"),
    ("raft.received", "follower", "follower reads the AppendEntries"),
    ("raft.synced", "follower", "follower's fdatasync done"),
    ("raft.answered", "follower", "follower answers"),
    ("raft.reply", "leader", "leader reads the answer"),
    ("raft.committed", "leader", "leader commits"),
    ("raft.applied", "leader", "leader applies"),
    ("node.confirm.queued", "leader", "confirm frame queued (in trio)"),
    ("node.confirm.written", "leader", "confirm frame written"),
    ("client.confirm.read", "client", "client reads the confirm"),
    ("client.confirmed", "client", "publish future resolved"),
]
DELIVERY_PATH = [
    ("raft.committed", "leader", "leader commits"),
    ("raft.committed", "follower", "follower learns the commit"),
    ("raft.applied", "follower", "follower applies"),
    ("node.effects", "follower", "its effects reach trio"),
    ("node.deliver.queued", "follower", "delivery frame queued"),
    ("node.deliver.written", "follower", "delivery frame written"),
    ("client.deliver.read", "client", "consumer's client reads it"),
    ("client.handed", "client", "handed to the application"),
]
FULL_DELIVERY_PATH = CONFIRM_PATH[:12] + DELIVERY_PATH[1:]
"""A delivery's whole path: the confirm path up to the commit, then the delivery path."""
COVERING = {"raft.synced", "raft.answered", "raft.reply", "raft.committed"}
"""Steps marked once for every entry up to an index (a sync, an answer, a commit): a
message's time is the first such mark at or past its index."""


def _load(directory: Path) -> dict[str, list[tuple[int, str, Any]]]:
    by_process: dict[str, list[tuple[int, str, Any]]] = collections.defaultdict(list)
    for path in sorted(directory.glob("*.jsonl")):
        name = "?"
        with open(path) as f:
            for line in f:
                value = json.loads(line)
                if isinstance(value, dict):
                    name = value["process"]
                else:
                    by_process[name].append((value[0], value[1], value[2]))
    return by_process


class _Steps:
    """One process's marks, looked up by step and key."""

    def __init__(self, marks: list[tuple[int, str, Any]]) -> None:
        self.exact: dict[tuple[str, tuple[Any, ...]], int] = {}
        covering: dict[str, list[tuple[int, int]]] = collections.defaultdict(list)
        for ns, step, key in marks:
            if step in COVERING:
                covering[step].append((key[1], ns))
            else:
                self.exact.setdefault((step, tuple(key)), ns)
        self.covering = {}
        for step, pairs in covering.items():
            pairs.sort(key=lambda p: (p[1], p[0]))
            # the first time each index was covered: a running maximum over time
            firsts: list[tuple[int, int]] = []
            top = -1
            for index, ns in pairs:
                if index > top:
                    firsts.append((index, ns))
                    top = index
            self.covering[step] = firsts

    def at(self, step: str, key: tuple[Any, ...]) -> int | None:
        if step in COVERING:
            firsts = self.covering.get(step, [])
            pos = bisect.bisect_left(firsts, (key[1], -1))
            return firsts[pos][1] if pos < len(firsts) else None
        return self.exact.get((step, key))


def _key_kind(step: str) -> str:
    """How `step` names a message: p (producer, seq), o (offset) or i (log index)."""
    if step in ("client.publish", "client.sent", "node.read", "node.proposed"):
        return "p"
    if step.startswith(("node.confirm", "node.deliver", "client.")):
        return "o"
    return "i"


def breakdown(directory: Path, leader: str, follower: str) -> str:
    processes = _load(directory)
    steps = {name: _Steps(marks) for name, marks in processes.items()}
    role = {"leader": steps[leader], "follower": steps[follower], "client": steps["client"]}
    maps = [tuple(k) for _, step, k in processes[leader] if step == "map"]
    rows: dict[str, list[list[float]]] = {"confirm": [], "delivery": [], "full": []}
    for index, producer, first_seq, count, first_offset in maps:
        for n in range(count):
            keys = {
                "p": ("p", producer, first_seq + n),
                "i": ("i", index),
                "o": ("o", first_offset + n),
            }
            start = role["client"].at("client.publish", keys["p"])
            if start is None:
                continue
            for path, name in (
                (CONFIRM_PATH, "confirm"),
                (DELIVERY_PATH, "delivery"),
                (FULL_DELIVERY_PATH, "full"),
            ):
                times = []
                for step, who, _ in path:
                    times.append(role[who].at(step, keys[_key_kind(step)]))
                if all(t is not None for t in times):
                    rows[name].append([(t - start) / 1e6 for t in times])  # type: ignore[operator]
    appended = sum(1 for _, step, _ in processes[leader] if step == "raft.appended")
    syncs = {
        name: sum(1 for _, step, _ in marks if step == "raft.synced")
        for name, marks in sorted(processes.items())
        if name != "client"
    }
    out = [
        f"log entries appended by the leader: {appended} for {len(rows['confirm'])} messages; "
        f"fdatasyncs marked: {', '.join(f'{n} {c}' for n, c in syncs.items())}"
    ]
    for path, name in ((CONFIRM_PATH, "confirm"), (DELIVERY_PATH, "delivery")):
        table = rows[name]
        out.append(f"\n{name} path ({len(table)} messages; ms since the publish call):\n")
        out.append("| step | where | median | p99 | the step itself, median |")
        out.append("|---|---|---:|---:|---:|")
        for col, (_step, who, label) in enumerate(path):
            values = sorted(r[col] for r in table)
            if not values:
                continue
            deltas = sorted(r[col] - r[col - 1] for r in table) if col else [0.0]
            p99 = values[min(len(values) - 1, int(len(values) * 0.99))]
            out.append(
                f"| {label} | {who} | {statistics.median(values):.3f} | {p99:.3f} | "
                f"{statistics.median(deltas):.3f} |"
            )
    out += _stalls(processes, rows["full"])
    return "\n".join(out)


def _collections(marks: list[tuple[int, str, Any]]) -> list[tuple[int, int, int]]:
    """(start ns, end ns, generation) of the garbage collector's passes."""
    passes = []
    started: tuple[int, int] | None = None
    for ns, step, key in marks:
        if step == "gc.start":
            started = (ns, key[1])
        elif step == "gc.stop" and started is not None:
            passes.append((started[0], ns, started[1]))
            started = None
    return passes


def _stalls(
    processes: dict[str, list[tuple[int, str, Any]]], delivery_rows: list[list[float]]
) -> list[str]:
    """The garbage collector's passes per process, and the slowest deliveries: the
    step that took them longest."""
    out = ["\ngarbage collection (passes, longest ms, total ms):"]
    for name, marks in sorted(processes.items()):
        passes = _collections(marks)
        for generation in (0, 1, 2):
            mine = [(b - a) / 1e6 for a, b, g in passes if g == generation]
            if mine:
                out.append(
                    f"  {name} generation {generation}: {len(mine)}, {max(mine):.2f}, "
                    f"{sum(mine):.1f}"
                )
    if not delivery_rows:
        return out
    out.append("\nthe slowest deliveries (ms since the publish call; the longest step):")
    labels = [label for _, _, label in FULL_DELIVERY_PATH]
    for row in sorted(delivery_rows, key=lambda r: r[-1])[-5:]:
        steps = [(row[i] - row[i - 1], labels[i]) for i in range(1, len(row))]
        took, label = max(steps)
        out.append(f"  {row[-1]:.1f}: {took:.1f} before '{label}'")
    return out


def _top(raw: Path, n: int = 12) -> str:
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        samples = int(count)
        total += samples
        frames = [
            f.split(" (")[0] + " " + f.rsplit("/", 1)[-1].split(":")[0] for f in stack.split(";")
        ]
        own[frames[-1]] += samples
        for frame in set(frames):
            inclusive[frame] += samples
    lines = [f"  {total} samples; own time:"]
    lines += [f"    {100 * c / total:5.1f}%  {f}" for f, c in own.most_common(n)]
    lines.append("  inclusive:")
    lines += [f"    {100 * c / total:5.1f}%  {f}" for f, c in inclusive.most_common(n)]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rate", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--profile", action="store_true", help="py-spy the nodes end to end")
    parser.add_argument("--messages", type=int, default=30000, help="end-to-end messages")
    parser.add_argument("--fsync", default="always", choices=("always", "batch", "never"))
    parser.add_argument("--journal", default="file", choices=("file", "wal"))
    args = parser.parse_args()
    marks = Path(tempfile.mkdtemp(prefix="quorumq-path-"))
    os.environ["QUORUMQ_PATH_TIMING"] = str(marks)
    # imported after the variable is set: path timing is read once, at import
    from quorumq import pathtiming
    from quorumq.ops.local_cluster import Cluster

    from .bench_cluster import end_to_end, paced

    pathtiming.name_process("client")
    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    data = Path(tempfile.mkdtemp(prefix="quorumq-path-data-"))
    try:
        with Cluster(
            3, str(data), node_down_grace=30.0, fsync=args.fsync, journal=args.journal
        ) as cluster:
            leader = cluster.leader()
            trace = paced(cluster, args.rate, args.seconds)
            follower = trace_follower = next(n for n in cluster.nodes if n != leader)
            print(
                f"{args.rate} msg/s for {args.seconds} s, leader {leader}, consumer on "
                f"{trace_follower}: confirm p50 {trace.analyse()['confirm_p50_ms']:.2f} ms, "
                f"delivery p50 {trace.analyse()['deliver_p50_ms']:.2f} ms"
            )
            profile = None
            if args.profile:
                os.environ.pop("QUORUMQ_PATH_TIMING")
                profile = _profile(cluster, end_to_end, args.messages, data)
        pathtiming._write()
        print(breakdown(marks, leader, follower))
        if profile:
            print(profile)
    finally:
        shutil.rmtree(marks, ignore_errors=True)
        shutil.rmtree(data, ignore_errors=True)
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


def _profile(cluster: Any, end_to_end: Any, messages: int, data: Path) -> str:
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not os.path.exists(spy):
        return "py-spy is not installed (pip install py-spy): no profile"
    leader = cluster.leader()
    pids = {n: cluster.pid(n) for n in cluster.nodes}
    rate: list[float] = []
    worker = threading.Thread(target=lambda: rate.append(end_to_end(cluster, messages, 1000)))
    worker.start()
    time.sleep(0.5)
    spies = {
        n: subprocess.Popen(
            [
                spy,
                "record",
                "--pid",
                str(pid),
                "--rate",
                "250",
                "--duration",
                "4",
                "--gil",
                "--format",
                "raw",
                "--output",
                str(data / f"spy-{n}.txt"),
                "--nonblocking",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for n, pid in pids.items()
    }
    for proc in spies.values():
        proc.wait(timeout=60)
    worker.join()
    out = [f"\nend to end, {messages} messages: {rate[0] if rate else 0:,.0f} msg/s"]
    for n in cluster.nodes:
        raw = data / f"spy-{n}.txt"
        role = "leader" if n == leader else "follower"
        out.append(f"\nnode {n} ({role}):")
        out.append(_top(raw) if raw.exists() else "  (no samples)")
    return "\n".join(out)


if __name__ == "__main__":
    main()
