"""The client's protocol state, driven with frames alone (no socket, no node)."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from quorumq.client.core import QuorumqError
from quorumq.client.session import ClientSession, ConsumerEnded, Failed, Resolved


@attrs.define
class _Consumer:
    queue: str
    prefetch: int = 10
    id: str = ""


def _session() -> ClientSession:
    return ClientSession(settle=lambda _delivery, _ack, _requeue: None)


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
