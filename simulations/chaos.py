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
* every replica ends with the same machine digest: each node is audited (its state
  digest and the log index it is of), all at once, again and again for up to 30 s, and
  some index must have been audited on every node with one digest. Two digests at one
  index is a divergence. When no index lines up, the report names, for each node, its
  applied and commit index, term, role, leader, last audit or why the audit failed,
  how far behind it is and since when, and the tail of its log.

While it runs, the harness polls every node's status and counts elections (terms with
a leader, from the nodes' "leading at term" log lines) and the nodes marked down; each
consumer's client tells it of a `node_down` cancellation. A node marked down that the
harness had not paused or killed within the node-down grace before (plus time to catch
up) is a false down, and fails the run.

Run it: `python -m simulations.chaos --duration 90` (CI runs a bounded run);
`--duration 8h` is the soak. `--faults none --cpu-hog 2 --duration 10m`: no fault, two
busy-looping processes beside the cluster, and the run fails on any election.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from quorumq.client import Client, QuorumqError
from quorumq.ops.local_cluster import Cluster

from .chaos_checks import (
    CATCH_UP_S,
    COUNTERS,
    Agreement,
    ChaosReport,
    Down,
    FaultLog,
    NodeEvidence,
    check,
    decide,
    duplicate_examples,
    false_downs,
)
from .chaos_clients import QUEUE, ConsumerSlot, Producer, Received

LOG_TAIL_LINES = 12
LEADING = re.compile(rb"leading at term (\d+)")

STATUS_FIELDS = (
    "term",
    "leader",
    "is_leader",
    "commit_index",
    "last_applied",
    "machine_index",
    "down_nodes",
    "connected",
    "snapshots_loaded",
    "compaction_error",
    "elections",
    "pre_votes_lost",
    "stalls",
)


class RaftWatch:
    """Polls every node's status every `every_s`, each node from a thread of its own (a
    paused node holds up only its own poll). Keeps each node's latest status and why
    its latest poll failed, when its applied index last moved, every (term, leader)
    first seen, the highest term, and the nodes the leader's status marks down."""

    def __init__(self, cluster: Cluster, clock: Callable[[], float], every_s: float = 0.5) -> None:
        self.cluster = cluster
        self.clock = clock
        self.every_s = every_s
        self.lock = threading.Lock()
        self.latest: dict[str, tuple[float, dict[str, Any]]] = {}
        self.errors: dict[str, str | None] = {}
        self.advanced_at: dict[str, float] = {}
        self.leaders: list[tuple[float, int, str]] = []
        """(when first seen, term, leader)."""
        self.max_term = 0
        self.downs: list[Down] = []
        self._seen: set[tuple[int, str]] = set()
        self._down: set[str] = set()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._poll, args=(n,), name=f"watch-{n}", daemon=True)
            for n in cluster.nodes
        ]

    def start(self, timeout_s: float = 10.0) -> None:
        """Start polling, and wait (up to `timeout_s`) for a first status of each node."""
        for thread in self._threads:
            thread.start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                if len(self.latest) == len(self._threads):
                    return
            time.sleep(0.05)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=10)

    def leader_at(self, at: float) -> str | None:
        with self.lock:
            seen = [leader for when, _term, leader in self.leaders if when <= at]
        return seen[-1] if seen else None

    def _poll(self, node: str) -> None:
        client: Client | None = None
        while not self._stop.wait(self.every_s):
            try:
                if client is None:
                    client = Client(
                        [self.cluster.endpoint(node)],
                        self.cluster.token,
                        timeout=2.0,
                        connect_timeout=1.0,
                        tls=self.cluster.tls_ca,
                    )
                status = client.status()
            except (QuorumqError, OSError) as e:
                with self.lock:
                    self.errors[node] = f"{type(e).__name__}: {e}"
                if client is not None:  # a new connection next time
                    client.close()
                    client = None
                continue
            self.saw(node, {k: status.get(k) for k in STATUS_FIELDS}, self.clock())
        if client is not None:
            client.close()

    def saw(self, node: str, status: dict[str, Any], at: float) -> None:
        with self.lock:
            previous = self.latest.get(node)
            self.latest[node] = (at, status)
            self.errors[node] = None
            if previous is None or previous[1]["last_applied"] != status["last_applied"]:
                self.advanced_at[node] = at
            term, leader = status["term"], status["leader"]
            self.max_term = max(self.max_term, term)
            if leader is not None and (term, leader) not in self._seen:
                self._seen.add((term, leader))
                self.leaders.append((at, term, leader))
            if status["is_leader"]:
                down = set(status["down_nodes"])
                self.downs.extend(
                    Down(at=at, node=d, seen_by=f"leader {node}'s status at term {term}")
                    for d in sorted(down - self._down)
                )
                self._down = down


