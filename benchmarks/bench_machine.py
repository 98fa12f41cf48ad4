"""Queue machine throughput: enqueue -> deliver -> ack on one core.

    python -m benchmarks.bench_machine [--messages 100000] [--repeat 3]

Every message is enqueued, delivered (the machine's `Deliver` effect) and acked.
"batch" enqueues 100 messages per `EnqueueBatch` and acks what each consumer got per
batch in one `Ack`; "single" uses one `Enqueue` and one `Ack` per message. Keys: none,
or 10,000 distinct ordering keys in rotation. Bodies are 100 random bytes. Prefetch is
1,000 per consumer (10 with 1,000 consumers). Building the commands (what a replica's
decoder does) is counted. Rates are per CPU second of this process (`process_time`), so
other load on a shared machine disturbs them less than wall time would. The table gives
the median of the repeats and the best one (the least disturbed, as `timeit` reports).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections import defaultdict

from quorumq.machine import (
    Ack,
    Declare,
    Deliver,
    Enqueue,
    EnqueueBatch,
    Machine,
    Message,
    Meta,
    Subscribe,
)

BATCH = 100
DISTINCT_KEYS = 10_000


def run(consumers: int, keyed: bool, batch: bool, messages: int) -> float:
    """Messages per CPU second through the whole cycle."""
    m = Machine()
    index = 0

    def apply(command: object) -> tuple[object, ...]:
        nonlocal index
        index += 1
        return m.apply(Meta(index, index), command).effects  # type: ignore[arg-type]

    apply(Declare(queue="q"))
    prefetch = 10 if consumers >= 1000 else 1000
    for c in range(consumers):
        apply(Subscribe(queue="q", consumer=f"c{c}", node="A", prefetch=prefetch))
    pool = [os.urandom(100) for _ in range(1024)]
    keys = [f"key-{i}" for i in range(DISTINCT_KEYS)] if keyed else [None]
    nkeys = len(keys)

    start = time.process_time()
    sent = 0
    while sent < messages:
        if batch:
            effects = apply(
                EnqueueBatch(
                    queue="q",
                    messages=[
                        Message(body=pool[(sent + i) & 1023], key=keys[(sent + i) % nkeys])
                        for i in range(BATCH)
                    ],
                )
            )
            held: dict[str, list[int]] = defaultdict(list)
            for e in effects:
                if type(e) is Deliver:
                    held[e.consumer].append(e.offset)
            for consumer, offsets in held.items():
                apply(Ack(queue="q", consumer=consumer, offsets=offsets))
            sent += BATCH
        else:
            for e in apply(Enqueue(queue="q", body=pool[sent & 1023], key=keys[sent % nkeys])):
                if type(e) is Deliver:
                    apply(Ack(queue="q", consumer=e.consumer, offsets=(e.offset,)))
            sent += 1
    elapsed = time.process_time() - start
    stats = m.stats("q")
    assert stats.next_offset == sent and stats.ready == 0 and stats.unacked == 0, stats
    return sent / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    print(
        f"machine: {platform.python_implementation()} {platform.python_version()}, "
        f"{platform.machine()}, {os.cpu_count()} cores; {args.messages} messages x "
        f"{args.repeat} runs"
    )
    print()
    print("| enqueue | consumers | keys | msgs per CPU s: median | best | worst |")
    print("|---|---:|---:|---:|---:|---:|")
    for batch in (True, False):
        for keyed in (False, True):
            for consumers in (1, 10, 1000):
                rates = [run(consumers, keyed, batch, args.messages) for _ in range(args.repeat)]
                print(
                    f"| {'batch of 100' if batch else 'single'} | {consumers} | "
                    f"{DISTINCT_KEYS if keyed else 0} | {statistics.median(rates):,.0f} | "
                    f"{max(rates):,.0f} | {min(rates):,.0f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
