"""The file operations a node's durable Raft state goes through.

A real node uses the operating system's (`OS_FILES`). The simulator gives the same
journal code a disk of its own (`simulations.disk.SimFiles`) that loses what was not
synced at a power loss, tears writes, flips bits and fails syncs, so that the checks a
node makes when it opens its journal run in every simulated restart.

Descriptors are ints, as the os module's are. `write` may write less than it was given
(as `os.write` may on a filling disk); `sync` is `fdatasync`.
"""

from __future__ import annotations

import os
import zlib
from typing import Any, Protocol

from ..machine import encoding


class Files(Protocol):
    def read(self, path: str) -> bytes | None:
        """The whole file, or None if there is none."""

    def create(self, path: str) -> int:
        """Create (or empty) `path`, open for appending."""

    def open_append(self, path: str) -> int:
        """Open an existing file for appending."""

    def write(self, fd: int, data: bytes | memoryview) -> int:
        """Append; how many bytes were written (maybe fewer, never zero without an error)."""

    def sync(self, fd: int) -> None:
        """Make what was written to `fd` durable (`fdatasync`)."""

    def truncate(self, fd: int, size: int) -> None: ...

    def close(self, fd: int) -> None: ...

    def replace(self, source: str, target: str) -> None:
        """Rename `source` over `target` (atomic; durable once the directory is synced)."""

    def sync_directory(self, path: str) -> None:
        """Make the names in directory `path` durable (renames, creations)."""

    def remove(self, path: str) -> None: ...

    def list_directory(self, path: str) -> list[str]:
        """The names of the files in directory `path` (none if there is no such directory)."""

    def random_bytes(self, n: int) -> bytes:
        """Random bytes (a journal's salt): the OS's, or the simulation's seeded ones."""


class OsFiles:
    """The operating system's files."""

    def read(self, path: str) -> bytes | None:
        try:
            with open(path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def create(self, path: str) -> int:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)

    def open_append(self, path: str) -> int:
        return os.open(path, os.O_WRONLY | os.O_APPEND)

    def write(self, fd: int, data: bytes | memoryview) -> int:
        return os.write(fd, data)

    def sync(self, fd: int) -> None:
        os.fdatasync(fd)

    def truncate(self, fd: int, size: int) -> None:
        os.ftruncate(fd, size)

    def close(self, fd: int) -> None:
        os.close(fd)

    def replace(self, source: str, target: str) -> None:
        os.replace(source, target)

    def sync_directory(self, path: str) -> None:
        fd = os.open(path or ".", os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def remove(self, path: str) -> None:
        os.unlink(path)

    def list_directory(self, path: str) -> list[str]:
        try:
            return os.listdir(path)
        except FileNotFoundError:
            return []

    def random_bytes(self, n: int) -> bytes:
        return os.urandom(n)


OS_FILES: Files = OsFiles()


def write_all(files: Files, fd: int, data: bytes | memoryview) -> None:
    """All of `data`, or `OSError` (a short write is continued, never left unnoticed)."""
    view = memoryview(data)
    while view:
        written = files.write(fd, view)
        if written <= 0:
            raise OSError(f"write returned {written}")
        view = view[written:]


def write_atomically(files: Files, path: str, data: bytes, *, durable: bool = True) -> None:
    """Replace `path` with `data` so that a crash leaves the old or the new file, whole."""
    tmp = path + ".tmp"
    fd = files.create(tmp)
    try:
        write_all(files, fd, data)
        if durable:
            files.sync(fd)
    finally:
        files.close(fd)
    files.replace(tmp, path)
    if durable:
        files.sync_directory(os.path.dirname(path))


def encode_record(magic: bytes, fields: dict[str, Any]) -> bytes:
    """A small checksummed file's bytes (a node's first configuration, its cluster
    identity): `magic` (4 bytes), the CRC-32 of the payload, the payload (`fields` in
    our encoding, with their `format` and `version`)."""
    payload = encoding.encode(fields)
    return magic + zlib.crc32(payload).to_bytes(4, "little") + payload


def decode_record(data: bytes, source: str, magic: bytes, form: str, what: str) -> dict[str, Any]:
    """The fields `encode_record` wrote with `magic` and `format` `form`, read from
    `source`; `ValueError` naming `source` and what is wrong (`what`: "a quorumq first
    configuration") otherwise. Their version is the caller's to check."""
    if data[:4] != magic or len(data) < 8:
        raise ValueError(f"{source} is not {what}")
    payload = data[8:]
    if zlib.crc32(payload) != int.from_bytes(data[4:8], "little"):
        raise ValueError(f"{source} fails its checksum: it is damaged")
    try:
        value = encoding.decode(payload)
    except ValueError as e:
        raise ValueError(f"{source} cannot be read ({e})") from None
    if not isinstance(value, dict) or value.get("format") != form:
        raise ValueError(f"{source} is not {what}")
    return value
