"""The `quorumq` sink, streaming and batch: rows (`key`, `value`, optional `headers`) into
a queue.

Effectively once without two-phase commit: every task writes under its own idempotent
producer id, `spark-<query id>-<batch id>-<partition>`, and numbers each row: by its
`offset` column when the input has one (a quorumq source's offsets, or any number
that increases within a partition), else by its position in the task. The query id
survives restarts from the checkpoint, and a replayed micro-batch re-reads the same
input range, so a replayed task sends the same producer id and numbers again, and the
queue answers the resends as duplicates instead of enqueueing them twice. A task that
died half-way resends what landed (recognised) and goes on with the rest.

Numbering by offset also holds when a replay reads fewer rows (a retention trim
between two attempts, with `failOnDataLoss=false`): each row keeps its number, where
numbering by position would shift the rest onto numbers already used, and drop them.

Spark runs batch b only once batch b-1 is in the checkpoint's commit log, so when batch
b commits, batch b-1 can never be replayed: `commit` then has the queue forget b-1's
producers (prefix `spark-<query id>-<b-1>-`), and only the latest batch's stay. The
prefix is sealed too: a zombie attempt of a b-1 task is refused, not written again.

A batch write (`df.write.format("quorumq")`) is effectively once per write job the same
way: its writer is made once, on the driver, with a new job id, and every attempt of a
task writes as `spark-write-<job id>-<partition>`, so a retried or speculative attempt's
rows are recognised. When the job commits (or aborts), the queue forgets its producers
and seals their prefix: an attempt that starts only then is refused, not written again.
A new `save()` is a new job: it writes its rows again.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

import attrs
from pyspark import TaskContext
from pyspark.sql.datasource import DataSourceStreamWriter, DataSourceWriter, WriterCommitMessage
from pyspark.sql.types import BinaryType, IntegerType, LongType, MapType, StringType, StructType

import quorumq
from quorumq.client import QuorumqError, ServerError
from quorumq.client.core import RETRIABLE
from quorumq.machine.machine import MAX_PRODUCERS

from .options import OptionError, WriteOptions

QUERY_ID_PROPERTY = "sql.streaming.queryId"
BATCH_ID_PROPERTY = "streaming.sql.batchId"

logger = logging.getLogger(__name__)

FORGET_ATTEMPTS = 3
"""Tries to forget a batch's producers when a leader change loses the command (it is
idempotent, so a repeat is harmless)."""


@attrs.frozen
class PartitionWritten(WriterCommitMessage):  # type: ignore[misc]
    """What one task wrote: its query, its producer id and how many rows."""

    query: str
    producer: str
    rows: int


def batch_prefix(query: str, batch: int | str) -> str:
    """The producer-id prefix of one micro-batch's tasks. The closing dash keeps batch 1
    from matching batches 10, 11, ... (the query id is a fixed-length UUID)."""
    return f"spark-{query}-{batch}-"


def check_sink_schema(schema: StructType) -> None:
    """`value` (binary or string) is required; `key` (string), `headers`
    (map<string,string>) and `offset` (long: numbers the rows) are optional; any other
    column is refused by name."""
    types = {f.name: f.dataType for f in schema.fields}
    if "value" not in types:
        raise OptionError(f"the quorumq sink needs a 'value' column; got {sorted(types)}")
    extra = sorted(set(types) - {"key", "value", "headers", "offset"})
    if extra:
        raise OptionError(
            f"the quorumq sink writes key, value and headers, numbered by offset; "
            f"drop or rename {extra}"
        )
    if "offset" in types and not isinstance(types["offset"], LongType | IntegerType):
        raise OptionError(f"column 'offset' must be a long, not {types['offset']}")
    if not isinstance(types["value"], BinaryType | StringType):
        raise OptionError(f"column 'value' must be binary or string, not {types['value']}")
    if "key" in types and not isinstance(types["key"], StringType):
        raise OptionError(f"column 'key' must be a string, not {types['key']}")
    headers = types.get("headers")
    if headers is not None and not (
        isinstance(headers, MapType)
        and isinstance(headers.keyType, StringType)
        and isinstance(headers.valueType, StringType)
    ):
        raise OptionError(f"column 'headers' must be map<string,string>, not {headers}")


def task_producer() -> tuple[str, str]:
    """This task's query id and producer id (the query, the micro-batch, the partition)."""
    context = TaskContext.get()
    if context is None:
        raise RuntimeError("the quorumq sink writes only inside a Spark task")
    query = context.getLocalProperty(QUERY_ID_PROPERTY)
    batch = context.getLocalProperty(BATCH_ID_PROPERTY)
    if not query or batch is None:
        raise RuntimeError("the quorumq sink writes only from a streaming query (writeStream)")
    return query, f"{batch_prefix(query, batch)}{context.partitionId()}"


def message_of(fields: Mapping[str, Any]) -> tuple[bytes, str | None, Mapping[str, str] | None]:
    value = fields["value"]
    if value is None:
        raise ValueError("the quorumq sink cannot write a row whose value is null")
    body = value.encode("utf-8") if isinstance(value, str) else bytes(value)
    headers = fields.get("headers")
    if headers:  # a null value is an absent header (the queue takes str values only)
        headers = {k: v for k, v in headers.items() if v is not None}
    return body, fields.get("key"), headers or None


