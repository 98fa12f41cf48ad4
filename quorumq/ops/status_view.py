"""What `quorumq status` and `quorumq queues` show people: tables (rich) of a cluster's
nodes and queues, from readings of every node's status.

A reading asks each endpoint for its node's status, all at once (a node that does not
answer is a row saying so, not an error: one row per node, named where it is known, or
told by the members no endpoint answered for). Rates need two readings: `queues_table` takes
the earlier one and divides what grew by the time between them, both of one node (a
queue's next offset is the same on every replica once applied, but the delivery counts
are each node's own since its process started).
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text


@attrs.frozen(kw_only=True)
class NodeReading:
    """One endpoint's answer: its node's status, or why there is none. `node`: the node
    behind the endpoint, as its status says, else as the caller knew it (None if
    unknown)."""

    endpoint: str
    node: str | None = None
    status: Mapping[str, Any] | None = None
    error: str | None = None


@attrs.frozen(kw_only=True)
class ClusterReading:
    """Every endpoint's answer, and when they were asked (monotonic seconds)."""

    taken_at: float
    nodes: tuple[NodeReading, ...]

    @property
    def answered(self) -> list[Mapping[str, Any]]:
        return [n.status for n in self.nodes if n.status is not None]

    def of(self, node: str) -> Mapping[str, Any] | None:
        """The status node `node` gave, if it answered."""
        return next((s for s in self.answered if s.get("node") == node), None)

    @property
    def reference(self) -> Mapping[str, Any] | None:
        """The status the queues are read from: the leader's, else the first answer."""
        answered = self.answered
        leaders = [s for s in answered if s.get("is_leader")]
        return (leaders or answered)[0] if answered else None


def read_cluster(
    endpoints: Sequence[str],
    status_of: Callable[[str], Mapping[str, Any]],
    errors: tuple[type[BaseException], ...],
    *,
    names: Mapping[str, str] | None = None,
    carry: ClusterReading | None = None,
) -> ClusterReading:
    """Ask every endpoint at once (`status_of(endpoint)`); an exception of `errors`
    is that endpoint's error. `names`: the node behind an endpoint, where known before
    it answers. An endpoint that gave no status in `carry` is not asked again: its
    reading is carried over (an unreachable node costs its connect timeout once)."""
    names = names or {}
    kept = {n.endpoint: n for n in carry.nodes if n.status is None} if carry else {}

    def one(endpoint: str) -> NodeReading:
        if endpoint in kept:
            return kept[endpoint]
        try:
            status = status_of(endpoint)
        except errors as e:
            error = str(e) or type(e).__name__
            return NodeReading(endpoint=endpoint, node=names.get(endpoint), error=error)
        node = status.get("node")
        return NodeReading(
            endpoint=endpoint,
            node=str(node) if node is not None else names.get(endpoint),
            status=status,
        )

    taken_at = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(endpoints))) as pool:
        nodes = tuple(pool.map(one, endpoints))
    return ClusterReading(taken_at=taken_at, nodes=nodes)


def not_ready(reading: ClusterReading, earlier: ClusterReading | None) -> str | None:
    """Why the cluster is not ready yet (None: it is): every endpoint's node answered,
    one of them leads, and each has applied what the leader had committed at the
    `earlier` reading (so a cluster under load is ready too, once nobody lags)."""
    missing = [n.endpoint for n in reading.nodes if n.status is None]
    if missing:
        return f"no status from {', '.join(missing)}"
    leader = next((s for s in reading.answered if s.get("is_leader")), None)
    if leader is None:
        return "no node leads yet"
    before = earlier.of(str(leader.get("node"))) if earlier is not None else None
    target = (before or {}).get("commit_index")
    if not isinstance(target, int):
        return "waiting for a second reading"
    behind = [
        str(s.get("node"))
        for s in reading.answered
        if not isinstance(s.get("last_applied"), int) or s["last_applied"] < target
    ]
    if behind:
        return f"{', '.join(sorted(behind))} still catching up with the leader"
    return None


