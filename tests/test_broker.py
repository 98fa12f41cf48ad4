"""The broker end to end: clients against real node processes, and the failures a
user can cause (wrong token, oversized message, bad frames, a consumer that stops
reading). Every process is stopped by the test."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quorumq.client import Client, ConnectionLostError, KeyPausedError, ServerError
from quorumq.ops.local_cluster import Cluster
from quorumq.wire.protocol import PROTOCOL_VERSION, SCHEMA, FrameDecoder, auth_proof, encode_frame

from .helpers import wait_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster() -> object:
    with Cluster(3, token="s3cret-token", max_body=64 * 1024) as c:
        c.leader()
        yield c


def test_a_wrong_token_is_refused(cluster: Cluster) -> None:
    with pytest.raises(ServerError, match="auth_failed"):
        Client(cluster.endpoints, "not-the-token", connect_timeout=2)
    with pytest.raises(ServerError, match="requires a token"):
        Client(cluster.endpoints, None, connect_timeout=2)


def test_publish_consume_ack_and_nack(cluster: Cluster) -> None:
    client = cluster.client()
    client.declare("basic")
    assert [client.publish("basic", b"m%d" % i) for i in range(3)] == [0, 1, 2]
    consumer = cluster.client().subscribe("basic", prefetch=10)
    first = [consumer.get(timeout=10) for _ in range(3)]
    assert [d.body for d in first if d] == [b"m0", b"m1", b"m2"]
    first[0].nack(requeue=True)  # type: ignore[union-attr]
    again = consumer.get(timeout=10)
    assert again is not None and (again.offset, again.redelivered) == (0, True)
    for d in [again, first[1], first[2]]:
        d.ack()  # type: ignore[union-attr]
    wait_for(lambda: client.status()["queues"]["basic"]["unacked"] == 0, "all acked")


def test_prefetch_is_respected(cluster: Cluster) -> None:
    client = cluster.client()
    client.declare("prefetch")
    for i in range(10):
        client.publish("prefetch", b"%d" % i)
    consumer = cluster.client().subscribe("prefetch", prefetch=3)
    held = [consumer.get(timeout=10) for _ in range(3)]
    assert all(held)
    assert consumer.get(timeout=0.5) is None  # a fourth does not come before an ack
    held[0].ack()  # type: ignore[union-attr]
    assert consumer.get(timeout=10) is not None


def test_keys_stay_in_order_across_two_consumers(cluster: Cluster) -> None:
    client = cluster.client()
    client.declare("keys")
    a = cluster.client(cluster.nodes[0]).subscribe("keys", prefetch=5)
    b = cluster.client(cluster.nodes[1]).subscribe("keys", prefetch=5)
    sent = {
        k: [client.publish("keys", b"%s%d" % (k.encode(), i), key=k) for i in range(10)]
        for k in ("x", "y", "z")
    }
    seen: dict[str, list[int]] = {"x": [], "y": [], "z": []}
    deadline = time.monotonic() + 20
    while sum(map(len, seen.values())) < 30 and time.monotonic() < deadline:
        for consumer in (a, b):
            d = consumer.get(timeout=0.05)
            if d is not None:
                assert not d.redelivered
                seen[d.key].append(d.offset)  # type: ignore[index]
                d.ack()
    assert seen == sent


def test_retry_backoff_brings_a_key_back_in_order_after_a_doubling_delay(
    cluster: Cluster,
) -> None:
    """A consumer on a follower nacks; the queue's backoff (500 ms, doubling) holds the
    message and the key's later one back, and they come back in order."""
    client = cluster.client()
    client.declare("backoff", retry_backoff_ms=(500, 5_000))
    consumer = cluster.client("B").subscribe("backoff", prefetch=10)
    for key in ("k", "k", "x"):
        client.publish("backoff", key.encode(), key=key)
    first, _, other = [consumer.get(timeout=10) for _ in range(3)]
    assert first is not None and other is not None
    other.ack()
    nacked_at = time.monotonic()
    first.nack()  # 0 waits 500 ms, and 1 (the key's, held) with it
    again = [consumer.get(timeout=10) for _ in range(2)]
    waits = [time.monotonic() - nacked_at]
    assert [(d.offset, d.redelivered, d.delivery_count) for d in again if d] == [
        (0, True, 1),
        (1, True, 0),
    ]
    first, second = again
    assert first is not None and second is not None
    second.ack()
    nacked_at = time.monotonic()
    first.nack()  # its second failure: 1 s
    last = consumer.get(timeout=10)
    waits.append(time.monotonic() - nacked_at)
    assert last is not None and (last.offset, last.delivery_count) == (0, 2)
    last.ack()
    assert 0.5 <= waits[0] < 1.0 <= waits[1] < 5, waits


