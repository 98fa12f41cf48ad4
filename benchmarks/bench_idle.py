"""What an idle cluster costs, and how fast it fails over: real node processes.

    python -m benchmarks.bench_idle [--seconds 20] [--kills 3]

* Idle CPU of a 3-node cluster (all three processes, % of one core) and their threads'
  wake-ups per second (context switches), twice: just started, with no queue; and
  after traffic (a queue declared, messages published, consumed and acked), which
  leaves producers remembered for a week.
* Failover on the idle cluster: the leader killed (SIGKILL: its connections close) and
  the leader stopped (SIGSTOP: its connections stay open, as with a host lost or a
  partition). Seconds from the signal until a publish through a surviving node is
  confirmed; the node is then restarted (or continued) and the cluster left to settle.

To compare two versions, run this file against each, side by side in one session,
from outside both checkouts (`cd /tmp && PYTHONPATH=<checkout> python
<checkout>/benchmarks/bench_idle.py`): the nodes run the code `quorumq` imports.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import time
from pathlib import Path

from benchmarks.peers.common import cpu_seconds
from quorumq.client import Client
from quorumq.ops.local_cluster import Cluster

SETTLE_S = 3.0
"""After start-up or traffic: the last acks commit, the cluster goes idle."""


def wakeups(pid: int) -> int:
    """Context switches of all of `pid`'s threads so far (each a wake-up, about)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            text = (task / "status").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                total += int(line.split()[1])
    return total


def idle_sample(cluster: Cluster, seconds: float) -> tuple[float, float]:
    """(% of one core, wake-ups per second) of the cluster's processes over `seconds`."""
    pids = [cluster.pid(n) for n in cluster.nodes]
    cpu0, wake0 = sum(map(cpu_seconds, pids)), sum(map(wakeups, pids))
    time.sleep(seconds)
    cpu1, wake1 = sum(map(cpu_seconds, pids)), sum(map(wakeups, pids))
    return 100 * (cpu1 - cpu0) / seconds, (wake1 - wake0) / seconds


def traffic(cluster: Cluster, messages: int) -> None:
    """Publish `messages` to a new queue, consume and ack them all."""
    client = cluster.client()
    client.declare("idle-bench")
    for i in range(messages):
        client.publish("idle-bench", b"x" * 100, key=f"k{i % 10}")
    consumer = client.subscribe("idle-bench", prefetch=100)
    for _ in range(messages):
        consumer.get(timeout=10).ack()
    consumer.cancel()


def settle(cluster: Cluster) -> str:
    """Wait until every node agrees on a leader and has caught up; then idle a while."""
    leader = cluster.leader(timeout=30)
    deadline = time.monotonic() + 30
    while True:
        states = [cluster.status(n) for n in cluster.nodes]
        if len({s["commit_index"] for s in states}) == 1:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"the nodes did not catch up: {states}")
        time.sleep(0.1)
    time.sleep(SETTLE_S)
    return leader


def failover(cluster: Cluster, how: signal.Signals) -> float:
    """Seconds from `how` sent to the idle leader until a publish through a surviving
    node is confirmed; then the leader runs again and the cluster settles."""
    leader = settle(cluster)
    survivors = [n for n in cluster.nodes if n != leader]
    client = Client([cluster.endpoint(n) for n in survivors], None, timeout=30.0)
    try:
        client.declare("failover-bench")
        client.publish("failover-bench", b"before")
        time.sleep(SETTLE_S)  # idle again
        started = time.monotonic()
        if how is signal.SIGKILL:
            cluster.kill(leader)
        else:
            os.kill(cluster.pid(leader), how)
        client.publish("failover-bench", b"after")
        took = time.monotonic() - started
        new = cluster.status(survivors[0])["leader"]
        if new in (None, leader):  # the signal must have struck the leader
            raise RuntimeError(f"after {how.name} of {leader}, {survivors[0]} names {new}")
    finally:
        client.close()
        if how is signal.SIGKILL:
            cluster.restart(leader)
        else:
            os.kill(cluster.pid(leader), signal.SIGCONT)
    return took


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_idle")
    parser.add_argument("--seconds", type=float, default=20.0, help="each idle CPU sample")
    parser.add_argument("--kills", type=int, default=3, help="failovers of each kind (0: none)")
    parser.add_argument("--messages", type=int, default=200, help="the traffic before")
    args = parser.parse_args(argv)
    with Cluster(3, fsync="always") as cluster:
        settle(cluster)
        fresh = idle_sample(cluster, args.seconds)
        print(f"idle, fresh:         {fresh[0]:5.2f}% of a core, {fresh[1]:6.0f} wake-ups/s")
        traffic(cluster, args.messages)
        settle(cluster)
        used = idle_sample(cluster, args.seconds)
        print(f"idle, after traffic: {used[0]:5.2f}% of a core, {used[1]:6.0f} wake-ups/s")
        for how in (signal.SIGKILL, signal.SIGSTOP) if args.kills else ():
            took = [failover(cluster, how) for _ in range(args.kills)]
            print(
                f"idle leader {how.name}: confirm after {statistics.median(took):.3f} s median,"
                f" {max(took):.3f} s max ({', '.join(f'{t:.3f}' for t in took)})",
                flush=True,
            )


if __name__ == "__main__":
    main()