def _host(address: str) -> str:
    return address.rpartition(":")[0]


@attrs.frozen(kw_only=True)
class Unreached:
    """Who the endpoints that gave no status are: `names` (endpoint -> node) where it is
    known or told; `among`: the members left over when as many endpoints are, each of
    them one of those."""

    names: Mapping[str, str]
    among: tuple[str, ...] = ()
    guessed: frozenset[str] = frozenset()
    """Endpoints named from the members left over, not known: a stale or mistyped
    endpoint is named so too, so the table marks the name as a guess."""


def unreached(reading: ClusterReading) -> Unreached:
    """The node behind each endpoint that gave no status: as known, else told by the
    members (of the reference status) no endpoint answered for: the one member on the
    endpoint's host, or, one endpoint and one member left, that member. As many
    endpoints as members left: each is one of them (`among`)."""
    members: Mapping[str, str] = (reading.reference or {}).get("members", {})
    named = {n.node for n in reading.nodes if n.node is not None}
    left = {m: address for m, address in members.items() if m not in named}
    found: dict[str, str] = {
        n.endpoint: n.node for n in reading.nodes if n.status is None and n.node is not None
    }
    unknown = [n.endpoint for n in reading.nodes if n.status is None and not n.node]
    guessed = set()
    for endpoint in list(unknown):
        on_host = [m for m, address in left.items() if _host(address) == _host(endpoint)]
        if len(on_host) == 1:
            found[endpoint] = on_host[0]
            guessed.add(endpoint)
            del left[on_host[0]]
            unknown.remove(endpoint)
    if len(unknown) == 1 and len(left) == 1:
        found[unknown[0]] = next(iter(left))
        guessed.add(unknown[0])
        left.clear()
    among = tuple(sorted(left)) if unknown and len(unknown) == len(left) else ()
    return Unreached(names=found, among=among, guessed=frozenset(guessed))


def _number(value: Any) -> str:
    return f"{value:,}" if isinstance(value, int) else "-"


def _rate(now: Any, before: Any, seconds: float) -> str:
    if not isinstance(now, int) or not isinstance(before, int) or seconds <= 0 or now < before:
        return "-"  # not counted by both readings, or the node restarted between them
    return f"{(now - before) / seconds:,.1f}"


def _role(status: Mapping[str, Any]) -> Text:
    if status.get("is_leader"):
        return Text("leader", style="bold green")
    if not status.get("ready", True):
        return Text("starting", style="yellow")
    if status.get("leader") is None:
        return Text("no leader", style="bold red")
    return Text("follower")


NEAR_LIMIT = 0.8
"""A node using this share of its open files or client connections has a note."""


def _near_limits(status: Mapping[str, Any]) -> list[str]:
    """Notes for a node close to its open file limit or its client connection cap."""
    notes = []
    for used, limit, what in (
        (status.get("files_open"), status.get("files_limit"), "open files"),
        (status.get("clients"), status.get("max_clients"), "clients"),
    ):
        if isinstance(used, int) and isinstance(limit, int) and used >= NEAR_LIMIT * limit:
            notes.append(f"{what}: {used} of {limit}")
    return notes


NODES_CAPTION = (
    "term: the Raft election term. commit: the last log entry the node knows is "
    "committed (on a majority); applied: the last one its queues reflect; lag: "
    "entries the leader committed that the node has not applied. clients: client "
    "connections, this command's not counted."
)


def _others(clients: Any) -> Any:
    """A node's client count less the connection its status was read over."""
    return max(clients - 1, 0) if isinstance(clients, int) else clients


def identity_note(status: Mapping[str, Any], leader: Mapping[str, Any] | None) -> str | None:
    """A node's note on its cluster identity against its leader's: of another cluster
    (restored beside nodes started empty, or another cluster's data), or knowing one
    the leader does not (a leader of a cluster upgraded after compacting, which draws
    none; or of another history, which the node then does not follow)."""
    mine, theirs = status.get("cluster"), (leader or {}).get("cluster")
    if not mine or leader is None or status is leader:
        return None
    if theirs and mine != theirs:
        return f"of another cluster ({mine[:8]}, the leader's {theirs[:8]})"
    if not theirs and "cluster" in leader:
        return f"knows cluster {mine[:8]}, the leader none"
    return None