def test_purge_and_delete_a_queue_in_use_across_the_cluster(cluster: Cluster) -> None:
    """Purge takes the ready messages and leaves the held ones with their consumer (on a
    follower); a delete of the queue in use is refused, and forced it cancels that
    consumer with a clear reason and takes what it held, each message counted. Every
    replica agrees: the queue is gone everywhere, and declared again it is empty and
    carries on from the offset where the deleted one ended."""
    client = cluster.client()
    other = cluster.client()  # another producer, which knows nothing of the delete
    client.declare("doomed", retry_backoff_ms=(60_000, 60_000))
    follower = next(n for n in cluster.nodes if n != cluster.leader())
    consumer = cluster.client(follower).subscribe("doomed", prefetch=3)
    for i in range(5):
        client.publish("doomed", b"m%d" % i)
    other.publish("doomed", b"m5")
    held = [consumer.get(timeout=10) for _ in range(3)]
    assert [d.offset for d in held if d] == [0, 1, 2]
    held[0].nack()  # type: ignore[union-attr]  # 0 waits a minute; the consumer takes 3
    refill = consumer.get(timeout=10)
    assert refill is not None and refill.offset == 3
    assert client.purge_queue("doomed") == 3  # 0 (waiting), 4, 5
    stats = client.status()["queues"]["doomed"]
    assert (stats["ready"], stats["unacked"]) == (0, 3)
    held[1].ack()  # type: ignore[union-attr]  # held ones are still the consumer's
    wait_for(lambda: client.status()["queues"]["doomed"]["unacked"] == 2, "the ack applied")
    with pytest.raises(ServerError, match="queue_in_use"):
        client.delete_queue("doomed")
    assert client.delete_queue("doomed", force=True) == {"messages": 2, "consumers": 1}
    assert consumer.get(timeout=10) is None
    assert consumer.cancel_reason == "queue_deleted"
    for node in cluster.nodes:
        wait_for(lambda n=node: "doomed" not in cluster.status(n)["queues"], f"{node} agrees")
    with pytest.raises(ServerError, match="unknown_queue"):
        client.purge_queue("doomed")
    assert client.declare("doomed") is True  # empty, where the deleted one ended
    assert client.publish("doomed", b"again") == 6  # under a new producer id
    assert [row[0] for row in client.read("doomed", 0, 10).rows] == [6]
    # the other client's id is one the new queue refuses (a resend of its publish to
    # the deleted queue must not land here): its next publish fails, certainly not
    # published, and the one after goes under a new id
    with pytest.raises(ServerError, match="producer_forgotten"):
        other.publish("doomed", b"m6")
    assert other.publish("doomed", b"m6") == 7
    assert client.delete_queue("doomed") == {"messages": 2, "consumers": 0}


