"""A real-process chaos run, as Wallaroo tested its system: real nodes, real faults,
and a check that compares what came out with what went in.

A 3-node cluster of OS processes runs on loopback. Producers send small unique records
(producer number, sequence number) with the client's idempotent retries; one consumer
per node records every delivery and acks it. A fault loop injects, every 1-5 s: SIGKILL
and restart of the leader or of any node, SIGSTOP for up to twice the node-down grace
period (so that the leader marks the node down and hands its consumers' messages to
others) then SIGCONT, and the death of a consumer. Then the faults stop, every node
runs, the queue drains, and the check runs:

* filter, then compare: per producer, the records delivered for the first time (marked
  redeliveries filtered out) are exactly the confirmed ones, plus any whose confirm was
  lost with a connection (counted as recovered). Nothing confirmed is lost, nothing is
  delivered twice unmarked, nothing arrives that was never sent;
* per consumer and ordering key, first deliveries come in increasing offset order;
* every replica ends with the same machine digest.

Run it: `python -m simulations.chaos --duration 90` (CI runs a bounded run);
`--duration 8h` is the soak.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import attrs

from quorumq.client import Client, Consumer, QuorumqError
from quorumq.embedded import Cluster

QUEUE = "chaos"
KEYS_PER_PRODUCER = 4
IN_FLIGHT = 32
"""Unconfirmed publishes each producer allows itself."""


@attrs.frozen
class Received:
    producer: int
    seq: int
    offset: int
    key: str
    redelivered: bool
    node: str
    consumer: str
    """Which consumer (node and life: one per kill) received it."""


@attrs.define
class ChaosReport:
    seed: int
    duration_s: float
    faults: dict[str, int]
    sent: int
    confirmed: int
    unconfirmed: int
    delivered: int
    lost: int
    duplicated: int
    unexpected: int
    recovered: int
    order_violations: int
    redeliveries: int
    replicas_agree: bool
    drained: bool

    @property
    def faults_per_hour(self) -> float:
        return sum(self.faults.values()) * 3600.0 / self.duration_s

    @property
    def passed(self) -> bool:
        return (
            self.lost == self.duplicated == self.unexpected == self.order_violations == 0
            and self.replicas_agree
            and self.drained
        )

    def summary(self) -> str:
        faults = ", ".join(f"{k} {v}" for k, v in sorted(self.faults.items())) or "none"
        verdict = "PASS" if self.passed else "FAIL"
        return "\n".join(
            [
                f"chaos run: seed {self.seed}, {self.duration_s:.0f} s of faults, "
                f"{self.faults_per_hour:.0f} faults/hour ({faults})",
                f"  sent {self.sent}, confirmed {self.confirmed}, "
                f"unconfirmed {self.unconfirmed}, delivered {self.delivered} "
                f"(+{self.redeliveries} marked redeliveries)",
                f"  lost {self.lost}, duplicated {self.duplicated}, "
                f"unexpected {self.unexpected}, recovered {self.recovered}, "
                f"order violations {self.order_violations}",
                f"  queue drained: {self.drained}; replicas agree: {self.replicas_agree}",
                f"  verdict: {verdict}"
                + (
                    ""
                    if self.passed
                    else f"  (replay: python -m simulations.chaos --seed {self.seed})"
                ),
            ]
        )


class Producer:
    """Publishes records `p:seq` with ordering keys, confirmed through the client."""

    def __init__(self, number: int, client: Client, rate: float) -> None:
        self.number = number
        self.client = client
        self.rate = rate
        self.sent = 0
        self.confirmed: set[int] = set()
        self.unconfirmed: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"producer-{number}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=180)

    def _run(self) -> None:
        window: collections.deque[tuple[int, Future[dict[str, Any]]]] = collections.deque()
        started = time.monotonic()
        seq = 0
        while not self._stop.is_set():
            key = f"p{self.number}k{seq % KEYS_PER_PRODUCER}"
            try:
                future = self.client.publish_async(QUEUE, b"%d:%d" % (self.number, seq), key)
            except QuorumqError:  # the key is paused after a failure: we handled it
                if key in self.client.settling_keys():
                    self._stop.wait(0.05)  # a publish of it may still land: let it settle
                else:
                    self.client.resume(key)
                continue
            window.append((seq, future))
            self.sent += 1
            seq += 1
            while len(window) >= IN_FLIGHT:
                self._settle(*window.popleft())
            pause = started + seq / self.rate - time.monotonic()
            if pause > 0:
                self._stop.wait(pause)
        while window:
            self._settle(*window.popleft())

    def _settle(self, seq: int, future: Future[dict[str, Any]]) -> None:
        try:
            future.result(timeout=120)
        except Exception:  # connection lost for good, or an error: outcome unknown
            self.unconfirmed.add(seq)
        else:
            self.confirmed.add(seq)


class ConsumerSlot:
    """The consumer attached to one node; replaced by a new one when it is killed."""

    def __init__(self, cluster: Cluster, node: str, record: Callable[[Received], None]) -> None:
        self.cluster = cluster
        self.node = node
        self.record = record
        self.lives = 0
        self._client: Client | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self) -> None:
        self.lives += 1
        # connected to its own node only: it waits for that node through its restarts
        client = Client([self.cluster.endpoint(self.node)], self.cluster.token, timeout=120)
        self._client, self._stop = client, threading.Event()
        self._thread = threading.Thread(
            target=self._subscribe_and_run, args=(client, self.lives, self._stop), daemon=True
        )
        self._thread.start()

    def _subscribe_and_run(self, client: Client, life: int, stop: threading.Event) -> None:
        """Subscribe until the node takes it (a node marked down refuses until it is up
        again), then consume; if the consumer ends (it could not subscribe again after
        its node was cut off), the slot subscribes anew, as a new life."""
        while not stop.is_set():
            try:
                consumer = client.subscribe(QUEUE, prefetch=20)
            except QuorumqError:
                stop.wait(0.2)
                continue
            self._run(consumer, life, stop)
            self.lives += 1
            life = self.lives

    def kill(self) -> None:
        """The consumer dies with what it holds (its connection closes, unacked)."""
        self._halt()
        self.start()

    def _halt(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._client is not None:
            self._client.close()

    def stop(self) -> None:
        self._halt()

    def _run(self, consumer: Consumer, life: int, stop: threading.Event) -> None:
        name = f"{self.node}#{life}"
        while not stop.is_set():
            d = consumer.get(timeout=0.1)
            if d is None:
                if consumer.cancelled:
                    return
                continue
            producer, seq = map(int, d.body.split(b":"))
            self.record(Received(producer, seq, d.offset, d.key or "", d.redelivered, d.node, name))
            if stop.is_set():
                return  # dying: this one stays unacked and must come back
            with contextlib.suppress(QuorumqError):  # if the connection is gone, it comes back
                d.ack()


def check(
    producers: list[Producer], received: list[Received]
) -> tuple[int, int, int, int, int, int]:
    """(delivered, lost, duplicated, unexpected, recovered, order violations)."""
    first: dict[tuple[int, int], int] = collections.Counter()
    sent = {p.number: p for p in producers}
    unexpected = 0
    for r in received:
        producer = sent.get(r.producer)
        if producer is None or r.seq >= producer.sent:
            unexpected += 1
        elif not r.redelivered:
            first[(r.producer, r.seq)] += 1
    seen = {(r.producer, r.seq) for r in received}
    lost = sum(1 for p in producers for s in p.confirmed if (p.number, s) not in seen)
    duplicated = sum(n - 1 for n in first.values() if n > 1)
    recovered = sum(1 for p in producers for s in p.unconfirmed if (p.number, s) in seen)
    last: dict[tuple[str, str], int] = {}
    violations = 0
    for r in received:
        if r.redelivered:
            continue
        lane = (r.consumer, r.key)
        if r.offset <= last.get(lane, -1):
            violations += 1
        last[lane] = r.offset
    return len(first), lost, duplicated, unexpected, recovered, violations


def duplicate_examples(received: list[Received], limit: int = 5) -> list[str]:
    """Every reception of the first few records delivered twice without the mark."""
    firsts: dict[tuple[int, int], list[Received]] = collections.defaultdict(list)
    for r in received:
        firsts[(r.producer, r.seq)].append(r)
    lines = []
    for (producer, seq), seen in firsts.items():
        if sum(not r.redelivered for r in seen) > 1:
            lines.append(
                f"  record {producer}:{seq}: "
                + "; ".join(
                    f"offset {r.offset} to {r.consumer} via {r.node}"
                    + (" (redelivered)" if r.redelivered else "")
                    for r in seen
                )
            )
            if len(lines) >= limit:
                break
    return lines


def run_chaos(
    duration_s: float = 90.0,
    *,
    seed: int = 0,
    producers: int = 3,
    rate: float = 100.0,
    node_down_grace: float = 2.0,
    drain_timeout_s: float = 120.0,
    data_dir: str | None = None,
    log_level: str = "warning",
    compaction_entries: int = 50_000,
    log: Callable[[str], None] = print,
) -> ChaosReport:
    """Run a cluster under faults for `duration_s`, drain it and check what came out."""
    rng = random.Random(seed)
    faults: collections.Counter[str] = collections.Counter()
    received: list[Received] = []
    lock = threading.Lock()

    def record(r: Received) -> None:
        with lock:
            received.append(r)

    began = time.monotonic()
    plain_log = log

    def log(line: str) -> None:  # when, and how many confirms so far: a stall shows
        confirmed = sum(len(w.confirmed) for w in workers)
        plain_log(f"{time.monotonic() - began:6.1f}s {confirmed:7d} confirmed {line}")

    workers: list[Producer] = []
    with Cluster(
        3,
        data_dir,
        node_down_grace=node_down_grace,
        log_level=log_level,
        compaction_entries=compaction_entries,
    ) as cluster:
        setup = cluster.client()
        setup.declare(QUEUE)
        slots = [ConsumerSlot(cluster, node, record) for node in cluster.nodes]
        for slot in slots:
            slot.start()
        for i in range(producers):
            order = cluster.nodes[i % 3 :] + cluster.nodes[: i % 3]
            client = Client([cluster.endpoint(n) for n in order], cluster.token, timeout=120)
            workers.append(Producer(i, client, rate))
        for w in workers:
            w.start()

        started = time.monotonic()
        interrupted = threading.Event()
        with _stop_on_interrupt(interrupted, log):
            while time.monotonic() - started < duration_s and not interrupted.is_set():
                if interrupted.wait(rng.uniform(1.0, 5.0)):
                    break
                kind = rng.choices(
                    ["kill_leader", "kill_node", "pause_node", "kill_consumer"],
                    weights=[35, 20, 25, 20],
                )[0]
                try:
                    _inject(cluster, slots, kind, rng, node_down_grace, log)
                except Exception as e:  # a fault that could not be injected is not counted
                    log(f"  fault {kind} not injected: {e}")
                    continue
                faults[kind] += 1
        faulted_s = time.monotonic() - started

        for w in workers:
            w.stop()
        for node in cluster.nodes:  # heal: everything runs
            if not cluster.alive(node):
                cluster.restart(node)
            cluster.resume(node)
        log("  faults over: draining")
        drained = _drain(cluster, workers, received, lock, drain_timeout_s)
        if not drained:
            for line in _stuck(cluster, workers, received, lock):
                log(line)
        for slot in slots:
            slot.stop()
        replicas_agree = _replicas_agree(cluster)
        for w in workers:
            w.client.close()

    with lock:
        delivered, lost, duplicated, unexpected, recovered, violations = check(workers, received)
        if duplicated:
            for line in duplicate_examples(received):
                log(line)
        redeliveries = sum(1 for r in received if r.redelivered)
    return ChaosReport(
        seed=seed,
        duration_s=faulted_s,
        faults=dict(faults),
        sent=sum(w.sent for w in workers),
        confirmed=sum(len(w.confirmed) for w in workers),
        unconfirmed=sum(len(w.unconfirmed) for w in workers),
        delivered=delivered,
        lost=lost,
        duplicated=duplicated,
        unexpected=unexpected,
        recovered=recovered,
        order_violations=violations,
        redeliveries=redeliveries,
        replicas_agree=replicas_agree,
        drained=drained,
    )


@contextlib.contextmanager
def _stop_on_interrupt(interrupted: threading.Event, log: Callable[[str], None]) -> Iterator[None]:
    """Ctrl-C ends the fault phase (the run still heals, drains and reports); a second
    Ctrl-C interrupts as usual."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_interrupt(_signum: int, _frame: object) -> None:
        log("  interrupted: no more faults; healing and draining (Ctrl-C again to abort)")
        interrupted.set()
        signal.signal(signal.SIGINT, previous)

    previous = signal.signal(signal.SIGINT, on_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _inject(
    cluster: Cluster,
    slots: list[ConsumerSlot],
    kind: str,
    rng: random.Random,
    grace: float,
    log: Callable[[str], None],
) -> None:
    if kind == "kill_consumer":
        slot = rng.choice(slots)
        log(f"  kill consumer on {slot.node}")
        slot.kill()
        return
    node = cluster.leader(timeout=30) if kind == "kill_leader" else rng.choice(cluster.nodes)
    if kind == "pause_node":
        pause_s = rng.uniform(0.5, 2 * grace)
        log(f"  SIGSTOP {node} for {pause_s:.1f} s")
        cluster.pause(node)
        time.sleep(pause_s)
        cluster.resume(node)
        return
    log(f"  SIGKILL {node}" + (" (leader)" if kind == "kill_leader" else ""))
    cluster.kill(node)
    time.sleep(rng.uniform(0.2, 2.0))
    cluster.restart(node)


def _drain(
    cluster: Cluster,
    workers: list[Producer],
    received: list[Received],
    lock: threading.Lock,
    timeout_s: float,
) -> bool:
    """Wait until every confirmed record arrived and nothing is ready or unacked."""
    deadline = time.monotonic() + timeout_s
    wanted = {(w.number, s) for w in workers for s in w.confirmed}
    while time.monotonic() < deadline:
        with lock:
            seen = {(r.producer, r.seq) for r in received}
        if wanted <= seen:
            try:
                queue = cluster.status(cluster.leader())["queues"][QUEUE]
            except (QuorumqError, OSError, RuntimeError):
                queue = None
            if queue is not None and queue["ready"] == 0 and queue["unacked"] == 0:
                return True
        time.sleep(0.2)
    return False


def _stuck(
    cluster: Cluster, workers: list[Producer], received: list[Received], lock: threading.Lock
) -> list[str]:
    """What a drain that did not finish was waiting for: records never received, and
    what each node says the queue holds and for whom."""
    with lock:
        seen = {(r.producer, r.seq) for r in received}
    missing = sorted(
        (w.number, s) for w in workers for s in w.confirmed if (w.number, s) not in seen
    )
    lines = [f"  not drained: {len(missing)} confirmed records never received {missing[:10]}"]
    for node in cluster.nodes:
        try:
            status = cluster.status(node)
            queue = status["queues"][QUEUE]
        except (QuorumqError, OSError, RuntimeError, KeyError) as e:
            lines.append(f"  {node}: no status ({e})")
            continue
        lines.append(
            f"  {node}: leader {status['leader']}, applied {status['machine_index']}, "
            f"ready {queue['ready']}, unacked {queue['unacked']}, "
            f"consumers {queue['consumer_ids']}"
        )
    return lines


def _replicas_agree(cluster: Cluster, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            statuses = [cluster.status(n, audit=True) for n in cluster.nodes]
            seen = {(s["machine_index"], s["digest"]) for s in statuses}
        except (QuorumqError, OSError):
            seen = set()
        if len(seen) == 1:
            return True
        time.sleep(0.2)
    return False


def _duration(text: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600}
    if text and text[-1] in units:
        return float(text[:-1]) * units[text[-1]]
    return float(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m simulations.chaos",
        description="Run a real 3-node cluster under faults and check every message.",
    )
    parser.add_argument("--duration", type=_duration, default=90.0, help="e.g. 90, 10m, 8h")
    parser.add_argument("--seed", type=int, default=0, help="seeds the fault schedule")
    parser.add_argument("--producers", type=int, default=3)
    parser.add_argument("--rate", type=float, default=100.0, help="msg/s per producer")
    parser.add_argument("--node-down-grace", type=float, default=2.0, metavar="SECONDS")
    parser.add_argument("--quiet", action="store_true", help="no line per fault")
    parser.add_argument(
        "--data-dir", help="keep the nodes' data and logs here (default: a temporary dir)"
    )
    parser.add_argument("--log-level", default="warning", help="the nodes' log level")
    parser.add_argument(
        "--compaction-entries",
        type=int,
        default=50_000,
        help="log entries between snapshots (lower: more snapshot installs)",
    )
    args = parser.parse_args(argv)
    report = run_chaos(
        args.duration,
        seed=args.seed,
        producers=args.producers,
        rate=args.rate,
        node_down_grace=args.node_down_grace,
        data_dir=args.data_dir,
        log_level=args.log_level,
        compaction_entries=args.compaction_entries,
        log=(lambda _line: None) if args.quiet else print,
    )
    print(report.summary())
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