def nodes_table(reading: ClusterReading, *, audit: bool = False) -> Table:
    """One row per node: role, Raft term, commit and applied index, its lag (entries
    the leader has committed that it has not applied yet) and its client connections
    besides the one its status was read over; a caption says what the columns are."""
    table = Table(
        title="nodes",
        caption=NODES_CAPTION,
        box=box.SIMPLE_HEAD,
        title_justify="left",
        caption_justify="left",
    )
    table.add_column("node")
    table.add_column("role")
    for name in ("term", "commit", "applied", "lag", "clients"):
        table.add_column(name, justify="right")
    if audit:
        table.add_column("audited at", justify="right")
        table.add_column("digest")
    table.add_column("endpoint")
    table.add_column("note")
    reference = reading.reference
    leader = next((s for s in reading.answered if s.get("is_leader")), None)
    commits = [s.get("commit_index") for s in reading.answered]
    top = (leader or {}).get("commit_index", max((c for c in commits if c is not None), default=0))
    rows: list[tuple[str, list[Any]]] = []
    who = unreached(reading)
    group_tops = _group_commits(reading)
    for node in reading.nodes:
        status = node.status
        if status is None:
            known = who.names.get(node.endpoint)
            shown = f"{known}?" if known and node.endpoint in who.guessed else known
            cells: list[Any] = [shown or "?", Text("unreachable", style="bold red")] + ["-"] * 5
            if audit:
                cells += ["-", "-"]
            note = node.error or ""
            if known is None and who.among:
                note = f"one of {', '.join(who.among)}: {note}"
            elif shown != known:
                note = f"{known}, if this is its endpoint: {note}"
            rows.append((known or "~", [*cells, node.endpoint, note]))
            continue
        notes = []
        identity = identity_note(status, leader)
        if identity:
            notes.append(identity)
        down = status.get("down_nodes") or []
        if down:
            notes.append(f"sees down: {', '.join(down)}")
        if status.get("compaction_error"):
            notes.append(f"compaction failed: {status['compaction_error']}")
        journal = status.get("journal") or {}
        if journal.get("kind") == "wal":
            notes.append(
                f"journal: write-ahead log, {journal.get('segments')} segment(s), "
                f"{(journal.get('bytes') or 0) / 2**20:.1f} MiB"
            )
        notes += _groups_note(status, group_tops)
        notes += _near_limits(status)
        learners = status.get("learners") or {}
        if learners:
            notes.append(
                "catching up to add: "
                + ", ".join(f"{n} at {i}" for n, i in sorted(learners.items()))
            )
        applied = status.get("last_applied")
        lag = top - applied if isinstance(applied, int) and isinstance(top, int) else None
        cells = [
            str(status.get("node")),
            _role(status),
            _number(status.get("term")),
            _number(status.get("commit_index")),
            _number(applied),
            _number(max(lag, 0)) if lag is not None else "-",
            _number(_others(status.get("clients"))),
        ]
        if audit:
            cells += [_number(status.get("machine_index")), str(status.get("digest", "-"))[:16]]
        rows.append((str(status.get("node")), [*cells, node.endpoint, "; ".join(notes)]))
    named = {name for name, _ in rows} | set(who.among)
    for member in sorted((reference or {}).get("members", {})):
        if member not in named:
            cells = [member, Text("not asked", style="dim")] + ["-"] * 5
            if audit:
                cells += ["-", "-"]
            rows.append((member, [*cells, "-", "no client endpoint given for it"]))
    for _, cells in sorted(rows, key=lambda row: row[0]):
        table.add_row(*cells)
    return table


