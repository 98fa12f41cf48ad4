"""The reads the Spark source stands on, against real node processes: a replica answers
only what it has applied (committed), and when asked for a range known to be committed
it waits for the whole of it, or says it lags; it never answers part of it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from quorumq.client import QuorumqError, ServerError
from quorumq.ops.local_cluster import Cluster

from .helpers import wait_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Cluster(3) as c:
        c.leader()
        yield c


def test_a_lagging_replica_says_so_and_then_serves_the_whole_range(cluster: Cluster) -> None:
    leader = cluster.leader()
    lagging = next(n for n in cluster.nodes if n != leader)
    others = [n for n in cluster.nodes if n != lagging]
    writer = cluster.client(leader)
    writer.declare("lag")
    cluster.client(lagging).read("lag", 0, 0, wait=10)  # the declaration reached it
    cluster.kill(lagging)
    offsets = writer.publish_batch("lag", [b"m%d" % i for i in range(200)])
    assert offsets == list(range(200))  # committed by the other two
    for node in others:
        cluster.pause(node)
    try:
        cluster.restart(lagging)  # serving, but nobody can bring it up to date
        reader = cluster.client(lagging)
        with pytest.raises(ServerError, match=r"lagging: node \w does not know queue 'lag'"):
            reader.read("lag", 0, 200, wait=0.5)
        with pytest.raises(ServerError, match="unknown_queue"):  # without wait: at once
            reader.read("lag", 0, 200)
    finally:
        for node in others:
            cluster.resume(node)
    whole = reader.read("lag", 0, 200, wait=20)
    assert [m.body for m in whole] == [b"m%d" % i for i in range(200)]
    assert reader.node == lagging


def test_a_range_larger_than_a_frame_is_read_in_pages(cluster: Cluster) -> None:
    client = cluster.client()
    client.declare("big")
    body = b"x" * 4000
    for _ in range(4):
        client.publish_batch("big", [body] * 250)  # 4 MB in all
    read = client.read("big", 0, 1000, wait=10)
    assert [m.offset for m in read] == list(range(1000))
    bucket = client.read("big", 0, 1000, 1, 3, wait=10)
    assert [m.offset for m in bucket] == list(range(1, 1000, 3))  # keyless: offset % 3


def test_reads_of_a_missing_queue_or_a_wrong_bucket_end_in_a_clear_error(cluster: Cluster) -> None:
    with pytest.raises(ServerError, match="does not know queue 'no-such-queue'"):
        cluster.client().read("no-such-queue", 0, 10, wait=0.2)
    with pytest.raises(ServerError, match=r"invalid: bucket must be in \[0, 2\)"):
        cluster.client().read("big", 0, 10, 5, 2)


def test_starting_timestamp_finds_the_first_message_enqueued_at_or_after_it(
    cluster: Cluster,
) -> None:
    from spark_source.options import read_options
    from spark_source.source import QueueEnds

    client = cluster.client()
    client.declare("times")
    client.publish_batch("times", [b"early-%d" % i for i in range(40)])
    early_ts = client.read("times", 39, 40).rows[0][4]
    wait_for(lambda: time.time() * 1000 > early_ts + 2, "the clock to move on")
    client.publish_batch("times", [b"late-%d" % i for i in range(25)])
    late_ts = client.read("times", 40, 41).rows[0][4]
    assert late_ts > early_ts

    def start_at(timestamp_ms: int) -> int:
        options = {"endpoints": ",".join(cluster.endpoints), "queue": "times"}
        ends = QueueEnds(
            read_options({**options, "startingTimestamp": str(timestamp_ms)}, batch=False)
        )
        try:
            return ends.resolve_start()
        finally:
            ends.close()

    assert start_at(0) == 0
    assert start_at(early_ts + 1) == 40
    assert start_at(late_ts) == 40
    assert start_at(late_ts + 10**6) == 65  # later than everything: the end


def test_a_partition_read_moves_past_a_dead_node_and_fails_clearly_when_all_are(
    cluster: Cluster,
) -> None:
    from spark_source.options import read_options
    from spark_source.reading import read_chunks

    client = cluster.client()
    client.declare("dead")
    client.publish_batch("dead", [b"m%d" % i for i in range(30)])
    options = read_options(
        {"endpoints": ",".join(cluster.endpoints), "queue": "dead", "readWaitSeconds": "5"},
        batch=False,
    )
    # every replica has applied the range (if the victim led, the others would otherwise
    # wait for an election before they could serve it: a different test)
    seen: dict[str, object] = {}

    def applied_everywhere() -> bool:
        seen.update({n: cluster.status(n) for n in cluster.nodes})
        return all(
            s["queues"].get("dead", {}).get("next_offset") == 30  # type: ignore[index]
            for s in seen.values()
        )

    try:
        wait_for(applied_everywhere, "the range applied on every replica", 30)
    except AssertionError as e:
        keep = ("leader", "term", "commit_index", "machine_index", "connected")
        views = {n: {k: s[k] for k in keep} for n, s in seen.items()}  # type: ignore[index]
        raise AssertionError(f"{e}; the replicas: {views}") from None
    victim = cluster.nodes[0]
    cluster.kill(victim)
    try:
        chunks = list(read_chunks(options, 0, 30, prefer=0))  # prefers the dead node
        assert [row[0] for _, _, r in chunks for row in r.rows] == list(range(30))
        nowhere = read_options(
            {"endpoints": cluster.endpoint(victim), "queue": "dead"}, batch=False
        )
        with pytest.raises(QuorumqError, match=r"no node could serve offsets \[0, 30\)"):
            list(read_chunks(nowhere, 0, 30))
    finally:
        cluster.restart(victim)


def test_prefetched_chunks_come_in_order_and_the_readers_error_in_its_place() -> None:
    import threading

    from quorumq.client import ReadResult
    from spark_source.reading import prefetched

    def chunks() -> Any:
        for lo in range(0, 50, 10):
            yield lo, lo + 10, ReadResult(rows=[], first_retained=0, next_offset=lo + 10)
        raise QuorumqError("no node could serve offsets [50, 60)")

    got: list[int] = []
    with pytest.raises(QuorumqError, match=r"no node could serve offsets \[50, 60\)"):
        for lo, _hi, _result in prefetched(chunks()):
            got.append(lo)
    assert got == [0, 10, 20, 30, 40]
    assert not [t for t in threading.enumerate() if t.name == "quorumq-prefetch"]


def test_closing_prefetched_early_stops_its_thread_and_closes_the_chunks() -> None:
    import threading

    from quorumq.client import ReadResult
    from spark_source.reading import PREFETCH_CHUNKS, prefetched

    made: list[int] = []
    closed = threading.Event()

    def chunks() -> Any:
        try:
            for lo in range(0, 10_000, 10):
                made.append(lo)
                yield lo, lo + 10, ReadResult(rows=[], first_retained=0, next_offset=lo + 10)
        finally:
            closed.set()

    reading = prefetched(chunks())
    assert next(reading)[0] == 0
    wait_for(lambda: len(made) == PREFETCH_CHUNKS + 2, "the reader to fill its queue")
    reading.close()  # Spark stopped taking rows (a limit, a failed task)
    assert closed.is_set()  # its client closed, in the reader's thread
    assert not [t for t in threading.enumerate() if t.name == "quorumq-prefetch"]
    assert len(made) <= PREFETCH_CHUNKS + 2  # read ahead, but only so far


def test_a_read_by_columns_gives_the_messages_a_read_by_rows_does(cluster: Cluster) -> None:
    """Across reply pages (4 MB of bodies: pages hold 768 KiB), in a key bucket, with
    keyless, empty, headed and large messages."""
    client = cluster.client()
    client.declare("by-columns")
    for lo in range(0, 4000, 500):
        batch = [
            (b"" if i % 97 == 0 else b"%d" % i * (1 + i % 300), None if i % 5 else f"k{i % 11}")
            for i in range(lo, lo + 500)
        ]
        client.publish_batch("by-columns", batch)
    client.publish("by-columns", b"with headers", key="h", headers={"a": "1"})
    for bucket, buckets in ((None, None), (1, 3)):
        rows = client.read("by-columns", 0, 4001, bucket, buckets, wait=10)
        columns = client.read("by-columns", 0, 4001, bucket, buckets, wait=10, columns=True)
        assert columns.rows == [] and columns.columns is not None
        assert len(columns.columns.bodies) > 1024 * 1024 or bucket is not None
        assert columns.messages == rows.messages
        assert (columns.first_retained, columns.next_offset) == (0, 4001)


def test_chunks_are_sized_by_what_the_last_one_weighed() -> None:
    from spark_source.reading import CHUNK_BYTES, CHUNK_OFFSETS, next_span

    assert next_span(1000, 1000, 1000 * 1024) == CHUNK_BYTES // 1024  # 1 KiB an offset
    assert next_span(1000, 1000, 1000 * 100) == CHUNK_OFFSETS  # small: at most this many
    assert next_span(1000, 1000, 1000 * 8 * 1024 * 1024) == 1  # 8 MiB messages: one each
    assert next_span(1000, 1000, 0) == 2000  # nothing in that chunk (another bucket's)


def test_a_read_across_a_delete_never_takes_a_message_of_one_queue_for_the_others(
    cluster: Cluster,
) -> None:
    """A queue declared again under a deleted one's name carries on from its end: a
    query that had read part of the deleted queue fails with data loss (or skips, with
    failOnDataLoss=false) rather than read the new queue's messages under old offsets,
    and one that had read all of it goes on with the new one's."""
    from spark_source.options import read_options
    from spark_source.reading import DataLossError, check_retained, read_chunks

    client = cluster.client()
    client.declare("reborn")
    client.publish_batch("reborn", [b"old%d" % i for i in range(10)])
    client.delete_queue("reborn")
    client.declare("reborn")
    client.publish_batch("reborn", [b"new%d" % i for i in range(3)])
    options = read_options(
        {"endpoints": ",".join(cluster.endpoints), "queue": "reborn", "readWaitSeconds": "5"},
        batch=False,
    )

    def read(start: int, end: int) -> list[tuple[int, bytes]]:
        rows = []
        for lo, hi, result in read_chunks(options, start, end):
            check_retained(options, lo, hi, result.first_retained)
            rows += [(row[0], row[2]) for row in result.rows]
        return rows

    with pytest.raises(DataLossError, match=r"offsets \[4, 10\) .*deleted with the queue"):
        read(4, 13)  # a checkpoint of the deleted queue at offset 4
    assert read(10, 13) == [(10, b"new0"), (11, b"new1"), (12, b"new2")]
