"""The Raft engine (`quorumq.raft.engine`): many Raft groups ticked by one thread per
node process, on real sockets and files, their journals in one write-ahead log synced
once per round for every group (group commit across groups)."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from quorumq.ops.local_cluster import free_ports
from quorumq.raft.engine import RaftEngine
from quorumq.raft.journal import JournalFailedError
from quorumq.raft.member import RaftMember

NODES = "ABC"


def _wait(condition: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.01)


class Node:
    """One node process's part: an engine hosting one member of each group, every
    group's journal in the node's one write-ahead log."""

    def __init__(
        self,
        name: str,
        root: Any,
        groups: list[dict[str, str]],
        *,
        journal: str = "wal",
        fsync: str = "always",
        engine: RaftEngine | None = None,
        compaction_entries: int = 50_000,
        password: str = "secret",
    ) -> None:
        self.name = name
        self.dir = str(root / name)
        if engine is None:
            shared = {group[name] for group in groups}
            # every group at one address: the engine's link (one Raft port for all)
            link = (
                {"raft_address": shared.pop(), "password": password, "insecure": not password}
                if len(shared) == 1
                else {}
            )
            engine = RaftEngine(name, **link)
        self.engine = engine
        self._options = {
            "journal": journal,
            "fsync": fsync,
            "password": password,
            "compaction_entries": compaction_entries,
        }
        self.applied: list[list[bytes]] = []
        self.members: list[RaftMember] = []
        for group, addresses in enumerate(groups):
            self.members.append(self.member(group, addresses))

    def member(self, group: int, addresses: dict[str, str]) -> RaftMember:
        """This node's member of `group` (not started), its entries in `applied`."""
        while len(self.applied) <= group:
            self.applied.append([])
        return RaftMember(
            self.name,
            addresses,
            data_dir=self.dir if group == 0 else os.path.join(self.dir, f"group-{group}"),
            node_dir=self.dir,
            group=group,
            engine=self.engine,
            apply=self._applier(group),
            snapshot=lambda: b"",
            restore=lambda machine: None,
            on_tick=lambda: None,
            **self._options,  # type: ignore[arg-type]
        )

    def _applier(self, group: int) -> Callable[[int, bytes], None]:
        def apply(index: int, payload: bytes) -> None:
            self.applied[group].append(payload)

        return apply

    def start(self) -> None:
        for member in self.members:
            member.start()

    def stop(self) -> None:
        self.engine.stop()


def _groups(count: int, *, link: bool = False) -> list[dict[str, str]]:
    """Every group's members' addresses: a Raft port per node and group, or (`link`)
    one per node, shared by every group."""
    if link:
        node_ports = free_ports(len(NODES))
        return [
            {n: f"127.0.0.1:{p}" for n, p in zip(NODES, node_ports, strict=True)}
            for _ in range(count)
        ]
    ports = iter(free_ports(count * len(NODES)))
    return [{n: f"127.0.0.1:{next(ports)}" for n in NODES} for _ in range(count)]


@contextmanager
def _cluster(root: Any, groups: list[dict[str, str]], **options: Any) -> Iterator[list[Node]]:
    nodes: list[Node] = []
    try:
        for name in NODES:
            nodes.append(Node(name, root, groups, **options))
        for node in nodes:
            node.start()
        yield nodes
    finally:
        for node in nodes:
            node.stop()


def _leader(nodes: list[Node], group: int) -> Node | None:
    for node in nodes:
        if group < len(node.members) and node.members[group]._isLeader():
            return node
    return None


def _propose(member: RaftMember, payload: bytes) -> threading.Event:
    done = threading.Event()

    def answered(result: Any, error: int) -> None:
        done.set()

    member._engine.call(lambda: member.propose(payload, answered))
    return done


