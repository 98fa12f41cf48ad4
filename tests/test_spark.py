"""The Spark source and sink against a real 3-node cluster, in one local SparkSession.

Each test uses its own queues on one module-wide cluster and its own checkpoint
directory. A query that must fail is awaited and its error message checked."""

from __future__ import annotations

import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from quorumq.machine.views import bucket_of
from quorumq.ops.local_cluster import Cluster

pytestmark = [pytest.mark.spark, pytest.mark.slow]

QUERY_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Cluster(3) as c:
        c.leader()
        yield c


@pytest.fixture
def checkpoint() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="quorumq-spark-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def endpoints(cluster: Cluster) -> str:
    return ",".join(cluster.endpoints)


def fill(cluster: Cluster, queue: str, count: int, keys: int = 7, **options: Any) -> None:
    client = cluster.client()
    client.declare(queue, **options)
    for lo in range(0, count, 500):
        batch = [
            (b"v%d" % i, f"k{i % keys}", {"n": str(i)}) for i in range(lo, min(count, lo + 500))
        ]
        client.publish_batch(queue, batch)


def stream(spark: Any, cluster: Cluster, queue: str, **options: str) -> Any:
    reader = spark.readStream.format("quorumq").option("endpoints", endpoints(cluster))
    reader = reader.option("queue", queue)
    for name, value in options.items():
        reader = reader.option(name, value)
    return reader.load()


def run_batches(
    frame: Any, checkpoint: Path, on_batch: Callable[[Any, int], None], **trigger: Any
) -> None:
    """Run a query with `foreachBatch(on_batch)` until it has read all (availableNow)."""
    query = (
        frame.writeStream.foreachBatch(on_batch)
        .option("checkpointLocation", str(checkpoint))
        .trigger(**(trigger or {"availableNow": True}))
        .start()
    )
    try:
        assert query.awaitTermination(QUERY_TIMEOUT_S), "the query did not finish"
    finally:
        query.stop()


def query_error(start: Callable[[], Any]) -> str:
    """The error message of a query that fails, at start or while running."""
    try:
        query = start()
        try:
            query.awaitTermination(QUERY_TIMEOUT_S)
        finally:
            query.stop()
    except Exception as e:  # Spark wraps the Python error in its own exception types
        return str(e)
    raise AssertionError("the query did not fail")


def test_rate_limited_batches_cover_exactly_the_expected_ranges(
    spark: Any, cluster: Cluster, checkpoint: Path
) -> None:
    fill(cluster, "ranges", 100)
    batches: dict[int, list[int]] = {}

    def record(frame: Any, batch_id: int) -> None:
        batches[batch_id] = [r.offset for r in frame.select("offset").collect()]

    source = stream(spark, cluster, "ranges", startingOffsets="earliest", maxOffsetsPerTrigger="30")
    run_batches(source, checkpoint, record)
    ranges = [(min(o), max(o) + 1, len(o)) for _, o in sorted(batches.items())]
    assert ranges == [(0, 30, 30), (30, 60, 30), (60, 90, 30), (90, 100, 10)]
    groups = cluster.client().status()["queues"]["ranges"]["committed_offsets"]
    (group,) = groups
    assert group.startswith("spark-quorumq-")
    assert groups[group] == 90  # Spark commits a batch's end when it plans the next one

    # the same checkpoint goes on from 100: new messages only
    fill_more = cluster.client()
    fill_more.publish_batch("ranges", [b"late-%d" % i for i in range(5)])
    batches.clear()
    run_batches(source, checkpoint, record)
    assert sorted(o for offsets in batches.values() for o in offsets) == list(range(100, 105))


