"""The client's protocol state, driven with frames alone (no socket, no node)."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quorumq.client.core import (
    ConnectionLostError,
    KeyPausedError,
    OutcomeUnknownError,
    Producer,
    QuorumqError,
    ServerError,
    TooManyUnconfirmedError,
)
from quorumq.client.session import (
    PARKED_RETRY_DELAY,
    SUBSCRIBE_RETRY_FIRST,
    SUBSCRIBE_RETRY_LONGEST,
    ClientSession,
    ConsumerEnded,
    Failed,
    Resolved,
    Resubscribe,
    RewindLater,
    Send,
    keys_of,
)
from quorumq.wire.protocol import encode_frame


@attrs.define
class _Consumer:
    queue: str
    prefetch: int = 10
    id: str = ""
    cancel_requested: bool = False


def _session() -> ClientSession:
    session = ClientSession(settle=lambda _delivery, _ack, _requeue, _delay: None)
    session.connection_made()
    return session


def _reply(request_id: int, **fields: Any) -> dict[str, Any]:
    return {"t": "reply", "id": request_id, **fields}


def test_closing_fails_every_pending_request_and_ends_every_consumer() -> None:
    session = _session()
    consumer = _Consumer("q")
    subscribed, _ = session.subscribe(consumer)
    assert session.receive(_reply(subscribed, consumer="n.1")) == [
        Resolved(subscribed, _reply(subscribed, consumer="n.1"))
    ]
    published, _ = session.publish("q", b"m", None, None)
    waiting, _ = session.subscribe(_Consumer("other"))

    events = session.close()

    failed = [e for e in events if isinstance(e, Failed)]
    assert [e.request_id for e in failed] == [published, waiting]
    # a publish sent and unconfirmed may have landed: not "not published" (a duplicate
    # when the caller retries it; found by a helper's review of the embedded node)
    assert isinstance(failed[0].error, OutcomeUnknownError)
    again = _session()
    again.publish("q", b"a", None, None)
    again.publish("q", b"b", None, None)
    errors = [e.error for e in again.close() if isinstance(e, Failed)]
    assert len(errors) == 2 and errors[0] is not errors[1]  # one each: raised apart
    assert "may have landed" in str(failed[0].error)
    assert str(failed[1].error) == "the client is closed"
    assert [e for e in events if isinstance(e, ConsumerEnded)] == [
        ConsumerEnded(consumer, "client closed")
    ]
    assert session.unconfirmed() == []  # nothing is sent again
    assert session.receive(_reply(published, offset=0)) == []  # an answer read late is no one's


def test_a_closed_session_takes_no_request() -> None:
    session = _session()
    session.close()
    with pytest.raises(QuorumqError, match="closed"):
        session.publish("q", b"m", None, None)


# ------------------------------------------------------- subscribing again


def _error(frame_id: int, code: str, **fields: Any) -> dict[str, Any]:
    return {"t": "error", "id": frame_id, "code": code, "message": "from the node", **fields}


LEADER_CHANGE = ServerError("not_applied", "no leader")


def test_a_subscribe_is_tried_again_after_50_ms_doubling_up_to_1_s() -> None:
    session = _session()
    delays = [session.subscribe_retry_delay(LEADER_CHANGE, n, 30.0) for n in range(1, 9)]
    assert delays == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0]
    assert delays[-1] == SUBSCRIBE_RETRY_LONGEST


def test_a_leader_change_or_a_lost_connection_is_worth_another_subscribe() -> None:
    session = _session()
    for error in (
        ServerError("not_applied", "no leader"),
        ServerError("outcome_unknown", "no outcome within 15.0 s"),
        ServerError("node_down", "node 'B' is marked down; subscribe after it is up"),
        ConnectionLostError("the connection broke"),
        ConnectionLostError("not connected: the client is reconnecting"),
    ):
        assert session.subscribe_retry_delay(error, 1, 30.0) == SUBSCRIBE_RETRY_FIRST, error


def test_any_other_refusal_ends_the_subscribe_at_once() -> None:
    session = _session()
    for error in (
        ServerError("unknown_queue", "no queue 'q'"),
        ServerError("invalid", "prefetch must be >= 0"),
        QuorumqError("something else"),
    ):
        assert session.subscribe_retry_delay(error, 1, 30.0) is None, error


def test_no_subscribe_is_tried_again_if_its_wait_would_end_past_the_deadline() -> None:
    session = _session()
    assert session.subscribe_retry_delay(LEADER_CHANGE, 1, 0.06) == 0.05
    assert session.subscribe_retry_delay(LEADER_CHANGE, 1, 0.05) is None
    assert session.subscribe_retry_delay(LEADER_CHANGE, 6, 0.9) is None  # would wait 1 s
    assert session.subscribe_retry_delay(LEADER_CHANGE, 1, -1.0) is None


def test_no_subscribe_is_tried_again_by_a_closed_client() -> None:
    session = _session()
    session.close()
    assert session.subscribe_retry_delay(LEADER_CHANGE, 1, 30.0) is None
    with pytest.raises(QuorumqError, match="closed"):
        session.subscribe(_Consumer("q"))


def test_a_subscribe_without_a_connection_fails_as_a_lost_connection_until_one_is_made() -> None:
    session = ClientSession(settle=lambda _delivery, _ack, _requeue, _delay: None)
    with pytest.raises(ConnectionLostError, match="reconnecting"):
        session.subscribe(_Consumer("q"))  # sent now, it would get no answer, ever
    session.connection_made()
    pending, frame = session.subscribe(_Consumer("q"))
    assert frame == {"t": "subscribe", "queue": "q", "prefetch": 10, "id": pending}

    events = session.connection_lost()

    assert [(e.request_id, type(e.error)) for e in events if isinstance(e, Failed)] == [
        (pending, ConnectionLostError)
    ]
    with pytest.raises(ConnectionLostError, match="reconnecting"):
        session.subscribe(_Consumer("q"))
    session.connection_made()
    session.subscribe(_Consumer("q"))


def test_no_subscribe_is_tried_again_once_the_client_gave_up_reaching_any_node() -> None:
    session = _session()
    session.connection_lost()
    session.give_up(ConnectionLostError("no quorumq node answered: 127.0.0.1:1: refused"))
    gone = ConnectionLostError("not connected")
    assert session.subscribe_retry_delay(gone, 1, 30.0) is None
    with pytest.raises(ConnectionLostError, match="no quorumq node answered"):
        session.subscribe(_Consumer("q"))


def test_a_consumer_whose_connection_broke_or_whose_node_was_cut_off_subscribes_again() -> None:
    session = _session()
    first, second = _Consumer("q"), _Consumer("r")
    for consumer, consumer_id in ((first, "n.1"), (second, "n.2")):
        request_id, _ = session.subscribe(consumer)
        session.receive(_reply(request_id, consumer=consumer_id))

    cut_off = session.receive({"t": "cancelled", "consumer": "n.1", "reason": "node_down"})
    assert cut_off == [Resubscribe(first)]
    assert session.connection_lost() == [Resubscribe(second)]


def test_a_subscribe_refused_by_the_node_registers_no_consumer() -> None:
    session = _session()
    consumer = _Consumer("q")
    request_id, _ = session.subscribe(consumer)
    (failed,) = session.receive(_error(request_id, "outcome_unknown"))
    assert isinstance(failed, Failed) and isinstance(failed.error, ServerError)
    assert session.subscribe_retry_delay(failed.error, 1, 30.0) == SUBSCRIBE_RETRY_FIRST
    assert session.consumers == {}
    assert session.connection_lost() == []  # nothing to subscribe again: the retry does it


# ------------------------------------------------- the client's promises (issue 15)


def test_resends_go_in_send_order_across_renewed_producer_ids() -> None:
    """Key `a`: m0, then a permanent error renews the producer id, then m2. The new id is
    random; sorting resends by it landed m2 before m0 in 96 of 200 trials."""
    for _ in range(50):  # the new id is random each time
        session = _session()
        m0, _ = session.publish("q", b"m0", "a", None)
        m1, _ = session.publish("q", b"m1", "b", None)
        session.receive(_error(m1, "too_large"))  # permanent: renews the producer id
        session.resume("b")
        with pytest.raises(KeyPausedError, match="another producer id"):  # a waits for m0
            session.publish("q", b"m2", "a", None)
        m2, _ = session.publish("q", b"m2", "c", None)
        session.connection_lost()
        session.connection_made()
        assert [f["body"] for f in session.unconfirmed()] == [b"m0", b"m2"]
        assert [f["id"] for f in session.unconfirmed()] == [m0, m2]


def test_a_cancelled_consumer_is_not_subscribed_again_after_a_reconnect() -> None:
    session = _session()
    kept, cancelled = _Consumer("q"), _Consumer("q")
    for consumer, consumer_id in ((kept, "n.1"), (cancelled, "n.2")):
        request_id, _ = session.subscribe(consumer)
        session.receive(_reply(request_id, consumer=consumer_id))
    cancel = session.cancel(cancelled)
    assert cancel is not None and cancel[1] == {"t": "cancel", "consumer": "n.2", "id": cancel[0]}
    delivery = {"t": "deliver", "consumer": "n.2", "offset": 4, "key": None, "body": b"x"}
    more = {"headers": None, "redelivered": False, "delivery_count": 0, "node": "A"}
    assert session.receive({**delivery, **more})  # in flight before the cancel: delivered
    events = session.connection_lost()
    assert Resubscribe(kept) in events and Resubscribe(cancelled) not in events
    assert ConsumerEnded(cancelled, "cancelled") in events


def test_a_consumer_cancelled_while_it_subscribes_again_is_not_subscribed_again() -> None:
    """The connection broke, and the application cancelled the consumer before its
    resubscribe: the cancel recorded its old id, and the resubscribe went ahead under a
    new one, holding prefetch messages nobody read."""
    session = _session()
    consumer = _Consumer("q")
    request_id, _ = session.subscribe(consumer)
    session.receive(_reply(request_id, consumer="n.1"))
    assert session.connection_lost() == [Resubscribe(consumer)]
    session.connection_made()
    in_flight, _ = session.subscribe(consumer)  # the resubscribe had started
    assert session.cancel(consumer) is None  # not subscribed on this connection: no frame
    with pytest.raises(QuorumqError, match="cancelled"):
        session.subscribe(consumer)  # a later attempt is refused
    events = session.receive(_reply(in_flight, consumer="n.2"))
    assert Send({"t": "cancel", "consumer": "n.2", "id": in_flight + 1}) in events
    assert session.consumers == {}  # not registered: no resubscribe, no deliveries
    assert session.connection_lost() == []


def test_a_subscribe_answered_after_its_caller_stopped_waiting_is_cancelled_at_once() -> None:
    """A subscribe timed out (or its trio caller was cancelled), then succeeded: the
    session registered a consumer nobody read, which took prefetch messages and was
    subscribed again after every reconnect."""
    session = _session()
    consumer = _Consumer("q")
    request_id, _ = session.subscribe(consumer)
    assert session.abandon(request_id) is True
    events = session.receive(_reply(request_id, consumer="n.1"))
    assert events == [Send({"t": "cancel", "consumer": "n.1", "id": request_id + 1})]
    assert session.consumers == {}
    delivery = {"t": "deliver", "consumer": "n.1", "offset": 4, "key": None, "body": b"x"}
    more = {"headers": None, "redelivered": False, "delivery_count": 0, "node": "A"}
    assert session.receive({**delivery, **more}) == [
        Send({"t": "nack", "consumer": "n.1", "offsets": [4], "requeue": True})
    ]  # given before the cancel: back to the queue
    assert session.receive({"t": "cancelled", "consumer": "n.1", "reason": "cancelled"}) == []
    assert session.connection_lost() == []  # nothing to subscribe again, nothing failed

    session.connection_made()
    read, _ = session.request({"t": "status"})  # any other request: forgotten
    assert session.abandon(read) is True
    assert session.receive(_reply(read, status={})) == []
    refused, _ = session.subscribe(_Consumer("q"))
    session.abandon(refused)
    assert session.receive(_error(refused, "unknown_queue")) == []
    answered, _ = session.request({"t": "status"})
    session.receive(_reply(answered, status={}))
    assert session.abandon(answered) is False  # read already: the caller takes it


def test_a_publish_whose_caller_stopped_waiting_stays_live_and_pauses_its_key() -> None:
    session = _session()
    request_id, _ = session.publish("q", b"m", "k", None)
    error = session.outcome_unknown(request_id, "no answer within 1 s")
    assert isinstance(error, OutcomeUnknownError) and isinstance(error, ConnectionLostError)
    assert "may still land" in str(error) and "'k' paused" in str(error)
    assert session.producer.paused == {"k"}
    with pytest.raises(KeyPausedError):
        session.publish("q", b"m again", "k", None)  # the app's retry: refused, no duplicate
    assert [f["body"] for f in session.unconfirmed()] == [b"m"]  # still resent
    assert session.receive(_reply(request_id, offset=7)) == [
        Resolved(request_id, _reply(request_id, offset=7))
    ]
    assert session.unconfirmed() == []  # settled by the late confirm


def test_a_publish_that_can_never_fit_fails_at_once_with_too_large() -> None:
    session = ClientSession(settle=lambda _delivery, _ack, _requeue, _delay: None)
    session.connection_made({"node": "A", "max_body": 1024, "max_frame": 4096})
    with pytest.raises(ServerError, match="too_large"):
        session.publish("q", b"x" * 1025, "k", None)
    with pytest.raises(ServerError, match="too_large"):  # each body fits, the frame does not
        session.publish_batch("q", [[b"x" * 1000, None, None]] * 5)
    assert session.unconfirmed() == [] and session.producer.paused == {"k"}
    _, frame = session.publish("q", b"x" * 1024, None, None)
    assert frame["seq"] == 0  # the refused ones took no sequence number


@settings(max_examples=200, deadline=None)
@given(
    max_body=st.integers(16, 4096),
    overhead=st.integers(0, 600),
    sizes=st.lists(st.integers(0, 5000), min_size=1, max_size=6),
    key=st.one_of(
        st.none(), st.text(max_size=40), st.text(alphabet="\u20ac\U0001f600", max_size=900)
    ),
    batch=st.booleans(),
)
def test_what_is_sent_always_fits_the_nodes_limits(
    max_body: int, overhead: int, sizes: list[int], key: str | None, batch: bool
) -> None:
    """Around every limit: a publish either fails at once with too_large, or what is
    sent is within the node's body and frame limits (never a frame it drops)."""
    session = ClientSession(settle=lambda _delivery, _ack, _requeue, _delay: None)
    max_frame = max_body + overhead
    session.connection_made({"node": "A", "max_body": max_body, "max_frame": max_frame})
    bodies = [b"x" * n for n in sizes]
    try:
        if batch:
            _, frame = session.publish_batch("q", [[b, key, None] for b in bodies])
        else:
            _, frame = session.publish("q", bodies[0], key, None)
    except ServerError as e:
        assert e.code == "too_large"
        return
    sent = bodies if batch else bodies[:1]
    assert all(len(b) <= max_body for b in sent)
    assert len(encode_frame(frame)) <= max_frame