@pytest.mark.parametrize("link", [False, True], ids=["ports", "link"])
def test_three_groups_on_three_engines_commit_in_order_everywhere(
    tmp_path: Any, link: bool
) -> None:
    """Every group elects, commits what is proposed to any of its members, and applies
    it in one order on every node; each node's write-ahead log holds every group. On
    one port per node, every group's messages share one connection per pair."""
    groups = _groups(3, link=link)
    with _cluster(tmp_path, groups) as nodes:
        for g in range(3):
            _wait(lambda g=g: _leader(nodes, g) is not None, f"group {g} elects")
        answers = []
        for i in range(30):
            for g in range(3):
                node = nodes[(i + g) % 3]  # to followers too: forwarded to the leader
                answers.append(_propose(node.members[g], b"g%d-%d" % (g, i)))
        for answer in answers:
            assert answer.wait(20), "a proposal was never answered"

        def applied_everywhere() -> bool:
            return all(len(node.applied[g]) >= 30 for node in nodes for g in range(3))

        _wait(applied_everywhere, "every node applies every group's entries")
        for g in range(3):
            orders = [[p for p in node.applied[g] if p.startswith(b"g%d-" % g)] for node in nodes]
            assert orders[0] == orders[1] == orders[2]
            assert sorted(orders[0]) == sorted(b"g%d-%d" % (g, i) for i in range(30))
        for node in nodes:
            wal = node.members[0].journal._wal  # type: ignore[attr-defined]
            assert wal.groups_open() == [0, 1, 2]
            assert all(m.journal._wal is wal for m in node.members)  # type: ignore[attr-defined]
            if link:
                assert node.engine.link is not None
                assert len(node.engine.link._connections) == 2  # one per peer, not per group


@pytest.mark.parametrize("link", [False, True], ids=["ports", "link"])
def test_a_node_restarted_from_its_write_ahead_log_catches_up_in_every_group(
    tmp_path: Any, link: bool
) -> None:
    """A node stopped while its groups go on comes back from its one log with every
    group's entries, and catches up; nothing a group committed is lost or reordered.
    On one port, the others see its connection close and dial it again."""
    groups = _groups(3, link=link)
    with _cluster(tmp_path, groups) as nodes:
        for g in range(3):
            _wait(lambda g=g: _leader(nodes, g) is not None, f"group {g} elects")
        for g in range(3):
            for i in range(10):
                assert _propose(nodes[0].members[g], b"before-%d-%d" % (g, i)).wait(20)
        _wait(lambda: all(len(n.applied[g]) >= 10 for n in nodes for g in range(3)), "applied")
        c = nodes[2]
        c.stop()
        before = [list(a) for a in c.applied]
        for g in range(3):
            _wait(lambda g=g: _leader(nodes[:2], g) is not None, f"group {g} leads without C")
            for i in range(10):
                assert _propose(nodes[0].members[g], b"after-%d-%d" % (g, i)).wait(20)
        again = Node("C", tmp_path, groups)
        nodes[2] = again
        again.start()
        _wait(
            lambda: all(len(again.applied[g]) >= 20 for g in range(3)),
            "C applies every group's entries again",
        )
        for g in range(3):
            assert again.applied[g][: len(before[g])] == before[g]
            assert nodes[0].applied[g][:20] == again.applied[g][:20]


def test_leaders_of_many_groups_on_one_engine_sync_once_a_round(tmp_path: Any) -> None:
    """Three lone groups (each a one-node cluster, so each member leads) on one engine:
    what all three append in a round is made durable by one fdatasync of the log, not
    one per group. With each leader syncing in its own tick, it took three."""
    engine = RaftEngine("solo")
    ports = free_ports(3)
    node = Node("A", tmp_path, [{"A": f"127.0.0.1:{p}"} for p in ports], engine=engine)
    for member in node.members:
        engine.add(member)
    try:
        deadline = time.monotonic() + 10
        while not all(m._isLeader() for m in node.members):
            assert time.monotonic() < deadline, "the lone members did not lead"
            engine._round()
        for _ in range(5):
            engine._round()  # their first entries committed: nothing left to sync
        for member in node.members:
            # (each journal stores its commit index once a second, syncing the log first:
            # one more fdatasync in whichever round the second ends)
            member._SyncObj__numOneSecondDumps = 10**9
        wal = node.members[0].journal._wal  # type: ignore[attr-defined]
        for round_ in range(3):
            for g, member in enumerate(node.members):
                member.propose(b"r%d-g%d" % (round_, g), None)
            syncs = wal.syncs
            engine._round()  # each appends its entry
            assert wal.syncs - syncs == 1, "one fdatasync for three groups' entries"
            engine._round()  # commits them
        engine._round()
        for g in range(3):
            assert node.applied[g][-3:] == [b"r%d-g%d" % (r, g) for r in range(3)]
    finally:
        engine.stop()


