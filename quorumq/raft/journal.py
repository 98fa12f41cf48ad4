"""A durable Raft journal for PySyncObj: checksummed records, fsync when asked, atomic rewrites.

PySyncObj's `FileJournal` writes through mmap with no fsync and no checksum, and
compacts by rewriting the file in place. This journal keeps PySyncObj's interface
(entries are `(command, idx, term)` tuples addressed by position) on a file of our own:

    b"QQJ2", 8 random bytes (the salt), u32 crc(the 12 bytes before), then records:
    [u32 length][u64 idx][u64 term][u32 crc(command)][u32 crc(the 24 bytes before)]
    [command: length bytes]

Both checksums are CRC-32 seeded with the salt: a message body that happens to hold the
bytes of a record (a client's, say) is never taken for one, and a record's header is
checked on its own, so a damaged length is told from a record cut short.

Writes go to the page cache at once; `sync()` makes them durable (`fdatasync`). The
replica calls it before a follower acknowledges entries and before a leader counts its
own copy toward commit. Compaction and a snapshot install's reset write a new file,
sync it, rename it over the old one and sync the directory; the journal then appends
to that new file (a failure anywhere on the way breaks the journal, below). Term, vote
and commit index live in `<path>.meta`, checksummed, replaced the same way,
synchronously for term and vote (Raft needs them durable before any vote is sent).

What opening tells apart:

* a torn tail: a header cut short, a record whose body runs past the end of the file,
  or zeros where the rest of the last record (or the file) should be (a crash while
  appending). Those bytes were never synced, so never acknowledged: they are cut off.
* damage: a header or command that fails its checksum with an intact record after it,
  or (when every acknowledged entry was synced first, `strict`) any bad record that is
  not a torn tail, or a log that ends below the commit index this node recorded, or a
  meta file that is missing or fails its checksum while the journal holds entries of a
  term. Cutting there would delete entries this node acknowledged; forgetting a term or
  a vote lets it vote twice in one term. Either lets the cluster lose committed
  entries, so opening refuses (`JournalDamagedError`, naming the file, the place and
  the way out); it never shortens the log below what the node acknowledged.

A write that fails or writes short, an `fdatasync` that fails, or a rewrite that fails
after its rename, breaks the journal for good (`JournalFailedError` from then on, on
every write and sync): nothing after a gap may be acknowledged, and on Linux a retried
`fdatasync` can report success for pages it lost (PostgreSQL's fsync lesson), so the
node must stop, never retry.

Journals of the first format (b"QQJ1", no salt, no header checksum) are read once and
rewritten in this one.
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from typing import Any

from ..machine import encoding
from .files import OS_FILES, Files, write_all, write_atomically

logger = logging.getLogger(__name__)

_MAGIC = b"QQJ2"
SALT_BYTES = 8
RECORDS_START = len(_MAGIC) + SALT_BYTES + 4
"""Where the first record starts: after the magic, the salt and their checksum."""
_HEAD = struct.Struct("<IQQII")
"""length, idx, term, crc(command), crc(the four fields before)."""
HEADER_BYTES = _HEAD.size
"""A record's header, before its command."""
_CHECKED = _HEAD.size - 4
MAX_ENTRY_BYTES = 16 * 1024 * 1024
"""No entry of ours is longer (commands are at most 3 MiB): a longer length is damage."""
PAGE = 4096
"""A crash while appending may leave the file's last page zeros."""
FIND_INTACT_AFTER = 1024
"""How many entries past a damaged one opening looks for an intact record."""

_LEGACY_MAGIC = b"QQJ1"
_LEGACY_HEAD = struct.Struct("<II")
_LEGACY_ENTRY = struct.Struct("<QQ")

_META_MAGIC = b"QQM1"

Entry = tuple[bytes, int, int]
NO_OP_PREFIX = bytes([1])
"""PySyncObj's no-op command type (`_COMMAND_TYPE.NO_OP`), applied as nothing by it: a
new leader's first entry of its term, and the cluster's identity (`cluster_identity`)."""


class JournalDamagedError(Exception):
    """The journal on disk lost entries this node may have acknowledged: refuse to start."""


