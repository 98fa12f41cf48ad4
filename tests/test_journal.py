"""The durable Raft journal: survives reopen, cuts torn tails, compacts atomically."""

from __future__ import annotations

import os
from pathlib import Path

from quorumq.raft.journal import DurableJournal


def _fill(j: DurableJournal, first: int, last: int, term: int = 1) -> None:
    for i in range(first, last + 1):
        j.add(b"cmd-%d" % i, i, term)


def test_entries_survive_reopen(tmp_path: Path) -> None:
    path = str(tmp_path / "raft.log")
    j = DurableJournal(path)
    _fill(j, 1, 5)
    j.sync()
    j._destroy()
    again = DurableJournal(path)
    assert list(again[:]) == [(b"cmd-%d" % i, i, 1) for i in range(1, 6)]
    assert again.last_index_at_open == 5


def test_torn_tail_is_cut_and_earlier_entries_kept(tmp_path: Path) -> None:
    path = str(tmp_path / "raft.log")
    j = DurableJournal(path)
    _fill(j, 1, 3)
    j._destroy()
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 3)  # the last record lost its last bytes
    again = DurableJournal(path)
    assert [e[1] for e in again[:]] == [1, 2]
    again.add(b"next", 3, 2)
    again._destroy()
    assert [e[1:] for e in DurableJournal(path)[:]] == [(1, 1), (2, 1), (3, 2)]


def test_corrupt_record_ends_the_journal(tmp_path: Path) -> None:
    path = str(tmp_path / "raft.log")
    j = DurableJournal(path)
    _fill(j, 1, 3)
    j._destroy()
    data = bytearray(Path(path).read_bytes())
    data[-2] ^= 0xFF  # flip a bit in the last command
    Path(path).write_bytes(bytes(data))
    assert [e[1] for e in DurableJournal(path)[:]] == [1, 2]


def test_delete_from_truncates_on_disk(tmp_path: Path) -> None:
    path = str(tmp_path / "raft.log")
    j = DurableJournal(path)
    _fill(j, 1, 5)
    j.deleteEntriesFrom(2)
    j.add(b"new", 3, 2)
    j._destroy()
    assert [e[1:] for e in DurableJournal(path)[:]] == [(1, 1), (2, 1), (3, 2)]


def test_compaction_keeps_the_tail_and_reopens(tmp_path: Path) -> None:
    path = str(tmp_path / "raft.log")
    j = DurableJournal(path)
    _fill(j, 1, 10)
    j.deleteEntriesTo(8)
    assert [e[1] for e in j[:]] == [9, 10]
    j.add(b"x", 11, 1)
    j.deleteEntriesFrom(2)
    j._destroy()
    assert [e[1] for e in DurableJournal(path)[:]] == [9, 10]
    assert not os.path.exists(path + ".tmp")


def test_term_and_vote_are_stored_at_once(tmp_path: Path) -> None:
    path = str(tmp_path / "raft.log")
    j = DurableJournal(path)
    j.setCurrentTerm(7, "127.0.0.1:9000")
    # no _destroy: a crash right after voting must not forget the vote
    again = DurableJournal(path)
    assert (again.getCurrentTerm(), again.getVotedForNodeId()) == (7, "127.0.0.1:9000")


def test_commit_index_is_stored_lazily(tmp_path: Path) -> None:
    path = str(tmp_path / "raft.log")
    j = DurableJournal(path)
    j.setRaftCommitIndex(42)
    assert DurableJournal(path).getRaftCommitIndex() == 1
    j.onOneSecondTimer()
    assert DurableJournal(path).getRaftCommitIndex() == 42


def test_replay_boundary_is_the_end_at_open_and_drops_where_an_entry_is_replaced(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "raft.log")
    j = DurableJournal(path)
    _fill(j, 1, 8)
    j._destroy()
    again = DurableJournal(path)
    assert again.replay_until == 8  # entries 1-8 were on disk before this process
    again.deleteEntriesFrom(3)  # PySyncObj deletes and adds back the same entries ...
    _fill(again, 4, 5)
    assert again.replay_until == 8  # ... which stay replayed
    again.deleteEntriesFrom(5)  # a new leader's log replaces index 6 on
    _fill(again, 6, 10, term=2)
    assert again.replay_until == 5  # 6-10 are new entries, not a replay
    again.clear()  # a snapshot install, then the leader's entries: the same ones stay
    _fill(again, 4, 5)
    assert again.replay_until == 5
