"""Failover simulations of the real node: deterministic, seeded runs of whole clusters
on a simulated clock, network and disk (`quorumq simulate`). The parts: `world` (clock,
events, random streams, the trace hash), `network`, `disk`, `node` (the real replica
and node core), `member` (the real Raft rules on the simulated network), `storage`
(the real journal and the snapshots on the simulated disk), `cluster`, `clients` and
`workload` (real client sessions), `names`, `faults`, `operator` and `pauses` (what
goes wrong, and when), `checker`, `replica_checks` and `liveness` (what must hold),
`runner` (one seed, a sweep), `history` and `render` (the timeline), `chaos` with
`chaos_checks` and `chaos_clients` (the same checks on real processes)."""