def leading_terms(cluster: Cluster) -> dict[int, str]:
    """Term -> the node that logged "leading at term" for it (nodes logging at info)."""
    terms: dict[int, str] = {}
    for node in cluster.nodes:
        with contextlib.suppress(OSError):
            for m in LEADING.finditer(cluster.log_path(node).read_bytes()):
                terms[int(m.group(1))] = node
    return terms


def log_tail(path: os.PathLike[str] | str, lines: int = LOG_TAIL_LINES) -> tuple[str, ...]:
    """The last `lines` lines of a node's log, less the leader's "proposing Tick()"
    lines (one a second: they would fill the tail)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 256 * 1024))
            data = f.read()
    except OSError as e:
        return (f"(no log: {e})",)
    kept = [line for line in data.splitlines() if b"proposing Tick()" not in line]
    ticks = data.count(b"proposing Tick()")
    tail = tuple(line.decode(errors="replace") for line in kept[-lines:])
    return tail + ((f"({ticks} 'proposing Tick()' lines left out)",) if ticks else ())


@contextlib.contextmanager
def cpu_hogs(n: int) -> Iterator[list[int]]:
    """`n` processes that busy-loop beside the cluster (at the harness's niceness), killed
    by PID at the end."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(n):
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL
                )
            )
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait(timeout=10)


