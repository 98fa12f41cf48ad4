"""What pausing one node does to many queues (issue 33: "with 6 queues, pausing any one
node stalls at most 4 of them"), measured before there are many Raft groups.

    python -m benchmarks.bench_spread [--queues 6] [--pause-seconds 3] [--groups 3]
                                      [--node-groups 3]

Every queue gets a process of its own publishing to it at `--rate` msg/s with confirms,
through a node that stays up; `--pause-at` seconds in, one node is stopped (SIGSTOP:
its connections stay open, as with a host that hangs) and `--pause-seconds` later it is
continued. For each queue the stall is the longest time without a confirm from the
pause to two seconds after the continue; a queue stalled if that is at least
`STALLED_S`. Each system has each of its nodes paused in turn (quorumq: the leader and
the followers of its one Raft group; RabbitMQ: every node, each leading a third of the
quorum queues, declared round robin). With `--groups N`, N separate quorumq clusters
stand in for N Raft groups (nothing in quorumq places queues on groups yet): the queues
round robin over them, their leaders steered onto hosts A, B, C, ... (`steer_leader`),
and a host, the node of that name in every cluster, paused whole. With `--node-groups
N`, one quorumq cluster whose nodes host N Raft groups each (`quorumq node --groups`):
queues placed over the groups at declare, their leaders spread by the nodes themselves
(each group's preferred node), each node paused in turn.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import itertools
import multiprocessing as mp
import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from quorumq.client import Client, QuorumqError
from quorumq.ops.local_cluster import Cluster

from .peers.common import Trace, message_body, publish_paced, stop_on_sigterm, take_message
from .peers.rabbitmq import RabbitCluster, _declare, _delete, _Producer, rabbitmq_missing

STALLED_S = 0.25
"""A queue with no confirm for this long while a node is paused counts as stalled (at
the default 50 msg/s a queue confirms every 20 ms)."""


def _paced(publish: Callable[[int], None], rate: int, seconds: float) -> None:
    """Call `publish(i)` at `rate` a second for `seconds` (a message due while the
    publisher was held is sent as soon as it can be)."""
    began = time.monotonic()
    for i in range(int(rate * seconds)):
        delay = began + i / rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        publish(i)


def _quorumq_queue(
    queue: str, endpoint: str, rate: int, seconds: float, start: Any, out: Any
) -> None:
    """One queue's publisher process: confirm times (monotonic) on `out`."""
    try:
        client = Client([endpoint])
        client.declare(queue)
        total = int(rate * seconds)
        confirmed: list[float] = []
        failed = [0]
        lock = threading.Lock()
        answered = threading.Event()

        def publish(i: int) -> None:
            def done(f: Any) -> None:
                with lock:
                    if f.exception() is None:
                        confirmed.append(time.monotonic())
                    else:
                        failed[0] += 1
                    if len(confirmed) + failed[0] >= total:
                        answered.set()

            client.publish_async(queue, message_body(i)).add_done_callback(done)

        out.put(("ready", queue))
        start.wait()
        _paced(publish, rate, seconds)
        answered.wait(30)  # (unanswered by then: reported as not confirmed)
        client.close()
        with lock:
            out.put(("done", queue, list(confirmed), failed[0]))
    except Exception as e:
        out.put(("error", queue, f"{type(e).__name__}: {e}"))


def _rabbit_queue(queue: str, url: str, rate: int, seconds: float, start: Any, out: Any) -> None:
    """As `_quorumq_queue`, against a RabbitMQ quorum queue (declared by the parent)."""

    async def main() -> None:
        producer = _Producer([url], queue)
        await producer.connect()
        confirmed: list[float] = []
        out.put(("ready", queue))
        await asyncio.get_running_loop().run_in_executor(None, start.wait)

        async def one(i: int) -> None:
            await producer.publish(i)
            confirmed.append(time.monotonic())

        with contextlib.suppress(TimeoutError):  # (unanswered by then: not confirmed)
            await asyncio.wait_for(publish_paced(Trace(rate), seconds, one), seconds + 30)
        producer.close()
        out.put(("done", queue, confirmed, int(rate * seconds) - len(confirmed)))

    try:
        asyncio.run(main())
    except Exception as e:
        out.put(("error", queue, f"{type(e).__name__}: {e}"))


