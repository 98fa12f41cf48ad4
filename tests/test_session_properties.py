"""The real `ClientSession` against the real machine, through a network the test
controls. The application publishes (alone, in batches, in batches under a producer id
and sequence numbers of its own), stops waiting (a timeout, a cancelled trio caller),
resumes keys and retries as the README says, subscribes and cancels consumers. The
network and the node refuse frames at once, lose proposals in leader changes, time
proposals out while they stay in the Raft pipeline, answer `not_applied` and
`outcome_unknown`, and break connections (a node may still read and propose what a
dropped connection had sent). The shell's part is played as the real shells do it:
timed rewinds outlive a reconnect, a consumer is subscribed again after a reconnect.

Safety, checked after every step: every logical message lands at most once, each
key's messages land in the order the application published them, what the application
was told succeeded landed, what it was told was not published never lands (nor does a
publish it found missing once its key had settled, before publishing it again; a batch
under its own producer id is replayed with the same numbers instead), a key
is paused after any failure reported to it, and no consumer is subscribed for a caller
that stopped waiting or a consumer that was cancelled. Liveness, checked once the
faults stop (one last connection that loses nothing): nothing is left live, no key is
wedged, every publish the application waited for was answered, and the node holds
exactly the consumers the application holds (issue 15)."""

from __future__ import annotations

import contextlib
import os
from typing import Any

import attrs
import hypothesis
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from quorumq.client.core import (
    ConnectionLostError,
    KeyPausedError,
    OutcomeUnknownError,
    QuorumqError,
    TooManyUnconfirmedError,
)
from quorumq.client.session import (
    ClientSession,
    Event,
    Failed,
    Resolved,
    Resubscribe,
    RewindLater,
    Send,
)
from quorumq.machine import (
    Ack,
    Cancel,
    Command,
    Declare,
    Deliver,
    Down,
    Enqueue,
    EnqueueBatch,
    Enqueued,
    Error,
    Machine,
    Message,
    Meta,
    QueueOptions,
    Subscribe,
)

KEYS = ["a", "b", "c"]
MAX_UNCONFIRMED = 12
"""Small, so that the limit is met (`TooManyUnconfirmedError`)."""


def note(what: str) -> None:
    """For --hypothesis-show-statistics: which paths the examples took."""
    with contextlib.suppress(hypothesis.errors.InvalidArgument):  # (a named test)
        hypothesis.event(what)


@attrs.define(eq=False)
class _Consumer:
    queue: str = "s"
    prefetch: int = 5
    id: str = ""
    cancel_requested: bool = False


@attrs.define
class _Proposal:
    connection: int
    frame: dict[str, Any]
    answered: bool = False
    """Answered already (a proposal timeout): its outcome, when it comes, goes nowhere."""


@attrs.define
class _Call:
    """One publish call of the application: its bodies and, for a batch under the
    application's own producer id, what to replay it with."""

    bodies: list[bytes]
    rows: list[list[Any]]
    first_seq: int | None = None
    seqs: list[int] | None = None
    """A batch under producer "N", numbered by its caller with gaps (as the Spark sink
    numbers rows by their source offsets)."""
    opens: bool = False
    """N's first batch (it opens the producer)."""


class SessionAgainstTheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.session = ClientSession(
            settle=lambda _d, _a, _r, _w: None, max_unconfirmed=MAX_UNCONFIRMED
        )
        self.machine = Machine()
        self.index = 0
        self._apply(Declare(queue="q"))
        self._apply(Declare(queue="s"))
        self.connection = 0
        self.connected = True
        self.session.connection_made()
        self.to_node: dict[int, list[dict[str, Any]]] = {0: []}
        """Frames on their way, per connection, in order. A dropped connection's may
        still be read (and proposed) by its node, their answers going nowhere."""
        self.to_client: list[dict[str, Any]] = []  # answers on the current connection
        self.proposed: list[_Proposal] = []  # the Raft pipeline: commits in this order
        self.consumers_on: dict[int, set[str]] = {}  # connection -> consumer ids subscribed
        self.next_consumer = 0

        # the application
        self.counter = 0
        self.calls: list[_Call] = []  # call number -> call (its rows carry {"c": number})
        self.call_of: dict[int, int] = {}  # request id -> call number
        self.waiting: set[int] = set()  # publishes the application waits for
        self.order: dict[str, list[bytes]] = {k: [] for k in KEYS}
        """Each key's bodies in the order the application published them; a body
        published again (it certainly did not land) moves to the end."""
        self.told_ok: set[bytes] = set()
        self.must_not_land: set[int] = set()
        """Calls told "not published", or found missing once their key had settled."""
        self.not_published: dict[bytes, int] = {}  # body -> its call: may be retried
        self.unknown: dict[bytes, int] = {}  # body -> its call, outcome unknown
        self.s_next = 0  # the application's own producer "S": its next sequence number
        self.s_failed: dict[int, int] = {}  # first_seq -> call, to replay
        self.n_next = 0  # the application's numbered producer "N": its next free number
        self.n_opened = False  # N's opening batch was sent
        self.n_failed: dict[int, int] = {}  # first of its seqs -> call, to replay
        self.rewinds: list[str] = []
        self.subscribing: dict[int, _Consumer] = {}  # request id -> consumer being subscribed
        self.held: list[_Consumer] = []  # consumers the application holds
        self.resubscribing: list[_Consumer] = []  # to subscribe again (the shell's part)
        self.cancelled_as: dict[int, str] = {}  # id(consumer) -> its id when cancelled

    # ------------------------------------------------------------ plumbing

    def _apply(self, command: Command) -> Any:
        self.index += 1
        return self.machine.apply(Meta(self.index, self.index), command).reply

    def _send(self, frame: dict[str, Any]) -> None:
        """What a shell does with a frame: write it on the connection, if there is one."""
        if self.connected:
            self.to_node[self.connection].append(frame)

    def _answer(self, connection: int, frame: dict[str, Any]) -> None:
        if connection == self.connection and self.connected:
            self.to_client.append(frame)

    def _handle(self, events: list[Event]) -> None:
        for event in events:
            if isinstance(event, RewindLater):
                self.rewinds.append(event.queue)
            elif isinstance(event, Send):
                note(f"sent for nobody: {event.frame['t']}")
                self._send(event.frame)
            elif isinstance(event, Resubscribe):
                assert not event.consumer.cancel_requested, "a cancelled consumer comes back"
                self.resubscribing.append(event.consumer)
            elif isinstance(event, Resolved | Failed):
                self._settled(event)
        self._consumers_are_wanted()

    def _settled(self, event: Resolved | Failed) -> None:
        request_id = event.request_id
        consumer = self.subscribing.pop(request_id, None)
        if consumer is not None:
            if isinstance(event, Resolved):
                if consumer not in self.held and not consumer.cancel_requested:
                    self.held.append(consumer)
            elif not consumer.cancel_requested and consumer in self.held:
                self.resubscribing.append(consumer)  # the shell tries again
            return
        if request_id not in self.waiting:
            return
        self.waiting.discard(request_id)
        call = self.call_of[request_id]
        bodies = self.calls[call].bodies
        if isinstance(event, Resolved):
            note("told: published")
            self.told_ok.update(bodies)
            return
        self._expect_paused(call)
        note(f"told: {type(event.error).__name__}")
        for body in bodies:
            if isinstance(event.error, OutcomeUnknownError):
                self.unknown[body] = call
            else:  # not published
                if not self._replayed_with_its_numbers(call):
                    self.must_not_land.add(call)
                self.not_published[body] = call
        self._to_replay(call)

    def _replayed_with_its_numbers(self, call: int) -> bool:
        return self.calls[call].first_seq is not None or self.calls[call].seqs is not None

    def _to_replay(self, call: int) -> None:
        first_seq, seqs = self.calls[call].first_seq, self.calls[call].seqs
        if first_seq is not None:
            self.s_failed[first_seq] = call
        if seqs is not None:
            self.n_failed[seqs[0]] = call

    def _expect_paused(self, call: int) -> None:
        keys = {b.decode()[0] for b in self.calls[call].bodies}
        assert keys <= self.session.producer.paused, (keys, self.session.producer.paused)

    def _new_call(
        self, bodies: list[bytes], first_seq: int | None = None, seqs: list[int] | None = None
    ) -> int:
        call = len(self.calls)
        rows = [[b, b.decode()[0], {"c": str(call)}] for b in bodies]
        self.calls.append(_Call(bodies, rows, first_seq, seqs))
        return call

    def _published(self, request_id: int, frame: dict[str, Any], call: int) -> None:
        for body in self.calls[call].bodies:
            key = body.decode()[0]
            if body in self.order[key]:
                self.order[key].remove(body)  # published again: it did not land
            self.order[key].append(body)
            self.not_published.pop(body, None)
            self.unknown.pop(body, None)
        self.call_of[request_id] = call
        self.waiting.add(request_id)
        self._send(frame)

    def _landed(self) -> list[Any]:
        return list(self.machine.read("q", 0, 10**9))

    # ------------------------------------------------------------ the application

    def _body(self, key: str) -> bytes:
        self.counter += 1
        return f"{key}{self.counter}".encode()

    def _refused_before_sending(self, error: QuorumqError, keys: set[str]) -> None:
        note(f"refused before sending: {type(error).__name__}")
        if isinstance(error, KeyPausedError):
            assert keys & (self.session.producer.paused | self.session.settling_keys())
        else:
            assert isinstance(error, TooManyUnconfirmedError), error

    @rule(key=st.sampled_from(KEYS))
    def publish(self, key: str) -> None:
        call = self._new_call([self._body(key)])
        body, _, headers = self.calls[call].rows[0]
        try:
            request_id, frame = self.session.publish("q", body, key, headers)
        except (KeyPausedError, TooManyUnconfirmedError) as e:
            self._refused_before_sending(e, {key})
            return
        self._published(request_id, frame, call)

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=3))
    def publish_batch(self, keys: list[str]) -> None:
        call = self._new_call([self._body(k) for k in keys])
        try:
            request_id, frame = self.session.publish_batch("q", self.calls[call].rows)
        except (KeyPausedError, TooManyUnconfirmedError) as e:
            self._refused_before_sending(e, set(keys))
            return
        self._published(request_id, frame, call)

    @precondition(lambda self: not self.s_failed)
    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=2))
    def publish_batch_under_its_own_producer(self, keys: list[str]) -> None:
        """A caller that derives the producer id and sequence numbers from its input (as
        the Spark sink does), so that a replay of the same input is recognised. It goes
        through its input in order: a failed batch is replayed before any later one."""
        call = self._new_call([self._body(k) for k in keys], first_seq=self.s_next)
        rows = self.calls[call].rows
        try:
            request_id, frame = self.session.publish_batch("q", rows, "S", self.s_next)
        except (KeyPausedError, TooManyUnconfirmedError) as e:
            self._refused_before_sending(e, set(keys))
            return
        self.s_next += len(rows)
        self._published(request_id, frame, call)

    @precondition(lambda self: not self.n_failed)
    @rule(
        keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=3),
        gaps=st.lists(st.integers(0, 3), min_size=3, max_size=3),
    )
    def publish_batch_numbered_by_its_input(self, keys: list[str], gaps: list[int]) -> None:
        """A caller that numbers each message from its input, with gaps (the Spark sink
        numbers rows by their source offsets), one batch at a time; a failed batch is
        replayed with the same numbers before any later one."""
        seqs, number = [], self.n_next
        for i in range(len(keys)):
            number += gaps[i]
            seqs.append(number)
            number += 1
        call = self._new_call([self._body(k) for k in keys], seqs=seqs)
        self.calls[call].opens = opens = not self.n_opened
        rows = self.calls[call].rows
        try:
            request_id, frame = self.session.publish_batch("q", rows, "N", None, seqs, opens)
        except (KeyPausedError, TooManyUnconfirmedError) as e:
            self._refused_before_sending(e, set(keys))
            return
        except QuorumqError as e:  # one is still live: the session refuses a second
            assert "still live" in str(e)
            assert any(f["producer"] == "N" for f in self.session.unconfirmed()), e
            note("a numbered batch refused: one is live")
            return
        self.n_next = number
        self.n_opened = True
        self._published(request_id, frame, call)

    @precondition(lambda self: self.waiting or self.subscribing)
    @rule(data=st.data(), cancelled=st.booleans())
    def stop_waiting(self, data: Any, cancelled: bool) -> None:
        """A timeout, or a trio caller cancelled: outcome unknown, keys paused (a
        publish); forgotten (a subscribe)."""
        request_id = data.draw(st.sampled_from(sorted(self.waiting | set(self.subscribing))))
        self.stop_waiting_on(request_id, cancelled)

    def stop_waiting_on(self, request_id: int, cancelled: bool = False) -> None:
        if request_id in self.subscribing:
            assert self.session.abandon(request_id)  # (its answer is not read yet)
            consumer = self.subscribing.pop(request_id)
            if consumer in self.held:  # a resubscribe that timed out: the shell tries again
                self.resubscribing.append(consumer)
            return
        note("stopped waiting for a publish")
        self.waiting.discard(request_id)
        call = self.call_of[request_id]
        if cancelled:
            frame_keys = {b.decode()[0] for b in self.calls[call].bodies}
            self.session.cancelled_while_waiting(request_id, frame_keys)
        else:
            assert self.session.outcome_unknown(request_id, "gave up") is not None
        self._expect_paused(call)
        for body in self.calls[call].bodies:
            self.unknown[body] = call
        self._to_replay(call)

    @rule(key=st.sampled_from(KEYS))
    def resume(self, key: str) -> None:
        try:
            self.session.resume(key)
        except KeyPausedError:  # a publish of it is live: it may still land
            assert key in self.session.settling_keys()

    @precondition(lambda self: self.not_published or self.unknown)
    @rule(data=st.data())
    def retry(self, data: Any) -> None:
        """The README's advice: resume the key (refused while a publish of it is live),
        then publish again what was not published, and what had an unknown outcome if
        a read now shows it did not land (nothing more can land for it). A batch under
        the application's own producer is replayed as it was, with its numbers."""
        body = data.draw(st.sampled_from(sorted(self.not_published | self.unknown)))
        key = body.decode()[0]
        try:  # refused while the key is settling: what made the read below conclusive
            self.session.resume(key)
        except KeyPausedError:
            assert key in self.session.settling_keys()
            return
        if body in self.unknown:
            call = self.unknown[body]
            if body in {m.body for m in self._landed()}:
                del self.unknown[body]  # it landed: nothing to do
                return
            self.must_not_land.add(call)  # settled and missing: it never lands now
        else:
            call = self.not_published[body]
        first_seq, seqs = self.calls[call].first_seq, self.calls[call].seqs
        if first_seq is not None or seqs is not None:  # replayed as it was, with its numbers
            failed = self.s_failed if seqs is None else self.n_failed
            first = first_seq if seqs is None else seqs[0]
            if failed.get(first) != call or first != min(failed):
                return  # the caller replays its input in order
            rows = self.calls[call].rows
            producer = "S" if seqs is None else "N"
            try:
                request_id, frame = self.session.publish_batch(
                    "q", rows, producer, first_seq, seqs, self.calls[call].opens
                )
            except (KeyPausedError, TooManyUnconfirmedError) as e:
                self._refused_before_sending(e, {r[1] for r in rows})
                return
            except QuorumqError as e:  # an attempt of it is still live
                assert seqs is not None and "still live" in str(e), e
                return
            note("replayed with its sequence numbers")
            del failed[first]
            self.must_not_land.discard(call)  # the same call again: it may land now
            self._published(request_id, frame, call)
            return
        note("published again")
        again = self._new_call([body])
        _, _, headers = self.calls[again].rows[0]
        try:
            request_id, frame = self.session.publish("q", body, key, headers)
        except (KeyPausedError, TooManyUnconfirmedError) as e:
            self._refused_before_sending(e, {key})
            return
        self._published(request_id, frame, again)

    @rule()
    def subscribe(self) -> None:
        consumer = _Consumer()
        try:
            request_id, frame = self.session.subscribe(consumer)
        except ConnectionLostError:
            assert not self.connected
            return
        self.subscribing[request_id] = consumer
        self._send(frame)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def cancel(self, data: Any) -> None:
        consumer = data.draw(st.sampled_from(self.held))
        self.held.remove(consumer)
        request = self.session.cancel(consumer)
        self.cancelled_as[id(consumer)] = consumer.id
        if request is not None:
            self._send(request[1])  # its answer: the model does not wait for it

    @precondition(lambda self: self.resubscribing and self.connected)
    @rule()
    def resubscribe(self) -> None:
        """The shell subscribes a consumer again after its connection broke."""
        consumer = self.resubscribing.pop(0)
        try:
            request_id, frame = self.session.subscribe(consumer)
        except QuorumqError:
            assert consumer.cancel_requested, "only a cancelled consumer is refused"
            return
        self.subscribing[request_id] = consumer
        self._send(frame)

    # ------------------------------------------------------------ the node

    @precondition(lambda self: any(self.to_node.values()))
    @rule(stale=st.integers(0, 4), outcome=st.integers(0, 19))
    def node_reads_a_frame(self, stale: int, outcome: int) -> None:
        """A frame is refused at once (too large: checked before proposing, so answered
        while earlier publishes are still in the Raft pipeline; or no leader), or
        proposed. Now and then a dropped connection's node reads one of its frames."""
        dropped = sorted(c for c, f in self.to_node.items() if f and c != self.connection)
        if self.to_node[self.connection] and (stale or not dropped):
            self._read(self.connection, outcome)
        else:
            self._read(dropped[0], outcome)

    def _read(self, connection: int, outcome: int) -> None:
        frame = self.to_node[connection].pop(0)
        if connection != self.connection or not self.connected:
            note("a dropped connection's frame read")
        kind = frame["t"]
        if kind in ("publish", "publish_batch") and outcome < 4:
            code = "too_large" if outcome < 3 else "not_applied"
            self._answer(
                connection, {"t": "error", "id": frame["id"], "code": code, "message": "no"}
            )
        elif kind == "cancel" and frame["consumer"] not in self.consumers_on.get(connection, ()):
            error = {"t": "error", "id": frame["id"], "code": "unknown_consumer", "message": "no"}
            self._answer(connection, error)
        elif kind in ("publish", "publish_batch", "subscribe", "cancel"):
            if kind == "subscribe":
                self.next_consumer += 1
                frame = {**frame, "consumer": f"c{connection}.{self.next_consumer}"}
                self.consumers_on.setdefault(connection, set()).add(frame["consumer"])
            self.proposed.append(_Proposal(connection, frame))

    @precondition(lambda self: self.proposed)
    @rule()
    def an_entry_commits(self) -> None:
        self._commit(self.proposed.pop(0))

    def _commit(self, proposal: _Proposal) -> None:
        frame = proposal.frame
        if frame["t"] == "subscribe":
            command: Command = Subscribe(
                queue="s", consumer=frame["consumer"], node="N", prefetch=frame["prefetch"]
            )
        elif frame["t"] == "cancel":
            command = Cancel(queue="s", consumer=frame["consumer"])
        elif frame["t"] == "publish":
            command = Enqueue(
                queue="q",
                body=frame["body"],
                key=frame["key"],
                headers=frame["headers"],
                producer=frame["producer"],
                seq=frame["seq"],
            )
        else:
            command = EnqueueBatch(
                queue="q",
                messages=[Message(body=b, key=k, headers=h) for b, k, h in frame["messages"]],
                producer=frame["producer"],
                first_seq=frame["first_seq"],
                seqs=frame.get("seqs"),
                opens=bool(frame.get("opens")),
            )
        reply = self._apply(command)
        live = proposal.connection == self.connection and self.connected
        if frame["t"] == "subscribe" and not live:
            self._apply(Down(consumer=frame["consumer"]))  # its connection is gone
        if proposal.answered:
            return
        if isinstance(reply, Error):
            answer = {
                "t": "error",
                "id": frame["id"],
                "code": reply.code.value,
                "message": reply.message,
                "expected_seq": reply.expected_seq,
            }
        elif isinstance(reply, Enqueued):
            answer = {
                "t": "reply",
                "id": frame["id"],
                "offset": reply.offset,
                "count": reply.count,
            }
        elif frame["t"] == "subscribe":
            answer = {"t": "reply", "id": frame["id"], "consumer": frame["consumer"]}
        else:
            answer = {"t": "reply", "id": frame["id"]}
        self._answer(proposal.connection, answer)

    @precondition(lambda self: self.proposed)
    @rule(data=st.data(), code=st.sampled_from(["not_applied", "outcome_unknown"]))
    def a_leader_change_loses_a_proposal(self, data: Any, code: str) -> None:
        """Never applied; the node answers (at its proposal timeout, if not before)."""
        proposal = self.proposed.pop(data.draw(st.integers(0, len(self.proposed) - 1)))
        if not proposal.answered:
            error = {"t": "error", "id": proposal.frame["id"], "code": code, "message": "lost"}
            self._answer(proposal.connection, error)

    @precondition(lambda self: any(not p.answered for p in self.proposed))
    @rule(data=st.data())
    def a_proposal_times_out(self, data: Any) -> None:
        """outcome_unknown at the node's proposal timeout; the proposal stays in the
        pipeline, and may still commit."""
        waiting = [p for p in self.proposed if not p.answered]
        proposal = data.draw(st.sampled_from(waiting))
        proposal.answered = True
        error = {"t": "error", "id": proposal.frame["id"], "code": "outcome_unknown"}
        self._answer(proposal.connection, {**error, "message": "no outcome in time"})

    @precondition(lambda self: self.to_client)
    @rule()
    def an_answer_arrives(self) -> None:
        self._handle(self.session.receive(self.to_client.pop(0)))

    @precondition(lambda self: self.rewinds)
    @rule()
    def a_rewind_is_due(self) -> None:
        """A timer the shell set (it outlives a reconnect)."""
        for frame in self.session.rewind(self.rewinds.pop(0)):
            self._send(frame)

    @precondition(lambda self: self.connected)
    @rule(reconnect=st.integers(0, 2))
    def the_connection_breaks(self, reconnect: int = 0) -> None:
        """Answers on their way are lost with it. Most often the client reconnects at
        once; else later (meanwhile the application goes on)."""
        self._break()
        if reconnect:
            self.a_connection_is_made()

    def _break(self) -> None:
        self.connected = False
        self.to_client.clear()  # answers on their way are lost with it
        for consumer in self.consumers_on.get(self.connection, ()):
            self._apply(Down(consumer=consumer))  # the node downs its consumers
        self._handle(self.session.connection_lost())

    @precondition(lambda self: not self.connected)
    @rule()
    def a_connection_is_made(self) -> None:
        self.connection += 1
        self.connected = True
        self.to_node[self.connection] = []
        self.session.connection_made()
        for frame in self.session.unconfirmed():
            self._send(frame)

    # ------------------------------------------------------------ checks

    @invariant()
    def each_message_lands_at_most_once_and_each_key_in_order(self) -> None:
        bodies = [m.body for m in self._landed()]
        assert len(bodies) == len(set(bodies)), "a message landed twice"
        for key, order in self.order.items():
            landed = [b for b in bodies if b.decode()[0] == key]
            position = {b: i for i, b in enumerate(order)}
            assert [position[b] for b in landed] == sorted(position[b] for b in landed), key

    @invariant()
    def what_the_app_was_told_landed_did_and_what_it_was_told_not_did_not(self) -> None:
        landed = self._landed()
        assert self.told_ok <= {m.body for m in landed}
        calls = {int(m.headers["c"]) for m in landed if m.headers}
        assert not calls & self.must_not_land, "told not published (or settled), yet landed"

    def _consumers_are_wanted(self) -> None:
        """No consumer is registered for nobody: not one whose subscribe the caller
        stopped waiting for, and a cancelled one only under the id it was cancelled
        with (it stays for its acks until its connection ends)."""
        for consumer_id, consumer in self.session.consumers.items():
            if consumer.cancel_requested:
                assert self.cancelled_as.get(id(consumer)) == consumer_id, "resubscribed"
            else:
                assert consumer in self.held, "a consumer nobody holds"

    def teardown(self) -> None:
        """The faults stop: one last connection, to a node that refuses nothing and
        loses nothing, and everything goes through."""
        note(f"publish calls: {min(len(self.calls) // 10 * 10, 40)}+")
        if self.connected:
            self._break()
        self.a_connection_is_made()
        for _ in range(100_000):
            if self.resubscribing:
                self.resubscribe()
            elif any(self.to_node.values()):
                connection = min(c for c, f in self.to_node.items() if f)
                self._read(connection, outcome=19)
            elif self.proposed:
                self.an_entry_commits()
            elif self.to_client:
                self.an_answer_arrives()
            elif self.rewinds:
                self.a_rewind_is_due()
            else:
                break
        self.each_message_lands_at_most_once_and_each_key_in_order()
        self.what_the_app_was_told_landed_did_and_what_it_was_told_not_did_not()
        assert self.session.settling_keys() == set(), "a publish never settled"
        assert self.waiting == set(), "a publish the application waits for was never answered"
        assert self.subscribing == {}, "a subscribe was never answered"
        for key in KEYS:  # no key wedged
            self.session.resume(key)
            self.session.publish("q", b"probe", key, None)
        wanted = {c.id for c in self.held}
        assert set(self.machine.consumers("s")) == wanted, "the node holds other consumers"


SessionAgainstTheMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("QUORUMQ_PROPERTY_EXAMPLES", "200")),
    stateful_step_count=120,
    deadline=None,
)
TestSessionAgainstTheMachine = SessionAgainstTheMachine.TestCase


class SessionAgainstAFullQueue(SessionAgainstTheMachine):
    """The same session, faults and promises, against a queue that refuses publishes
    when it holds two ready messages (`reject-publish`), with a consumer that drains it
    now and then: `queue_full` for now, `over_max_length` for good, parked publishes
    tried again on the same connection, and the later ones given up behind a refusal
    (`RefusedBeforeError`). (A hostile review's harness: parked publishes waited for a
    reconnect that never came, and were all resent every second.)"""

    FULL_AT = 2

    def _apply(self, command: Command) -> Any:
        if isinstance(command, Declare) and command.queue == "q":
            options = QueueOptions(max_length=self.FULL_AT, overflow="reject-publish")
            command = attrs.evolve(command, options=options)
        return super()._apply(command)

    @rule()
    def a_consumer_drains_the_queue(self) -> None:
        self.index += 1
        taker = Subscribe(queue="q", consumer="drain", node="X", prefetch=0)
        applied = self.machine.apply(Meta(self.index, self.index), taker)
        offsets = tuple(e.offset for e in applied.effects if isinstance(e, Deliver))
        if offsets:
            self._apply(Ack(queue="q", consumer="drain", offsets=offsets))
        self._apply(Cancel(queue="q", consumer="drain"))

    @precondition(lambda self: self.rewinds)
    @rule()
    def a_rewind_is_due(self) -> None:
        if not any(self.to_node.values()) and not self.to_client and not self.proposed:
            self.a_consumer_drains_the_queue()  # (in the teardown: the queue empties)
        super().a_rewind_is_due()


