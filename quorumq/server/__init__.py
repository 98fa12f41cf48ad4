"""The trio server of a quorumq node."""

from .node import NodeConfig, NodeServer

__all__ = ["NodeConfig", "NodeServer"]
