"""What every system's benchmark shares: message bodies, process accounting, producer
processes and the analysis of a paced run (latency, failover, lost and duplicated).

Every workload numbers its messages 0, 1, 2, ...; the number is the first 8 bytes of a
100-byte body, so a consumer knows which message it got without any broker feature.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import queue as queue_module
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PAYLOAD = 100
_PADDING = os.urandom(PAYLOAD - 8)


def message_body(index: int) -> bytes:
    """A 100-byte body that starts with the message's number."""
    return index.to_bytes(8, "big") + _PADDING


def message_index(body: bytes) -> int:
    return int.from_bytes(body[:8], "big")


def wait_until(
    condition: Callable[[], bool], timeout: float, what: str, interval: float = 0.05
) -> None:
    """Poll `condition` until it holds; RuntimeError naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


# ------------------------------------------------------------ process accounting

_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds of a live process (0 if it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime


def peak_rss_mb(pid: int) -> float:
    """The process's peak resident set (VmHWM) in MiB (0 if it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def stop_process(proc: subprocess.Popen[bytes], pid: int | None = None, grace: float = 20) -> None:
    """SIGTERM `pid` (default: the child itself), wait for the child, SIGKILL after `grace`.
    A process a benchmark paused (SIGSTOP) is continued first: it would not act on the
    SIGTERM before."""
    target = proc.pid if pid is None else pid
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(target, signal.SIGCONT)
            os.kill(target, signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            pass
        for victim in {target, proc.pid}:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, 9)
        proc.wait(timeout=10)


def stop_on_sigterm() -> None:
    """Make SIGTERM end the benchmark as Ctrl-C does: through its `finally` blocks, which
    continue a paused node and stop every process it started (a test harness's timeout
    or a CI cancel sends SIGTERM; by default Python died at once and left them running)."""

    def interrupt(_signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt("SIGTERM")

    signal.signal(signal.SIGTERM, interrupt)


# ------------------------------------------------------------ producer processes


def take_message(out: Any, procs: Sequence[Any], within: float) -> Any:
    """The next message a child process put on `out`; RuntimeError if a child died
    (a nonzero exit code) or nothing came within `within` seconds."""
    deadline = time.monotonic() + within
    while True:
        try:
            return out.get(timeout=0.5)
        except queue_module.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"child processes died (exit codes {dead}) or hung") from None