def test_a_member_whose_journal_fails_stops_alone_on_a_shared_engine(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a journal file per group, the group whose journal fails stops (its node is
    told: `on_fatal`); the engine goes on ticking the other groups."""
    engine = RaftEngine("solo")
    ports = free_ports(2)
    node = Node(
        "A", tmp_path, [{"A": f"127.0.0.1:{p}"} for p in ports], engine=engine, journal="file"
    )
    told: list[int] = []
    for g, member in enumerate(node.members):
        member.on_fatal = lambda g=g: told.append(g)
    broken, healthy = node.members
    try:
        node.start()
        _wait(lambda: broken._isLeader() and healthy._isLeader(), "both lead")

        def failing_sync() -> None:
            raise JournalFailedError("fdatasync failed: EIO (by the test)")

        monkeypatch.setattr(broken.journal, "sync", failing_sync)
        broken.propose(b"lost", None)
        _wait(broken.closed.is_set, "the member with the failed journal stops")
        assert told == [0] and isinstance(broken.fatal_error, JournalFailedError)
        assert _propose(healthy, b"still").wait(10)
        _wait(lambda: node.applied[1][-1:] == [b"still"], "the other group goes on")
        assert engine.alive()
    finally:
        engine.stop()
    assert healthy.closed.is_set()


def test_a_member_stopped_alone_leaves_the_engine_and_its_port(tmp_path: Any) -> None:
    """Stopping one member of a shared engine closes it (its port free again) and
    leaves the others ticking."""
    engine = RaftEngine("solo")
    ports = free_ports(2)
    node = Node("A", tmp_path, [{"A": f"127.0.0.1:{p}"} for p in ports], engine=engine)
    first, second = node.members
    try:
        node.start()
        _wait(lambda: first._isLeader() and second._isLeader(), "both lead")
        first.stop()
        assert first.closed.is_set()
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", ports[0]))  # free again
        assert _propose(second, b"on").wait(10)
    finally:
        engine.stop()


def test_no_group_applies_an_entry_before_an_fdatasync_covers_it(tmp_path: Any) -> None:
    """Three lone groups on a running engine, proposing all the time: a lone leader
    commits what it holds durably, so every entry it applies was written before an
    fdatasync of the log began. Without the engine's sync after the ticks (a leader's
    sync owed, never paid), entries are applied unsynced."""
    engine = RaftEngine("solo")
    ports = free_ports(3)
    node = Node("A", tmp_path, [{"A": f"127.0.0.1:{p}"} for p in ports], engine=engine)
    wal = node.members[0].journal._wal  # type: ignore[attr-defined]

    def position() -> tuple[int, int]:
        """The log's end: (segment, bytes written to it)."""
        return wal._segments[-1].seq, wal._segments[-1].size  # type: ignore[no-any-return]

    written: dict[tuple[int, int], tuple[int, int]] = {}  # (group, index) -> the end after it
    synced = [(0, 0)]  # the log's end when the last fdatasync of it began
    real_write = wal._write

    def write(records: list[Any]) -> None:
        real_write(records)
        for _, group, idx, _, _ in records:
            written[(group, idx)] = position()

    wal._write = write
    counted: list[tuple[int, int]] = []
    real_sync = wal.files.sync

    def sync(fd: int) -> None:
        began = position() if fd == wal._fd else None  # (not a meta file's)
        real_sync(fd)
        if began is not None:
            synced[0] = max(synced[0], began)
            counted.append(began)

    wal.files = _Wrapped(wal.files, sync=sync)
    early: list[tuple[int, int]] = []
    for g, member in enumerate(node.members):

        def apply(index: int, payload: bytes, g: int = g) -> None:
            at = written.get((g, index))
            if at is not None and at > synced[0]:
                early.append((g, index))

        member._apply = apply
    try:
        node.start()
        _wait(lambda: all(m._isLeader() for m in node.members), "the lone members lead")
        for i in range(100):  # in waves: many rounds, each group appending in most
            answers = [_propose(member, b"x%d" % i) for member in node.members]
            for answer in answers:
                assert answer.wait(20)
    finally:
        engine.stop()
    assert early == [], f"applied before an fdatasync covered them: {early[:5]}"
    assert len(counted) >= 100


