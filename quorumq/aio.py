"""The trio client: `async with quorumq.aio.connect(endpoints, token) as client`."""

from .client.aio import AsyncClient, AsyncConsumer, connect

__all__ = ["AsyncClient", "AsyncConsumer", "connect"]
