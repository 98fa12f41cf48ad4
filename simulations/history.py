"""What a run did, kept for the summary and the timeline picture.

Per replica: its applied log index over time, when it led, how many deliveries it sent
itself (its consumers are local) and how many it only tracked (another replica sends
them), per second; the service queue after each consumer change. For the whole run:
the faults, the nodes that refused to start or stopped, and the failure commands the
leaders proposed. Sizes are bounded so a long run does not keep everything.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from quorumq.machine import (
    Applied,
    Cancel,
    Command,
    Deliver,
    Down,
    NodeDown,
    NodeUp,
    Subscribe,
)
from quorumq.ops import scenarios

from .world import US, World, seconds

if TYPE_CHECKING:
    from .node import SimNode

MAX_EVENTS = 2000
"""Service-queue changes and faults kept for the picture."""


@attrs.define
class Lane:
    """One replica's line in the timeline, in 1-second buckets."""

    index: dict[int, int] = attrs.field(factory=dict)
    sent: dict[int, int] = attrs.field(factory=dict)
    tracked: dict[int, int] = attrs.field(factory=dict)
    led: list[list[float]] = attrs.field(factory=list)
    """[start, end] seconds of each leadership; end is -1 while it lasts."""
    down: list[list[float]] = attrs.field(factory=list)
    """[start, end] seconds while crashed (-1 while it lasts)."""
    periods: list[tuple[float, float, str]] = attrs.field(factory=list)
    """(start, end, what) of the faults that hold this node up or cut it off: paused,
    stalled, alone, a slow direction from it."""


@attrs.frozen
class SqChange:
    at_s: float
    node: str
    index: int
    what: str
    service_queue: tuple[str, ...]


class History:
    def __init__(self, world: World, names: list[str], queue: str) -> None:
        self.world = world
        self.queue = queue
        self.lanes = {n: Lane() for n in names}
        self.sq_changes: list[SqChange] = []
        self.faults: list[tuple[Any, str]] = []
        """The faults injected, and what each hit (a node, a consumer, the changes)."""
        self.node_events: list[tuple[float, str, str]] = []
        """(when, node, what): a node that refused to start, or stopped."""
        self.failure_commands: list[tuple[float, str, str]] = []
        self.leader_changes = 0

    def _bucket(self) -> int:
        return self.world.now_us // US

    def on_applied(
        self, node: SimNode, index: int, crc: int, command: Command, applied: Applied
    ) -> None:
        lane = self.lanes[node.name]
        b = self._bucket()
        lane.index[b] = index
        if applied.effects and index > node.replay_until:
            for e in applied.effects:
                if type(e) is Deliver:
                    counts = lane.sent if e.node == node.name else lane.tracked
                    counts[b] = counts.get(b, 0) + 1
        if (
            isinstance(command, Subscribe | Down | NodeDown | NodeUp | Cancel)
            and len(self.sq_changes) < MAX_EVENTS
            and self.queue in node.machine.queues()
        ):
            self.sq_changes.append(
                SqChange(
                    seconds(self.world.now_us),
                    node.name,
                    index,
                    describe(command),
                    node.machine.service_queue(self.queue),
                )
            )

    def on_leadership(self, node: SimNode, leader: bool) -> None:
        lane = self.lanes[node.name]
        now = seconds(self.world.now_us)
        if leader:
            self.leader_changes += 1
            lane.led.append([now, -1.0])
        elif lane.led and lane.led[-1][1] < 0:
            lane.led[-1][1] = now

    def on_stamp(self, ts_ms: int) -> None:
        pass

    def on_failure_command(self, node: SimNode, command: Any) -> None:
        if len(self.failure_commands) < MAX_EVENTS:
            self.failure_commands.append((seconds(self.world.now_us), node.name, describe(command)))

    def fault(self, fault: Any, detail: str) -> None:
        if len(self.faults) < MAX_EVENTS:
            self.faults.append((fault, detail))

    def period(self, name: str, start_s: float, end_s: float, what: str) -> None:
        lane = self.lanes.get(name)
        if lane is not None and len(lane.periods) < MAX_EVENTS:
            lane.periods.append((start_s, end_s, what))

    def on_snapshot_loaded(self, node: SimNode, applied: int, index: int) -> None:
        pass

    def on_refused(self, name: str, reason: str) -> None:
        if len(self.node_events) < MAX_EVENTS:
            now = seconds(self.world.now_us)
            self.node_events.append((now, name, f"refused to start: {reason}"))

    def on_fatal(self, name: str, reason: str) -> None:
        if len(self.node_events) < MAX_EVENTS:
            self.node_events.append((seconds(self.world.now_us), name, f"stopped: {reason}"))

    def on_ticked(self, node: SimNode) -> None:
        pass

    def on_change_cluster(self, node: SimNode, request: Any, accepted: bool) -> None:
        pass

    def on_node(self, name: str, running: bool) -> None:
        down = self.lanes[name].down
        if not running:
            down.append([seconds(self.world.now_us), -1.0])
        elif down and down[-1][1] < 0:
            down[-1][1] = seconds(self.world.now_us)


def describe(command: Command) -> str:
    """A short label: 'subscribe c1@A', 'down c1', 'node_down B'."""
    if isinstance(command, NodeDown | NodeUp):
        return f"{'node_down' if isinstance(command, NodeDown) else 'node_up'} {command.node}"
    return scenarios.describe(command)
