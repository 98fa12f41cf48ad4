"""One write-ahead log for every Raft group a node hosts: one fdatasync per round for all.

Issue 33's engine runs many Raft groups in one node process. With a journal per group,
each group that wrote in a round pays its own fdatasync; here every group appends to
one log, and one `sync()` makes all of them durable (group commit, as Ra's
`ra_log_wal`). Each group sees its part through a `GroupJournal`, PySyncObj's Journal
interface as `journal.DurableJournal` gives it, with the same checks and the same
refusals; its term, vote and commit index stay in a meta file of its own.

The log is a directory of segments, `wal-<seq>.log`, each

    b"QQW1", 8 random bytes (the salt), u32 crc(the 12 bytes before), then records in
    the journal's format (`journal.entry_record`), whose command is
    [u8 kind][u32 group][body]:

    ENTRY  idx, term, body: an entry of the group's log
    CUT    idx: the group's entries from idx on are gone (a follower's conflicting tail)
    FREED  idx: segment idx and those before it were freed (group 0, no body)
    FIRST  idx: the group's entries below idx are gone (compaction behind a snapshot)
    RESET  idx = n, term = the first index: the group's log is the n ENTRY records of
           the group that follow, all written together (a snapshot install, or a
           rewrite that frees an old segment). Opening takes them only whole.

Replaying every segment in order gives each group's log. What opening tells apart is
the journal's (`journal` module docstring): a torn tail of the newest segment (never
synced, so never acknowledged) is cut; a bad record anywhere else, an intact record
after a bad one, a record that does not follow its group's log, a missing segment
between two others, or (strict) a whole record failing its checksum refuse to open
(`JournalDamagedError`). A failed write or sync breaks the whole log for good
(`JournalFailedError` for every group): a node stops, it never retries.

Segments roll over at `segment_bytes`; the segment being left is synced first, so only
the newest one can end torn. The oldest segment is removed once no group has a live
entry in it (each group's entries there are below its first entry, or the group was
reset since). A quiet group that never compacts would keep the oldest segment forever,
so the groups pinning the oldest are rewritten at the end (a RESET with their live
entries) while the segments hold more than twice what is live (`_free_segments`).
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import struct
import zlib
from typing import Any, Literal

from .files import OS_FILES, Files, write_all, write_atomically
from .journal import (
    HEADER_BYTES,
    RECORDS_START,
    SALT_BYTES,
    DurableJournal,
    Entry,
    JournalDamagedError,
    JournalFailedError,
    RaftJournal,
    crc_bytes,
    damaged,
    decode_meta,
    failed_for_good,
    meta_bytes,
    parse_entry_record,
    torn_at,
)

logger = logging.getLogger(__name__)

__all__ = [
    "KEPT_SEGMENTS",
    "SEGMENT_BYTES",
    "GroupJournal",
    "JournalKind",
    "WriteAheadLog",
    "WrongJournalError",
    "open_group_journal",
    "open_node_journal",
    "open_node_log",
]

_MAGIC = b"QQW1"
SEGMENT_BYTES = 64 * 1024 * 1024
"""A segment past this size is left for a new one at the next write."""
KEPT_SEGMENTS = 2
"""Segments of dead records tolerated beside twice the live ones before the groups
pinning the oldest segment are copied forward to free it."""

_TAG = struct.Struct("<BI")
"""A record's kind and group, before its body."""
_RECORD_OVERHEAD = HEADER_BYTES + _TAG.size
ENTRY, CUT, FIRST, RESET, FREED = b"ECFRD"
"""Printable kinds: a record's command never starts with a zero byte, so a page that
came back as zeros is never taken for the rest of a whole record."""
_KIND_BYTES = re.compile(b"[ECFRD]")
_KINDS = {ENTRY: "entry", CUT: "cut", FIRST: "first", RESET: "reset", FREED: "freed"}

JournalKind = Literal["file", "wal"]
"""A node's journal: a file of its own, or group 0 of the write-ahead log."""
Record = tuple[int, int, int, int, bytes]
"""(kind, group, idx, term, body)."""


_FIELDS = struct.Struct("<IQQI")
_CRC = struct.Struct("<I")


def _record_bytes(kind: int, group: int, idx: int, term: int, body: bytes, seed: int) -> bytes:
    """The journal's record (`journal.entry_record`) of the command [kind][group][body],
    without copying the body into a command first (this is every entry's path)."""
    tag = _TAG.pack(kind, group)
    fields = _FIELDS.pack(len(tag) + len(body), idx, term, zlib.crc32(body, zlib.crc32(tag, seed)))
    return b"".join((fields, _CRC.pack(zlib.crc32(fields, seed)), tag, body))


