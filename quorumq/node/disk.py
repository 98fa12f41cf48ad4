"""The node core's disk alarm: what the shell measured of the data disk's free space
(`disk_free`, every second), this node's alarm raised below `min_free_disk_bytes` and
cleared an eighth above it, and the log's record of it (`DiskAlarm`) brought in line."""

from __future__ import annotations

import logging

from ..machine import (
    DiskAlarm,
    Reply,
)
from ..replica import (
    ProposalError,
)
from .services import ReplicaHandle, Services

logger = logging.getLogger(__name__)


class DiskWatch:
    """This node's disk alarm (see the module's docstring)."""

    def __init__(self, core: Services) -> None:
        self.core = core
        self.free_disk_bytes: int | None = None
        """The data disk's free space as last measured (`disk_free`); None: not yet."""
        self.disk_alarm = False
        """This node's disk alarm: raised below `min_free_disk_bytes` of free space."""
        self.alarms_in_log = False
        """Whether a disk alarm (any node's) was in the log at the last measure."""
        self._alarm_proposing: set[int] = set()
        """The groups a `DiskAlarm` of this node is proposed to, not yet answered."""

    def disk_free(self, free_bytes: int | None) -> None:
        """The shell measured the data disk's free space (every second): raise or clear
        this node's disk alarm, and bring the log's record of it (`DiskAlarm`, which
        refuses publishes cluster-wide) in line, proposing again until it is."""
        self.free_disk_bytes = free_bytes
        limit = self.core.config.min_free_disk_bytes
        if free_bytes is None or limit <= 0:
            raised = False
        elif self.disk_alarm:  # cleared a margin above the limit: no flapping around it
            raised = free_bytes < limit + limit // 8
        else:
            raised = free_bytes < limit
        if raised != self.disk_alarm:
            self.disk_alarm = raised
            log = logger.warning if raised else logger.info
            log(
                "disk alarm %s: %s free on the data disk, limit %s",
                "raised" if raised else "cleared",
                _mib(free_bytes),
                _mib(limit),
            )
        self.alarms_in_log = False
        for group, replica in enumerate(self.core.groups):  # each group refuses its publishes
            alarms = replica.query(lambda m: m.disk_alarms())
            self.alarms_in_log = self.alarms_in_log or bool(alarms)
            in_log = self.core.node_id in alarms
            if in_log != raised and group not in self._alarm_proposing:
                self._propose(group, replica, raised)

    def _propose(self, group: int, replica: ReplicaHandle, raised: bool) -> None:
        self._alarm_proposing.add(group)

        def done(_reply: Reply | None, _error: ProposalError | None) -> None:
            self._alarm_proposing.discard(group)  # (checked again at the next measure)

        replica.propose(DiskAlarm(node=self.core.node_id, raised=raised), done)


def _mib(n: int | None) -> str:
    return "?" if n is None else f"{n / (1024 * 1024):.1f} MiB"
