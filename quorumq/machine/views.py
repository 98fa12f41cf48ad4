"""What the machine's queries return."""

from __future__ import annotations

import zlib
from collections.abc import Mapping

import attrs


@attrs.frozen(kw_only=True)
class StreamMessage:
    """A message as enqueued. Never changes once its offset is assigned."""

    offset: int
    key: str | None
    body: bytes
    headers: Mapping[str, str] | None
    ts_ms: int
    """The machine's time when the message was enqueued."""


@attrs.frozen(kw_only=True)
class QueueStats:
    ready: int
    unacked: int
    consumers: int
    next_offset: int
    first_retained: int
    """Lowest offset still in the stream view; equal to `next_offset` when it is empty."""
    producers: int
    """Idempotent producers remembered (until forgotten or silent for 7 days)."""


def bucket_of(key: str | None, offset: int, buckets: int) -> int:
    """The key bucket of a message, stable across processes and Python versions.

    A keyed message goes to `crc32(utf-8 key) % buckets`, so all messages of one key
    share a bucket; a message without key goes to `offset % buckets`.
    """
    if key is None:
        return offset % buckets
    return zlib.crc32(key.encode("utf-8")) % buckets