MOVED_MARKER = b"QQWA"
MOVED_TEXT = (
    MOVED_MARKER + b"\nThis node's Raft journal moved into wal/ (quorumq node --journal wal).\n"
)
"""What stays at `raft.log` once the log took the journal over: a file journal refuses
to open it (not its magic), so an older release does not start with no term or vote."""


def _fingerprint(data: bytes) -> str:
    return f"{len(data)}-{zlib.crc32(data):08x}"


def _intact_record_after(data: bytes, start: int, seed: int) -> int | None:
    """Where the first intact record of any group and kind at or after `start` is, if
    there is one: every record's command starts with its kind byte, so candidates are
    found by that byte (in C), then their length's high byte (our records are under 16
    MiB), then both salted checksums. One pass over the tail, whatever the number of
    groups (the journal's search by the indexes that come next took minutes with many
    groups, and missed records of groups with none before the damage)."""
    for match in _KIND_BYTES.finditer(data, start + HEADER_BYTES):
        pos = match.start() - HEADER_BYTES
        if data[pos + 3] > 1:
            continue
        parsed = parse_entry_record(data, pos, seed)
        if parsed is not None and len(parsed[0][0]) >= _TAG.size:
            return pos
    return None


def _segment_name(seq: int) -> str:
    return f"wal-{seq:010d}.log"


def _segment_seq(name: str) -> int | None:
    if not (name.startswith("wal-") and name.endswith(".log")):
        return None
    digits = name[4:-4]
    return int(digits) if digits.isdigit() else None


class _GroupLog:
    """One group's entries as replayed and kept up to date."""

    __slots__ = ("entries", "next_index", "reset_segment")

    def __init__(self) -> None:
        self.entries: list[Entry] = []
        self.next_index: int | None = None
        """The index the next entry must have while `entries` is empty (after a
        compaction or a cut), if known."""
        self.reset_segment = 0
        """The segment of the group's last RESET: nothing of it in older ones is live."""

    def follows(self, idx: int) -> bool:
        if self.entries:
            return idx == self.entries[-1][1] + 1
        return self.next_index is None or idx == self.next_index

    def cut(self, idx: int) -> None:
        """Drop entries from `idx` on."""
        keep = len(self.entries)
        while keep and self.entries[keep - 1][1] >= idx:
            keep -= 1
        del self.entries[keep:]
        if not self.entries:
            self.next_index = idx

    def first(self, idx: int, *, replaying: bool = False) -> None:
        """Drop entries below `idx`. Replayed, a FIRST that empties the log says nothing
        of the next entry: the ones between may have been in a segment freed since
        (dead by a later compaction)."""
        drop = 0
        while drop < len(self.entries) and self.entries[drop][1] < idx:
            drop += 1
        del self.entries[:drop]
        self.next_index = None if replaying and not self.entries else idx

    def live_bytes(self) -> int:
        """What the group's entries take in a segment, record headers included."""
        return sum(len(command) + _RECORD_OVERHEAD for command, _, _ in self.entries)


class _Segment:
    __slots__ = ("highest", "path", "seed", "seq", "size")

    def __init__(self, seq: int, path: str, seed: int, size: int) -> None:
        self.seq = seq
        self.path = path
        self.seed = seed
        self.size = size
        self.highest: dict[int, int] = {}
        """Per group, the highest index of an entry written here."""

    def holds(self, group: int, idx: int) -> None:
        if idx > self.highest.get(group, -1):
            self.highest[group] = idx


class _PendingReset:
    __slots__ = ("count", "entries", "first", "group", "start")

    def __init__(self, group: int, count: int, first: int, start: int) -> None:
        self.group = group
        self.count = count
        self.first = first
        self.start = start
        self.entries: list[Entry] = []


