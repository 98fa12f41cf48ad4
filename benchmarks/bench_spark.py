"""Rows/s read by Spark from a 3-node loopback cluster, next to the plain client.

    python -m benchmarks.bench_spark [--messages 200000] [--repeat 3]

The queue holds `--messages` messages of 100-byte values (keys from 1,000 distinct ones).
Measured, interleaved in each round so that drift on a shared machine hits all alike:

* plain: one blocking client reads the whole range (`read(queue, 0, n)`);
* streaming, 1 and 2 partitions: a `readStream` query with `trigger(availableNow=True)`
  reads the range in one micro-batch into the `noop` sink; rows/s over the micro-batch's
  `triggerExecution` time, and over the whole query (start to termination);
* batch: `spark.read` of the range into the `noop` sink (2 partitions).

A warm-up query runs first: the first micro-batch of a session pays for starting Python
workers and JIT-compiling Spark (about 15 s here), which is not the source's cost.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

from quorumq.embedded import Cluster

VALUE_BYTES = 100
KEYS = 1000


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
    spark: Any, cluster: Cluster, queue: str, messages: int, partitions: int
) -> tuple[float, float]:
    """(rows/s over the micro-batch, rows/s over the whole query)."""
    checkpoint = tempfile.mkdtemp(prefix="bench-spark-")
    try:
        began = time.perf_counter()
        query = (
            spark.readStream.format("quorumq")
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
    args = parser.parse_args()
    n = args.messages
    load_before = os.getloadavg()[0]
    spark = session()
    results: dict[str, list[float]] = {}
    try:
        with Cluster(3) as cluster:
            cluster.leader()
            fill(cluster, "bench", n)
            fill(cluster, "warm-up", 1000)
            streaming_read(spark, cluster, "warm-up", 1000, 2)
            batch_read(spark, cluster, "warm-up", 1000)
            for _ in range(args.repeat):
                results.setdefault("plain client", []).append(plain_read(cluster, "bench", n))
                for partitions in (1, 2):
                    batch_rate, whole_rate = streaming_read(spark, cluster, "bench", n, partitions)
                    name = f"streaming, {partitions} partition{'s' if partitions > 1 else ''}"
                    results.setdefault(f"{name} (micro-batch)", []).append(batch_rate)
                    results.setdefault(f"{name} (whole query)", []).append(whole_rate)
                results.setdefault("batch read, 2 partitions", []).append(
                    batch_read(spark, cluster, "bench", n)
                )
    finally:
        spark.stop()
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
