# ruff: noqa: N802  (PySyncObj's camelCase Serializer and SyncObj methods)
"""A simulated node's durable storage: `SimDisk` (its journal, the real `DurableJournal`
on simulated files, and its snapshot, stored whole and synced) and `SimSerializer`
(PySyncObj's snapshot store on that disk, writing late as the real node's child does,
sending and receiving snapshots in chunks)."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from typing import Any

from pysyncobj.config import SERIALIZER_STATE

from quorumq.raft.journal import DurableJournal, RaftJournal
from quorumq.raft.wal import WriteAheadLog

from .disk import SimFiles

# ---------------------------------------------------------------------- disk


class SimDisk:
    """A node's durable storage: what a restarted node finds. Its journal is the real
    `DurableJournal` on `files` (this disk's `SimFiles`), or with `wal` group 0 of the
    real `WriteAheadLog` (issue 33's shared log, one group in it); its snapshot is
    stored whole and synced before PySyncObj compacts the journal behind it, as the
    real node writes its file."""

    JOURNAL = "/raft.log"
    WAL = "/wal"
    WAL_SEGMENT_BYTES = 8192
    """Small segments, so that a run rolls over, frees and copies forward (a node's are
    64 MiB: a simulated run never filled one)."""

    def __init__(
        self,
        name: str,
        rng: random.Random,
        *,
        wal: bool = False,
        files: SimFiles | None = None,
        directory: str = "",
    ) -> None:
        """`files` and `directory`: a Raft group's part of a node's disk (`group`)."""
        self.name = name
        self.files = SimFiles(rng) if files is None else files
        self.directory = directory
        """Where this disk's journal and records are: "" (the data directory), or
        `/group-g` for group g of a node with groups (`quorumq.replica.group_dir`)."""
        self.journal_path = directory + self.JOURNAL
        self._rng = rng
        self._groups: dict[int, SimDisk] = {0: self}
        self.wal = wal
        self.wals: list[WriteAheadLog] = []
        """Every write-ahead log opened on this disk (its counters)."""
        self.snapshot: bytes | None = None
        """The node's snapshot (`encode_snapshot` bytes)."""
        self.damaged: str | None = None
        """Why the node refused to start from this disk (it stays down), if it did."""
        self.doomed = False
        """A fault damaged this disk: the node will refuse to start from it (until its
        operator wipes it)."""

    def group(self, group: int) -> SimDisk:
        """Raft group `group`'s part of this disk (group 0's is this disk itself): its
        own journal, records and snapshot in `/group-g`, on the same files (a power
        loss, a full disk or a failing sync hits every group of the node)."""
        disk = self._groups.get(group)
        if disk is None:
            if self.wal:
                raise ValueError("the simulator runs the write-ahead log with one group only")
            disk = self._groups[group] = SimDisk(
                self.name, self._rng, files=self.files, directory=f"/group-{group}"
            )
        return disk

    def open_journal(self) -> RaftJournal:
        """The journal a starting node opens: `JournalDamagedError` if it must refuse."""
        if self.wal:
            log = WriteAheadLog(self.WAL, files=self.files, segment_bytes=self.WAL_SEGMENT_BYTES)
            self.wals.append(log)
            return log.journal(0)
        return DurableJournal(self.journal_path, files=self.files)

    @property
    def meta_path(self) -> str:
        """The journal's meta file (term, vote, commit index)."""
        return f"{self.WAL}/group-0.meta" if self.wal else self.journal_path + ".meta"

    def journal_data_path(self) -> str:
        """The file holding the journal's newest records (where a fault flips a bit)."""
        if not self.wal:
            return self.journal_path
        segments = sorted(n for n in self.files.list_directory(self.WAL) if n.endswith(".log"))
        return f"{self.WAL}/{segments[-1]}" if segments else self.WAL

    def crash(self) -> None:
        self.files.crash()

    def power_loss(self, *, torn: bool = False) -> None:
        self.files.power_loss(torn=torn)


class SimSerializer:
    """PySyncObj's `Serializer` (its snapshot store) for a simulated member, on the
    node's `SimDisk`, behaving as `RaftMember`'s does:

    * `serialize` takes the snapshot of the state as it is (the real node forks), and
      the write ends later, after `write_ms` (a random span: encoding the real state
      takes 0.25-1.9 s), while the node goes on. Only then is the snapshot on the disk
      and does PySyncObj learn it is done (`checkSerializing`) and compact the journal.
      A crash meanwhile loses the write; the previous snapshot stays.
    * the leader sends a follower behind its compacted log the snapshot it has on its
      disk (the previous one while a write runs), in chunks of
      `logCompactionBatchSize` (the first flagged, then an empty last one); a new
      snapshot starts every transfer over.
    * the follower gathers the chunks in memory (lost if it crashes) and stores the
      snapshot only once whole and taken by `accept` (the shared rule that refuses a
      stale one), as `RaftMember` does with its ".incoming" file. A write of its own
      still running then is dropped: it is behind what was installed.

    `write(data)` turns PySyncObj's (last entry, previous entry, members) into the
    snapshot's bytes; `read(bytes)` loads them and gives that triple back."""

    def __init__(
        self,
        disk: SimDisk,
        batch_size: int,
        write: Callable[[Any], bytes],
        read: Callable[[bytes], Any],
        counts: Counter[str],
        now_ms: Callable[[], int],
        write_ms: Callable[[], int],
    ) -> None:
        self.disk = disk
        self.batch_size = batch_size
        self._write = write
        self._read = read
        self.counts = counts
        self._now_ms = now_ms
        self._write_ms = write_ms
        self.accept: Callable[[bytes], bool] = lambda _data: True
        self._writing: tuple[int, bytes, int] | None = None
        """(log index, bytes, when the write ends) of the snapshot being written."""
        self._sending: dict[Any, tuple[bytes, int]] = {}
        """Per follower: the snapshot being sent to it and how many bytes are sent."""
        self._receiving: bytearray | None = None

    def checkSerializing(self) -> tuple[int, int | None]:
        if self._writing is None:
            return SERIALIZER_STATE.NOT_SERIALIZING, None
        index, snapshot, ends_ms = self._writing
        if self._now_ms() < ends_ms:
            return SERIALIZER_STATE.SERIALIZING, index
        self._writing = None
        self.disk.snapshot = snapshot
        self.counts["written"] += 1
        self._sending = {}  # as PySyncObj's: transfers start over with the new snapshot
        return SERIALIZER_STATE.SUCCESS, index

    def serialize(self, data: Any, index: int) -> None:
        if self._writing is not None:
            return
        self._writing = (index, self._write(data[1:]), self._now_ms() + self._write_ms())

    def deserialize(self) -> Any:
        assert self.disk.snapshot is not None
        return (None, *self._read(self.disk.snapshot))

    def getTransmissionData(self, follower: Any) -> tuple[bytes, bool, bool] | None:
        if self.disk.snapshot is None:
            # PySyncObj's would answer None (no snapshot file to open), and PySyncObj
            # then sends empty snapshot messages until appendEntriesPeriod has passed:
            # for ever on the simulated clock, which stands still during a tick. Say so.
            raise RuntimeError(f"{self.disk.name} was asked to send a snapshot it does not have")
        snapshot, sent = self._sending.get(follower) or (self.disk.snapshot, 0)
        chunk = snapshot[sent : sent + self.batch_size]
        last = not chunk
        if last:
            self._sending.pop(follower, None)
            self.counts["sent"] += 1
        else:
            self._sending[follower] = (snapshot, sent + len(chunk))
        return chunk, sent == 0, last

    def setTransmissionData(self, data: tuple[bytes, bool, bool] | None) -> bool:
        if data is None:
            return False
        chunk, first, last = data
        if first:
            self._receiving = bytearray()
        elif self._receiving is None:
            return False
        self._receiving += chunk
        if not last:
            return False
        snapshot, self._receiving = bytes(self._receiving), None
        if not self.accept(snapshot):
            self.counts["refused"] += 1
            return False
        if self._writing is not None:  # behind the snapshot installed: it must not land
            self._writing = None
            self.counts["write dropped"] += 1
        self.disk.snapshot = snapshot
        self.counts["installed"] += 1
        return True

    def cancelTransmisstion(self, follower: Any) -> None:  # sic: PySyncObj's spelling
        self._sending.pop(follower, None)