class WriteAheadLog:
    """Every group's journal records in one directory of segments, synced together."""

    def __init__(
        self,
        directory: str,
        *,
        durable: bool = True,
        strict: bool | None = None,
        files: Files = OS_FILES,
        segment_bytes: int = SEGMENT_BYTES,
    ) -> None:
        """`durable` and `strict` as `DurableJournal`'s. `segment_bytes`: roll over past it."""
        self.directory = directory
        self.durable = durable
        self.strict = durable if strict is None else strict
        self.files = files
        self.segment_bytes = segment_bytes
        self.failed: BaseException | None = None
        self.syncs = 0
        """fdatasyncs of segments so far (what group commit saves is counted here)."""
        self.segments_freed = 0
        """Segments removed since this log was opened."""
        self._logs: dict[int, _GroupLog] = {}
        self._journals: dict[int, GroupJournal] = {}
        self._segments: list[_Segment] = []
        self._pending_resets: set[int] = set()
        """Groups whose log was replaced (`clear`): written whole at the next sync."""
        self._dirty = False
        self._closed = False
        self._freed = 0
        """The highest segment freed, as the log's FREED records say."""
        self._may_free = False
        """A segment rolled, or a group compacted, cut or reset: look for one to free."""
        self._fd = self._open()

    # ------------------------------------------------------------------ opening

    def _segment_files(self) -> list[tuple[int, str]]:
        found = []
        for name in self.files.list_directory(self.directory):
            seq = _segment_seq(name)
            if seq is not None:
                found.append((seq, os.path.join(self.directory, name)))
        return sorted(found)

    def _open(self) -> int:
        found = self._segment_files()
        for (seq, path), (next_seq, _) in itertools.pairwise(found):
            if next_seq != seq + 1:
                raise damaged(path, f"the write-ahead log's segment {seq + 1} is missing")
        if not found:
            if any(n.endswith(".meta") for n in self.files.list_directory(self.directory)):
                raise damaged(
                    self.directory, "the write-ahead log is missing but group meta files are not"
                )
            return self._start_segment(1)
        newest_seq, newest_path = found[-1]
        if len(self.files.read(newest_path) or b"") < RECORDS_START:
            # started by a rollover a crash cut short: it holds no record
            logger.warning("%s: removing a segment whose header was never written", newest_path)
            self._remove(newest_path)
            found.pop()
            if not found:
                return self._start_segment(newest_seq)
        cut: tuple[str, int] | None = None
        for i, (seq, path) in enumerate(found):
            data = self.files.read(path) or b""
            try:
                segment = self._read_header(seq, path, data)
            except JournalDamagedError:
                if self.durable:
                    raise
                # never synced: its header was torn with the rest; the log ends before it
                for _, later in found[i:]:
                    logger.warning("%s: removing a segment whose header was torn", later)
                    self._remove(later)
                if not self._segments:
                    return self._start_segment(seq)
                cut = None
                break
            self._segments.append(segment)
            newest = i == len(found) - 1
            pos = self._replay(segment, data, newest=newest or not self.durable)
            if pos != len(data):
                cut = (path, pos)
                if not newest:
                    # never synced (`fsync=never`): a power loss may tear any segment;
                    # the log ends at the first tear, and what came after goes with it
                    for _, later in found[i + 1 :]:
                        logger.warning("%s: removing a segment after a torn one", later)
                        self._remove(later)
                    break
        self._check_oldest()
        return self._reopen(cut)

    def _check_oldest(self) -> None:
        """Every segment after the last one freed is here: a missing oldest segment is
        no gap between two others, so only the FREED records tell it was not freed.
        One whose removal a crash cut short is removed now (nothing of it is live)."""
        while len(self._segments) > 1 and self._segments[0].seq <= self._freed:
            self._remove(self._segments.pop(0).path)
        first = self._segments[0]
        if self.durable and first.seq > self._freed + 1:
            raise damaged(
                first.path,
                f"the write-ahead log's segments {self._freed + 1} to {first.seq - 1} are "
                "missing (never freed)",
            )

    def _read_header(self, seq: int, path: str, data: bytes) -> _Segment:
        if data[:4] != _MAGIC or len(data) < RECORDS_START:
            raise JournalDamagedError(f"{path} is not a quorumq write-ahead log segment")
        if crc_bytes(data[: RECORDS_START - 4]) != data[RECORDS_START - 4 : RECORDS_START]:
            raise damaged(path, "its header (the checksums' salt) fails its checksum")
        return _Segment(seq, path, zlib.crc32(data[4 : RECORDS_START - 4]), len(data))

    def _replay(self, segment: _Segment, data: bytes, newest: bool) -> int:
        """Apply the segment's records to the groups' logs; where they stop being intact
        (past a torn tail, or the start of a RESET cut short)."""
        pos = RECORDS_START
        pending: _PendingReset | None = None
        while pos < len(data):
            parsed = parse_entry_record(data, pos, segment.seed)
            if parsed is None:
                break
            (command, idx, term), end = parsed
            if len(command) < _TAG.size or command[0] not in _KINDS:
                raise damaged(segment.path, f"the record at byte {pos} is of no known kind")
            kind, group = _TAG.unpack_from(command)
            body = command[_TAG.size :]
            if pending is not None:
                if kind != ENTRY or group != pending.group:
                    raise damaged(
                        segment.path,
                        f"group {pending.group}'s reset at byte {pending.start} is "
                        f"interrupted by a {_KINDS[kind]} record of group {group}",
                    )
                pending.entries.append((body, idx, term))
                if len(pending.entries) == pending.count:
                    self._install_reset(pending, segment)
                    pending = None
            elif kind == RESET:
                pending = _PendingReset(group, idx, term, pos)
                if idx == 0:
                    self._install_reset(pending, segment)
                    pending = None
            else:
                self._apply(segment, pos, kind, group, idx, term, body)
            if kind == ENTRY:
                segment.holds(group, idx)
            pos = end
        if pos == len(data) and pending is None:
            return pos
        if not newest:
            raise damaged(
                segment.path,
                f"a record at byte {pos} fails its checksum in a segment that was synced "
                "whole before the next one began",
            )
        if pos != len(data):
            self._check_cut(segment, data, pos, pending)
        return pending.start if pending is not None else pos

    def _apply(
        self, segment: _Segment, pos: int, kind: int, group: int, idx: int, term: int, body: bytes
    ) -> None:
        if kind == FREED:
            self._freed = max(self._freed, idx)
            return
        log = self._logs.setdefault(group, _GroupLog())
        if kind == ENTRY:
            if not log.follows(idx):
                last = log.entries[-1][1] if log.entries else log.next_index
                raise damaged(
                    segment.path,
                    f"entry {idx} of group {group} at byte {pos} does not follow "
                    f"its log (at {last})",
                )
            log.entries.append((body, idx, term))
        elif kind == CUT:
            log.cut(idx)
        else:
            log.first(idx, replaying=True)

    def _install_reset(self, pending: _PendingReset, segment: _Segment) -> None:
        log = self._logs.setdefault(pending.group, _GroupLog())
        log.entries[:] = pending.entries
        log.next_index = pending.first or None
        log.reset_segment = segment.seq

    def _check_cut(
        self, segment: _Segment, data: bytes, pos: int, pending: _PendingReset | None
    ) -> None:
        """Refuse to cut the newest segment at `pos` unless what follows is a torn tail
        (or, not strict, a record maybe never synced with nothing intact after it)."""
        after = _intact_record_after(data, pos + 1, segment.seed)
        if after is not None:
            raise damaged(
                segment.path,
                f"a corrupt record at byte {pos} is followed by an intact one at byte {after}",
            )
        if self.strict and not torn_at(data, pos, segment.seed):
            raise damaged(
                segment.path,
                f"the record at byte {pos} fails its checksum but is not a torn write: it "
                "was written whole, so it may have been acknowledged",
            )

    def _reopen(self, cut: tuple[str, int] | None) -> int:
        """Open the newest segment for appending, its torn tail cut first, and sync it:
        a process that crashed may have written records it never synced, and this one
        must not acknowledge them (nor roll past them) as if they were durable."""
        segment = self._segments[-1]
        try:
            fd = self.files.open_append(segment.path)
            if cut is not None:
                path, pos = cut
                logger.warning(
                    "%s: cutting a torn tail of %d bytes at byte %d", path, segment.size - pos, pos
                )
                self.files.truncate(fd, pos)
                segment.size = pos
            if self.durable:
                self.files.sync(fd)
                self.files.sync_directory(self.directory)  # and the names it made
        except OSError as e:
            raise self._fail("opening the newest segment", e) from e
        return fd

    def _start_segment(self, seq: int) -> int:
        """A new, empty segment, synced with its name: the descriptor to append to."""
        path = os.path.join(self.directory, _segment_name(seq))
        salt = self.files.random_bytes(SALT_BYTES)
        head = _MAGIC + salt
        try:
            fd = self.files.create(path)
            write_all(self.files, fd, head + crc_bytes(head))
            if self.durable:
                self.files.sync(fd)
                self.files.sync_directory(self.directory)
        except OSError as e:
            raise self._fail("starting a segment", e) from e
        self._segments.append(_Segment(seq, path, zlib.crc32(salt), RECORDS_START))
        return fd

    # ------------------------------------------------------------------ groups

    def journal(self, group: int) -> GroupJournal:
        """Group `group`'s journal (an empty one if the log holds nothing of it)."""
        if not 0 <= group < 2**32:
            raise ValueError(f"group {group} is not a 32-bit unsigned number")
        if group in self._journals:
            raise ValueError(f"group {group}'s journal is already open")
        log = self._logs.setdefault(group, _GroupLog())
        journal = self._journals[group] = GroupJournal(self, group, log)
        return journal

    def groups(self) -> list[int]:
        """The groups the log holds entries of."""
        return sorted(g for g, log in self._logs.items() if log.entries)

    # ------------------------------------------------------------------ writing

    def _check_usable(self) -> None:
        if self.failed is not None:
            raise JournalFailedError(f"{self.directory}: unusable since {self.failed}")

    def _fail(self, what: str, error: BaseException) -> JournalFailedError:
        self.failed = error
        return failed_for_good(self.directory, "the write-ahead log", what, error)

    def _write(self, records: list[Record]) -> None:
        """Append `records` in one write, to one segment; `JournalFailedError` if not all."""
        self._check_usable()
        if self._segments[-1].size >= self.segment_bytes:
            self._roll()
        segment = self._segments[-1]
        seed = segment.seed
        data = b"".join(
            [
                _record_bytes(kind, group, idx, term, body, seed)
                for kind, group, idx, term, body in records
            ]
        )
        try:
            write_all(self.files, self._fd, data)
        except OSError as e:
            raise self._fail("write", e) from e
        segment.size += len(data)
        for kind, group, idx, _, _ in records:
            if kind == ENTRY:
                segment.holds(group, idx)
            else:
                self._may_free = True
        self._dirty = True

    def _roll(self) -> None:
        """Sync the segment being left (so only the newest can end torn), start the next."""
        try:
            if self.durable and self._dirty:
                self.files.sync(self._fd)
                self.syncs += 1
        except OSError as e:
            raise self._fail("fdatasync", e) from e
        self._dirty = False
        self._may_free = True
        old = self._fd
        self._fd = self._start_segment(self._segments[-1].seq + 1)
        self._close(old)

    def _write_reset(self, group: int) -> None:
        log = self._logs[group]
        first = log.entries[0][1] if log.entries else (log.next_index or 0)
        records: list[Record] = [(RESET, group, len(log.entries), first, b"")]
        records += [(ENTRY, group, idx, term, command) for command, idx, term in log.entries]
        self._write(records)
        self._pending_resets.discard(group)
        log.reset_segment = self._segments[-1].seq

    def sync(self) -> None:
        """Make every record of every group written so far durable, with one fdatasync;
        then free what no group needs. A failure breaks the log for good."""
        self._check_usable()
        for group in sorted(self._pending_resets):
            self._write_reset(group)
        self._sync_segment()
        if self._may_free:
            self._may_free = False
            self._free_segments()

    def _sync_segment(self, *, force: bool = False) -> None:
        if not self._dirty:
            return
        if self.durable or force:
            try:
                self.files.sync(self._fd)
            except OSError as e:
                raise self._fail("fdatasync", e) from e
            self.syncs += 1
        self._dirty = False

    def _live_in(self, segment: _Segment, group: int) -> bool:
        """Whether `segment` holds an entry of `group` that is still in its log."""
        log = self._logs.get(group)
        if log is None or log.reset_segment > segment.seq or not log.entries:
            return False
        return segment.highest.get(group, -1) >= log.entries[0][1]

    def _free_segments(self) -> None:
        """Remove the oldest segments no group needs; everything written is synced.

        When groups still need the oldest, they are copied forward (a RESET with
        their live entries, at the end) only while the segments hold more than
        twice every group's live records and `KEPT_SEGMENTS` segments besides: a
        quiet group is never left keeping old segments, the disk holds at most about
        twice what is live, and a copy is paid for by what it frees. One pass: a
        segment started during it is never freed by it, so each group is copied at
        most once and the pass ends (the review found one that never did)."""
        started = self._segments[-1].seq
        while len(self._segments) > 1 and self._segments[0].seq < started:
            oldest = self._segments[0]
            pinning = [g for g in oldest.highest if self._live_in(oldest, g)]
            if pinning:
                if not self._too_much_dead_data():
                    return
                for group in pinning:
                    self._write_reset(group)
                self._sync_segment()
                continue
            # recorded (and synced) first: opening tells a freed segment from a lost one
            self._write([(FREED, 0, oldest.seq, 0, b"")])
            self._sync_segment()
            self._remove(oldest.path)
            self._segments.pop(0)
            self.segments_freed += 1

    def _too_much_dead_data(self) -> bool:
        on_disk = sum(segment.size for segment in self._segments)
        live = sum(log.live_bytes() for log in self._logs.values())
        return on_disk > 2 * live + KEPT_SEGMENTS * self.segment_bytes

    def _remove(self, path: str) -> None:
        """Remove a segment, durably: a removal lost to a crash while the next one's
        stayed would leave a gap, which opening refuses."""
        try:
            self.files.remove(path)
            if self.durable:
                self.files.sync_directory(self.directory)
        except OSError as e:
            raise self._fail(f"removing {path}", e) from e

    def _close(self, fd: int) -> None:
        try:
            self.files.close(fd)
        except OSError as e:
            logger.warning("%s: closing a descriptor failed: %s", self.directory, e)

    def close(self) -> None:
        """Sync what is written (unless the log failed) and close the newest segment.
        Idempotent; the log is closed too once its last open group journal is."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.failed is None:
                self.sync()
        finally:
            self._close(self._fd)

    @property
    def closed(self) -> bool:
        return self._closed

    def groups_open(self) -> list[int]:
        """The groups whose journal is open on this log."""
        return sorted(self._journals)

    def _release(self, group: int) -> None:
        self._journals.pop(group, None)
        if not self._journals:
            self.close()

    def adopt(self, group: int, journal_path: str) -> None:
        """Carry a journal file of its own (`DurableJournal`, a node's before it ran on
        this log) into `group`, once, and leave a marker in its place.

        The journal's entries are written as the group's log, its meta file becomes
        the group's (with the journal's fingerprint, `adopted_from`), both synced
        whatever the fsync mode; then the journal and its meta file are renamed
        `<name>.adopted-<fingerprint>` (kept, never read again) and `journal_path`
        becomes a marker (`MOVED_MARKER`) that a file journal refuses to open: a node
        rolled back to a release without this log, or started with `--journal file`,
        refuses instead of starting with no term or vote. A crash anywhere on the way
        leaves what the next `adopt` finishes. A journal file found beside a group
        that holds another one's entries (a rollback that ran on it, a restored
        backup) is refused (`WrongJournalError`), never set aside silently."""
        if group in self._journals:
            raise ValueError(f"group {group}'s journal is open: adopt before opening it")
        data = self.files.read(journal_path)
        old_meta = journal_path + ".meta"
        group_meta = self._read_group_meta(group)
        if data is not None and data[:4] == MOVED_MARKER:
            if group_meta is None:
                raise damaged(
                    journal_path,
                    "the journal moved into the write-ahead log, but the log has no group "
                    f"{group} ({self._meta_path(group)} is missing): its term and vote are gone",
                )
            self._check_meta_matches(old_meta, group_meta, journal_path, group)
            self._set_aside(old_meta, group_meta)
            return
        if data is None:
            if group_meta is None or self.files.read(old_meta) is None:
                if group_meta is None and self.files.read(old_meta) is not None:
                    DurableJournal(journal_path, files=self.files)  # refuses: meta, no journal
                if group_meta is None:
                    # a group on the log from its first start: its meta file first, or a
                    # node stopped before its first term would find the marker and no
                    # group, and refuse every start after
                    self._store_group_meta(group, {})
                self._mark_moved(journal_path)
                return
            self._mark_moved(journal_path)  # renamed aside, the marker not yet written
            self._check_meta_matches(old_meta, group_meta, journal_path, group)
            self._set_aside(old_meta, group_meta)
            return
        if group_meta is None:
            group_meta = self._carry(group, journal_path)
            data = self.files.read(journal_path) or b""
        if group_meta.get("adopted_from") != _fingerprint(data):
            raise self._not_adopted(journal_path, group)
        self._check_meta_matches(old_meta, group_meta, journal_path, group)
        self._set_aside(journal_path, group_meta)
        self._mark_moved(journal_path)
        self._set_aside(old_meta, group_meta)

    def _not_adopted(self, journal_path: str, group: int) -> WrongJournalError:
        return WrongJournalError(
            f"{journal_path} is a journal file beside a write-ahead log whose group "
            f"{group} holds other entries or another term ({self._meta_path(group)}): it "
            "was written after the log took this node's journal over (a release without "
            "the log, or a restored backup), and carrying it over would lose what the log "
            "holds. Move one of them away"
        )

    def _check_meta_matches(
        self, old_meta: str, group_meta: dict[str, Any], journal_path: str, group: int
    ) -> None:
        """A journal's meta file left beside the log must be the one carried over: one
        that moved on since (a term or vote of a rolled-back run) is refused."""
        data = self.files.read(old_meta)
        if data is not None and group_meta.get("adopted_meta") != _fingerprint(data):
            raise self._not_adopted(journal_path, group)

    def _carry(self, group: int, journal_path: str) -> dict[str, Any]:
        """Write the journal's entries and meta as the group's, durably; its meta. The
        journal is opened durable whatever the log is: a rewrite or a cut it makes,
        and the bytes fingerprinted, must be the ones a power loss leaves."""
        journal = DurableJournal(journal_path, durable=True, strict=self.strict, files=self.files)
        entries, meta = list(journal[:]), dict(journal._meta)
        journal._destroy()  # (it may have cut a torn tail: fingerprint what stays)
        old_meta = self.files.read(journal_path + ".meta")
        if old_meta is not None:  # written by a run that never synced, maybe: sync it
            try:
                write_atomically(self.files, journal_path + ".meta", old_meta)
            except OSError as e:
                raise self._fail("syncing the journal's meta file", e) from e
        meta["adopted_from"] = _fingerprint(self.files.read(journal_path) or b"")
        meta["adopted_meta"] = _fingerprint(old_meta or b"")
        log = self._logs.setdefault(group, _GroupLog())
        log.entries[:] = entries
        log.next_index = None
        self._pending_resets.add(group)
        self._check_usable()
        self._write_reset(group)
        self._sync_segment(force=True)
        self._store_group_meta(group, meta)
        logger.info(
            "%s: carried %d entries of %s into group %d",
            self.directory,
            len(entries),
            journal_path,
            group,
        )
        return meta

    def _store_group_meta(self, group: int, meta: dict[str, Any]) -> None:
        """The group's meta file, durably whatever the fsync mode (an adoption's)."""
        try:
            write_atomically(self.files, self._meta_path(group), meta_bytes(meta))
        except OSError as e:
            raise self._fail("writing a group's meta file", e) from e

    def _read_group_meta(self, group: int) -> dict[str, Any] | None:
        data = self.files.read(self._meta_path(group))
        if data is None:
            return None
        try:
            meta = decode_meta(data)
        except ValueError as e:
            raise damaged(self._meta_path(group), str(e)) from None
        return meta

    def _set_aside(self, path: str, group_meta: dict[str, Any] | None) -> None:
        if self.files.read(path) is None:
            return
        mark = str((group_meta or {}).get("adopted_from", "unknown"))
        target = f"{path}.adopted-{mark}"
        kept = self.files.read(target)
        if kept is not None and kept != self.files.read(path):
            raise WrongJournalError(f"{target} exists and differs from {path}: move one away")
        try:
            self.files.replace(path, target)
            self.files.sync_directory(os.path.dirname(path))
        except OSError as e:
            raise self._fail("setting an adopted journal aside", e) from e

    def _mark_moved(self, journal_path: str) -> None:
        try:
            write_atomically(self.files, journal_path, MOVED_TEXT)
        except OSError as e:
            raise self._fail("leaving the journal's marker", e) from e

    def _meta_path(self, group: int) -> str:
        return os.path.join(self.directory, f"group-{group}.meta")


class GroupJournal(RaftJournal):
    """One group's journal in a `WriteAheadLog`: PySyncObj's Journal interface, as
    `DurableJournal`'s, with its meta file (`group-<n>.meta`) beside the segments."""

    def __init__(self, wal: WriteAheadLog, group: int, log: _GroupLog) -> None:
        self._wal = wal
        self.group = group
        self._log = log
        meta_found = self._begin(
            f"{wal.directory} (group {group})",
            wal._meta_path(group),
            wal.durable,
            wal.strict,
            wal.files,
        )
        self._entries = log.entries
        self._check_meta_for(meta_found)
        self._check_commit_index()
        self._opened()

    @property
    def failed(self) -> BaseException | None:
        return self._wal.failed

    @property
    def files(self) -> Files:
        """The log's files: wrapping them (the fsync metrics) wraps every group's."""
        return self._wal.files

    @files.setter
    def files(self, files: Files) -> None:
        self._wal.files = files

    def sync(self) -> None:
        """Sync the whole log (every group's records: that is the point)."""
        self._wal.sync()

    def _fail(self, what: str, error: BaseException) -> JournalFailedError:
        return self._wal._fail(what, error)

    @property
    def _resetting(self) -> bool:
        return self.group in self._wal._pending_resets

    # ------------------------------------------------------ PySyncObj Journal

    def add(self, command: bytes, idx: int, term: int) -> None:
        self._wal._check_usable()
        entry = self._carry(command, idx, term)
        if not self._resetting:
            if self._log.follows(idx):
                self._wal._write([(ENTRY, self.group, idx, term, entry[0])])
            else:
                # opening would refuse a record that does not follow: what PySyncObj
                # holds is written whole instead, at the next sync
                logger.warning(
                    "%s: entry %d does not follow the log; it is rewritten whole", self.path, idx
                )
                self._wal._pending_resets.add(self.group)
        self._entries.append(entry)

    def clear(self) -> None:
        """A snapshot install replaces the log: written whole at the next sync (a RESET
        with the entries added meanwhile), so a crash before it leaves the old log."""
        self._wal._check_usable()
        self._entries.clear()
        self._log.next_index = None
        self.carrying_no_op = None
        self._wal._pending_resets.add(self.group)
        if not self.durable:
            self._wal.sync()  # nobody syncs a log that is never synced: write it now

    def deleteEntriesFrom(self, entry_from: int) -> None:
        if entry_from >= len(self._entries):
            return
        self._check_cut_above_commit(entry_from)
        idx = self._entries[entry_from][1]
        if not self._resetting:
            self._wal._write([(CUT, self.group, idx, 0, b"")])
        self._cut_entries(entry_from)
        if not self._entries:
            self._log.next_index = idx

    def deleteEntriesTo(self, entry_to: int) -> None:
        """Compaction: entries before position `entry_to` go (their segments once no
        group needs them)."""
        self._wal._check_usable()
        if entry_to <= 0 or not self._entries:
            return
        entry_to = min(entry_to, len(self._entries))
        first = self._entries[entry_to - 1][1] + 1
        if not self._resetting:
            self._wal._write([(FIRST, self.group, first, 0, b"")])
        self._log.first(first)

    def usage(self) -> dict[str, Any]:
        """The group's entries, and the whole log's segments (shared by every group)."""
        segments = list(self._wal._segments)
        return {
            "kind": "wal",
            "entries": len(self._entries),
            "segments": len(segments),
            "bytes": sum(segment.size for segment in segments),
        }

    def _destroy(self) -> None:
        """Sync and store the meta file (unless the log failed); the view closes, and
        the log with its last one."""
        try:
            if self.failed is None:
                self.sync()
                if self._meta_dirty:
                    self._store_meta()
        finally:
            self._wal._release(self.group)


