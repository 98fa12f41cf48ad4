"""The real `ClientSession` against the real machine, through a network the test
controls: random interleavings of publish, batch, timeout (the caller stops waiting),
permanent error, resume, lost replies and reconnects (rewind). Whatever happens, every
logical publish lands at most once, each key's messages land in the order the
application published them, a publish the application was told succeeded landed, and a
key is paused after any failure reported to the application (issue 15)."""

from __future__ import annotations

import os
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from quorumq.client.core import KeyPausedError, OutcomeUnknownError
from quorumq.client.session import ClientSession, Failed, Resolved, RewindLater
from quorumq.machine import (
    Declare,
    Enqueue,
    EnqueueBatch,
    Enqueued,
    Error,
    Machine,
    Message,
    Meta,
)

KEYS = ["a", "b", "c"]


class SessionAgainstTheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.session = ClientSession(settle=lambda _d, _a, _r: None)
        self.session.connection_made()
        self.machine = Machine()
        self.index = 1
        self.machine.apply(Meta(1, 0), Declare(queue="q"))
        self.to_node: list[dict[str, Any]] = []  # frames on their way, in order
        self.to_client: list[dict[str, Any]] = []  # replies on their way, in order
        self.proposed: list[tuple[int, dict[str, Any]]] = []
        """Frames in the Raft pipeline, with the connection they came on: they commit
        in order, after a reconnect too (their answers then go nowhere)."""
        self.connection = 0
        self.published: dict[str, list[bytes]] = {k: [] for k in KEYS}  # app order
        self.body_of: dict[int, list[bytes]] = {}  # request id -> its bodies
        self.told_ok: set[bytes] = set()
        self.waiting: set[int] = set()  # request ids the application waits for
        self.counter = 0
        self.rewinds: list[str] = []
        self.events: list[Failed] = []  # failures reported to the application

    # ------------------------------------------------------------ the app

    def _body(self, key: str) -> bytes:
        self.counter += 1
        return f"{key}{self.counter}".encode()

    @rule(key=st.sampled_from(KEYS))
    def publish(self, key: str) -> None:
        body = self._body(key)
        try:
            request_id, frame = self.session.publish("q", body, key, None)
        except KeyPausedError:  # paused, or behind a retired producer's unconfirmed one
            assert key in self.session.producer.paused | self.session.settling_keys()
            return
        self.published[key].append(body)
        self.body_of[request_id] = [body]
        self.waiting.add(request_id)
        self.to_node.append(frame)

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=3))
    def publish_batch(self, keys: list[str]) -> None:
        rows = [[self._body(k), k, None] for k in keys]
        try:
            request_id, frame = self.session.publish_batch("q", rows)
        except KeyPausedError:
            assert set(keys) & (self.session.producer.paused | self.session.settling_keys())
            return
        for body, key, _ in rows:
            self.published[key].append(body)
        self.body_of[request_id] = [r[0] for r in rows]
        self.waiting.add(request_id)
        self.to_node.append(frame)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def stop_waiting(self, data: Any) -> None:
        """A timeout or a cancelled caller: outcome unknown, the key paused."""
        request_id = data.draw(st.sampled_from(sorted(self.waiting)))
        self.waiting.discard(request_id)
        self.session.outcome_unknown(request_id, "gave up")
        self._expect_paused(request_id)

    @rule(key=st.sampled_from(KEYS))
    def resume(self, key: str) -> None:
        try:
            self.session.resume(key)
        except KeyPausedError:  # a publish of it is live: it may still land
            assert key in self.session.settling_keys()

    # ------------------------------------------------------------ the node

    @precondition(lambda self: self.to_node)
    @rule(refuse=st.integers(0, 9))
    def node_reads_a_frame(self, refuse: int) -> None:
        """Refused at once (too large, say: checked before proposing, so answered while
        earlier publishes are still in the Raft pipeline), or proposed."""
        frame = self.to_node.pop(0)
        if refuse == 0:
            self.to_client.append(
                {"t": "error", "id": frame["id"], "code": "too_large", "message": "no"}
            )
        else:
            self.proposed.append((self.connection, frame))

    @precondition(lambda self: self.proposed)
    @rule()
    def an_entry_commits(self) -> None:
        connection, frame = self.proposed.pop(0)
        if frame["t"] == "publish":
            command: Any = Enqueue(
                queue="q",
                body=frame["body"],
                key=frame["key"],
                producer=frame["producer"],
                seq=frame["seq"],
            )
        else:
            command = EnqueueBatch(
                queue="q",
                messages=[Message(body=b, key=k, headers=h) for b, k, h in frame["messages"]],
                producer=frame["producer"],
                first_seq=frame["first_seq"],
            )
        self.index += 1
        reply = self.machine.apply(Meta(self.index, self.index), command).reply
        if connection != self.connection:
            return  # its connection is gone: nobody reads the answer
        if isinstance(reply, Error):
            answer = {
                "t": "error",
                "id": frame["id"],
                "code": reply.code.value,
                "message": reply.message,
                "expected_seq": reply.expected_seq,
            }
        else:
            assert isinstance(reply, Enqueued)
            answer = {"t": "reply", "id": frame["id"], "offset": reply.offset}
        self.to_client.append(answer)

    @precondition(lambda self: self.proposed)
    @rule(data=st.data())
    def a_leader_change_loses_a_proposal(self, data: Any) -> None:
        """Forwarded to a leader that lost it: never applied, never answered."""
        self.proposed.pop(data.draw(st.integers(0, len(self.proposed) - 1)))

    @precondition(lambda self: self.to_client)
    @rule(lose=st.integers(0, 9))
    def a_reply_arrives(self, lose: int) -> None:
        answer = self.to_client.pop(0)
        if lose == 0:
            return  # lost with its connection, in effect: the reconnect resends
        for event in self.session.receive(answer):
            if isinstance(event, RewindLater):
                self.rewinds.append(event.queue)
            elif isinstance(event, Resolved) and event.request_id in self.waiting:
                self.waiting.discard(event.request_id)
                self.told_ok.update(self.body_of[event.request_id])
            elif isinstance(event, Failed) and event.request_id in self.waiting:
                self.events.append(event)
                self.waiting.discard(event.request_id)
                self._expect_paused(event.request_id)

    @precondition(lambda self: self.rewinds)
    @rule()
    def rewind(self) -> None:
        self.to_node.extend(self.session.rewind(self.rewinds.pop(0)))

    @rule()
    def reconnect(self) -> None:
        self.connection += 1
        self.to_node.clear()
        self.to_client.clear()
        for event in self.session.connection_lost():
            assert not isinstance(event, Failed) or event.request_id not in self.waiting
        self.session.connection_made()
        self.rewinds.clear()
        self.to_node.extend(self.session.unconfirmed())

    # ------------------------------------------------------------ checks

    def _expect_paused(self, request_id: int) -> None:
        keys = {b.decode()[0] for b in self.body_of[request_id]}
        assert keys <= self.session.producer.paused, (keys, self.session.producer.paused)

    def _landed(self) -> list[Any]:
        return list(self.machine.read("q", 0, 10**9))

    @invariant()
    def each_publish_lands_at_most_once_and_each_key_in_order(self) -> None:
        bodies = [m.body for m in self._landed()]
        assert len(bodies) == len(set(bodies)), "a publish landed twice"
        for key, order in self.published.items():
            landed = [b for b in bodies if b.decode()[0] == key]
            position = {b: i for i, b in enumerate(order)}
            assert [position[b] for b in landed] == sorted(position[b] for b in landed), key

    @invariant()
    def what_the_app_was_told_succeeded_landed(self) -> None:
        bodies = {m.body for m in self._landed()}
        assert self.told_ok <= bodies


SessionAgainstTheMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("QUORUMQ_PROPERTY_EXAMPLES", "300")),
    stateful_step_count=50,
    deadline=None,
)
TestSessionAgainstTheMachine = SessionAgainstTheMachine.TestCase



def test_a_key_is_not_overtaken_by_its_next_publish_under_a_renewed_producer_id() -> None:
    """m0 (key a) is lost in the Raft pipeline; m1 (key b) is refused at once, which
    renews the producer id; m2 (key a) under the new id would land before m0's resend.
    The hypothesis search above did not find this in 4,000 examples; written out here."""
    m = SessionAgainstTheMachine()
    m.publish("a")  # m0
    m.publish("b")  # m1
    m.node_reads_a_frame(refuse=5)  # m0 proposed ...
    m.node_reads_a_frame(refuse=0)  # m1 refused: too large
    m.proposed.pop(0)  # ... and lost in a leader change
    m.a_reply_arrives(lose=5)  # m1's refusal: key b paused, the producer id renewed
    m.publish("a")  # m2 must wait for m0: refused for now, not sent
    assert m.published["a"] == [b"a1"]
    m.reconnect()  # m0 is resent and lands
    m.node_reads_a_frame(refuse=5)
    m.an_entry_commits()
    m.a_reply_arrives(lose=5)
    m.publish("a")  # now it goes
    m.node_reads_a_frame(refuse=5)
    m.an_entry_commits()
    assert [x.body for x in m.machine.read("q", 0, 10)] == [b"a1", b"a4"]
    m.each_publish_lands_at_most_once_and_each_key_in_order()


def test_a_publish_is_not_told_not_published_when_a_resend_before_it_is_refused() -> None:
    """a1 and b2 land, their replies are lost, the client reconnects and publishes c3,
    and a node with a smaller --max-body refuses a1's resend. c3 (and b2) were failed as
    "not published", yet the log then held [a1, b2, c3]: an application retry of c3
    would have been a duplicate."""
    m = SessionAgainstTheMachine()
    m.publish("a")  # a1
    m.publish("b")  # b2
    for _ in range(2):
        m.node_reads_a_frame(refuse=5)
        m.an_entry_commits()
        m.a_reply_arrives(lose=0)  # lost
    m.reconnect()  # a1 and b2 resent
    m.publish("c")  # c3: sent first on this connection
    m.node_reads_a_frame(refuse=0)  # a1's resend: too large for this node
    m.a_reply_arrives(lose=5)
    failed = {e.request_id: e.error for e in m.events if isinstance(e, Failed)}
    assert list(failed.values()) and all(
        isinstance(e, OutcomeUnknownError) for e in failed.values()
    ), failed  # a1: outcome unknown; b2 and c3: not failed
    for _ in range(2):
        m.node_reads_a_frame(refuse=5)
        m.an_entry_commits()
        m.a_reply_arrives(lose=5)
    assert [x.body for x in m.machine.read("q", 0, 10)] == [b"a1", b"b2", b"c3"]
    assert m.told_ok == {b"b2", b"c3"}
