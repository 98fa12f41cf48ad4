"""`quorumq status` (tables of nodes and queues, `--json`, `--watch`) and `quorumq
members` (list, add, remove)."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from .args import UsageError, peer
from .connecting import client_of, connect_client, endpoint_names, endpoints_of, make_console


def run_status(args: argparse.Namespace) -> int:

    from ..client import ServerError  # noqa: PLC0415

    if args.wait is not None:
        _wait_until_ready(args)
    if args.json:
        if args.watch:
            raise UsageError("--watch shows tables; for a program, run status --json each time")
        with connect_client(args) as client:
            try:
                status = client.status(audit=args.audit)
            except ServerError as e:
                if e.code == "admin_required":
                    raise UsageError(
                        f"{e} (an audit needs the admin token: set QUORUMQ_ADMIN_TOKEN)"
                    ) from None
                raise
        print(json.dumps(status, indent=2, sort_keys=True))
        return 0
    return _status_tables(args)


def _reader(args: argparse.Namespace) -> Any:
    """`read(earlier=None, again=True)`: one reading of every endpoint's node, at once."""
    from ..client import QuorumqError  # noqa: PLC0415
    from ..ops.status_view import read_cluster  # noqa: PLC0415

    endpoints = endpoints_of(args)
    names = endpoint_names(args)

    def status_of(endpoint: str) -> dict[str, Any]:
        timeout = 300.0 if args.audit else max(args.timeout, 1.0)
        try:
            with client_of(args, [endpoint], timeout=timeout) as client:
                status: dict[str, Any] = client.status(audit=args.audit)
                return status
        except QuorumqError as e:
            raise QuorumqError(_why(endpoint, e)) from None

    def read(earlier: Any = None, *, again: bool = True) -> Any:
        """A reading; `again=False`: endpoints that gave no status in `earlier` keep
        that reading, not asked again (an unreachable node costs its timeout once)."""
        known = dict(names)
        if earlier is not None:
            known.update({n.endpoint: n.node for n in earlier.nodes if n.node is not None})
        return read_cluster(
            endpoints,
            status_of,
            (QuorumqError, OSError, ValueError),
            names=known,
            carry=None if again else earlier,
        )

    return read


def _wait_until_ready(args: argparse.Namespace) -> None:
    """`--wait SECONDS`: until every endpoint's node answers, one leads and none lags
    (for scripts that start nodes); one line saying what is missing if not in time."""
    from ..ops.status_view import not_ready  # noqa: PLC0415

    read = _reader(args)
    deadline = time.monotonic() + args.wait
    earlier = None
    while True:
        reading = read()
        why = not_ready(reading, earlier)
        if why is None:
            return
        if time.monotonic() > deadline:
            raise UsageError(f"the cluster was not ready within {args.wait:g} s: {why}")
        time.sleep(0.2)
        earlier = reading


def _status_tables(args: argparse.Namespace) -> int:
    """Tables of every endpoint's node and of the queues, with rates over `--interval`;
    with `--watch`, refreshed in place until Ctrl-C."""

    from rich.console import Group  # noqa: PLC0415
    from rich.live import Live  # noqa: PLC0415
    from rich.text import Text  # noqa: PLC0415

    from ..ops.status_view import status_view  # noqa: PLC0415

    read = _reader(args)
    console = make_console()
    before = read()
    if not before.answered and not args.watch:
        errors = "; ".join(f"{n.endpoint}: {n.error}" for n in before.nodes)
        hint = " (set QUORUMQ_ADMIN_TOKEN)" if "admin_required" in errors else ""
        if "connection refused" in errors:
            hint += " (is a quorumq node running there?)"
        raise UsageError(f"no node gave its status: {errors}{hint}")
    if not args.watch:
        if args.audit:  # an audit hashes every message: once is enough, and no rates
            console.print(status_view(before, None, audit=True))
            return 0
        time.sleep(max(0.0, before.taken_at + args.interval - time.monotonic()))
        console.print(status_view(read(before, again=False), before))
        return 0

    def view(now: Any, earlier: Any) -> Any:
        heading = Text(
            f"quorumq status: every {args.interval:g} s, {time.strftime('%H:%M:%S')} "
            "(Ctrl-C to stop)",
            style="dim",
        )
        return Group(heading, status_view(now, earlier, audit=args.audit))

    try:
        with Live(view(before, None), console=console) as live:
            while True:
                time.sleep(max(0.0, before.taken_at + args.interval - time.monotonic()))
                now = read(before)
                live.update(view(now, before))
                before = now
    except KeyboardInterrupt:  # how --watch ends
        return 0


def _why(endpoint: str, error: Exception) -> str:
    """Why `endpoint` gave no status, short: its row names the endpoint already."""
    from ..client import UnreachableError  # noqa: PLC0415

    if isinstance(error, UnreachableError):
        if error.refused:
            return "connection refused"
        return "sent no welcome: stalled, or not a quorumq client port (a Raft port?)"
    text = str(error)
    for prefix in ("no quorumq node answered: ", f"{endpoint}: "):
        text = text.removeprefix(prefix)
    return text


def run_members(args: argparse.Namespace) -> int:
    from ..client import ConnectionLostError, QuorumqError  # noqa: PLC0415

    if args.action == "list":
        if args.member:
            raise UsageError("list takes no member")
        with connect_client(args) as client:
            members = client.status()["members"]
    elif args.action == "add":
        try:
            name, address = peer(args.member or "")
        except argparse.ArgumentTypeError as e:
            raise UsageError(f"add takes NAME=HOST:PORT: {e}") from None
        print(f"adding {name} ({address}); waiting for the change to commit...", flush=True)
        with connect_client(args) as client:
            try:
                members = client.add_member(name, address)
            except QuorumqError as e:
                raise UsageError(str(e)) from None
    else:
        if not args.member or "=" in args.member:
            raise UsageError("remove takes a member name, e.g. B")
        members = {}
        unreached = []
        for endpoint in endpoints_of(args):  # a node does not remove itself: ask another
            try:  # the node being removed is often down: its endpoint is passed over
                client = client_of(args, [endpoint])
            except ConnectionLostError as e:
                unreached.append(f"{endpoint}: {_why(endpoint, e)}")
                continue
            except QuorumqError as e:
                raise UsageError(str(e)) from None
            with client:
                if client.node == args.member:
                    continue
                print(f"removing {args.member} via {client.node}...", flush=True)
                try:
                    members = client.remove_member(args.member)
                except QuorumqError as e:
                    raise UsageError(str(e)) from None
                break
        else:
            why = f" ({'; '.join(unreached)})" if unreached else ""
            raise UsageError(f"no endpoint other than {args.member}'s answered{why}")
        print(f"{args.member} removed: stop its process now (it no longer gets the log)")
    for name, address in sorted(members.items()):
        print(f"  {name}: raft {address}")
    return 0
