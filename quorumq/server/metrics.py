"""A node's Prometheus metrics (`quorumq node --metrics HOST:PORT`), with prometheus_client.

Two kinds, so that the hot path stays cheap:

* read at scrape time, by a custom collector: every queue's figures (from the machine,
  under the replica's lock, O(queues)), what the node counted as it applied entries
  (`quorumq.server.counters`), and the Raft member's term, role, indexes and log length. The
  node does nothing for these between scrapes.
* observed as they happen: the journal's fsync latency (a timing wrapper around the
  journal's file operations, `TimedFiles`) and the time from proposing a command to its
  commit (the node's trio shell times each proposal it makes with a callback).

Names follow Prometheus's conventions: `quorumq_` prefix, base units (seconds),
`_total` for counters, a `queue` label per queue. The machine stays pure: nothing here
is imported by `quorumq.machine`.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from ..machine import Command, Enqueue, EnqueueBatch
from ..raft.files import Files
from .counters import QueueCounters

FSYNC_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)
PROPOSAL_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 15.0)
ROLES = ("follower", "candidate", "leader")

QUEUE_COUNTERS = (
    ("delivered", "Deliveries from the queue, redeliveries included."),
    ("redelivered", "Deliveries of messages delivered before and returned."),
    ("acked", "Messages acked."),
    ("rejected", "Messages nacked without requeue."),
    ("dead_lettered", "Messages that left the queue into its dead-letter queue."),
    ("expired", "Messages whose TTL ran out (dead-lettered or dropped)."),
    ("dropped", "Messages that left undelivered and were not dead-lettered."),
    ("purged", "Ready messages removed by a purge."),
)
"""The per-queue counts of `quorumq.server.counters`, as `quorumq_queue_messages_<name>_total`."""


def _command_label(kind: type) -> str:
    """`publish` for the commands that carry messages, else the command's snake_case name."""
    if kind in (Enqueue, EnqueueBatch):
        return "publish"
    return re.sub(r"(?<!^)(?=[A-Z])", "_", kind.__name__).lower()


class TimedFiles:
    """A journal's `Files`, each `sync` (fdatasync) timed into `observe(seconds)`; every
    other operation as the wrapped `files` does it."""

    def __init__(self, files: Files, observe: Callable[[float], None]) -> None:
        self._files = files
        self._observe = observe

    def sync(self, fd: int) -> None:
        started = time.perf_counter()
        self._files.sync(fd)
        self._observe(time.perf_counter() - started)

    def read(self, path: str) -> bytes | None:
        return self._files.read(path)

    def create(self, path: str) -> int:
        return self._files.create(path)

    def open_append(self, path: str) -> int:
        return self._files.open_append(path)

    def write(self, fd: int, data: bytes | memoryview) -> int:
        return self._files.write(fd, data)

    def truncate(self, fd: int, size: int) -> None:
        self._files.truncate(fd, size)

    def close(self, fd: int) -> None:
        self._files.close(fd)

    def replace(self, source: str, target: str) -> None:
        self._files.replace(source, target)

    def sync_directory(self, path: str) -> None:
        self._files.sync_directory(path)

    def remove(self, path: str) -> None:
        self._files.remove(path)

    def list_directory(self, path: str) -> list[str]:
        return self._files.list_directory(path)

    def random_bytes(self, n: int) -> bytes:
        return self._files.random_bytes(n)


