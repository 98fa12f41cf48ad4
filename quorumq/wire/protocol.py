"""The client wire protocol, sans I/O: bytes in, checked frames out; frames in, bytes out.

Theory of operation
-------------------
A connection carries frames in both directions. A frame is a 4-byte big-endian length
followed by that many bytes of msgpack: a map whose "t" names the frame type. The first
frame each side sends is `welcome` (server: protocol version, node, auth nonce) or
`hello` (client: version, HMAC proof). Requests carry an "id" the reply echoes.

The decoder checks the length prefix before buffering a frame, so a huge prefix costs
nothing: it is a fatal `ProtocolError` (the stream cannot be resynchronised cheaply).
A frame that is not msgpack, not a map, of an unknown type, or with a missing or
mistyped field is a non-fatal `ProtocolError`: the frame is skipped and the
connection goes on. The server answers every `ProtocolError` with an `error` frame,
and closes the connection when it is fatal, or when the peer has not said `hello` yet
(an unauthenticated peer gets one error frame, not one per garbage frame). Nothing here
imports sockets.

A client in the node's own process (`quorumq.Node`) skips the bytes: its frames travel
as copies made by `copy_frame` (what decoding would give, sharing nothing with the
sender, with an estimated size no smaller than the encoding's), and `FrameQueue` checks
them as `FrameDecoder` checks what it decodes, against the same limits.
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import struct
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from operator import itemgetter
from typing import Any, Protocol

import msgpack

PROTOCOL_VERSION = 1
DEFAULT_MAX_BODY = 1024 * 1024
"""Largest message body a node accepts by default (1 MiB)."""
FRAME_OVERHEAD = 64 * 1024
"""Room for everything in a frame besides message bodies."""

KEEPALIVE_IDLE_S = 10
"""Silence on a connection before TCP probes the peer; with `KEEPALIVE_PROBES` probes
`KEEPALIVE_INTERVAL_S` apart, a peer whose host vanished (no FIN, no RST) is given up
about 25 s after the connection fell silent."""
KEEPALIVE_INTERVAL_S = 5
KEEPALIVE_PROBES = 3


class _HasSockopt(Protocol):
    def setsockopt(self, level: int, option: int, value: int, /) -> None: ...


def keep_alive(sock: _HasSockopt) -> None:
    """Turn on TCP keepalive: without it a node keeps a vanished client's consumers, and
    their unacked messages, for good, and a client waits for a vanished node for good."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (
        ("TCP_KEEPIDLE", KEEPALIVE_IDLE_S),
        ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
        ("TCP_KEEPCNT", KEEPALIVE_PROBES),
    ):
        option = getattr(socket, name, None)
        if option is not None:  # Linux; elsewhere the system's keepalive timing
            sock.setsockopt(socket.IPPROTO_TCP, option, value)


_LENGTH = struct.Struct(">I")

Frame = dict[str, Any]

_B, _S, _I, _BOOL, _MAP, _LIST = bytes, str, int, bool, dict, list
_N = type(None)

# frame type -> {field: allowed types}; "id" is required on requests that get a reply
SCHEMA: dict[str, dict[str, tuple[type, ...]]] = {
    # client -> server
    "hello": {"v": (_I,), "client": (_S,), "proof": (_B, _N)},
    "declare": {"id": (_I,), "queue": (_S,), "options": (_MAP,)},
    "publish": {
        "id": (_I,),
        "queue": (_S,),
        "body": (_B,),
        "key": (_S, _N),
        "headers": (_MAP, _N),
        "producer": (_S, _N),
        "seq": (_I, _N),
    },
    "publish_batch": {
        "id": (_I,),
        "queue": (_S,),
        "messages": (_LIST,),
        "producer": (_S, _N),
        "first_seq": (_I, _N),
        "seqs": (_LIST, _N),
        "opens": (_BOOL, _N),
    },
    "subscribe": {"id": (_I,), "queue": (_S,), "prefetch": (_I,)},
    "cancel": {"id": (_I,), "consumer": (_S,)},
    "ack": {"consumer": (_S,), "offsets": (_LIST,)},
    "nack": {"consumer": (_S,), "offsets": (_LIST,), "requeue": (_BOOL,), "delay_ms": (_I, _N)},
    "read": {
        "id": (_I,),
        "queue": (_S,),
        "start": (_I,),
        "end": (_I,),
        "bucket": (_I, _N),
        "buckets": (_I, _N),
    },
    "commit_offset": {"id": (_I,), "queue": (_S,), "group": (_S,), "offset": (_I,)},
    "forget_producers": {"id": (_I,), "queue": (_S,), "prefix": (_S,), "seal": (_BOOL, _N)},
    "purge_queue": {"id": (_I,), "queue": (_S,)},
    "delete_queue": {"id": (_I,), "queue": (_S,), "force": (_BOOL, _N)},
    "status": {"id": (_I,)},
    "add_member": {"id": (_I,), "node": (_S,), "raft_address": (_S,)},
    "remove_member": {"id": (_I,), "node": (_S,)},
    # server -> client
    "welcome": {"v": (_I,), "node": (_S,), "nonce": (_B,), "auth": (_BOOL,)},
    "reply": {"id": (_I,)},
    "error": {"id": (_I, _N), "code": (_S,), "message": (_S,)},
    "deliver": {
        "consumer": (_S,),
        "offset": (_I,),
        "key": (_S, _N),
        "body": (_B,),
        "headers": (_MAP, _N),
        "redelivered": (_BOOL,),
        "delivery_count": (_I,),
        "node": (_S,),
    },
    "cancelled": {"consumer": (_S,), "reason": (_S,)},
}