class Countdown:
    """Deliveries counted down to `n` (`on_message`, a consumer's callback); `finished`
    is set at the `n`th."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.got = 0
        self.finished = asyncio.Event()

    def on_message(self, _index: int, _redelivered: bool) -> None:
        self.got += 1
        if self.got >= self.n:
            self.finished.set()


def run_async_child(main: Callable[[], Coroutine[Any, Any, None]], out: Any) -> None:
    """Run a child process's asyncio `main`; an exception goes to `out` as the child's
    answer (`run_producer_processes` reports it)."""
    try:
        asyncio.run(main())
    except Exception as e:
        out.put(f"{type(e).__name__}: {e}")


def run_producer_processes(target: Callable[..., None], args: Sequence[tuple[Any, ...]]) -> float:
    """Run one spawned process per `args` entry calling `target(*a, ready, start, out)`.

    Each child connects, puts "ready" on `out`, waits for `start`, publishes, then puts its
    message count on `out`. Returns the total msg/s from `start` to the last child's end.
    """
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=target, args=(*a, start, out), daemon=True) for a in args]
    for p in procs:
        p.start()

    def next_message(within: float) -> Any:
        return take_message(out, procs, within)

    try:
        for _ in procs:
            message = next_message(120)
            if message != "ready":
                raise RuntimeError(f"producer failed before start: {message}")
        began = time.perf_counter()
        start.set()
        total = 0
        for _ in procs:
            message = next_message(600)
            if not isinstance(message, int):
                raise RuntimeError(f"producer failed: {message}")
            total += message
        return total / (time.perf_counter() - began)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()


# ------------------------------------------------------------------ paced runs


@dataclass
class Trace:
    """What a paced run saw: when each message was sent, confirmed and delivered."""

    rate: int
    sent: list[float] = field(default_factory=list)
    confirmed: dict[int, float] = field(default_factory=dict)
    deliveries: list[tuple[int, float, bool]] = field(default_factory=list)
    """(message number, time, marked redelivered)"""
    killed_at: float | None = None
    first_delivery: dict[int, float] = field(default_factory=dict)

    def on_confirm(self, index: int) -> None:
        self.confirmed.setdefault(index, time.perf_counter())

    def on_delivery(self, index: int, redelivered: bool) -> None:
        now = time.perf_counter()
        self.deliveries.append((index, now, redelivered))
        self.first_delivery.setdefault(index, now)

    def all_delivered(self) -> bool:
        """Every confirmed message has been delivered at least once."""
        return all(i in self.first_delivery for i in list(self.confirmed))

    def analyse(self) -> dict[str, float]:
        """Latency percentiles (ms), achieved rate, and with a kill: failover, lost, dups."""
        first = self.first_delivery
        confirm_ms = sorted((self.confirmed[i] - self.sent[i]) * 1e3 for i in self.confirmed)
        deliver_ms = sorted((t - self.sent[i]) * 1e3 for i, t in first.items())
        result: dict[str, float] = {
            "sent": len(self.sent),
            "achieved_rate": (len(self.sent) - 1) / (self.sent[-1] - self.sent[0]),
            "confirm_p50_ms": percentile(confirm_ms, 50),
            "confirm_p99_ms": percentile(confirm_ms, 99),
            "deliver_p50_ms": percentile(deliver_ms, 50),
            "deliver_p99_ms": percentile(deliver_ms, 99),
            "deliver_p999_ms": percentile(deliver_ms, 99.9),
        }
        if self.killed_at is not None:
            after = [i for i, t in enumerate(self.sent) if t >= self.killed_at]
            result["confirms_resumed_s"] = (
                min(self.confirmed[i] for i in after if i in self.confirmed) - self.killed_at
            )
            result["deliveries_resumed_s"] = (
                min(first[i] for i in after if i in first) - self.killed_at
            )
            seen: set[int] = set()
            duplicated = unmarked = 0
            for i, _, redelivered in self.deliveries:
                if i in seen:
                    duplicated += 1
                    unmarked += not redelivered
                seen.add(i)
            result["unconfirmed"] = len(self.sent) - len(self.confirmed)
            result["lost"] = sum(1 for i in self.confirmed if i not in first)
            result["duplicated"] = duplicated
            result["unmarked_duplicates"] = unmarked
        return result


def percentile(ordered: Sequence[float], pct: float) -> float:
    """The nearest-rank percentile of an ascending list (nan when empty)."""
    if not ordered:
        return float("nan")
    rank = min(len(ordered) - 1, max(0, int(len(ordered) * pct / 100 + 0.5) - 1))
    return ordered[rank]


def latency_sample(trace: Trace, limit: int = 500) -> list[float]:
    """About `limit` evenly spaced publish->delivery latencies (ms, to 0.01), always with
    the largest, for the CDF plot."""
    ordered = sorted((t - trace.sent[i]) * 1e3 for i, t in trace.first_delivery.items())
    step = max(1, len(ordered) // limit)
    sample = ordered[::step] + ordered[-1:]
    return [round(v, 2) for v in sample]


# ------------------------------------------------------ asyncio publish drivers


async def publish_windowed(publish: Callable[[int], Awaitable[None]], n: int, window: int) -> None:
    """Publish messages 0..n-1 with at most `window` awaiting their confirm."""
    free = asyncio.Semaphore(window)
    failures: list[BaseException] = []
    tasks: set[asyncio.Task[None]] = set()

    def done(task: asyncio.Task[None]) -> None:
        tasks.discard(task)
        free.release()
        if not task.cancelled() and task.exception() is not None:
            failures.append(task.exception())  # type: ignore[arg-type]

    for i in range(n):
        await free.acquire()
        if failures:
            raise failures[0]
        task = asyncio.create_task(publish(i))
        tasks.add(task)
        task.add_done_callback(done)
    if tasks:
        await asyncio.gather(*tasks)


async def publish_paced(
    trace: Trace,
    seconds: float,
    publish: Callable[[int], Awaitable[None]],
    kill: Callable[[], None] | None = None,
    kill_at: float = 0.0,
) -> None:
    """Publish at `trace.rate` msg/s for `seconds`, recording send times in `trace`;
    with `kill`, call it once `kill_at` seconds in. Waits for every confirm."""
    tasks: set[asyncio.Task[None]] = set()
    began = time.perf_counter()
    for i in range(int(trace.rate * seconds)):
        delay = began + i / trace.rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        elif i % 16 == 0:
            await asyncio.sleep(0)  # behind schedule: still let confirms in
        if kill is not None and trace.killed_at is None and time.perf_counter() - began >= kill_at:
            kill()
            trace.killed_at = time.perf_counter()
        trace.sent.append(time.perf_counter())
        task = asyncio.create_task(publish(i))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.gather(*tasks)


async def wait_delivered(trace: Trace, within: float = 60) -> None:
    """Let consumers run until every confirmed message was delivered (or `within` s pass:
    what is still missing then counts as lost)."""
    deadline = time.monotonic() + within
    # the trace is shared with threaded clients too, so it is polled, not awaited
    while not trace.all_delivered() and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.05)