class _Wrapped:
    """`files` with some of its methods replaced."""

    def __init__(self, files: Any, **replaced: Any) -> None:
        self._files = files
        self.__dict__.update(replaced)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._files, name)


def test_a_write_ahead_log_that_fails_stops_every_group_on_it(tmp_path: Any) -> None:
    """The log's fdatasync fails: every group on it stops (each node told), none goes
    on acknowledging what it cannot make durable."""
    engine = RaftEngine("solo")
    ports = free_ports(3)
    node = Node("A", tmp_path, [{"A": f"127.0.0.1:{p}"} for p in ports], engine=engine)
    told: list[int] = []
    for g, member in enumerate(node.members):
        member.on_fatal = lambda g=g: told.append(g)
    wal = node.members[0].journal._wal  # type: ignore[attr-defined]
    try:
        node.start()
        _wait(lambda: all(m._isLeader() for m in node.members), "the lone members lead")

        def failing(fd: int) -> None:
            raise OSError(5, "Input/output error (by the test)")

        wal.files = _Wrapped(wal.files, sync=failing)
        node.members[1].propose(b"lost", None)
        _wait(lambda: all(m.closed.is_set() for m in node.members), "every group stops")
        assert sorted(told) == [0, 1, 2]
        assert all(isinstance(m.fatal_error, JournalFailedError) for m in node.members)
    finally:
        engine.stop()


def test_a_member_of_a_running_engine_is_built_and_closed_on_its_thread(tmp_path: Any) -> None:
    """The members' journals share one log that only the engine's thread may touch:
    building a member off the thread of a running engine is refused with the way to
    do it (`RaftEngine.run`); built through it, it joins, and one never started is
    closed there too. (Built and stopped from another thread, 40 groups beside a busy
    one made its leader count entries no fdatasync covered: the two threads' syncs
    raced on the log's dirty flag.)"""
    engine = RaftEngine("solo")
    ports = free_ports(3)
    node = Node("A", tmp_path, [{"A": f"127.0.0.1:{ports[0]}"}], engine=engine)
    try:
        node.start()
        _wait(node.members[0]._isLeader, "the first group leads")

        def build(group: int) -> RaftMember:
            return node.member(group, {"A": f"127.0.0.1:{ports[group]}"})

        with pytest.raises(RuntimeError, match=r"RaftEngine\.run"):
            build(1)
        second = engine.run(lambda: build(1))
        second.start()
        _wait(second._isLeader, "the group built through the engine leads")
        third = engine.run(lambda: build(2))
        third.stop()  # never started: closed on the engine's thread
        assert third.closed.is_set()
        assert _propose(second, b"on").wait(10)
    finally:
        engine.stop()


def test_a_stopped_member_is_not_kept_alive_by_the_engine(tmp_path: Any) -> None:
    """Stopping one group of a running engine lets it go, its log in memory with it
    (PySyncObj's poller kept every closed descriptor's callback, and through it the
    member, until the number was used again)."""
    import gc
    import weakref

    engine = RaftEngine("solo")
    ports = free_ports(2)
    node = Node("A", tmp_path, [{"A": f"127.0.0.1:{p}"} for p in ports], engine=engine)
    try:
        node.start()
        _wait(lambda: all(m._isLeader() for m in node.members), "both lead")
        gone = weakref.ref(node.members[0])
        node.members[0].stop()
        del node.members[0]
        gc.collect()
        assert gone() is None, gc.get_referrers(gone())
        assert _propose(node.members[0], b"on").wait(10)
    finally:
        engine.stop()


