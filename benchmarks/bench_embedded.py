"""A node inside the program: its clients in-process against the same clients over TCP.

    python -m benchmarks.bench_embedded [--rate 1000] [--seconds 10] [--messages 20000]
                                        [--rounds 2] [--fsync always]

A 3-node cluster on loopback: node A runs inside this process (`quorumq.Node`, with a
client port), B and C are `quorumq node` processes. Two ways for this program to use
node A, side by side on the same node and the same log, one after the other (and again,
`--rounds` times, so that a drift of the host does not favour one):

* in-process: the publisher and the consumer are `node.client()`s;
* tcp: the same two over TCP to node A's own client port.

For each, on a queue of its own with the consumer on node A:

* latency: `--seconds` of publishes paced at `--rate` msg/s (publish_async), each body
  carrying its publish time; publish call -> delivery handed to the consumer
  (`consumer.get()` returns), p50/p99/p99.9, after a warm-up of a second;
* throughput: `--messages` published as fast as a window of 1,000 unconfirmed
  publishes allows while the consumer acks each; end-to-end msg/s, first publish to
  last delivery.

Prints a table with the load average before and after, and issue 20's targets:
in-process p50 at most half the TCP path's, throughput at least 1.5 times.
"""

from __future__ import annotations

import argparse
import collections
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import quorumq
from quorumq.ops.local_cluster import free_ports

BODY_BYTES = 100
WINDOW = 1000


def _start_peer(
    root: Path, name: str, peers: dict[str, str], port: int, fsync: str, env: dict[str, str]
) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "quorumq", "node", "--id", name]
    command += ["--data-dir", str(root / name), "--listen", f"127.0.0.1:{port}"]
    command += ["--raft", peers[name], "--fsync", fsync, "--log-level", "warning"]
    for other, address in peers.items():
        if other != name:
            command += ["--peer", f"{other}={address}"]
    log = open(root / f"{name}.log", "ab")  # noqa: SIM115 - the child owns it from here
    try:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    finally:
        log.close()


def _wait_ready(root: Path, name: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while b" ready: " not in (root / f"{name}.log").read_bytes():
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"node {name} did not start:\n{(root / f'{name}.log').read_text()}")
        time.sleep(0.05)


def _stamped(pad: bytes) -> bytes:
    return time.perf_counter_ns().to_bytes(8, "big") + pad


def measure_latency(
    publisher: Any, consumers: Any, queue: str, rate: int, seconds: float
) -> list[float]:
    """Milliseconds from each publish call to its delivery, paced at `rate` msg/s."""
    publisher.declare(queue)
    consumer = consumers.subscribe(queue, prefetch=1000)
    warmup = rate  # a second
    total = warmup + int(rate * seconds)
    latencies: list[float] = []

    def consume() -> None:
        for _ in range(total):
            delivery = consumer.get(timeout=30)
            if delivery is None:
                return
            sent = int.from_bytes(delivery.body[:8], "big")
            latencies.append((time.perf_counter_ns() - sent) / 1e6)
            delivery.ack()

    reader = threading.Thread(target=consume)
    reader.start()
    pad = b"x" * (BODY_BYTES - 8)
    start = time.perf_counter()
    futures: collections.deque[Future[Any]] = collections.deque()
    for i in range(total):
        wait = start + i / rate - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        futures.append(publisher.publish_async(queue, _stamped(pad)))
        while futures and futures[0].done():
            futures.popleft().result()
    reader.join()
    consumer.cancel()
    if len(latencies) != total:
        raise SystemExit(f"{queue}: {len(latencies)} of {total} messages delivered")
    return latencies[warmup:]


def measure_throughput(publisher: Any, consumers: Any, queue: str, messages: int) -> float:
    """End-to-end msg/s: `messages` published (a window of `WINDOW` unconfirmed), each
    delivered and acked; first publish to last delivery."""
    publisher.declare(queue)
    consumer = consumers.subscribe(queue, prefetch=1000)
    finished: list[float] = []

    def consume() -> None:
        for _ in range(messages):
            delivery = consumer.get(timeout=30)
            if delivery is None:
                return
            delivery.ack()
        finished.append(time.perf_counter())

    reader = threading.Thread(target=consume)
    reader.start()
    body = b"x" * BODY_BYTES
    futures: collections.deque[Future[Any]] = collections.deque()
    start = time.perf_counter()
    for _ in range(messages):
        if len(futures) >= WINDOW:
            futures.popleft().result()
        futures.append(publisher.publish_async(queue, body))
    for future in futures:
        future.result()
    reader.join()
    consumer.cancel()
    if not finished:
        raise SystemExit(f"{queue}: not every message was delivered")
    return messages / (finished[0] - start)


