"""Commands: the only inputs of the queue machine.

Every command is a frozen, keyword-only value that carries everything the machine
needs to decide. Failure and time enter here too (`Down`, `NodeDown`, `Tick`): the
machine reads no clock and watches no socket.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Literal, TypeAlias

import attrs

Overflow: TypeAlias = Literal["drop-head", "reject-publish"]

DEFAULT_CONSUMER_TIMEOUT_MS = 30 * 60 * 1000
"""How long a consumer may hold a delivery when neither queue nor subscribe says (30
minutes, as RabbitMQ): a consumer alive but stuck kept its messages for good."""
MAX_PREFETCH = 65_535
"""The largest `prefetch` a consumer may ask for (RabbitMQ's limit): a huge one turned
the node's slow-consumer cut-off off."""
DEFAULT_RETENTION_BYTES = 64 * 1024 * 1024
"""Stream-view retention by body bytes when a queue does not say (64 MiB)."""
MAX_RETRY_DELAY_MS = 24 * 3600 * 1000
"""The longest a returned message may be held back before it is ready again (a day): a
nack's `delay_ms`, and the upper bound of a queue's `retry_backoff_ms`."""


# Every field is checked to its exact type: a float or a bool where an int belongs, or a
# str that is not valid text, would be held by the machine and then fail the snapshot
# encoder at every compaction (the journal then grows without bound).


def _non_negative(_inst: object, attr: attrs.Attribute[Any], value: Any) -> None:
    """None or an int (exactly: not a bool, not a float) >= 0."""
    if value is None:
        return
    if type(value) is not int:
        raise TypeError(f"{attr.name} must be an int, got {type(value).__name__} {value!r}")
    if value < 0:
        raise ValueError(f"{attr.name} must be >= 0, got {value}")


def _offset(inst: object, attr: attrs.Attribute[Any], value: Any) -> None:
    """An int (exactly) >= 0, never None."""
    if value is None:
        raise TypeError(f"{attr.name} must be an int, got None")
    _non_negative(inst, attr, value)


def _exact_bool(_inst: object, attr: attrs.Attribute[Any], value: Any) -> None:
    if type(value) is not bool:
        raise TypeError(f"{attr.name} must be a bool, got {type(value).__name__} {value!r}")


def check_text(what: str, value: object) -> None:
    """`value` is a str that encodes as UTF-8 (no lone surrogates)."""
    if type(value) is not str:
        raise TypeError(f"{what} must be a str, got {type(value).__name__}")
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"{what} is not valid text: {e}") from None


def _str(_inst: object, attr: attrs.Attribute[Any], value: Any) -> None:
    check_text(attr.name, value)


def _opt_str(_inst: object, attr: attrs.Attribute[Any], value: Any) -> None:
    if value is not None:
        check_text(attr.name, value)


MAX_HEADERS = 256
"""The most headers a message may carry (each costs its entry and two objects in every
replica's memory for as long as the message is retained)."""


def _headers(value: Mapping[str, str] | None) -> Mapping[str, str] | None:
    if value is None or not value:
        return None
    if not isinstance(value, Mapping):
        raise TypeError(f"headers must be a map of str to str, got {type(value).__name__}")
    if len(value) > MAX_HEADERS:
        raise ValueError(f"a message carries at most {MAX_HEADERS} headers, not {len(value)}")
    for k, v in value.items():
        check_text("a header name", k)
        check_text(f"header {k!r}", v)
    return dict(value)


def _pair(value: Any) -> Any:
    """A list or tuple as a tuple (msgpack and the snapshot give lists); anything else as
    it is, for the validator to refuse."""
    return tuple(value) if isinstance(value, list | tuple) else value


def _backoff(_inst: object, attr: attrs.Attribute[Any], value: Any) -> None:
    """None, or (min, max) ints with 1 <= min <= max <= `MAX_RETRY_DELAY_MS`."""
    if value is None:
        return
    if type(value) is not tuple or len(value) != 2 or any(type(v) is not int for v in value):
        raise TypeError(f"{attr.name} must be a pair of ints (min, max), got {value!r}")
    low, high = value
    if not 1 <= low <= high <= MAX_RETRY_DELAY_MS:
        raise ValueError(
            f"{attr.name} must be (min, max) with 1 <= min <= max <= {MAX_RETRY_DELAY_MS} "
            f"ms, got {value!r}"
        )


def retry_delay_ms(backoff: tuple[int, int], failures: int) -> int:
    """How long a message returned for its `failures`-th time waits under a queue's
    `retry_backoff_ms=(min, max)`: min, doubled with each failed delivery, at most max."""
    low, high = backoff
    return min(high, low << min(max(failures - 1, 0), 62))