class ProtocolError(Exception):
    """A frame broke the protocol. `fatal`: the connection must close."""

    def __init__(self, code: str, message: str, *, fatal: bool = False, request_id: Any = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.fatal = fatal
        self.request_id = request_id if isinstance(request_id, int) else None


def encode_frame(frame: Frame) -> bytes:
    body: bytes = msgpack.packb(frame, use_bin_type=True)
    return _LENGTH.pack(len(body)) + body


def check_frame(frame: object) -> Frame:
    """Check a decoded frame against the schema; extra fields are allowed and ignored. A
    field that may be nil may also be left out: it is filled in as nil, so that code
    reading a checked frame finds every field of its schema."""
    if not isinstance(frame, dict):
        raise ProtocolError("bad_frame", "a frame must be a msgpack map")
    kind = frame.get("t")
    spec = SCHEMA.get(kind) if isinstance(kind, str) else None
    request_id = frame.get("id")
    if spec is None:
        raise ProtocolError("unknown_frame", f"unknown frame type {kind!r}", request_id=request_id)
    for field, types in spec.items():
        value = frame.get(field)
        if value is None and _N in types:
            frame[field] = None
        elif type(value) not in types:
            expected = " or ".join("nil" if t is _N else t.__name__ for t in types)
            raise ProtocolError(
                "bad_frame",
                f"{kind}: field {field!r} must be {expected}, got {type(value).__name__}",
                request_id=request_id,
            )
    return frame


class FrameDecoder:
    """Accumulates bytes and yields checked frames."""

    def __init__(self, max_frame: int = DEFAULT_MAX_BODY + FRAME_OVERHEAD) -> None:
        self.max_frame = max_frame
        self._buffer = bytearray()

    def feed(self, data: bytes | bytearray) -> None:
        self._buffer += data

    def frames(self) -> Iterator[Frame]:
        """Yield every complete frame; raise `ProtocolError` for a bad one (after removing
        it from the buffer, so calling again goes on with the next frame)."""
        buf = self._buffer
        while len(buf) >= 4:
            (length,) = _LENGTH.unpack_from(buf)
            if length > self.max_frame:
                raise ProtocolError(
                    "frame_too_large",
                    f"frame of {length} bytes exceeds the limit of {self.max_frame}",
                    fatal=True,
                )
            if len(buf) < 4 + length:
                return
            raw = bytes(buf[4 : 4 + length])
            del buf[: 4 + length]
            try:
                frame = msgpack.unpackb(raw, raw=False, strict_map_key=True)
            except Exception as e:  # msgpack raises several kinds for garbage
                raise ProtocolError("bad_frame", f"frame is not msgpack: {e}") from None
            yield check_frame(frame)


READ_COLUMNS = ("offsets", "keys", "bodies", "body_lengths", "headers", "ts_ms")
"""The fields of a read reply's `columns` (a read that asked `columns: true`)."""


def encode_columns(records: Sequence[Sequence[Any]]) -> dict[str, Any]:
    """A read reply's (offset, key, body, headers, ts_ms) records column by column: the
    bodies as one bytes object and their lengths, so that a bulk reader (the Spark
    source) builds Arrow arrays from them without a Python object per body."""
    bodies = list(map(itemgetter(2), records))
    return {
        "offsets": list(map(itemgetter(0), records)),
        "keys": list(map(itemgetter(1), records)),
        "bodies": b"".join(bodies),
        "body_lengths": list(map(len, bodies)),
        "headers": list(map(itemgetter(3), records)),
        "ts_ms": list(map(itemgetter(4), records)),
    }


def check_columns(columns: object) -> dict[str, Any]:
    """A read reply's `columns` as `encode_columns` makes them, or `ProtocolError`: the
    lengths must add up, since readers cut `bodies` by them."""
    fields = columns if isinstance(columns, dict) else {}
    lists: list[list[Any]] = []
    for name in READ_COLUMNS:
        value = fields.get(name)
        if type(value) is not (bytes if name == "bodies" else list):
            raise ProtocolError("bad_frame", f"read columns: {name!r} is missing or malformed")
        if name != "bodies":
            lists.append(value)  # type: ignore[arg-type]  # checked to be a list above
    bodies: bytes = fields["bodies"]
    lengths: list[Any] = fields["body_lengths"]
    if len({len(v) for v in lists}) != 1:
        raise ProtocolError("bad_frame", "read columns: the columns differ in length")
    if not all(type(n) is int and n >= 0 for n in lengths):
        raise ProtocolError("bad_frame", "read columns: a body length is not a size")
    if sum(lengths) != len(bodies):
        raise ProtocolError("bad_frame", "read columns: body lengths do not add up to bodies")
    return fields


_BASE_TYPES: tuple[type, ...] = (str, bytes, bool, int, float, dict, list, tuple)
_BYTES_LIKE = (bytearray, memoryview)
"""Sent as `bin` by msgpack: they come out as bytes."""


def _in_range(value: int) -> int:
    """`value`, if a frame can carry it: as over TCP, where encoding it fails in the
    caller (an in-process copy let it through, and the node's log encoding then failed
    in the connection's task and dropped the whole connection)."""
    if not -(2**63) <= value < 2**64:
        raise OverflowError(f"integer {value} is out of the range a frame carries")
    return value


def copy_frame(value: Any) -> tuple[Any, int]:
    """`value` (a frame, or a field of one) as encoding and decoding would give it back,
    without the bytes, and about how many bytes it takes encoded: maps and lists are
    new (a tuple becomes a list, a subclass its base type), text, bytes and numbers
    are shared (immutable). The size counts its text and bytes, plus 5 for each map,
    list, text or bytes and 9 for each other value: at least msgpack's own overhead,
    so a bound counted in it is no looser than one counted in encoded bytes.

    What an in-process connection carries (`FrameQueue`, `ConnectionCore`): nothing the
    sender keeps is reachable from the copy, so neither side's later changes reach the
    other (a delivery's headers are the replica's own map). `TypeError` for a value
    msgpack cannot encode either, as `encode_frame` would raise."""
    kind = type(value)
    if kind is dict:
        copy: dict[Any, Any] = {}
        size = 5
        for key, item in value.items():
            plain_key, key_size = (
                (key, len(key) + 5) if type(key) is str and key.isascii() else copy_frame(key)
            )
            # the plain values of a frame inline: a call for each costs a third of the time
            item_kind = type(item)
            if item_kind is bytes or (item_kind is str and item.isascii()):
                copy[plain_key] = item
                size += key_size + len(item) + 5
            elif item is None or item_kind is bool or item_kind is float:
                copy[plain_key] = item
                size += key_size + 9
            elif item_kind is int:
                copy[plain_key] = _in_range(item)
                size += key_size + 9
            else:
                copy[plain_key], item_size = copy_frame(item)
                size += key_size + item_size
        return copy, size
    if kind is bytes:
        return value, len(value) + 5
    if kind is str:
        return value, (len(value) if value.isascii() else len(value.encode())) + 5
    if value is None or kind is float or kind is bool:
        return value, 9
    if kind is int:
        return _in_range(value), 9
    if kind is list or kind is tuple:
        items = []
        size = 5
        for item in value:
            item_copy, item_size = copy_frame(item)
            items.append(item_copy)
            size += item_size
        return items, size
    base: Callable[[Any], Any]
    for base in _BASE_TYPES:
        if isinstance(value, base):  # a subclass: sent as its base type
            return copy_frame(base(value))
    if isinstance(value, _BYTES_LIKE):
        return copy_frame(bytes(value))
    raise TypeError(f"can not serialize {kind.__name__!r} object")


SizedFrame = tuple[Any, int]
"""A frame handed over in-process, and what it counts for (`copy_frame`)."""


class FrameQueue:
    """The in-process counterpart of `FrameDecoder`: frames handed over by a client in
    the node's own process (`copy_frame`'s copies, with their sizes), no bytes between.
    Checked as the decoder checks what it decodes, against the same `max_frame`, so
    nothing reaches the node core that the wire would have refused."""

    def __init__(self, max_frame: int = DEFAULT_MAX_BODY + FRAME_OVERHEAD) -> None:
        self.max_frame = max_frame
        self._queue: deque[SizedFrame] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def feed(self, frames: Iterable[SizedFrame]) -> None:
        self._queue.extend(frames)

    def frames(self) -> Iterator[Frame]:
        """Yield every queued frame, checked; raise `ProtocolError` for a bad one (after
        removing it, so calling again goes on with the next frame)."""
        queue = self._queue
        while queue:
            frame, size = queue.popleft()
            if size > self.max_frame:
                raise ProtocolError(
                    "frame_too_large",
                    f"frame of about {size} bytes exceeds the limit of {self.max_frame}",
                    fatal=True,
                )
            yield check_frame(frame)


def auth_proof(token: str, nonce: bytes) -> bytes:
    """HMAC-SHA256 of the server's nonce with the token: the token itself never travels."""
    return hmac.new(token.encode("utf-8"), nonce, hashlib.sha256).digest()


def proof_matches(token: str, nonce: bytes, proof: bytes | None) -> bool:
    return proof is not None and hmac.compare_digest(auth_proof(token, nonce), proof)
