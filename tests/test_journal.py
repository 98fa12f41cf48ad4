"""The durable Raft journal: survives reopen, cuts torn tails only, refuses to open a
damaged log, fails for good on a failed write or sync, compacts atomically."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quorumq.raft.journal import DurableJournal, JournalDamagedError, JournalFailedError

_FUZZ_FILES = itertools.count()


def _fill(j: DurableJournal, first: int, last: int, term: int = 1) -> None:
    """Entries `first`..`last` of `term`, the term stored first (as a node stores it
    before it takes in an entry of that term)."""
    if j.getCurrentTerm() < term:
        j.setCurrentTerm(term, None)
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
    again.setCurrentTerm(2, None)
    again.add(b"next", 3, 2)
    again._destroy()
    assert [e[1:] for e in DurableJournal(path)[:]] == [(1, 1), (2, 1), (3, 2)]


def _flip(path: str, at: int) -> bytes:
    data = bytearray(Path(path).read_bytes())
    data[at] ^= 0x10
    Path(path).write_bytes(bytes(data))
    return bytes(data)


def test_a_corrupt_record_with_intact_ones_after_it_refuses_to_open_and_keeps_the_file(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "raft.log")
    j = DurableJournal(path, durable=False, strict=False)  # even where syncs are lax
    _fill(j, 1, 200)
    j._destroy()
    damaged = _flip(path, os.path.getsize(path) // 2)
    with pytest.raises(JournalDamagedError, match="followed by an intact one") as e:
        DurableJournal(path, durable=False, strict=False)
    assert "members remove" in str(e.value)  # says the way out
    assert Path(path).read_bytes() == damaged  # nothing after the damage was deleted


def test_a_complete_last_record_that_fails_its_checksum_refuses_to_open_when_strict(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "raft.log")
    j = DurableJournal(path)
    _fill(j, 1, 3)
    j._destroy()
    _flip(path, os.path.getsize(path) - 2)  # the last command: synced, maybe acknowledged
    with pytest.raises(JournalDamagedError, match="complete"):
        DurableJournal(path)
    # with fsync=batch it may never have been synced: cut, as a torn tail
    assert [e[1] for e in DurableJournal(path, strict=False)[:]] == [1, 2]


def test_a_tail_of_zeros_is_a_torn_write_and_is_cut(tmp_path: Path) -> None:
    path = str(tmp_path / "raft.log")
    j = DurableJournal(path)
    _fill(j, 1, 3)
    j._destroy()
    with open(path, "ab") as f:
        f.write(bytes(300))  # the file grew, its data never came
    assert [e[1] for e in DurableJournal(path)[:]] == [1, 2, 3]


def test_a_log_that_ends_below_the_stored_commit_index_refuses_to_open_when_strict(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "raft.log")
    j = DurableJournal(path)
    _fill(j, 1, 10)
    j.setRaftCommitIndex(10)
    j._destroy()
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[: len(data) - 20])  # entry 10 torn away
    with pytest.raises(JournalDamagedError, match="commit index 10"):
        DurableJournal(path)


def test_a_commit_index_past_the_end_is_clamped_when_not_strict(tmp_path: Path) -> None:
    path = str(tmp_path / "raft.log")
    j = DurableJournal(path, strict=False)
    _fill(j, 1, 10)
    j.setRaftCommitIndex(10)
    j._destroy()
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[: len(data) - 20])  # fsync=batch, power lost: 10 gone
    again = DurableJournal(path, strict=False)
    assert again.getRaftCommitIndex() == 9  # an elected node never applies what it lacks
    assert DurableJournal(path, strict=False).getRaftCommitIndex() == 9


def test_the_stored_commit_index_never_runs_ahead_of_synced_entries(tmp_path: Path) -> None:
    path = str(tmp_path / "raft.log")
    j = DurableJournal(path)
    _fill(j, 1, 5)  # written, not yet synced
    j.setRaftCommitIndex(5)
    j.onOneSecondTimer()  # stores the commit index: syncs the entries first
    assert not j._dirty


def test_an_unchanged_commit_index_is_not_stored_again(tmp_path: Path) -> None:
    """Every heartbeat sets the commit index; an idle node rewrote its meta file (a
    temporary file, two fsyncs and a rename) every second for the same value (issue 32:
    idle CPU). The journal's files show whether it was written."""
    path = str(tmp_path / "raft.log")
    j = DurableJournal(path)
    _fill(j, 1, 5)
    j.setRaftCommitIndex(5)
    j.onOneSecondTimer()
    stored = Path(path + ".meta").stat().st_ino  # a store renames a new file over it
    for _ in range(3):
        j.setRaftCommitIndex(5)
        assert not j._meta_dirty
        j.onOneSecondTimer()
    assert Path(path + ".meta").stat().st_ino == stored
    j.setRaftCommitIndex(4)  # down and back up before the timer (a snapshot install)
    j.setRaftCommitIndex(5)
    j.onOneSecondTimer()
    j._destroy()
    assert DurableJournal(path).getRaftCommitIndex() == 5


