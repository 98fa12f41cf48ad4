"""PySpark source and sink for quorumq queues: `spark_source.register(spark)`, then
`spark.readStream.format("quorumq")`, `spark.read.format("quorumq")` and
`df.writeStream.format("quorumq")`."""

from __future__ import annotations

from typing import Any

from .options import OptionError
from .reading import DataLossError
from .source import QuorumqDataSource


def register(spark: Any) -> None:
    """Register the `quorumq` format in `spark`'s session. Without a `partitions`
    option, a read uses the session's default parallelism as its number of key buckets."""
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


__all__ = ["DataLossError", "OptionError", "QuorumqDataSource", "register"]
