"""Many Raft groups per node process: one engine and one write-ahead log, or a thread
and a journal file per group (issue 33, stage 2).

    python -m benchmarks.bench_engine [--groups 1,4] [--seconds 5] [--window 8]
                                      [--bytes 200] [--repeat 3]
                                      [--kinds threads,engine,link]
                                      [--dir PATH]

Three node processes on 127.0.0.1 each host one member of every group, as a node of a
3-node cluster would with `--groups` groups (Raft alone: no queue, no client). Each
process keeps `--window` proposals of `--bytes` bytes outstanding in every group,
through its own member (a follower forwards to the leader, as a node forwards a
publish), for `--seconds`, with fsync=always. "engine" ticks every group a process
hosts on one thread (`RaftEngine`) with their journals in one `WriteAheadLog`;
"link" is the engine with one Raft port per node for every group
(`link.EngineLink`: one connection per pair of nodes, messages tagged by group);
"threads" gives each group a thread and a journal file of its own (what separate
groups in one process would be without the engine; it runs on a checkout from before
the engine too, for a side-by-side run of the same code path). Rows give commits per
second (answered proposals: the median, then every run's), the three processes' CPU
seconds per 10,000 commits and fdatasyncs per 100 commits (counted in the
processes). Kinds alternate within each repeat, medians are printed, and the ratio
line divides them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from benchmarks.peers.common import stop_on_sigterm
from quorumq.ops.local_cluster import free_ports

NODES = "ABC"
KINDS = ("threads", "engine", "link")
LABELS = {
    "threads": "a thread, a file each",
    "engine": "one engine, one log",
    "link": "one engine, one log, one port",
}


# ----------------------------------------------------------------- one node process


def _node(spec: dict[str, Any]) -> None:
    """One node process: its member of every group, the load, a JSON line of counts."""
    syncs = [0]
    fdatasync = os.fdatasync

    def counted(fd: int) -> None:
        syncs[0] += 1
        fdatasync(fd)

    os.fdatasync = counted  # (the journals sync through os.fdatasync)

    from quorumq.raft.member import RaftMember

    name, root, groups = spec["name"], spec["dir"], spec["groups"]
    engine = None
    if spec["kind"] in ("engine", "link"):
        from quorumq.raft.engine import RaftEngine

        port = (
            {"raft_address": groups[0][name], "password": "bench"} if spec["kind"] == "link" else {}
        )
        engine = RaftEngine(name, **port)
    on_engine: dict[str, Any] = {}  # (none for "threads": it runs on releases before the engine)
    members = [
        RaftMember(
            name,
            addresses,
            data_dir=os.path.join(root, f"group-{g}") if g else root,
            **(on_engine if engine is None else {"node_dir": root, "group": g, "engine": engine}),
            journal="wal" if engine is not None else "file",
            password="bench",
            fsync="always",
            apply=lambda index, payload: None,
            snapshot=lambda: b"",
            restore=lambda machine: None,
            on_tick=lambda: None,
            compaction_entries=10**9,
        )
        for g, addresses in enumerate(groups)
    ]
    for member in members:
        member.start()
    try:
        deadline = time.monotonic() + 30
        while not all(m._getLeader() is not None for m in members):
            if time.monotonic() > deadline:
                raise SystemExit(f"{name}: a group elected no leader within 30 s")
            time.sleep(0.01)
        print("ready", flush=True)
        sys.stdin.readline()  # go
        commits = [0]
        failures = [0]
        running = threading.Event()
        running.set()
        body = os.urandom(spec["bytes"])
        lock = threading.Lock()

        def keep_going(member: RaftMember) -> Any:
            def answered(result: Any, error: int) -> None:
                with lock:
                    if error == 0:
                        commits[0] += 1
                    else:
                        failures[0] += 1
                if running.is_set():
                    member.propose(body, answered)

            return answered

        cpu0 = resource.getrusage(resource.RUSAGE_SELF)
        syncs0 = syncs[0]
        started = time.monotonic()
        for member in members:
            for _ in range(spec["window"]):
                member.propose(body, keep_going(member))
        time.sleep(spec["seconds"])
        with lock:
            done, failed = commits[0], failures[0]
        elapsed = time.monotonic() - started
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
        synced = syncs[0] - syncs0
        running.clear()
        leaders = sum(1 for m in members if m._isLeader())
        cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
        print(
            json.dumps(
                {
                    "commits": done,
                    "failed": failed,
                    "seconds": elapsed,
                    "cpu": cpu,
                    "syncs": synced,
                    "leads": leaders,
                }
            ),
            flush=True,
        )
        sys.stdin.readline()  # stop
    finally:
        if engine is not None:
            engine.stop()
        for member in members:
            member.stop()


# ----------------------------------------------------------------- the driver


def measure(
    base: str, kind: str, groups: int, seconds: float, window: int, size: int
) -> dict[str, float]:
    """One run of `kind` with `groups` groups over three fresh node processes."""
    root = tempfile.mkdtemp(prefix=f"{kind}-", dir=base)
    if kind == "link":  # one port per node for every group
        ports = iter(free_ports(len(NODES)))
        shared = {n: f"127.0.0.1:{next(ports)}" for n in NODES}
        layout = [dict(shared) for _ in range(groups)]
    else:
        ports = iter(free_ports(groups * len(NODES)))
        layout = [{n: f"127.0.0.1:{next(ports)}" for n in NODES} for _ in range(groups)]
    procs: list[subprocess.Popen[str]] = []
    try:
        for name in NODES:
            spec = {
                "name": name,
                "dir": os.path.join(root, name),
                "groups": layout,
                "kind": kind,
                "seconds": seconds,
                "window": window,
                "bytes": size,
            }
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "benchmarks.bench_engine", "--node", json.dumps(spec)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
        for proc in procs:
            line = proc.stdout.readline() if proc.stdout else ""
            if line.strip() != "ready":
                raise RuntimeError(f"a node process did not get ready: {line!r}")
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        counts = []
        for proc in procs:
            line = proc.stdout.readline() if proc.stdout else ""
            counts.append(json.loads(line))
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("stop\n")
            proc.stdin.flush()
        for proc in procs:
            proc.wait(timeout=30)
        commits = sum(c["commits"] for c in counts)
        elapsed = max(c["seconds"] for c in counts)
        return {
            "rate": commits / elapsed,
            "cpu": sum(c["cpu"] for c in counts) / max(commits, 1) * 10_000,
            "syncs": sum(c["syncs"] for c in counts) / max(commits, 1) * 100,
            "failed": sum(c["failed"] for c in counts),
        }
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        shutil.rmtree(root, ignore_errors=True)


def _rate(run: dict[str, float]) -> float:
    return run["rate"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", default="1,4")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--window", type=int, default=8)
    parser.add_argument("--bytes", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--kinds", default=",".join(KINDS), help="of threads, engine, link")
    parser.add_argument("--dir", default=None, help="where the data goes (a real disk)")
    parser.add_argument("--node", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.node is not None:
        _node(json.loads(args.node))
        return
    stop_on_sigterm()
    counts = [int(g) for g in args.groups.split(",")]
    chosen = tuple(k for k in KINDS if k in args.kinds.split(","))
    base = tempfile.mkdtemp(prefix="bench-engine-", dir=args.dir or os.getcwd())
    print(
        f"# bench_engine: {platform.node()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, load {os.getloadavg()[0]:.2f}, data in {base}"
    )
    print(
        f"# 3 node processes, {args.window} proposals of {args.bytes} bytes outstanding per "
        f"group per process, {args.seconds:g} s a run, fsync=always, {args.repeat} repeats"
    )
    print("| groups | per process | commits/s | CPU s / 10k commits | fdatasyncs / 100 commits |")
    print("|---:|---|---:|---:|---:|")
    try:
        results: dict[tuple[int, str], list[dict[str, float]]] = {}
        for repeat in range(args.repeat):
            for groups in counts:
                kinds = chosen if repeat % 2 == 0 else chosen[::-1]
                for kind in kinds:
                    run = measure(base, kind, groups, args.seconds, args.window, args.bytes)
                    results.setdefault((groups, kind), []).append(run)
        for groups in counts:
            for kind in chosen:
                runs = results[(groups, kind)]
                label = LABELS[kind]
                spread = "-".join(f"{r['rate']:,.0f}" for r in sorted(runs, key=_rate))
                print(
                    f"| {groups} | {label} "
                    f"| {statistics.median(r['rate'] for r in runs):,.0f} ({spread}) "
                    f"| {statistics.median(r['cpu'] for r in runs):.2f} "
                    f"| {statistics.median(r['syncs'] for r in runs):.1f} |"
                )
        for groups in counts if "threads" in chosen else ():
            base_rate = statistics.median(r["rate"] for r in results[(groups, "threads")])
            for kind in chosen[1:] if chosen[0] == "threads" else ():
                rate = statistics.median(r["rate"] for r in results[(groups, kind)])
                print(
                    f"{kind} / threads, {groups} groups (commits/s, medians): "
                    f"{rate / base_rate:.2f}x"
                )
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
