"""`quorumq simulate sweep --spark MASTER`: the seeds as Spark tasks, on a cluster the user
already runs.

The seeds are cut into tasks of a few seeds each. Every task is a Spark job of its own,
submitted at once (Spark queues what its cores cannot take yet), so the sweep gets its
outcomes as tasks finish and hands them on in seed order: the report, the progress and
the early stop at a first failure are a local sweep's, and Ctrl-C cancels what is left.
A task returns each seed's outcome (verdict, trace hash, and for a failing seed its
summary and replay command); a seed whose run raises is a failing seed, not a failed
task. A run depends on its seed and options alone, so with the same quorumq on the
executors a seed gives the trace hash it gives here.

The executors need quorumq, and the simulator under the name this process knows it
by: one task checks both first (in local mode, Spark's workers are switched to this
interpreter if theirs lacks quorumq, as `spark_source.register` does). A checkout's
simulator is the top-level `simulations`; its local workers get the checkout on their
PYTHONPATH through `spark.executorEnv`.
"""

from __future__ import annotations

import math
import os
import queue
import threading
import traceback
from collections.abc import Generator, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs

from .runner import Outcome, RunConfig, no_result, outcome

SEEDS_PER_TASK = 25
"""At most this many seeds a task: small enough that a lost task costs little and a
large cluster's cores all get work, large enough that a task outweighs its scheduling."""
MIN_TASKS_PER_CORE = 4
"""At least this many tasks per core of the default parallelism (for short sweeps)."""
JOBS_AT_ONCE = 256
"""Tasks submitted at once at most (each waits in a driver thread of its own)."""


TEST_RAISE_ON_SEED = "QUORUMQ_SIM_TEST_RAISE_ON_SEED"
"""For tests only: a Spark task handed this seed raises instead of running it, as a
simulator bug would (read in the executors' workers, which inherit it in local mode)."""


class SparkSweepError(RuntimeError):
    """The sweep could not run on Spark: pyspark missing, executors without quorumq or
    the simulator, or a Spark job that failed (its first line)."""


def run_seeds(configs: Iterable[RunConfig]) -> Iterator[Outcome]:
    """A task: its seeds, one after another (in an executor's Python worker). A seed
    whose run raises fails with the exception; a passing seed comes back without its
    summary, which only a failing seed's report prints."""
    for config in configs:
        try:
            if os.environ.get(TEST_RAISE_ON_SEED) == str(config.seed):
                raise RuntimeError(f"{TEST_RAISE_ON_SEED} names seed {config.seed}")
            result = outcome(config)
        except Exception as e:
            yield _raised(config, e)
            continue
        yield attrs.evolve(result, summary="") if result.ok else result


def _raised(config: RunConfig, error: Exception) -> Outcome:
    where = traceback.extract_tb(error.__traceback__)[-1:]
    at = f" at {where[0].filename}:{where[0].lineno}" if where else ""
    why = f"seed {config.seed} raised {type(error).__name__}: {error}{at}"
    return no_result(config, why, violation_kinds={"raised": 1})


def spark_sweep(
    configs: Sequence[RunConfig], master: str, *, seeds_per_task: int = SEEDS_PER_TASK
) -> Generator[Outcome, None, None]:
    """The outcomes of `configs`, in their order, run as Spark tasks on `master`
    (`local[2]`, `spark://host:7077`, `yarn`, ...), each as soon as the tasks before it
    have come back. Closing the generator (an interrupt, the first failure) cancels the
    jobs left and stops the session, which the sweep starts and owns."""
    try:
        from pyspark.sql import SparkSession  # noqa: PLC0415
    except ImportError:
        raise SparkSweepError(
            "--spark needs pyspark: pip install 'quorumq[spark]' (and Java 17)"
        ) from None
    if SparkSession.getActiveSession() is not None:
        raise SparkSweepError("a SparkSession is already active here: the sweep starts its own")
    builder = (
        SparkSession.builder.master(master)
        .appName(f"quorumq simulate sweep ({len(configs)} seeds)")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
    )
    checkout = _checkout_root()
    if checkout is not None and master.startswith("local"):
        builder = builder.config("spark.executorEnv.PYTHONPATH", checkout)
    try:
        spark = builder.getOrCreate()
    except Exception as e:  # a master Spark cannot reach, no Java
        raise SparkSweepError(f"could not start Spark on {master}: {_first_line(e)}") from None
    context = spark.sparkContext
    group = f"quorumq-simulate-{os.getpid()}"
    try:
        context.setLogLevel("ERROR")
        _check_executors(spark)
        per_task = max(
            1,
            min(
                seeds_per_task,
                math.ceil(len(configs) / (context.defaultParallelism * MIN_TASKS_PER_CORE)),
            ),
        )
        chunks = [list(configs[i : i + per_task]) for i in range(0, len(configs), per_task)]
        yield from _in_order(context, group, chunks)
    finally:
        try:
            context.cancelJobGroup(group)
        finally:
            spark.stop()


