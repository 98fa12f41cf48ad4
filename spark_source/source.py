"""The `quorumq` data source: `spark.readStream`, `spark.read`, `writeStream` and `write`.

Offsets are JSON dicts `{"group": ..., "offset": n, "buckets": k}`: the next offset to
read, the query's group id, and the number of key buckets the batch was planned with.
The group id is made once, by `initialOffset` when a new query starts without a
checkpoint, and from then on travels inside every offset Spark stores in the checkpoint.
So it names the checkpoint: a restarted query gets it back from its offset log, and
`commit(end)` records the query's progress under it with `commit_offset`, where `quorumq
status` shows it.

A micro-batch is an offset range [start, end) of committed messages (`end` is what some
node has applied), split into one input partition per key bucket. A restarted query
re-plans exactly the range of its offset log, and the data at an offset never changes,
so it reads the same rows again.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    DataSourceStreamWriter,
    DataSourceWriter,
    InputPartition,
)
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    ReadMinRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

import quorumq
from quorumq.client import Client, QuorumqError, ReadResult

from .options import OptionError, ReadOptions, check_options, read_options, write_options
from .reading import BucketRange, check_retained, plan, read_partition, read_range
from .sink import QuorumqBatchWriter, QuorumqStreamWriter

logger = logging.getLogger(__name__)

SCHEMA = "offset long, key string, value binary, timestamp timestamp, queue string, partition int"
SCHEMA_WITH_HEADERS = (
    "offset long, key string, value binary, headers map<string,string>, timestamp timestamp, "
    "queue string, partition int"
)


class QueueEnds:
    """The queue's retained range as the planning client's node has committed it."""

    def __init__(self, options: ReadOptions) -> None:
        self.options = options
        self._client: Client | None = None

    def client(self) -> Client:
        if self._client is None:
            self._client = quorumq.connect(
                list(self.options.endpoints), self.options.token, tls=self.options.tls
            )
        return self._client

    def bounds(self) -> ReadResult:
        """An empty read: `first_retained` and `next_offset` of the queue."""
        return self.client().read(self.options.queue, 0, 0)

    def resolve_start(self) -> int:
        """The first offset to read, from startingOffsets or startingTimestamp."""
        options = self.options
        bounds = self.bounds()
        if options.starting_timestamp is not None:
            return self.first_at_or_after(options.starting_timestamp, bounds)
        if options.starting_offsets == "earliest":
            return bounds.first_retained
        if options.starting_offsets == "latest":
            return bounds.next_offset
        return int(options.starting_offsets)

    def first_at_or_after(self, timestamp_ms: int, bounds: ReadResult) -> int:
        """Binary search by enqueue time (the machine's clock never runs back)."""
        lo, hi = bounds.first_retained, bounds.next_offset
        while lo < hi:
            mid = (lo + hi) // 2
            found = read_range(self.options, mid, mid + 1)  # [offset, key, body, headers, ts_ms]
            if not found or found[0][4] < timestamp_ms:  # (none: trimmed meanwhile, so later)
                lo = mid + 1
            else:
                hi = mid
        return lo

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


class QuorumqStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):  # type: ignore[misc]
    def __init__(self, options: ReadOptions, buckets: int, schema: StructType) -> None:
        self.options = options
        self.buckets = buckets
        self.schema = schema
        self.ends = QueueEnds(options)
        self.available_now_end: int | None = None
        self.waiting_since: float | None = None
        """When new offsets, fewer than minOffsetsPerTrigger, were first seen."""

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "ends": None}  # executors never plan

    def initialOffset(self) -> dict[str, Any]:  # noqa: N802
        group = f"{self.options.group_id_prefix}-{uuid.uuid4().hex}"
        return {"group": group, "offset": self.ends.resolve_start(), "buckets": self.buckets}

    def getDefaultReadLimit(self) -> ReadLimit:  # noqa: N802
        if self.options.max_offsets_per_trigger is not None:
            return ReadMaxRows(self.options.max_offsets_per_trigger)
        if self.options.min_offsets_per_trigger is not None:
            return ReadMinRows(self.options.min_offsets_per_trigger)
        return ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:  # noqa: N802
        self.available_now_end = self.ends.bounds().next_offset

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:  # noqa: N802
        begin = int(start["offset"])
        latest = self.ends.bounds().next_offset
        if self.available_now_end is not None:
            latest = min(latest, self.available_now_end)
        end = max(begin, latest)
        if not isinstance(limit, ReadAllAvailable):
            maximum = self.options.max_offsets_per_trigger
            if isinstance(limit, ReadMaxRows):
                maximum = limit.max_rows
            minimum = self.options.min_offsets_per_trigger
            if isinstance(limit, ReadMinRows):
                minimum = limit.min_rows
            if minimum is not None and self.available_now_end is None:
                end = self._enough(begin, end, minimum)
            if maximum is not None:
                end = min(end, begin + maximum)
        # The plan's bucket count goes into the offset log with the batch's end: a batch
        # replayed after a restart with other cores or another `partitions` option is
        # planned as it first was, so each sink task writes the same rows again.
        # With nothing new the offset stays exactly as it was (another bucket count alone
        # would look like new data to Spark and start an empty batch).
        if end == begin:
            return start
        return {"group": start["group"], "offset": end, "buckets": self.buckets}

    def _enough(self, begin: int, end: int, minimum: int) -> int:
        """`end`, or `begin` (no batch yet) while fewer than `minimum` new offsets have
        waited less than maxTriggerDelay, as the Kafka source does."""
        if end - begin >= minimum or end == begin:
            self.waiting_since = None
            return end
        now = time.monotonic()
        if self.waiting_since is None:
            self.waiting_since = now
        if now - self.waiting_since >= self.options.max_trigger_delay_s:
            self.waiting_since = None
            return end
        return begin

    def reportLatestOffset(self) -> dict[str, Any] | None:  # noqa: N802
        return None

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        """The batch's plan, with the bucket count stored in its end offset (checkpoints
        written before it was stored: the current count)."""
        buckets = int(end.get("buckets", self.buckets))
        return plan(self.options, int(start["offset"]), int(end["offset"]), buckets)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, BucketRange)
        return read_partition(partition, self.schema)

    def commit(self, end: dict[str, Any]) -> None:
        """Record the query's progress in the queue (its group's committed offset)."""
        try:
            self.ends.client().commit_offset(self.options.queue, end["group"], int(end["offset"]))
        except QuorumqError as e:  # progress is advisory: the checkpoint is the truth
            logger.warning("could not record progress %s in the queue: %s", end, e)

    def stop(self) -> None:
        self.ends.close()


class RefusedStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):  # type: ignore[misc]
    """A stream reader whose options were refused: every call raises their error."""

    def __init__(self, error: OptionError) -> None:
        self.error = error

    def initialOffset(self) -> dict[str, Any]:  # noqa: N802
        raise self.error

    def getDefaultReadLimit(self) -> ReadLimit:  # noqa: N802
        raise self.error

    def prepareForTriggerAvailableNow(self) -> None:  # noqa: N802
        raise self.error

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:  # noqa: N802
        raise self.error

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        raise self.error

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        raise self.error

    def commit(self, end: dict[str, Any]) -> None:
        raise self.error

    def stop(self) -> None:
        """Nothing was opened."""


class QuorumqBatchReader(DataSourceReader):  # type: ignore[misc]
    def __init__(self, options: ReadOptions, buckets: int, schema: StructType) -> None:
        self.options = options
        self.buckets = buckets
        self.schema = schema

    def partitions(self) -> Sequence[InputPartition]:
        ends = QueueEnds(self.options)
        try:
            start = ends.resolve_start()
            latest = ends.bounds()
            end = latest.next_offset
            if isinstance(self.options.ending_offsets, int):
                end = min(end, self.options.ending_offsets)
            if self.options.ending_timestamp is not None:
                end = ends.first_at_or_after(self.options.ending_timestamp, latest)
        finally:
            ends.close()
        if self.options.starting_timestamp is None:  # an explicit start that was trimmed
            check_retained(self.options, start, end, latest.first_retained)
        return plan(self.options, start, end, self.buckets)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, BucketRange)
        return read_partition(partition, self.schema)


class QuorumqDataSource(DataSource):  # type: ignore[misc]
    """`format("quorumq")`. Register it with `spark_source.register(spark)`."""

    default_partitions = 2
    """Key buckets when the `partitions` option is not given (register() sets it to the
    session's default parallelism)."""

    def __init__(self, options: dict[str, str]) -> None:
        """Spark makes the data source when a query is defined (`load()`, `start()`,
        `save()`): a misspelt or malformed option fails there, naming the option."""
        check_options(options)
        super().__init__(options)

    @classmethod
    def name(cls) -> str:
        return "quorumq"

    def _include_headers(self) -> bool:
        raw = str(self.options.get("includeHeaders", "false")).strip().lower()
        if raw not in ("true", "false"):
            raise OptionError(f"option 'includeHeaders' must be true or false, got {raw!r}")
        return raw == "true"

    def schema(self) -> str:
        return SCHEMA_WITH_HEADERS if self._include_headers() else SCHEMA

    def _buckets(self, options: ReadOptions) -> int:
        return options.partitions or self.default_partitions

    def reader(self, schema: StructType) -> DataSourceReader:
        options = read_options(self.options, batch=True)
        return QuorumqBatchReader(options, self._buckets(options), schema)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:  # noqa: N802
        """The stream's reader; for options that do not fit a streaming read, one that
        raises their OptionError when Spark first asks it something (raised here, PySpark
        buries it under an UnboundLocalError of its own)."""
        try:
            options = read_options(self.options, batch=False)
        except OptionError as e:
            return RefusedStreamReader(e)
        return QuorumqStreamReader(options, self._buckets(options), schema)

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:  # noqa: N802
        return QuorumqStreamWriter(write_options(self.options), schema)

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        """`df.write`: appends to the queue (a queue is never overwritten)."""
        if overwrite:
            raise OptionError(
                "a quorumq queue is only appended to: write with mode('append'), not overwrite"
            )
        return QuorumqBatchWriter(write_options(self.options), schema)
