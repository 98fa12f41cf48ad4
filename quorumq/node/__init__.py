"""The node core: everything a quorumq node decides, and none of its I/O.

A node is its replica (`quorumq.replica`) and the core that serves its clients: frames
in (as bytes), commands proposed, effects applied, frames out (as bytes), timers.
`quorumq.server` drives it with trio on a real node; `simulations` drives the same core
on a simulated network and clock. See `NodeCore` (`core.py`), the switchboard, and its
parts, one module each: `publishes`, `settling`, `serving`, `reading` (over `reads`),
`admin`, `membership`, `disk`, on what they share (`services`); `connection` is one
client connection's state, `config` the node's settings.
"""

from .config import NodeConfig, check_node_config
from .connection import ConnectionCore
from .core import NodeCore, NodeShell, ReplicaHandle

__all__ = [
    "ConnectionCore",
    "NodeConfig",
    "NodeCore",
    "NodeShell",
    "ReplicaHandle",
    "check_node_config",
]
