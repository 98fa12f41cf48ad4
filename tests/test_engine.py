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

from quorumq.raft.engine import RaftEngine
from quorumq.raft.journal import JournalFailedError
from quorumq.raft.member import RaftMember

NODES = "ABC"


def _free_ports(count: int) -> list[int]:
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


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
    ) -> None:
        self.name = name
        self.dir = str(root / name)
        self.engine = RaftEngine(name) if engine is None else engine
        self.applied: list[list[bytes]] = [[] for _ in groups]
        self.members: list[RaftMember] = []
        for group, addresses in enumerate(groups):
            self.members.append(
                RaftMember(
                    name,
                    addresses,
                    data_dir=self.dir if group == 0 else os.path.join(self.dir, f"group-{group}"),
                    node_dir=self.dir,
                    group=group,
                    engine=self.engine,
                    journal=journal,  # type: ignore[arg-type]
                    password="secret",
                    fsync=fsync,  # type: ignore[arg-type]
                    apply=self._applier(group),
                    snapshot=lambda: b"",
                    restore=lambda machine: None,
                    on_tick=lambda: None,
                )
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


def _groups(count: int) -> list[dict[str, str]]:
    ports = iter(_free_ports(count * len(NODES)))
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
        if node.members[group]._isLeader():
            return node
    return None


def _propose(member: RaftMember, payload: bytes) -> threading.Event:
    done = threading.Event()

    def answered(result: Any, error: int) -> None:
        done.set()

    member._engine.call(lambda: member.propose(payload, answered))
    return done


def test_three_groups_on_three_engines_commit_in_order_everywhere(tmp_path: Any) -> None:
    """Every group elects, commits what is proposed to any of its members, and applies
    it in one order on every node; each node's write-ahead log holds every group."""
    groups = _groups(3)
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


def test_a_node_restarted_from_its_write_ahead_log_catches_up_in_every_group(
    tmp_path: Any,
) -> None:
    """A node stopped while its groups go on comes back from its one log with every
    group's entries, and catches up; nothing a group committed is lost or reordered."""
    groups = _groups(3)
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
    ports = _free_ports(3)
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
    ports = _free_ports(2)
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
    ports = _free_ports(2)
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
    ports = _free_ports(3)
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
    ports = _free_ports(3)
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
    ports = _free_ports(3)
    node = Node("A", tmp_path, [{"A": f"127.0.0.1:{ports[0]}"}], engine=engine)
    try:
        node.start()
        _wait(node.members[0]._isLeader, "the first group leads")

        def build(group: int) -> RaftMember:
            return RaftMember(
                "A",
                {"A": f"127.0.0.1:{ports[group]}"},
                data_dir=str(tmp_path / "A" / f"group-{group}"),
                node_dir=str(tmp_path / "A"),
                group=group,
                engine=engine,
                journal="wal",
                password="secret",
                fsync="always",
                apply=lambda index, payload: None,
                snapshot=lambda: b"",
                restore=lambda machine: None,
                on_tick=lambda: None,
            )

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
    ports = _free_ports(2)
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
