"""Commands, log entries and replies to and from bytes (msgpack), versioned.

Nothing of ours is pickled, in the log or on any port. Every encoding is a msgpack array
that starts with `VERSION` and a small integer tag naming the type; tags are fixed
forever, so renaming a class never breaks a log. Queue options travel by name. Decoding
builds the attrs values, so their validators run: bytes that decode to an invalid
command are refused with `CodecError`, never half-built.

A log entry is `[VERSION, ENTRY, ts_ms, command]`: the proposer's clock travels with
the command, and the machine clamps it so time never runs back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import msgpack

from .machine import (
    Ack,
    Cancel,
    Command,
    CommitOffset,
    Declare,
    Declared,
    DeleteQueue,
    DiskAlarm,
    Down,
    Enqueue,
    EnqueueBatch,
    Enqueued,
    Error,
    ErrorCode,
    ForgetProducers,
    Forgotten,
    Message,
    Nack,
    NodeDown,
    NodeUp,
    Ok,
    Place,
    Placed,
    PurgeQueue,
    QueueDeleted,
    QueueOptions,
    QueuePurged,
    Reply,
    Subscribe,
    Tick,
)

VERSION = 1

# command tags: never renumber
_DECLARE, _ENQUEUE, _ENQUEUE_BATCH, _SUBSCRIBE, _CANCEL, _ACK, _NACK = 1, 2, 3, 4, 5, 6, 7
_DOWN, _NODE_DOWN, _NODE_UP, _COMMIT_OFFSET, _TICK = 8, 9, 10, 11, 12
_FORGET_PRODUCERS = 13
_PURGE_QUEUE, _DELETE_QUEUE = 14, 15
_DISK_ALARM = 16
_PLACE = 17
# reply tags
_OK, _DECLARED, _ENQUEUED, _ERROR = 100, 101, 102, 103
_FORGOTTEN = 104
_QUEUE_PURGED, _QUEUE_DELETED = 105, 106
_PLACED = 107
# envelope tags
_ENTRY = 200

_OPTION_NAMES = frozenset(f.name for f in attrs.fields(QueueOptions))


class CodecError(ValueError):
    """The bytes are not a valid encoding of what was asked for."""


class UnreadableEntryError(Exception):
    """A committed log entry this node cannot decode (written by another release): the
    node must stop, not skip it and diverge."""


def _pack(value: list[Any]) -> bytes:
    return msgpack.packb(value, use_bin_type=True)  # type: ignore[no-any-return]


def _unpack(data: bytes) -> list[Any]:
    try:
        value = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
    except (ValueError, msgpack.UnpackException, TypeError) as e:
        raise CodecError(f"not msgpack: {e}") from None
    if not isinstance(value, list) or len(value) < 2:
        raise CodecError("expected an array [version, tag, ...]")
    if value[0] != VERSION:
        raise CodecError(f"unsupported codec version {value[0]!r} (this node speaks {VERSION})")
    return value


_LATER_OPTIONS = ("retry_backoff_ms",)
"""Options added after the first release: left out of the map while they have their
default, so an entry that does not use them reads as before (on a node of an earlier
release too)."""


def _options_to_map(options: QueueOptions) -> dict[str, Any]:
    fields = attrs.asdict(options)
    for name in _LATER_OPTIONS:
        if fields[name] is None:
            del fields[name]
    return fields


def _options_from_map(raw: object) -> QueueOptions:
    if not isinstance(raw, dict):
        raise CodecError("queue options must be a map")
    unknown = set(raw) - _OPTION_NAMES
    if unknown:
        raise CodecError(f"unknown queue options {sorted(unknown)}")
    return QueueOptions(**raw)


def _command_fields(cmd: Command) -> list[Any]:
    match cmd:
        case Enqueue():
            return [_ENQUEUE, cmd.queue, cmd.body, cmd.key, cmd.headers, cmd.producer, cmd.seq]
        case EnqueueBatch():
            fields = [
                _ENQUEUE_BATCH,
                cmd.queue,
                [[m.body, m.key, m.headers] for m in cmd.messages],
                cmd.producer,
                cmd.first_seq,
            ]
            if cmd.seqs is None:
                return fields
            return [*fields, list(cmd.seqs), True] if cmd.opens else [*fields, list(cmd.seqs)]
        case Ack():
            return [_ACK, cmd.queue, cmd.consumer, list(cmd.offsets)]
        case Nack():
            fields = [_NACK, cmd.queue, cmd.consumer, list(cmd.offsets), cmd.requeue]
            return fields if cmd.delay_ms is None else [*fields, cmd.delay_ms]
        case Declare():
            return [_DECLARE, cmd.queue, _options_to_map(cmd.options)]
        case Subscribe():
            fields = [_SUBSCRIBE, cmd.queue, cmd.consumer, cmd.node, cmd.prefetch]
            return fields if cmd.timeout_ms is None else [*fields, cmd.timeout_ms]
        case Cancel():
            return [_CANCEL, cmd.queue, cmd.consumer]
        case Down():
            return [_DOWN, cmd.consumer]
        case NodeDown():
            return [_NODE_DOWN, cmd.node]
        case NodeUp():
            return [_NODE_UP, cmd.node]
        case CommitOffset():
            return [_COMMIT_OFFSET, cmd.queue, cmd.group, cmd.offset]
        case ForgetProducers():  # the third field only when sealing (as before without)
            return [_FORGET_PRODUCERS, cmd.queue, cmd.prefix, *([True] if cmd.seal else [])]
        case PurgeQueue():
            return [_PURGE_QUEUE, cmd.queue]
        case DeleteQueue():
            return [_DELETE_QUEUE, cmd.queue, cmd.force]
        case Tick():
            return [_TICK]
        case DiskAlarm():
            return [_DISK_ALARM, cmd.node, cmd.raised]
        case Place():
            return [_PLACE, cmd.queue, cmd.groups, cmd.dead_letter_queue]
    raise TypeError(f"not a command: {cmd!r}")


def _batch(
    queue: str,
    messages: list[Any],
    producer: str | None,
    first_seq: int | None,
    seqs: list[Any] | None = None,
    opens: Any = False,
) -> Command:
    if not isinstance(messages, list):
        raise CodecError("batch messages must be an array")
    if seqs is not None and not isinstance(seqs, list):
        raise CodecError("batch seqs must be an array")
    built = []
    for m in messages:
        if not isinstance(m, list) or len(m) != 3:
            raise CodecError("a batch message must be [body, key, headers]")
        built.append(Message(body=m[0], key=m[1], headers=m[2]))
    return EnqueueBatch(
        queue=queue, messages=built, producer=producer, first_seq=first_seq, seqs=seqs, opens=opens
    )


_COMMAND_BUILDERS: dict[int, tuple[int | tuple[int, ...], Callable[..., Command]]] = {
    _DECLARE: (2, lambda q, o: Declare(queue=q, options=_options_from_map(o))),
    _ENQUEUE: (
        6,
        lambda q, b, k, h, p, s: Enqueue(queue=q, body=b, key=k, headers=h, producer=p, seq=s),
    ),
    _ENQUEUE_BATCH: ((4, 5, 6), _batch),  # seqs and opens only when given
    _SUBSCRIBE: (
        (4, 5),  # the fifth, the consumer's timeout, only when it has one
        lambda q, c, n, p, t=None: Subscribe(queue=q, consumer=c, node=n, prefetch=p, timeout_ms=t),
    ),
    _CANCEL: (2, lambda q, c: Cancel(queue=q, consumer=c)),
    _ACK: (3, lambda q, c, o: Ack(queue=q, consumer=c, offsets=o)),
    _NACK: (
        (4, 5),  # the fifth, a retry delay, only when it has one
        lambda q, c, o, r, d=None: Nack(queue=q, consumer=c, offsets=o, requeue=r, delay_ms=d),
    ),
    _DOWN: (1, lambda c: Down(consumer=c)),
    _NODE_DOWN: (1, lambda n: NodeDown(node=n)),
    _NODE_UP: (1, lambda n: NodeUp(node=n)),
    _COMMIT_OFFSET: (3, lambda q, g, o: CommitOffset(queue=q, group=g, offset=o)),
    _TICK: (0, Tick),
    _FORGET_PRODUCERS: (
        (2, 3),  # the third, `seal`, only when true
        lambda q, p, s=None: ForgetProducers(queue=q, prefix=p, seal=_sealing(s)),
    ),
    _PURGE_QUEUE: (1, lambda q: PurgeQueue(queue=q)),
    _DELETE_QUEUE: (2, lambda q, f: DeleteQueue(queue=q, force=f)),
    _DISK_ALARM: (2, lambda n, r: DiskAlarm(node=n, raised=r)),
    _PLACE: (3, lambda q, g, d: Place(queue=q, groups=g, dead_letter_queue=d)),
}


def _sealing(field: object) -> bool:
    """`ForgetProducers`' third field: present only as `True` (canonical: one encoding)."""
    if field is None:
        return False
    if field is not True:
        raise CodecError(f"forget_producers' seal field must be true when present, not {field!r}")
    return True


