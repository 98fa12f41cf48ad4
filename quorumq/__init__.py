"""quorumq: a Raft-replicated, ordered message queue for Python.

`quorumq.connect(endpoints, token=None)` gives a blocking client (`tls=True` or
`tls="ca.pem"` for nodes that serve TLS). `quorumq.Node(id=..., ...)` runs a node inside
this process (`node.client()` for its clients); `quorumq.Cluster(3)` starts a local
cluster of node processes (`quorumq.ops.local_cluster`). The trio client is
`quorumq.aio`. The pure queue machine is `quorumq.machine`; importing it does not import
the client.

The package by layer, bottom up: `machine` (the pure queue state machine), `codec` (its
commands as log entries), `raft` (the Raft rules and journal on PySyncObj), `replica`
(log and machine together), `wire` (the client protocol's frames), `node` (every
decision a node makes towards its clients, sans I/O), `server` (the node's trio shell,
metrics, the node in a program), `client` (blocking and trio clients over one session),
`ops` (local clusters, the demo, status tables) and `cli` (the `quorumq` command).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .ops.local_cluster import Cluster
    from .server.local_node import Node

__version__ = "0.1.0"
__all__ = ["Cluster", "Node", "connect"]


def __getattr__(name: str) -> Any:
    if name == "Node":  # the node's stack (trio, PySyncObj) only for programs that run one
        from .server.local_node import Node  # noqa: PLC0415

        return Node
    if name == "Cluster":  # starts processes: only for programs that want a cluster
        from .ops.local_cluster import Cluster  # noqa: PLC0415

        return Cluster
    raise AttributeError(f"module 'quorumq' has no attribute {name!r}")


def connect(endpoints: str | list[str], token: str | None = None, **options: Any) -> Any:
    """A blocking client: see `quorumq.client.Client`."""
    from .client import connect as _connect  # noqa: PLC0415 - the machine must not need it

    return _connect(endpoints, token, **options)