def test_a_resend_refused_by_a_node_with_other_limits_is_outcome_unknown_and_stays_live() -> None:
    """Configuration drift: the first attempt landed on a node, its confirm was lost, and
    a node with a smaller --max-body refused the resend. It was reported "not published";
    then "outcome unknown" but dropped, so the key settled while an earlier attempt could
    still be in the Raft pipeline (a read then proves nothing). Now it stays live, and so
    do the later ones of its producer: each is settled by its own answer."""
    session = _session()
    first, sent = session.publish("q", b"m0", "k", None)
    later, _ = session.publish("q", b"m1", "j", None)
    session.connection_lost()
    session.connection_made()
    assert [f["id"] for f in session.unconfirmed()] == [first, later]  # resent
    refused = session.receive(_error(first, "too_large"))
    assert [type(e.error) for e in refused if isinstance(e, Failed)] == [OutcomeUnknownError]
    assert not any(isinstance(e, RewindLater) for e in refused)  # not to this node again
    assert session.producer.paused == {"k"}
    assert session.settling_keys() == {"k", "j"}  # both live
    assert [f["id"] for f in session.unconfirmed("q")] == [later]  # not to this node now
    fresh, frame = session.publish("q", b"m2", None, None)
    assert frame["producer"] != sent["producer"]  # a fresh id
    (never_resent,) = [
        e for e in session.receive(_error(fresh, "too_large")) if isinstance(e, Failed)
    ]
    assert type(never_resent.error) is ServerError  # sent once, refused: not published
    assert session.receive(_reply(later, offset=1)) == [Resolved(later, _reply(later, offset=1))]
    session.connection_lost()
    session.connection_made()
    assert [f["id"] for f in session.unconfirmed()] == [first]  # to the next node
    session.receive(_reply(first, offset=0))
    assert session.settling_keys() == set()