def test_each_key_stays_in_one_partition_in_offset_order(
    spark: Any, cluster: Cluster, checkpoint: Path
) -> None:
    from pyspark.sql.functions import spark_partition_id

    fill(cluster, "order", 600, keys=13)
    rows: list[Any] = []

    def record(frame: Any, _batch_id: int) -> None:
        with_task = frame.withColumn("task", spark_partition_id())
        rows.extend(with_task.select("offset", "key", "partition", "task").collect())

    source = stream(
        spark,
        cluster,
        "order",
        startingOffsets="earliest",
        partitions="3",
        maxOffsetsPerTrigger="250",
    )
    run_batches(source, checkpoint, record)
    assert sorted(r.offset for r in rows) == list(range(600))
    by_task: dict[int, list[Any]] = {}
    for r in rows:  # collect() keeps each input partition's rows in their order
        by_task.setdefault(r.task, []).append(r)
        assert r.partition == bucket_of(r.key, r.offset, 3)
    for task_rows in by_task.values():
        per_key: dict[str, list[int]] = {}
        for r in task_rows:
            per_key.setdefault(r.key, []).append(r.offset)
        assert all(offsets == sorted(offsets) for offsets in per_key.values())
    tasks_of_key: dict[str, set[tuple[int, int]]] = {}
    assert {r.partition for r in rows} == {0, 1, 2}
    for r in rows:
        tasks_of_key.setdefault(r.key, set()).add(r.partition)
    assert all(len(buckets) == 1 for buckets in tasks_of_key.values())


def test_a_query_killed_mid_batch_rereads_the_same_range_after_restart(
    spark: Any, cluster: Cluster, checkpoint: Path
) -> None:
    fill(cluster, "replay", 200)
    sink: dict[int, list[int]] = {}  # idempotent: a replayed batch overwrites its entry
    attempts: list[tuple[int, int, int]] = []

    def crash_in_second_batch(frame: Any, batch_id: int) -> None:
        offsets = sorted(r.offset for r in frame.select("offset").collect())
        attempts.append((batch_id, offsets[0], offsets[-1]))
        if batch_id == 1 and len(attempts) == 2:
            raise RuntimeError("killed mid-batch")
        sink[batch_id] = offsets

    source = stream(spark, cluster, "replay", startingOffsets="earliest", maxOffsetsPerTrigger="70")
    message = query_error(
        lambda: (
            source.writeStream.foreachBatch(crash_in_second_batch)
            .option("checkpointLocation", str(checkpoint))
            .trigger(availableNow=True)
            .start()
        )
    )
    assert "killed mid-batch" in message
    run_batches(source, checkpoint, crash_in_second_batch)
    assert attempts == [(0, 0, 69), (1, 70, 139), (1, 70, 139), (2, 140, 199)]
    everything = [o for _, offsets in sorted(sink.items()) for o in offsets]
    assert everything == list(range(200))  # each offset exactly once
    assert len(cluster.client().status()["queues"]["replay"]["committed_offsets"]) == 1


def test_fail_on_data_loss_fails_clearly_or_skips_what_retention_trimmed(
    spark: Any, cluster: Cluster, checkpoint: Path
) -> None:
    fill(cluster, "trimmed", 100, retention_messages=40)
    source = stream(spark, cluster, "trimmed", startingOffsets="10")
    message = query_error(
        lambda: (
            source.writeStream.foreachBatch(lambda frame, _b: frame.count())
            .option("checkpointLocation", str(checkpoint / "strict"))
            .trigger(availableNow=True)
            .start()
        )
    )
    assert "offsets [10, 60) of queue 'trimmed' were trimmed" in message
    assert "failOnDataLoss=false" in message

    got: list[int] = []
    lenient = stream(spark, cluster, "trimmed", startingOffsets="10", failOnDataLoss="false")
    run_batches(
        lenient,
        checkpoint / "lenient",
        lambda f, _b: got.extend(r.offset for r in f.select("offset").collect()),
    )
    assert sorted(got) == list(range(60, 100))