def stall_s(confirms: list[float], paused: float, until: float) -> float:
    """The longest time in [paused, until] with no confirm."""
    inside = sorted(t for t in confirms if paused <= t <= until)
    edges = [paused, *inside, until]
    return max(b - a for a, b in itertools.pairwise(edges))


def run_paused(
    target: Callable[..., None],
    routes: list[tuple[str, str]],
    rate: int,
    pause_at: float,
    pause_s: float,
    pause: Callable[[], None],
    resume: Callable[[], None],
) -> dict[str, dict[str, float]]:
    """One process per (queue, endpoint) publishing for `pause_at + pause_s + 3` s; the
    node paused `pause_at` s after they start, continued `pause_s` later. Per queue:
    its stall (s) and the publishes that failed."""
    seconds = pause_at + pause_s + 3
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=target, args=(q, e, rate, seconds, start, out), daemon=True)
        for q, e in routes
    ]
    for p in procs:
        p.start()

    def take(within: float) -> Any:
        return take_message(out, procs, within)

    paused: float | None = None
    continued = results_taken = False
    try:
        for _ in procs:
            message = take(120)
            if message[0] != "ready":
                raise RuntimeError(f"publisher failed before start: {message}")
        began = time.monotonic()
        start.set()
        time.sleep(max(0.0, began + pause_at - time.monotonic()))
        paused = time.monotonic()  # (set first: a signal during `pause` still continues it)
        pause()
        time.sleep(pause_s)
        resume()
        continued = True
        resumed_at = time.monotonic()
        results = {}
        for _ in procs:
            message = take(seconds + 60)
            if message[0] != "done":
                raise RuntimeError(f"publisher failed: {message}")
            _, queue, confirms, failed = message
            stall = stall_s(confirms, paused, resumed_at + 2)
            results[queue] = {"stall_s": stall, "failed": failed}
        results_taken = True
        return results
    finally:
        if paused is not None and not continued:  # (a second SIGCONT is harmless)
            with contextlib.suppress(OSError):
                resume()
        for p in procs:  # done, or (an error, a signal) stopped at once
            p.join(timeout=30 if results_taken else 0)
            if p.is_alive():
                p.kill()
                p.join()


def _summary(name: str, by_queue: dict[str, dict[str, float]]) -> str:
    stalls = sorted((r["stall_s"] for r in by_queue.values()), reverse=True)
    stalled = sum(s >= STALLED_S for s in stalls)
    failed = sum(int(r["failed"]) for r in by_queue.values())
    shown = ", ".join(f"{s:.2f}" for s in stalls)
    return f"| {name} | {stalled} of {len(stalls)} | {shown} | {failed} |"


def _agreed_leader(cluster: Cluster, among: list[str], timeout: float = 30.0) -> str:
    """The leader the nodes `among` agree on (the others may be paused)."""
    deadline = time.monotonic() + timeout
    while True:
        seen = set()
        for node in among:
            try:
                seen.add(cluster.status(node)["leader"])
            except (QuorumqError, OSError):
                seen.add(None)
        if len(seen) == 1 and None not in seen and seen <= set(among):
            return str(seen.pop())
        if time.monotonic() > deadline:
            raise RuntimeError(f"{among} agreed on no leader within {timeout} s (seen {seen})")
        time.sleep(0.05)


def steer_leader(cluster: Cluster, wanted: str, tries: int = 20) -> None:
    """Make `wanted` the cluster's leader with nothing but pauses: while another node
    leads, pause it until the rest elect a new leader, then continue it (it rejoins as a
    follower). quorumq has no command to move a leader yet (issue 33's placement); this
    is the benchmark placing the leaders of separate clusters, the groups to come."""
    for _ in range(tries):
        leader = cluster.leader(timeout=30)
        if leader == wanted:
            return
        try:
            cluster.pause(leader)
            _agreed_leader(cluster, [n for n in cluster.nodes if n != leader])
        finally:
            cluster.resume(leader)
    raise RuntimeError(f"{wanted} did not become the leader in {tries} tries")


