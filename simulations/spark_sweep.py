"""`quorumq simulate sweep --spark MASTER`: the seeds as Spark tasks, on a cluster the user
already runs.

Each task runs its share of the seeds one after another and returns their outcomes
(verdict, summary, trace hash, the replay command of a failure: `Outcome`). The driver
reads them back partition by partition, in seed order, so the sweep prints what a local
sweep prints. A run depends on its seed and options alone, so a seed run on an executor
gives the same trace hash as on this machine.

The executors need quorumq (and so the simulator, `quorumq.simulations`) in the Python
their workers run: checked with one task before the sweep, as `spark_source.register`
does for queries. In local mode from a checkout, where the simulator is the top-level
`simulations` package, the workers are given the checkout on their PYTHONPATH.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Generator, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from .runner import Outcome, RunConfig, outcome

TASKS_PER_CORE = 4
"""Tasks per core of the cluster's default parallelism: a few per core, so a slow seed
holds one core less long, while each task still runs many seeds."""


class SparkSweepError(RuntimeError):
    """The sweep could not run on Spark: pyspark missing, executors without quorumq, or
    a Spark job that failed (its first line)."""


def run_seeds(configs: Iterable[tuple[int, RunConfig]]) -> Iterator[tuple[int, Outcome]]:
    """A task: its seeds, one after another (in an executor's Python worker)."""
    for index, config in configs:
        yield index, outcome(config)


def spark_sweep(
    configs: Sequence[RunConfig], master: str, *, tasks: int | None = None
) -> Generator[Outcome, None, None]:
    """The outcomes of `configs`, in their order, run as Spark tasks on `master`
    (`local[2]`, `spark://host:7077`, `yarn`, ...). Closing the generator (an interrupt,
    the first failure) cancels the Spark job and stops the session."""
    try:
        from pyspark.sql import SparkSession  # noqa: PLC0415
    except ImportError:
        raise SparkSweepError(
            "--spark needs pyspark: pip install 'quorumq[spark]' (and Java 17)"
        ) from None
    from spark_source.workers import (  # noqa: PLC0415
        WorkerPythonError,
        ensure_workers_import_quorumq,
    )

    if master.startswith("local"):
        _put_the_simulator_on_the_workers_path()
    try:
        spark = (
            SparkSession.builder.master(master)
            .appName(f"quorumq simulate sweep ({len(configs)} seeds)")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .getOrCreate()
        )
    except Exception as e:  # a master Spark cannot parse or reach, no Java
        raise SparkSweepError(f"could not start Spark on {master}: {_first_line(e)}") from None
    context = spark.sparkContext
    context.setLogLevel("ERROR")
    try:
        try:
            ensure_workers_import_quorumq(spark)
        except WorkerPythonError as e:
            raise SparkSweepError(str(e)) from None
        slices = tasks or max(1, min(len(configs), context.defaultParallelism * TASKS_PER_CORE))
        results = context.parallelize(list(enumerate(configs)), slices).mapPartitions(run_seeds)
        outcomes = _collect(context, results)
        if [index for index, _ in outcomes] != list(range(len(configs))):
            raise SparkSweepError(f"Spark returned {len(outcomes)} outcomes of {len(configs)}")
        for _, result in outcomes:
            yield result
    finally:
        context.cancelAllJobs()
        spark.stop()


def _collect(context: Any, results: Any) -> list[tuple[int, Outcome]]:
    """Every task's outcomes, the tasks run at once on the cluster's cores (Spark's
    `toLocalIterator` runs one partition at a time). The job runs in a thread of its own,
    in a job group, so that an interrupt here cancels it."""
    group = f"quorumq-simulate-{os.getpid()}-{threading.get_ident()}"
    done: list[Any] = []
    failed: list[BaseException] = []

    def run() -> None:
        context.setJobGroup(group, "quorumq simulate sweep", interruptOnCancel=True)
        try:
            done.extend(results.collect())
        except BaseException as e:  # handed to the caller's thread
            failed.append(e)

    worker = threading.Thread(target=run, name="quorumq-spark-sweep", daemon=True)
    worker.start()
    try:
        while worker.is_alive():
            worker.join(0.2)
    except BaseException:
        context.cancelJobGroup(group)
        raise
    if failed:
        raise SparkSweepError(f"the Spark job failed: {_first_line(failed[0])}")
    return done


def _put_the_simulator_on_the_workers_path() -> None:
    """In a checkout the simulator is the top-level `simulations`: local workers, which
    inherit this process's environment, get the checkout on their PYTHONPATH. (Installed,
    it is `quorumq.simulations`, importable wherever quorumq is.)"""
    package = Path(__file__).resolve().parent
    if package.parent.name == "quorumq":
        return
    root = str(package.parent)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([root, *paths])


def _first_line(error: BaseException) -> str:
    """The line of a Spark error that says what went wrong (a Python worker's last
    traceback line, else the first)."""
    text = str(error)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if line.endswith("Error") or "Error:" in line or "Exception:" in line:
            return line[:300]
    return (lines[0] if lines else type(error).__name__)[:300]