def test_batch_read_of_an_offset_range(spark: Any, cluster: Cluster) -> None:
    fill(cluster, "batch", 50)
    frame = (
        spark.read.format("quorumq")
        .option("endpoints", endpoints(cluster))
        .option("queue", "batch")
        .option("startingOffsets", "10")
        .option("endingOffsets", "40")
        .option("includeHeaders", "true")
        .load()
    )
    assert frame.columns == ["offset", "key", "value", "headers", "timestamp", "queue", "partition"]
    rows = sorted(frame.collect(), key=lambda r: r.offset)
    assert [r.offset for r in rows] == list(range(10, 40))
    assert [bytes(r.value) for r in rows] == [b"v%d" % i for i in range(10, 40)]
    assert all(r.headers == {"n": str(r.offset)} and r.queue == "batch" for r in rows)
    assert all(r.key == f"k{r.offset % 7}" and r.timestamp is not None for r in rows)
    everything = spark.read.format("quorumq").option("endpoints", endpoints(cluster))
    assert everything.option("queue", "batch").load().count() == 50


def test_queue_to_spark_to_queue_restarted_midway_has_each_input_once(
    spark: Any, cluster: Cluster, checkpoint: Path
) -> None:
    """Restarted after a failed micro-batch with another parallelism (3 key buckets, then
    2): the replayed batch is planned as it first was (its bucket count is in the offset
    log), so each sink task sends the same rows under the same producer and sequence
    numbers. Planned anew, 600 inputs once gave 877 rows: 92 missing, 369 duplicated.
    A null header value is dropped (it once failed the query for good)."""
    from pyspark.sql.functions import col, create_map, lit, udf

    fill(cluster, "pipe-in", 300)
    cluster.client().declare("pipe-out")
    marker = checkpoint / "failed-once"
    partitions = ["3"]

    @udf("binary")
    def fail_once_at_250(offset, value):  # no type hints: with them Spark makes a pandas UDF
        if offset == 250 and not marker.exists():  # in an executor: the task dies
            marker.touch()
            raise RuntimeError("task killed mid-batch")
        return b"out-" + bytes(value)

    def start() -> Any:
        source = stream(
            spark,
            cluster,
            "pipe-in",
            startingOffsets="earliest",
            maxOffsetsPerTrigger="100",
            partitions=partitions[0],
        )
        headers = create_map(lit("source"), lit("spark"), lit("empty"), lit(None).cast("string"))
        return (
            source.select(
                col("offset"),  # numbers each row in the sink
                col("key"),
                fail_once_at_250(col("offset"), col("value")).alias("value"),
                headers.alias("headers"),
            )
            .writeStream.format("quorumq")
            .option("endpoints", endpoints(cluster))
            .option("queue", "pipe-out")
            .option("batchRows", "10")
            .option("checkpointLocation", str(checkpoint / "cp"))
            .trigger(availableNow=True)
            .start()
        )

    def output() -> list[Any]:
        return list(cluster.client().read("pipe-out", 0, 10_000))

    assert "task killed mid-batch" in query_error(start)  # in the third batch, [200, 300)
    assert len(output()) >= 200
    partitions[0] = "2"  # restarted with another parallelism
    query = start()  # replays the third batch: what landed before the crash is recognised
    assert query.awaitTermination(QUERY_TIMEOUT_S)
    assert len(output()) == 300
    # a crash after the sink wrote a whole batch but before Spark recorded it: replayed
    for name in ("2", ".2.crc"):
        (checkpoint / "cp" / "commits" / name).unlink()
    query = start()
    assert query.awaitTermination(QUERY_TIMEOUT_S)
    assert (checkpoint / "cp" / "commits" / "2").exists()
    out = output()
    bodies = [m.body for m in out]
    assert sorted(bodies) == sorted(b"out-v%d" % i for i in range(300))  # each exactly once
    assert all(m.headers == {"source": "spark"} for m in out)
    for key in {m.key for m in out}:  # and each key's messages in their input order
        numbers = [int(m.body[5:]) for m in out if m.key == key]
        assert numbers == sorted(numbers)