def test_the_blocking_client_forgets_producers_by_prefix(cluster: Cluster) -> None:
    client = cluster.client()
    client.declare("forget")
    # a client needs a prefix of 12 characters or more (shorter ones need the admin token)
    client.publish_batch("forget", [b"a", b"b"], producer="job-batch-1-0", first_seq=0)
    client.publish_batch("forget", [b"c"], producer="job-batch-11-0", first_seq=0)
    assert client.forget_producers("forget", "job-batch-1-") == 1
    assert client.status()["queues"]["forget"]["producers"] == 1
    assert client.publish_batch("forget", [b"a"], producer="job-batch-1-0", first_seq=0) == [3]
    with pytest.raises(ServerError, match="invalid"):
        client.forget_producers("forget", "")


def test_a_batch_numbered_by_its_own_seqs_lands_what_is_above_the_last(
    cluster: Cluster,
) -> None:
    """Sequence numbers with gaps (a Spark task numbers rows by source offsets): a
    resend that overlaps lands only the messages above the producer's last. A producer
    the queue does not know (new, or forgotten) takes only its opening batch."""
    client = cluster.client()
    client.declare("numbered")
    publish = client.publish_batch
    with pytest.raises(ServerError, match="out_of_order"):
        publish("numbered", [b"a"], producer="job-7-partition-0", seqs=[0])
    opened = publish(
        "numbered", [b"a", b"b", b"c"], producer="job-7-partition-0", seqs=[0, 5, 9], opens=True
    )
    assert opened == [0, 1, 2]
    assert publish(
        "numbered", [b"b", b"c", b"d"], producer="job-7-partition-0", seqs=[5, 9, 12]
    ) == [3]
    assert publish("numbered", [b"c"], producer="job-7-partition-0", seqs=[9]) == []
    assert [m.body for m in client.read("numbered", 0, 10)] == [b"a", b"b", b"c", b"d"]
    with pytest.raises(ValueError, match="strictly increasing; got 3 after 5"):
        publish("numbered", [b"x", b"y"], producer="job-7-partition-0", seqs=[5, 3])
    with pytest.raises(ValueError, match="seqs go with a producer"):
        publish("numbered", [b"x"], seqs=[20])
    with pytest.raises(ValueError, match="2 seqs for 1 messages"):
        publish("numbered", [b"x"], producer="job-7-partition-0", seqs=[20, 21])
    assert len(client.read("numbered", 0, 10)) == 4  # nothing more was sent
    assert client.forget_producers("numbered", "job-7-partition-0") == 1
    with pytest.raises(ServerError, match="out_of_order"):  # a zombie's resend, say
        publish("numbered", [b"d"], producer="job-7-partition-0", seqs=[12])
    assert len(client.read("numbered", 0, 10)) == 4


def test_a_client_whose_producer_the_queue_forgot_goes_on_under_a_newer_id(
    cluster: Cluster,
) -> None:
    """Client producer ids carry a generation (`g<wall ms hex>-...`). Once a queue forgot
    one, every unknown id of that generation or below is refused (`producer_forgotten`):
    a resend of the forgotten producer is never enqueued as new. The client's first
    attempt is "not published", its key paused; its next id is above the generation."""
    client = cluster.client()
    client.declare("forgetful")
    assert client.publish("forgetful", b"a", key="k") == 0
    producer = client.producer.current("forgetful")
    assert producer is not None and producer.startswith("g")
    admin = Client(cluster.endpoints, cluster.token, admin_token=cluster.admin_token)
    assert admin.forget_producers("forgetful", "g") == 1  # a short prefix needs the admin token
    with pytest.raises(ServerError, match="producer_forgotten"):
        client.publish("forgetful", b"b", key="k")
    assert client.paused_keys() == {"k"}
    client.resume("k")
    assert client.publish("forgetful", b"b", key="k") == 1
    renewed = client.producer.current("forgetful")
    assert renewed is not None and renewed != producer
    assert int(renewed[1:].split("-")[0], 16) > int(producer[1:].split("-")[0], 16)
    assert [m.body for m in client.read("forgetful", 0, 10)] == [b"a", b"b"]