def test_a_caller_that_stops_waiting_just_after_the_answer_was_read_gets_that_answer() -> None:
    """The confirm was read as the caller's timeout expired: "outcome unknown" then found
    the publish confirmed and raised an error that paused nothing, for a message that
    had landed (an application retry would publish it twice)."""
    session = _session()
    request_id, _ = session.publish("q", b"m", "k", None)
    assert session.receive(_reply(request_id, offset=3)) == [
        Resolved(request_id, _reply(request_id, offset=3))
    ]
    assert session.outcome_unknown(request_id, "no answer within 1 s") is None  # use it
    assert session.producer.paused == set()
    refused, _ = session.publish("q", b"n", "j", None)
    (failed,) = session.receive(_error(refused, "too_large"))
    assert isinstance(failed, Failed)
    assert session.outcome_unknown(refused, "no answer within 1 s") is None  # that one too


def test_a_caller_cancelled_while_waiting_pauses_the_keys_even_if_the_answer_came() -> None:
    """A trio caller cancelled as the confirm arrived never sees the offset: its key is
    paused as after any outcome unknown, so its retry cannot publish the message twice."""
    session = _session()
    request_id, frame = session.publish("q", b"m", "k", None)
    session.receive(_reply(request_id, offset=3))
    session.cancelled_while_waiting(request_id, keys_of(frame))
    assert session.producer.paused == {"k"}