def test_a_sink_task_retried_after_a_retention_trim_writes_each_row_once(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With `failOnDataLoss=false`, a retention trim between two attempts of a task
    makes the retry read fewer rows. Numbered by position, the retry's rows took the
    numbers of rows the first attempt wrote, and were dropped as duplicates: here rows
    6 to 8 were lost. Numbered by their `offset` column, each row keeps its number."""
    from pyspark.sql import Row
    from pyspark.sql.types import BinaryType, LongType, StringType, StructField, StructType

    from spark_source import sink
    from spark_source.options import WriteOptions

    cluster.client().declare("trimmed-out")
    schema = StructType(
        [
            StructField("offset", LongType(), False),
            StructField("key", StringType()),
            StructField("value", BinaryType()),
        ]
    )
    options = WriteOptions(endpoints=tuple(cluster.endpoints), queue="trimmed-out", batch_rows=2)
    writer = sink.QuorumqStreamWriter(options, schema)
    monkeypatch.setattr(sink, "task_producer", lambda: ("query", "spark-query-0-0"))

    def rows(offsets: range) -> Iterator[Any]:
        return iter(Row(offset=o, key="k", value=b"row-%d" % o) for o in offsets)

    writer.write(rows(range(0, 6)))  # the first attempt dies after six rows landed
    written = writer.write(rows(range(3, 10)))  # the retry: 0..2 were trimmed meanwhile
    assert written.rows == 7
    bodies = [m.body for m in cluster.client().read("trimmed-out", 0, 100)]
    assert bodies == [b"row-%d" % o for o in range(10)]
    with pytest.raises(ValueError, match="must increase within a partition; got 4 after 7"):
        writer.write(rows(range(7, 3, -3)))


def test_the_sink_forgets_each_batchs_producers_once_the_next_batch_commits(
    spark: Any, cluster: Cluster, checkpoint: Path
) -> None:
    fill(cluster, "forget-in", 120)
    client = cluster.client()
    client.declare("forget-out")
    source = stream(
        spark, cluster, "forget-in", startingOffsets="earliest", maxOffsetsPerTrigger="30"
    )
    query = (
        source.select("key", "value")
        .writeStream.format("quorumq")
        .option("endpoints", endpoints(cluster))
        .option("queue", "forget-out")
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    try:
        assert query.awaitTermination(QUERY_TIMEOUT_S), "the query did not finish"
        last = query.lastProgress["batchId"]
    finally:
        query.stop()
    assert last == 3  # four batches of 30, each written by 2 partitions (7 keys in 2 buckets)
    assert len(client.read("forget-out", 0, 1000)) == 120
    # only the last batch's producers are left: it may still be replayed
    assert client.status()["queues"]["forget-out"]["producers"] == 2
    assert client.forget_producers("forget-out", f"spark-{query.id}-{last}-") == 2
    assert client.forget_producers("forget-out", f"spark-{query.id}-") == 0


def first_error(message: str) -> str:
    """The first `SomeError: ...` line of a Spark error message (past Spark's own tags)."""
    return next(
        line for line in message.splitlines() if re.match(r"[\w.]+(Error|Exception): ", line)
    )


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (
            {"maxOffsetPerTrigger": "10"},
            "spark_source.options.OptionError: unknown quorumq read or sink option(s) "
            "['maxoffsetpertrigger'] (did you mean 'maxOffsetsPerTrigger'?)",
        ),
        (
            {"maxOffsetsPerTrigger": "ten"},
            "spark_source.options.OptionError: option 'maxOffsetsPerTrigger' must be an "
            "integer, got 'ten'",
        ),
    ],
)
def test_a_misspelt_option_fails_at_start_with_the_option_error_first(
    spark: Any, cluster: Cluster, checkpoint: Path, options: dict[str, str], expected: str
) -> None:
    """Raised while the query is defined (Spark makes the data source at `load()`), not
    by the query's thread later, and not buried under PySpark's UnboundLocalError."""
    with pytest.raises(Exception) as caught:
        (
            stream(spark, cluster, "ranges", **options)
            .writeStream.foreachBatch(lambda _f, _b: None)
            .option("checkpointLocation", str(checkpoint))
            .start()
            .stop()
        )
    message = str(caught.value)
    assert first_error(message).startswith(expected)
    assert "UnboundLocalError" not in message


