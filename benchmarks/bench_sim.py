"""Simulator speed: simulated seconds per wall second, and default seeds per hour.

    python -m benchmarks.bench_sim [--rates 100,1000] [--seeds 20] [--jobs 2]

* For 3 and 5 nodes, a fault-free run at each workload rate (records/s) gives simulated
  seconds per wall second (issue 17's targets: 100x at 100 records/s, 20x at 1,000).
* A sweep of default seeds (`quorumq simulate run --seed N`: 30 s of faults at 150
  records/s, then heal and drain) in `--jobs` processes gives seconds per seed and the
  hours 10,000 seeds would take (target: one hour on 2 cores).
* The CI configuration (24 s of faults, one every 0.6 s, 10 records/s) gives seeds per
  minute on one core.

Times are CPU seconds of this process where one process runs (`time.process_time`: a
shared machine's other load stretches wall time, not CPU time), and wall seconds for the
sweep across processes. To compare two versions, run this file in each checkout, side
by side, in one session (`PYTHONPATH=<checkout> python benchmarks/bench_sim.py`).
"""

from __future__ import annotations

import argparse
import os
import time

from simulations.runner import RunConfig, run, sweep
from simulations.workload import WorkloadConfig


def speed(nodes: int, rate: float, steps: int) -> tuple[float, float]:
    """(simulated s per CPU s, records per CPU s) of one fault-free run."""
    started = time.process_time()
    result = run(
        RunConfig(
            seed=1, nodes=nodes, faults="none", steps=steps, workload=WorkloadConfig(rate=rate)
        )
    )
    cpu = time.process_time() - started
    assert result.ok, result.summary()
    return result.sim_s / cpu, result.counts["acked"] / cpu


def default_sweep(seeds: int, jobs: int) -> float:
    """Wall seconds per default seed, `jobs` seeds at a time."""
    started = time.perf_counter()
    outcomes = list(sweep((RunConfig(seed=s) for s in range(seeds)), jobs=jobs))
    wall = time.perf_counter() - started
    failed = [o.seed for o in outcomes if not o.ok]
    assert not failed, f"default seeds failed: {failed}"
    return wall / seeds


def seeds_per_minute(nodes: int, seeds: int) -> float:
    started = time.process_time()
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
    return seeds * 60 / (time.process_time() - started)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rates", default="100,1000")
    parser.add_argument("--nodes", default="3,5")
    parser.add_argument("--seeds", type=int, default=20, help="default seeds to sweep")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--ci-seeds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2000, help="10 ms steps per speed run")
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    print("| nodes | records/s | sim s per CPU s | records per CPU s |")
    print("|---:|---:|---:|---:|")
    for nodes in (int(n) for n in args.nodes.split(",")):
        for rate in rates:
            ratio, records = speed(nodes, rate, args.steps)
            print(f"| {nodes} | {rate:g} | {ratio:.1f} | {records:.0f} |", flush=True)
    if args.seeds:
        per_seed = default_sweep(args.seeds, args.jobs)
        hours = per_seed * 10_000 / 3600
        print(
            f"default seeds 0-{args.seeds - 1}, {args.jobs} processes: {per_seed:.2f} wall s "
            f"per seed; 10,000 seeds would take {hours:.1f} h",
            flush=True,
        )
    for nodes in (3, 5) if args.ci_seeds else ():
        per_minute = seeds_per_minute(nodes, args.ci_seeds)
        print(f"{nodes} nodes, CI configuration: {per_minute:.1f} seeds per CPU minute")
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
