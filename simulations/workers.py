"""A sweep's worker processes, which end with it.

`Workers(jobs, fn)` starts `jobs` processes; `map(items)` hands each idle one the next
item over a pipe of its own and yields `fn(item)` in the items' order. Leaving the
`with` block ends them: those still working are killed (a sweep that stopped at a
failing seed, a Ctrl-C, a SIGTERM, an error), idle ones see their pipe close and exit.

A worker

* ignores SIGINT: a terminal's Ctrl-C reaches the whole foreground process group, and
  the sweep, not each worker, decides what an interrupt does (it stops them); it
  starts with SIGINT and SIGTERM blocked until it has set its own dispositions, and
  the sweep blocks them while it starts one, so that a Ctrl-C then neither raises in
  the worker nor leaves a started worker unknown to the pool;
* dies with its parent, however the parent ends (SIGKILL too): on Linux the kernel
  sends it SIGKILL then (`PR_SET_PDEATHSIG`), elsewhere a thread of its own watches
  `os.getppid()`; and it holds no other worker's pipe, so an idle one reads the end
  of its pipe when the parent is gone;
* sends back `fn`'s error as text: the parent raises it, naming the item.

(`concurrent.futures.ProcessPoolExecutor` did this before: on Ctrl-C it printed a
traceback and waited for the seeds in its queue, its workers orphaned by a SIGKILL of
the sweep waited forever for more.)

A worker that dies (a SIGKILL, the OOM killer) is reaped and another started in its
place; the item it was running gives `died(item, how)` (a sweep reports the seed as
failed and goes on), or without `died` a `WorkerError` naming the item.
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
STOPPING = {signal.SIGINT, signal.SIGTERM}
"""The signals that stop a sweep: blocked while a worker starts."""


class WorkerError(RuntimeError):
    """A worker's `fn` raised (its traceback, and the item), or a worker died while it
    ran an item and no `died` says what to make of that."""


def _how(exitcode: int | None) -> str:
    """How a process ended, in words: `signal 9, SIGKILL`, `exit code 1`."""
    if exitcode is None:
        return "unknown"
    if exitcode < 0:
        with contextlib.suppress(ValueError):
            return f"signal {-exitcode}, {signal.Signals(-exitcode).name}"
        return f"signal {-exitcode}"
    return f"exit code {exitcode}"


class _Worker:
    """One worker process and the parent's end of its pipe."""

    def __init__(self, pipe: Connection, process: BaseProcess) -> None:
        self.pipe = pipe
        self.process = process


class Workers(Generic[T, R]):
    def __init__(
        self, jobs: int, fn: Callable[[T], R], died: Callable[[T, str], R] | None = None
    ) -> None:
        """`jobs` workers running `fn`. `died(item, how)`: what `map` yields for an item
        whose worker died while it ran it (`how`: "signal 9, SIGKILL", "exit code 1"),
        the dead worker reaped and a new one started; without it, `map` raises
        `WorkerError` naming the item."""
        # fork: a worker's parent is this process (what PR_SET_PDEATHSIG watches), and
        # it starts at once; spawn where there is no fork
        self._context = (
            multiprocessing.get_context("fork")
            if "fork" in multiprocessing.get_all_start_methods()
            else multiprocessing.get_context("spawn")
        )
        self._fn = fn
        self._died = died
        self._parent = os.getpid()
        self._workers: list[_Worker] = []
        try:
            for _ in range(jobs):
                self._start()
        except BaseException:  # a Ctrl-C meanwhile: no `with` ends those started
            self.stop(kill=True)
            raise

    def _start(self) -> _Worker:
        """Start a worker with SIGINT and SIGTERM blocked: one that comes meanwhile
        is handled once the worker is counted among `_workers` (in this process) and
        once the worker has set its own dispositions (in the worker, which would
        otherwise run this process's handlers)."""
        mine, theirs = self._context.Pipe()
        others = [w.pipe for w in self._workers] + [mine]
        process = self._context.Process(
            target=_serve, args=(theirs, self._fn, self._parent, others), daemon=True
        )
        before = signal.pthread_sigmask(signal.SIG_BLOCK, STOPPING)
        try:
            process.start()
            theirs.close()
            self._workers.append(_Worker(mine, process))
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, before)
        return self._workers[-1]

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
        for worker in self._workers:
            worker.pipe.close()
        processes = [w.process for w in self._workers]
        if kill:
            for process in processes:
                if process.is_alive():
                    process.kill()
        deadline = time.monotonic() + STOP_S
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join(1.0)

    def map(self, items: Iterable[T]) -> Iterator[R]:
        """`fn(item)` for each item, in order, each run in the next idle worker. A
        worker that dies is reaped and replaced (while items are left); the item it
        was running gives `died(item, how)`."""
        todo = enumerate(items)
        left = True
        idle = list(self._workers)
        busy: dict[_Worker, tuple[int, T]] = {}
        results: dict[int, R] = {}
        given = 0
        while True:
            while idle and left:
                item = next(todo, None)
                if item is None:
                    left = False
                    break
                worker = idle.pop()
                busy[worker] = item
                # a worker that died idle: its sentinel says so below, and its item
                # counts as the one it died running
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    worker.pipe.send(item[1])
            while given in results:
                yield results.pop(given)
                given += 1
            if not busy:
                return
            ready = wait([*(w.pipe for w in busy), *(w.process.sentinel for w in self._workers)])
            for worker in list(self._workers):
                if worker in busy and (worker.pipe in ready or worker.process.sentinel in ready):
                    answer = _answer(worker.pipe)
                    if answer is not None:
                        index, ran = busy.pop(worker)
                        failed, value = answer
                        if failed:
                            raise WorkerError(f"a worker failed running {ran!r}:\n{value}")
                        results[index] = value
                        idle.append(worker)
                if worker.process.sentinel not in ready:
                    continue
                how = self._reap(worker)
                if worker in idle:
                    idle.remove(worker)
                if left:
                    idle.append(self._start())
                if worker in busy:
                    index, ran = busy.pop(worker)
                    if self._died is None:
                        raise WorkerError(f"a worker died running {ran!r} ({how})")
                    results[index] = self._died(ran, how)

    def _reap(self, worker: _Worker) -> str:
        """Wait for a worker that ended (its sentinel is ready); how it ended."""
        self._workers.remove(worker)
        worker.pipe.close()
        worker.process.join(STOP_S)
        if worker.process.is_alive():  # (its sentinel closed, and it lives on)
            worker.process.kill()
            worker.process.join(1.0)
        return _how(worker.process.exitcode)


def _answer(pipe: Connection) -> tuple[bool, Any] | None:
    """A worker's answer, if its pipe holds one (None: it ended without one)."""
    try:
        if not pipe.poll():
            return None
        answer: tuple[bool, Any] = pipe.recv()
    except (EOFError, OSError):
        return None
    return answer


def _serve(pipe: Connection, fn: Callable[[Any], Any], parent: int, others: list[Any]) -> None:
    """A worker: run `fn` on each item its pipe brings, until the pipe ends."""
    # started with STOPPING blocked: a Ctrl-C that came since is dropped (ignored), a
    # SIGTERM ends the worker as any SIGTERM of it does; neither runs a handler of
    # the parent's
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOPPING)
    for other in others:  # the parent's ends: the parent alone holds them
        other.close()
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
