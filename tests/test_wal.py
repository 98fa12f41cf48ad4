"""The write-ahead log shared by a node's Raft groups (`quorumq.raft.wal`).

Direct tests on the real file system and on the simulator's disk, then a Hypothesis
state machine that drives several groups through appends, cuts, compactions, snapshot
installs, syncs, rollovers and every disk fault the simulator makes, and checks after
each restart that every group's log is what it was at one moment between the last
sync and the crash: never a synced entry lost, never a mix of two moments.
"""

from __future__ import annotations

import contextlib
import os
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from quorumq.raft.journal import DurableJournal, JournalDamagedError, JournalFailedError
from quorumq.raft.wal import (
    ENTRY,
    KEPT_SEGMENTS,
    MOVED_MARKER,
    GroupJournal,
    WriteAheadLog,
    WrongJournalError,
)
from quorumq.server.metrics import TimedFiles
from simulations.disk import SimFiles

DIR = "/node/wal"


def _sim() -> SimFiles:
    return SimFiles(random.Random(7))


def _fill(journal: GroupJournal, first: int, count: int, *, term: int = 1, size: int = 10) -> None:
    if journal.getCurrentTerm() < term:  # as Raft does: the term is stored before its entries
        journal.setCurrentTerm(term, None)
    for idx in range(first, first + count):
        journal.add(bytes([idx % 251]) * size, idx, term)


def _logs(wal: WriteAheadLog, groups: list[int]) -> dict[int, list[tuple[bytes, int, int]]]:
    journals = {g: wal.journal(g) for g in groups}
    return {g: list(j[:]) for g, j in journals.items()}


def test_every_groups_entries_survive_a_reopen(tmp_path: Path) -> None:
    wal = WriteAheadLog(str(tmp_path))
    journals = [wal.journal(g) for g in (0, 1, 7)]
    for n, journal in enumerate(journals):
        journal.setCurrentTerm(n + 1, None)
        _fill(journal, 1, 5 + n, term=n + 1)
    wal.sync()
    expected = {g: list(j[:]) for g, j in zip((0, 1, 7), journals, strict=True)}
    for journal in journals:
        journal._destroy()
    wal.close()
    again = WriteAheadLog(str(tmp_path))
    assert again.groups() == [0, 1, 7]
    assert _logs(again, [0, 1, 7]) == expected
    assert again.journal(3)[:] == []  # a group the log never held: empty
    assert sorted(os.listdir(tmp_path)) == [
        "group-0.meta",
        "group-1.meta",
        "group-7.meta",
        "wal-0000000001.log",
    ]


def test_one_sync_makes_every_group_durable() -> None:
    """Group commit: three groups that wrote in a round cost one fdatasync, and a power
    loss after it keeps all three."""
    files = _sim()
    wal = WriteAheadLog(DIR, files=files)
    journals = [wal.journal(g) for g in range(3)]
    for journal in journals:
        journal.setCurrentTerm(1, None)
    before = files.syncs
    for journal in journals:
        _fill(journal, 1, 4)
    wal.sync()
    assert files.syncs - before == 1
    assert wal.syncs == 1
    wal.sync()  # nothing written since: no fdatasync
    assert files.syncs - before == 1
    _fill(journals[1], 5, 3)  # written, never synced
    files.power_loss()
    logs = _logs(WriteAheadLog(DIR, files=files), [0, 1, 2])
    assert [len(logs[g]) for g in range(3)] == [4, 4, 4]


def test_a_torn_tail_is_cut_and_the_synced_records_kept() -> None:
    files = SimFiles(random.Random(3))
    wal = WriteAheadLog(DIR, files=files)
    a, b = wal.journal(0), wal.journal(1)
    _fill(a, 1, 3, size=2000)
    _fill(b, 1, 3, size=2000)
    wal.sync()
    _fill(a, 4, 5, size=2000)
    files.power_loss(torn=True)
    logs = _logs(WriteAheadLog(DIR, files=files), [0, 1])
    assert [e[1] for e in logs[1]] == [1, 2, 3]
    assert [e[1] for e in logs[0]][:3] == [1, 2, 3]
    assert [e[1] for e in logs[0]] == list(range(1, len(logs[0]) + 1))