def test_on_one_port_a_group_a_node_does_not_host_is_dropped_and_the_rest_go_on(
    tmp_path: Any,
) -> None:
    """A and B host groups 0-2, C only 0 and 1: group 2's messages to C are dropped
    by C's link (a group it does not host), group 2 commits on A and B, and C's
    groups go on."""
    groups = _groups(3, link=True)
    nodes = [
        Node("A", tmp_path, groups),
        Node("B", tmp_path, groups),
        Node("C", tmp_path, groups[:2]),
    ]
    try:
        for node in nodes:
            node.start()
        for g in range(3):
            _wait(lambda g=g: _leader(nodes, g) is not None, f"group {g} elects")
        for g in range(3):
            assert _propose(nodes[0].members[g], b"g%d" % g).wait(20)
        _wait(lambda: all(nodes[2].applied[g][-1:] == [b"g%d" % g] for g in range(2)), "C applies")
        _wait(lambda: nodes[1].applied[2][-1:] == [b"g2"], "B applies group 2")
    finally:
        for node in nodes:
            node.stop()


def test_on_one_port_a_node_with_another_secret_is_never_heard(tmp_path: Any) -> None:
    """C's engine seals with another secret: A and B's groups elect and commit
    without it, C's link never authenticates a connection, and C's groups never
    elect (it cannot win a pre-vote with no one to answer)."""
    groups = _groups(2, link=True)
    a, b = Node("A", tmp_path, groups), Node("B", tmp_path, groups)
    c_engine = RaftEngine("C", raft_address=groups[0]["C"], password="another")
    c = Node("C", tmp_path, groups, engine=c_engine, password="another")
    nodes = [a, b, c]
    try:
        for node in nodes:
            node.start()
        for g in range(2):
            _wait(lambda g=g: _leader([a, b], g) is not None, f"group {g} elects without C")
            assert _propose(a.members[g], b"x").wait(20)
        _wait(lambda: all(b.applied[g][-1:] == [b"x"] for g in range(2)), "B applies")
        assert c_engine.link is not None and not c_engine.link._remote
        assert all(m._getLeader() is None for m in c.members)
        assert all(n.applied == [[], []] for n in [c])
    finally:
        for node in nodes:
            node.stop()


def test_on_one_port_a_group_added_to_running_nodes_hears_the_peers_already_connected(
    tmp_path: Any,
) -> None:
    """Group 1 joins three running nodes whose link is already connected (for group
    0): it is told its peers are connected when it joins, elects and commits (a
    member only told of connections made after it joined would wait for ever)."""
    groups = _groups(2, link=True)
    nodes = [Node(name, tmp_path, groups[:1]) for name in NODES]
    try:
        for node in nodes:
            node.start()
        _wait(lambda: _leader(nodes, 0) is not None, "group 0 elects")
        _wait(lambda: all(len(n.engine.link._remote) == 2 for n in nodes), "linked")
        for node in nodes:
            node.members.append(node.engine.run(lambda node=node: node.member(1, groups[1])))
            node.members[1].start()
        _wait(lambda: _leader(nodes, 1) is not None, "group 1 elects")
        assert _propose(nodes[2].members[1], b"late").wait(20)
        _wait(lambda: all(n.applied[1][-1:] == [b"late"] for n in nodes), "every node applies")
        # every member said hello to every other, whichever joined first (the last to
        # join heard none when hellos went out only as connections opened)
        _wait(
            lambda: all(len(n.members[1]._quiet_speakers) == 2 for n in nodes),
            "every group-1 member knows both peers quiesce",
        )
    finally:
        for node in nodes:
            node.stop()


