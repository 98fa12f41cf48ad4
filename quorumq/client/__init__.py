"""quorumq clients: `connect` (blocking); `quorumq.aio` for trio comes later."""

from ..machine.views import StreamMessage
from .blocking import Client, Consumer, connect
from .core import (
    ConnectionLostError,
    Delivery,
    KeyPausedError,
    QuorumqError,
    ReadResult,
    ServerError,
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
    "StreamMessage",
    "connect",
]
