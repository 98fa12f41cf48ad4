"""What a message costs each node, by role: the measured basis of the capacity plan.

    python -m benchmarks.bench_roles [--messages 20000] [--repeat 3]

A 3-node loopback cluster (each node its own process, fsync=always), one queue. For
each workload, the CPU seconds every node process used (user + system, from `/proc`)
over the run, divided by the messages it moved:

* publish-confirm: 4 producer processes connected to the leader, each keeping up to
  256 publishes unconfirmed;
* end to end: a producer connected to the leader, a consumer on each follower (each
  follower delivers to its own), publish -> deliver -> ack;
* paced: 1,000 msg/s for `--seconds` from one producer on the leader, a consumer on a
  follower: the cost of a message that shares its Raft entry with few others (a
  group carrying a small share of a cluster's load is in this regime, not in the
  saturated ones above, whose entries carry tens of messages each).

Then the plan "Past this machine" in docs/benchmarks.md explains: a node process is
bound to about one core (Python's GIL), so one Raft group carries at most
1 / max(L, F) messages a second (L: a message's CPU on the leader, F: on a follower),
and G >= N groups spread over N nodes, 3 replicas each, at most N / (L + 2F).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

from quorumq.ops.local_cluster import Cluster

from .bench_cluster import _producer, end_to_end, paced
from .peers.common import cpu_seconds, run_producer_processes

REPLICAS = 3
PRODUCERS = 4
WINDOW = 256
PACED_RATE = 1000


def _paced_rate(cluster: Cluster, seconds: float) -> float:
    trace = paced(cluster, PACED_RATE, seconds)
    return len(trace.sent) / seconds


def publish_confirm_to_leader(cluster: Cluster, messages: int) -> float:
    """msg/s of `PRODUCERS` processes, all connected to the leader."""
    queue = f"roles-{time.monotonic_ns()}"
    leader = cluster.leader()
    with cluster.client(leader) as client:
        client.declare(queue)
    per = messages // PRODUCERS
    args = [(cluster.endpoint(leader), queue, per, WINDOW) for _ in range(PRODUCERS)]
    return run_producer_processes(_producer, args)


def per_message_cpu_us(
    cluster: Cluster, work: Callable[[], float], messages: int
) -> tuple[float, float, float]:
    """(leader µs, follower µs (the mean of both), msg/s) of CPU per message."""
    leader = cluster.leader()
    pids = {n: cluster.pid(n) for n in cluster.nodes}
    before = {n: cpu_seconds(pid) for n, pid in pids.items()}
    rate = work()
    used = {n: cpu_seconds(pid) - before[n] for n, pid in pids.items()}
    if cluster.leader() != leader:
        raise RuntimeError("leadership moved during the run: measure again")
    followers = [used[n] for n in cluster.nodes if n != leader]
    return used[leader] / messages * 1e6, statistics.mean(followers) / messages * 1e6, rate


def capacity(leader_us: float, follower_us: float, nodes: int, *, groups: bool) -> float:
    """Messages a second `nodes` nodes carry, each node process one core: one Raft
    group (its leader or its followers, whichever is busier, bound it), or enough
    groups spread evenly (every node leads 1/N of them and follows 2/N)."""
    if not groups:
        return 1e6 / max(leader_us, follower_us)
    return nodes * 1e6 / (leader_us + (REPLICAS - 1) * follower_us)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0, help="of the paced run")
    args = parser.parse_args()
    n = args.messages
    paced_n = int(PACED_RATE * args.seconds)
    print(f"load average at start: {os.getloadavg()[0]:.2f}; {n} messages a run")
    rows: dict[str, list[tuple[float, float, float]]] = {
        "publish-confirm": [],
        "end to end": [],
        f"paced {PACED_RATE:,} msg/s": [],
    }
    with Cluster(3) as cluster:
        cluster.leader()
        for _ in range(args.repeat):
            rows["publish-confirm"].append(
                per_message_cpu_us(cluster, lambda: publish_confirm_to_leader(cluster, n), n)
            )
            rows["end to end"].append(
                per_message_cpu_us(cluster, lambda: end_to_end(cluster, n, WINDOW), n)
            )
            rows[f"paced {PACED_RATE:,} msg/s"].append(
                per_message_cpu_us(cluster, lambda: _paced_rate(cluster, args.seconds), paced_n)
            )
    print()
    print("| workload | leader µs CPU/msg | follower µs CPU/msg | msg/s | runs |")
    print("|---|---:|---:|---:|---:|")
    medians: dict[str, tuple[float, float]] = {}
    for name, runs in rows.items():
        leader_us = statistics.median(r[0] for r in runs)
        follower_us = statistics.median(r[1] for r in runs)
        rate = statistics.median(r[2] for r in runs)
        medians[name] = (leader_us, follower_us)
        print(f"| {name} | {leader_us:.0f} | {follower_us:.0f} | {rate:,.0f} | {len(runs)} |")
    print()
    print("Projection, one core per node process (see docs/benchmarks.md, Past this machine):")
    print()
    print("| workload | nodes | one group, msg/s | groups spread, msg/s | x one group on 3 |")
    print("|---|---:|---:|---:|---:|")
    for name, (leader_us, follower_us) in medians.items():
        base = capacity(leader_us, follower_us, 3, groups=False)
        for nodes in (3, 9, 27):
            one = capacity(leader_us, follower_us, nodes, groups=False)
            spread = capacity(leader_us, follower_us, nodes, groups=True)
            print(f"| {name} | {nodes} | {one:,.0f} | {spread:,.0f} | {spread / base:.1f}x |")


if __name__ == "__main__":
    main()
