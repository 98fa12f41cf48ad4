"""`python -m benchmarks compare ...`: quorumq side by side with RabbitMQ and NATS.
`python -m benchmarks peers rabbitmq|nats`: start a peer cluster by hand, stop it on Enter."""

from __future__ import annotations

import sys


def _peers(argv: list[str]) -> None:
    from .peers.jetstream import NatsCluster, nats_missing
    from .peers.rabbitmq import RabbitCluster, rabbitmq_missing

    kind = argv[0] if argv else ""
    if kind not in ("rabbitmq", "nats"):
        raise SystemExit("usage: python -m benchmarks peers rabbitmq|nats")
    missing = rabbitmq_missing() if kind == "rabbitmq" else nats_missing()
    if missing:
        raise SystemExit(missing)
    cluster = RabbitCluster() if kind == "rabbitmq" else NatsCluster()
    with cluster:
        members = cluster.nodes if isinstance(cluster, RabbitCluster) else cluster.servers
        for member in members:
            print(f"{member}: {cluster.url(member)} pid {cluster.pids()[member]}")
        print(f"data in {cluster.root}; press Enter to stop", flush=True)
        sys.stdin.readline()


def main() -> None:
    command, rest = (sys.argv[1], sys.argv[2:]) if len(sys.argv) > 1 else ("", [])
    if command == "compare":
        from .compare import main as compare

        compare(rest)
    elif command == "peers":
        _peers(rest)
    else:
        raise SystemExit("usage: python -m benchmarks compare [options] | peers rabbitmq|nats")


if __name__ == "__main__":
    main()
