"""Why a chaos run's agreement check could fail with every replica in step (issue 27).

    python -m benchmarks.audit_alignment [--messages 180000] [--check-s 30]

A 3-node loopback cluster takes `--messages` small keyed messages from one idempotent
producer, then they are purged: what is left is what a chaos run leaves after its
drain, the stream view of every message (64 MiB of retention by default) and a
remembered producer, for which the leader proposes a `Tick` every second. Then, for up
to `--check-s` each:

* rounds of audits of the three nodes one after another (the check the chaos run had
  passed at the first round whose three audits were of one index, and failed after 30 s
  without one), then rounds of the three audited at once: how many rounds line up, and
  how long the audits take;
* the check the chaos run has (`simulations.chaos._agreement`): the three audited at
  once, again and again, until some index was audited on every node with one digest.

The index moves on a `Tick` a second: three audits one after another that take longer
than that together cannot all be of one index, however healthy the nodes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from quorumq.client import QuorumqError
from quorumq.ops.local_cluster import Cluster
from simulations.chaos import RaftWatch, _agreement

QUEUE = "chaos"


def _fill(cluster: Cluster, messages: int, batch: int = 1000) -> None:
    client = cluster.client()
    client.declare(QUEUE)
    sent = 0
    while sent < messages:
        n = min(batch, messages - sent)
        rows = [(b"0:%d" % (sent + i), f"p0k{(sent + i) % 4}") for i in range(n)]
        client.publish_batch(QUEUE, rows)
        sent += n
    client.purge_queue(QUEUE)


def _rounds(cluster: Cluster, check_s: float, at_once: bool) -> tuple[int, list[float], list[str]]:
    """Audit the three nodes, one after another or all at once, round after round for
    `check_s`: (rounds in which all three audits were of one index, durations, one line a
    round). The chaos run's check before issue 27 passed at the first such round of
    audits one after another, and failed after 30 s without one."""
    durations: list[float] = []
    lines: list[str] = []
    lined_up = 0

    def audit(node: str) -> tuple[int, str]:
        began = time.monotonic()
        status = cluster.status(node, audit=True)
        durations.append(time.monotonic() - began)
        return status["machine_index"], status["digest"]

    deadline = time.monotonic() + check_s
    with ThreadPoolExecutor(len(cluster.nodes)) as pool:
        while time.monotonic() < deadline:
            try:
                if at_once:
                    seen = list(pool.map(audit, cluster.nodes))
                else:
                    seen = [audit(node) for node in cluster.nodes]
            except (QuorumqError, OSError) as e:
                lines.append(f"    audit failed: {e}")
                continue
            lined_up += len(set(seen)) == 1
            lines.append(
                "    "
                + ", ".join(f"{n} {i}" for n, (i, _d) in zip(cluster.nodes, seen, strict=True))
            )
            time.sleep(0.2)
    return lined_up, durations, lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.audit_alignment")
    parser.add_argument("--messages", type=int, default=180_000)
    parser.add_argument("--check-s", type=float, default=30.0)
    args = parser.parse_args(argv)
    began = time.monotonic()
    with Cluster(3, log_level="info") as cluster:
        _fill(cluster, args.messages)
        status = cluster.status(cluster.leader())
        queue = status["queues"][QUEUE]
        print(
            f"{args.messages} messages published and purged in {time.monotonic() - began:.0f} s: "
            f"stream view {queue['first_retained']}-{queue['next_offset']}, "
            f"producers {queue['producers']}, index {status['machine_index']}; "
            f"load average {os.getloadavg()[0]:.2f}"
        )
        for at_once in (False, True):
            lined_up, durations, rounds = _rounds(cluster, args.check_s, at_once)
            how = "all at once" if at_once else "one after another"
            print(
                f"{how}: {lined_up} of {len(rounds)} rounds lined up; audits took "
                f"{statistics.median(durations):.2f} s (median), {max(durations):.2f} s "
                f"(longest); load average {os.getloadavg()[0]:.2f}"
                if durations
                else f"{how}: no audit succeeded"
            )
            for line in rounds[:6]:
                print(line)
        watch = RaftWatch(cluster, lambda: time.monotonic() - began)
        watch.start()
        try:
            agreement = _agreement(
                cluster, watch, lambda: time.monotonic() - began, timeout_s=args.check_s
            )
        finally:
            watch.stop()
        print(f"all at once: {agreement.verdict} ({agreement.detail})")
        for evidence in agreement.evidence:
            for line in evidence.render():
                print(line)
        print(f"load average {os.getloadavg()[0]:.2f}")
    return 0 if agreement.agreed else 1


if __name__ == "__main__":
    sys.exit(main())
