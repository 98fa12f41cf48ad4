"""Rows/s read by Spark from a 3-node loopback cluster, next to the plain client.

    python -m benchmarks.bench_spark [--messages 200000] [--repeat 3] [--baseline REV]

The queue holds `--messages` messages of 100-byte values (keys from 1,000 distinct ones).
Measured, interleaved in each round so that drift on a shared machine hits all alike:

* plain: one blocking client reads the whole range (`read(queue, 0, n)`);
* streaming, 1 and 2 partitions: a `readStream` query with `trigger(availableNow=True)`
  reads the range in one micro-batch into the `noop` sink; rows/s over the micro-batch's
  `triggerExecution` time, and over the whole query (start to termination);
* batch: `spark.read` of the range into the `noop` sink (2 partitions).

With `--baseline REV`, the source as it was at git revision REV (its `spark_source`,
with this checkout's `quorumq`) reads too, as the format `quorumq_base`: a 1-partition
streaming read, interleaved with the others, so before and after are measured side by side
in one run.

A warm-up query runs first: the first micro-batch of a session pays for starting Python
workers and JIT-compiling Spark (about 15 s here), which is not the source's cost.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from quorumq.ops.local_cluster import Cluster

VALUE_BYTES = 100
KEYS = 1000
WARM_UP = 20_000
"""Messages of the warm-up queries (Python workers started, Spark's code compiled)."""


def fill(cluster: Cluster, queue: str, messages: int) -> None:
    client = cluster.client()
    client.declare(queue)
    value = os.urandom(VALUE_BYTES)
    for lo in range(0, messages, 1000):
        rows = [(value, f"key-{i % KEYS}") for i in range(lo, min(messages, lo + 1000))]
        client.publish_batch(queue, rows)
    for node in cluster.nodes:  # every replica has applied all of it
        cluster.client(node).read(queue, 0, messages, wait=30)


def plain_read(cluster: Cluster, queue: str, messages: int) -> float:
    client = cluster.client(cluster.nodes[1])
    began = time.perf_counter()
    got = len(client.read(queue, 0, messages, wait=30))
    elapsed = time.perf_counter() - began
    assert got == messages, got
    return messages / elapsed


def streaming_read(
    spark: Any,
    cluster: Cluster,
    queue: str,
    messages: int,
    partitions: int,
    source: str = "quorumq",
) -> tuple[float, float]:
    """(rows/s over the micro-batch, rows/s over the whole query)."""
    checkpoint = tempfile.mkdtemp(prefix="bench-spark-")
    try:
        began = time.perf_counter()
        query = (
            spark.readStream.format(source)
            .option("endpoints", ",".join(cluster.endpoints))
            .option("queue", queue)
            .option("startingOffsets", "earliest")
            .option("partitions", str(partitions))
            .load()
            .writeStream.format("noop")
            .option("checkpointLocation", checkpoint)
            .trigger(availableNow=True)
            .start()
        )
        assert query.awaitTermination(600), "the query did not finish"
        whole = time.perf_counter() - began
        progress = [p for p in query.recentProgress if p["numInputRows"]]
        rows = sum(p["numInputRows"] for p in progress)
        assert rows == messages, rows
        batch_s = sum(p["durationMs"]["triggerExecution"] for p in progress) / 1000
        return messages / batch_s, messages / whole
    finally:
        shutil.rmtree(checkpoint, ignore_errors=True)


def batch_read(spark: Any, cluster: Cluster, queue: str, messages: int) -> float:
    began = time.perf_counter()
    frame = (
        spark.read.format("quorumq")
        .option("endpoints", ",".join(cluster.endpoints))
        .option("queue", queue)
        .option("partitions", "2")
        .load()
    )
    frame.write.format("noop").mode("overwrite").save()
    return messages / (time.perf_counter() - began)


BASELINE_PACKAGE = "spark_source_base"


def extract_baseline(revision: str, into: Path) -> None:
    """`spark_source` as it was at `revision`, as the package `spark_source_base` in
    `into`, which goes on the PYTHONPATH of this process and of Spark's workers (its
    imports are relative, so the rename is all it takes)."""
    root = Path(__file__).resolve().parent.parent
    archive = subprocess.run(
        ["git", "-C", str(root), "archive", revision, "spark_source"],
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    (into / "spark_source").rename(into / BASELINE_PACKAGE)
    sys.path.insert(0, str(into))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(into), os.environ.get("PYTHONPATH", "")) if p
    )