def run_chaos(
    duration_s: float = 90.0,
    *,
    seed: int = 0,
    producers: int = 3,
    rate: float = 100.0,
    node_down_grace: float = 2.0,
    drain_timeout_s: float = 120.0,
    data_dir: str | None = None,
    log_level: str = "info",
    compaction_entries: int = 50_000,
    fault_mode: str = "mixed",
    hogs: int = 0,
    log: Callable[[str], None] = print,
) -> ChaosReport:
    """Run a cluster under faults for `duration_s` (`fault_mode` "none": no fault, the
    run fails on any election), with `hogs` busy-looping processes beside it while the
    faults run; drain it and check what came out."""
    if fault_mode not in ("mixed", "none"):
        raise ValueError(f"fault_mode must be 'mixed' or 'none', not {fault_mode!r}")
    rng = random.Random(seed)
    faults: collections.Counter[str] = collections.Counter()
    fault_log = FaultLog()
    received: list[Received] = []
    cancelled: list[Down] = []
    lock = threading.Lock()

    def record(r: Received) -> None:
        with lock:
            received.append(r)

    began = time.monotonic()
    plain_log = log

    def clock() -> float:
        return time.monotonic() - began

    def log(line: str) -> None:  # when, and how many confirms so far: a stall shows
        confirmed = sum(len(w.confirmed) for w in workers)
        plain_log(f"{clock():6.1f}s {confirmed:7d} confirmed {line}")

    def on_cancelled(node: str, consumer: str, reason: str) -> None:
        if reason == "node_down":
            at = clock()
            with lock:
                cancelled.append(Down(at=at, node=node, seen_by=f"consumer {consumer}'s cancel"))
            log(f"  consumer {consumer} on {node} cancelled: node_down")

    workers: list[Producer] = []
    with Cluster(
        3,
        data_dir,
        node_down_grace=node_down_grace,
        log_level=log_level,
        compaction_entries=compaction_entries,
    ) as cluster:
        watch = RaftWatch(cluster, clock)
        watch.start()
        try:
            setup = cluster.client()
            setup.declare(QUEUE)
            slots = [ConsumerSlot(cluster, node, record, on_cancelled) for node in cluster.nodes]
            for slot in slots:
                slot.start()
            for i in range(producers):
                order = cluster.nodes[i % 3 :] + cluster.nodes[: i % 3]
                client = Client([cluster.endpoint(n) for n in order], cluster.token, timeout=120)
                workers.append(Producer(i, client, rate))
            for w in workers:
                w.start()

            terms_before = leading_terms(cluster)
            first_term = watch.max_term
            load_before = os.getloadavg()[0]
            started = time.monotonic()
            interrupted = threading.Event()
            with _stop_on_interrupt(interrupted, log), cpu_hogs(hogs) as hog_pids:
                if hog_pids:
                    log(f"  CPU hogs running: PIDs {hog_pids}")
                while time.monotonic() - started < duration_s and not interrupted.is_set():
                    if fault_mode == "none":
                        interrupted.wait(min(1.0, duration_s - (time.monotonic() - started)))
                        continue
                    if interrupted.wait(rng.uniform(1.0, 5.0)):
                        break
                    kind = rng.choices(
                        ["kill_leader", "kill_node", "pause_node", "kill_consumer"],
                        weights=[35, 20, 25, 20],
                    )[0]
                    try:
                        _inject(cluster, slots, kind, rng, node_down_grace, log, fault_log, clock)
                    except Exception as e:  # a fault that could not be injected is not counted
                        log(f"  fault {kind} not injected: {e}")
                        continue
                    faults[kind] += 1
            faulted_s = time.monotonic() - started
            load_after = os.getloadavg()[0]
            terms_faulted = leading_terms(cluster)

            for w in workers:
                w.stop()
            for node in cluster.nodes:  # heal: everything runs
                if not cluster.alive(node):
                    cluster.restart(node)
                cluster.resume(node)
                fault_log.end_all(node, clock())
            log("  faults over: draining")
            drained = _drain(cluster, workers, received, lock, drain_timeout_s)
            if not drained:
                for line in _stuck(cluster, workers, received, lock):
                    log(line)
            for slot in slots:
                slot.stop()
            agreement = _agreement(cluster, watch, clock)
            terms_after = leading_terms(cluster)
            for w in workers:
                w.client.close()
        finally:
            watch.stop()

    if log_level in ("info", "debug"):
        won = sorted((t, n) for t, n in terms_faulted.items() if t not in terms_before)
        after = sum(1 for t in terms_after if t not in terms_faulted)
    else:  # no "leading at term" lines: the (term, leader) pairs the polls saw
        won = sorted(
            (t, n) for when, t, n in watch.leaders if 0 < when - (started - began) <= faulted_s
        )
        after = sum(1 for when, _t, _n in watch.leaders if when - (started - began) > faulted_s)
    with lock:
        downs = sorted([*cancelled, *watch.downs], key=lambda d: d.at)
    wrong = false_downs(downs, fault_log, node_down_grace + CATCH_UP_S, watch.leader_at)
    for f in wrong:
        log(f.render())

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
        agreement=agreement,
        drained=drained,
        fault_mode=fault_mode,
        cpu_hogs=hogs,
        elections=len(won),
        elections_after=after,
        leader_terms=tuple(won),
        terms=(first_term, watch.max_term),
        cancels=len(cancelled),
        counters={
            n: {c: s[c] for c in COUNTERS}
            for n, (_at, s) in watch.latest.items()
            if all(s.get(c) is not None for c in COUNTERS)
        },
        marks=len(watch.downs),
        false_downs=tuple(wrong),
        load=(load_before, load_after),
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
    fault_log: FaultLog,
    clock: Callable[[], float],
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
        fault = fault_log.begin(node, "pause", clock())
        cluster.pause(node)
        try:
            time.sleep(pause_s)
        finally:
            cluster.resume(node)
            fault_log.end(fault, clock())
        return
    log(f"  SIGKILL {node}" + (" (leader)" if kind == "kill_leader" else ""))
    fault = fault_log.begin(node, "kill", clock())  # over once restarted (else at the heal)
    cluster.kill(node)
    time.sleep(rng.uniform(0.2, 2.0))
    cluster.restart(node)
    fault_log.end(fault, clock())


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


