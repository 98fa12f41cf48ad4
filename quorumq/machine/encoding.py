"""A small canonical binary encoding for snapshots and digests.

Only the standard library may be used under `quorumq.machine`, and the digest must be
equal across processes and Python versions, so neither pickle nor marshal will do.
Values: None, bool, int, bytes, str, list/tuple (decoded as list) and dict with str
keys (encoded in sorted key order, so equal dicts give equal bytes). Each value is a
one-byte tag followed by its payload; lengths and ints are LEB128 varints (ints
zigzag-encoded, any size).
"""

from __future__ import annotations

from typing import Any

_NONE, _FALSE, _TRUE, _INT, _BYTES, _STR, _LIST, _DICT = range(8)


class DecodeError(ValueError):
    """The bytes are not a valid encoding."""


def _varint(out: bytearray, n: int) -> None:
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)


def _heads(tag: int) -> list[bytes]:
    """A tag and a length (or zigzag int) below 128, the common case, as one `bytes`."""
    return [bytes((tag, n)) for n in range(0x80)]


_INT_HEAD, _BYTES_HEAD, _STR_HEAD, _LIST_HEAD = (_heads(t) for t in (_INT, _BYTES, _STR, _LIST))


def _head(out: bytearray, n: int, heads: list[bytes], tag: int) -> None:
    """A tag and a length (or zigzag int) `n`: one entry of `heads` below 128."""
    if n < 0x80:
        out += heads[n]
    else:
        out.append(tag)
        _varint(out, n)


def _int(out: bytearray, value: int) -> None:
    _head(out, (value << 1) if value >= 0 else ((-value << 1) - 1), _INT_HEAD, _INT)


def _sized(out: bytearray, raw: bytes, heads: list[bytes], tag: int) -> None:
    """`raw` after its tag and length."""
    _head(out, len(raw), heads, tag)
    out += raw


def _encode(out: bytearray, value: Any) -> None:
    # The types in the order a machine snapshot holds most of them (ints, lists and
    # tuples, bytes, strs): snapshots and digests spend their time here.
    kind = type(value)
    if kind is int:
        _int(out, value)
    elif kind is list or kind is tuple:
        _head(out, len(value), _LIST_HEAD, _LIST)
        for item in value:
            if type(item) is int:  # half of a snapshot's values: `_int`, inlined
                z = (item << 1) if item >= 0 else ((-item << 1) - 1)
                if z < 0x80:
                    out += _INT_HEAD[z]
                else:
                    out.append(_INT)
                    _varint(out, z)
            else:
                _encode(out, item)
    elif kind is bytes:
        _sized(out, value, _BYTES_HEAD, _BYTES)
    elif kind is str:
        _sized(out, value.encode("utf-8"), _STR_HEAD, _STR)
    elif value is None:
        out.append(_NONE)
    elif value is True:
        out.append(_TRUE)
    elif value is False:
        out.append(_FALSE)
    elif kind is dict:
        out.append(_DICT)
        _varint(out, len(value))
        for k in sorted(value):
            if type(k) is not str:
                raise TypeError(f"dict keys must be str, got {k!r}")
            _encode(out, k)
            _encode(out, value[k])
    else:
        raise TypeError(f"cannot encode {type(value).__name__}: {value!r}")


def encode(value: Any) -> bytes:
    out = bytearray()
    _encode(out, value)
    return bytes(out)


class _Reader:
    __slots__ = ("data", "pos")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def varint(self) -> int:
        data = self.data
        shift = 0
        result = 0
        while True:
            if self.pos >= len(data):
                raise DecodeError("truncated varint")
            b = data[self.pos]
            self.pos += 1
            result |= (b & 0x7F) << shift
            if b < 0x80:
                return result
            shift += 7

    def take(self, n: int) -> bytes:
        end = self.pos + n
        if end > len(self.data):
            raise DecodeError("truncated value")
        chunk = self.data[self.pos : end]
        self.pos = end
        return chunk

    def value(self) -> Any:
        if self.pos >= len(self.data):
            raise DecodeError("truncated value")
        tag = self.data[self.pos]
        self.pos += 1
        if tag == _NONE:
            return None
        if tag == _TRUE:
            return True
        if tag == _FALSE:
            return False
        if tag == _INT:
            z = self.varint()
            return (z >> 1) if not z & 1 else -((z + 1) >> 1)
        if tag == _BYTES:
            return self.take(self.varint())
        if tag == _STR:
            try:
                return self.take(self.varint()).decode("utf-8")
            except UnicodeDecodeError as e:
                raise DecodeError(f"bad utf-8 in str: {e}") from None
        if tag == _LIST:
            return [self.value() for _ in range(self.varint())]
        if tag == _DICT:
            n = self.varint()
            result = {}
            for _ in range(n):
                k = self.value()
                if type(k) is not str:
                    raise DecodeError("dict key is not a str")
                result[k] = self.value()
            return result
        raise DecodeError(f"unknown tag {tag}")


def decode(data: bytes) -> Any:
    reader = _Reader(data)
    value = reader.value()
    if reader.pos != len(data):
        raise DecodeError(f"{len(data) - reader.pos} trailing bytes")
    return value