def _lead(node: quorumq.Node) -> str | None:
    """Make `node` the leader if the others let it (asking the leader to hand over until
    it lands there, 20 tries at most): then every message's work, the commit included,
    is done in this process, on the node whose two paths are compared. The leader."""
    deadline = time.monotonic() + 30
    while node.status()["leader"] is None and time.monotonic() < deadline:
        time.sleep(0.05)
    for _ in range(20):
        leader = node.status()["leader"]
        if leader == node.id:
            break
        node.server.replica.ask_leader_to_step_down()
        time.sleep(1.0)
    leader = node.status()["leader"]
    return str(leader) if leader else None


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(rate: int, seconds: float, messages: int, rounds: int, fsync: str) -> int:
    names = ["A", "B", "C"]
    rafts = free_ports(3)
    peers = {n: f"127.0.0.1:{p}" for n, p in zip(names, rafts, strict=True)}
    secret, token = secrets.token_hex(16), secrets.token_hex(16)
    env = {**os.environ, "QUORUMQ_SECRET": secret, "QUORUMQ_TOKEN": token}
    load_before = os.getloadavg()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-embedded-") as tmp:
        root = Path(tmp)
        processes = {
            name: _start_peer(root, name, peers, port, fsync, env)
            for name, port in zip(names[1:], free_ports(2), strict=True)
        }
        try:
            for name, process in processes.items():
                _wait_ready(root, name, process)
            settings: dict[str, Any] = {
                "id": "A",
                "data_dir": root / "A",
                "raft": peers["A"],
                "peers": peers,
                "secret": secret,
                "listen": "127.0.0.1:0",
                "token": token,
                "fsync": fsync,
            }
            with quorumq.Node(**settings) as node:
                leader = _lead(node)
                assert node.address is not None
                modes: dict[str, Callable[[], Any]] = {
                    "in-process": node.client,
                    "tcp": lambda: quorumq.connect(node.address, token),
                }
                for round_ in range(rounds):
                    for mode, make in modes.items():
                        publisher, consumers = make(), make()
                        try:
                            tag = f"{mode}-{round_}"
                            latencies = measure_latency(
                                publisher, consumers, f"lat-{tag}", rate, seconds
                            )
                            throughput = measure_throughput(
                                publisher, consumers, f"tput-{tag}", messages
                            )
                        finally:
                            publisher.close()
                            consumers.close()
                        rows.append(
                            {
                                "mode": mode,
                                "round": round_ + 1,
                                "p50": statistics.median(latencies),
                                "p99": _quantile(latencies, 0.99),
                                "p999": _quantile(latencies, 0.999),
                                "throughput": throughput,
                            }
                        )
                        print(f"{mode}, round {round_ + 1}: done", file=sys.stderr, flush=True)
        finally:
            for process in processes.values():
                process.terminate()
            for process in processes.values():
                try:
                    process.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
    load_after = os.getloadavg()
    print(
        f"node A in this process, B and C node processes; fsync={fsync}; leader {leader}; "
        f"latency at {rate} msg/s for {seconds:g} s, throughput over {messages:,} messages "
        f"of {BODY_BYTES} bytes; load average {load_before[0]:.2f} before, "
        f"{load_after[0]:.2f} after\n"
    )
    print("| path | round | p50 ms | p99 ms | p99.9 ms | end-to-end msg/s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['mode']} | {r['round']} | {r['p50']:.2f} | {r['p99']:.2f} | "
            f"{r['p999']:.2f} | {r['throughput']:,.0f} |"
        )

    def of(mode: str, field: str) -> float:
        return statistics.median(r[field] for r in rows if r["mode"] == mode)

    p50 = of("in-process", "p50") / of("tcp", "p50")
    speed = of("in-process", "throughput") / of("tcp", "throughput")
    print(
        f"\nin-process / tcp (medians of the rounds): p50 {p50:.2f}x (target at most 0.5x: "
        f"{'met' if p50 <= 0.5 else 'missed'}), throughput {speed:.2f}x (target at least "
        f"1.5x: {'met' if speed >= 1.5 else 'missed'})"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=int, default=1000, help="msg/s of the latency runs")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of a latency run")
    parser.add_argument("--messages", type=int, default=20_000, help="per throughput run")
    parser.add_argument("--rounds", type=int, default=2, help="in-process then tcp, this often")
    parser.add_argument("--fsync", choices=["always", "batch", "never"], default="always")
    args = parser.parse_args(argv)
    return run(args.rate, args.seconds, args.messages, args.rounds, args.fsync)


if __name__ == "__main__":
    sys.exit(main())