def test_a_key_is_not_wedged_once_none_of_its_publishes_is_live() -> None:
    """m0 (a), m1 (b), m2 (c); m2 refused at once renews the producer id, so a and b
    wait for m0 and m1. The resend of m0 refused dropped m1 without releasing key b:
    publish(key="b") raised KeyPausedError until close(), whatever resume("b") did."""
    session = _session()
    m0, _ = session.publish("q", b"m0", "a", None)
    m1, _ = session.publish("q", b"m1", "b", None)
    m2, _ = session.publish("q", b"m2", "c", None)
    session.receive(_error(m2, "too_large"))  # refused at once: the producer id is renewed
    session.connection_lost()
    session.connection_made()
    assert [f["id"] for f in session.unconfirmed()] == [m0, m1]  # resent
    session.receive(_error(m0, "too_large"))  # a node with a smaller --max-body
    session.receive(_reply(m1, offset=1))  # (if m1 is still live) it landed
    session.resume("b")
    session.publish("q", b"m3", "b", None)
    assert "b" in session.settling_keys() and "c" not in session.settling_keys()


def test_a_key_waits_for_its_publishes_under_another_producer_id() -> None:
    """A caller-chosen producer id is ordered against the client's own per key: a
    publish under one id while the key has an unconfirmed publish under another could
    land first (the other lost in the Raft pipeline, then resent)."""
    session = _session()
    mine, _ = session.publish("q", b"a0", "a", None)
    with pytest.raises(KeyPausedError, match="another producer id"):
        session.publish_batch("q", [[b"a1", "a", None]], producer="S", first_seq=0)
    theirs, _ = session.publish_batch("q", [[b"b0", "b", None]], producer="S", first_seq=0)
    session.publish_batch("q", [[b"b1", "b", None]], producer="S", first_seq=1)  # same id
    with pytest.raises(KeyPausedError, match="another producer id"):
        session.publish("q", b"b2", "b", None)
    session.publish_batch("r", [[b"x", "a", None]], producer="S", first_seq=0)  # another queue
    assert session.settling_keys() == {"a", "b"}
    session.receive(_reply(mine, offset=0))
    session.publish_batch("q", [[b"a1", "a", None]], producer="S", first_seq=3)
    session.receive(_reply(theirs, offset=1))
    with pytest.raises(KeyPausedError):  # b1 is still out under S
        session.publish("q", b"b2", "b", None)