def test_no_prefix_a_client_may_forget_covers_more_than_one_spark_job(cluster: Cluster) -> None:
    """`spark-write-`, exactly the 12 characters the rule asks for, forgot every Spark
    batch write's producers, and a retried task then wrote its rows again. A client
    forgets only one whole job's (`spark-write-<job uuid>-`) or micro-batch's prefix."""
    client = cluster.client()
    client.declare("sparky")
    job = "0123456789abcdef0123456789abcdef"
    client.publish_batch("sparky", [b"r0"], producer=f"spark-write-{job}-0", seqs=[0], opens=True)
    for prefix in ("spark-write-", "spark-write-0123", "spark-", "spark-0123456789ab"):
        with pytest.raises(ServerError, match="admin_required"):
            client.forget_producers("sparky", prefix)
    assert client.forget_producers("sparky", f"spark-write-{job}-") == 1
    query = "01234567-89ab-cdef-0123-456789abcdef"
    assert client.forget_producers("sparky", f"spark-{query}-7-") == 0
    admin = Client(cluster.endpoints, cluster.token, admin_token=cluster.admin_token)
    assert admin.forget_producers("sparky", "spark-write-") == 0


def test_a_client_seals_only_a_whole_spark_prefix_and_the_admin_any(cluster: Cluster) -> None:
    """A seal refuses every new producer under its prefix for 7 days, and nothing undoes
    it: a client holding only the token could have locked any id family out (say
    `orders-api-`), or flooded a queue's 1,000 seals to push out the sink's. Without the
    admin token, only a whole Spark job's or micro-batch's prefix may be sealed."""
    client = cluster.client()
    client.declare("sealing")
    job = "0123456789abcdef0123456789abcdef"
    for prefix in ("orders-api-", f"spark-write-{job}-0-", "spark-write-0123-"):
        with pytest.raises(ServerError, match="admin_required"):
            client.forget_producers("sealing", prefix, seal=True)
    assert client.forget_producers("sealing", f"spark-write-{job}-", seal=True) == 0
    with pytest.raises(ServerError, match="producer_sealed"):
        client.publish_batch(
            "sealing", [b"r"], producer=f"spark-write-{job}-3", seqs=[0], opens=True
        )
    admin = Client(cluster.endpoints, cluster.token, admin_token=cluster.admin_token)
    assert admin.forget_producers("sealing", "orders-api-", seal=True) == 0
    with pytest.raises(ServerError, match="producer_sealed"):
        client.publish_batch("sealing", [b"r"], producer="orders-api-1", seqs=[0], opens=True)


def test_an_oversized_message_is_refused_and_the_node_keeps_serving(cluster: Cluster) -> None:
    client = cluster.client()
    client.declare("big")
    with pytest.raises(ServerError, match="too_large"):
        client.publish("big", b"x" * (64 * 1024 + 1), key="k")
    with pytest.raises(KeyPausedError):  # later publishes of that key fail fast
        client.publish("big", b"small", key="k")
    assert client.paused_keys() == {"k"}
    client.resume("k")
    assert client.publish("big", b"small", key="k") == 0


def _raw_session(cluster: Cluster) -> tuple[socket.socket, Callable[[], dict[str, Any]]]:
    """A socket past `hello` on the first node, and a function that reads its next frame
    (`ConnectionError` if the node closes it)."""
    host, port = cluster.endpoint(cluster.nodes[0]).split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    decoder = FrameDecoder()

    def receive() -> dict[str, Any]:
        while True:
            for frame in decoder.frames():
                return frame
            data = sock.recv(65536)
            if not data:
                raise ConnectionError("the node closed the connection")
            decoder.feed(data)

    proof = auth_proof("s3cret-token", receive()["nonce"])
    sock.sendall(encode_frame({"t": "hello", "v": PROTOCOL_VERSION, "client": "t", "proof": proof}))
    assert receive()["t"] == "reply"
    return sock, receive