def _group_commits(reading: ClusterReading) -> dict[int, int]:
    """Per Raft group (a node with `--groups`): the highest commit index any node gave."""
    tops: dict[int, int] = {}
    for status in reading.answered:
        for group in status.get("groups") or []:
            commit = group.get("commit_index")
            if isinstance(commit, int):
                tops[group["group"]] = max(commit, tops.get(group["group"], commit))
    return tops


def _groups_note(status: Mapping[str, Any], tops: dict[int, int]) -> list[str]:
    """A node with many Raft groups: the groups it leads, and its most lagging one."""
    groups = status.get("groups") or []
    if not groups:
        return []
    led = [str(g["group"]) for g in groups if g.get("role") == "leader"]
    note = f"{len(groups)} Raft groups, leads {', '.join(led) or 'none'}"
    lags = {
        g["group"]: tops[g["group"]] - g["last_applied"]
        for g in groups
        if g["group"] in tops and isinstance(g.get("last_applied"), int)
    }
    worst = max(lags, key=lambda g: lags[g], default=None)
    if worst is not None and lags[worst] > 0:
        note += f"; group {worst} lags {lags[worst]:,}"
    return [note]


QUEUE_COLUMNS = ("ready", "unacked", "consumers")


def queues_table(reading: ClusterReading, before: ClusterReading | None) -> Table:
    """One row per queue, as the leader (else the first node that answered) applied it:
    ready, unacked, consumers, and publish and deliver rates since `before`."""
    reference = reading.reference or {}
    node = reference.get("node")
    earlier = before.of(node) if before is not None and node is not None else None
    seconds = reading.taken_at - before.taken_at if before is not None else 0.0
    caption = f"as node {node} applied them" if node else "no node answered"
    if before is not None:
        caption += f"; rates per second over the last {seconds:.1f} s"
    if node and not reference.get("queues"):
        caption = "no queues yet (quorumq declare NAME makes one)"
    table = Table(title="queues", caption=caption, box=box.SIMPLE_HEAD, title_justify="left")
    table.add_column("queue")
    for name in (*QUEUE_COLUMNS, "publish/s", "deliver/s"):
        table.add_column(name, justify="right")
    then = (earlier or {}).get("queues", {})
    for name, queue in sorted(reference.get("queues", {}).items()):
        old = then.get(name, {})
        table.add_row(
            name,
            *(_number(queue.get(column)) for column in QUEUE_COLUMNS),
            _rate(queue.get("next_offset"), old.get("next_offset"), seconds),
            _rate(queue.get("delivered"), old.get("delivered"), seconds),
        )
    return table


def status_view(
    reading: ClusterReading, before: ClusterReading | None, *, audit: bool = False
) -> Group:
    """The nodes table, then the queues table."""
    return Group(nodes_table(reading, audit=audit), Text(""), queues_table(reading, before))


def queue_list(status: Mapping[str, Any]) -> Table:
    """`quorumq queues`: every queue of one node's status, with what it counted."""
    table = Table(
        caption=f"as node {status.get('node')} applied them. enqueued: offsets given "
        "(published, or dead-lettered into it); delivered, acked, dead-lettered: counted "
        "by the node since it started",
        box=box.SIMPLE_HEAD,
    )
    table.add_column("queue")
    for name in (
        *QUEUE_COLUMNS,
        "producers",
        "enqueued",
        "delivered",
        "acked",
        "dead-lettered",
    ):
        table.add_column(name, justify="right")
    for name, queue in sorted(status.get("queues", {}).items()):
        table.add_row(
            name,
            *(_number(queue.get(column)) for column in QUEUE_COLUMNS),
            _number(queue.get("producers")),
            _number(queue.get("next_offset")),
            _number(queue.get("delivered")),
            _number(queue.get("acked")),
            _number(queue.get("dead_lettered")),
        )
    return table


__all__ = [
    "ClusterReading",
    "NodeReading",
    "Unreached",
    "nodes_table",
    "not_ready",
    "queue_list",
    "queues_table",
    "read_cluster",
    "status_view",
    "unreached",
]