def test_a_key_is_resumed_only_once_none_of_its_publishes_is_live() -> None:
    """The README said: after outcome unknown, find it with read, then resume. But the
    publish was still live: a read that missed it proved nothing, and the retry that
    followed landed as well (offsets 0 and 1)."""
    session = _session()
    request_id, _ = session.publish("q", b"m", "k", None)
    assert session.outcome_unknown(request_id, "no answer within 1 s") is not None
    assert session.settling_keys() == {"k"}
    with pytest.raises(KeyPausedError, match=r"settling_keys\(\)"):
        session.resume("k")
    assert session.producer.paused == {"k"}
    session.receive(_reply(request_id, offset=0))
    assert session.settling_keys() == set()
    session.resume("k")  # now a read tells whether it landed
    session.publish("q", b"next", "k", None)


def test_a_publish_past_the_unconfirmed_limits_fails_before_anything_is_sent() -> None:
    """A node that never answers (stopped, its TCP kept alive by the kernel) made the
    unconfirmed publishes, and every rewind's resends, grow without bound."""
    session = ClientSession(
        settle=lambda _d, _a, _r, _w: None, max_unconfirmed=2, max_unconfirmed_bytes=100
    )
    session.connection_made()
    first, _ = session.publish("q", b"x" * 10, "a", None)
    session.publish("q", b"x" * 10, None, None)
    with pytest.raises(TooManyUnconfirmedError, match=r"max_unconfirmed=2"):
        session.publish("q", b"x", "k", None)
    with pytest.raises(TooManyUnconfirmedError):
        session.publish_batch("q", [[b"x", None, None]])
    assert session.producer.paused == set()  # not sent: nothing to pause
    session.receive(_reply(first, offset=0))
    _, frame = session.publish("q", b"x", "k", None)
    assert frame["seq"] == 2  # the refused ones took no sequence number
    session = ClientSession(settle=lambda _d, _a, _r, _w: None, max_unconfirmed_bytes=100)
    session.connection_made()
    big, _ = session.publish("q", b"x" * 500, None, None)  # alone, any size goes
    with pytest.raises(TooManyUnconfirmedError, match=r"max_unconfirmed_bytes=100"):
        session.publish("q", b"x", None, None)
    session.receive(_reply(big, offset=0))
    session.publish("q", b"x" * 60, None, None)
    with pytest.raises(TooManyUnconfirmedError, match="bytes"):
        session.publish_batch("q", [[b"x" * 30, "k", {"h": "v" * 10}]])


