"""Moved to `quorumq.ops.local_cluster` (a cluster of node *processes*: the name
`embedded` misled, the node embedded in a program being `quorumq.Node`). This name stays
so that code written against it keeps working."""

from .ops.local_cluster import Cluster, free_ports

__all__ = ["Cluster", "free_ports"]