def test_a_corrupt_record_with_intact_ones_after_it_refuses_to_open(tmp_path: Path) -> None:
    wal = WriteAheadLog(str(tmp_path), strict=False)
    journal = wal.journal(4)
    _fill(journal, 1, 10, size=40)
    wal.close()
    segment = tmp_path / "wal-0000000001.log"
    data = bytearray(segment.read_bytes())
    data[len(data) // 2] ^= 0x10
    segment.write_bytes(bytes(data))
    with pytest.raises(JournalDamagedError, match="followed by an intact one"):
        WriteAheadLog(str(tmp_path), strict=False)
    assert segment.read_bytes() == bytes(data)  # kept for inspection, never cut


def test_a_whole_last_record_failing_its_checksum_refuses_when_strict(tmp_path: Path) -> None:
    wal = WriteAheadLog(str(tmp_path))
    _fill(wal.journal(0), 1, 3, size=40)
    wal.close()
    segment = tmp_path / "wal-0000000001.log"
    data = bytearray(segment.read_bytes())
    data[-5] ^= 1  # inside the last entry's command
    segment.write_bytes(bytes(data))
    with pytest.raises(JournalDamagedError, match="not a torn write"):
        WriteAheadLog(str(tmp_path))
    loose = WriteAheadLog(str(tmp_path), strict=False)  # `fsync=batch`: cut, maybe never synced
    assert [e[1] for e in loose.journal(0)[:]] == [1, 2]


def test_an_entry_that_does_not_follow_its_groups_log_refuses_to_open() -> None:
    files = _sim()
    wal = WriteAheadLog(DIR, files=files)
    journal = wal.journal(2)
    _fill(journal, 1, 3)
    wal._write([(ENTRY, 2, 9, 1, b"gap")])  # a record a bug could write
    wal.sync()
    with pytest.raises(JournalDamagedError, match=r"entry 9 of group 2 .* does not follow"):
        WriteAheadLog(DIR, files=files)


def test_an_entry_added_out_of_order_rewrites_the_log_whole() -> None:
    """What the journal holds is what opening gives, even if PySyncObj adds an entry
    that does not follow: the group's log is written whole at the next sync."""
    files = _sim()
    wal = WriteAheadLog(DIR, files=files)
    journal = wal.journal(2)
    _fill(journal, 1, 3)
    journal.add(b"jump", 9, 1)
    wal.sync()
    files.power_loss()
    assert [e[1] for e in _logs(WriteAheadLog(DIR, files=files), [2])[2]] == [1, 2, 3, 9]


def test_a_missing_segment_between_two_refuses_to_open() -> None:
    files = _sim()
    wal = WriteAheadLog(DIR, files=files, segment_bytes=300)
    _fill(wal.journal(0), 1, 40, size=50)
    wal.sync()
    names = sorted(n for n in files.list_directory(DIR) if n.endswith(".log"))
    assert len(names) > 3
    files.remove(f"{DIR}/{names[1]}")
    files.sync_directory(DIR)
    with pytest.raises(JournalDamagedError, match="segment 2 is missing"):
        WriteAheadLog(DIR, files=files)


def test_meta_files_without_a_log_refuse_to_open() -> None:
    files = _sim()
    wal = WriteAheadLog(DIR, files=files)
    wal.journal(0).setCurrentTerm(3, "b")
    wal.close()
    for name in files.list_directory(DIR):
        if name.endswith(".log"):
            files.remove(f"{DIR}/{name}")
    with pytest.raises(JournalDamagedError, match="write-ahead log is missing"):
        WriteAheadLog(DIR, files=files)


def test_a_snapshot_install_is_written_whole_or_not_at_all() -> None:
    """`clear` then new entries: a power loss before the sync leaves the old log, one
    after it the new one, never a log cut in between (whatever part of the write the
    disk kept)."""
    for seed in range(30):
        files = SimFiles(random.Random(seed))
        wal = WriteAheadLog(DIR, files=files)
        journal, other = wal.journal(0), wal.journal(1)
        _fill(journal, 1, 4, size=500)
        _fill(other, 1, 2)
        wal.sync()
        old = list(journal[:])
        journal.clear()
        _fill(journal, 50, 6, size=500)
        new = list(journal[:])
        _fill(other, 3, 1)
        files.power_loss(torn=True)
        logs = _logs(WriteAheadLog(DIR, files=files), [0, 1])
        assert logs[0] == old, seed
        wal2 = WriteAheadLog(DIR, files=files)
        journal = wal2.journal(0)
        journal.clear()
        for entry in new:
            journal.add(*entry)
        wal2.sync()
        files.power_loss(torn=True)
        assert _logs(WriteAheadLog(DIR, files=files), [0])[0] == new, seed


def test_compaction_frees_old_segments() -> None:
    files = _sim()
    wal = WriteAheadLog(DIR, files=files, segment_bytes=1000)
    journal = wal.journal(0)
    _fill(journal, 1, 100, size=100)
    wal.sync()
    assert len(files.list_directory(DIR)) > 10
    journal.deleteEntriesTo(95)  # positions: entries 96-100 stay
    wal.sync()
    segments = [n for n in files.list_directory(DIR) if n.endswith(".log")]
    assert len(segments) <= 2
    files.power_loss()
    assert [e[1] for e in _logs(WriteAheadLog(DIR, files=files), [0])[0]] == list(range(96, 101))


def test_a_quiet_group_is_rewritten_so_it_cannot_keep_old_segments() -> None:
    """A group that wrote one entry long ago and never compacts would pin the oldest
    segment forever: it is rewritten at the end instead, and the disk stays bounded."""
    files = _sim()
    wal = WriteAheadLog(DIR, files=files, segment_bytes=2000)
    quiet, busy = wal.journal(5), wal.journal(6)
    quiet.setCurrentTerm(1, None)
    quiet.add(b"hello", 1, 1)
    for first in range(1, 2001, 20):
        _fill(busy, first, 20, size=100)
        busy.deleteEntriesTo(max(0, len(busy) - 10))  # compacts, as a busy group does
        wal.sync()
        segments = [n for n in files.list_directory(DIR) if n.endswith(".log")]
        assert len(segments) <= KEPT_SEGMENTS + 2
    files.power_loss()
    logs = _logs(WriteAheadLog(DIR, files=files), [5, 6])
    assert logs[5] == [(b"hello", 1, 1)]
    assert [e[1] for e in logs[6]] == list(range(1991, 2001))


def test_groups_that_never_compact_keep_each_sync_bounded_and_the_disk_near_what_is_live() -> None:
    """Eight groups appending in turn, never compacting, on small segments: every
    sync does a bounded amount of work (a review found one that copied groups forward
    forever once they pinned more than two segments), and the segments hold at most
    twice the live records and a few segments besides."""
    files = _sim()
    wal = WriteAheadLog(DIR, files=files, segment_bytes=4096)
    journals = [wal.journal(g) for g in range(8)]
    for journal in journals:
        journal.setCurrentTerm(1, None)
    real_write = files.write
    budget = [0]

    def write(fd: int, data: bytes | memoryview) -> int:
        budget[0] -= 1
        assert budget[0] >= 0, "a sync that does not end"
        return real_write(fd, data)

    files.write = write  # type: ignore[method-assign]
    for n in range(1, 81):
        budget[0] = 10**9
        for g, journal in enumerate(journals):
            journal.add(bytes([g + 1]) * 300, n, 1)
        budget[0] = 3 * len(journals)  # each group copied at most once, rollovers
        wal.sync()
        names = [x for x in files.list_directory(DIR) if x.endswith(".log")]
        on_disk = sum(len(files.read(f"{DIR}/{x}") or b"") for x in names)
        live = sum(sum(len(c) + 50 for c, _, _ in j[:]) for j in journals)
        assert on_disk <= 2 * live + (KEPT_SEGMENTS + 1) * 4096, (n, on_disk, live)
    files.power_loss()
    logs = _logs(WriteAheadLog(DIR, files=files), list(range(8)))
    assert all([e[1] for e in logs[g]] == list(range(1, 81)) for g in range(8))


def test_a_group_too_large_to_rewrite_keeps_its_segments() -> None:
    """A log that cannot compact (its snapshots fail) is never rewritten again and
    again: its segments stay, as a journal of its own would grow."""
    files = _sim()
    wal = WriteAheadLog(DIR, files=files, segment_bytes=1000)
    stuck = wal.journal(0)
    _fill(stuck, 1, 60, size=100)
    wal.sync()
    writes = files.writes
    _fill(stuck, 61, 10, size=100)
    wal.sync()
    assert files.writes - writes < 30  # the appends and rollovers, no rewrite of 6 KB
    assert len([n for n in files.list_directory(DIR) if n.endswith(".log")]) > 6


def test_cut_and_compaction_survive_a_reopen() -> None:
    files = _sim()
    wal = WriteAheadLog(DIR, files=files)
    journal = wal.journal(0)
    _fill(journal, 1, 10)
    journal.deleteEntriesFrom(7)  # positions: entries 8-10 go
    journal.add(b"new8", 8, 2)
    journal.deleteEntriesTo(3)  # entries 1-3 go
    wal.sync()
    files.power_loss()
    log = _logs(WriteAheadLog(DIR, files=files), [0])[0]
    assert [e[1] for e in log] == [4, 5, 6, 7, 8]
    assert log[-1] == (b"new8", 8, 2)


def test_a_failed_write_breaks_every_group_for_good() -> None:
    files = _sim()
    wal = WriteAheadLog(DIR, files=files)
    a, b = wal.journal(0), wal.journal(1)
    _fill(a, 1, 2)
    wal.sync()
    files.fail_next_write()
    with pytest.raises(JournalFailedError):
        _fill(b, 1, 1, size=100)
    for call in (lambda: a.add(b"x", 3, 1), wal.sync, b.sync, lambda: a.deleteEntriesTo(1)):
        with pytest.raises(JournalFailedError):
            call()
    files.crash()
    logs = _logs(WriteAheadLog(DIR, files=files), [0, 1])
    assert [len(logs[0]), len(logs[1])] == [2, 0]  # the half record was a torn tail


def test_a_failed_fdatasync_is_never_retried() -> None:
    files = _sim()
    wal = WriteAheadLog(DIR, files=files)
    journal = wal.journal(0)
    _fill(journal, 1, 2)
    files.fail_next_sync()
    with pytest.raises(JournalFailedError, match="fdatasync"):
        wal.sync()
    syncs = files.syncs
    with pytest.raises(JournalFailedError):
        wal.sync()
    journal._destroy()
    assert files.syncs == syncs


def test_the_commit_index_is_checked_per_group(tmp_path: Path) -> None:
    wal = WriteAheadLog(str(tmp_path))
    a, b = wal.journal(0), wal.journal(1)
    for journal in (a, b):
        journal.setCurrentTerm(1, None)
        _fill(journal, 1, 5)
        journal.setRaftCommitIndex(5)
        journal.onOneSecondTimer()
    with pytest.raises(JournalDamagedError, match="at or below the commit index 5"):
        b.deleteEntriesFrom(2)
    wal.close()
    segment = tmp_path / "wal-0000000001.log"
    (tmp_path / "copy").write_bytes(segment.read_bytes())
    # cut group 1's last records: group 1 now ends below its recorded commit index
    data = segment.read_bytes()
    segment.write_bytes(data[: len(data) - 40])
    with pytest.raises(JournalDamagedError, match="recorded commit index 5"):
        WriteAheadLog(str(tmp_path)).journal(1)
    assert [e[1] for e in WriteAheadLog(str(tmp_path)).journal(0)[:]] == [1, 2, 3, 4, 5]


def test_a_group_journal_is_opened_once() -> None:
    wal = WriteAheadLog(DIR, files=_sim())
    journal = wal.journal(0)
    with pytest.raises(ValueError, match="already open"):
        wal.journal(0)
    journal._destroy()
    wal.journal(0)
    with pytest.raises(ValueError, match="32-bit"):
        wal.journal(-1)


# ---------------------------------------------------------------- properties

GROUPS = (0, 1, 2, 3, 4)
Logs = dict[int, tuple[tuple[bytes, int, int], ...]]


class WalMachine(RuleBasedStateMachine):
    """Several groups on the simulator's disk with tiny segments. `history` holds the
    groups' logs after each operation since the last sync: after a restart, each
    group's log must be exactly its log at one of them (whole operations only)."""

    @initialize(seed=st.integers(0, 2**32 - 1), segment_bytes=st.integers(200, 3000))
    def start(self, seed: int, segment_bytes: int) -> None:
        self.files = SimFiles(random.Random(seed))
        self.segment_bytes = segment_bytes
        self.next_index = dict.fromkeys(GROUPS, 1)
        self.term = 1
        self.broken = False
        self._open()
        self.history: list[tuple[Logs, dict[int, int]]] = [self._moment()]

    def _open(self) -> None:
        self.wal = WriteAheadLog(DIR, files=self.files, segment_bytes=self.segment_bytes)
        self.journals = {g: self.wal.journal(g) for g in GROUPS}

    def _now(self) -> Logs:
        return {g: tuple(j[:]) for g, j in self.journals.items()}

    def _moment(self) -> tuple[Logs, dict[int, int]]:
        return self._now(), dict(self.next_index)

    def _did(self) -> None:
        self.history.append(self._moment())

    def _try(self, call: object) -> None:
        try:
            call()  # type: ignore[operator]
        except JournalFailedError:
            self.broken = True
            return
        self._did()

    @precondition(lambda self: not self.broken)
    @rule(group=st.sampled_from(GROUPS), count=st.integers(1, 6), size=st.integers(0, 400))
    def append(self, group: int, count: int, size: int) -> None:
        journal = self.journals[group]

        def add() -> None:
            if journal.getCurrentTerm() < self.term:
                journal.setCurrentTerm(self.term, None)
            for _ in range(count):
                idx = self.next_index[group]
                journal.add(bytes([idx % 256]) * size, idx, self.term)
                self.next_index[group] = idx + 1
                self._did()

        self._try(add)

    @precondition(lambda self: not self.broken)
    @rule(group=st.sampled_from(GROUPS), where=st.floats(0, 1))
    def cut(self, group: int, where: float) -> None:
        journal = self.journals[group]
        if not len(journal):
            return
        position = int(where * (len(journal) - 1))
        self.term += 1
        self.next_index[group] = journal[position][1]
        self._try(lambda: journal.deleteEntriesFrom(position))

    @precondition(lambda self: not self.broken)
    @rule(group=st.sampled_from(GROUPS), where=st.floats(0, 1))
    def compact(self, group: int, where: float) -> None:
        journal = self.journals[group]
        self._try(lambda: journal.deleteEntriesTo(int(where * len(journal))))

    @precondition(lambda self: not self.broken)
    @rule(group=st.sampled_from(GROUPS), skip=st.integers(0, 50), count=st.integers(0, 5))
    def install_snapshot(self, group: int, skip: int, count: int) -> None:
        journal = self.journals[group]

        def install() -> None:
            if journal.getCurrentTerm() < self.term:
                journal.setCurrentTerm(self.term, None)
            journal.clear()
            first = self.next_index[group] + skip
            for idx in range(first, first + count):
                journal.add(b"s%d" % idx, idx, self.term)
            self.next_index[group] = first + count

        self._try(install)

    @precondition(lambda self: not self.broken)
    @rule()
    def sync(self) -> None:
        try:
            self.wal.sync()
        except JournalFailedError:
            self.broken = True
            return
        self.history = [self._moment()]

    @precondition(lambda self: not self.broken)
    @rule(rounds=st.integers(1, 30), size=st.integers(50, 400))
    def a_busy_spell(self, rounds: int, size: int) -> None:
        """Every group appends, round after round, with a sync each: segments roll
        over, fill with every group's records and are freed or copied forward."""
        for _ in range(rounds):
            for group in GROUPS:
                self.append(group, 1, size)
            if self.broken:
                return
            self.sync()
            if self.broken:
                return

    @precondition(lambda self: not self.broken)
    @rule(at=st.integers(1, 12), torn=st.booleans())
    def power_loss_inside_a_sync(self, at: int, torn: bool) -> None:
        """The host loses power at the `at`-th write, sync, rename or removal of a
        sync: inside a rollover, a copy forward, a FREED record or a removal."""

        class PowerLossError(Exception):
            pass

        countdown = [at]
        originals = {}
        for name in ("write", "sync", "replace", "remove", "sync_directory", "create"):
            original = originals[name] = getattr(self.files, name)

            def hooked(*args: object, _original: object = original) -> object:
                countdown[0] -= 1
                if countdown[0] == 0:
                    raise PowerLossError
                return _original(*args)  # type: ignore[operator]

            setattr(self.files, name, hooked)
        try:
            self.wal.sync()
            finished = True
        except (PowerLossError, JournalFailedError):  # (a fault armed before)
            finished = False
        finally:
            for name, original in originals.items():
                setattr(self.files, name, original)
        if finished:
            self.history = [self._moment()]
        self.files.power_loss(torn=torn)
        self._reopen_and_check()

    @precondition(lambda self: not self.broken)
    @rule()
    def a_write_fails(self) -> None:
        self.files.fail_next_write()

    @precondition(lambda self: not self.broken)
    @rule()
    def a_sync_fails(self) -> None:
        self.files.fail_next_sync()

    @rule(power=st.booleans(), torn=st.booleans())
    def restart(self, power: bool, torn: bool) -> None:
        if power:
            self.files.power_loss(torn=torn)
        else:
            self.files.crash()
        self._reopen_and_check()

    @rule(segment=st.integers(0, 50))
    def a_bit_flips_on_disk(self, segment: int) -> None:
        self.files.power_loss()
        names = sorted(n for n in self.files.list_directory(DIR) if n.endswith(".log"))
        flipped = self.files.flip_bit(f"{DIR}/{names[segment % len(names)]}")
        try:
            self._reopen_and_check()
        except JournalDamagedError:
            assert flipped
            # the node would stay down; the run goes on with a new, empty disk
            self.files = SimFiles(random.Random(self.segment_bytes))
            self.next_index = dict.fromkeys(GROUPS, 1)
            self._open()
            self.history = [self._moment()]
            return
        # a strict log refuses any flipped bit it reads; one in bytes never read (there
        # are none past a segment's last record) would be a miss
        assert not flipped, "a flipped bit was read without refusing"

    def _reopen_and_check(self) -> None:
        del self.wal  # its descriptors went with the crash
        self._open()
        now = self._now()
        for group in GROUPS:
            # each group's log is its log at one moment since the last sync (groups are
            # separate Raft logs: a snapshot install is written only at the next sync,
            # so one group may come back from before moments the others come back from)
            moments = [(logs[group], nexts[group]) for logs, nexts in self.history]
            found = [nxt for log, nxt in moments if log == now[group]]
            assert found, (group, now[group], moments)
            self.next_index[group] = found[-1]
        self.history = [self._moment()]
        self.broken = False

    def teardown(self) -> None:
        if hasattr(self, "wal"):
            with contextlib.suppress(JournalFailedError):
                self.wal.close()


TestWalMachine = WalMachine.TestCase
TestWalMachine.settings = settings(
    max_examples=1000,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


# ---------------------------------------------------------------- adopting a journal file


def _journal_file(files: SimFiles, count: int) -> list[tuple[bytes, int, int]]:
    old = DurableJournal("/node/raft.log", files=files)
    old.setCurrentTerm(3, "B")
    for idx in range(1, count + 1):
        old.add(b"e%d" % idx, idx, 3)
    old.setRaftCommitIndex(count - 1)
    entries = list(old[:])
    old._destroy()
    return entries


def _set_aside(files: SimFiles, name: str) -> list[str]:
    return [n for n in files.list_directory("/node") if n.startswith(name + ".adopted-")]


def test_a_journal_file_is_carried_into_a_group_once_and_set_aside() -> None:
    files = _sim()
    entries = _journal_file(files, 20)
    wal = WriteAheadLog(DIR, files=files)
    wal.adopt(0, "/node/raft.log")
    journal = wal.journal(0)
    assert list(journal[:]) == entries
    assert (journal.getCurrentTerm(), journal.getVotedForNodeId()) == (3, "B")
    assert journal.getRaftCommitIndex() == 19
    assert (files.read("/node/raft.log") or b"")[:4] == MOVED_MARKER
    assert len(_set_aside(files, "raft.log")) == len(_set_aside(files, "raft.log.meta")) == 1
    with pytest.raises(JournalDamagedError, match="not a quorumq journal"):
        DurableJournal("/node/raft.log", files=files)  # an older release refuses the marker
    journal._destroy()
    files.power_loss()
    again = WriteAheadLog(DIR, files=files)
    again.adopt(0, "/node/raft.log")  # nothing left to carry: a no-op
    assert list(again.journal(0)[:]) == entries


@pytest.mark.parametrize("durable", [True, False])
@pytest.mark.parametrize("at", range(1, 21))
def test_an_adoption_cut_short_by_a_power_loss_anywhere_is_finished_by_the_next(
    at: int, durable: bool
) -> None:
    """The host loses power at the `at`-th file operation of an adoption (with
    `fsync=never` too: the adoption is synced whatever the mode); the next start
    carries the journal over whole, term and vote with it, or finds it done."""
    files = _sim()
    entries = _journal_file(files, 12)

    class PowerLossError(Exception):
        pass

    wal = WriteAheadLog(DIR, files=files, durable=durable)
    countdown = [at]
    originals = {}
    for name in ("write", "sync", "replace", "remove", "sync_directory", "create"):
        original = originals[name] = getattr(files, name)

        def hooked(*args: object, _original: object = original) -> object:
            countdown[0] -= 1
            if countdown[0] == 0:
                raise PowerLossError
            return _original(*args)  # type: ignore[operator]

        setattr(files, name, hooked)
    with contextlib.suppress(PowerLossError, JournalFailedError):
        wal.adopt(0, "/node/raft.log")
    for name, original in originals.items():
        setattr(files, name, original)
    files.power_loss(torn=True)
    again = WriteAheadLog(DIR, files=files, durable=durable)
    again.adopt(0, "/node/raft.log")
    journal = again.journal(0)
    assert list(journal[:]) == entries, at
    assert (journal.getCurrentTerm(), journal.getVotedForNodeId()) == (3, "B")
    assert (files.read("/node/raft.log") or b"")[:4] == MOVED_MARKER
    assert files.read("/node/raft.log.meta") is None


def test_a_journal_file_written_after_the_adoption_is_refused_not_set_aside() -> None:
    """A release without the log, run on the directory after the adoption (it had to
    get past the marker: a restored backup, say), wrote a journal of its own: carrying
    either over would lose the other's term, vote and entries, so opening refuses."""
    files = _sim()
    _journal_file(files, 5)
    wal = WriteAheadLog(DIR, files=files)
    wal.adopt(0, "/node/raft.log")
    wal.close()
    files.remove("/node/raft.log")  # the marker, gone with a restore
    newer = _journal_file(files, 3)
    with pytest.raises(WrongJournalError, match="holds other entries"):
        WriteAheadLog(DIR, files=files).adopt(0, "/node/raft.log")
    assert [e for e in DurableJournal("/node/raft.log", files=files)[:]] == newer


def test_wrapping_a_group_journals_files_wraps_the_logs() -> None:
    """The fsync metrics wrap `journal.files`: every group's syncs go through it."""
    files = _sim()
    wal = WriteAheadLog(DIR, files=files)
    journal = wal.journal(0)
    seen: list[float] = []
    journal.files = TimedFiles(files, seen.append)
    _fill(journal, 1, 3)
    wal.sync()
    assert wal.files is journal.files and len(seen) >= 2  # the term's and the entries'


def test_the_log_closes_with_its_last_group_journal() -> None:
    files = _sim()
    wal = WriteAheadLog(DIR, files=files)
    a, b = wal.journal(0), wal.journal(1)
    a._destroy()
    _fill(b, 1, 2)
    b._destroy()
    with pytest.raises(KeyError):  # its descriptor is closed
        files.sync(wal._fd)
    wal.close()  # idempotent


def test_a_flipped_bit_with_another_groups_records_after_it_refuses_to_open() -> None:
    """Not strict (`fsync=batch`), one damaged record of group 0 followed by intact
    records of group 1: cutting there would drop group 1's synced entries too."""
    files = _sim()
    wal = WriteAheadLog(DIR, files=files, strict=False)
    a, b = wal.journal(0), wal.journal(1)
    _fill(a, 1, 5, size=60)
    _fill(b, 1, 3, size=60)
    wal.sync()
    path = f"{DIR}/wal-0000000001.log"
    data = bytearray(files.read(path) or b"")
    records_of_a_end = len(data) - 3 * (28 + 5 + 60)
    data[records_of_a_end - 10] ^= 0x04  # inside group 0's last entry
    files.names[path].reset(bytes(data))
    with pytest.raises(JournalDamagedError, match="followed by an intact one"):
        WriteAheadLog(DIR, files=files, strict=False)


def test_a_group_journal_says_what_the_log_holds_for_status() -> None:
    files = _sim()
    wal = WriteAheadLog(DIR, files=files, segment_bytes=1000)
    a, b = wal.journal(0), wal.journal(1)
    _fill(a, 1, 12, size=100)
    _fill(b, 1, 3, size=100)
    wal.sync()
    segments = [n for n in files.list_directory(DIR) if n.endswith(".log")]
    on_disk = sum(len(files.read(f"{DIR}/{n}") or b"") for n in segments)
    assert a.usage() == {"kind": "wal", "entries": 12, "segments": len(segments), "bytes": on_disk}
    assert b.usage()["entries"] == 3 and len(segments) > 1


def test_an_adoption_under_fsync_never_of_a_journal_never_synced_is_finished_not_refused() -> None:
    """A node run with `fsync=never` never synced its journal: the adoption syncs it
    (and its meta file) before fingerprinting it, so a power loss right after the
    group's meta file is durable does not leave a fingerprint that no longer matches
    (a review found every later start refused)."""
    files = _sim()
    old = DurableJournal("/node/raft.log", files=files, durable=False)
    old.setCurrentTerm(3, "B")
    for idx in range(1, 11):
        old.add(b"e%d" % idx, idx, 3)
    entries = list(old[:])
    old._destroy()
    wal = WriteAheadLog(DIR, files=files, durable=False)
    real_replace = files.replace

    class PowerLossError(Exception):
        pass

    def replace(source: str, target: str) -> None:
        real_replace(source, target)
        if target.endswith("group-0.meta"):
            files.sync_directory(DIR)
            raise PowerLossError

    files.replace = replace  # type: ignore[method-assign]
    with pytest.raises(PowerLossError):
        wal.adopt(0, "/node/raft.log")
    files.replace = real_replace  # type: ignore[method-assign]
    files.power_loss()
    again = WriteAheadLog(DIR, files=files, durable=False)
    again.adopt(0, "/node/raft.log")
    journal = again.journal(0)
    assert list(journal[:]) == entries and journal.getCurrentTerm() == 3


def test_a_meta_file_that_moved_on_after_the_adoption_is_refused() -> None:
    """A restored journal file identical to the one carried over, but with a meta
    file a rolled-back run moved on (a term and a vote of its own): setting both aside
    would forget that vote, so opening refuses."""
    files = _sim()
    _journal_file(files, 5)
    journal_bytes = files.read("/node/raft.log")
    wal = WriteAheadLog(DIR, files=files)
    wal.adopt(0, "/node/raft.log")
    wal.close()
    files.remove("/node/raft.log")  # a restore: journal and meta as they were
    for name in (*_set_aside(files, "raft.log"), *_set_aside(files, "raft.log.meta")):
        files.replace(f"/node/{name}", "/node/" + name.split(".adopted-")[0])
    assert files.read("/node/raft.log") == journal_bytes
    rolled_back = DurableJournal("/node/raft.log", files=files)
    rolled_back.setCurrentTerm(9, "C")
    rolled_back._destroy()
    with pytest.raises(WrongJournalError, match="another term"):
        WriteAheadLog(DIR, files=files).adopt(0, "/node/raft.log")


def test_the_marker_without_the_log_refuses_to_open() -> None:
    """`raft.log` says the journal moved, but the log has no group 0 (a restore left
    `wal/` out): starting empty would forget the term and the vote."""
    files = _sim()
    _journal_file(files, 5)
    wal = WriteAheadLog(DIR, files=files)
    wal.adopt(0, "/node/raft.log")
    wal.close()
    for name in files.list_directory(DIR):
        files.remove(f"{DIR}/{name}")
    with pytest.raises(JournalDamagedError, match="no group 0"):
        WriteAheadLog("/node/wal2", files=files).adopt(0, "/node/raft.log")


@pytest.mark.parametrize("durable", [True, False])
def test_a_node_on_the_log_from_its_first_start_stopped_before_any_term_starts_again(
    durable: bool,
) -> None:
    """A fresh node on the log (no journal to carry over) leaves the marker at its
    first start; stopped or crashed before its first term (its peers were not up yet,
    or its Raft port was taken), it must start again: the group's meta file is written
    before the marker. It was not, and every later start refused ("no group 0")."""
    files = _sim()
    wal = WriteAheadLog(DIR, files=files, durable=durable)
    wal.adopt(0, "/node/raft.log")
    assert (files.read("/node/raft.log") or b"")[:4] == MOVED_MARKER
    wal.journal(0)._destroy()  # stopped before any term: nothing stored since
    files.power_loss()
    again = WriteAheadLog(DIR, files=files, durable=durable)
    again.adopt(0, "/node/raft.log")
    journal = again.journal(0)
    assert (journal.getCurrentTerm(), list(journal[:])) == (0, [])