def _on_host(clusters: list[Cluster], action: str, host: str) -> None:
    """Pause or continue the node named `host` in every cluster (one host's processes);
    every cluster is tried, the first failure raised after."""
    failures = []
    for cluster in clusters:
        try:
            getattr(cluster, action)(host)
        except OSError as e:
            failures.append(e)
    if failures:
        raise failures[0]


def _leader_and_term(cluster: Cluster) -> tuple[str, int]:
    """The cluster's agreed leader and its Raft term."""
    leader = cluster.leader(timeout=30)
    return leader, int(cluster.status(leader)["term"])


def _groups_paused(
    clusters: list[Cluster], queues: int, timing: tuple[int, float, float], run: int
) -> list[str]:
    """Queue q in cluster q mod len(clusters), cluster g led by node g mod 3 (its name in
    every cluster is a host's); each host paused in turn: one node of every cluster."""
    rows = []
    hosts = clusters[0].nodes
    for host in hosts:
        for g, cluster in enumerate(clusters):
            steer_leader(cluster, hosts[g % len(hosts)])
        other = next(n for n in hosts if n != host)
        routes = [
            (
                f"spread-{run}-{host}-{q}-{time.monotonic_ns()}",
                clusters[q % len(clusters)].endpoint(other),
            )
            for q in range(queues)
        ]
        seen: dict[str, Any] = {}

        def pause(host: str = host, seen: dict[str, Any] = seen) -> None:
            # who leads each cluster, and its term, read just before the pause (a leader
            # moved since it was steered is counted where it is)
            seen["before"] = [_leader_and_term(c) for c in clusters]
            _on_host(clusters, "pause", host)

        result = run_paused(
            _quorumq_queue,
            routes,
            *timing,
            pause,
            functools.partial(_on_host, clusters, "resume", host),
        )
        after = [_leader_and_term(c) for c in clusters]
        before = seen["before"]
        led = sum(1 for q in range(queues) if before[q % len(clusters)][0] == host)
        elected = sum(1 for b, a in zip(before, after, strict=True) if a[1] > b[1])
        name = f"quorumq, {len(clusters)} groups, leaders spread: host {host}, leading {led}"
        rows.append(_summary(f"{name} of {queues}, paused ({elected} new terms)", result))
        print(rows[-1], flush=True)
    return rows


def _groups_led(cluster: Cluster, node: str) -> list[str | None]:
    return [g["leader"] for g in cluster.status(node)["groups"]]


