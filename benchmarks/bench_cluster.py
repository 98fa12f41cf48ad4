"""A 3-node loopback cluster (each node its own process), measured through the real path:
client -> server -> Raft (fsync=always) -> machine -> server -> client.

    python -m benchmarks.bench_cluster [--messages 20000] [--repeat 3]

Workloads, each repeated and interleaved with the baseline so that drift on a shared
machine hits both alike:

* publish-confirm msg/s: 100-byte random payloads, 1 producer and 16 producer processes,
  each keeping up to `--window` publishes in flight;
* end to end: publish -> deliver -> ack msg/s, consumers on the two followers;
* confirm latency p50/p99 at a fixed 1,000 msg/s (one producer, paced);
* failover: leader SIGKILL while publishing at 1,000 msg/s -> first confirm of a
  message sent after it;
* baseline: PySyncObj's own `batteries.ReplQueue`, 3 processes, pipelined `put`s.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from importlib.metadata import version
from typing import Any

from quorumq.client import Client, Consumer, Delivery, QuorumqError
from quorumq.ops.local_cluster import Cluster, free_ports

from .peers.common import (
    PAYLOAD,
    Trace,
    message_body,
    message_index,
    run_producer_processes,
    wait_until,
)

DURABILITY = "fsync=always: every replica fdatasyncs an entry before acknowledging it"


def _producer(endpoint: str, queue: str, n: int, window: int, start: Any, out: Any) -> None:
    """One producer process (see `run_producer_processes`)."""
    try:
        client = Client([endpoint])
        out.put("ready")
        start.wait()
        publish_windowed(client, queue, range(n), window)
        client.close()
        out.put(n)
    except Exception as e:
        out.put(f"{type(e).__name__}: {e}")


def publish_windowed(client: Client, queue: str, indexes: Iterable[int], window: int) -> None:
    """Publish the numbered messages with at most `window` unconfirmed (in halves)."""
    in_flight: list[Future[dict[str, Any]]] = []
    for i in indexes:
        in_flight.append(client.publish_async(queue, message_body(i)))
        if len(in_flight) >= window:
            for f in in_flight[: window // 2]:
                f.result(60)
            del in_flight[: window // 2]
    for f in in_flight:
        f.result(60)


def publish_confirm(cluster: Cluster, producers: int, messages: int, window: int) -> float:
    """msg/s of `producers` processes (spread over the nodes) publishing and confirming."""
    queue = f"pc-{producers}-{time.monotonic_ns()}"
    with cluster.client() as c:
        c.declare(queue)
    per = messages // producers
    live = [n for n in cluster.nodes if cluster.alive(n)]
    args = [(cluster.endpoint(live[i % len(live)]), queue, per, window) for i in range(producers)]
    return run_producer_processes(_producer, args)


def _consume_in_thread(
    consumer: Consumer, on_delivery: Callable[[Delivery], None]
) -> Callable[[], None]:
    """Ack every delivery of `consumer` in a thread after `on_delivery`; returns a stop
    that ends the thread and closes the consumer's client."""
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            d = consumer.get(timeout=0.1)
            if d is not None:
                on_delivery(d)
                d.ack()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def stop_and_join() -> None:
        stop.set()
        thread.join(timeout=10)
        consumer.client.close()

    return stop_and_join


def end_to_end(cluster: Cluster, messages: int, window: int) -> float:
    """publish -> deliver -> ack msg/s: producer on the leader, consumers on the followers."""
    queue = f"e2e-{time.monotonic_ns()}"
    leader = cluster.leader()
    followers = [n for n in cluster.nodes if n != leader]
    producer = cluster.client(leader)
    producer.declare(queue)
    received = [0]
    lock = threading.Lock()
    done = threading.Event()

    def count(_d: Delivery) -> None:
        with lock:
            received[0] += 1
            if received[0] >= messages:
                done.set()

    stops = [
        _consume_in_thread(cluster.client(f).subscribe(queue, prefetch=window), count)
        for f in followers
    ]
    began = time.perf_counter()
    publish_windowed(producer, queue, range(messages), window)
    finished = done.wait(300)
    elapsed = time.perf_counter() - began
    for stop in stops:
        stop()
    producer.close()
    if not finished:
        raise RuntimeError(f"only {received[0]} of {messages} messages delivered in 300 s")
    return messages / elapsed


Route = tuple[str, str, str]
"""One queue of a many-queues run: (its name, its leader's endpoint, a follower's)."""


def _queue_process(route: Route, n: int, window: int, start: Any, out: Any) -> None:
    """One queue's client process (see `run_producer_processes`): publish `n` to the
    queue's leader, consume and ack them on a follower; reports once all are delivered."""
    queue, leader, follower = route
    try:
        producer = Client([leader])
        producer.declare(queue)
        got = [0]
        done = threading.Event()

        def count(_d: Delivery) -> None:
            got[0] += 1
            if got[0] >= n:
                done.set()

        stop = _consume_in_thread(Client([follower]).subscribe(queue, prefetch=window), count)
        out.put("ready")
        start.wait()
        publish_windowed(producer, queue, range(n), window)
        finished = done.wait(300)
        # counted before the teardown (stopping the consumer's thread takes up to 0.1 s)
        out.put(n if finished else f"only {got[0]} of {n} delivered in 300 s")
        stop()
        producer.delete_queue(queue, force=True)  # as the peers' runs delete theirs
        producer.close()
    except Exception as e:
        out.put(f"{type(e).__name__}: {e}")