def test_a_misspelt_sink_option_fails_the_query_with_the_option_error_first(
    spark: Any, cluster: Cluster, checkpoint: Path
) -> None:
    """Spark makes a streaming sink in the query's thread, so this one fails as the
    query starts running."""
    fill(cluster, "misspelt-in", 5)
    cluster.client().declare("misspelt-out")
    message = query_error(
        lambda: (
            stream(spark, cluster, "misspelt-in", startingOffsets="earliest")
            .select("key", "value")
            .writeStream.format("quorumq")
            .option("endpoints", endpoints(cluster))
            .option("queue", "misspelt-out")
            .option("batchRow", "10")
            .option("checkpointLocation", str(checkpoint))
            .trigger(availableNow=True)
            .start()
        )
    )
    assert first_error(message).startswith(
        "spark_source.options.OptionError: unknown quorumq read or sink option(s) "
        "['batchrow'] (did you mean 'batchRows'?)"
    )
    assert "UnboundLocalError" not in message


def test_an_option_for_batch_reads_fails_a_stream_with_the_option_error_first(
    spark: Any, cluster: Cluster, checkpoint: Path
) -> None:
    """Only known to be wrong once Spark asks for a stream reader: the query fails as it
    starts, with the OptionError first."""
    message = query_error(
        lambda: (
            stream(spark, cluster, "ranges", endingOffsets="10")
            .writeStream.foreachBatch(lambda _f, _b: None)
            .option("checkpointLocation", str(checkpoint))
            .start()
        )
    )
    assert first_error(message) == (
        "spark_source.options.OptionError: option 'endingOffsets' is for batch reads "
        "(spark.read) only"
    )
    assert "UnboundLocalError" not in message


def test_a_query_written_for_kafka_runs_with_only_its_format_and_connection_changed(
    spark: Any, cluster: Cluster, checkpoint: Path
) -> None:
    """Kafka's option names, its JSON offsets included, as a Kafka query has them."""
    fill(cluster, "kafka-names", 60)
    batches: dict[int, list[int]] = {}

    def record(frame: Any, batch_id: int) -> None:
        batches[batch_id] = sorted(r.offset for r in frame.select("offset").collect())

    source = (
        spark.readStream.format("quorumq")  # was: "kafka"
        .option("kafka.bootstrap.servers", endpoints(cluster))  # was: the brokers
        .option("subscribe", "kafka-names")
        .option("startingOffsets", '{"kafka-names": {"0": 10, "1": 10}}')
        .option("maxOffsetsPerTrigger", "20")
        .option("failOnDataLoss", "false")
        .option("minPartitions", "2")
        .load()
    )
    run_batches(source, checkpoint, record)
    assert list(batches.values()) == [list(range(10, 30)), list(range(30, 50)), list(range(50, 60))]
    some = (
        spark.read.format("quorumq")
        .option("kafka.bootstrap.servers", endpoints(cluster))
        .option("subscribe", "kafka-names")
        .option("startingOffsets", '{"kafka-names": {"0": -2}}')
        .option("endingOffsets", '{"kafka-names": {"0": 25, "1": 25}}')
        .load()
    )
    assert sorted(r.offset for r in some.select("offset").collect()) == list(range(25))


@pytest.fixture(scope="module")
def bare_python() -> Iterator[str]:
    """A virtual environment's interpreter without quorumq or anything else installed:
    what Spark's workers run when PYSPARK_PYTHON is the system's python3."""
    import subprocess
    import sys

    where = Path(tempfile.mkdtemp(prefix="quorumq-bare-venv-"))
    try:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
        yield str(where / "bin" / "python")
    finally:
        shutil.rmtree(where, ignore_errors=True)


@pytest.fixture
def workers_run(spark: Any) -> Iterator[Callable[[str], None]]:
    """Sets the interpreter the session starts Python workers with; restores it after."""
    context = spark.sparkContext
    before = context.pythonExec

    def set_to(executable: str) -> None:
        context.pythonExec = executable

    try:
        yield set_to
    finally:
        context.pythonExec = before