SessionAgainstAFullQueue.TestCase.settings = settings(
    max_examples=int(os.environ.get("QUORUMQ_PROPERTY_EXAMPLES", "200")) // 2,
    stateful_step_count=120,
    deadline=None,
)
TestSessionAgainstAFullQueue = SessionAgainstAFullQueue.TestCase


# ------------------------------------------------- named regression tests


def _run(
    m: SessionAgainstTheMachine, *, frames: int = 0, commits: int = 0, answers: int = 0
) -> None:
    for _ in range(frames):
        m._read(m.connection, outcome=19)
    for _ in range(commits):
        m.an_entry_commits()
    for _ in range(answers):
        m.an_answer_arrives()


def test_a_key_is_not_overtaken_by_its_next_publish_under_a_renewed_producer_id() -> None:
    """m0 (key a) is lost in the Raft pipeline; m1 (key b) is refused at once, which
    renews the producer id; m2 (key a) under the new id would land before m0's resend.
    The first hypothesis search did not find this in 4,000 examples; written out here."""
    m = SessionAgainstTheMachine()
    m.publish("a")  # a1
    m.publish("b")  # b2
    m._read(m.connection, outcome=19)  # a1 proposed ...
    m._read(m.connection, outcome=0)  # b2 refused: too large
    m.proposed.pop(0)  # ... and lost in a leader change (answered in time: not yet)
    m.an_answer_arrives()  # b2's refusal: key b paused, the producer id renewed
    m.publish("a")  # a3 must wait for a1: refused for now, not sent
    assert m.order["a"] == [b"a1"]
    m.the_connection_breaks(reconnect=1)  # a1 is resent and lands
    _run(m, frames=1, commits=1, answers=1)
    m.publish("a")  # now it goes
    _run(m, frames=1, commits=1)
    assert [x.body for x in m.machine.read("q", 0, 10)] == [b"a1", b"a4"]
    m.each_message_lands_at_most_once_and_each_key_in_order()