def test_deleting_committed_entries_is_refused(tmp_path: Path) -> None:
    j = DurableJournal(str(tmp_path / "raft.log"))
    _fill(j, 1, 5)
    j.setRaftCommitIndex(3)
    with pytest.raises(JournalDamagedError, match="commit index 3"):
        j.deleteEntriesFrom(2)  # position 2 is entry 3
    j.deleteEntriesFrom(3)  # entries 4 and 5 are not committed: a conflict may cut them
    assert [e[1] for e in j[:]] == [1, 2, 3]


def test_a_failed_write_breaks_the_journal_for_good(tmp_path: Path) -> None:
    j = DurableJournal(str(tmp_path / "raft.log"))
    _fill(j, 1, 2)
    j.sync()
    real = j._fd
    j._fd = os.open("/dev/full", os.O_WRONLY)  # every write: ENOSPC
    with pytest.raises(JournalFailedError, match="write failed"):
        j.add(b"three", 3, 1)
    os.close(j._fd)
    j._fd = real  # the disk has room again: still nothing is accepted
    with pytest.raises(JournalFailedError):
        j.add(b"three", 3, 1)
    with pytest.raises(JournalFailedError):
        j.sync()
    assert len(j) == 2
    j._destroy()


def test_a_short_write_is_never_left_unnoticed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from quorumq.raft import journal

    j = DurableJournal(str(tmp_path / "raft.log"))
    _fill(j, 1, 2)
    real_write = os.write
    calls = []

    def short_then_enospc(fd: int, data: bytes) -> int:  # as a filling disk does
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(fd, bytes(data)[: len(data) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(journal.os, "write", short_then_enospc)
    with pytest.raises(JournalFailedError):
        j.add(b"three" * 10, 3, 1)
    monkeypatch.undo()
    assert len(calls) == 2  # the rest of the record was tried, not dropped
    with pytest.raises(JournalFailedError):
        j.add(b"four", 4, 1)  # nothing goes on past the gap
    j._destroy()
    # at restart the half record is a torn tail, never acknowledged: cut
    assert [e[1] for e in DurableJournal(j.path)[:]] == [1, 2]


def test_a_failed_fdatasync_is_never_retried(tmp_path: Path) -> None:
    j = DurableJournal(str(tmp_path / "raft.log"))
    _fill(j, 1, 2)
    real = j._fd
    read_end, write_end = os.pipe()
    j._fd = write_end  # fdatasync on a pipe fails (EINVAL)
    with pytest.raises(JournalFailedError, match="fdatasync failed"):
        j.sync()
    j._fd = real
    with pytest.raises(JournalFailedError):
        j.sync()  # a retry could report success for pages that were lost
    os.close(read_end)
    os.close(write_end)
    j._destroy()


_FAULTS = st.one_of(
    st.tuples(st.just("flip"), st.floats(0, 1), st.integers(0, 7)),
    st.tuples(st.just("truncate"), st.floats(0, 1), st.just(0)),
    st.tuples(st.just("zeros"), st.integers(1, 600), st.just(0)),
    st.tuples(st.just("last_page"), st.just(0), st.just(0)),
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    bodies=st.lists(st.binary(max_size=300), min_size=1, max_size=30),
    committed=st.floats(0, 1),
    fault=_FAULTS,
    strict=st.booleans(),
)
def test_one_fault_anywhere_never_silently_loses_a_committed_entry(
    tmp_path: Path,
    bodies: list[bytes],
    committed: float,
    fault: tuple[str, float, int],
    strict: bool,
) -> None:
    """Whatever one flipped bit, one truncation or a tail of zeros does to the file,
    opening either refuses or gives a prefix of the log that holds every entry up to the
    stored commit index (strict: every synced entry)."""
    path = str(tmp_path / f"fuzz-{next(_FUZZ_FILES)}.log")  # (drawn data only: replayable)
    j = DurableJournal(path, strict=strict)
    j.setCurrentTerm(1, None)
    entries = [(body, i + 1, 1) for i, body in enumerate(bodies)]
    for entry in entries:
        j.add(*entry)
    commit = round(committed * len(entries))
    j.setRaftCommitIndex(commit)
    ends = list(j._ends)
    j._destroy()
    data = bytearray(Path(path).read_bytes())
    kind, where, bit = fault
    flipped_record = None
    if kind == "flip":
        at = min(int(where * len(data)), len(data) - 1)
        data[at] ^= 1 << bit
        flipped_record = sum(1 for end in ends if end <= at)
    elif kind == "truncate":
        del data[int(where * len(data)) :]
    elif kind == "last_page":  # the file's last page reads back as zeros
        page = (len(data) - 1) // 4096 * 4096
        data[page:] = bytes(len(data) - page)
    else:
        data += bytes(int(where))
    Path(path).write_bytes(bytes(data))
    try:
        opened = list(DurableJournal(path, strict=strict)[:])
    except JournalDamagedError:
        # refusing is right for damage, never for a tail of zeros after the last record
        # (a file system's preallocation after a crash): a journal that refused every
        # file passed this test
        assert kind != "zeros", "a tail of zeros made the journal refuse to open"
        return
    assert opened == entries[: len(opened)]  # a prefix, never other entries
    if strict:
        assert len(opened) >= commit
        assert kind != "flip", "a flipped bit in a strict journal must refuse to open"
    elif flipped_record is not None:
        assert flipped_record == len(entries) - 1, "intact records after a bad one were cut"


def test_delete_from_truncates_on_disk(tmp_path: Path) -> None:
    path = str(tmp_path / "raft.log")
    j = DurableJournal(path)
    _fill(j, 1, 5)
    j.deleteEntriesFrom(2)
    j.setCurrentTerm(2, None)
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
    _fill(j, 1, 42)
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


# --------------------------------------------- the second hostile read (issue 14)


def test_a_flip_in_the_last_records_length_refuses_to_open_when_strict(tmp_path: Path) -> None:
    """The length ran past the end of the file, and the last record, synced and maybe
    acknowledged, was cut as a torn tail; its header now has a checksum of its own."""
    path = str(tmp_path / "raft.log")
    j = DurableJournal(path)
    _fill(j, 1, 5)
    last_record = j._ends[-2]
    j._destroy()
    _flip(path, last_record + 3)  # the length's high byte
    with pytest.raises(JournalDamagedError, match="not a torn write"):
        DurableJournal(path)


def test_a_last_record_ending_in_zeros_is_a_torn_write(tmp_path: Path) -> None:
    """A crash while appending a record longer than a page may leave its later pages
    zero: never synced, never acknowledged, cut. (Media damage that zeros exactly the
    end of the last record looks the same: the one case a strict journal cannot tell.)"""
    path = str(tmp_path / "raft.log")
    j = DurableJournal(path)
    _fill(j, 1, 2)
    j.add(os.urandom(10_000), 3, 1)
    j._destroy()
    data = bytearray(Path(path).read_bytes())
    data[-4096:] = bytes(4096)
    Path(path).write_bytes(bytes(data))
    assert [e[1] for e in DurableJournal(path)[:]] == [1, 2]


def test_a_body_holding_a_whole_record_is_not_taken_for_one(tmp_path: Path) -> None:
    """A client's message body that holds the bytes of a valid-looking record, in a torn
    last record, made opening see "an intact record after a corrupt one" and refuse to
    start after an ordinary crash. Records are checksummed with the file's own salt."""
    from quorumq.raft import journal

    path = str(tmp_path / "raft.log")
    j = DurableJournal(path)
    _fill(j, 1, 2)
    # what a client can forge: records checksummed without the salt, or with a guess
    forged = journal.entry_record((b"forged", 4, 1), 0) + journal.entry_record(
        (b"forged", 4, 1), 12345
    )
    j.add(b"x" * 100 + forged + b"y" * 100, 3, 1)
    j._destroy()
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[:-50])  # the crash tore the record holding them
    assert [e[1] for e in DurableJournal(path)[:]] == [1, 2]


def test_a_damaged_or_missing_meta_file_refuses_to_open(tmp_path: Path) -> None:
    """A flipped byte made another valid term (5 -> 1) with the vote kept, and a missing
    meta file opened at term 0 with no vote: the node could vote twice in one term."""
    path = str(tmp_path / "raft.log")
    j = DurableJournal(path)
    _fill(j, 1, 3, term=5)
    j.setCurrentTerm(5, "B")
    j._destroy()
    meta = Path(path + ".meta")
    good = meta.read_bytes()
    _flip(str(meta), len(good) - 3)
    with pytest.raises(JournalDamagedError, match=r"meta file .* checksum"):
        DurableJournal(path)
    meta.unlink()
    with pytest.raises(JournalDamagedError, match=r"meta file .* missing"):
        DurableJournal(path)
    meta.write_bytes(good)
    Path(path).unlink()
    with pytest.raises(JournalDamagedError, match="journal is missing"):
        DurableJournal(path)


def test_a_failed_directory_sync_in_compaction_breaks_the_journal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rename had happened, the directory sync failed, and every later append went to
    the old, unlinked file: acknowledged, and gone at the next start."""
    from quorumq.raft.files import OsFiles

    path = str(tmp_path / "raft.log")
    j = DurableJournal(path)
    _fill(j, 1, 10)
    j.sync()

    def eio(self: OsFiles, path: str) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(OsFiles, "sync_directory", eio)
    with pytest.raises(JournalFailedError, match="rewriting"):
        j.deleteEntriesTo(5)
    monkeypatch.undo()
    with pytest.raises(JournalFailedError):
        j.add(b"cmd-11", 11, 1)
    j._destroy()


def test_a_snapshot_install_replaces_the_file_whole_at_the_next_sync(tmp_path: Path) -> None:
    """`clear()` truncated the file at once and the kept entries were added back unsynced:
    a power loss in between lost entries the node had acknowledged. Until the next sync
    the file holds the old log; after it, the new one, whole."""
    path = str(tmp_path / "raft.log")
    j = DurableJournal(path)
    _fill(j, 1, 10)
    j.sync()
    before = Path(path).read_bytes()
    j.clear()
    for i in (7, 8, 9, 10):
        j.add(b"cmd-%d" % i, i, 1)
    assert Path(path).read_bytes() == before  # a crash now finds the old log
    j.sync()
    j._destroy()
    assert [e[1] for e in DurableJournal(path)[:]] == [7, 8, 9, 10]


def test_a_first_format_journal_is_read_and_rewritten(tmp_path: Path) -> None:
    import struct
    import zlib

    from quorumq.machine import encoding

    path = tmp_path / "raft.log"
    records = b""
    for i in range(1, 4):
        body = struct.pack("<QQ", i, 1) + b"cmd-%d" % i
        records += struct.pack("<II", len(body), zlib.crc32(body)) + body
    path.write_bytes(b"QQJ1" + records)
    Path(str(path) + ".meta").write_bytes(encoding.encode({"term": 1, "voted_for": None}))
    j = DurableJournal(str(path))
    assert list(j[:]) == [(b"cmd-%d" % i, i, 1) for i in range(1, 4)]
    assert path.read_bytes()[:4] == b"QQJ2"
    j.onOneSecondTimer()  # the meta file gets its checksum, even on an idle node
    assert Path(str(path) + ".meta").read_bytes()[:4] == b"QQM1"
    assert DurableJournal(str(path)).getCurrentTerm() == 1
    j.add(b"cmd-4", 4, 1)
    j._destroy()
    assert [e[1] for e in DurableJournal(str(path))[:]] == [1, 2, 3, 4]


def test_a_torn_page_inside_a_record_with_zeros_after_it_is_a_torn_write() -> None:
    """A torn power loss kept part of the unsynced tail, and its last page came back as
    zeros from inside a record whose header is whole, with zeros past the record's end
    (what followed it in that page). A strict journal refused to open: a node that
    could not restart after an ordinary power loss (found by a review's fuzzer)."""
    import random
    import struct

    from quorumq.raft.journal import PAGE, RECORDS_START
    from simulations.disk import SimFiles

    files = SimFiles(random.Random(1))
    j = DurableJournal("/n/raft.log", files=files)
    j.setCurrentTerm(1, None)
    j.add(b"a" * 100, 1, 1)
    j.sync()
    for i in range(2, 40):
        j.add(bytes([i]) * 300, i, 1)  # never synced
    files.crash()
    files.names = dict(files.synced_names)
    f = files.names["/n/raft.log"]
    data, synced = bytes(f.data), len(f.synced)
    pos = RECORDS_START
    while True:  # the first unsynced record whose body crosses a page boundary
        end = pos + 28 + struct.unpack_from("<I", data, pos)[0]
        boundary = (end - 1) // PAGE * PAGE
        if pos >= synced and pos + 28 <= boundary < end:
            break
        pos = end
    kept = bytearray(data[synced : end + 20])
    kept[boundary - synced :] = bytes(len(kept) - (boundary - synced))
    f.reset(bytes(f.synced) + bytes(kept))
    opened = [e[1] for e in DurableJournal("/n/raft.log", files=files)[:]]
    assert opened == list(range(1, len(opened) + 1)) and len(opened) >= 1