def test_a_refusal_of_an_attempt_already_sent_again_starts_no_other_rewind() -> None:
    """30 publishes of 1 MB in flight, a leader change: the first not_applied started a
    rewind, which resent all of them, and each stale outcome_unknown of the first
    attempts that followed started another, resending the whole queue again and again.
    Once the blocking client stopped holding its lock while writing, this stormed the
    node into leader change after leader change, and nothing was confirmed."""
    session = _session()
    ids = [session.publish("q", b"m%d" % i, None, None)[0] for i in range(3)]
    assert session.receive(_error(ids[0], "not_applied")) == [RewindLater("q")]
    assert [f["id"] for f in session.rewind("q")] == ids  # second attempts
    for request_id in ids[1:]:  # their first attempts' refusals, read late: stale
        assert session.receive(_error(request_id, "outcome_unknown")) == [], request_id
    assert session.receive(_error(ids[1], "out_of_order", expected_seq=0)) == [
        RewindLater("q")
    ]  # a second attempt's refusal: that one counts
    session.rewind("q")
    for request_id in ids:
        session.receive(_reply(request_id, offset=request_id))
    assert session.settling_keys() == set() and session.unconfirmed() == []


def test_a_publish_refused_as_out_of_order_never_stays_live_for_ever() -> None:
    """The queue expects 0 from a producer it forgot (forget_producers, 7 days of
    silence): a resend of this client's publish 1 was then parked as outcome unknown,
    resent on every reconnect and refused every time, its key settling for ever. And a
    batch under a caller's own producer id, sent ahead of that producer's first, did the
    same (the property test found it)."""
    session = _session()
    first, _ = session.publish("q", b"m0", "a", None)
    session.receive(_reply(first, offset=0))
    later, _ = session.publish("q", b"m1", "b", None)
    session.connection_lost()
    session.connection_made()
    session.unconfirmed()  # resent: refused, its outcome is unknown (it may have landed)
    (forgotten,) = session.receive(_error(later, "out_of_order", expected_seq=0))
    assert isinstance(forgotten, Failed) and isinstance(forgotten.error, OutcomeUnknownError)
    assert "forgot" in str(forgotten.error)
    assert session.settling_keys() == set() and session.producer.paused == {"b"}

    ahead, _ = session.publish_batch("q", [[b"x", "c", None]], producer="S", first_seq=1)
    session.connection_lost()
    session.connection_made()
    session.unconfirmed()
    (refused,) = session.receive(_error(ahead, "out_of_order", expected_seq=0))
    assert isinstance(refused, Failed) and type(refused.error) is ServerError  # replay it
    assert session.settling_keys() == set() and session.unconfirmed() == []


def test_a_producer_the_queue_forgot_is_refused_not_duplicated_and_the_next_id_is_newer() -> None:
    """Ids carry a generation (the wall clock when made, in ms). A queue that forgot a
    producer refuses unknown ids of that generation or below (`producer_forgotten`,
    with the generation). A first attempt is "not published"; a resend's outcome is
    unknown (an earlier attempt may have landed before the queue forgot the id), and it
    is not live any more. Either way the next id is above the generation, even from a
    clock behind it."""
    session = ClientSession(
        settle=lambda _d, _a, _r, _w: None, producer=Producer(clock_ms=lambda: 0x1000)
    )
    session.connection_made()
    first, frame = session.publish("q", b"m0", "a", None)
    assert frame["producer"].startswith("g1000-")
    (refused,) = session.receive(_error(first, "producer_forgotten", generation=0x5000))
    assert isinstance(refused, Failed) and isinstance(refused.error, ServerError)
    assert refused.error.code == "producer_forgotten"
    assert session.producer.paused == {"a"} and session.settling_keys() == set()

    second, frame = session.publish("q", b"m1", "b", None)
    assert frame["producer"].startswith("g5001-") and frame["seq"] == 0
    session.connection_lost()
    session.connection_made()
    session.unconfirmed()  # resent
    (unknown,) = session.receive(_error(second, "producer_forgotten", generation=0x6000))
    assert isinstance(unknown, Failed) and isinstance(unknown.error, OutcomeUnknownError)
    assert session.settling_keys() == set() and session.unconfirmed() == []
    _, frame = session.publish("q", b"m2", "c", None)
    assert frame["producer"].startswith("g6001-")


