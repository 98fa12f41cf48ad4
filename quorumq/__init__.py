"""quorumq: a Raft-replicated, ordered message queue for Python.

`quorumq.connect(endpoints, token=None)` gives a blocking client (`tls=True` or
`tls="ca.pem"` for nodes that serve TLS). The pure queue machine is `quorumq.machine`;
importing it does not import the client.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


def connect(endpoints: str | list[str], token: str | None = None, **options: Any) -> Any:
    """A blocking client: see `quorumq.client.Client`."""
    from .client import connect as _connect  # noqa: PLC0415 - the machine must not need it

    return _connect(endpoints, token, **options)
