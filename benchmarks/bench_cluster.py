"""A 3-node loopback cluster (each node its own process), measured through the real path:
client -> server -> Raft (fsync=always) -> machine -> server -> client.

    python -m benchmarks.bench_cluster [--messages 20000] [--repeat 3]

Workloads, each repeated and interleaved with the baseline so that drift on a shared
machine hits both alike:

* publish-confirm msg/s: 100-byte random payloads, 1 producer and 16 producer processes,
  each keeping up to `--window` publishes in flight;
* end to end: publish -> deliver -> ack msg/s, consumers on the two followers;
* confirm latency p50/p99 at a fixed 1,000 msg/s (one producer, paced);
* failover: leader SIGKILL while publishing at 1,000 msg/s -> first confirm after it;
* baseline: PySyncObj's own `batteries.ReplQueue`, 3 processes, pipelined `put`s.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from quorumq.client import Client
from quorumq.embedded import Cluster, free_ports

PAYLOAD = 100


def _producer(
    endpoint: str, queue: str, n: int, window: int, start: Any, out: Any
) -> None:  # runs in a child process
    client = Client([endpoint])
    payloads = [os.urandom(PAYLOAD) for _ in range(256)]
    start.wait()
    began = time.perf_counter()
    in_flight: list[Future[dict[str, Any]]] = []
    for i in range(n):
        in_flight.append(client.publish_async(queue, payloads[i & 255] + i.to_bytes(8, "big")))
        if len(in_flight) >= window:
            for f in in_flight[: window // 2]:
                f.result(60)
            del in_flight[: window // 2]
    for f in in_flight:
        f.result(60)
    out.put(time.perf_counter() - began)
    client.close()


def publish_confirm(cluster: Cluster, producers: int, messages: int, window: int) -> float:
    queue = f"pc-{producers}-{time.monotonic_ns()}"
    with cluster.client() as c:
        c.declare(queue)
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    per = messages // producers
    procs = [
        ctx.Process(
            target=_producer,
            args=(cluster.endpoint(cluster.nodes[i % 3]), queue, per, window, start, out),
        )
        for i in range(producers)
    ]
    for p in procs:
        p.start()
    time.sleep(1.0 + 0.1 * producers)  # let every producer connect
    began = time.perf_counter()
    start.set()
    for _ in procs:
        out.get(timeout=300)
    elapsed = time.perf_counter() - began
    for p in procs:
        p.join(timeout=30)
    return per * producers / elapsed


def end_to_end(cluster: Cluster, messages: int, window: int) -> float:
    queue = f"e2e-{time.monotonic_ns()}"
    leader = cluster.leader()
    followers = [n for n in cluster.nodes if n != leader]
    producer = cluster.client(leader)
    producer.declare(queue)
    done = threading.Event()
    received = [0]
    lock = threading.Lock()

    def consume(node: str) -> None:
        consumer = cluster.client(node).subscribe(queue, prefetch=window)
        while not done.is_set():
            d = consumer.get(timeout=0.2)
            if d is None:
                continue
            d.ack()
            with lock:
                received[0] += 1
                if received[0] >= messages:
                    done.set()

    threads = [threading.Thread(target=consume, args=(f,), daemon=True) for f in followers]
    for t in threads:
        t.start()
    time.sleep(0.5)
    payload = os.urandom(PAYLOAD)
    began = time.perf_counter()
    in_flight: list[Future[dict[str, Any]]] = []
    for i in range(messages):
        in_flight.append(producer.publish_async(queue, payload + i.to_bytes(8, "big")))
        if len(in_flight) >= window:
            for f in in_flight[: window // 2]:
                f.result(60)
            del in_flight[: window // 2]
    done.wait(120)
    elapsed = time.perf_counter() - began
    for t in threads:
        t.join(timeout=5)
    return messages / elapsed


def paced_latency(
    cluster: Cluster, rate: int, seconds: float, kill_leader_at: float | None = None
) -> dict[str, float]:
    """Publish at `rate` msg/s; confirm latencies, and with a kill, the failover time."""
    queue = f"lat-{time.monotonic_ns()}"
    leader = cluster.leader()
    client = cluster.client(leader, timeout=60.0)
    client.declare(queue)
    latencies: list[float] = []
    confirms: list[float] = []
    lock = threading.Lock()
    futures = []
    payload = os.urandom(PAYLOAD)
    began = time.perf_counter()
    killed_at = None
    n = int(rate * seconds)
    for i in range(n):
        due = began + i / rate
        now = time.perf_counter()
        if due > now:
            time.sleep(due - now)
        if kill_leader_at is not None and killed_at is None and now - began >= kill_leader_at:
            cluster.kill(leader)
            killed_at = time.perf_counter()
        sent = time.perf_counter()

        def on_done(f: Future[dict[str, Any]], sent: float = sent) -> None:
            t = time.perf_counter()
            with lock:
                latencies.append(t - sent)
                confirms.append(t)

        f = client.publish_async(queue, payload + i.to_bytes(8, "big"))
        f.add_done_callback(on_done)
        futures.append(f)
    for f in futures:
        f.result(60)
    lat = sorted(latencies)
    result = {
        "p50_ms": lat[len(lat) // 2] * 1e3,
        "p99_ms": lat[int(len(lat) * 0.99)] * 1e3,
    }
    if killed_at is not None:
        after = [t for t in confirms if t > killed_at]
        result["failover_s"] = min(after) - killed_at
        cluster.restart(leader)
    return result


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
            for _ in range(messages):
                in_flight.acquire()
                queue.put(payload, callback=callback)
            for _ in range(messages):
                done.acquire(timeout=120)
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
            record("ReplQueue puts/s", lambda: replqueue(args.messages, args.window))
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
            lat = paced_latency(cluster, 1000, args.latency_seconds)
            results.setdefault("confirm p50 ms @1000/s", []).append(lat["p50_ms"])
            results.setdefault("confirm p99 ms @1000/s", []).append(lat["p99_ms"])
            print(f"  latency @1000/s: p50 {lat['p50_ms']:.2f} ms, p99 {lat['p99_ms']:.2f} ms")
            fail = paced_latency(cluster, 1000, 4.0, kill_leader_at=1.5)
            results.setdefault("failover s (leader kill -> next confirm)", []).append(
                fail["failover_s"]
            )
            print(f"  failover: {fail['failover_s']:.2f} s", flush=True)
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
    rq = statistics.median(results["ReplQueue puts/s"])
    for name in ("publish-confirm msg/s, 1 producer", "publish-confirm msg/s, 16 producers"):
        print(f"ratio {name} / ReplQueue: {statistics.median(results[name]) / rq:.2f}x")


if __name__ == "__main__":
    main()
