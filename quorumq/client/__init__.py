"""quorumq clients: `connect` (blocking); `quorumq.aio` is the trio client."""

from ..machine.views import StreamMessage
from .blocking import Client, Consumer, connect
from .core import (
    ConnectionLostError,
    Delivery,
    KeyPausedError,
    OutcomeUnknownError,
    QuorumqError,
    ReadResult,
    RefusedBeforeError,
    ServerError,
    TlsError,
    TooManyUnconfirmedError,
    UnreachableError,
)

__all__ = [
    "Client",
    "ConnectionLostError",
    "Consumer",
    "Delivery",
    "KeyPausedError",
    "OutcomeUnknownError",
    "QuorumqError",
    "ReadResult",
    "RefusedBeforeError",
    "ServerError",
    "StreamMessage",
    "TlsError",
    "TooManyUnconfirmedError",
    "UnreachableError",
    "connect",
]
