"""The `quorumq` command."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from .scenarios import SCENARIOS, render


class UsageError(Exception):
    """A bad argument: reported in one line, exit status 2."""


def _address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise argparse.ArgumentTypeError(f"{text!r} is not host:port")
    return host, int(port)


def _peer(text: str) -> tuple[str, str]:
    name, sep, address = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"{text!r} is not NODE=host:port")
    _address(address)
    return name, address


def _secret(file: str | None, env: str, what: str) -> str | None:
    if file is not None:
        try:
            value = Path(file).read_text().strip()
        except OSError as e:
            raise UsageError(f"cannot read the {what} file: {e}") from None
        if not value:
            raise UsageError(f"the {what} file {file} is empty")
        return value
    return os.environ.get(env) or None


def _node(args: argparse.Namespace) -> int:
    import trio  # noqa: PLC0415 - only the node needs the server stack

    from .replica import ConfigError, ReplicaConfig  # noqa: PLC0415
    from .server import NodeConfig, NodeServer  # noqa: PLC0415

    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format=f"%(asctime)s {args.id} %(levelname)s %(name)s: %(message)s",
    )
    peers = dict(args.peer)
    peers[args.id] = f"{args.raft[0]}:{args.raft[1]}"
    try:
        replica = ReplicaConfig(
            node_id=args.id,
            peers=peers,
            data_dir=args.data_dir,
            secret=_secret(args.secret_file, "QUORUMQ_SECRET", "cluster secret"),
            insecure=args.insecure,
            fsync=args.fsync,
            node_down_grace_s=args.node_down_grace,
            compaction_entries=args.compaction_entries,
        )
    except ConfigError as e:
        raise UsageError(str(e)) from None
    config = NodeConfig(
        replica=replica,
        listen_host=args.listen[0],
        listen_port=args.listen[1],
        token=_secret(args.token_file, "QUORUMQ_TOKEN", "client token"),
        max_body=args.max_body,
    )

    async def run() -> None:
        server = NodeServer(config)
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(server.serve)
            host, port = listeners[0].socket.getsockname()[:2]
            print(
                f"quorumq node {args.id} ready: clients on {host}:{port}, "
                f"raft on {peers[args.id]}, fsync={args.fsync}",
                flush=True,
            )
            import signal  # noqa: PLC0415

            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    nursery.cancel_scope.cancel()
                    break

    trio.run(run)
    return 0


def _demo(args: argparse.Namespace) -> int:
    if args.post:
        names = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
        for name in names:
            print(render(SCENARIOS[name]))
            print()
        print(
            "Three queue machines applied the same log, each at its own pace: every replica\n"
            "computed the same assignment and only the replica local to a consumer sent to it."
        )
        return 0
    from .demo import run  # noqa: PLC0415 - starts processes: only when asked

    timeline = Path(args.timeline) if args.timeline else None
    result = run(messages=args.messages, timeline=timeline)
    return 0 if result.ok else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="quorumq", description="A Raft-replicated, ordered message queue."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = commands.add_parser(
        "demo",
        help="run a 3-node cluster, kill its leader mid-stream, and show what every node delivered",
    )
    demo.add_argument("--messages", type=int, default=600, help="how many to publish")
    demo.add_argument("--timeline", help="where to write the HTML timeline")
    demo.add_argument(
        "--post",
        action="store_true",
        help="instead: replay the event sequences of RabbitMQ's local-delivery post on "
        "three in-process queue machines",
    )
    demo.add_argument(
        "--scenario",
        choices=[*SCENARIOS, "all"],
        default="all",
        help="with --post: which sequence to play (default: all)",
    )
    demo.set_defaults(run=_demo)

    node = commands.add_parser("node", help="run one node of a cluster (replica and server)")
    node.add_argument("--id", required=True, help="this node's name, e.g. A")
    node.add_argument("--data-dir", required=True, help="where the journal and snapshots live")
    node.add_argument("--listen", type=_address, required=True, help="client address host:port")
    node.add_argument("--raft", type=_address, required=True, help="Raft address host:port")
    node.add_argument(
        "--peer", type=_peer, action="append", default=[], help="another replica: NODE=host:port"
    )
    node.add_argument("--secret-file", help="file with the cluster secret (or set QUORUMQ_SECRET)")
    node.add_argument(
        "--insecure",
        action="store_true",
        help="run without a cluster secret (only when every Raft address is loopback)",
    )
    node.add_argument("--token-file", help="file with the client token (or set QUORUMQ_TOKEN)")
    node.add_argument("--fsync", choices=["always", "batch", "never"], default="always")
    node.add_argument("--node-down-grace", type=float, default=5.0, metavar="SECONDS")
    node.add_argument("--max-body", type=int, default=1024 * 1024, metavar="BYTES")
    node.add_argument(
        "--compaction-entries",
        type=int,
        default=50_000,
        metavar="N",
        help="snapshot the machine and compact the log past this many entries",
    )
    node.add_argument("--log-level", default="warning", choices=["debug", "info", "warning"])
    node.set_defaults(run=_node)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        result: int = args.run(args)
    except UsageError as e:
        parser.exit(2, f"quorumq {args.command}: {e}\n")
    except KeyboardInterrupt:
        return 130
    return result


if __name__ == "__main__":
    sys.exit(main())
