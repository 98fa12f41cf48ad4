"""Reading a range of a queue's stream view into Arrow, on whichever node answers.

This is what runs in Spark's executors, on a pickled copy of the reader: everything it
needs travels in the `BucketRange` partition, and it keeps no state between calls.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from operator import itemgetter
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.datasource import InputPartition
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import StructType

import quorumq
from quorumq.client import Client, QuorumqError, ReadResult, ServerError
from quorumq.client.core import Row

from .options import ReadOptions

logger = logging.getLogger(__name__)

ARROW_BATCH_ROWS = 50_000
"""Rows per Arrow record batch handed to Spark."""
CHUNK_OFFSETS = 20_000
"""Offsets read per request to a node: Spark takes one chunk while the next is read."""
RETRY_ELSEWHERE = frozenset({"lagging", "not_applied", "outcome_unknown"})
"""Errors after which another node may well answer the same read."""


class DataLossError(RuntimeError):
    """Offsets a query was to read were trimmed by the queue's retention first."""


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
) -> Iterator[tuple[int, int, ReadResult]]:
    """The committed messages of [start, end) (a range some node reported committed) as
    (lo, hi, result) chunks of `CHUNK_OFFSETS` offsets, each whole, in order. Chunks
    let Spark take one while the next is read. A node that lags or is down is left for
    the next one; the read fails only when every node failed the same chunk."""
    endpoints = rotated(options.endpoints, prefer)
    client: Client | None = None
    node = 0
    errors: list[str] = []
    position = start
    try:
        while position < end:
            hi = min(end, position + CHUNK_OFFSETS)
            endpoint = endpoints[node % len(endpoints)]
            try:
                if client is None:
                    client = quorumq.connect([endpoint], options.token, connect_timeout=1.0)
                result = client.read(
                    options.queue, position, hi, bucket, buckets, wait=options.read_wait_seconds
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
            yield position, hi, result
            position = hi
    finally:
        if client is not None:
            client.close()


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
        f"queue's retention before this query read them (the queue now starts at offset "
        f"{first_retained})"
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
        offsets, keys, bodies, headers, ts_ms = (list(map(itemgetter(i), chunk)) for i in range(5))
        n = len(chunk)
        columns: dict[str, Any] = {
            "offset": offsets,
            "key": keys,
            "value": bodies,
            "timestamp": pc.multiply(pa.array(ts_ms, pa.int64()), 1000),  # ms -> us
            "queue": [options.queue] * n,
            "partition": [bucket] * n,
        }
        if "headers" in arrow_schema.names:
            columns["headers"] = [list(h.items()) if h else None for h in headers]
        arrays = []
        for field in arrow_schema:
            data = columns[field.name]
            if isinstance(data, pa.Array):
                arrays.append(data.cast(field.type))
            else:
                arrays.append(pa.array(data, type=field.type))
        yield pa.RecordBatch.from_arrays(arrays, schema=arrow_schema)


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
    )
    for lo, hi, result in chunks:
        check_retained(options, lo, hi, result.first_retained)
        yield from arrow_batches(result.rows, options, partition.bucket, schema)
