"""A durable Raft journal for PySyncObj: checksummed records, fsync when asked, atomic rewrites.

PySyncObj's `FileJournal` writes through mmap with no fsync and no checksum, and
compacts by rewriting the file in place. This journal keeps PySyncObj's interface
(entries are `(command, idx, term)` tuples addressed by position) on a file of our own:

    b"QQJ1" then records: [u32 body length][u32 crc32(body)][body]
    body = [u64 idx][u64 term][command bytes]

Writes go to the page cache at once; `sync()` makes them durable (`fdatasync`). The
replica calls it before a follower acknowledges entries and before a leader counts its
own copy toward commit. Compaction writes a new file, fsyncs it, renames it over the old
one and fsyncs the directory. Term, vote and commit index live in `<path>.meta`,
replaced the same way, synchronously for term and vote (Raft needs them durable before
any vote is sent).

What opening tells apart:

* a torn tail: the last record runs past the end of the file, or the file ends in
  zeros (a crash while appending). Those bytes were never synced, so never
  acknowledged: they are cut off.
* damage: a record that fails its CRC with an intact record after it, or (when every
  acknowledged entry was synced first, `strict`) any bad record that is not a torn
  tail, or a log that ends below the commit index this node recorded. Cutting there
  would delete entries this node acknowledged, and a node that then votes as if its log
  were short can let a lagging candidate overwrite committed entries. Opening refuses
  (`JournalDamagedError`, naming the file, the offset and the way out); it never
  shortens the log below what the node acknowledged.

A write that fails or writes short, or an `fdatasync` that fails, breaks the journal
for good (`JournalFailedError` from then on, on every write and sync): nothing after a
gap may be acknowledged, and on Linux a retried `fdatasync` can report success for
pages it lost (PostgreSQL's fsync lesson), so the node must stop, never retry.
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


class JournalDamagedError(Exception):
    """The journal on disk lost entries this node may have acknowledged: refuse to start."""


class JournalFailedError(Exception):
    """A write or sync failed: this journal accepts nothing more (the node must stop)."""


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


def _parse(data: bytes, pos: int) -> tuple[Entry, int] | None:
    """The intact record at `pos` and the offset past it, or None."""
    if pos + _HEAD.size > len(data):
        return None
    length, crc = _HEAD.unpack_from(data, pos)
    end = pos + _HEAD.size + length
    if length < _ENTRY.size or end > len(data):
        return None
    body = data[pos + _HEAD.size : end]
    if zlib.crc32(body) != crc:
        return None
    idx, term = _ENTRY.unpack_from(body)
    return (body[_ENTRY.size :], idx, term), end


def _next_intact(data: bytes, start: int, last: int) -> tuple[int, int] | None:
    """(offset, index) of the first intact record at or after `start` whose index follows
    `last`: a record that survived damage before it. Cheap tests first (the length fits,
    the index is plausible), the CRC last."""
    limit = len(data) - _HEAD.size - _ENTRY.size
    for pos in range(start, limit + 1):
        length = int.from_bytes(data[pos : pos + 4], "little")
        if length < _ENTRY.size or pos + _HEAD.size + length > len(data):
            continue
        idx = int.from_bytes(data[pos + _HEAD.size : pos + _HEAD.size + 8], "little")
        if not last < idx <= last + len(data):
            continue
        parsed = _parse(data, pos)
        if parsed is not None:
            return pos, parsed[0][1]
    return None


def _torn(data: bytes, pos: int) -> bool:
    """What follows `pos` is what a crash while appending leaves: a record that runs past
    the end of the file, or zeros (the file grew, its data never came)."""
    rest = data[pos:]
    if not rest.strip(b"\0"):
        return True
    if len(rest) < _HEAD.size:
        return True
    length = int.from_bytes(rest[:4], "little")
    return _HEAD.size + length > len(rest)


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

    def __init__(self, path: str, *, durable: bool = True, strict: bool | None = None) -> None:
        """`durable`: sync at all. `strict`: every acknowledged entry was synced first
        (`fsync=always`), so any loss below the recorded commit index is damage; by
        default the same as `durable`. Not strict, a short log is cut and the commit
        index clamped to its end (`fsync=batch` acknowledges before syncing)."""
        self.path = path
        self.durable = durable
        self.strict = durable if strict is None else strict
        self.failed: BaseException | None = None
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
            raise JournalDamagedError(f"{self.path} is not a quorumq journal")
        pos = 4
        while pos + _HEAD.size <= len(data):
            entry = _parse(data, pos)
            if entry is None:
                break
            self._entries.append(entry[0])
            pos = entry[1]
            self._ends.append(pos)
        if pos != len(data):
            self._check_cut(data, pos)
        self._check_commit_index()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        if pos != len(data):
            logger.warning(
                "%s: cutting a torn tail of %d bytes after entry %d",
                self.path,
                len(data) - pos,
                self._last_index(),
            )
            os.ftruncate(fd, pos)
            if self.durable:
                os.fsync(fd)
        return fd

    def _last_index(self) -> int:
        return self._entries[-1][1] if self._entries else 0

    def _check_cut(self, data: bytes, pos: int) -> None:
        """Refuse to cut at `pos` unless what follows is a torn tail."""
        last = self._last_index()
        after = _next_intact(data, pos + 1, last)
        if after is not None:
            raise self._damaged(
                f"a corrupt record at byte {pos} (after entry {last}) is followed by an "
                f"intact one at byte {after[0]} (entry {after[1]})"
            )
        if self.strict and not _torn(data, pos):
            raise self._damaged(
                f"the record at byte {pos} (after entry {last}) fails its checksum but is "
                "complete: it was written whole, so it may have been acknowledged"
            )

    def _check_commit_index(self) -> None:
        recorded = self._meta.get("commit_index")
        last = self._last_index()
        if not isinstance(recorded, int) or recorded <= last:
            return
        if self.strict:
            raise self._damaged(
                f"the log ends at entry {last}, but this node recorded commit index {recorded}"
            )
        logger.warning(
            "%s: commit index %d is past the log's end %d (entries written but not synced "
            "before a crash); clamping it to %d",
            self.path,
            recorded,
            last,
            last,
        )
        self._meta["commit_index"] = last
        self._store_meta()

    def _damaged(self, what: str) -> JournalDamagedError:
        return JournalDamagedError(
            f"{self.path}: {what}. The journal lost entries this node may have acknowledged; "
            "starting would let the cluster lose committed messages, so the node refuses. "
            "Keep the file for inspection. To bring the node back, remove it from the "
            "cluster (`quorumq members remove`), move its data directory away, and add it "
            "again empty (it catches up from the leader)."
        )

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
        if hasattr(self, "_fd"):
            # The commit index stored must never be ahead of the entries on disk (a
            # strict journal that ends below it refuses to open).
            self.sync()
        write_atomically(self.path + ".meta", encoding.encode(self._meta), durable=self.durable)
        self._meta_dirty = False

    def sync(self) -> None:
        """Make every entry written so far durable; a failure breaks the journal for good."""
        self._check_usable()
        if self._dirty:
            if self.durable:
                try:
                    os.fdatasync(self._fd)
                except OSError as e:
                    raise self._fail("fdatasync", e) from e
            self._dirty = False

    def _check_usable(self) -> None:
        if self.failed is not None:
            raise JournalFailedError(f"{self.path}: unusable since {self.failed}")

    def _fail(self, what: str, error: BaseException) -> JournalFailedError:
        self.failed = error
        logger.critical(
            "%s: %s failed (%s); the journal accepts nothing more and the node must stop "
            "(a retried fdatasync may report success for lost writes)",
            self.path,
            what,
            error,
        )
        return JournalFailedError(f"{self.path}: {what} failed: {error}")

    def _write(self, data: bytes) -> None:
        """All of `data`, or `JournalFailedError` (a short write is never left unnoticed)."""
        self._check_usable()
        view = memoryview(data)
        try:
            while view:
                written = os.write(self._fd, view)
                if written <= 0:
                    raise OSError(f"write returned {written}")
                view = view[written:]
        except OSError as e:
            raise self._fail("write", e) from e

    def _truncate(self, size: int) -> None:
        self._check_usable()
        try:
            os.ftruncate(self._fd, size)
        except OSError as e:
            raise self._fail("truncate", e) from e

    # ------------------------------------------------------ PySyncObj Journal

    def add(self, command: bytes, idx: int, term: int) -> None:
        entry = (bytes(command), idx, term)
        self._replay.added(idx, term)
        record = _record(entry)
        self._write(record)
        self._entries.append(entry)
        self._ends.append((self._ends[-1] if self._ends else 4) + len(record))
        self._dirty = True

    def clear(self) -> None:
        self._truncate(4)
        self._entries = []
        self._ends = []
        self._dirty = True

    def deleteEntriesFrom(self, entry_from: int) -> None:
        if entry_from >= len(self._entries):
            return
        committed = self._meta.get("commit_index", 0)
        if self._entries[entry_from][1] <= committed:
            raise JournalDamagedError(
                f"{self.path}: refusing to delete entries from "
                f"{self._entries[entry_from][1]}, at or below the commit index {committed}"
            )
        self._truncate(self._ends[entry_from - 1] if entry_from else 4)
        del self._entries[entry_from:]
        del self._ends[entry_from:]
        self._dirty = True

    def deleteEntriesTo(self, entry_to: int) -> None:
        """Compaction: keep entries from `entry_to` on, in a new file swapped in atomically."""
        self._check_usable()
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
        if self.failed is not None:  # nothing more is written, the meta file included
            os.close(self._fd)
            return
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
