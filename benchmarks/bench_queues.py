"""Many queues end to end, before there is an engine for many groups (issue 33): what
spreading queues over more Raft groups can gain on this machine, measured.

    python -m benchmarks.bench_queues [--queues 16] [--messages 16000] [--repeat 3]

Each queue gets its own client process (a producer on the queue's leader, one consumer
on a follower, acking), all started together; the figure is every message published,
delivered and acked over the time from the start to the last queue's end. Run side by
side, interleaved run by run:

* quorumq, one 3-node cluster (one Raft group) with 1 queue, and with `--queues`;
* quorumq, three 3-node clusters (three Raft groups, nine processes) with `--queues`
  spread over them: what separate groups give with no shared write-ahead log, no group
  commit and no shared connections, each group in processes of its own (an upper bound
  for groups as threads of one process, which share one interpreter lock);
* RabbitMQ (if installed) with 1 queue and with `--queues` quorum queues, their leaders
  placed round robin over the nodes (client-local declares).

Server CPU seconds per 100,000 messages are read from /proc for every server process.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

from quorumq.ops.local_cluster import Cluster

from .bench_cluster import QuorumqSystem, end_to_end_queues
from .peers.common import cpu_seconds, stop_on_sigterm
from .peers.rabbitmq import RabbitCluster, RabbitSystem, rabbitmq_missing

_Case = tuple[str, Callable[[], list[int]], Callable[[], float], Callable[[], int] | None]
"""(its name, its servers' pids, the run, Raft entries so far or None)."""


def _commit_indexes(clusters: list[Cluster]) -> int:
    """Raft entries committed so far, summed over the clusters (their leaders' view)."""
    return sum(int(c.status(c.leader())["commit_index"]) for c in clusters)


def _measured(
    pids: Callable[[], list[int]],
    run: Callable[[], float],
    messages: int,
    entries: Callable[[], int] | None = None,
) -> dict[str, float]:
    """msg/s of `run`, the server CPU s per 100,000 messages it took and (quorumq) the
    Raft entries it took per message, publishes and acks together."""
    before = {p: cpu_seconds(p) for p in pids()}
    entries_before = entries() if entries is not None else 0
    rate = run()
    cpu = sum(cpu_seconds(p) - c for p, c in before.items())
    result = {"msg_s": rate, "cpu_per_100k": cpu / messages * 100_000}
    if entries is not None:
        result["entries_per_msg"] = (entries() - entries_before) / messages
    return result


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_queues")
    parser.add_argument("--queues", type=int, default=16)
    parser.add_argument("--messages", type=int, default=16_000, help="per run, over all queues")
    parser.add_argument("--window", type=int, default=500)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--no-rabbitmq", action="store_true")
    args = parser.parse_args()
    if args.messages < args.queues:
        parser.error("--messages must be at least --queues (each queue carries some)")
    stop_on_sigterm()
    q, m, w = args.queues, args.messages, args.window
    skip_rabbit = "--no-rabbitmq" if args.no_rabbitmq else rabbitmq_missing()
    results: dict[str, list[dict[str, float]]] = {}
    with (
        tempfile.TemporaryDirectory(prefix="quorumq-bench-queues-") as root,
        contextlib.ExitStack() as stack,
    ):

        def cluster(name: str) -> Cluster:
            path = Path(root) / name
            path.mkdir()
            return stack.enter_context(Cluster(3, str(path), node_down_grace=30.0))

        one = QuorumqSystem(cluster("one"))
        three = [cluster(f"group{i}") for i in range(3)]

        def in_one() -> int:
            return _commit_indexes([one.cluster])

        cases: list[_Case] = [
            (
                "quorumq, 1 group, 1 queue",
                one.pids,
                lambda: one.end_to_end_queues(1, m, w),
                in_one,
            ),
            (
                f"quorumq, 1 group, {q} queues",
                one.pids,
                lambda: one.end_to_end_queues(q, m, w),
                in_one,
            ),
            (
                f"quorumq, 3 groups (9 processes), {q} queues",
                lambda: [c.pid(n) for c in three for n in c.nodes if c.alive(n)],
                lambda: end_to_end_queues(three, q, m, w),
                lambda: _commit_indexes(three),
            ),
        ]
        if skip_rabbit is None:
            path = Path(root) / "rabbitmq"
            path.mkdir()
            rabbit = RabbitSystem(stack.enter_context(RabbitCluster(root=str(path))))
            cases += [
                ("RabbitMQ, 1 queue", rabbit.pids, lambda: rabbit.end_to_end_queues(1, m, w), None),
                (
                    f"RabbitMQ, {q} quorum queues",
                    rabbit.pids,
                    lambda: rabbit.end_to_end_queues(q, m, w),
                    None,
                ),
            ]
        else:
            print(f"RabbitMQ skipped: {skip_rabbit}")
        for run in range(args.repeat):
            for name, pids, measure, entries in cases:
                result = _measured(pids, measure, m, entries)
                results.setdefault(name, []).append(result)
                print(f"run {run + 1}: {name}: {_shown(result)}", flush=True)
    print()
    print(
        "| setup | end-to-end msg/s, median (min-max) | server CPU s per 100k msgs "
        "| Raft entries per message |"
    )
    print("|---|---:|---:|---:|")
    for name, runs in results.items():
        rates = sorted(r["msg_s"] for r in runs)
        cpu = statistics.median(r["cpu_per_100k"] for r in runs)
        per = [r["entries_per_msg"] for r in runs if "entries_per_msg" in r]
        entries_cell = f"{statistics.median(per):.3f}" if per else "-"
        print(
            f"| {name} | {statistics.median(rates):,.0f} ({rates[0]:,.0f}-{rates[-1]:,.0f}) "
            f"| {cpu:.1f} | {entries_cell} |"
        )


def _shown(result: dict[str, float]) -> str:
    shown = f"{result['msg_s']:,.0f} msg/s, {result['cpu_per_100k']:.1f} server CPU s per 100k"
    if "entries_per_msg" in result:
        shown += f", {result['entries_per_msg']:.3f} Raft entries per message"
    return shown


if __name__ == "__main__":
    main()