def test_register_moves_local_workers_that_cannot_import_quorumq_to_the_driver_python(
    spark: Any, cluster: Cluster, bare_python: str, workers_run: Callable[[str], None]
) -> None:
    import sys

    import spark_source
    from spark_source.workers import probe_workers

    fill(cluster, "wrong-python", 20)
    workers_run(bare_python)
    executable, error = probe_workers(spark)
    assert (executable, error) == (bare_python, "ModuleNotFoundError: No module named 'attrs'")
    spark_source.register(spark)  # local mode: the workers may run this interpreter
    assert spark.sparkContext.pythonExec == sys.executable
    frame = spark.read.format("quorumq").option("endpoints", endpoints(cluster))
    assert frame.option("queue", "wrong-python").load().count() == 20


def test_register_fails_at_once_naming_pyspark_python_when_it_may_not_switch(
    spark: Any, cluster: Cluster, bare_python: str, workers_run: Callable[[str], None]
) -> None:
    import sys

    import spark_source

    workers_run(bare_python)
    with pytest.raises(spark_source.WorkerPythonError) as caught:
        spark_source.register(spark, use_driver_python=False)
    assert str(caught.value) == (
        f"Spark's Python workers run {bare_python}, which cannot import quorumq "
        f"(ModuleNotFoundError: No module named 'attrs'): set PYSPARK_PYTHON={sys.executable} "
        "(or another interpreter that has quorumq) before the SparkSession starts."
    )
    assert spark.sparkContext.pythonExec == bare_python  # left as it was


WRITE_RETRIED_JOB = '''
"""A batch write in a session that retries a failed task once (local[2,2]): the first
attempt of partition 0 dies after 25 of its rows, 20 of which landed (batchRows 10)."""
import sys
from pathlib import Path

from pyspark import TaskContext
from pyspark.sql import SparkSession

from spark_source.sink import QuorumqBatchWriter
from spark_source.source import QuorumqDataSource

endpoints, queue, marker = sys.argv[1:4]


def dies_after(rows, count):
    for n, row in enumerate(rows):
        if n == count:
            Path(marker).write_text(f"attempt 0 of partition 0 died after {count} rows")
            raise RuntimeError("task killed mid-partition")
        yield row


class DiesOnce(QuorumqBatchWriter):
    def write(self, iterator):
        context = TaskContext.get()
        if context.partitionId() == 0 and context.attemptNumber() == 0:
            iterator = dies_after(iterator, 25)
        return super().write(iterator)


class DyingSource(QuorumqDataSource):
    @classmethod
    def name(cls):
        return "quorumq-dies-once"

    def writer(self, schema, overwrite):
        plain = super().writer(schema, overwrite)
        return DiesOnce(plain.options, schema)


spark = SparkSession.builder.master("local[2,2]").config("spark.ui.enabled", "false").getOrCreate()
spark.sparkContext.setLogLevel("OFF")
try:
    spark.dataSource.register(DyingSource)
    rows = spark.range(0, 100, numPartitions=2).selectExpr(
        "concat('k', cast(id % 7 AS string)) AS key", "concat('row-', cast(id AS string)) AS value"
    )
    (
        rows.write.format("quorumq-dies-once")
        .mode("append")
        .option("endpoints", endpoints)
        .option("queue", queue)
        .option("batchRows", "10")
        .save()
    )
finally:
    spark.stop()
'''


def test_a_batch_write_whose_task_is_retried_lands_each_row_once(
    cluster: Cluster, tmp_path: Path
) -> None:
    """In a session that retries failed tasks (its own process: the shared session's
    local[2] fails a job at its first task failure), the first attempt of a task dies
    after 20 of its 50 rows landed. The retry writes as the same producer with the same
    numbers: the 20 are recognised, the other 30 land, and each row is there once."""
    import os
    import subprocess
    import sys

    client = cluster.client()
    client.declare("written-once")
    script, marker = tmp_path / "write_retried.py", tmp_path / "died"
    script.write_text(WRITE_RETRIED_JOB)
    job = subprocess.run(
        [sys.executable, str(script), endpoints(cluster), "written-once", str(marker)],
        capture_output=True,
        text=True,
        timeout=QUERY_TIMEOUT_S * 2,
        check=False,
        env={**os.environ, "PYSPARK_PYTHON": sys.executable},
    )
    assert job.returncode == 0, job.stderr[-3000:]
    assert marker.read_text() == "attempt 0 of partition 0 died after 25 rows"
    bodies = [m.body for m in client.read("written-once", 0, 1000)]
    assert sorted(bodies) == sorted(b"row-%d" % i for i in range(100))  # each exactly once
    assert client.status()["queues"]["written-once"]["producers"] == 0  # forgotten at commit