def _build_command(fields: list[Any]) -> Command:
    tag, args = fields[0], fields[1:]
    spec = _COMMAND_BUILDERS.get(tag) if isinstance(tag, int) else None
    if spec is None:
        raise CodecError(f"unknown command tag {tag!r}")
    arity, build = spec
    if len(args) not in ((arity,) if isinstance(arity, int) else arity):
        raise CodecError(f"command tag {tag} takes {arity} fields, got {len(args)}")
    try:
        return build(*args)
    except CodecError:
        raise
    except (TypeError, ValueError) as e:
        raise CodecError(f"invalid command (tag {tag}): {e}") from None


def encode_command(cmd: Command) -> bytes:
    return _pack([VERSION, *_command_fields(cmd)])


def decode_command(data: bytes) -> Command:
    return _build_command(_unpack(data)[1:])


_ENTRY_HEAD = bytes([0x94, VERSION, 0xCC, _ENTRY, 0xCF])
"""A log entry starts [VERSION, _ENTRY, ts_ms as a msgpack uint64, ...]: the time sits at
a fixed place, so the leader stamps an entry without decoding it (`stamp_entry`)."""
_TS_END = len(_ENTRY_HEAD) + 8
UNSTAMPED = 0
"""The time a proposer puts in an entry: only the leader stamps (`stamp_entry`). An entry
left unstamped (leadership changed while it was queued) moves no clock (time is a max)."""