def _offsets(value: Iterable[int]) -> tuple[int, ...]:
    offsets = tuple(value)
    for o in offsets:
        if type(o) is not int or o < 0:
            raise ValueError(f"offsets must be non-negative ints, got {o!r}")
    return offsets


def _messages(value: Iterable[Message]) -> tuple[Message, ...]:
    return tuple(value)


@attrs.frozen(kw_only=True)
class QueueOptions:
    """How one queue behaves. Fixed at declare time; a re-declare must match."""

    max_length: int | None = attrs.field(default=None, validator=_non_negative)
    """Most ready messages the queue holds; unacked ones do not count."""
    overflow: Overflow = attrs.field(
        default="drop-head", validator=attrs.validators.in_(("drop-head", "reject-publish"))
    )
    delivery_limit: int | None = attrs.field(default=None, validator=_non_negative)
    """Returns (nack or consumer down) a message survives; one more dead-letters it."""
    dead_letter_queue: str | None = attrs.field(default=None, validator=_opt_str)
    single_active_consumer: bool = attrs.field(default=False, validator=_exact_bool)
    retention_messages: int | None = attrs.field(default=None, validator=_non_negative)
    """Stream view: keep at most this many most recent messages (None: no count limit)."""
    retention_bytes: int | None = attrs.field(
        default=DEFAULT_RETENTION_BYTES, validator=_non_negative
    )
    """Stream view: keep at most this many body bytes (None: no byte limit)."""
    message_ttl_ms: int | None = attrs.field(default=None, validator=_non_negative)
    """Ready messages older than this are dead-lettered or dropped."""
    consumer_timeout_ms: int | None = attrs.field(default=None, validator=_non_negative)
    """A consumer holding a delivery longer than this is cancelled and its messages
    return (None: `DEFAULT_CONSUMER_TIMEOUT_MS`, unless the subscribe says otherwise)."""
    retry_backoff_ms: tuple[int, int] | None = attrs.field(
        default=None, converter=_pair, validator=_backoff
    )
    """(min, max): a message returned as failed (nack with requeue, its consumer down or
    timed out) waits min ms before it is ready again, doubled with each failed delivery,
    at most max (None: it is ready at once). It keeps its place meanwhile (`Nack`)."""

    @message_ttl_ms.validator
    def _check_ttl(self, _attr: object, value: int | None) -> None:
        if value is not None and value < 1:
            raise ValueError(f"message_ttl_ms must be >= 1, got {value}")


def _check_message(body: object, key: object, headers: object) -> object:
    """Validate a message's fields; return its headers normalised (None or a dict).

    One check in `__attrs_post_init__` instead of a validator per field: messages are
    built once per enqueued message, where three validator calls cost as much as the
    rest of the construction.
    """
    if type(body) is not bytes:
        raise TypeError(f"body must be bytes, got {type(body).__name__}")
    if key is not None:
        check_text("key", key)
    return None if headers is None else _headers(headers)  # type: ignore[arg-type]


@attrs.frozen(kw_only=True)
class Message:
    """One message of an `EnqueueBatch`."""

    body: bytes
    key: str | None = None
    headers: Mapping[str, str] | None = None

    def __attrs_post_init__(self) -> None:
        headers = _check_message(self.body, self.key, self.headers)
        if headers is not self.headers:
            object.__setattr__(self, "headers", headers)


@attrs.frozen(kw_only=True)
class Declare:
    queue: str = attrs.field(validator=_str)
    options: QueueOptions = attrs.field(
        factory=QueueOptions, validator=attrs.validators.instance_of(QueueOptions)
    )


@attrs.frozen(kw_only=True)
class Enqueue:
    """Append one message. With `producer` and `seq` the enqueue is idempotent."""

    queue: str = attrs.field(validator=_str)
    body: bytes
    key: str | None = None
    headers: Mapping[str, str] | None = None
    producer: str | None = attrs.field(default=None, validator=_opt_str)
    seq: int | None = attrs.field(default=None, validator=_non_negative)

    def __attrs_post_init__(self) -> None:
        headers = _check_message(self.body, self.key, self.headers)
        if headers is not self.headers:
            object.__setattr__(self, "headers", headers)


def _seqs(value: Iterable[int] | None) -> tuple[int, ...] | None:
    return None if value is None else tuple(value)


MAX_SEQ = 2**63 - 1
"""The largest sequence number (one the wire's msgpack and every replica can carry)."""


def check_seqs(seqs: Iterable[int], count: int) -> None:
    """`ValueError` unless `seqs` numbers `count` messages with ints >= 0, strictly
    increasing: what a batch that carries its own sequence numbers must send."""
    previous, seen = -1, 0
    for seq in seqs:
        if type(seq) is not int or seq <= previous or seq > MAX_SEQ:
            raise ValueError(
                f"seqs must be ints >= 0, strictly increasing; got {seq!r} after {previous}"
            )
        previous, seen = seq, seen + 1
    if seen != count:
        raise ValueError(f"{seen} seqs for {count} messages")