def test_an_attempt_that_starts_after_its_job_committed_writes_nothing(cluster: Cluster) -> None:
    """A batch write's commit forgets its producers; an attempt of one of its tasks that
    sends its first rows only then (a speculative copy, a zombie on an executor the
    driver gave up on) opened the producer anew and wrote its rows a second time. The
    commit seals the job's prefix now: that attempt is refused, and each row is there
    once. The same for a streaming micro-batch once the next one committed. (The
    sink's own functions, on a real cluster: Spark cannot be made to start an attempt
    after its job committed.)"""
    from pyspark.sql import Row
    from pyspark.sql.types import StringType, StructField, StructType

    from quorumq.client import ServerError
    from spark_source.options import write_options
    from spark_source.sink import (
        PartitionWritten,
        QuorumqBatchWriter,
        QuorumqStreamWriter,
        batch_prefix,
        write_rows,
    )

    client = cluster.client()
    client.declare("sealed")
    options = write_options({"endpoints": endpoints(cluster), "queue": "sealed"})
    schema = StructType([StructField("key", StringType()), StructField("value", StringType())])
    rows = [Row(key="k", value=f"row-{i}") for i in range(3)]

    writer = QuorumqBatchWriter(options, schema)
    producer = f"spark-write-{writer.job}-0"
    assert write_rows(options, producer, iter(rows)) == 3  # the task's first attempt
    writer.commit([])
    with pytest.raises(ServerError) as late:  # a late attempt of the same task
        write_rows(options, producer, iter(rows))
    assert late.value.code == "producer_sealed"
    assert [m.body for m in client.read("sealed", 0, 100)] == [b"row-0", b"row-1", b"row-2"]

    query = "0c5e2a6e-8a9f-4d0b-9a1e-3f6b2c1d4e5f"
    stream = QuorumqStreamWriter(options, schema)
    zombie = f"{batch_prefix(query, 4)}1"
    assert write_rows(options, zombie, iter(rows[:1])) == 1  # batch 4, partition 1
    stream.commit([PartitionWritten(query, f"{batch_prefix(query, 5)}0", 0)], 5)
    with pytest.raises(ServerError) as zombie_refused:
        write_rows(options, zombie, iter(rows[:1]))
    assert zombie_refused.value.code == "producer_sealed"
    assert len(client.read("sealed", 0, 100)) == 4


def test_a_write_with_no_producer_room_left_fails_saying_to_use_fewer_partitions(
    cluster: Cluster,
) -> None:
    """A queue that already remembers 10,000 producers, each active within the hour: a
    sink task's first batch was refused "try again later, or reuse a producer", which
    tells a Spark user nothing. It fails naming the limit and `coalesce` now."""
    import trio

    import quorumq.aio
    from spark_source.options import write_options
    from spark_source.sink import TooManyPartitionsError, write_rows

    client = cluster.client()
    client.declare("crowded")

    async def fill() -> None:
        async with quorumq.aio.connect(endpoints(cluster).split(",")) as aio:

            async def one(first: int) -> None:
                for i in range(first, 10_000, 50):
                    await aio.publish_batch(
                        "crowded", [b"x"], producer=f"p{i}", seqs=[0], opens=True
                    )

            async with trio.open_nursery() as nursery:
                for first in range(50):
                    nursery.start_soon(one, first)

    trio.run(fill)
    assert client.status()["queues"]["crowded"]["producers"] == 10_000
    options = write_options({"endpoints": endpoints(cluster), "queue": "crowded"})
    with pytest.raises(TooManyPartitionsError, match=r"coalesce"):
        write_rows(options, "spark-write-0123456789abcdef0123456789abcdef-0", iter([_row()]))


