"""Simulator speed: simulated seconds per wall second, and seeds per minute.

    python -m benchmarks.bench_sim [--rates 0,10,100,1000] [--seeds 5]

For 3 and 5 nodes: a fault-free run at each workload rate (records/s) gives simulated
seconds per wall second; the CI configuration (24 s of faults, one every 0.6 s, 10
records/s) gives seeds per minute on one core.
"""

from __future__ import annotations

import argparse
import time

from simulations.runner import RunConfig, run
from simulations.workload import WorkloadConfig


def speed(nodes: int, rate: float, steps: int) -> tuple[float, float]:
    """(simulated s / wall s, records per wall s) of one fault-free run."""
    result = run(
        RunConfig(
            seed=1, nodes=nodes, faults="none", steps=steps, workload=WorkloadConfig(rate=rate)
        )
    )
    assert result.ok, result.summary()
    return result.sim_s / result.wall_s, result.counts["acked"] / result.wall_s


def seeds_per_minute(nodes: int, seeds: int) -> float:
    started = time.perf_counter()
    for seed in range(seeds):
        run(
            RunConfig(
                seed=seed,
                nodes=nodes,
                steps=2400,
                fault_interval_s=0.6,
                workload=WorkloadConfig(rate=10),
            )
        )
    return seeds * 60 / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rates", default="0,10,100,1000")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2000, help="10 ms steps per speed run")
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    print("| nodes | records/s | sim s per wall s | records per wall s |")
    print("|---:|---:|---:|---:|")
    for nodes in (3, 5):
        for rate in rates:
            ratio, records = speed(nodes, rate, args.steps)
            print(f"| {nodes} | {rate:g} | {ratio:.1f} | {records:.0f} |", flush=True)
    for nodes in (3, 5):
        per_minute = seeds_per_minute(nodes, args.seeds)
        print(f"{nodes} nodes, CI configuration: {per_minute:.1f} seeds/minute")


if __name__ == "__main__":
    main()
