"""Requests beside publishing, consuming and reading: committing a consumer group's
offset, forgetting (and sealing) producers, purging and deleting a queue, the node's
status and its audit digest (one at a time), and the admin check of administrative
verbs."""

from __future__ import annotations

import logging
import re
from typing import Any

import attrs

from ..machine import (
    CommitOffset,
    DeleteQueue,
    ForgetProducers,
    PurgeQueue,
)
from ..machine.queue import may_start_generation_id
from ..replica import (
    AuditBusyError,
    AuditFailedError,
)
from ..wire.protocol import Frame
from .connection import ConnectionCore
from .disk import DiskWatch
from .services import ReplicaHandle, Services

logger = logging.getLogger(__name__)

MIN_FORGET_PREFIX = 12
"""The shortest producer prefix a client may forget without the admin credential."""


class Admin:
    """Queue administration, status and audit (see the module's docstring)."""

    def __init__(self, core: Services, disk: DiskWatch) -> None:
        self.core = core
        self.disk = disk
        self._auditing = False

    def commit_offset(self, conn: ConnectionCore, frame: Frame) -> None:
        command = CommitOffset(queue=frame["queue"], group=frame["group"], offset=frame["offset"])
        self.core.propose_for(conn, frame["id"], command)

    def forget_producers(self, conn: ConnectionCore, frame: Frame) -> None:
        """A short prefix forgets other clients' producers too ("0".."f" forget them
        all): without the admin credential a prefix must be `MIN_FORGET_PREFIX`
        characters or more, and may not be one of a client's producer id
        ("g<ms>-<32 hex>"). Forgetting one moves the queue's forgotten generation up to
        its time, which refuses the first publish of every client whose id is older: a
        client looping that would keep other clients failing. (The machine refuses an
        empty prefix from anyone.)"""
        prefix = frame["prefix"]
        if prefix and not conn.admin and needs_admin(prefix):
            self.core.error(
                conn,
                frame["id"],
                "admin_required",
                f"forget_producers with the prefix {prefix!r} needs the admin token: give at "
                f"least {MIN_FORGET_PREFIX} characters, not the start of a client's producer "
                "id ('g<generation>-<32 hex>'), nor a start of 'spark-' shorter than a whole "
                "Spark job's or batch's prefix ('spark-write-<job>-', "
                "'spark-<query id>-<batch>-'), or prove the admin token",
            )
            return
        seal = frame.get("seal") is True
        if seal and not conn.admin and SPARK_PREFIXES.fullmatch(prefix) is None:
            self.core.error(
                conn,
                frame["id"],
                "admin_required",
                f"sealing the prefix {prefix!r} needs the admin token: without it, only a "
                "whole Spark job's or batch's prefix ('spark-write-<job>-', "
                "'spark-<query id>-<batch>-') may be sealed",
            )
            return
        command = ForgetProducers(queue=frame["queue"], prefix=prefix, seal=seal)
        self.core.propose_for(conn, frame["id"], command)

    def purge_queue(self, conn: ConnectionCore, frame: Frame) -> None:
        self.core.propose_for(conn, frame["id"], PurgeQueue(queue=frame["queue"]))

    def delete_queue(self, conn: ConnectionCore, frame: Frame) -> None:
        """A queue verb, as `declare` is (the client token, not the admin one). The
        consumers of the queue are told through their `cancelled` frames, on whichever
        node serves them, once the delete is applied there."""
        command = DeleteQueue(queue=frame["queue"], force=frame["force"] is True)
        self.core.propose_for(conn, frame["id"], command)

    def admin_refused(self, conn: ConnectionCore, frame: Frame, verb: str | None = None) -> bool:
        """Membership changes the cluster, not a queue, and an audit costs the node a
        copy of its state: they need the admin credential."""
        if conn.admin:
            return False
        why = (
            "this node has no admin token: start it with QUORUMQ_ADMIN_TOKEN to allow it"
            if self.core.config.admin_token is None
            else "prove the admin token (QUORUMQ_ADMIN_TOKEN, or admin_token= in the client)"
        )
        what = verb or frame["t"]
        self.core.error(
            conn, frame["id"], "admin_required", f"{what} is an administrative verb; {why}"
        )
        return True

    def answer_status(self, conn: ConnectionCore, frame: Frame) -> None:
        if frame.get("audit") is True:
            # it encodes the whole state (in a child process, one audit at a time): an
            # administrative verb, or any client could keep a node busy hashing
            if self.admin_refused(conn, frame, "status with audit"):
                return
            self._audit(conn, frame["id"])
            return
        self.core.push(conn, {"t": "reply", "id": frame["id"], "status": self.status()})

    def _audit(self, conn: ConnectionCore, request_id: int) -> None:
        def done(taken: Any, error: BaseException | None) -> None:
            if isinstance(error, AuditBusyError):
                self.core.error(conn, request_id, "audit_busy", str(error))
            elif isinstance(error, AuditFailedError):
                self.core.error(conn, request_id, "audit_failed", str(error))
            elif error is not None:
                self.core.error(
                    conn, request_id, "audit_failed", f"{type(error).__name__}: {error}"
                )
            else:
                self.core.push(conn, {"t": "reply", "id": request_id, "status": self.status(taken)})

        replica = self.core.replica
        self.core.shell.run_in_worker(lambda: replica.status(audit=True), done)

    def status(self, replica_status: dict[str, Any] | None = None) -> dict[str, Any]:
        """What `quorumq status` shows, O(queues) (`replica_status`: one taken already,
        say with the audit digest, off the loop)."""
        status = replica_status if replica_status is not None else self.core.replica.status()

        def queues(m: Any) -> dict[str, Any]:
            return {
                q: {
                    **attrs.asdict(m.stats(q)),
                    "consumer_ids": list(m.consumers(q)),
                    "committed_offsets": m.committed_offsets(q),
                }
                for q in m.queues()
            }

        status["queues"] = {}
        for group in self.core.groups:
            status["queues"].update(group.query(queues))
        if len(self.core.groups) > 1:
            status["groups"] = [self._group_status(g, r) for g, r in enumerate(self.core.groups)]
        if self.core.queue_counts is not None:
            for queue, counts in self.core.queue_counts(status["queues"]).items():
                status["queues"][queue].update(counts)
        status["disk_free_bytes"] = self.disk.free_disk_bytes
        status["disk_alarm"] = self.disk.disk_alarm
        status["disk_alarms"] = sorted(self.core.replica.query(lambda m: m.disk_alarms()))
        status["clients"] = len(self.core.connections)
        status["max_clients"] = self.core.config.max_connections
        config, replica = self.core.config, self.core.config.replica
        status["settings"] = {  # what this node runs with (its flags, as it took them)
            "election_timeout_s": list(replica.raft_timeouts),
            "node_down_grace_s": replica.node_down_grace_s,
            "max_body": config.max_body,
            "outbound_frames": config.outbound_frames,
            "outbound_bytes": config.outbound_bytes,
            "min_free_disk_bytes": config.min_free_disk_bytes,
        }
        return status

    def _group_status(self, group: int, replica: ReplicaHandle) -> dict[str, Any]:
        """One Raft group as this node sees it: its leader, term, members (a membership
        change reaches the groups one after the other), how far this replica is, and
        how many queue names the directory placed in it."""
        raft = replica.status()
        loads = self.core.replica.query(lambda m: m.group_loads())
        return {
            "group": group,
            "leader": raft["leader"],
            "role": raft["role"],
            "term": raft["term"],
            "members": raft["members"],
            "commit_index": raft["commit_index"],
            "last_applied": raft["last_applied"],
            "placed": loads[group] if group < len(loads) else 0,
        }


SPARK_PREFIXES = re.compile(
    r"spark-(write-[0-9a-f]{32}|[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}-\d+)-"
)
"""The Spark sink's producer-id prefixes: one batch write job's (`spark-write-<job>-`,
the job a random UUID) or one micro-batch's (`spark-<query id>-<batch>-`)."""


def needs_admin(prefix: str) -> bool:
    """Whether forgetting `prefix` needs the admin credential: it is shorter than
    `MIN_FORGET_PREFIX`, or it could start a client's producer id ("g<ms hex>-<hex>":
    the generation is a time anyone can guess, and forgetting even one's own moves
    the queue's forgotten generation for every client), or it covers the Spark sink's
    producers of more than one job or micro-batch (`spark-write-`, exactly 12
    characters, forgot every batch write's producers, and a retried task then wrote
    its rows again)."""
    if len(prefix) < MIN_FORGET_PREFIX or may_start_generation_id(prefix):
        return True
    spark = "spark-"
    if spark.startswith(prefix) or prefix.startswith(spark):
        return SPARK_PREFIXES.match(prefix) is None
    return False