def _starts_with(path: str, prefix: bytes) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(prefix)) == prefix
    except FileNotFoundError:
        return False


class WrongJournalError(Exception):
    """The data directory's journal is of the other kind than the node was started with."""


def open_node_journal(
    data_dir: str, kind: JournalKind, *, durable: bool, strict: bool
) -> RaftJournal:
    """A node's journal in `data_dir` when it hosts one group: `raft.log` of its own
    ("file"), or group 0 of the write-ahead log in `wal/` ("wal")."""
    wal = open_node_log(data_dir, durable=durable, strict=strict) if kind == "wal" else None
    try:
        return open_group_journal(wal, data_dir, 0, kind, durable=durable, strict=strict)
    except BaseException:
        if wal is not None:
            wal.close()
        raise


def open_node_log(node_dir: str, *, durable: bool, strict: bool) -> WriteAheadLog:
    """The node's one write-ahead log, in `node_dir/wal` (made, and the directory
    synced, at the first start)."""
    wal_dir = os.path.join(node_dir, "wal")
    if not os.path.isdir(wal_dir):
        os.makedirs(wal_dir, exist_ok=True)
        OS_FILES.sync_directory(node_dir)
    return WriteAheadLog(wal_dir, durable=durable, strict=strict)


def open_group_journal(
    wal: WriteAheadLog | None,
    data_dir: str,
    group: int,
    kind: JournalKind,
    *,
    durable: bool,
    strict: bool,
    node_dir: str | None = None,
) -> RaftJournal:
    """Group `group`'s journal: `data_dir/raft.log` ("file"), or its part of `wal`
    ("wal"), which takes a `raft.log` in `data_dir` over once (`WriteAheadLog.adopt`).
    A group whose journal is in a write-ahead log (the node's, in `node_dir/wal`,
    `node_dir` by default `data_dir`) is refused as "file" (`WrongJournalError`):
    going back is not built."""
    journal_path = os.path.join(data_dir, "raft.log")
    if kind == "file":
        moved = _starts_with(journal_path, MOVED_MARKER)  # (not the whole journal)
        wal_dir = os.path.join(data_dir if node_dir is None else node_dir, "wal")
        if moved or os.path.exists(os.path.join(wal_dir, f"group-{group}.meta")):
            raise WrongJournalError(
                f"{data_dir} holds a write-ahead log ({wal_dir}): this node was run with "
                "--journal wal; start it with --journal wal (going back to a journal file "
                "is not supported)"
            )
        return DurableJournal(journal_path, durable=durable, strict=strict)
    if kind != "wal":
        raise ValueError(f"journal must be file or wal, not {kind!r}")
    if wal is None:
        raise ValueError("a group's journal in a write-ahead log needs the log")
    wal.adopt(group, journal_path)
    return wal.journal(group)
