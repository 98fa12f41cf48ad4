"""What a node process does before it serves: take its data directory (`lock_data_dir`:
one process per directory, the lock held for the process's life), run blocking work off
the trio loop (`in_own_thread`), and load its TLS certificate and key (`tls_context`)."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import ssl
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import trio

from ..node import NodeConfig
from ..replica import ConfigError

logger = logging.getLogger(__name__)

T = TypeVar("T")


def lock_data_dir(path: str) -> int:
    """Take the data directory for this process (a lock file in it, with this process's
    id), or `ConfigError` saying which process has it: two nodes writing one journal
    damage it (found by hand: a second `quorumq node` on a running node's directory
    started, and the first one's journal was refused at its restart). Returns the lock's
    descriptor: closing it lets the directory go."""
    directory = Path(path)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(directory / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise ConfigError(f"cannot use the data directory {path}: {e}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise ConfigError(
            f"the data directory {path} is in use by another quorumq node (pid {holder})"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


async def in_own_thread(work: Callable[[], T], *, name: str) -> T:
    """`work()` in a thread of its own, joined before this returns (the caller's
    cancellation waits for it, as `trio.to_thread.run_sync`'s does). Not trio's worker
    threads: they outlive their call, idle, for 10 s, and a node embedded in a program
    leaves no thread behind when it stops."""
    token = trio.lowlevel.current_trio_token()
    finished = trio.Event()
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(work())
        except BaseException as e:
            error.append(e)
        finally:
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(finished.set)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    with trio.CancelScope(shield=True):
        await finished.wait()
    thread.join()
    if error:
        raise error[0]
    return result[0]


def tls_context(config: NodeConfig) -> ssl.SSLContext | None:
    """The client port's TLS context (TLS 1.2 at least), or None without a certificate;
    `ConfigError` (one line) if the certificate or its key cannot be loaded."""
    if config.tls_cert is None or config.tls_key is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.options |= ssl.OP_NO_RENEGOTIATION
    try:
        context.load_cert_chain(config.tls_cert, config.tls_key)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(
            f"cannot load the TLS certificate {config.tls_cert} with the key {config.tls_key}: {e}"
        ) from None
    return context
