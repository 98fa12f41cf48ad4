"""quorumq clients: `connect` (blocking); `quorumq.aio` for trio comes later."""

from .blocking import Client, Consumer, connect
from .core import (
    ConnectionLostError,
    Delivery,
    KeyPausedError,
    QuorumqError,
    ReadResult,
    ServerError,
    StreamRecord,
)

__all__ = [
    "Client",
    "ConnectionLostError",
    "Consumer",
    "Delivery",
    "KeyPausedError",
    "QuorumqError",
    "ReadResult",
    "ServerError",
    "StreamRecord",
    "connect",
]
