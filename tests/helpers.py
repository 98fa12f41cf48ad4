"""Shared test helpers."""

from __future__ import annotations

from quorumq.machine import Applied, Command, Deliver, Machine, Meta
from quorumq.ops.local_cluster import free_ports


class Driver:
    """Applies commands to one machine with increasing log indexes and a settable clock."""

    def __init__(self, machine: Machine | None = None) -> None:
        self.machine = machine if machine is not None else Machine()
        self.index = self.machine.last_index
        self.ts_ms = self.machine.now_ms
        self.log: list[tuple[Meta, Command]] = []

    def __call__(self, command: Command, *, ts_ms: int | None = None) -> Applied:
        self.index += 1
        if ts_ms is not None:
            self.ts_ms = ts_ms
        meta = Meta(self.index, self.ts_ms)
        self.log.append((meta, command))
        return self.machine.apply(meta, command)


def deliveries(applied: Applied) -> list[tuple[str, int]]:
    """(consumer, offset) of every delivery, in order."""
    return [(e.consumer, e.offset) for e in applied.effects if isinstance(e, Deliver)]


def delivered(applied: Applied) -> list[Deliver]:
    return [e for e in applied.effects if isinstance(e, Deliver)]


def wait_for(condition: object, what: str, timeout: float = 15.0, every: float = 0.02) -> None:
    """Poll `condition()` until it is true; fail naming `what` after `timeout` seconds."""
    import time

    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(every)


__all__ = ["Driver", "delivered", "deliveries", "free_ports", "wait_for"]
