"""The queue verbs: `declare`, `publish`, `consume`, `purge-queue`, `delete-queue`,
`queues`."""

from __future__ import annotations

import argparse
import json
import sys

from .args import UsageError
from .connecting import connect_client, make_console, many


def run_publish(args: argparse.Namespace) -> int:
    bodies = args.message or [line.rstrip("\n") for line in sys.stdin]
    with connect_client(args) as client:
        for i, body in enumerate(bodies, 1):
            offset = client.publish(args.queue, body.encode(), key=args.key)
            print(f"{offset}" if args.quiet else f"published offset {offset}", flush=True)
            if not args.quiet and len(bodies) > 20 and i % 100 == 0:
                print(f"  {i}/{len(bodies)}", file=sys.stderr, flush=True)
    return 0


def run_declare(args: argparse.Namespace) -> int:
    from ..client import QuorumqError  # noqa: PLC0415

    options = {
        name: getattr(args, name)
        for name in (
            "max_length",
            "overflow",
            "delivery_limit",
            "dead_letter_queue",
            "retention_messages",
            "retention_bytes",
            "message_ttl_ms",
            "retry_backoff_ms",
        )
        if getattr(args, name) is not None
    }
    if args.single_active_consumer:
        options["single_active_consumer"] = True
    with connect_client(args) as client:
        try:
            created = client.declare(args.queue, **options)
        except QuorumqError as e:
            raise UsageError(str(e)) from None
    print(f"queue {args.queue} {'created' if created else 'exists with these options'}")
    return 0


def run_delete_queue(args: argparse.Namespace) -> int:
    with connect_client(args) as client:
        deleted = client.delete_queue(args.queue, force=args.force)
    cancelled = deleted["consumers"]
    print(
        f"deleted queue {args.queue}: {many(deleted['messages'], 'message')} removed"
        + (f", {many(cancelled, 'consumer')} cancelled" if cancelled else "")
    )
    return 0


def run_purge_queue(args: argparse.Namespace) -> int:
    with connect_client(args) as client:
        removed = client.purge_queue(args.queue)
    print(f"purged queue {args.queue}: {many(removed, 'ready message')} removed")
    return 0


def run_consume(args: argparse.Namespace) -> int:

    with connect_client(args) as client:
        consumer = client.subscribe(args.queue, prefetch=args.prefetch)
        seen = 0
        while args.count == 0 or seen < args.count:
            d = consumer.get(timeout=args.wait)
            if d is None:
                if consumer.cancel_reason:  # ended by the queue, not by a quiet --wait
                    raise UsageError(
                        f"the consumer of {args.queue!r} was ended: {consumer.cancel_reason}"
                        + (
                            " (the queue was deleted)"
                            if consumer.cancel_reason == "queue_deleted"
                            else ""
                        )
                    )
                break
            print(
                json.dumps(
                    {
                        "offset": d.offset,
                        "key": d.key,
                        "body": d.body.decode("utf-8", "backslashreplace"),
                        "redelivered": d.redelivered,
                        "delivery_count": d.delivery_count,
                        "node": d.node,
                    }
                ),
                flush=True,
            )
            if not args.no_ack:
                d.ack()
            seen += 1
    return 0


def run_queues(args: argparse.Namespace) -> int:

    from ..ops.status_view import queue_list  # noqa: PLC0415

    with connect_client(args) as client:
        status = client.status()
    if args.json:
        print(json.dumps(status["queues"], indent=2, sort_keys=True))
    elif not status["queues"]:
        print(f"no queues (node {status['node']}); declare one: quorumq declare NAME")
    else:
        make_console().print(queue_list(status))
    return 0
