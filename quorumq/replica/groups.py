"""A node's replicas of its Raft groups (`NodeReplicas`): with `ReplicaConfig.groups`
above one, every group's member runs on one engine (`quorumq.raft.engine`: one thread,
one sync a round) and one Raft port (`quorumq.raft.link`: messages tagged by group,
sealed with the cluster secret). Group 0 keeps its files in the data directory, as a
node of one group does; group g in `group-g` under it.

A node records its group count in the data directory at its first start with groups
(`groups`), and refuses to start with another: the directory in group 0 names groups
by number, and a queue's messages are in its group's log only. A data directory of a
node of one group (no record) may start with groups: its queues are in group 0."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable

from ..raft.engine import RaftEngine
from . import MemberFactory, Replica, _raft_member
from .config import ConfigError, ReplicaConfig

logger = logging.getLogger(__name__)

GROUPS_FILE = "groups"


def check_group_count(data_dir: str, groups: int) -> None:
    """Refuse (`ConfigError`) a group count other than the one `data_dir` records;
    record it at the first start with groups."""
    path = os.path.join(data_dir, GROUPS_FILE)
    try:
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
    except FileNotFoundError:
        recorded = 1
    else:
        if not text.isdigit():
            raise ConfigError(f"{path} holds {text!r}, not a group count")
        recorded = int(text)
    if recorded != groups:
        if recorded == 1 and groups > 1:
            _record(data_dir, path, groups)  # a node of one group, upgraded: group 0 as it is
            return
        raise ConfigError(
            f"{data_dir} holds a node of {recorded} Raft group(s), not {groups}: a node's "
            f"group count never changes (its queues live in their groups' logs); start it "
            f"with groups={recorded}"
        )


def _record(data_dir: str, path: str, groups: int) -> None:
    os.makedirs(data_dir, exist_ok=True)
    temporary = f"{path}.new"
    with open(temporary, "w", encoding="ascii") as f:
        f.write(f"{groups}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)
    directory = os.open(data_dir, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


class NodeReplicas:
    """The replicas of a node's `config.groups` Raft groups, on one engine and one Raft
    port; `replicas[0]` is group 0's (the directory's)."""

    def __init__(
        self, config: ReplicaConfig, build: Callable[[int, MemberFactory], Replica]
    ) -> None:
        """`build(group, member_factory)`: group `group`'s replica, its Raft member made
        by `member_factory` (called on the engine's thread once the engine runs)."""
        check_group_count(config.data_dir, config.groups)
        self.engine = RaftEngine(
            config.node_id,
            raft_address=config.raft_address,
            password=config.secret or None,
            insecure=not config.secret,
        )
        self.replicas: list[Replica] = []
        try:
            # group 0 starts the engine; each other member is built on its thread
            self.replicas.append(build(0, _raft_member(config, self.engine, 0)))
            for group in range(1, config.groups):
                factory = _raft_member(config, self.engine, group)
                self.replicas.append(self.engine.run(functools.partial(build, group, factory)))
            for group, replica in enumerate(self.replicas):
                replica.steer_group = group
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop every replica (their journals synced and closed), then the engine."""
        try:
            for replica in reversed(self.replicas):
                replica.stop()
        finally:
            self.engine.stop()
