"""quorumq: a Raft-replicated, ordered message queue for Python."""

__version__ = "0.1.0"