def _node_groups_paused(
    cluster: Cluster, groups: int, queues: int, timing: tuple[int, float, float], run: int
) -> list[str]:
    """One cluster of nodes hosting `groups` Raft groups: wait until the leaders are
    spread (group g led by the (g mod 3)-th node), then pause each node in turn."""
    rows = []
    nodes = cluster.nodes
    spread = [nodes[g % len(nodes)] for g in range(groups)]
    for node in nodes:
        other = next(n for n in nodes if n != node)
        deadline = time.monotonic() + 60
        while (led_now := _groups_led(cluster, other)) != spread:
            if time.monotonic() > deadline:
                raise RuntimeError(f"leaders not spread within 60 s: {led_now}")
            time.sleep(0.2)
        routes = [
            (f"spread-{run}-{node}-{q}-{time.monotonic_ns()}", cluster.endpoint(other))
            for q in range(queues)
        ]
        seen: dict[str, Any] = {}

        def pause(node: str = node, other: str = other, seen: dict[str, Any] = seen) -> None:
            seen["before"] = cluster.status(other)["groups"]
            cluster.pause(node)

        result = run_paused(
            _quorumq_queue, routes, *timing, pause, functools.partial(cluster.resume, node)
        )
        after = cluster.status(other)["groups"]
        before = seen["before"]
        led = sum(g["leader"] == node for g in before)
        elected = sum(a["term"] > b["term"] for b, a in zip(before, after, strict=True))
        name = f"quorumq, {groups} groups in each node: {node} leading {led} of them"
        rows.append(_summary(f"{name}, paused ({elected} new terms)", result))
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_spread")
    parser.add_argument("--queues", type=int, default=6)
    parser.add_argument("--rate", type=int, default=50, help="msg/s per queue")
    parser.add_argument("--pause-at", type=float, default=2.0)
    parser.add_argument("--pause-seconds", type=float, default=3.0)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument(
        "--groups", type=int, default=1, help="separate clusters standing in for groups (1: none)"
    )
    parser.add_argument(
        "--node-groups", type=int, default=0, help="also one cluster of nodes hosting N groups"
    )
    parser.add_argument("--no-rabbitmq", action="store_true")
    args = parser.parse_args()
    stop_on_sigterm()
    skip_rabbit = "--no-rabbitmq" if args.no_rabbitmq else rabbitmq_missing()
    rows: list[str] = []
    timing = (args.rate, args.pause_at, args.pause_seconds)
    with (
        tempfile.TemporaryDirectory(prefix="quorumq-bench-spread-") as root,
        contextlib.ExitStack() as stack,
    ):
        path = Path(root) / "quorumq"
        path.mkdir()
        cluster = stack.enter_context(Cluster(3, str(path), node_down_grace=30.0))
        groups = []
        for g in range(args.groups if args.groups > 1 else 0):
            path = Path(root) / f"group{g}"
            path.mkdir()
            groups.append(stack.enter_context(Cluster(3, str(path), node_down_grace=30.0)))
        node_groups = None
        if args.node_groups > 1:
            path = Path(root) / "node-groups"
            path.mkdir()
            node_groups = stack.enter_context(
                Cluster(3, str(path), node_down_grace=30.0, groups=args.node_groups)
            )
        rabbit = None
        if skip_rabbit is None:
            path = Path(root) / "rabbitmq"
            path.mkdir()
            rabbit = stack.enter_context(RabbitCluster(root=str(path)))
        else:
            print(f"RabbitMQ skipped: {skip_rabbit}")
        for run in range(args.repeat):
            for role in ("its leader", "a follower", "the other follower"):
                leader = cluster.leader(timeout=30)  # settled again after the last pause
                followers = [n for n in cluster.nodes if n != leader]
                node = {"its leader": leader, "a follower": followers[0]}.get(role, followers[-1])
                other = next(n for n in cluster.nodes if n != node)
                routes = [
                    (f"spread-{run}-{node}-{q}-{time.monotonic_ns()}", cluster.endpoint(other))
                    for q in range(args.queues)
                ]
                result = run_paused(
                    _quorumq_queue,
                    routes,
                    *timing,
                    functools.partial(cluster.pause, node),
                    functools.partial(cluster.resume, node),
                )
                rows.append(_summary(f"quorumq (one Raft group), {role} paused", result))
                print(rows[-1], flush=True)
            if groups:
                rows += _groups_paused(groups, args.queues, timing, run)
            if node_groups is not None:
                rows += _node_groups_paused(node_groups, args.node_groups, args.queues, timing, run)
            if rabbit is not None:
                nodes = rabbit.nodes
                for node in nodes:
                    other = next(n for n in nodes if n != node)
                    routes = []
                    pid = rabbit.pid(node)
                    try:
                        for q in range(args.queues):
                            name = f"spread-{run}-{q}-{time.monotonic_ns()}"
                            asyncio.run(_declare(rabbit.url(nodes[q % len(nodes)]), name))
                            routes.append((name, rabbit.url(other)))
                        result = run_paused(
                            _rabbit_queue,
                            routes,
                            *timing,
                            functools.partial(os.kill, pid, signal.SIGSTOP),
                            functools.partial(os.kill, pid, signal.SIGCONT),
                        )
                    finally:
                        for name, url in routes:
                            with contextlib.suppress(Exception):
                                asyncio.run(_delete(url, name))
                    led = sum(1 for q in range(args.queues) if nodes[q % len(nodes)] == node)
                    rows.append(
                        _summary(f"RabbitMQ, a node leading {led} of {args.queues} paused", result)
                    )
                    print(rows[-1], flush=True)
    print()
    print(
        f"{args.queues} queues at {args.rate} msg/s each; one node (or host) paused "
        f"{args.pause_seconds} s; "
        f"a queue stalled if it had no confirm for {STALLED_S} s or more"
    )
    print()
    print("| paused | queues stalled | each queue's stall, s | publishes failed |")
    print("|---|---:|---|---:|")
    for row in rows:
        print(row)


if __name__ == "__main__":
    main()
