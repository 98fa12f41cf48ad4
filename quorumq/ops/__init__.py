"""The operator's tools, above the clients and the node: a local cluster of node
processes (`local_cluster`, for tests, examples and `quorumq cluster up`), the demo and
its scripted scenarios (`demo`, `scenarios`), and the status tables (`status_view`).
The command line is `quorumq.cli`."""
