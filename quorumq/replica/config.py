"""A replica's settings (`ReplicaConfig`, checked: `ConfigError`), and the checks of a
node's addresses and open files they need."""

from __future__ import annotations

import ipaddress
import logging
import os
import resource
from collections.abc import Mapping

import attrs

from ..machine.commands import MAX_GROUPS
from ..raft.member import Fsync
from ..raft.wal import JournalKind

logger = logging.getLogger(__name__)

PROPOSAL_TIMEOUT_S = 15.0
"""A proposal with no outcome after this long is answered "outcome unknown" (PySyncObj
never calls back for some, e.g. when a snapshot install skips past their index)."""


class ConfigError(ValueError):
    """The replica's configuration is unsafe or inconsistent."""


def is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def file_usage() -> dict[str, int | None]:
    """Descriptors this process has open and may open (None where it cannot tell)."""
    try:
        open_now: int | None = len(os.listdir("/proc/self/fd")) - 1  # (the listing's own)
    except OSError:
        open_now = None
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return {"files_open": open_now, "files_limit": None if soft < 0 else int(soft)}


@attrs.frozen(kw_only=True)
class ReplicaConfig:
    node_id: str
    """This node's name, as consumers' `node` names it in the log."""
    peers: Mapping[str, str]
    """Every replica's node id -> Raft address ("host:port"), this node included."""
    data_dir: str
    secret: str | None
    """The cluster secret: authenticates and encrypts Raft traffic."""
    insecure: bool = False
    """Allow no secret; only when every Raft address is loopback."""
    fsync: Fsync = "always"
    journal: JournalKind = "file"
    """The Raft journal: a file of its own, or group 0 of the write-ahead log."""
    node_down_grace_s: float = 5.0
    proposal_timeout_s: float = PROPOSAL_TIMEOUT_S
    raft_timeouts: tuple[float, float] = (0.25, 0.6)
    """Election timeout range in seconds. Measured here: failover 0.6-1.1 s, against
    1.6-2.5 s with PySyncObj's 0.4-1.4, and no spurious elections under full load."""
    compaction_entries: int = 50_000
    groups: int = 1
    """How many Raft groups this node hosts (every node of a cluster the same): queues
    are placed over them (`Place`), on one engine and one Raft port per node."""

    def __attrs_post_init__(self) -> None:
        if type(self.groups) is not int or not 1 <= self.groups <= MAX_GROUPS:
            raise ConfigError(f"groups must be from 1 to {MAX_GROUPS}, not {self.groups!r}")
        if self.node_id not in self.peers:
            raise ConfigError(f"node {self.node_id!r} is not among the peers {sorted(self.peers)}")
        if self.fsync not in ("always", "batch", "never"):
            raise ConfigError(f"fsync must be always, batch or never, not {self.fsync!r}")
        if self.journal not in ("file", "wal"):
            raise ConfigError(f"journal must be file or wal, not {self.journal!r}")
        if not self.secret:
            if not self.insecure:
                raise ConfigError(
                    "a cluster secret is required: Raft traffic between nodes is authenticated "
                    "with it (without one, anyone who reaches the Raft port runs code)"
                )
            public = [a for a in self.peers.values() if not is_loopback(a)]
            if public:
                raise ConfigError(
                    f"insecure mode is for loopback only; these Raft addresses are not: {public}"
                )

    @property
    def raft_address(self) -> str:
        return self.peers[self.node_id]
