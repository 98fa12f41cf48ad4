"""A sweep's worker processes, which end with it.

`Workers(jobs, fn)` starts `jobs` processes; `map(items)` hands each idle one the next
item over a pipe of its own and yields `fn(item)` in the items' order. Leaving the
`with` block ends them: those still working are killed (a sweep that stopped at a
failing seed, a Ctrl-C, a SIGTERM, an error), idle ones see their pipe close and exit.

A worker

* ignores SIGINT: a terminal's Ctrl-C reaches the whole foreground process group, and
  the sweep, not each worker, decides what an interrupt does (it stops them);
* dies with its parent, however the parent ends (SIGKILL too): on Linux the kernel
  sends it SIGKILL then (`PR_SET_PDEATHSIG`), elsewhere a thread of its own watches
  `os.getppid()`; and it holds no other worker's pipe, so an idle one reads the end
  of its pipe when the parent is gone;
* sends back `fn`'s error as text: the parent raises it, naming the item.

(`concurrent.futures.ProcessPoolExecutor` did this before: on Ctrl-C it printed a
traceback and waited for the seeds in its queue, its workers orphaned by a SIGKILL of
the sweep waited forever for more.)
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from types import TracebackType
from typing import Any, Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")

PR_SET_PDEATHSIG = 1
"""prctl(2): the signal a process gets when its parent ends."""
STOP_S = 5.0
"""How long leaving waits for the workers to end (they are killed, or idle)."""


class WorkerError(RuntimeError):
    """A worker's `fn` raised: its traceback, and the item."""


class Workers(Generic[T, R]):
    def __init__(self, jobs: int, fn: Callable[[T], R]) -> None:
        # fork: a worker's parent is this process (what PR_SET_PDEATHSIG watches), and
        # it starts at once; spawn where there is no fork
        context = (
            multiprocessing.get_context("fork")
            if "fork" in multiprocessing.get_all_start_methods()
            else multiprocessing.get_context("spawn")
        )
        self._pipes: list[Connection] = []
        self._processes: list[BaseProcess] = []
        parent = os.getpid()
        for _ in range(jobs):
            mine, theirs = context.Pipe()
            self._pipes.append(mine)
            process = context.Process(
                target=_serve, args=(theirs, fn, parent, list(self._pipes)), daemon=True
            )
            process.start()
            theirs.close()
            self._processes.append(process)

    def __enter__(self) -> Workers[T, R]:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.stop(kill=kind is not None)

    def stop(self, kill: bool) -> None:
        """End the workers: close their pipes (an idle worker exits), kill those still
        working if `kill`; wait for them (up to `STOP_S`), then kill any left."""
        for pipe in self._pipes:
            pipe.close()
        if kill:
            for process in self._processes:
                if process.is_alive():
                    process.kill()
        deadline = time.monotonic() + STOP_S
        for process in self._processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join(1.0)

    def map(self, items: Iterable[T]) -> Iterator[R]:
        """`fn(item)` for each item, in order, each run in the next idle worker."""
        todo = enumerate(items)
        idle = list(self._pipes)
        busy: dict[Connection, tuple[int, T]] = {}
        sentinels = {p.sentinel: pipe for p, pipe in zip(self._processes, self._pipes, strict=True)}
        results: dict[int, R] = {}
        given = 0
        while True:
            while idle:
                item = next(todo, None)
                if item is None:
                    break
                pipe = idle.pop()
                pipe.send(item[1])
                busy[pipe] = item
            while given in results:
                yield results.pop(given)
                given += 1
            if not busy:
                return
            ready = wait([*busy, *sentinels])
            for pipe in [r for r in ready if r in busy]:
                index, ran = busy.pop(pipe)
                try:
                    failed, value = pipe.recv()
                except EOFError:
                    raise WorkerError(f"a worker ended while it ran {ran!r}") from None
                if failed:
                    raise WorkerError(f"a worker failed running {ran!r}:\n{value}")
                results[index] = value
                idle.append(pipe)
            for sentinel in ready:
                if sentinel in sentinels and sentinels[sentinel] not in ready:
                    process = self._processes[self._pipes.index(sentinels[sentinel])]
                    raise WorkerError(f"worker {process.pid} ended (exit code {process.exitcode})")


def _serve(pipe: Connection, fn: Callable[[Any], Any], parent: int, others: list[Any]) -> None:
    """A worker: run `fn` on each item its pipe brings, until the pipe ends."""
    for other in others:  # the parent's ends: the parent alone holds them
        other.close()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _die_with(parent)
    while True:
        try:
            item = pipe.recv()
        except EOFError:
            return
        try:
            answer: tuple[bool, Any] = (False, fn(item))
        except Exception:
            answer = (True, traceback.format_exc())
        try:
            pipe.send(answer)
        except (BrokenPipeError, ConnectionResetError):
            return


def _die_with(parent: int) -> None:
    """End this process when `parent` ends: at once on Linux, within a second elsewhere."""
    if not _kernel_kills_on_parent_death():
        threading.Thread(target=_watch, args=(parent,), daemon=True).start()
    if os.getppid() != parent:  # it ended before we asked
        os._exit(1)


def _kernel_kills_on_parent_death() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return bool(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0)
    return False


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)