def test_on_one_port_groups_restarted_from_their_snapshots_elect_and_commit(
    tmp_path: Any,
) -> None:
    """Every node of a group compacts behind a snapshot, then all restart from it:
    PySyncObj gives the member new node objects, equal to the old ones, which the
    link's groups must take for the same peers (taken by identity, a group on one
    port never elected again after loading a snapshot)."""
    groups = _groups(2, link=True)
    with _cluster(tmp_path, groups, compaction_entries=10) as nodes:
        for g in range(2):
            _wait(lambda g=g: _leader(nodes, g) is not None, f"group {g} elects")
            for i in range(40):
                assert _propose(nodes[0].members[g], b"s%d" % i).wait(20)

        def snapshots() -> bool:
            return all(
                os.path.exists(os.path.join(m.data_dir, "snapshot"))
                for n in nodes
                for m in n.members
            )

        _wait(snapshots, "every member wrote a snapshot")
    again = [Node(name, tmp_path, groups, compaction_entries=10) for name in NODES]
    try:
        for node in again:
            node.start()
        for g in range(2):
            _wait(lambda g=g: _leader(again, g) is not None, f"group {g} elects again")
            assert _propose(again[1].members[g], b"after").wait(20)
    finally:
        for node in again:
            node.stop()


def test_on_one_port_a_member_that_stops_is_gone_for_its_peers_at_once(tmp_path: Any) -> None:
    """Group 1's member on A stops while A's node (and its group 0) goes on: B and
    C's group-1 members are told A is gone (their early-election and failed-forward
    rules run on that), while group 0 keeps A connected."""
    groups = _groups(2, link=True)
    with _cluster(tmp_path, groups) as nodes:
        a, b, c = nodes
        for g in range(2):
            _wait(lambda g=g: _leader(nodes, g) is not None, f"group {g} elects")

        def connected(node: Node, group: int) -> set[str]:
            return {n.address for n in node.members[group]._SyncObj__connectedNodes}

        address = groups[0]["A"]
        _wait(lambda: all(address in connected(n, g) for n in (b, c) for g in range(2)), "linked")
        a.members[1].stop()
        _wait(lambda: all(address not in connected(n, 1) for n in (b, c)), "A's group 1 is gone")
        assert all(address in connected(n, 0) for n in (b, c))
        _wait(lambda: _leader([b, c], 1) is not None, "group 1 leads without A")
        assert _propose(b.members[1], b"without A").wait(20)


def test_on_one_port_without_a_secret_every_group_elects_and_commits(tmp_path: Any) -> None:
    """An insecure link (no cluster secret): PySyncObj takes a dialled connection as
    connected while it is still connecting, and refused what was sent then: the
    dialler's groups were never heard by the node it dialled, and group 0 never
    elected. Each node says which of its groups are there on the connection as it is."""
    groups = _groups(2, link=True)
    with _cluster(tmp_path, groups, password="") as nodes:
        for g in range(2):
            _wait(lambda g=g: _leader(nodes, g) is not None, f"group {g} elects")
            assert _propose(nodes[1].members[g], b"plain").wait(20)
        _wait(lambda: all(n.applied[g][-1:] == [b"plain"] for n in nodes for g in range(2)), "all")


def test_on_one_port_a_port_that_stops_listening_is_bound_again(tmp_path: Any) -> None:
    """The link's server socket fails (an error event unbinds it): the next rounds
    bind it again, and a peer can dial the node (PySyncObj bound only until its first
    success, and every group on the one port would have stayed deaf)."""
    from pysyncobj.tcp_server import SERVER_STATE

    groups = _groups(1, link=True)
    with _cluster(tmp_path, groups) as nodes:
        _wait(lambda: _leader(nodes, 0) is not None, "group 0 elects")
        link = nodes[0].engine.link
        assert link is not None
        nodes[0].engine.run(link._server.unbind)
        _wait(lambda: link._server._TcpServer__state == SERVER_STATE.BINDED, "bound again")
        host, port = groups[0]["A"].rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5):
            pass  # accepted
        assert _propose(nodes[1].members[0], b"on").wait(20)