class JournalFailedError(Exception):
    """A write or sync failed: this journal accepts nothing more (the node must stop)."""


def fsync_directory(path: str) -> None:
    OS_FILES.sync_directory(path)


def failed_for_good(where: str, thing: str, what: str, error: BaseException) -> JournalFailedError:
    """Log that `what` failed on `thing` at `where`, which accepts nothing more from
    now on; the error to raise."""
    logger.critical(
        "%s: %s failed (%s); %s accepts nothing more and the node must stop (a retried "
        "fdatasync may report success for lost writes)",
        where,
        what,
        error,
        thing,
    )
    return JournalFailedError(f"{where}: {what} failed: {error}")


def damaged(path: str, what: str) -> JournalDamagedError:
    """The refusal to start, with the way out."""
    return JournalDamagedError(
        f"{path}: {what}. The journal lost entries this node may have acknowledged; "
        "starting would let the cluster lose committed messages, so the node refuses. "
        "Keep the file for inspection. To bring the node back, remove it from the "
        "cluster (`quorumq members remove`), move its data directory away, and add it "
        "again empty at a new Raft address (it catches up from the leader; at its old "
        "address, a member that missed its removal could count the empty node's vote)."
    )


# -------------------------------------------------------------------- records


def entry_record(entry: Entry, seed: int) -> bytes:
    command, idx, term = entry
    fields = struct.pack("<IQQI", len(command), idx, term, zlib.crc32(command, seed))
    return fields + struct.pack("<I", zlib.crc32(fields, seed)) + command


def crc_bytes(data: bytes) -> bytes:
    return zlib.crc32(data).to_bytes(4, "little")


def _header(data: bytes, pos: int, seed: int) -> tuple[int, int, int, int] | None:
    """(length, idx, term, command crc) of the record header at `pos` if it is intact."""
    if pos + _HEAD.size > len(data):
        return None
    length, idx, term, crc, head_crc = _HEAD.unpack_from(data, pos)
    if zlib.crc32(data[pos : pos + _CHECKED], seed) != head_crc or length > MAX_ENTRY_BYTES:
        return None
    return length, idx, term, crc


def parse_entry_record(data: bytes, pos: int, seed: int) -> tuple[Entry, int] | None:
    """The intact record at `pos` and the offset past it, or None."""
    header = _header(data, pos, seed)
    if header is None:
        return None
    length, idx, term, crc = header
    start = pos + _HEAD.size
    end = start + length
    if end > len(data):
        return None
    command = data[start:end]
    if zlib.crc32(command, seed) != crc:
        return None
    return (command, idx, term), end


def next_intact_record(data: bytes, start: int, last: int, seed: int) -> tuple[int, int] | None:
    """(offset, index) of the first intact record at or after `start` whose index is
    among the next `FIND_INTACT_AFTER` after `last`: a record that survived damage
    before it. Found by its index's bytes (`bytes.find`), then both checksums."""
    for idx in range(last + 1, last + 1 + FIND_INTACT_AFTER):
        pattern = idx.to_bytes(8, "little")
        found = data.find(pattern, start + 4)
        while found != -1:
            pos = found - 4
            parsed = parse_entry_record(data, pos, seed)
            if parsed is not None and parsed[0][1] == idx:
                return pos, idx
            found = data.find(pattern, found + 1)
    return None


