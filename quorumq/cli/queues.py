"""The queue verbs: `declare`, `publish`, `consume`, `purge-queue`, `delete-queue`,
`queues`."""

from __future__ import annotations

import argparse
import json
import select
import sys
from collections import deque
from collections.abc import Iterator
from typing import Any

from .args import UsageError
from .connecting import connect_client, make_console, many

PUBLISH_WINDOW = 1000
"""Publishes `quorumq publish` keeps in flight (each printed, in order, once confirmed):
one at a time it did about 100 a second, a round trip and a commit each."""


def run_publish(args: argparse.Namespace) -> int:
    """Publish each argument, or each line of stdin as it comes, pipelined: up to
    `PUBLISH_WINDOW` in flight, their offsets printed in order (all of those sent once
    stdin has nothing more for now). Interrupted, it says how many were confirmed and
    how many are in flight, whose outcome is unknown."""
    in_flight: deque[Any] = deque()
    confirmed = 0

    def confirm_oldest() -> None:
        nonlocal confirmed
        offset = in_flight.popleft().result()["offset"]
        confirmed += 1
        print(f"{offset}" if args.quiet else f"published offset {offset}")
        if not args.quiet and confirmed % 1000 == 0:
            print(f"  {confirmed} published", file=sys.stderr, flush=True)

    def bodies() -> Iterator[str]:
        if args.message:
            yield from args.message
            return
        while True:
            if in_flight and not _stdin_ready():  # nothing more for now: say what landed
                while in_flight:
                    confirm_oldest()
                sys.stdout.flush()
            line = sys.stdin.readline()  # a line as soon as it comes (no read-ahead)
            if not line:
                return
            yield line.rstrip("\n")

    with connect_client(args) as client:
        try:
            for body in bodies():
                in_flight.append(client.publish_async(args.queue, body.encode(), key=args.key))
                while in_flight and (len(in_flight) >= PUBLISH_WINDOW or in_flight[0].done()):
                    confirm_oldest()
            while in_flight:
                confirm_oldest()
        except KeyboardInterrupt:
            sys.stdout.flush()
            print(
                f"interrupted: {confirmed} published (their offsets above); "
                f"{len(in_flight)} sent but not confirmed: their outcome is unknown "
                "(each lands at most once; read the queue before sending them again)",
                file=sys.stderr,
                flush=True,
            )
            raise
    sys.stdout.flush()
    return 0


def _stdin_ready() -> bool:
    """Whether stdin has input now (a file or a terminal without select: always)."""
    try:
        return bool(select.select([sys.stdin], [], [], 0)[0])
    except (OSError, ValueError):
        return True


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
