"""The client's protocol state, driven with frames alone (no socket, no node)."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from quorumq.client.core import ConnectionLostError, QuorumqError, ServerError
from quorumq.client.session import (
    SUBSCRIBE_RETRY_FIRST,
    SUBSCRIBE_RETRY_LONGEST,
    ClientSession,
    ConsumerEnded,
    Failed,
    Resolved,
    Resubscribe,
)


@attrs.define
class _Consumer:
    queue: str
    prefetch: int = 10
    id: str = ""


def _session() -> ClientSession:
    session = ClientSession(settle=lambda _delivery, _ack, _requeue: None)
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
    assert all(str(e.error) == "the client is closed" for e in failed)
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


def _error(frame_id: int, code: str) -> dict[str, Any]:
    return {"t": "error", "id": frame_id, "code": code, "message": "from the node"}


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
    session = ClientSession(settle=lambda _delivery, _ack, _requeue: None)
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
