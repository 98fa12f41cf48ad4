"""`quorumq node` (one node of a cluster, until SIGTERM or SIGINT) and `quorumq demo`."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from ..ops.scenarios import SCENARIOS, render
from .args import UsageError, secret_from


def run_node(args: argparse.Namespace) -> int:
    import trio  # noqa: PLC0415 - only the node needs the server stack

    from ..replica import ConfigError  # noqa: PLC0415
    from ..server.local_node import AsyncNode, node_config  # noqa: PLC0415

    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format=f"%(asctime)s {args.id} %(levelname)s %(name)s: %(message)s",
    )
    raft = f"{args.raft[0]}:{args.raft[1]}"
    try:
        config = node_config(
            id=args.id,
            data_dir=args.data_dir,
            raft=raft,
            peers=dict(args.peer),
            secret=secret_from(args.secret_file, "QUORUMQ_SECRET", "cluster secret"),
            listen=f"{args.listen[0]}:{args.listen[1]}",
            token=secret_from(args.token_file, "QUORUMQ_TOKEN", "client token"),
            admin_token=secret_from(args.admin_token_file, "QUORUMQ_ADMIN_TOKEN", "admin token"),
            insecure=args.insecure,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            fsync=args.fsync,
            journal=args.journal,
            groups=args.groups,
            node_down_grace_s=args.node_down_grace,
            election_timeout_s=args.election_timeout,
            compaction_entries=args.compaction_entries,
            max_body=args.max_body,
            outbound_frames=args.outbound_frames,
            min_free_disk_bytes=args.min_free_disk * 1024 * 1024,
        )
    except ConfigError as e:
        raise UsageError(str(e)) from None

    async def run() -> None:
        # the start-up and the stop of `quorumq.Node`: the data directory taken, the
        # replica started, served until SIGTERM or SIGINT, then leadership handed over
        async with AsyncNode.from_config(config, metrics=args.metrics, own_process=True) as node:
            server = node.server
            metrics = server.metrics.address if server.metrics is not None else None
            print(
                f"quorumq node {args.id} ready: clients on {node.address}"
                + (" (TLS)" if server.tls is not None else "")
                + f", raft on {raft}, fsync={args.fsync}"
                + (f", metrics on http://{metrics[0]}:{metrics[1]}/metrics" if metrics else ""),
                flush=True,
            )
            import signal  # noqa: PLC0415

            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    break

    from ..raft.first_configuration import PeersChangedError  # noqa: PLC0415
    from ..raft.journal import JournalDamagedError, JournalFailedError  # noqa: PLC0415
    from ..raft.wal import WrongJournalError  # noqa: PLC0415

    refusals = (
        JournalDamagedError,
        JournalFailedError,
        PeersChangedError,
        WrongJournalError,
        OSError,
    )
    try:
        trio.run(run)
    except (*refusals, ConfigError) as e:  # start-up
        raise UsageError(str(e)) from None
    except BaseExceptionGroup as group:  # trio wraps what the node's tasks raised
        found = group.subgroup(refusals)
        if found is None:
            raise
        cannot: BaseException = found
        while isinstance(cannot, BaseExceptionGroup):
            cannot = cannot.exceptions[0]
        raise UsageError(str(cannot)) from None
    return 0


def run_demo(args: argparse.Namespace) -> int:
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
    from ..ops.demo import run  # noqa: PLC0415 - starts processes: only when asked

    timeline = Path(args.timeline) if args.timeline else None
    result = run(messages=args.messages, timeline=timeline)
    return 0 if result.ok else 1
