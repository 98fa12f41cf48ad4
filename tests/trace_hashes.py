"""The simulator's trace hashes on the CI seeds and on 20 default seeds, for proving that a
change of structure changes no behaviour: the same hashes before and after.

    python -m tests.trace_hashes > before.json      # on the revision before
    python -m tests.trace_hashes --compare before.json

A trace hash covers every event of a run (messages, faults, applies, deliveries), so
equal hashes mean the real node code did the same things in the same order.
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ProcessPoolExecutor

from simulations.runner import RunConfig, run

from .test_sim import CI_SEEDS, ci_config

DEFAULT_SEEDS = range(20)


def _hash(config: RunConfig) -> str:
    return run(config).trace_hash


def trace_hashes(jobs: int = 2) -> dict[str, str]:
    """'ci:<seed>' and 'default:<seed>' -> trace hash."""
    named = [(f"ci:{s}", ci_config(s)) for s in CI_SEEDS]
    named += [(f"default:{s}", RunConfig(seed=s)) for s in DEFAULT_SEEDS]
    with ProcessPoolExecutor(jobs) as pool:
        hashes = pool.map(_hash, [config for _, config in named])
        return dict(zip([name for name, _ in named], hashes, strict=True))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.trace_hashes")
    parser.add_argument("--compare", metavar="FILE", help="hashes from before, to compare with")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args(argv)
    now = trace_hashes(args.jobs)
    if args.compare is None:
        json.dump(now, sys.stdout, indent=1, sort_keys=True)
        print()
        return 0
    with open(args.compare) as f:
        before = json.load(f)
    changed = sorted(k for k in before.keys() | now.keys() if before.get(k) != now.get(k))
    for name in changed:
        print(f"{name}: {before.get(name)} -> {now.get(name)}")
    print(f"{len(now) - len(changed)} of {len(now)} runs have the same trace hash")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
