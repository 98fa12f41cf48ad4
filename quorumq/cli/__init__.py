"""The `quorumq` command, by verb group: `node` (a node, and the demo), `devcluster`
(`cluster up|down|status`), `queues` (declare, publish, consume, purge, delete, list),
`status` (status and members), on `connecting` (how a verb reaches a cluster) and
`args` (argument types, one-line errors); `main` builds the parser and runs a verb.
`quorumq simulate` hands its arguments to the simulator's own command line."""

from .main import build_parser, main

__all__ = ["build_parser", "main"]
