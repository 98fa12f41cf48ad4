"""PySpark source and sink for quorumq queues: `spark_source.register(spark)`, then
`spark.readStream.format("quorumq")`, `spark.read.format("quorumq")` and
`df.writeStream.format("quorumq")`."""

from __future__ import annotations

from typing import Any

from .options import OptionError
from .reading import DataLossError
from .source import QuorumqDataSource
from .workers import WorkerPythonError, ensure_workers_import_quorumq


def register(
    spark: Any, *, use_driver_python: bool | None = None, check_timeout_s: float = 300.0
) -> None:
    """Register the `quorumq` format in `spark`'s session. Without a `partitions`
    option, a read uses the session's default parallelism as its number of key buckets.

    First one task checks that Spark's Python workers import quorumq. If they cannot,
    they are switched to this interpreter when `use_driver_python` (default: in local
    mode, where the workers run on this machine); otherwise `WorkerPythonError` says
    which PYSPARK_PYTHON to set, rather than a query failing later inside a task. With no
    executor free to run that task within `check_timeout_s`, it is cancelled and
    `WorkerPythonError` says so (it waited for ever on a cluster with no executors)."""
    ensure_workers_import_quorumq(spark, use_driver_python, check_timeout_s)
    try:
        parallelism = int(spark.sparkContext.defaultParallelism)
    except Exception:  # Spark Connect sessions have no SparkContext
        parallelism = int(spark.conf.get("spark.default.parallelism", "2"))
    source = type(
        "QuorumqDataSource",
        (QuorumqDataSource,),
        {"default_partitions": max(1, parallelism), "__module__": __name__},
    )
    spark.dataSource.register(source)


__all__ = [
    "DataLossError",
    "OptionError",
    "QuorumqDataSource",
    "WorkerPythonError",
    "register",
]
