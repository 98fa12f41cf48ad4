"""Reading a range of a queue's stream view into Arrow, on whichever node answers.

This is what runs in Spark's executors, on a pickled copy of the reader: everything it
needs travels in the `BucketRange` partition, and it keeps no state between calls.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Generator, Iterator, Sequence
from operator import itemgetter
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.datasource import InputPartition
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import StructType

import quorumq
from quorumq.client import Client, QuorumqError, ReadResult, ServerError
from quorumq.client.core import ReadColumns, Row

from .options import ReadOptions

logger = logging.getLogger(__name__)

ARROW_BATCH_ROWS = 50_000
"""Rows per Arrow record batch handed to Spark."""
CHUNK_OFFSETS = 20_000
"""Most offsets read per request to a node: Spark takes one chunk while the next is read."""
FIRST_CHUNK_OFFSETS = 1_000
"""Offsets of a partition's first chunk: Spark gets rows soon, and the next chunks are
sized by what this one weighed."""
CHUNK_BYTES = 4 * 1024 * 1024
"""About how many bytes of messages a chunk holds: a task keeps a chunk and the few read
ahead in memory, and a chunk is one Arrow batch (whose binary column holds < 2 GiB)."""
PREFETCH_CHUNKS = 2
"""Chunks read ahead of the one being turned into Arrow and handed to Spark."""
RETRY_ELSEWHERE = frozenset({"lagging", "node_reads_full", "not_applied", "outcome_unknown"})
"""Errors after which another node may well answer the same read."""


class DataLossError(RuntimeError):
    """Offsets a query was to read were trimmed by the queue's retention first (or went
    with the queue when it was deleted: one declared again carries on from its end)."""


class BucketRange(InputPartition):  # type: ignore[misc]
    """One input partition: offsets [start, end) of the queue, key bucket `bucket` of
    `buckets`. Rows of one key share a bucket, so they stay in offset order here."""

    def __init__(self, options: ReadOptions, start: int, end: int, bucket: int, buckets: int):
        super().__init__(bucket)
        self.options = options
        self.start = start
        self.end = end
        self.bucket = bucket
        self.buckets = buckets

    def __repr__(self) -> str:
        return (
            f"BucketRange({self.options.queue!r}, [{self.start}, {self.end}), "
            f"bucket {self.bucket} of {self.buckets})"
        )


def plan(options: ReadOptions, start: int, end: int, buckets: int) -> list[BucketRange]:
    """One partition per key bucket; none for an empty range."""
    if end <= start:
        return []
    return [BucketRange(options, start, end, b, buckets) for b in range(buckets)]


def rotated(endpoints: Sequence[str], first: int) -> list[str]:
    """Endpoints starting at `first` (mod their count): partitions spread over replicas."""
    n = len(endpoints)
    return [endpoints[(first + i) % n] for i in range(n)]


def read_chunks(
    options: ReadOptions,
    start: int,
    end: int,
    bucket: int | None = None,
    buckets: int | None = None,
    *,
    prefer: int = 0,
    columns: bool = False,
) -> Generator[tuple[int, int, ReadResult], None, None]:
    """The committed messages of [start, end) (a range some node reported committed) as
    (lo, hi, result) chunks, each whole, in order: the first of `FIRST_CHUNK_OFFSETS`
    offsets, the next sized to about `CHUNK_BYTES` by what the last weighed, at most
    `CHUNK_OFFSETS`. Chunks let Spark take one while the next is read. A node that lags
    or is down is left for the next one; the read fails only when every node failed the
    same chunk. `columns`: results column by column (`ReadResult.columns`)."""
    endpoints = rotated(options.endpoints, prefer)
    if buckets == 1:  # every message is in bucket 0 of 1: spare the node a crc32 per row
        bucket = buckets = None
    client: Client | None = None
    node = 0
    errors: list[str] = []
    position = start
    span = FIRST_CHUNK_OFFSETS
    try:
        while position < end:
            hi = min(end, position + span)
            endpoint = endpoints[node % len(endpoints)]
            try:
                if client is None:
                    client = quorumq.connect(
                        [endpoint], options.token, connect_timeout=1.0, tls=options.tls
                    )
                result = client.read(
                    options.queue,
                    position,
                    hi,
                    bucket,
                    buckets,
                    wait=options.read_wait_seconds,
                    columns=columns,
                )
            except QuorumqError as e:
                if isinstance(e, ServerError) and e.code not in RETRY_ELSEWHERE:
                    raise
                errors.append(f"{endpoint}: {e}")
                if len(errors) >= len(endpoints):
                    raise QuorumqError(
                        f"no node could serve offsets [{position}, {hi}) of queue "
                        f"{options.queue!r}: " + "; ".join(errors)
                    ) from None
                if client is not None:
                    client.close()
                    client = None
                node += 1
                continue
            errors.clear()
            weight = result_bytes(result)
            yield position, hi, result
            span = next_span(span, hi - position, weight)
            position = hi
    finally:
        if client is not None:
            client.close()


def result_bytes(result: ReadResult) -> int:
    """About what a read result weighs in memory: its bodies and a little per message."""
    if result.columns is not None:
        return len(result.columns.bodies) + 64 * len(result.columns.offsets)
    return sum(len(row[2]) + 64 for row in result.rows)


def next_span(span: int, offsets: int, weight: int) -> int:
    """The offsets of the next chunk: about `CHUNK_BYTES` at this chunk's bytes per offset
    (twice as many after an empty one), from 1 to `CHUNK_OFFSETS`."""
    if weight <= 0:
        return min(CHUNK_OFFSETS, 2 * span)
    return max(1, min(CHUNK_OFFSETS, CHUNK_BYTES * offsets // weight))


def read_range(
    options: ReadOptions,
    start: int,
    end: int,
    bucket: int | None = None,
    buckets: int | None = None,
) -> list[Row]:
    """The rows of a (small) committed range, from whichever node has them."""
    return [row for _, _, r in read_chunks(options, start, end, bucket, buckets) for row in r.rows]


def check_retained(options: ReadOptions, start: int, end: int, first_retained: int) -> None:
    """Fail (or, with failOnDataLoss=false, log) when retention trimmed part of a range."""
    if first_retained <= start or start >= end:
        return
    lost_until = min(first_retained, end)
    message = (
        f"offsets [{start}, {lost_until}) of queue {options.queue!r} were trimmed by the "
        f"queue's retention, or deleted with the queue, before this query read them (the "
        f"queue now starts at offset {first_retained})"
    )
    if options.fail_on_data_loss:
        raise DataLossError(
            message + "; set the option failOnDataLoss=false to skip them and go on"
        )
    logger.warning("%s; skipped (failOnDataLoss=false)", message)


def arrow_batches(
    rows: list[Row], options: ReadOptions, bucket: int, schema: StructType
) -> Iterator[pa.RecordBatch]:
    """The rows as Arrow record batches matching `schema` exactly."""
    arrow_schema = to_arrow_schema(schema, timezone="UTC")
    for lo in range(0, len(rows), ARROW_BATCH_ROWS):
        chunk = rows[lo : lo + ARROW_BATCH_ROWS]
        n = len(chunk)
        columns: dict[str, Any] = {
            "offset": list(map(itemgetter(0), chunk)),
            "key": list(map(itemgetter(1), chunk)),
            "value": list(map(itemgetter(2), chunk)),
            "timestamp": pc.multiply(pa.array(list(map(itemgetter(4), chunk)), pa.int64()), 1000),
            "queue": pa.repeat(pa.scalar(options.queue, pa.string()), n),  # ms -> us above
            "partition": pa.repeat(pa.scalar(bucket, pa.int32()), n),
        }
        if "headers" in arrow_schema.names:
            columns["headers"] = [list(h.items()) if h else None for h in map(itemgetter(3), chunk)]
        arrays = []
        for field in arrow_schema:
            data = columns[field.name]
            if isinstance(data, pa.Array):
                arrays.append(data.cast(field.type))
            else:
                arrays.append(pa.array(data, type=field.type))
        yield pa.RecordBatch.from_arrays(arrays, schema=arrow_schema)


Chunk = tuple[int, int, ReadResult]


def column_batch(
    columns: ReadColumns, options: ReadOptions, bucket: int, schema: StructType
) -> pa.RecordBatch:
    """A column-wise read result as one Arrow record batch matching `schema` exactly:
    the bodies become the binary column without a copy per body."""
    arrow_schema = to_arrow_schema(schema, timezone="UTC")
    n = len(columns.offsets)
    ends = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(columns.body_lengths, out=ends[1:])
    bodies = pa.LargeBinaryArray.from_buffers(
        pa.large_binary(), n, [None, pa.py_buffer(ends), pa.py_buffer(columns.bodies)]
    )
    data: dict[str, pa.Array] = {
        "offset": pa.array(columns.offsets, pa.int64()),
        "key": pa.array(columns.keys, pa.string()),
        "value": bodies,
        "timestamp": pc.multiply(pa.array(columns.ts_ms, pa.int64()), 1000),  # ms -> us
        "queue": pa.repeat(pa.scalar(options.queue, pa.string()), n),
        "partition": pa.repeat(pa.scalar(bucket, pa.int32()), n),
    }
    if "headers" in arrow_schema.names:
        headers = [list(h.items()) if h else None for h in columns.headers]
        data["headers"] = pa.array(headers, arrow_schema.field("headers").type)
    arrays = [data[field.name].cast(field.type) for field in arrow_schema]
    return pa.RecordBatch.from_arrays(arrays, schema=arrow_schema)


def prefetched(chunks: Generator[Chunk, None, None]) -> Iterator[Chunk]:
    """`chunks`, read up to `PREFETCH_CHUNKS` ahead by a thread: the node serves (and this
    process decodes) the next chunk while Spark takes the current one. The thread's error
    is raised here, in order; closing this generator stops the thread and waits for it."""
    ready: queue.Queue[Chunk | BaseException | None] = queue.Queue(PREFETCH_CHUNKS)
    stop = threading.Event()

    def put(item: Chunk | BaseException | None) -> bool:
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def fetch() -> None:
        try:
            for chunk in chunks:
                if not put(chunk):
                    return
            put(None)
        except BaseException as e:  # handed to the consumer, which raises it
            put(e)
        finally:
            chunks.close()  # its client, in this thread

    reader = threading.Thread(target=fetch, name="quorumq-prefetch", daemon=True)
    reader.start()
    try:
        while True:
            item = ready.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        reader.join()


def read_partition(partition: BucketRange, schema: StructType) -> Iterator[pa.RecordBatch]:
    """An input partition's rows, in offset order (executor side)."""
    options = partition.options
    chunks = read_chunks(
        options,
        partition.start,
        partition.end,
        partition.bucket,
        partition.buckets,
        prefer=partition.bucket,
        columns=True,
    )
    for lo, hi, result in prefetched(chunks):
        check_retained(options, lo, hi, result.first_retained)
        if result.columns is not None:
            if result.columns.offsets:
                yield column_batch(result.columns, options, partition.bucket, schema)
        else:  # a node of an earlier release answers rows
            yield from arrow_batches(result.rows, options, partition.bucket, schema)
