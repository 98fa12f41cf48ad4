"""The event sequences of RabbitMQ's post on local delivery, played on real machines.

"How quorum queues deliver locally while still offering ordering guarantees" walks
three replicas (leader B, followers A and C; consumer c1 on A, c2 on C) through a log
of enqueue / subscribe / ack / down commands that each replica applies at its own
pace. Playing it here shows the same thing with our machine: every replica computes
the same assignment, and only the replica local to a consumer sends to it.
"""

from __future__ import annotations

from collections.abc import Iterator

import attrs

from ..machine import (
    Ack,
    Command,
    Declare,
    Deliver,
    Down,
    Enqueue,
    Machine,
    Meta,
    Subscribe,
)


@attrs.frozen(kw_only=True)
class Apply:
    """At `event`, `replica` applies the next entry of its log."""

    event: int
    replica: str


@attrs.frozen(kw_only=True)
class Scenario:
    name: str
    title: str
    replicas: tuple[str, ...]
    log: tuple[Command, ...]
    applies: tuple[Apply, ...]
    notes: tuple[tuple[int, str], ...] = ()
    """Events that are not applies (a broker fails, an election), for the printout."""


@attrs.frozen(kw_only=True)
class Step:
    event: int
    replica: str
    index: int
    command: Command
    sent: tuple[Deliver, ...]
    """Deliveries this replica sends itself: its consumers are local."""
    tracked: tuple[Deliver, ...]
    """Deliveries this replica only records: another replica sends them."""
    service_queue: tuple[str, ...]
    digest: str


QUEUE = "q"


def _applies(*pairs: tuple[int, str]) -> tuple[Apply, ...]:
    return tuple(Apply(event=e, replica=r) for e, r in pairs)


_DECLARE = _applies((0, "A"), (0, "B"), (0, "C"))
_START = (
    Declare(queue=QUEUE),
    Enqueue(queue=QUEUE, body=b"m1"),
    Subscribe(queue=QUEUE, consumer="c1", node="A"),
    Subscribe(queue=QUEUE, consumer="c2", node="C"),
    Enqueue(queue=QUEUE, body=b"m2"),
)
_FIRST_GROUPS = _applies((5, "B"), (8, "C"), (9, "A"), (10, "B"), (15, "C"), (16, "A"))

RABBITMQ_POST_MAIN = Scenario(
    name="main",
    title="RabbitMQ post, main sequence (events 1-35): local delivery through a leader change",
    replicas=("A", "B", "C"),
    log=(
        *_START,
        Ack(queue=QUEUE, consumer="c1", offsets=(0,)),
        Enqueue(queue=QUEUE, body=b"m3"),
    ),
    applies=(
        _DECLARE
        + _FIRST_GROUPS
        + _applies(
            (17, "B"),
            (20, "A"),
            (22, "C"),
            (23, "B"),
            (24, "B"),
            (25, "C"),
            (26, "A"),
            (32, "A"),
            (33, "C"),
            (34, "A"),
            (35, "C"),
        )
    ),
    notes=((27, "the broker hosting leader B fails"), (28, "A wins the election and leads")),
)

RABBITMQ_POST_ALTERNATE = Scenario(
    name="alternate",
    title="RabbitMQ post, alternate sequence: consumer c1 fails after m1 was delivered",
    replicas=("A", "B", "C"),
    log=(*_START, Down(consumer="c1")),
    applies=(
        _DECLARE
        + _FIRST_GROUPS
        + _applies(
            (18, "B"),
            (19, "A"),
            (23, "C"),
            (24, "B"),
            (25, "A"),
            (26, "B"),
            (27, "C"),
            (28, "A"),
            (31, "C"),
        )
    ),
    notes=((17, "the channel of c1 goes away; B's monitor will log down c1"),),
)

SCENARIOS = {s.name: s for s in (RABBITMQ_POST_MAIN, RABBITMQ_POST_ALTERNATE)}


def play(scenario: Scenario) -> Iterator[Step]:
    """Apply the log on one machine per replica, in the scenario's order of applies."""
    machines = {r: Machine() for r in scenario.replicas}
    for a in scenario.applies:
        machine = machines[a.replica]
        index = machine.last_index + 1
        command = scenario.log[index - 1]
        applied = machine.apply(Meta(index, index), command)
        deliveries = [e for e in applied.effects if isinstance(e, Deliver)]
        yield Step(
            event=a.event,
            replica=a.replica,
            index=index,
            command=command,
            sent=tuple(d for d in deliveries if d.node == a.replica),
            tracked=tuple(d for d in deliveries if d.node != a.replica),
            service_queue=machine.service_queue(QUEUE) if QUEUE in machine.queues() else (),
            digest=machine.digest(),
        )


def describe(command: Command) -> str:
    """A short label in the post's words: 'enqueue m1', 'subscribe c1@A', 'ack 0'."""
    match command:
        case Declare(queue=queue):
            return f"declare {queue}"
        case Enqueue(body=body):
            return f"enqueue {body.decode()}"
        case Subscribe(consumer=consumer, node=node):
            return f"subscribe {consumer}@{node}"
        case Ack(consumer=consumer, offsets=offsets):
            return f"ack {consumer} {list(offsets)}"
        case Down(consumer=consumer):
            return f"down {consumer}"
    return type(command).__name__.lower()


def render(scenario: Scenario) -> str:
    """The run as a table: who applied what, who sent what, who only tracked it."""

    def label(ds: tuple[Deliver, ...]) -> str:
        return ", ".join(
            f"{d.body.decode()}->{d.consumer}" + ("*" if d.redelivered else "") for d in ds
        )

    notes = dict(scenario.notes)
    rows = [
        f"{scenario.title}",
        f"{'event':>5}  {'replica':<7}  {'applies':<18}  {'sends':<16}  {'tracks only':<16}  SQ",
    ]
    for step in play(scenario):
        for event in sorted(e for e in notes if e < step.event):
            rows.append(f"{event:>5}  {notes.pop(event)}")
        rows.append(
            f"{step.event:>5}  {step.replica:<7}  {describe(step.command):<18}  "
            f"{label(step.sent) or '-':<16}  {label(step.tracked) or '-':<16}  "
            f"{' '.join(step.service_queue) or '-'}"
        )
    rows.append("(* = redelivered)")
    return "\n".join(rows)