@attrs.frozen(kw_only=True)
class EnqueueBatch:
    """Append many messages as one log entry: all land, in order, or none do.

    With `producer` and `first_seq` the messages take consecutive sequence numbers. With
    `producer` and `seqs` instead, each message carries its own, strictly increasing but
    not necessarily consecutive (a Spark task numbers its rows by their source offsets,
    so that a replay that reads fewer rows still numbers each row as before): those at
    or below the producer's last are duplicates, the rest land. A producer that numbers
    its own must have one batch out at a time, and says which batch is its first
    (`opens`): a producer the queue does not know takes only that one (as a producer
    numbered from 0 must start at 0), so a later batch resent after the queue forgot
    the producer is refused instead of landing a second time."""

    queue: str = attrs.field(validator=_str)
    messages: tuple[Message, ...] = attrs.field(converter=_messages)
    producer: str | None = attrs.field(default=None, validator=_opt_str)
    first_seq: int | None = attrs.field(default=None, validator=_non_negative)
    seqs: tuple[int, ...] | None = attrs.field(default=None, converter=_seqs)
    opens: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    """With `seqs`: this batch is its producer's first."""

    def __attrs_post_init__(self) -> None:
        seqs = self.seqs
        if seqs is None:
            if self.opens:
                raise ValueError("opens goes with seqs")
            return
        if self.first_seq is not None or self.producer is None:
            raise ValueError("seqs go with a producer, and without first_seq")
        check_seqs(seqs, len(self.messages))


@attrs.frozen(kw_only=True)
class Subscribe:
    """Add `consumer`, whose connection lives on `node`, to the service queue."""

    queue: str = attrs.field(validator=_str)
    consumer: str = attrs.field(validator=_str)
    node: str = attrs.field(validator=_str)
    prefetch: int = attrs.field(default=0, validator=_non_negative)
    """Most unacked messages the consumer holds (at most 65,535); 0 means no limit."""
    timeout_ms: int | None = attrs.field(default=None, validator=_non_negative)
    """This consumer's delivery timeout, in place of its queue's `consumer_timeout_ms`."""

    @prefetch.validator
    def _check_prefetch(self, _attr: object, value: int) -> None:
        if value > MAX_PREFETCH:
            raise ValueError(f"prefetch must be at most {MAX_PREFETCH}, got {value}")


@attrs.frozen(kw_only=True)
class Cancel:
    """Stop new deliveries to `consumer`; what it holds stays until acked or down."""

    queue: str = attrs.field(validator=_str)
    consumer: str = attrs.field(validator=_str)


@attrs.frozen(kw_only=True)
class Ack:
    queue: str = attrs.field(validator=_str)
    consumer: str = attrs.field(validator=_str)
    offsets: tuple[int, ...] = attrs.field(converter=_offsets)


@attrs.frozen(kw_only=True)
class Nack:
    """Return (`requeue=True`) or reject (dead-letter or drop) held messages.

    A returned message waits `delay_ms` (None: what the queue's `retry_backoff_ms`
    says, or not at all) before it is ready again, and keeps its place meanwhile: it
    is delivered before any later message once it is due, its ordering key waits
    behind it (in order), and a single-active-consumer queue waits for it."""

    queue: str = attrs.field(validator=_str)
    consumer: str = attrs.field(validator=_str)
    offsets: tuple[int, ...] = attrs.field(converter=_offsets)
    requeue: bool = attrs.field(default=True, validator=_exact_bool)
    delay_ms: int | None = attrs.field(default=None, validator=_non_negative)

    @delay_ms.validator
    def _check_delay(self, _attr: object, value: int | None) -> None:
        if value is None:
            return
        if not self.requeue:
            raise ValueError("delay_ms goes with requeue=True (a rejected message does not return)")
        if value > MAX_RETRY_DELAY_MS:
            raise ValueError(f"delay_ms must be at most {MAX_RETRY_DELAY_MS}, got {value}")


@attrs.frozen(kw_only=True)
class Down:
    """The consumer's connection is gone: on every queue it is on, return what it holds."""

    consumer: str = attrs.field(validator=_str)


@attrs.frozen(kw_only=True)
class NodeDown:
    """Every consumer on `node` is down; subscribes from it are refused until `NodeUp`."""

    node: str = attrs.field(validator=_str)


@attrs.frozen(kw_only=True)
class NodeUp:
    node: str = attrs.field(validator=_str)


