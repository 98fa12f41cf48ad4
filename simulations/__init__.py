"""Failover simulations of the real node: deterministic, seeded runs of whole clusters
on a simulated clock, network and disk (`quorumq simulate`). The parts: `world` (clock,
events, random streams, the trace hash), `network`, `disk`, `node` (the real Raft
rules, journal, replica and node core on them), `cluster`, `clients` and `workload`
(real client sessions), `faults`, `operator` and `pauses` (what goes wrong, and when),
`checker` and `liveness` (what must hold), `runner` (one seed, a sweep), `history` and
`render` (the timeline), `chaos` (the same checks on real processes)."""