def register_baseline(spark: Any) -> None:
    """The baseline's data source, as the format `quorumq_base`."""
    import importlib

    base = importlib.import_module(f"{BASELINE_PACKAGE}.source").QuorumqDataSource
    source = type(
        "BaselineDataSource",
        (base,),
        {"name": classmethod(lambda cls: "quorumq_base"), "__module__": __name__},
    )
    spark.dataSource.register(source)


def session() -> Any:
    from pyspark.sql import SparkSession

    import spark_source

    os.environ["PYSPARK_PYTHON"] = sys.executable
    spark = (
        SparkSession.builder.master("local[2]")
        .appName("quorumq-bench")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    spark_source.register(spark)
    return spark


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--baseline", metavar="REV", help="also read with spark_source at REV")
    args = parser.parse_args()
    n = args.messages
    load_before = os.getloadavg()[0]
    baseline_dir = tempfile.mkdtemp(prefix="bench-spark-baseline-")
    if args.baseline:
        extract_baseline(args.baseline, Path(baseline_dir))
    spark = session()
    if args.baseline:
        register_baseline(spark)
    results: dict[str, list[float]] = {}
    try:
        with Cluster(3) as cluster:
            cluster.leader()
            fill(cluster, "bench", n)
            fill(cluster, "warm-up", WARM_UP)
            streaming_read(spark, cluster, "warm-up", WARM_UP, 2)
            streaming_read(spark, cluster, "warm-up", WARM_UP, 1)
            if args.baseline:
                streaming_read(spark, cluster, "warm-up", WARM_UP, 1, "quorumq_base")
            batch_read(spark, cluster, "warm-up", WARM_UP)
            for _ in range(args.repeat):
                results.setdefault("plain client", []).append(plain_read(cluster, "bench", n))
                for partitions in (1, 2):
                    batch_rate, whole_rate = streaming_read(spark, cluster, "bench", n, partitions)
                    name = f"streaming, {partitions} partition{'s' if partitions > 1 else ''}"
                    results.setdefault(f"{name} (micro-batch)", []).append(batch_rate)
                    results.setdefault(f"{name} (whole query)", []).append(whole_rate)
                    if args.baseline and partitions == 1:
                        batch_rate, whole_rate = streaming_read(
                            spark, cluster, "bench", n, 1, "quorumq_base"
                        )
                        name = f"streaming, 1 partition, at {args.baseline}"
                        results.setdefault(f"{name} (micro-batch)", []).append(batch_rate)
                        results.setdefault(f"{name} (whole query)", []).append(whole_rate)
                results.setdefault("batch read, 2 partitions", []).append(
                    batch_read(spark, cluster, "bench", n)
                )
    finally:
        spark.stop()
        shutil.rmtree(baseline_dir, ignore_errors=True)
    plain = statistics.median(results["plain client"])
    print(
        f"\n{n:,} messages of {VALUE_BYTES} bytes, {args.repeat} interleaved rounds; "
        f"{platform.machine()}, {os.cpu_count()} cores, CPython {platform.python_version()}, "
        f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after\n"
    )
    print("| read | median rows/s | min-max | vs plain client |")
    print("|---|---:|---:|---:|")
    for name, rates in results.items():
        print(
            f"| {name} | {statistics.median(rates):,.0f} | {min(rates):,.0f}-{max(rates):,.0f} "
            f"| {statistics.median(rates) / plain:.0%} |"
        )


if __name__ == "__main__":
    main()
