"""The names every part of a run shares: the queue the workload publishes to and
consumes from, and where that queue dead-letters (nobody consumes it)."""

QUEUE = "orders"
DEAD_LETTER_QUEUE = "orders.dead"
