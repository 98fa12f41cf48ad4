"""quorumq: a Raft-replicated, ordered message queue for Python.

`quorumq.connect(endpoints, token=None)` gives a blocking client (`tls=True` or
`tls="ca.pem"` for nodes that serve TLS). `quorumq.Node(id=..., ...)` runs a node inside
this process (`node.client()` for its clients). The pure queue machine is
`quorumq.machine`; importing it does not import the client.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .server.local_node import Node

__version__ = "0.1.0"
__all__ = ["Node", "connect"]


def __getattr__(name: str) -> Any:
    if name == "Node":  # the node's stack (trio, PySyncObj) only for programs that run one
        from .server.local_node import Node  # noqa: PLC0415

        return Node
    raise AttributeError(f"module 'quorumq' has no attribute {name!r}")


def connect(endpoints: str | list[str], token: str | None = None, **options: Any) -> Any:
    """A blocking client: see `quorumq.client.Client`."""
    from .client import connect as _connect  # noqa: PLC0415 - the machine must not need it

    return _connect(endpoints, token, **options)