def test_a_batch_numbered_by_seqs_refused_at_once_fails_alone_and_the_session_goes_on() -> None:
    """A refusal of a `seqs` batch once crashed the session (it did arithmetic on the
    frame's first_seq, None there): the blocking client's reader thread died and the
    client never reconnected. The queue takes a numbered batch whatever came before it,
    so a later one under the same producer is not failed with it."""
    session = _session()
    refused, frame = session.publish_batch("q", [[b"x", "a", None]], "N", None, [3])
    assert frame["seqs"] == [3] and frame["first_seq"] is None
    (failed,) = session.receive(_error(refused, "unknown_queue"))
    assert isinstance(failed, Failed) and isinstance(failed.error, ServerError)
    later, _ = session.publish_batch("q", [[b"y", "b", None]], "N", None, [5])
    (answer,) = session.receive(_reply(later, offset=0, count=1))
    assert isinstance(answer, Resolved)


def test_a_second_batch_numbered_by_seqs_waits_for_the_first() -> None:
    """With two live, the later could land first, and the earlier, resent, would be
    taken for a duplicate (numbers below the producer's last) and confirmed, lost."""
    session = _session()
    first, _ = session.publish_batch("q", [[b"x", None, None]], "N", None, [0])
    with pytest.raises(QuorumqError, match="still live"):
        session.publish_batch("q", [[b"y", None, None]], "N", None, [1])
    session.receive(_reply(first, offset=0, count=1))
    session.publish_batch("q", [[b"y", None, None]], "N", None, [1])


def test_sequence_numbers_past_what_the_wire_carries_are_refused_before_sending() -> None:
    session = _session()
    with pytest.raises(ValueError, match="strictly increasing"):
        session.publish_batch("q", [[b"x", None, None]], "N", None, [2**64])
    with pytest.raises(ValueError, match="first_seq must be in"):
        session.publish_batch("q", [[b"x", None, None]], "S", 2**63)
    assert session.unconfirmed() == [] and session.settling_keys() == set()


def test_a_numbered_batch_refused_as_out_of_order_is_never_live_for_ever() -> None:
    """A queue that does not know a numbered batch's producer (forgotten, or not opened
    by it) refuses it `out_of_order`, naming its first number: the session took that
    for "behind an earlier live publish", found the batch itself, and rewound it for
    ever (the property test found it). A first attempt is not published; a resend's
    outcome is unknown, and it is not live."""
    session = _session()
    first, _ = session.publish_batch("q", [[b"x", "a", None]], "N", None, [4])
    (refused,) = session.receive(_error(first, "out_of_order", expected_seq=4))
    assert isinstance(refused, Failed) and type(refused.error) is ServerError
    resent, _ = session.publish_batch("q", [[b"y", "b", None]], "N", None, [6], True)
    session.connection_lost()
    session.connection_made()
    session.unconfirmed()
    (unknown,) = session.receive(_error(resent, "out_of_order", expected_seq=6))
    assert isinstance(unknown, Failed) and isinstance(unknown.error, OutcomeUnknownError)
    assert session.settling_keys() == set() and session.unconfirmed() == []


def test_a_resend_refused_by_a_full_queue_is_sent_again_on_the_same_connection() -> None:
    """A resend refused because the queue is full for now stays live ("parked"). It used
    to be sent again only on the next connection: with none coming, the publish stayed
    unconfirmed for ever, its key settling for ever (simulator, `--max-length 20
    --overflow reject-publish`, seed 3: not drained 60 s after heal). Now it goes again
    after `PARKED_RETRY_DELAY`, on this connection, alone (not the queue's other live
    publishes), and as often as the queue refuses it."""
    session = _session()
    first, _ = session.publish("q", b"m0", "k", None)
    later, _ = session.publish("q", b"m1", "j", None)
    session.connection_lost()
    session.connection_made()
    assert [f["id"] for f in session.unconfirmed()] == [first, later]
    told = 0
    for attempt in range(4):
        events = session.receive(_error(first, "queue_full"))
        if attempt == 0:  # `later` is refused behind it, and waits for it
            assert session.receive(_error(later, "out_of_order", expected_seq=0)) == []
        told += sum(isinstance(e, Failed) for e in events)
        # again later, and later each time (1 s, 2 s, 4 s, 8 s): not a storm
        assert RewindLater("q", PARKED_RETRY_DELAY * 2**attempt) in events
        # the producer's earliest alone (the rest would be refused behind it)
        assert [f["id"] for f in session.rewind("q")] == [first]
    assert told == 1  # its caller is told "outcome unknown" once
    assert session.rewind("q") == []  # a second timer for the same retry sends nothing
    (resolved, retry) = session.receive({"t": "reply", "id": first, "offset": 0})
    assert isinstance(resolved, Resolved)
    # the queue takes publishes again: what waited behind it goes at once, not a
    # second later (72 publishes a disk alarm parked took 72 s: the simulator's seed 1)
    assert isinstance(retry, Send) and retry.frame["id"] == later and retry.frame["retry"]
    assert session.rewind("q") == []
    assert session.settling_keys() == {"j"}
    # refused for now again: parked, on the delay reset by the confirm
    assert RewindLater("q", PARKED_RETRY_DELAY) in session.receive(_error(later, "queue_full"))


