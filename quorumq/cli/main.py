"""The `quorumq` command: its parser (every verb and its options) and `main`, which
turns every error a user can cause into one line on stderr and exit status 2."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from .. import __version__
from ..ops.scenarios import SCENARIOS
from .args import (
    Parser,
    UsageError,
    backoff_ms,
    host_port,
    peer,
    queue_name,
    seconds,
    timeout_pair,
    whole_number,
)
from .connecting import client_error
from .devcluster import DEFAULT_CLUSTER_DIR, run_cluster
from .node import run_demo, run_node
from .queues import (
    run_consume,
    run_declare,
    run_delete_queue,
    run_publish,
    run_purge_queue,
    run_queues,
)
from .status import run_members, run_status


def _simulate(arguments: list[str]) -> int:
    """The simulator's own command line: shipped as `quorumq.simulations` in the wheel,
    a top-level `simulations` package in a checkout."""
    try:
        module = importlib.import_module("quorumq.simulations.__main__")
    except ModuleNotFoundError:
        module = importlib.import_module("simulations.__main__")
    result: int = module.main(arguments)
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="quorumq", description="A Raft-replicated, ordered message queue.")
    parser.add_argument("--version", action="version", version=f"quorumq {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = commands.add_parser(
        "demo",
        help="run a 3-node cluster, kill its leader mid-stream, and show what every node delivered",
    )
    demo.add_argument(
        "--messages",
        type=whole_number(2),
        default=600,
        help="how many to publish (at least 2: the leader is killed halfway)",
    )
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
    demo.set_defaults(run=run_demo)

    simulate = commands.add_parser(
        "simulate",
        help="deterministic failover simulations: run, sweep, scenario (see simulate --help)",
        add_help=False,
    )
    simulate.add_argument("arguments", nargs=argparse.REMAINDER)
    simulate.set_defaults(run=lambda args: _simulate(list(args.arguments)))

    node = commands.add_parser("node", help="run one node of a cluster (replica and server)")
    node.add_argument("--id", required=True, help="this node's name, e.g. A")
    node.add_argument("--data-dir", required=True, help="where the journal and snapshots live")
    node.add_argument("--listen", type=host_port, required=True, help="client address host:port")
    node.add_argument("--raft", type=host_port, required=True, help="Raft address host:port")
    node.add_argument(
        "--peer", type=peer, action="append", default=[], help="another replica: NODE=host:port"
    )
    node.add_argument("--secret-file", help="file with the cluster secret (or set QUORUMQ_SECRET)")
    node.add_argument(
        "--insecure",
        action="store_true",
        help="run without a cluster secret or a client token (only when every Raft and "
        "client address is loopback)",
    )
    node.add_argument("--token-file", help="file with the client token (or set QUORUMQ_TOKEN)")
    node.add_argument(
        "--admin-token-file",
        help="file with the admin token, for membership changes (or set QUORUMQ_ADMIN_TOKEN)",
    )
    node.add_argument(
        "--tls-cert",
        metavar="FILE",
        help="serve clients over TLS only, with this PEM certificate (chain); needs --tls-key",
    )
    node.add_argument("--tls-key", metavar="FILE", help="the PEM private key of --tls-cert")
    node.add_argument("--fsync", choices=["always", "batch", "never"], default="always")
    node.add_argument(
        "--journal",
        choices=["file", "wal"],
        default="file",
        help="the Raft journal: a file of its own, or the write-ahead log that many Raft "
        "groups will share (issue 33; not the default yet: a file is carried over once, "
        "and a node on the log cannot go back)",
    )
    node.add_argument(
        "--groups",
        type=int,
        default=1,
        metavar="G",
        help="Raft groups this node hosts, queues placed over them, on one Raft port "
        "(default 1; every node of the cluster the same, and never changed; membership "
        "changes are not built for groups yet)",
    )
    node.add_argument("--node-down-grace", type=seconds, default=5.0, metavar="SECONDS")
    node.add_argument(
        "--election-timeout",
        type=timeout_pair,
        default=(0.25, 0.6),
        metavar="MIN,MAX",
        help="seconds without a leader before a follower stands for election (randomised)",
    )
    node.add_argument("--max-body", type=int, default=1024 * 1024, metavar="BYTES")
    node.add_argument(
        "--outbound-frames",
        type=whole_number(1),
        default=20_000,
        metavar="N",
        help="frames waiting for a client before it is cut off as a slow consumer",
    )
    node.add_argument(
        "--min-free-disk",
        type=whole_number(0),
        default=64,
        metavar="MIB",
        help="below this much free space on the data disk, refuse publishes (the disk "
        "alarm) until space returns; deliveries, acks and reads go on (0: never)",
    )
    node.add_argument(
        "--compaction-entries",
        type=whole_number(1),
        default=50_000,
        metavar="N",
        help="snapshot the machine and compact the log past this many entries",
    )
    node.add_argument(
        "--metrics",
        type=host_port,
        metavar="HOST:PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (port 0 picks one)",
    )
    node.add_argument("--log-level", default="warning", choices=["debug", "info", "warning"])
    node.set_defaults(run=run_node)

    cluster = commands.add_parser("cluster", help="a local dev cluster of node processes")
    cluster.add_argument("action", choices=["up", "down", "status"])
    cluster.add_argument("--dir", default=DEFAULT_CLUSTER_DIR, help="where its data dirs live")
    cluster.add_argument("--nodes", type=int, default=3, choices=range(1, 8), metavar="N")
    cluster.set_defaults(run=run_cluster)

    def client_options(p: argparse.ArgumentParser) -> None:
        p.add_argument("--endpoints", help="host:port,... (default: the local dev cluster)")
        p.add_argument("--dir", default=DEFAULT_CLUSTER_DIR, help="the local dev cluster's dir")
        p.add_argument("--token-file", help="file with the client token (or QUORUMQ_TOKEN)")
        p.add_argument(
            "--timeout",
            type=seconds,
            default=5.0,
            metavar="SECONDS",
            help="to connect (default 5); endpoints that all refuse the connection fail at once",
        )
        p.add_argument(
            "--tls",
            action="store_true",
            help="connect over TLS, trusting the system's CAs (nodes run with --tls-cert)",
        )
        p.add_argument(
            "--tls-ca",
            metavar="FILE",
            help="connect over TLS, trusting the CA certificates in this PEM file",
        )

    declare = commands.add_parser("declare", help="create a queue (or check its options)")
    declare.add_argument("queue", type=queue_name)
    declare.add_argument("--max-length", type=whole_number(0), help="most ready messages")
    declare.add_argument("--overflow", choices=["drop-head", "reject-publish"])
    declare.add_argument(
        "--delivery-limit", type=whole_number(0), help="returns before dead-lettering"
    )
    declare.add_argument("--dead-letter-queue", help="where rejected and expired messages go")
    declare.add_argument("--single-active-consumer", action="store_true")
    declare.add_argument(
        "--retention-messages", type=whole_number(0), help="stream view: newest N kept"
    )
    declare.add_argument(
        "--retention-bytes",
        type=whole_number(0),
        help="stream view: bytes kept (body, key, headers + 96 each)",
    )
    declare.add_argument(
        "--message-ttl-ms", type=whole_number(0), help="ready messages expire after this"
    )
    declare.add_argument(
        "--retry-backoff-ms",
        type=backoff_ms,
        metavar="MIN:MAX",
        help="a returned message waits MIN ms before it is delivered again, doubled with "
        "each failed delivery, at most MAX",
    )
    client_options(declare)
    declare.set_defaults(run=run_declare)

    publish = commands.add_parser("publish", help="publish messages (arguments or stdin lines)")
    publish.add_argument("queue", type=queue_name)
    publish.add_argument("message", nargs="*", help="message bodies (default: lines of stdin)")
    publish.add_argument("--key", help="ordering key")
    publish.add_argument("--quiet", action="store_true", help="print bare offsets")
    client_options(publish)
    publish.set_defaults(run=run_publish)

    consume = commands.add_parser("consume", help="print deliveries as JSON lines and ack them")
    consume.add_argument("queue", type=queue_name)
    consume.add_argument(
        "--count", type=whole_number(0), default=0, help="stop after N (0: until idle)"
    )
    consume.add_argument(
        "--prefetch",
        type=whole_number(0, 65_535),
        default=100,
        help="deliveries held unacked at most (up to 65535; 0: no limit)",
    )
    consume.add_argument("--wait", type=seconds, default=2.0, help="idle seconds before stopping")
    consume.add_argument("--no-ack", action="store_true", help="do not ack (they come back)")
    client_options(consume)
    consume.set_defaults(run=run_consume)

    delete = commands.add_parser(
        "delete-queue",
        help="delete a queue and its messages (refused while it has consumers)",
        description="Deletes the queue with its messages, stream view, producers and "
        "committed offsets, and prints how many messages went. A queue with consumers is "
        "refused unless --force. A queue declared again under the name is empty and "
        "carries on from the offset where this one ended.",
    )
    delete.add_argument("queue", type=queue_name)
    delete.add_argument(
        "--force",
        action="store_true",
        help="delete it even with consumers: they are cancelled (reason queue_deleted) "
        "and the messages they hold are deleted too",
    )
    client_options(delete)
    delete.set_defaults(run=run_delete_queue)

    purge = commands.add_parser(
        "purge-queue",
        help="remove a queue's ready messages (delivered ones stay with their consumers)",
        description="Removes the queue's ready messages, those waiting for a retry delay "
        "too, and prints how many went. Delivered ones stay with their consumers, to ack "
        "or nack as before; the stream view (read) keeps everything until retention "
        "drops it.",
    )
    purge.add_argument("queue", type=queue_name)
    client_options(purge)
    purge.set_defaults(run=run_purge_queue)

    members = commands.add_parser(
        "members",
        help="list, add or remove replicas of a running cluster (one change at a time)",
        description="To add a replica, first start its node with every current member "
        "and itself as --peer, then `members add NAME=HOST:PORT` (its Raft address). To "
        "remove one, `members remove NAME`, then stop that node.",
    )
    members.add_argument("action", choices=["list", "add", "remove"])
    members.add_argument("member", nargs="?", help="add: NAME=HOST:PORT; remove: NAME")
    client_options(members)
    members.set_defaults(run=run_members)

    status = commands.add_parser(
        "status",
        help="tables of the cluster's nodes and queues (--json: one node's status as JSON)",
        description="Asks every endpoint's node for its status: a table of nodes (role, "
        "Raft term, commit and applied index, lag behind the leader's commit, clients; a "
        "node that does not answer is a row saying why) and one of queues (ready, "
        "unacked, consumers, publish and deliver rates from two readings --interval "
        "apart).",
    )
    client_options(status)
    status.add_argument(
        "--json",
        action="store_true",
        help="print one node's status as JSON, for programs (every field, raw)",
    )
    status.add_argument(
        "--watch", action="store_true", help="refresh the tables in place until Ctrl-C"
    )
    status.add_argument(
        "--interval",
        type=seconds,
        default=1.0,
        metavar="SECONDS",
        help="between the two readings rates come from, and between refreshes (default 1)",
    )
    status.add_argument(
        "--wait",
        type=seconds,
        metavar="SECONDS",
        help="first wait until every endpoint's node answers, one leads and none lags "
        "behind (for scripts that start nodes); exit status 2 if not within SECONDS",
    )
    status.add_argument(
        "--audit",
        action="store_true",
        help="also the state digest and the log index it is of (needs the admin token, "
        "QUORUMQ_ADMIN_TOKEN; one audit at a time per node; the node encodes its state in "
        "a forked child, about 1.3 s per million 100-byte messages)",
    )
    status.set_defaults(run=run_status)

    queues = commands.add_parser("queues", help="a table of the queues")
    client_options(queues)
    queues.add_argument("--json", action="store_true", help="the queues' status as JSON")
    queues.set_defaults(run=run_queues)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The `quorumq` command: every error a user can cause is one line on stderr and
    exit status 2."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["simulate"]:  # its options, --help too, are the simulator's
        return _simulate(arguments[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        result: int = args.run(args)
    except UsageError as e:
        parser.exit(2, f"quorumq {args.command}: {e}\n")
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `quorumq status | head`: the reader went away
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except Exception as e:
        client = sys.modules.get("quorumq.client.core")
        if client is None or not isinstance(e, client.QuorumqError):
            raise  # a defect, not the user's doing: the traceback is for us
        parser.exit(2, f"quorumq {args.command}: {client_error(args, e)}\n")
    return result
