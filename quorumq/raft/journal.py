"""A durable Raft journal for PySyncObj: checksummed records, fsync when asked, atomic rewrites.

PySyncObj's `FileJournal` writes through mmap with no fsync and no checksum, and
compacts by rewriting the file in place. This journal keeps PySyncObj's interface
(entries are `(command, idx, term)` tuples addressed by position) on a file of our own:

    b"QQJ1" then records: [u32 body length][u32 crc32(body)][body]
    body = [u64 idx][u64 term][command bytes]

Writes go to the page cache at once; `sync()` makes them durable (`fdatasync`). The
replica calls it before a follower acknowledges entries and before a leader counts its
own copy toward commit. On open, a torn or corrupt tail (a crash mid-write) is cut
off: those entries were never acknowledged. Compaction writes a new file, fsyncs it,
renames it over the old one and fsyncs the directory. Term, vote and commit index live
in `<path>.meta`, replaced the same way, synchronously for term and vote (Raft needs
them durable before any vote is sent).
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from typing import Any

from ..machine import encoding

logger = logging.getLogger(__name__)

_MAGIC = b"QQJ1"
_HEAD = struct.Struct("<II")
_ENTRY = struct.Struct("<QQ")

Entry = tuple[bytes, int, int]


def fsync_directory(path: str) -> None:
    fd = os.open(path or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: str, data: bytes, *, durable: bool = True) -> None:
    """Replace `path` with `data` so that a crash leaves the old or the new file, whole."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        if durable:
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if durable:
        fsync_directory(os.path.dirname(path))


def _record(entry: Entry) -> bytes:
    command, idx, term = entry
    body = _ENTRY.pack(idx, term) + command
    return _HEAD.pack(len(body), zlib.crc32(body)) + body


class ReplayBoundary:
    """Which entries applied by this process are replayed from its own journal.

    Those on disk when the process started, as long as they are still the same entries
    (same index and term: Raft's log matching). A node that led while cut off can hold
    an uncommitted tail that the new leader's log replaces: an entry added in place of
    one of another term is new, and so is every entry after it. (PySyncObj also deletes
    and adds back identical entries, on a stale reset or a snapshot install: those stay
    replayed.) Entries below the first index on disk at start-up were compacted into the
    snapshot, so they were committed: the same."""

    def __init__(self, entries: list[Entry]) -> None:
        self.first = entries[0][1] if entries else 0
        self.terms = [term for _, _, term in entries]
        self.until = entries[-1][1] if entries else 0
        """Entries up to this index are replayed."""

    def added(self, idx: int, term: int) -> None:
        """The journal got entry (idx, term)."""
        pos = idx - self.first
        if idx <= self.until and pos >= 0 and self.terms[pos] != term:
            self.until = idx - 1
            del self.terms[pos:]


class DurableJournal:
    """PySyncObj's Journal interface (duck-typed) on a checksummed, fsynced file."""

    def __init__(self, path: str, *, durable: bool = True) -> None:
        self.path = path
        self.durable = durable
        self._entries: list[Entry] = []
        self._ends: list[int] = []
        """File offset just past each entry's record, for truncation."""
        self._dirty = False
        self._meta: dict[str, Any] = self._load_meta()
        self._meta_dirty = False
        self._fd = self._open()
        self.last_index_at_open = self._entries[-1][1] if self._entries else 0
        self._replay = ReplayBoundary(self._entries)

    @property
    def replay_until(self) -> int:
        """Applying entries up to here is replay: they were on disk before this process
        and are still the same entries (`ReplayBoundary`)."""
        return self._replay.until

    # ------------------------------------------------------------------ files

    def _open(self) -> int:
        if not os.path.exists(self.path):
            write_atomically(self.path, _MAGIC, durable=self.durable)
        with open(self.path, "rb") as f:
            data = f.read()
        if data[:4] != _MAGIC:
            raise ValueError(f"{self.path} is not a quorumq journal")
        pos = 4
        while pos + _HEAD.size <= len(data):
            length, crc = _HEAD.unpack_from(data, pos)
            body = data[pos + _HEAD.size : pos + _HEAD.size + length]
            if len(body) != length or length < _ENTRY.size or zlib.crc32(body) != crc:
                break
            idx, term = _ENTRY.unpack_from(body)
            self._entries.append((body[_ENTRY.size :], idx, term))
            pos += _HEAD.size + length
            self._ends.append(pos)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        if pos != len(data):
            logger.warning(
                "%s: cutting a torn or corrupt tail of %d bytes after entry %d",
                self.path,
                len(data) - pos,
                self._entries[-1][1] if self._entries else 0,
            )
            os.ftruncate(fd, pos)
            if self.durable:
                os.fsync(fd)
        return fd

    def _load_meta(self) -> dict[str, Any]:
        try:
            with open(self.path + ".meta", "rb") as f:
                meta = encoding.decode(f.read())
        except FileNotFoundError:
            return {}
        if not isinstance(meta, dict):
            raise ValueError(f"{self.path}.meta is not a journal meta file")
        return meta

    def _store_meta(self) -> None:
        write_atomically(self.path + ".meta", encoding.encode(self._meta), durable=self.durable)
        self._meta_dirty = False

    def sync(self) -> None:
        """Make every entry written so far durable."""
        if self._dirty:
            if self.durable:
                os.fdatasync(self._fd)
            self._dirty = False

    # ------------------------------------------------------ PySyncObj Journal

    def add(self, command: bytes, idx: int, term: int) -> None:
        entry = (bytes(command), idx, term)
        self._replay.added(idx, term)
        record = _record(entry)
        os.write(self._fd, record)
        self._entries.append(entry)
        self._ends.append((self._ends[-1] if self._ends else 4) + len(record))
        self._dirty = True

    def clear(self) -> None:
        os.ftruncate(self._fd, 4)
        self._entries = []
        self._ends = []
        self._dirty = True

    def deleteEntriesFrom(self, entry_from: int) -> None:
        if entry_from >= len(self._entries):
            return
        os.ftruncate(self._fd, self._ends[entry_from - 1] if entry_from else 4)
        del self._entries[entry_from:]
        del self._ends[entry_from:]
        self._dirty = True

    def deleteEntriesTo(self, entry_to: int) -> None:
        """Compaction: keep entries from `entry_to` on, in a new file swapped in atomically."""
        kept = self._entries[entry_to:]
        records = [_record(e) for e in kept]
        write_atomically(self.path, _MAGIC + b"".join(records), durable=self.durable)
        os.close(self._fd)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        self._entries = kept
        self._ends = []
        end = 4
        for r in records:
            end += len(r)
            self._ends.append(end)
        self._dirty = False

    def __getitem__(self, item: int | slice) -> Any:
        return self._entries[item]

    def __len__(self) -> int:
        return len(self._entries)

    def _destroy(self) -> None:
        self.sync()
        if self._meta_dirty:
            self._store_meta()
        os.close(self._fd)

    def setRaftCommitIndex(self, index: int) -> None:
        self._meta["commit_index"] = index
        self._meta_dirty = True

    def getRaftCommitIndex(self) -> int:
        return int(self._meta.get("commit_index", 1))

    def setCurrentTerm(self, term: int, voted_for: str | None) -> None:
        self._meta["term"] = term
        self._meta["voted_for"] = voted_for
        self._store_meta()

    def getCurrentTerm(self) -> int:
        return int(self._meta.get("term", 0))

    def getVotedForNodeId(self) -> str | None:
        voted: str | None = self._meta.get("voted_for")
        return voted

    def onOneSecondTimer(self) -> None:
        if self._meta_dirty:
            self._store_meta()