class _NodeCollector(Collector):
    """Reads the node's figures when Prometheus scrapes (on the HTTP server's thread)."""

    def __init__(
        self,
        replica: Any,
        counters: QueueCounters,
        connections: Callable[[], int],
        disk: Callable[[], tuple[int | None, bool]],
        groups: Sequence[Any] = (),
    ) -> None:
        self._replica = replica
        self._groups = tuple(groups) or (replica,)
        """Every Raft group's replica on this node (`--groups`), `replica` first."""
        self._counters = counters
        self._connections = connections
        self._disk = disk
        self._loaded_at_start = replica.snapshots_loaded
        """Snapshots loaded while the replica started (its own): not installs."""

    def describe(self) -> Iterator[Metric]:
        return iter(())  # described by collecting: the queues are known only then

    def collect(self) -> Iterator[Metric]:
        yield from self._queue_metrics()
        yield from self._node_metrics()

    def _queue_metrics(self) -> Iterator[Metric]:
        def read(m: Any) -> list[tuple[str, Any, int | None]]:
            return [(q, m.stats(q), m.oldest_ready_ms(q)) for q in m.queues()]

        queues = [row for group in self._groups for row in group.query(read)]
        counted = self._counters.counts(q for q, _, _ in queues)
        now_ms = time.time() * 1000

        def gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"quorumq_queue_{name}", doc, labels=["queue"])

        ready = gauge("ready_messages", "Messages ready to be delivered.")
        unacked = gauge("unacked_messages", "Messages delivered and not yet acked.")
        consumers = gauge("consumers", "Consumers subscribed (cancelled ones still holding too).")
        producers = gauge("producers", "Idempotent producers the queue remembers.")
        oldest = gauge(
            "oldest_ready_age_seconds",
            "Age of the oldest ready message (0 when none is ready).",
        )
        published = CounterMetricFamily(
            "quorumq_queue_messages_published",
            "Messages enqueued: offsets given, published or dead-lettered into the queue.",
            labels=["queue"],
        )
        counts = {
            name: CounterMetricFamily(
                f"quorumq_queue_messages_{name}",
                f"{doc} Counted by this node as it applied the log, since it started.",
                labels=["queue"],
            )
            for name, doc in QUEUE_COUNTERS
        }
        for queue, stats, oldest_ms in queues:
            label = [queue]
            ready.add_metric(label, stats.ready)
            unacked.add_metric(label, stats.unacked)
            consumers.add_metric(label, stats.consumers)
            producers.add_metric(label, stats.producers)
            age = 0.0 if oldest_ms is None else max(0.0, (now_ms - oldest_ms) / 1000)
            oldest.add_metric(label, age)
            published.add_metric(label, stats.next_offset)
            for name, family in counts.items():
                family.add_metric(label, counted[queue][name])
        yield from (ready, unacked, consumers, producers, oldest, published)
        yield from counts.values()

    def _node_metrics(self) -> Iterator[Metric]:
        replica = self._replica
        member = replica.member
        info = GaugeMetricFamily("quorumq_node_info", "This node's name.", labels=["node"])
        info.add_metric([replica.node_id], 1)
        yield info
        yield GaugeMetricFamily(
            "quorumq_raft_term", "The Raft term this node is in.", value=member.raftCurrentTerm
        )
        role = member.role()
        roles = GaugeMetricFamily(
            "quorumq_raft_role", "1 for this node's Raft role, 0 for the others.", labels=["role"]
        )
        for name in ROLES:
            roles.add_metric([name], 1 if name == role else 0)
        yield roles
        yield GaugeMetricFamily(
            "quorumq_raft_commit_index",
            "The highest log index this node knows committed.",
            value=member.raftCommitIndex,
        )
        yield GaugeMetricFamily(
            "quorumq_raft_applied_index",
            "The highest log index this node applied.",
            value=member.raftLastApplied,
        )
        yield GaugeMetricFamily(
            "quorumq_raft_log_entries",
            "Entries in this node's log since its last snapshot.",
            value=len(member.journal),
        )
        yield CounterMetricFamily(
            "quorumq_raft_snapshot_installs",
            "Snapshots this node installed from the leader since it started.",
            value=replica.snapshots_loaded - self._loaded_at_start,
        )
        yield CounterMetricFamily(
            "quorumq_raft_elections",
            "Elections this node stood in since it started (each raised its term).",
            value=member.elections,
        )
        yield CounterMetricFamily(
            "quorumq_raft_pre_votes_lost",
            "Pre-vote rounds this node lost since it started: elections that would only "
            "have disrupted the cluster.",
            value=member.pre_votes_lost,
        )
        yield CounterMetricFamily(
            "quorumq_raft_stalls",
            "Times this node's Raft thread stalled past 0.2 s (a pause, a GC, a starved "
            "CPU) since it started.",
            value=member.stalls,
        )
        yield GaugeMetricFamily(
            "quorumq_raft_learners",
            "Nodes this leader is catching up before it adds them (the learner stage).",
            value=len(member.learners),
        )
        heard = member.leader_heard_at
        if role == "leader":
            silence = 0.0
        elif heard is None:
            silence = float("nan")  # never heard from a leader since it started
        else:
            silence = max(0.0, time.monotonic() - heard)
        yield GaugeMetricFamily(
            "quorumq_raft_leader_contact_age_seconds",
            "Seconds since this node last heard from its leader (0 on the leader).",
            value=silence,
        )
        if len(self._groups) > 1:
            yield from self._group_metrics()
        yield GaugeMetricFamily(
            "quorumq_client_connections",
            "Client connections to this node.",
            value=self._connections(),
        )
        free, alarm = self._disk()
        yield GaugeMetricFamily(
            "quorumq_disk_free_bytes",
            "Free space on this node's data disk, as last measured (every second).",
            value=float("nan") if free is None else free,
        )
        yield GaugeMetricFamily(
            "quorumq_disk_alarm",
            "1 while this node's data disk is below its free-space limit: publishes are "
            "refused cluster-wide (disk_alarm) until it is back above.",
            value=float(alarm),
        )

    def _group_metrics(self) -> Iterator[Metric]:
        """With many Raft groups: each group's role, term and indexes on this node (the
        unlabelled `quorumq_raft_*` figures are group 0's)."""

        def gauge(name: str, doc: str, *labels: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"quorumq_raft_group_{name}", doc, labels=["group", *labels])

        role = gauge("role", "1 for this node's Raft role in the group, 0 for the others.", "role")
        term = gauge("term", "The Raft term this node is in, in the group.")
        commit = gauge("commit_index", "The highest index of the group's log known committed.")
        applied = gauge("applied_index", "The highest index of the group's log applied here.")
        for number, replica in enumerate(self._groups):
            member, label = replica.member, str(number)
            for name in ROLES:
                role.add_metric([label, name], 1 if name == member.role() else 0)
            term.add_metric([label], member.raftCurrentTerm)
            commit.add_metric([label], member.raftCommitIndex)
            applied.add_metric([label], member.raftLastApplied)
        yield from (role, term, commit, applied)