def _row() -> Any:
    from pyspark.sql import Row

    return Row(key="k", value="v")


def test_a_batch_write_appends_and_refuses_overwrite(spark: Any, cluster: Cluster) -> None:
    client = cluster.client()
    client.declare("appended")
    rows = spark.createDataFrame(
        [("k1", "a"), ("k2", "b"), ("k1", "c")], "key string, value string"
    ).coalesce(1)
    writer = rows.write.format("quorumq").option("endpoints", endpoints(cluster))
    writer.option("queue", "appended").mode("append").save()
    messages = client.read("appended", 0, 100)
    assert [(m.key, m.body) for m in messages] == [("k1", b"a"), ("k2", b"b"), ("k1", b"c")]
    with pytest.raises(Exception, match=r"only appended to: write with mode\('append'\)"):
        writer.option("queue", "appended").mode("overwrite").save()


def test_spark_reads_and_writes_a_cluster_that_serves_tls(spark: Any) -> None:
    """Turning on TLS turned off Spark: every reader and writer connected without it.
    A 3-node cluster serving TLS only: a batch write and a batch read with `tls` and
    `tlsCaFile`, and a read with Kafka's names for them."""
    with Cluster(3, tls=True) as secure:
        assert secure.tls_ca is not None
        client = secure.client()
        client.declare("secure")
        rows = spark.createDataFrame([("k1", "a"), ("k2", "b")], "key string, value string")
        writer = rows.coalesce(1).write.format("quorumq").option("endpoints", endpoints(secure))
        writer.option("queue", "secure").option("tlsCaFile", secure.tls_ca).mode("append").save()
        assert [(m.key, m.body) for m in client.read("secure", 0, 10)] == [
            ("k1", b"a"),
            ("k2", b"b"),
        ]
        read = spark.read.format("quorumq").option("endpoints", endpoints(secure))
        frame = read.option("queue", "secure").option("tls", "true")
        assert frame.option("tlsCaFile", secure.tls_ca).load().count() == 2
        kafka = (
            spark.read.format("quorumq")
            .option("kafka.bootstrap.servers", endpoints(secure))
            .option("subscribe", "secure")
            .option("kafka.security.protocol", "SSL")
            .option("kafka.ssl.truststore.type", "PEM")
            .option("kafka.ssl.truststore.location", secure.tls_ca)
        )
        assert sorted(bytes(r.value) for r in kafka.load().collect()) == [b"a", b"b"]
        plain = spark.read.format("quorumq").option("endpoints", endpoints(secure))
        plain = plain.option("queue", "secure").load()
        with pytest.raises(Exception, match=r"TLS|tls"):
            plain.count()  # without TLS: refused saying so (tls_required)


def test_register_with_no_executor_free_fails_in_bounded_time_saying_so(spark: Any) -> None:
    """register() waited for ever on a cluster with no executors: its check is one task.
    Here both of the session's task slots are held by a job that waits for a file."""
    import threading
    import time

    import spark_source
    from spark_source.workers import WorkerPythonError

    from .helpers import wait_for

    flags = Path(tempfile.mkdtemp(prefix="quorumq-slots-"))

    def hold(index: int, _: Any) -> list[int]:
        import os
        import time

        open(os.path.join(str(flags), f"started-{index}"), "w").close()
        while not os.path.exists(os.path.join(str(flags), "go")):
            time.sleep(0.05)
        return [index]

    job = spark.sparkContext.parallelize([0, 1], 2).mapPartitionsWithIndex(hold)
    holder = threading.Thread(target=job.collect)
    holder.start()
    try:
        wait_for(lambda: len(list(flags.glob("started-*"))) == 2, "both slots held", 60)
        started = time.monotonic()
        with pytest.raises(WorkerPythonError, match="no Spark executor ran"):
            spark_source.register(spark, check_timeout_s=3)
        assert time.monotonic() - started < 20
    finally:
        (flags / "go").touch()
        holder.join(60)
        shutil.rmtree(flags, ignore_errors=True)
    spark_source.register(spark)  # free again: it passes
