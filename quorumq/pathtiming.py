"""Where a message's time goes: timestamps at each step of its path, for the latency
breakdown (`python -m benchmarks.bench_path`).

Off unless the environment variable `QUORUMQ_PATH_TIMING` names a directory when the
process starts: then every step marks `(wall-clock ns, step, key)` in memory, and the
process appends its marks to `<directory>/<name>-<pid>.jsonl` every `FLUSH_EVERY` marks
and when it exits (a SIGKILLed process loses those not written yet). Nodes and
clients on one host share the wall clock, so marks from different processes compare.
Call sites test `ENABLED` first, so that a node that does not time pays one attribute
read per step.

Keys say which message a mark is about, as each layer knows it:
* `("p", producer, seq)`: a publish, in the client and the node core;
* `("i", index)`: a Raft log entry, in the Raft layer and where effects cross to trio;
* `("o", offset)`: a message in the queue, in confirm and delivery frames.
Each replica's `map` mark (as it applies the entry) ties them:
`(index, producer, first seq, count, first offset)`.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import threading
import time
from typing import Any

__all__ = ["ENABLED", "mark", "name_process"]

_DIRECTORY = os.environ.get("QUORUMQ_PATH_TIMING") or None
ENABLED = _DIRECTORY is not None
"""Whether this process marks its steps (read once, at import)."""

_marks: list[tuple[int, str, Any]] = []
_name = "process"
_lock = threading.Lock()


FLUSH_EVERY = 200_000
"""Marks kept in memory before they are appended to the file (a long run stays bounded)."""


def mark(step: str, key: Any) -> None:
    """Record that the message `key` passed `step` now (call only when `ENABLED`)."""
    _marks.append((time.time_ns(), step, key))
    if len(_marks) >= FLUSH_EVERY:
        _write()


def name_process(name: str) -> None:
    """What this process is (a node's id, `client`): it names the file of its marks."""
    global _name  # noqa: PLW0603 (one name per process)
    _name = name


def _write() -> None:
    if _DIRECTORY is None or not _marks:
        return
    with _lock:
        marks = _marks[:]
        del _marks[: len(marks)]  # (marks made meanwhile by other threads stay)
    os.makedirs(_DIRECTORY, exist_ok=True)
    path = os.path.join(_DIRECTORY, f"{_name}-{os.getpid()}.jsonl")
    with open(path, "a") as f:
        f.write(json.dumps({"process": _name}) + "\n")  # (again after each flush: harmless)
        for ns, step, key in marks:
            f.write(json.dumps([ns, step, key]) + "\n")


def _collecting(phase: str, info: dict[str, int]) -> None:
    """The garbage collector's passes, to tell a stall it causes from others."""
    mark(f"gc.{phase}", ("g", info["generation"]))


if ENABLED:
    atexit.register(_write)
    gc.callbacks.append(_collecting)