def torn_at(data: bytes, pos: int, seed: int) -> bool:
    """What follows `pos` is what a crash while appending leaves: a header cut short, a
    record that runs past the end of the file, zeros (the file grew, its data never
    came), or the file's last page come back as zeros from inside the record at `pos`
    on (a header or a command written in part, and whatever the write kept after it)."""
    rest = data[pos:]
    if len(rest) < _HEAD.size or not rest.strip(b"\0"):
        return True
    header = _header(data, pos, seed)
    if header is None:
        last_page = max(pos, (len(data) - 1) // PAGE * PAGE)
        return not data[last_page:].strip(b"\0")
    end = pos + _HEAD.size + header[0]
    if end > len(data):
        return True
    # the file's last page, all zeros, beginning inside this record: it cut the record
    # short (zeros over more pages, or from past the record on, are damage)
    last_page = max(pos, (len(data) - 1) // PAGE * PAGE)
    return last_page < end and not data[last_page:].strip(b"\0")


def _legacy_entries(data: bytes) -> tuple[list[Entry], int]:
    """A first-format journal's intact records and where they stop."""
    entries: list[Entry] = []
    pos = len(_LEGACY_MAGIC)
    while pos + _LEGACY_HEAD.size <= len(data):
        length, crc = _LEGACY_HEAD.unpack_from(data, pos)
        end = pos + _LEGACY_HEAD.size + length
        if length < _LEGACY_ENTRY.size or end > len(data):
            break
        body = data[pos + _LEGACY_HEAD.size : end]
        if zlib.crc32(body) != crc:
            break
        idx, term = _LEGACY_ENTRY.unpack_from(body)
        entries.append((body[_LEGACY_ENTRY.size :], idx, term))
        pos = end
    return entries, pos


def decode_meta(data: bytes) -> dict[str, Any]:
    """A meta file's contents (the first format, with no checksum, too); `ValueError`
    saying what is wrong."""
    payload = data  # the first format: no checksum
    if data[:4] == _META_MAGIC:
        crc, payload = int.from_bytes(data[4:8], "little"), data[8:]
        if zlib.crc32(payload) != crc:
            raise ValueError("the meta file (term, vote) fails its checksum")
    try:
        meta = encoding.decode(payload)
    except ValueError as e:
        raise ValueError(f"the meta file cannot be read ({e})") from None
    if not isinstance(meta, dict):
        raise ValueError("the meta file is not a journal meta file")
    return meta


def meta_bytes(meta: dict[str, Any]) -> bytes:
    """A meta file's bytes: magic, CRC-32 of the payload, the payload."""
    payload = encoding.encode(meta)
    return _META_MAGIC + crc_bytes(payload) + payload


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


# -------------------------------------------------------------------- journal


class RaftJournal:
    """What every journal of ours keeps alike: PySyncObj's Journal interface over entries
    held in memory; term, vote and commit index in a checksummed meta file
    (`meta_path`); the no-op that carries the cluster's identity; the replay boundary.
    Subclasses store the entries: `DurableJournal` in a file of its own,
    `wal.GroupJournal` as one group's records in a node's write-ahead log."""

    path: str
    """What messages name (a file, or a group of a write-ahead log)."""
    meta_path: str
    durable: bool
    strict: bool
    files: Files
    _entries: list[Entry]
    _meta: dict[str, Any]
    _meta_dirty: bool
    _replay: ReplayBoundary
    last_index_at_open: int
    _ready = False
    """Opening is over: storing the meta file syncs the entries first."""

    def _begin(
        self, path: str, meta_path: str, durable: bool, strict: bool | None, files: Files
    ) -> bool:
        """Set the common fields and read the meta file; whether there is one."""
        self.path = path
        self.meta_path = meta_path
        self.durable = durable
        self.strict = durable if strict is None else strict
        self.files = files
        self._entries = []
        self._meta, meta_found, unchecked = self._load_meta()
        self._meta_dirty = unchecked
        """A first-format meta file (no checksum) is stored again in the current format at
        the next one-second timer, not only once its commit index changes."""
        return meta_found

    def _opened(self) -> None:
        """The entries on disk are read: where replay ends, which no-op carries a payload."""
        self.last_index_at_open = self._last_index()
        self._replay = ReplayBoundary(self._entries)
        self.carrying_no_op = next(
            (e for e in reversed(self._entries) if e[0][:1] == NO_OP_PREFIX and len(e[0]) > 1), None
        )
        self._ready = True

    next_no_op: bytes | None = None
    """Set by a new leader around PySyncObj's no-op append: the command it writes in
    place of the bare no-op (the cluster's identity, `cluster_identity`)."""
    carrying_no_op: Entry | None = None
    """The last no-op entry of the log that carries a payload (the cluster's identity),
    if the log holds one, or compacted it away since it was opened; None once cut or
    replaced, and None at open if the entries on disk hold none."""

    @property
    def replay_until(self) -> int:
        """Applying entries up to here is replay: they were on disk before this process
        and are still the same entries (`ReplayBoundary`)."""
        return self._replay.until

    def _last_index(self) -> int:
        return self._entries[-1][1] if self._entries else 0

    def _check_meta_for(self, meta_found: bool) -> None:
        """A journal with entries of a term has a meta file: the node stored the term
        (and any vote) before it took in an entry of it."""
        if not meta_found and self._entries and self._entries[-1][2] > 0:
            raise damaged(
                self.path,
                "the meta file (term, vote, commit index) is missing, but the journal holds "
                "entries of a term: the node could vote twice in one term",
            )

    def _check_commit_index(self) -> None:
        recorded = self._meta.get("commit_index")
        last = self._last_index()
        if not isinstance(recorded, int) or recorded <= last:
            return
        if self.strict:
            raise damaged(
                self.path,
                f"the log ends at entry {last}, but this node recorded commit index {recorded}",
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

    def _load_meta(self) -> tuple[dict[str, Any], bool, bool]:
        """The meta file's contents, whether there is one, and whether it is of the
        first format (no checksum)."""
        data = self.files.read(self.meta_path)
        if data is None:
            return {}, False, False
        try:
            meta = decode_meta(data)
        except ValueError as e:
            raise damaged(self.path, str(e)) from None
        return meta, True, data[:4] != _META_MAGIC

    def _store_meta(self) -> None:
        if self._ready:
            # The commit index stored must never be ahead of the entries on disk (a
            # strict journal that ends below it refuses to open).
            self.sync()
        try:
            write_atomically(
                self.files, self.meta_path, meta_bytes(self._meta), durable=self.durable
            )
        except OSError as e:
            raise self._fail("writing the meta file", e) from e
        self._meta_dirty = False

    def _carry(self, command: bytes, idx: int, term: int) -> Entry:
        """The entry to store for `command`: a new leader's bare no-op becomes the one
        that carries the cluster's identity (`next_no_op`)."""
        if command[:1] == NO_OP_PREFIX:
            if self.next_no_op is not None and command == NO_OP_PREFIX:
                command, self.next_no_op = self.next_no_op, None
            if len(command) > 1:
                self.carrying_no_op = (bytes(command), idx, term)
        self._replay.added(idx, term)
        return (bytes(command), idx, term)

    def __getitem__(self, item: int | slice) -> Any:
        return self._entries[item]

    def __len__(self) -> int:
        return len(self._entries)

    def setRaftCommitIndex(self, index: int) -> None:
        if self._meta.get("commit_index") == index:
            return  # every heartbeat sets it: an idle node rewrote and synced its meta each second
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

    def _check_cut_above_commit(self, entry_from: int) -> None:
        """Raft never deletes a committed entry: refuse (and so stop) rather than lose one."""
        committed = self._meta.get("commit_index", 0)
        if self._entries[entry_from][1] <= committed:
            raise JournalDamagedError(
                f"{self.path}: refusing to delete entries from "
                f"{self._entries[entry_from][1]}, at or below the commit index {committed}"
            )

    def _cut_entries(self, entry_from: int) -> None:
        carried = self.carrying_no_op
        if carried is not None and carried[1] >= self._entries[entry_from][1]:
            self.carrying_no_op = None
        del self._entries[entry_from:]

    def sync(self) -> None:
        raise NotImplementedError

    def _fail(self, what: str, error: BaseException) -> JournalFailedError:
        raise NotImplementedError

    def _destroy(self) -> None:
        """PySyncObj's close: sync, store the meta file, close (unless it failed)."""
        raise NotImplementedError

    def usage(self) -> dict[str, Any]:
        """What the journal holds and takes on disk, for status."""
        raise NotImplementedError


class DurableJournal(RaftJournal):
    """PySyncObj's Journal interface (duck-typed) on a checksummed, fsynced file."""

    def __init__(
        self,
        path: str,
        *,
        durable: bool = True,
        strict: bool | None = None,
        files: Files = OS_FILES,
    ) -> None:
        """`durable`: sync at all. `strict`: every acknowledged entry was synced first
        (`fsync=always`), so any loss below the recorded commit index is damage; by
        default the same as `durable`. Not strict, a short log is cut and the commit
        index clamped to its end (`fsync=batch` acknowledges before syncing). `files`:
        where the bytes go (the simulator gives its disk)."""
        self.failed: BaseException | None = None
        self._ends: list[int] = []
        """File offset just past each entry's record, for truncation."""
        self._dirty = False
        self._reset = False
        """The entries were replaced (a snapshot install): the file is rewritten whole,
        atomically, at the next sync, never truncated in place first."""
        meta_found = self._begin(path, path + ".meta", durable, strict, files)
        self._salt = b""
        self._fd = self._open(meta_found)
        self._opened()

    @property
    def _seed(self) -> int:
        return zlib.crc32(self._salt)

    # ------------------------------------------------------------------ files

    def _open(self, meta_found: bool) -> int:
        data = self.files.read(self.path)
        if data is None:
            if meta_found:
                raise damaged(self.path, "the journal is missing but its meta file is not")
            return self._rewrite([])
        if data[:4] == _LEGACY_MAGIC:
            self._entries, pos = _legacy_entries(data)
            if pos != len(data):
                raise damaged(self.path, f"a first-format journal stops being intact at {pos}")
            self._check_meta_for(meta_found)
            self._check_commit_index()
            logger.info("%s: rewriting a first-format journal in the current one", self.path)
            return self._rewrite(self._entries)
        if data[:4] != _MAGIC or len(data) < RECORDS_START:
            raise JournalDamagedError(f"{self.path} is not a quorumq journal")
        if crc_bytes(data[: RECORDS_START - 4]) != data[RECORDS_START - 4 : RECORDS_START]:
            raise damaged(self.path, "its header (the checksums' salt) fails its checksum")
        self._salt = data[4 : RECORDS_START - 4]
        seed = self._seed
        pos = RECORDS_START
        while pos < len(data):
            parsed = parse_entry_record(data, pos, seed)
            if parsed is None or (self._entries and parsed[0][1] != self._entries[-1][1] + 1):
                break
            self._entries.append(parsed[0])
            pos = parsed[1]
            self._ends.append(pos)
        if pos != len(data):
            self._check_cut(data, pos)
        self._check_meta_for(meta_found)
        self._check_commit_index()
        try:
            fd = self.files.open_append(self.path)
            if pos != len(data):
                logger.warning(
                    "%s: cutting a torn tail of %d bytes after entry %d",
                    self.path,
                    len(data) - pos,
                    self._last_index(),
                )
                self.files.truncate(fd, pos)
            if self.durable:
                # a process that crashed may have written entries it never synced: this
                # one must not acknowledge them as if they were durable
                self.files.sync(fd)
        except OSError as e:
            raise self._fail("open", e) from e
        return fd

    def _check_cut(self, data: bytes, pos: int) -> None:
        """Refuse to cut at `pos` unless what follows is a torn tail (or, not strict,
        a record that was maybe never synced, with nothing intact after it)."""
        last = self._last_index()
        after = next_intact_record(data, pos + 1, last, self._seed)
        if after is not None:
            raise damaged(
                self.path,
                f"a corrupt record at byte {pos} (after entry {last}) is followed by an "
                f"intact one at byte {after[0]} (entry {after[1]})",
            )
        if self.strict and not torn_at(data, pos, self._seed):
            raise damaged(
                self.path,
                f"the record at byte {pos} (after entry {last}) fails its checksum but is "
                "not a torn write: it was written whole, so it may have been acknowledged",
            )

    def _rewrite(self, entries: list[Entry]) -> int:
        """Replace the file with `entries`, atomically; the descriptor to append to. The
        new file is written, synced, renamed over the old one and the directory synced;
        the journal appends to it from then on. Any failure breaks the journal (after the
        rename, an old descriptor would append to a file no longer on disk)."""
        self._salt = self.files.random_bytes(SALT_BYTES)
        seed = self._seed
        records = [entry_record(e, seed) for e in entries]
        tmp = self.path + ".tmp"
        try:
            fd = self.files.create(tmp)
            head = _MAGIC + self._salt
            write_all(self.files, fd, head + crc_bytes(head) + b"".join(records))
            if self.durable:
                self.files.sync(fd)
            self.files.replace(tmp, self.path)
            if self.durable:
                self.files.sync_directory(os.path.dirname(self.path))
        except OSError as e:
            raise self._fail("rewriting the journal", e) from e
        self._ends = []
        end = RECORDS_START
        for r in records:
            end += len(r)
            self._ends.append(end)
        return fd

    def sync(self) -> None:
        """Make every entry written so far durable; a failure breaks the journal for good."""
        self._check_usable()
        if self._reset:
            old, self._fd = self._fd, self._rewrite(self._entries)
            self._reset = False
            self._dirty = False
            self._close(old)
            return
        if self._dirty:
            if self.durable:
                try:
                    self.files.sync(self._fd)
                except OSError as e:
                    raise self._fail("fdatasync", e) from e
            self._dirty = False

    def _close(self, fd: int) -> None:
        try:
            self.files.close(fd)
        except OSError as e:
            logger.warning("%s: closing an old descriptor failed: %s", self.path, e)

    def _check_usable(self) -> None:
        if self.failed is not None:
            raise JournalFailedError(f"{self.path}: unusable since {self.failed}")

    def _fail(self, what: str, error: BaseException) -> JournalFailedError:
        self.failed = error
        return failed_for_good(self.path, "the journal", what, error)

    def _write(self, data: bytes) -> None:
        """All of `data`, or `JournalFailedError` (a short write is never left unnoticed)."""
        self._check_usable()
        try:
            write_all(self.files, self._fd, data)
        except OSError as e:
            raise self._fail("write", e) from e

    def _truncate(self, size: int) -> None:
        self._check_usable()
        try:
            self.files.truncate(self._fd, size)
        except OSError as e:
            raise self._fail("truncate", e) from e

    # ------------------------------------------------------ PySyncObj Journal

    def add(self, command: bytes, idx: int, term: int) -> None:
        self._check_usable()
        entry = self._carry(command, idx, term)
        if not self._reset:
            record = entry_record(entry, self._seed)
            self._write(record)
            self._ends.append((self._ends[-1] if self._ends else RECORDS_START) + len(record))
        self._entries.append(entry)
        self._dirty = True

    def clear(self) -> None:
        """A snapshot install replaces the log: the file is rewritten at the next sync,
        whole (truncated first, a crash before the new entries were synced lost entries
        this node had acknowledged)."""
        self._check_usable()
        self._entries = []
        self._ends = []
        self.carrying_no_op = None
        self._reset = True
        self._dirty = True
        if not self.durable:
            self.sync()  # nobody syncs a journal that is never synced: rewrite it now

    def deleteEntriesFrom(self, entry_from: int) -> None:
        if entry_from >= len(self._entries):
            return
        self._check_cut_above_commit(entry_from)
        if not self._reset:
            self._truncate(self._ends[entry_from - 1] if entry_from else RECORDS_START)
            del self._ends[entry_from:]
        self._cut_entries(entry_from)
        self._dirty = True

    def deleteEntriesTo(self, entry_to: int) -> None:
        """Compaction: keep entries from `entry_to` on, in a new file swapped in atomically."""
        self._check_usable()
        kept = self._entries[entry_to:]
        old, self._fd = self._fd, self._rewrite(kept)
        self._close(old)
        self._entries = kept
        self._reset = False
        self._dirty = False

    def usage(self) -> dict[str, Any]:
        last = self._ends[-1:]  # (the Raft thread may empty the list meanwhile)
        return {
            "kind": "file",
            "entries": len(self._entries),
            "bytes": last[0] if last else RECORDS_START,
        }

    def _destroy(self) -> None:
        if self.failed is not None:  # nothing more is written, the meta file included
            self._close(self._fd)
            return
        try:
            self.sync()
            if self._meta_dirty:
                self._store_meta()
        finally:
            self._close(self._fd)