def encode_entry(ts_ms: int, cmd: Command) -> bytes:
    """A log entry: the command and the time the leader stamps (`UNSTAMPED` from proposers)."""
    fields: bytes = msgpack.packb(_command_fields(cmd), use_bin_type=True)
    return _ENTRY_HEAD + ts_ms.to_bytes(8, "big") + fields


def stamp_entry(entry: bytes, ts_ms: int) -> bytes:
    """`entry` with its time replaced by `ts_ms` (an entry of another layout: as it is)."""
    if len(entry) <= _TS_END or not entry.startswith(_ENTRY_HEAD):
        return entry
    return _ENTRY_HEAD + ts_ms.to_bytes(8, "big") + entry[_TS_END:]


def entry_time(entry: bytes) -> int:
    """The time stamped in `entry` (0 for one that is not a log entry of ours)."""
    if len(entry) > _TS_END and entry.startswith(_ENTRY_HEAD):
        return int.from_bytes(entry[len(_ENTRY_HEAD) : _TS_END], "big")
    try:
        return decode_entry(entry)[0]
    except CodecError:
        return 0


def decode_entry(data: bytes) -> tuple[int, Command]:
    value = _unpack(data)
    if value[1] != _ENTRY or len(value) != 4:
        raise CodecError("not a log entry")
    ts_ms, fields = value[2], value[3]
    if not isinstance(ts_ms, int) or not isinstance(fields, list) or not fields:
        raise CodecError("malformed log entry")
    return ts_ms, _build_command(fields)


def encode_reply(reply: Reply) -> bytes:
    match reply:
        case Ok():
            return _pack([VERSION, _OK])
        case Declared():
            return _pack([VERSION, _DECLARED, reply.created])
        case Enqueued():
            return _pack([VERSION, _ENQUEUED, reply.offset, reply.count, reply.duplicate])
        case Forgotten():
            return _pack([VERSION, _FORGOTTEN, reply.count])
        case QueuePurged():
            return _pack([VERSION, _QUEUE_PURGED, reply.messages])
        case QueueDeleted():
            return _pack([VERSION, _QUEUE_DELETED, reply.messages, reply.consumers])
        case Placed():
            return _pack([VERSION, _PLACED, reply.group])
        case Error():
            return _pack(
                [
                    VERSION,
                    _ERROR,
                    reply.code.value,
                    reply.message,
                    reply.expected_seq,
                    reply.generation,
                ]
            )
    raise TypeError(f"not a reply: {reply!r}")


def decode_reply(data: bytes) -> Reply:
    value = _unpack(data)
    tag, args = value[1], value[2:]
    try:
        if tag == _OK and not args:
            return Ok()
        if tag == _DECLARED and len(args) == 1:
            return Declared(created=args[0])
        if tag == _ENQUEUED and len(args) == 3:
            return Enqueued(offset=args[0], count=args[1], duplicate=args[2])
        if tag == _FORGOTTEN and len(args) == 1 and type(args[0]) is int:
            return Forgotten(count=args[0])
        if tag == _QUEUE_PURGED and len(args) == 1 and type(args[0]) is int:
            return QueuePurged(messages=args[0])
        if tag == _QUEUE_DELETED and len(args) == 2 and all(type(a) is int for a in args):
            return QueueDeleted(messages=args[0], consumers=args[1])
        if tag == _PLACED and len(args) == 1 and type(args[0]) is int:
            return Placed(group=args[0])
        if tag == _ERROR and len(args) in (3, 4):  # 3: before producer generations
            generation = args[3] if len(args) == 4 else None
            return Error(
                code=ErrorCode(args[0]),
                message=args[1],
                expected_seq=args[2],
                generation=generation,
            )
    except (TypeError, ValueError) as e:
        raise CodecError(f"invalid reply: {e}") from None
    raise CodecError(f"unknown reply tag {tag!r} with {len(args)} fields")