@attrs.frozen(kw_only=True)
class CommitOffset:
    """A stream reader's progress (`group`, e.g. a Spark query), kept in the log."""

    queue: str = attrs.field(validator=_str)
    group: str = attrs.field(validator=_str)
    offset: int = attrs.field(validator=_offset)


@attrs.frozen(kw_only=True)
class ForgetProducers:
    """Forget the idempotent producers of `queue` whose id starts with `prefix`.

    For producers that can never resend (a Spark batch once a later one is committed).
    A forgotten producer is new again: it must start at seq 0 (or, numbering its own,
    with the batch that `opens` it), and a client id of a generation the queue forgot
    is refused (`producer_forgotten`). An empty prefix is refused, so nobody forgets
    every producer by accident.
    """

    queue: str = attrs.field(validator=_str)
    prefix: str = attrs.field(validator=_str)
    seal: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    """And refuse, from now on, every new producer whose id starts with `prefix`
    (`producer_sealed`): a late attempt of a Spark task whose job or micro-batch has
    committed (the queue forgot its producer then) would otherwise open it anew and write
    its rows a second time. The prefix must end with "-". A queue keeps its newest
    `MAX_SEALED` seals, each for `PRODUCER_EXPIRY_MS` (7 days)."""


@attrs.frozen(kw_only=True)
class PurgeQueue:
    """Remove every ready message of `queue` (those waiting for a retry delay too); they
    are counted (`QueuePurged`, and a `Purged` effect lists them). Held messages stay
    with their consumers: acked, or returned by a nack or a `Down` as ever. The stream
    view keeps everything, as after an ack, until retention drops it."""

    queue: str = attrs.field(validator=_str)


@attrs.frozen(kw_only=True)
class DeleteQueue:
    """Delete `queue`: its messages, consumers, stream view, idempotent producers and
    committed offsets. A queue in use (with consumers, cancelled ones still holding
    messages included) is refused (`queue_in_use`) unless `force`: then each consumer
    is cancelled (`ConsumerDown`, reason "queue_deleted") and what it held goes with
    the queue. Every message the queue held, ready or delivered, is counted
    (`QueueDeleted`, and a `Purged` effect lists them): none is dead-lettered. A queue
    declared again under the name is a new, empty queue that carries on from the deleted
    one's next offset (an offset a reader kept never names a message of the other queue)
    and refuses the deleted one's producer ids (`producer_forgotten`: a resend of a
    publish to the deleted queue does not land in the new one)."""

    queue: str = attrs.field(validator=_str)
    force: bool = attrs.field(default=False, validator=_exact_bool)


@attrs.frozen(kw_only=True)
class DiskAlarm:
    """`node`'s data disk is below its free-space limit (`raised`), or back above it.
    While any node's alarm is raised, publishes are refused (`disk_alarm`) everywhere,
    as RabbitMQ's disk alarm blocks publishers cluster-wide: every replica writes every
    entry, so one full disk is enough to stop a node. Deliveries, acks and reads go on."""

    node: str = attrs.field(validator=_str)
    raised: bool = attrs.field(validator=_exact_bool)


MAX_GROUPS = 64
"""The most Raft groups a cluster may place its queues over (`Place.groups`)."""


@attrs.frozen(kw_only=True)
class Place:
    """Give `queue` one of `groups` Raft groups, for good: the directory a node with
    many groups keeps in group 0's log and routes every command for the queue by.

    A queue already placed keeps its group (declared again after a delete, it carries
    on from its offsets there). A queue group 0 holds from before there were groups is
    in group 0. A new queue goes to the group with the fewest placements (ties to the
    lowest), or to the group of its `dead_letter_queue`, which is placed with it if it
    is not yet: a queue dead-letters within its own group's log only. The first `Place`
    fixes the cluster's group count; one that names another is refused."""

    queue: str = attrs.field(validator=_str)
    groups: int = attrs.field(validator=_non_negative)
    dead_letter_queue: str | None = attrs.field(default=None, validator=_opt_str)

    @groups.validator
    def _check_groups(self, _attr: object, value: int) -> None:
        if not 1 <= value <= MAX_GROUPS:
            raise ValueError(f"groups must be from 1 to {MAX_GROUPS}, got {value}")


@attrs.frozen(kw_only=True)
class Tick:
    """Moves time (message TTL, producer expiry, consumer timeouts, retry delays) when
    nothing else does."""


Command: TypeAlias = (
    DiskAlarm
    | Declare
    | Enqueue
    | EnqueueBatch
    | Subscribe
    | Cancel
    | Ack
    | Nack
    | Down
    | NodeDown
    | NodeUp
    | CommitOffset
    | ForgetProducers
    | PurgeQueue
    | DeleteQueue
    | Place
    | Tick
)