def end_to_end_queues(clusters: list[Cluster], queues: int, messages: int, window: int) -> float:
    """publish -> deliver -> ack msg/s of `queues` queues at once, `messages` in all, each
    with a client process of its own; queue q lives in `clusters[q % len(clusters)]`
    (one cluster: one Raft group), its consumer on a follower."""
    leaders = [c.leader() for c in clusters]
    tag = time.monotonic_ns()
    routes = []
    for q in range(queues):
        cluster, leader = clusters[q % len(clusters)], leaders[q % len(clusters)]
        followers = [n for n in cluster.nodes if n != leader]
        follower = followers[q // len(clusters) % len(followers)]
        routes.append((f"e2eq-{tag}-{q}", cluster.endpoint(leader), cluster.endpoint(follower)))
    return run_producer_processes(_queue_process, [(r, messages // queues, window) for r in routes])


def paced(cluster: Cluster, rate: int, seconds: float, kill_at: float | None = None) -> Trace:
    """Publish at `rate` msg/s to the leader with a consumer on a follower; with
    `kill_at`, SIGKILL the leader that many seconds in (and restart it afterwards)."""
    queue = f"lat-{time.monotonic_ns()}"
    leader = cluster.leader()
    follower = next(n for n in cluster.nodes if n != leader)
    client = cluster.client(leader, timeout=60.0)
    client.declare(queue)
    trace = Trace(rate)
    stop = _consume_in_thread(
        cluster.client(follower).subscribe(queue, prefetch=1000),
        lambda d: trace.on_delivery(message_index(d.body), d.redelivered),
    )
    answered = threading.Semaphore(0)
    """One release per publish answered: the futures are not kept (25,000 futures held
    to the end made this process's garbage collector pause for 120 ms at 5,000 msg/s,
    which showed as quorumq's p99.9; bench_path found it)."""
    began = time.perf_counter()
    for i in range(int(rate * seconds)):
        delay = began + i / rate - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        if (
            kill_at is not None
            and trace.killed_at is None
            and time.perf_counter() - began >= kill_at
        ):
            cluster.kill(leader)
            trace.killed_at = time.perf_counter()
        trace.sent.append(time.perf_counter())
        f = client.publish_async(queue, message_body(i))
        f.add_done_callback(lambda f, i=i: _answered(f, i, trace, answered))
    deadline = time.monotonic() + 60
    for _ in range(int(rate * seconds)):  # an unconfirmed message is counted, not raised
        if not answered.acquire(timeout=max(0.0, deadline - time.monotonic())):
            break
    with contextlib.suppress(RuntimeError):
        wait_until(trace.all_delivered, 60, "deliveries", interval=0.02)
    stop()
    client.close()
    if kill_at is not None:
        cluster.restart(leader)
    return trace


def _answered(
    future: Future[dict[str, Any]], index: int, trace: Trace, answered: threading.Semaphore
) -> None:
    if future.exception() is None:
        trace.on_confirm(index)
    answered.release()


class QuorumqSystem:
    """The comparison's workloads against an embedded 3-node `Cluster`."""

    name = "quorumq"
    durability = DURABILITY

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.version = f"quorumq {version('quorumq')}"

    def server_pids(self) -> dict[str, int]:
        return {n: self.cluster.pid(n) for n in self.cluster.nodes if self.cluster.alive(n)}

    def pids(self) -> list[int]:
        return list(self.server_pids().values())

    def raft_term(self) -> int:
        """The highest Raft term a live node reports: its growth counts elections."""
        terms = []
        for node in self.cluster.nodes:
            if self.cluster.alive(node):
                with contextlib.suppress(QuorumqError, OSError):
                    terms.append(int(self.cluster.status(node)["term"]))
        return max(terms, default=0)

    def publish_confirm(self, producers: int, messages: int, window: int) -> float:
        return publish_confirm(self.cluster, producers, messages, window)

    def end_to_end(self, messages: int, window: int) -> float:
        return end_to_end(self.cluster, messages, window)

    def end_to_end_queues(self, queues: int, messages: int, window: int) -> float:
        return end_to_end_queues([self.cluster], queues, messages, window)

    def paced(self, rate: int, seconds: float, kill_at: float | None = None) -> Trace:
        return paced(self.cluster, rate, seconds, kill_at)


# ------------------------------------------------------------- the baseline

_REPLQUEUE_NODE = textwrap.dedent(
    """
    import sys, time
    from pysyncobj import SyncObj, SyncObjConf
    from pysyncobj.batteries import ReplQueue
    me, others = sys.argv[1], sys.argv[2].split(",")
    queue = ReplQueue()
    obj = SyncObj(me, others, consumers=[queue], conf=SyncObjConf(password="bench"))
    print("ready", flush=True)
    while True:
        time.sleep(1)
    """
)


REPLQUEUE_STALL_S = 60.0
"""PySyncObj's ReplQueue sometimes never calls back a put (seen once under load): a run
that waits this long for an answer is reported as stalled, not waited on forever."""


class BaselineStalledError(RuntimeError):
    pass


def replqueue(messages: int, window: int) -> float:
    """PySyncObj's ReplQueue: two member processes and a third that puts, pipelined."""
    from pysyncobj import SyncObj, SyncObjConf
    from pysyncobj.batteries import ReplQueue

    ports = free_ports(3)
    addresses = [f"127.0.0.1:{p}" for p in ports]
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "node.py")
        with open(script, "w") as f:
            f.write(_REPLQUEUE_NODE)
        procs = [
            subprocess.Popen(
                [sys.executable, script, a, ",".join(x for x in addresses if x != a)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for a in addresses[1:]
        ]
        try:
            queue = ReplQueue()
            obj = SyncObj(
                addresses[0], addresses[1:], consumers=[queue], conf=SyncObjConf(password="bench")
            )
            deadline = time.monotonic() + 30
            while obj._getLeader() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            done = threading.Semaphore(0)
            in_flight = threading.Semaphore(window)

            def callback(_res: Any, _err: Any) -> None:
                in_flight.release()
                done.release()

            payload = os.urandom(PAYLOAD)
            began = time.perf_counter()
            for sent in range(messages):
                if not in_flight.acquire(timeout=REPLQUEUE_STALL_S):
                    raise BaselineStalledError(f"{sent - window} of {sent} puts answered")
                queue.put(payload, callback=callback)
            for answered in range(messages):
                if not done.acquire(timeout=REPLQUEUE_STALL_S):
                    raise BaselineStalledError(f"{answered} of {messages} puts answered")
            elapsed = time.perf_counter() - began
            obj.destroy()
            return messages / elapsed
        finally:
            for p in procs:
                p.kill()
                p.wait()


def _summary(values: list[float]) -> str:
    return f"{statistics.median(values):,.0f} ({min(values):,.0f}-{max(values):,.0f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--window", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--latency-seconds", type=float, default=5.0)
    args = parser.parse_args()
    print(
        f"{platform.machine()}, {os.cpu_count()} cores, CPython {platform.python_version()}; "
        f"3 nodes on loopback, fsync=always, {args.messages} messages of {PAYLOAD} B, "
        f"window {args.window}, {args.repeat} runs (median, min-max)"
    )
    results: dict[str, list[float]] = {}

    def record(name: str, run: Callable[[], float]) -> None:
        value = run()
        results.setdefault(name, []).append(value)
        print(f"  {name}: {value:,.1f}", flush=True)

    with Cluster(3, node_down_grace=30.0) as cluster:
        cluster.leader()
        for r in range(args.repeat):
            print(f"run {r + 1}", flush=True)
            try:
                record("ReplQueue puts/s", lambda: replqueue(args.messages, args.window))
            except BaselineStalledError as e:
                print(f"  ReplQueue puts/s: stalled ({e}; no answer in {REPLQUEUE_STALL_S:.0f} s)")
            record(
                "publish-confirm msg/s, 1 producer",
                lambda: publish_confirm(cluster, 1, args.messages, args.window),
            )
            record(
                "publish-confirm msg/s, 16 producers",
                lambda: publish_confirm(cluster, 16, args.messages, args.window // 8),
            )
            record(
                "end-to-end msg/s, consumers on followers",
                lambda: end_to_end(cluster, args.messages, args.window),
            )
            lat = paced(cluster, 1000, args.latency_seconds).analyse()
            results.setdefault("confirm p50 ms @1000/s", []).append(lat["confirm_p50_ms"])
            results.setdefault("confirm p99 ms @1000/s", []).append(lat["confirm_p99_ms"])
            print(
                f"  latency @1000/s: p50 {lat['confirm_p50_ms']:.2f} ms, "
                f"p99 {lat['confirm_p99_ms']:.2f} ms"
            )
            fail = paced(cluster, 1000, 4.0, kill_at=1.5).analyse()
            results.setdefault("failover s (leader kill -> next confirm)", []).append(
                fail["confirms_resumed_s"]
            )
            print(f"  failover: {fail['confirms_resumed_s']:.2f} s", flush=True)
    print()
    print("| measure | median (min-max) |")
    print("|---|---:|")
    for name, values in results.items():
        if "msg/s" not in name and "puts/s" not in name:  # latencies and durations
            print(
                f"| {name} | {statistics.median(values):.2f} "
                f"({min(values):.2f}-{max(values):.2f}) |"
            )
        else:
            print(f"| {name} | {_summary(values)} |")
    if "ReplQueue puts/s" not in results:
        return
    rq = statistics.median(results["ReplQueue puts/s"])
    for name in ("publish-confirm msg/s, 1 producer", "publish-confirm msg/s, 16 producers"):
        print(f"ratio {name} / ReplQueue: {statistics.median(results[name]) / rq:.2f}x")


if __name__ == "__main__":
    main()