def test_a_publish_is_not_told_not_published_when_a_resend_before_it_is_refused() -> None:
    """a1 and b2 land, their answers are lost with the connection, the client
    reconnects and publishes c3, and a node with a smaller --max-body refuses a1's
    resend. c3 (and b2) were failed as "not published", yet the log then held
    [a1, b2, c3]: an application retry of c3 would have been a duplicate."""
    m = SessionAgainstTheMachine()
    m.publish("a")  # a1
    m.publish("b")  # b2
    _run(m, frames=2, commits=2)
    m.the_connection_breaks(reconnect=1)  # the answers are lost; a1 and b2 resent
    m.publish("c")  # c3: sent first on this connection
    m._read(m.connection, outcome=0)  # a1's resend: too large for this node
    m.an_answer_arrives()
    assert m.unknown == {b"a1": 0} and m.not_published == {}  # b2 and c3: not failed
    _run(m, frames=2, commits=2, answers=2)
    assert [x.body for x in m.machine.read("q", 0, 10)] == [b"a1", b"b2", b"c3"]
    assert m.told_ok == {b"b2", b"c3"}
    m.teardown()  # a1 settles on the next connection
    assert m.unknown == {b"a1": 0}


def test_an_outcome_unknown_publish_is_not_published_again_while_it_may_still_land() -> None:
    """The README said: after outcome unknown, find it with read, then resume. A read
    while the publish was still live (here: still in the Raft pipeline) missed it, and
    the republish landed as well."""
    m = SessionAgainstTheMachine()
    m.publish("a")  # a1
    m._read(m.connection, outcome=19)  # proposed, not committed yet
    (request_id,) = m.waiting
    m.stop_waiting_on(request_id)
    assert b"a1" not in {x.body for x in m._landed()}  # a read proves nothing yet
    m.resume("a")
    assert "a" in m.session.producer.paused  # refused: a1 is live
    m.an_entry_commits()
    m.an_answer_arrives()
    m.resume("a")
    assert [x.body for x in m._landed()] == [b"a1"]