def _in_order(context: Any, group: str, chunks: list[list[RunConfig]]) -> Iterator[Outcome]:
    """Each chunk's outcomes, chunk after chunk, every chunk a Spark job (at most
    `JOBS_AT_ONCE` waiting at once), in a job group that `cancelJobGroup` ends."""
    done: queue.Queue[tuple[int, list[Outcome] | BaseException]] = queue.Queue()
    claimed = iter(range(len(chunks)))
    lock = threading.Lock()
    stopping = threading.Event()

    def submit_until_done() -> None:
        try:
            context.setJobGroup(group, "quorumq simulate sweep", interruptOnCancel=True)
        except BaseException as e:  # no job will come from this thread: say so, not hang
            done.put((-1, e))
            return
        while not stopping.is_set():
            with lock:
                index = next(claimed, None)
            if index is None:
                return
            try:
                rdd = context.parallelize(chunks[index], 1).mapPartitions(run_seeds)
                done.put((index, list(rdd.collect())))
            except BaseException as e:  # handed to the caller's thread
                done.put((index, e))

    threads = [
        threading.Thread(target=submit_until_done, name="quorumq-spark-sweep", daemon=True)
        for _ in range(min(JOBS_AT_ONCE, len(chunks)))
    ]
    for thread in threads:
        thread.start()
    waiting: dict[int, list[Outcome]] = {}
    try:
        for index in range(len(chunks)):
            while index not in waiting:
                got, outcomes = done.get()
                if isinstance(outcomes, BaseException):
                    which = (
                        f"of seeds {chunks[got][0].seed}-{chunks[got][-1].seed} "
                        if got >= 0
                        else ""
                    )
                    raise SparkSweepError(f"the Spark job {which}failed: {_first_line(outcomes)}")
                waiting[got] = outcomes
            outcomes = waiting.pop(index)
            if [o.seed for o in outcomes] != [c.seed for c in chunks[index]]:
                raise SparkSweepError(f"the task of chunk {index} returned other seeds")
            yield from outcomes
    finally:
        stopping.set()


def _check_executors(spark: Any) -> None:
    """One task: the executors import quorumq (switching local workers to this
    interpreter if needed) and the simulator as this process names it."""
    from spark_source.workers import (  # noqa: PLC0415
        WorkerPythonError,
        ensure_workers_import_quorumq,
    )

    try:
        ensure_workers_import_quorumq(spark)
    except WorkerPythonError as e:
        raise SparkSweepError(str(e)) from None
    module = run_seeds.__module__

    def probe(_: Any) -> list[str]:
        import importlib  # noqa: PLC0415  (runs in the worker)

        try:
            importlib.import_module(module)
        except ImportError as e:
            return [f"{type(e).__name__}: {e}"]
        return [""]

    (error,) = spark.sparkContext.parallelize([0], 1).flatMap(probe).collect()
    if error:
        raise SparkSweepError(
            f"the executors cannot import {module} ({error}): install the same quorumq there "
            "as here (the simulator is quorumq.simulations in an installed quorumq; a "
            "checkout's top-level simulations reaches only local workers)"
        )


def _checkout_root() -> str | None:
    """The checkout holding the top-level `simulations` package, or None when the
    simulator is `quorumq.simulations` (installed)."""
    package = Path(__file__).resolve().parent
    return None if package.parent.name == "quorumq" else str(package.parent)


def _first_line(error: BaseException) -> str:
    """The line of a Spark error that says what went wrong (a Python worker's last
    error line, else the first)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    for line in reversed(lines):
        if line.endswith("Error") or "Error:" in line or "Exception:" in line:
            return line[:300]
    return (lines[0] if lines else type(error).__name__)[:300]
