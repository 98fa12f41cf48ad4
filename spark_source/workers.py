"""Spark's Python workers must import quorumq: checked once, when the format is registered.

A query whose workers run another interpreter than the driver's (the `python3` on the
PATH, say, while quorumq lives in a virtual environment) otherwise fails deep inside a
task, with `ModuleNotFoundError: No module named 'msgpack'` and nothing saying what to
set. So `register()` runs one tiny task that imports the source in a worker. If that
fails and the workers run on this machine (local mode), they are switched to this
driver's interpreter: Spark reads the interpreter of a Python function when the function
is made (`SparkContext.pythonExec`), so the format registered next, and every UDF made
after it, runs there. Elsewhere (a cluster, Spark Connect) the driver cannot know what
the executors have, and registration fails at once with one sentence that says what to
set.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import uuid
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


class WorkerPythonError(RuntimeError):
    """Spark's Python workers cannot import quorumq (or what it needs), or no worker ran
    the check in time."""


CHECK_TIMEOUT_S = 300.0
"""How long `register()` waits for an executor to run its one-task check (it waited for
ever on a cluster with no executors; an executor that dynamic allocation starts may
take a minute or more to arrive)."""


def _probe_function() -> Callable[[Any], list[str]]:
    """A probe that cloudpickle sends by value (a nested function is not importable by
    name): unpickling it in a worker must not itself need quorumq."""

    def probe(_):  # type: ignore[no-untyped-def]  # hints would make Spark warn and guess a pandas UDF
        import sys  # noqa: PLC0415  (runs in the worker)

        try:
            import quorumq  # noqa: F401, PLC0415  (msgpack, attrs, trio, ...)
            import spark_source.source  # noqa: F401, PLC0415  (pyarrow, ...)
        except ImportError as e:
            return [sys.executable, f"{type(e).__name__}: {e}"]
        return [sys.executable, ""]

    return probe


def probe_workers(spark: Any, timeout_s: float = CHECK_TIMEOUT_S) -> tuple[str, str]:
    """(the worker's interpreter, why it cannot import the source or ""), from one task
    (an RDD task, which needs nothing but the interpreter; under Spark Connect a UDF).
    A worker that does not even start gives Spark's reason, shortened; no worker within
    `timeout_s` raises `WorkerPythonError` (the task is cancelled)."""
    outcome: list[tuple[str, str]] = []
    group = f"quorumq-worker-check-{uuid.uuid4().hex}"

    def run() -> None:
        with contextlib.suppress(Exception):  # Spark Connect: no SparkContext, no groups
            spark.sparkContext.setJobGroup(group, "quorumq: workers import quorumq?", True)
        outcome.append(_probe_once(spark))

    thread = threading.Thread(target=run, name="quorumq-worker-check", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if outcome:
        return outcome[0]
    with contextlib.suppress(Exception):  # Spark Connect
        spark.sparkContext.cancelJobGroup(group)
    raise WorkerPythonError(
        f"no Spark executor ran quorumq's one-task check within {timeout_s:g} s: the "
        "cluster has no executors (or none free); register once it has, or give "
        "register(spark, check_timeout_s=...) more time"
    )


def _probe_once(spark: Any) -> tuple[str, str]:
    probe = _probe_function()
    try:
        try:
            context = spark.sparkContext
        except Exception:  # Spark Connect: no SparkContext, no RDDs
            from pyspark.sql.functions import lit, udf  # noqa: PLC0415

            check = udf(probe, "array<string>")
            executable, error = spark.range(1).select(check(lit(0)).alias("p")).first()["p"]
        else:
            ((executable, error),) = context.parallelize([0], 1).map(probe).collect()
    except Exception as e:  # the worker did not start: wrong path, another Python version
        return "?", _first_reason(str(e))
    return executable, error


def _first_reason(message: str) -> str:
    """The line of a Spark error that says what went wrong, at most 200 characters."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    for line in lines:
        if "Error" in line or "Cannot run program" in line or "No such file" in line:
            return line[:200]
    return (lines[0] if lines else "the worker failed")[:200]


def worker_python(spark: Any) -> str | None:
    """The interpreter Spark starts Python workers with (None under Spark Connect, where
    the server decides)."""
    try:
        return str(spark.sparkContext.pythonExec)
    except Exception:  # Spark Connect sessions have no SparkContext
        return None


def is_local(spark: Any) -> bool:
    """Whether the executors run on this machine, where this interpreter exists."""
    try:
        return str(spark.sparkContext.master).startswith("local")
    except Exception:
        return False


def ensure_workers_import_quorumq(
    spark: Any, use_driver_python: bool | None = None, timeout_s: float = CHECK_TIMEOUT_S
) -> None:
    """Check that Spark's Python workers import the source; in local mode (or when
    `use_driver_python` is True) switch them to this interpreter if they cannot; else
    raise `WorkerPythonError` naming PYSPARK_PYTHON and the interpreter to use (or
    saying that no executor ran the check within `timeout_s`)."""
    switch = is_local(spark) if use_driver_python is None else use_driver_python
    executable, error = probe_workers(spark, timeout_s)
    if not error:
        return
    before = worker_python(spark) or executable
    if switch and before is not None and before != sys.executable:
        spark.sparkContext.pythonExec = sys.executable
        now, again = probe_workers(spark, timeout_s)
        if not again:
            logger.warning(
                "Spark's Python workers ran %s, which cannot import quorumq (%s); "
                "they now run this driver's interpreter, %s",
                before,
                error,
                now,
            )
            return
        spark.sparkContext.pythonExec = before
    where = "" if is_local(spark) else " on every executor"
    raise WorkerPythonError(
        f"Spark's Python workers run {before}, which cannot import quorumq ({error}): set "
        f"PYSPARK_PYTHON={sys.executable} (or another interpreter that has quorumq{where}) "
        f"before the SparkSession starts."
    )