def test_a_confirm_releases_each_producers_next_parked_publish_not_all_of_them() -> None:
    """Released all at once, each confirm of a queue full for now sent every parked
    publish again, each refused again as one more log entry (1,000 parked publishes
    made 251,500 proposals); released one a second, 72 took 72 s. Now each confirm
    sends the producer's next one at once."""
    session = _session()
    ids = [session.publish("q", b"m%d" % i, "k", None)[0] for i in range(3)]
    session.connection_lost()
    session.connection_made()
    session.unconfirmed()
    session.receive(_error(ids[0], "queue_full"))
    for later in ids[1:]:  # refused behind it: they wait with it
        assert session.receive(_error(later, "out_of_order", expected_seq=0)) == []
    assert [f["id"] for f in session.rewind("q")] == [ids[0]]
    for i, confirmed in enumerate(ids):
        events = session.receive({"t": "reply", "id": confirmed, "offset": i})
        sent = [e.frame["id"] for e in events if isinstance(e, Send)]
        assert sent == ids[i + 1 : i + 2]  # the next one only, at once
    assert session.settling_keys() == set()


def test_a_resend_refused_as_sealed_is_no_longer_live() -> None:
    """A producer sealed (its Spark job committed) takes nothing more: a resend refused
    so settles as outcome unknown (an earlier attempt may have landed), not parked and
    resent on every reconnect for ever."""
    session = _session()
    first, _ = session.publish("q", b"m0", "k", None)
    session.connection_lost()
    session.connection_made()
    session.unconfirmed()
    events = session.receive(_error(first, "producer_sealed"))
    assert any(isinstance(e, Failed) and isinstance(e.error, OutcomeUnknownError) for e in events)
    assert session.unconfirmed() == [] and session.settling_keys() == set()


def test_a_resend_refused_by_a_disk_alarm_is_tried_every_second_without_backing_off() -> None:
    """A disk alarm clears within seconds of the space coming back, and publishers
    should resume then (RabbitMQ unblocks them at once): a resend it refuses is tried
    again every `PARKED_RETRY_DELAY`, not after 2, 4, 8 ... 30 s as a full queue's."""
    session = _session()
    first, _ = session.publish("q", b"m0", "k", None)
    session.connection_lost()
    session.connection_made()
    session.unconfirmed()
    for _ in range(5):
        events = session.receive(_error(first, "disk_alarm"))
        assert RewindLater("q", PARKED_RETRY_DELAY) in events
        assert [f["id"] for f in session.rewind("q")] == [first]


def test_a_resend_refused_because_the_batch_can_never_fit_is_not_published() -> None:
    """`over_max_length` refuses every attempt of a batch alike: a resend refused so is
    "not published" for certain, not parked and retried for ever."""
    session = _session()
    first, _ = session.publish("q", b"m0", "k", None)
    session.connection_lost()
    session.connection_made()
    assert [f["id"] for f in session.unconfirmed()] == [first]
    events = session.receive(_error(first, "over_max_length"))
    (failed,) = [e for e in events if isinstance(e, Failed)]
    assert type(failed.error) is ServerError
    assert not any(isinstance(e, RewindLater) for e in events)
    assert session.settling_keys() == set()


def test_after_this_client_deletes_a_queue_it_publishes_to_it_under_a_new_id_from_seq_0() -> None:
    """A queue declared again under the deleted one's name refuses the deleted one's
    producer ids: the client that deleted it takes a new one (another client's next
    publish is refused, and it renews then), and a queue's deletion by a consumer of
    it is said: `queue_deleted`, never subscribed again."""
    session = _session()
    _, first = session.publish("q", b"m0", None, None)
    session.receive(_reply(first["id"], offset=0))
    session.queue_deleted("q")
    _, again = session.publish("q", b"m1", None, None)
    assert again["producer"] != first["producer"] and again["seq"] == 0
    consumer = _Consumer("q")
    subscribed, _ = session.subscribe(consumer)
    session.receive(_reply(subscribed, consumer="n.1"))
    cancelled = {"t": "cancelled", "consumer": "n.1", "reason": "queue_deleted"}
    assert session.receive(cancelled) == [ConsumerEnded(consumer, "queue_deleted")]