class NodeMetrics:
    """A node's metrics registry and HTTP endpoint (see the module docstring)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.fsync_seconds = Histogram(
            "quorumq_journal_fsync_seconds",
            "Time an fdatasync of the Raft journal took.",
            buckets=FSYNC_BUCKETS,
            registry=self.registry,
        )
        self.proposal_seconds = Histogram(
            "quorumq_proposal_seconds",
            "Time from proposing a command to its commit and apply on this node "
            "(command=publish: publish -> commit).",
            ["command"],
            buckets=PROPOSAL_BUCKETS,
            registry=self.registry,
        )
        self._by_command: dict[type, Any] = {}
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        self.address: tuple[str, int] | None = None
        """Where metrics are served (the node's server sets it), the port as bound."""

    def attach(
        self,
        replica: Any,
        counters: QueueCounters,
        connections: Callable[[], int],
        disk: Callable[[], tuple[int | None, bool]] = lambda: (None, False),
        groups: Sequence[Any] = (),
    ) -> None:
        """Read `replica` (a started `quorumq.replica.Replica`), `counters`, the number
        of `connections` and the `disk` (free bytes, alarm) at every scrape, and time
        the replica's journal syncs. `groups`: with many Raft groups, every group's
        replica, `replica` first (their queues, and each group's figures)."""
        journal = replica.member.journal
        timed: Files = TimedFiles(journal.files, self.fsync_seconds.observe)
        journal.files = timed
        self.registry.register(_NodeCollector(replica, counters, connections, disk, groups))

    def observe_proposal(self, command: Command, seconds: float) -> None:
        """A proposal of `command` was committed and applied `seconds` after it was made."""
        child = self._by_command.get(type(command))
        if child is None:
            child = self._by_command[type(command)] = self.proposal_seconds.labels(
                _command_label(type(command))
            )
        child.observe(seconds)

    def render(self) -> bytes:
        """The exposition text of every metric (a scrape; `quorumq.server.metrics_http`
        serves it)."""
        return bytes(generate_latest(self.registry))


__all__ = ["NodeMetrics", "TimedFiles"]
