"""The trio client: `async with quorumq.aio.connect(endpoints, token) as client`; a node
in this trio program's loop: `async with quorumq.aio.Node(id=..., ...) as node`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .client.aio import AsyncClient, AsyncConsumer, connect

if TYPE_CHECKING:
    from .server.local_node import AsyncNode as Node

__all__ = ["AsyncClient", "AsyncConsumer", "Node", "connect"]


def __getattr__(name: str) -> Any:
    if name == "Node":  # the node's stack (PySyncObj) only for programs that run one
        from .server.local_node import AsyncNode  # noqa: PLC0415

        return AsyncNode
    raise AttributeError(f"module 'quorumq.aio' has no attribute {name!r}")