def _agreement(
    cluster: Cluster, watch: RaftWatch, clock: Callable[[], float], timeout_s: float = 30.0
) -> Agreement:
    """Audit every node at once, again and again, until some index was audited on every
    node (the leader proposes a `Tick` every second while the queue remembers producers,
    so the index moves on while the audits run) or `timeout_s` passed."""
    nodes = list(cluster.nodes)
    audited: dict[str, dict[int, str]] = {n: {} for n in nodes}
    tried: collections.Counter[str] = collections.Counter()
    failed: collections.Counter[str] = collections.Counter()
    last_error: dict[str, str] = {}
    last_audit: dict[str, tuple[int, str]] = {}
    took: dict[str, float] = dict.fromkeys(nodes, 0.0)

    def audit(node: str) -> tuple[str, tuple[int, str] | None, str | None]:
        began = time.monotonic()
        try:
            status = cluster.status(node, audit=True)
        except (QuorumqError, OSError) as e:
            return node, None, f"{type(e).__name__}: {e}"
        finally:
            took[node] = max(took[node], time.monotonic() - began)
        return node, (status["machine_index"], status["digest"]), None

    deadline = time.monotonic() + timeout_s
    with ThreadPoolExecutor(len(nodes)) as pool:
        while True:
            for node, result, error in pool.map(audit, nodes):
                tried[node] += 1
                if result is None:
                    failed[node] += 1
                    last_error[node] = error or ""
                else:
                    audited[node][result[0]] = result[1]
                    last_audit[node] = result
            verdict, detail = decide(audited)
            if verdict != "inconclusive" or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    rounds = max(tried.values(), default=0)
    detail += f"; {rounds} round(s), the longest audit " + ", ".join(
        f"{n} {took[n]:.2f} s" for n in nodes
    )
    if verdict == "agree":
        return Agreement(verdict=verdict, detail=detail)
    now = clock()
    with watch.lock:
        latest, errors = dict(watch.latest), dict(watch.errors)
        advanced = dict(watch.advanced_at)
    top = max((s["commit_index"] for _, s in latest.values()), default=None)
    evidence = []
    for node in nodes:
        seen = latest.get(node)
        status = seen[1] if seen else None
        evidence.append(
            NodeEvidence(
                node=node,
                alive=cluster.alive(node),
                status=status,
                status_age_s=now - seen[0] if seen else None,
                status_error=errors.get(node),
                behind=None if status is None or top is None else top - status["last_applied"],
                stalled_s=now - advanced[node] if node in advanced else None,
                audits=tried[node],
                last_audit=last_audit.get(node),
                audit_error=last_error.get(node),
                audit_errors=failed[node],
                audit_s=took[node],
                log_tail=log_tail(cluster.log_path(node)),
            )
        )
    return Agreement(verdict=verdict, detail=detail, evidence=tuple(evidence))


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
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning"],
        help="the nodes' log level (info or debug: elections are counted from the logs)",
    )
    parser.add_argument(
        "--faults",
        choices=["mixed", "none"],
        default="mixed",
        help="none: no fault at all, and the run fails on any election",
    )
    parser.add_argument(
        "--cpu-hog",
        type=int,
        default=0,
        metavar="N",
        help="N busy-looping processes beside the cluster while the faults (or none) run",
    )
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
        fault_mode=args.faults,
        hogs=args.cpu_hog,
        log=(lambda _line: None) if args.quiet else print,
    )
    print(report.summary())
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
