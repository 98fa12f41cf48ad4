"""A simulated node's disk: the files its real journal (`quorumq.raft.journal`) writes,
and the faults a disk makes.

Each file has what the node's process sees (the page cache) and what would survive a
power loss (what was synced). Names work the same way: a rename or a new file is
durable once its directory is synced. So:

* a process crash (`crash`) changes nothing on disk: a restarted node reads every byte
  its last run wrote;
* a power loss (`power_loss`) takes every file back to what was synced, under the names
  that were synced; with `torn` it keeps part of what was written after the last sync
  (the kernel wrote some of it back first), cut anywhere, maybe ending in a page of
  zeros: a torn tail;
* `flip_bit` flips one bit of what is on disk (media damage), `set_commit_index` makes
  the meta file claim a commit index (a disk that lied about a sync);
* `fail_next_write` makes the next write write half and the one after it fail with
  ENOSPC (a filling disk); `fail_next_sync` makes the next `fdatasync` fail with EIO;
* `free_bytes` is the free space the node measures (its disk alarm, and the wait for
  space before it starts); while a space fault runs, what is written uses it up, and
  at 0 every write fails with ENOSPC (a full disk) until space returns.

The journal then decides what a real node would: cut a torn tail, refuse to open a
damaged log, stop for good after a failed write or sync.
"""

from __future__ import annotations

import errno
import os
import random
from typing import Any

from quorumq.machine import encoding
from quorumq.raft.journal import PAGE, meta_bytes

PLENTY = 1 << 40
"""A disk's free space when no fault lowered it."""


class SimFile:
    __slots__ = ("data", "dirty_from", "synced")

    def __init__(self) -> None:
        self.data = bytearray()
        """What the process reads and writes."""
        self.synced = bytearray()
        """What a power loss leaves of it."""
        self.dirty_from = 0
        """The lowest offset written or cut since the last sync: a sync after appends
        only copies what was appended (copying the whole journal at every sync took a
        sixth of a run's time)."""

    def reset(self, content: bytes | bytearray) -> None:
        """The file holds `content`, synced."""
        self.data = bytearray(content)
        self.synced = bytearray(content)
        self.dirty_from = len(content)

    def sync(self) -> None:
        n = len(self.synced)
        if self.dirty_from >= n and len(self.data) >= n:
            self.synced += self.data[n:]
        else:
            self.synced = bytearray(self.data)
        self.dirty_from = len(self.data)


class SimFiles:
    """`quorumq.raft.files.Files` on memory, for one node."""

    def __init__(self, rng: random.Random) -> None:
        self.random = rng
        self.names: dict[str, SimFile] = {}
        self.synced_names: dict[str, SimFile] = {}
        self._fds: dict[int, SimFile] = {}
        self._next_fd = 3
        self._short_write = False
        self._no_space = False
        self._sync_fails = False
        self.free_bytes = PLENTY
        """The free space `statvfs` would report (the `disk_alarm` and `disk_full`
        faults lower it; a process crash leaves it as it is)."""
        self.writes = 0
        self.syncs = 0

    # ------------------------------------------------------------ Files

    def read(self, path: str) -> bytes | None:
        f = self.names.get(path)
        return None if f is None else bytes(f.data)

    def _open(self, f: SimFile) -> int:
        fd = self._next_fd
        self._next_fd += 1
        self._fds[fd] = f
        return fd

    def create(self, path: str) -> int:
        f = self.names[path] = SimFile()
        return self._open(f)

    def open_append(self, path: str) -> int:
        f = self.names.get(path)
        if f is None:
            raise FileNotFoundError(errno.ENOENT, "no such file", path)
        return self._open(f)

    def write(self, fd: int, data: bytes | memoryview) -> int:
        f = self._fds[fd]
        if self._no_space or self.free_bytes <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        if self._short_write and len(data) > 1:
            self._short_write = False
            self._no_space = True
            data = bytes(data)[: len(data) // 2]
        f.dirty_from = min(f.dirty_from, len(f.data))
        f.data += data
        if self.free_bytes < PLENTY:  # a space fault runs: what is written uses it up
            self.free_bytes = max(0, self.free_bytes - len(data))
        self.writes += 1
        return len(data)

    def sync(self, fd: int) -> None:
        if self._sync_fails:
            self._sync_fails = False
            raise OSError(errno.EIO, "Input/output error")
        self._fds[fd].sync()
        self.syncs += 1

    def truncate(self, fd: int, size: int) -> None:
        f = self._fds[fd]
        f.dirty_from = min(f.dirty_from, size)
        del f.data[size:]

    def close(self, fd: int) -> None:
        del self._fds[fd]

    def replace(self, source: str, target: str) -> None:
        self.names[target] = self.names.pop(source)

    def sync_directory(self, path: str) -> None:
        self.synced_names = dict(self.names)

    def remove(self, path: str) -> None:
        del self.names[path]

    def list_directory(self, path: str) -> list[str]:
        return [os.path.basename(name) for name in self.names if os.path.dirname(name) == path]

    def random_bytes(self, n: int) -> bytes:
        return self.random.randbytes(n)

    # ------------------------------------------------------------ faults

    def crash(self) -> None:
        """The process died: its descriptors close, its writes stay (the page cache)."""
        self._fds.clear()
        self._short_write = self._no_space = self._sync_fails = False

    def power_loss(self, *, torn: bool = False) -> None:
        """The host lost power: what was not synced is gone (`torn`: part of it stays)."""
        self.crash()
        self.names = dict(self.synced_names)
        seen: set[int] = set()
        for _, f in sorted(self.names.items()):  # in name order: the draws are the seed's
            if id(f) in seen:
                continue
            seen.add(id(f))
            kept = b""
            synced = len(f.synced)
            unsynced = len(f.data) - synced
            if torn and unsynced > 0 and bytes(f.data[:synced]) == f.synced:
                kept = bytes(f.data[synced : synced + self.random.randint(0, unsynced)])
                end = synced + len(kept)
                if kept and self.random.random() < 0.3:  # the last page never came
                    zeros = end - max(synced, (end - 1) // PAGE * PAGE)
                    kept = kept[: len(kept) - zeros] + bytes(zeros)
            f.reset(f.synced + kept)

    def flip_bit(self, path: str, start: int = 0) -> bool:
        """Flip one bit at random at or after byte `start` of what is on disk."""
        f = self.synced_names.get(path)
        if f is None or len(f.synced) <= start:
            return False
        data = bytearray(f.synced)
        data[self.random.randrange(start, len(data))] ^= 1 << self.random.randrange(8)
        f.reset(data)
        return True

    def set_commit_index(self, meta_path: str, index: int) -> bool:
        """Make the (synced) meta file claim `index` as the commit index."""
        f = self.synced_names.get(meta_path)
        if f is None or f.synced[:4] != b"QQM1":
            return False
        meta: Any = encoding.decode(f.synced[8:])
        meta["commit_index"] = index
        f.reset(meta_bytes(meta))
        return True

    def fail_next_write(self) -> None:
        self._short_write = True

    def fail_next_sync(self) -> None:
        self._sync_fails = True