def numbered_rows(rows: Iterator[Any]) -> Iterator[tuple[int, dict[str, Any]]]:
    """Each row's fields and its sequence number: its `offset` column, which must
    increase within the task, or else its position in the task."""
    previous: int | None = None
    for position, row in enumerate(rows):
        fields = row.asDict()
        if "offset" not in fields:
            yield position, fields
            continue
        offset = fields.pop("offset")
        if offset is None or offset < 0:
            raise ValueError(f"the quorumq sink numbers rows by 'offset'; got {offset!r}")
        if previous is not None and offset <= previous:
            raise ValueError(
                f"the quorumq sink numbers rows by 'offset', which must increase within a "
                f"partition; got {offset} after {previous} (drop the column to number rows "
                f"by position, or keep the source's partitioning)"
            )
        previous = offset
        yield offset, fields


class TooManyPartitionsError(RuntimeError):
    """A write has more partitions than the queue can hold producers for at once."""


def too_many_partitions(queue: str) -> str:
    return (
        f"queue {queue!r} remembers at most {MAX_PRODUCERS:,} producers, and a write takes "
        "one per partition until it commits: write with fewer partitions "
        "(df.coalesce(n)); rows written by the tasks that ran stay"
    )


def write_rows(options: WriteOptions, producer: str, iterator: Iterator[Any]) -> int:
    """Publish a task's rows as `producer`, numbered (see `numbered_rows`), in batches
    of `batchRows`; how many rows were sent (the queue drops the duplicates)."""
    rows = 0
    with quorumq.connect(list(options.endpoints), options.token, tls=options.tls) as client:
        chunk: list[tuple[bytes, str | None, Mapping[str, str] | None]] = []
        seqs: list[int] = []

        def send() -> None:
            # the task's first batch opens its producer: once the queue forgot the
            # producer (its batch committed, or evicted), a zombie attempt's later
            # batches are refused instead of landing again
            try:
                client.publish_batch(
                    options.queue, chunk, producer=producer, seqs=seqs, opens=rows == 0
                )
            except ServerError as e:
                if e.code == "too_many_producers":
                    raise TooManyPartitionsError(too_many_partitions(options.queue)) from e
                raise

        for seq, fields in numbered_rows(iterator):
            chunk.append(message_of(fields))
            seqs.append(seq)
            if len(chunk) >= options.batch_rows:
                send()
                rows += len(chunk)
                chunk, seqs = [], []
        if chunk:
            send()
            rows += len(chunk)
    return rows


def forget(options: WriteOptions, prefix: str) -> None:
    """Have the queue forget the producers whose id starts with `prefix`, and seal the
    prefix: an attempt of one of their tasks that starts late (a speculative copy, a
    zombie on an executor the driver gave up on) is refused (`producer_sealed`) instead
    of opening its producer anew and writing its rows a second time. A failure is only
    logged (the producers expire after 7 days of silence anyway)."""
    error: QuorumqError | None = None
    for _ in range(FORGET_ATTEMPTS):
        try:
            with quorumq.connect(list(options.endpoints), options.token, tls=options.tls) as client:
                client.forget_producers(options.queue, prefix, seal=True)
            return
        except QuorumqError as e:
            error = e
            if isinstance(e, ServerError) and e.code not in RETRIABLE:
                break
    logger.warning("could not forget the producers %s* of %s: %s", prefix, options.queue, error)


class QuorumqStreamWriter(DataSourceStreamWriter):  # type: ignore[misc]
    def __init__(self, options: WriteOptions, schema: StructType) -> None:
        check_sink_schema(schema)
        self.options = options

    def write(self, iterator: Iterator[Any]) -> PartitionWritten:
        query, producer = task_producer()
        return PartitionWritten(query, producer, write_rows(self.options, producer, iterator))

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:  # noqa: N803
        """Every task's rows are confirmed by the queue already. The batch before this
        one can no longer be replayed: forget its producers."""
        queries = {m.query for m in messages if isinstance(m, PartitionWritten)}
        if batchId < 1 or len(queries) != 1:
            return
        (query,) = queries
        forget(self.options, batch_prefix(query, batchId - 1))

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:  # noqa: N803
        """Rows that landed stay; a replay of the batch is recognised as duplicates."""


def job_prefix(job: str) -> str:
    """The producer-id prefix of one batch write job's tasks."""
    return f"spark-write-{job}-"


class QuorumqBatchWriter(DataSourceWriter):  # type: ignore[misc]
    """`df.write.format("quorumq").mode("append").save()`: effectively once per job."""

    def __init__(self, options: WriteOptions, schema: StructType) -> None:
        check_sink_schema(schema)
        self.options = options
        self.job = uuid.uuid4().hex
        """Made once, on the driver: every attempt of every task of this job has it."""

    def write(self, iterator: Iterator[Any]) -> PartitionWritten:
        context = TaskContext.get()
        if context is None:
            raise RuntimeError("the quorumq sink writes only inside a Spark task")
        partition = context.partitionId()
        if partition >= MAX_PRODUCERS:  # refused before it sends: it can never fit
            raise TooManyPartitionsError(too_many_partitions(self.options.queue))
        producer = f"{job_prefix(self.job)}{partition}"
        return PartitionWritten(self.job, producer, write_rows(self.options, producer, iterator))

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        """Every task's rows are confirmed by the queue; no attempt of this job can run
        again, so the queue forgets its producers."""
        forget(self.options, job_prefix(self.job))

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        """Rows that landed stay (no transaction spans the tasks); a new `save()` is a
        new job and writes them again. The producers are forgotten as on commit."""
        forget(self.options, job_prefix(self.job))
