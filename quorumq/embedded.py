"""Moved to `quorumq.ops.local_cluster` (a cluster of node *processes*: the name
`embedded` misled, the node embedded in a program being `quorumq.Node`). This name stays
so that code written against it keeps working: it holds every public name of the new
module."""

from .ops.local_cluster import (
    NODE_NAMES,
    Certificates,
    Cluster,
    free_ports,
    make_certificates,
)

__all__ = [
    "NODE_NAMES",
    "Certificates",
    "Cluster",
    "free_ports",
    "make_certificates",
]
