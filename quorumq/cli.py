"""The `quorumq` command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .scenarios import SCENARIOS, render


def _demo(args: argparse.Namespace) -> int:
    names = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    for name in names:
        print(render(SCENARIOS[name]))
        print()
    print(
        "Three queue machines applied the same log, each at its own pace: every replica\n"
        "computed the same assignment and only the replica local to a consumer sent to it.\n"
        "(This demo runs the machines in one process; the replicated-cluster demo, with real\n"
        "node processes and a leader kill, arrives with the cluster and broker.)"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="quorumq", description="A Raft-replicated, ordered message queue."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = commands.add_parser(
        "demo", help="replay RabbitMQ's local-delivery scenarios on three queue machines"
    )
    demo.add_argument(
        "--scenario",
        choices=[*SCENARIOS, "all"],
        default="all",
        help="which event sequence of the post to play (default: all)",
    )
    demo.set_defaults(run=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result: int = args.run(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