_SCALARS = {
    bytes: st.binary(max_size=8),
    str: st.sampled_from(["", "q", "basic", "k", "A", "p-1", "x" * 300]),
    int: st.one_of(st.integers(-3, 70_000), st.sampled_from([2**31, 2**63 - 1, -(2**63)])),
    bool: st.booleans(),
    type(None): st.none(),
}
_ANY = st.recursive(
    st.one_of(*_SCALARS.values(), st.floats(allow_nan=True)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(["a", "ttl_ms"]), inner)
    ),
    max_leaves=8,
)
_VALUES = {
    **_SCALARS,
    list: st.lists(_ANY, max_size=4),
    dict: st.dictionaries(st.text(max_size=12), _ANY, max_size=4),
}
_CLIENT_FRAMES = sorted(
    kind
    for kind in SCHEMA
    if kind not in ("hello", "welcome", "reply", "error", "deliver", "cancelled")
)


@st.composite
def schema_shaped_frames(draw: st.DrawFn) -> dict[str, Any]:
    """A frame the schema lets through, with odd values: each field of one of its
    allowed types (a nil-able one may be left out), plus unknown fields."""
    kind = draw(st.sampled_from(_CLIENT_FRAMES))
    frame: dict[str, Any] = {"t": kind}
    for field, types in SCHEMA[kind].items():
        if field == "id":
            continue
        if type(None) in types and draw(st.booleans()):
            continue  # left out
        frame[field] = draw(st.one_of(*(_VALUES[t] for t in types)))
    frame.update(draw(st.dictionaries(st.sampled_from(["seqs", "extra", "t2"]), _ANY, max_size=2)))
    return frame


@pytest.fixture(scope="module")
def raw_session(cluster: Cluster) -> Any:
    sock, receive = _raw_session(cluster)
    with sock:
        yield sock, receive


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(frames=st.lists(schema_shaped_frames(), min_size=1, max_size=4))
def test_every_frame_the_schema_lets_through_is_answered_and_the_connection_lives(
    raw_session: Any, frames: list[dict[str, Any]]
) -> None:
    """A missing nil-able field once closed the connection (the node core read
    `frame["first_seq"]`): whatever a frame's values, the node answers it or ignores it,
    and goes on serving this connection."""
    sock, receive = raw_session
    for n, frame in enumerate(frames, start=1):
        sock.sendall(encode_frame({**frame, "id": n}))
    sock.sendall(encode_frame({"t": "status", "id": 10_000}))
    while True:  # every answer before the status reply is a reply or a typed error
        answer = receive()
        assert answer["t"] in ("reply", "error", "deliver", "cancelled"), answer
        if answer["t"] == "error":
            assert answer["code"] != "internal", answer
        if answer.get("id") == 10_000:
            assert answer["t"] == "reply"
            break


def test_bad_frames_get_typed_errors_and_the_connection_survives(cluster: Cluster) -> None:
    sock, receive = _raw_session(cluster)
    with sock:
        sock.sendall(encode_frame({"t": "launch", "id": 5}))
        error = receive()
        assert (error["t"], error["code"], error["id"]) == ("error", "unknown_frame", 5)
        sock.sendall(encode_frame({"t": "publish", "id": 6, "queue": 3}))
        assert receive()["code"] == "bad_frame"
        batch = {"t": "publish_batch", "id": 8, "queue": "basic", "messages": [[b"x", None, None]]}
        for seqs in ([3.0], [2, 1], [1, 2], "3", [-1]):  # a float, out of order, too many...
            sock.sendall(encode_frame({**batch, "producer": "p-raw", "seqs": seqs}))
            assert receive()["code"] in ("bad_frame", "invalid"), seqs
        sock.sendall(encode_frame({**batch, "producer": None, "seqs": [1]}))
        assert receive()["code"] in ("bad_frame", "invalid")
        sock.sendall(encode_frame({"t": "status", "id": 7}))
        assert receive()["t"] == "reply"  # still served
        sock.sendall(b"\xff\xff\xff\xff")  # a length no frame may have
        assert receive()["code"] == "frame_too_large"
        assert sock.recv(1) == b""  # and this one closes the connection


