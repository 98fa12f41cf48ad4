"""Reads that wait (`wait_ms`) while a node takes publishes: issue 27, item 6.

    python -m benchmarks.bench_reads [--before DIR] [--connections 100] [--reads 64]
                                     [--rate 200] [--seconds 6] [--fsync never]

The complaint: 100 connections with 64 waiting reads each took a leader's publish p50
from 3.4 to 310 ms. A one-node group (a `quorumq node` process, so that the node has
its own interpreter) takes publishes paced at `--rate` msg/s, one at a time, each
awaiting its confirm, for `--seconds`; publish call -> confirm, p50 and p99, after a
second of warm-up. Three loads, one after the other on the same node:

* none: no reads;
* idle queue: `--connections` connections each keep `--reads` reads waiting on a queue
  nobody publishes to (30 s each, the most, so none ends during the run);
* same queue: as many waiting on the published queue, a million offsets ahead (every
  publish moves the end of the queue they wait on; none is answered).

With `--before DIR` (a copy of an earlier tree, e.g. `git archive <commit> quorumq |
tar -x -C DIR`) the same runs go first against a node run from DIR, then against this
tree's: the table puts them side by side. The readers run in this process (trio), and
wait: the node does the work.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio

import quorumq.aio
from quorumq.client import ServerError
from quorumq.ops.local_cluster import free_ports

HERE = Path(__file__).resolve().parent.parent
WAIT_S = 30.0
AHEAD = 1_000_000


def _start_node(root: Path, source: Path, fsync: str) -> tuple[subprocess.Popen[bytes], str]:
    client, raft = free_ports(2)
    command = [sys.executable, "-m", "quorumq", "node", "--id", "A", "--insecure"]
    command += ["--data-dir", str(root / "A"), "--listen", f"127.0.0.1:{client}"]
    command += ["--raft", f"127.0.0.1:{raft}", "--fsync", fsync, "--log-level", "warning"]
    env = {**os.environ, "PYTHONPATH": str(source)}
    log_path = root / "A.log"
    log = open(log_path, "ab")  # noqa: SIM115 - the child owns it from here
    try:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(source)
        )
    finally:
        log.close()
    deadline = time.monotonic() + 60
    while b" ready: " not in log_path.read_bytes():
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the node did not start:\n{log_path.read_text()}")
        time.sleep(0.05)
    return process, f"127.0.0.1:{client}"


def _imported_from(source: Path) -> str:
    """Where a node run from `source` imports quorumq from (the check that the runs
    compare the trees they say they do)."""
    out = subprocess.run(
        [sys.executable, "-c", "import quorumq; print(quorumq.__file__)"],
        env={**os.environ, "PYTHONPATH": str(source)},
        cwd=str(source),
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


async def _reader(
    endpoint: str, queue: str, start: int, reads: int, connected: trio.Event, go: trio.Event
) -> None:
    """One connection keeping `reads` reads of `queue` waiting from `start` on (each asked
    again when answered), once every reader is `connected` and it is told to `go` (a node
    busy with waiting reads can be too slow to answer the next connections' hello)."""
    async with quorumq.aio.connect(endpoint) as client, trio.open_nursery() as nursery:
        connected.set()
        await go.wait()

        async def keep_waiting(offset: int) -> None:
            while True:
                try:
                    await client.read(queue, offset, offset + 1, wait=WAIT_S)
                except ServerError as e:
                    if e.code != "lagging":
                        raise

        for i in range(reads):
            nursery.start_soon(keep_waiting, start + i)


async def _publish_paced(
    client: quorumq.aio.AsyncClient, queue: str, rate: int, seconds: float
) -> list[float]:
    latencies: list[float] = []
    interval = 1 / rate
    start = trio.current_time()
    warm_until = start + 1.0
    n = 0
    while (now := trio.current_time()) < start + 1.0 + seconds:
        began = time.perf_counter()
        await client.publish(queue, b"x" * 100)
        if now >= warm_until:
            latencies.append((time.perf_counter() - began) * 1000)
        n += 1
        await trio.sleep_until(start + n * interval)
    return latencies


async def _run_loads(
    endpoint: str, connections: int, reads: int, rate: int, seconds: float
) -> dict[str, list[float]]:
    async with quorumq.aio.connect(endpoint) as publisher:
        await publisher.declare("pub")
        await publisher.declare("idle")
        results = {"none": await _publish_paced(publisher, "pub", rate, seconds)}
        for load, queue, start in (("idle queue", "idle", 1), ("same queue", "pub", AHEAD)):
            async with trio.open_nursery() as nursery:
                go = trio.Event()
                connected = [trio.Event() for _ in range(connections)]
                for event in connected:
                    nursery.start_soon(_reader, endpoint, queue, start, reads, event, go)
                with trio.fail_after(60):
                    for event in connected:
                        await event.wait()
                go.set()
                await trio.sleep(1.0)  # the reads reach the node
                results[load] = await _publish_paced(publisher, "pub", rate, seconds)
                nursery.cancel_scope.cancel()
            await trio.sleep(1.0)  # the node sees the connections go
    return results


def _run(source: Path, args: argparse.Namespace) -> dict[str, list[float]]:
    with tempfile.TemporaryDirectory(prefix="bench-reads-") as tmp:
        process, endpoint = _start_node(Path(tmp), source, args.fsync)
        try:
            return trio.run(
                _run_loads, endpoint, args.connections, args.reads, args.rate, args.seconds
            )
        finally:
            process.terminate()
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, help="an earlier tree, run first")
    parser.add_argument("--connections", type=int, default=100)
    parser.add_argument("--reads", type=int, default=64, help="waiting reads per connection")
    parser.add_argument("--rate", type=int, default=200, help="publishes per second")
    parser.add_argument("--seconds", type=float, default=6.0, help="per load, after warm-up")
    parser.add_argument("--fsync", choices=["always", "batch", "never"], default="never")
    args = parser.parse_args(argv)
    trees = [("before", args.before.resolve())] if args.before else []
    trees.append(("this tree", HERE))
    load_before = os.getloadavg()
    rows = []
    for name, source in trees:
        print(f"{name}: quorumq from {_imported_from(source)}", file=sys.stderr, flush=True)
        for load, latencies in _run(source, args).items():
            rows.append((name, load, latencies))
            print(f"{name}, {load}: done", file=sys.stderr, flush=True)
    load_after = os.getloadavg()
    print(
        f"one node, fsync={args.fsync}; publishes at {args.rate} msg/s, one at a time, for "
        f"{args.seconds:g} s; waiting reads: {args.connections} connections x {args.reads}; "
        f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after\n"
    )
    print("| tree | waiting reads | publishes | p50 ms | p99 ms |")
    print("|---|---|---|---|---|")
    for name, load, latencies in rows:
        print(
            f"| {name} | {load} | {len(latencies)} | {statistics.median(latencies):.2f} | "
            f"{_quantile(latencies, 0.99):.2f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
