"""How the client verbs reach a cluster: endpoints (given, or the dev cluster's), TLS,
the token, and one line for a client's error."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from .args import UsageError, secret_from
from .devcluster import cluster_state, dir_option, running_nodes


def endpoints_of(args: argparse.Namespace) -> list[str]:
    if args.endpoints:
        return [e.strip() for e in args.endpoints.split(",") if e.strip()]
    root = Path(args.dir)
    state = cluster_state(root)
    if not running_nodes(state):
        raise UsageError(
            f"the cluster in {root} is stopped (start it with: quorumq cluster up"
            f"{dir_option(root)}), or give --endpoints"
        )
    return [f"127.0.0.1:{n['client_port']}" for n in state["nodes"].values()]


def endpoint_names(args: argparse.Namespace) -> dict[str, str]:
    """The node behind each endpoint, where known before it answers: the dev cluster's
    (from its file), none for `--endpoints`."""
    if args.endpoints:
        return {}
    state = cluster_state(Path(args.dir))
    return {f"127.0.0.1:{n['client_port']}": name for name, n in state["nodes"].items()}


def tls_option(args: argparse.Namespace) -> bool | str | None:
    """The clients' `tls=`: `--tls-ca FILE`, or `--tls` (the system's CAs), or None."""
    if args.tls_ca is not None:
        return str(args.tls_ca)
    return True if args.tls else None


def connect_client(args: argparse.Namespace) -> Any:
    """A client of the endpoints (`--endpoints`, or the dev cluster's); a `UsageError` if
    none can be used."""
    from ..client import QuorumqError  # noqa: PLC0415

    try:
        return client_of(args, endpoints_of(args))
    except (QuorumqError, ValueError) as e:
        raise UsageError(str(e)) from None


def client_of(args: argparse.Namespace, endpoints: list[str], **options: Any) -> Any:
    """A client of `endpoints`, with the command's token, admin token (for `members` and
    `status --audit`), TLS and `--timeout`. It does not wait for nodes: endpoints that
    all refuse the connection, or are no client port, are an error at once (a user waits
    for the answer; `--timeout` bounds a connection that hangs)."""
    from ..client import Client  # noqa: PLC0415

    return Client(
        endpoints,
        secret_from(args.token_file, "QUORUMQ_TOKEN", "client token"),
        connect_timeout=args.timeout,
        admin_token=secret_from(None, "QUORUMQ_ADMIN_TOKEN", "admin token"),
        tls=tls_option(args),
        wait_for_nodes=False,
        **options,
    )


def client_error(args: argparse.Namespace, error: Exception) -> str:
    """One line for an error the client raised, with what to do where it is clear."""
    from ..client import ServerError  # noqa: PLC0415

    text = str(error) or type(error).__name__
    if isinstance(error, ServerError):
        queue = getattr(args, "queue", None)
        if error.code == "unknown_queue" and queue and args.command in ("publish", "consume"):
            text += f" (declare it: quorumq declare {queue})"
        elif error.code == "queue_in_use":
            text += " (--force deletes it all the same)"
        elif error.code == "admin_required" and "QUORUMQ_ADMIN_TOKEN" not in text:
            text += " (set QUORUMQ_ADMIN_TOKEN)"
    return text


def many(count: int, thing: str) -> str:
    return f"{count} {thing}" + ("" if count == 1 else "s")


def make_console() -> Any:
    """A rich console: the terminal's width, or (into a pipe or file) wide enough that no
    column is cut."""
    from rich.console import Console  # noqa: PLC0415

    console = Console()
    return console if console.is_terminal else Console(width=200)