def test_closing_a_client_returns_what_its_full_consumer_held(cluster: Cluster) -> None:
    # A consumer with a full prefetch is sent nothing more, so the client's reader sits
    # in recv: closing the socket alone left the connection open (Linux keeps it until
    # that recv returns), and the node kept the consumer and its messages for good.
    node = cluster.leader()
    producer = cluster.client(node)
    producer.declare("full-close")
    for i in range(5):
        producer.publish("full-close", b"%d" % i)
    client = cluster.client(node)
    consumer = client.subscribe("full-close", prefetch=5)
    assert all(consumer.get(timeout=10) for _ in range(5))

    def queue() -> dict[str, int]:
        q: dict[str, int] = cluster.status(node)["queues"]["full-close"]
        return q

    wait_for(lambda: queue()["unacked"] == 5, "the consumer holding its prefetch")
    client.close()
    wait_for(lambda: queue()["unacked"] == 0 and queue()["ready"] == 5, "returned on close", 10)


def test_a_consumer_that_stops_reading_is_cut_off_and_its_messages_go_elsewhere() -> None:
    with Cluster(3, outbound_frames=20, max_body=128 * 1024) as cluster:
        leader = cluster.leader()
        client = cluster.client(leader)
        client.declare("slow")
        host, port = cluster.endpoint(leader).split(":")
        sock = socket.create_connection((host, int(port)), timeout=5)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        decoder = FrameDecoder()
        while not list(decoder.frames()):
            decoder.feed(sock.recv(65536))
        hello = {"t": "hello", "v": PROTOCOL_VERSION, "client": "t", "proof": None}
        sock.sendall(encode_frame(hello))
        subscribe = {"t": "subscribe", "id": 1, "queue": "slow", "prefetch": 0}
        sock.sendall(encode_frame(subscribe))
        replies: list[dict[str, object]] = []
        while not any(f.get("id") == 1 for f in replies):  # the subscription is in place
            decoder.feed(sock.recv(65536))
            replies += [f for f in decoder.frames() if f["t"] == "reply"]
        # unlimited prefetch, and from here on the raw consumer reads nothing
        body = b"x" * (100 * 1024)
        for _ in range(200):
            client.publish("slow", body)
        wait_for(
            lambda: client.status()["queues"]["slow"]["consumers"] == 0,
            "the slow consumer cut off",
            30,
        )
        healthy = cluster.client().subscribe("slow", prefetch=1000)  # a big burst is fine
        got = [healthy.get(timeout=10) for _ in range(200)]
        assert {d.offset for d in got if d} == set(range(200))
        assert any(d.redelivered for d in got if d)  # what the slow one held came back
        sock.close()


def test_a_client_with_no_reachable_node_says_so() -> None:
    with pytest.raises(ConnectionLostError, match="no quorumq node answered"):
        Client(["127.0.0.1:1"], connect_timeout=0.3)


def test_an_ack_refused_for_one_offset_still_settles_the_others(cluster: Cluster) -> None:
    client = cluster.client()
    client.declare("strand")
    client.publish("strand", b"a")
    client.publish("strand", b"b")
    consumer_client = cluster.client()
    consumer = consumer_client.subscribe("strand", prefetch=2)
    held = [consumer.get(timeout=10) for _ in range(2)]
    assert all(held)
    # one ack frame naming a held offset and one the consumer does not hold (as when a
    # nack took a key's later messages back and the client acks one of those with others)
    consumer_client._send_frames(
        [{"t": "ack", "consumer": consumer.id, "offsets": [held[0].offset, 10**6]}]  # type: ignore[union-attr]
    )
    wait_for(
        lambda: client.status()["queues"]["strand"]["unacked"] == 1,
        "the held offset acked although the frame named one that is not held",
    )
