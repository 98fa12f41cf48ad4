"""Replies: every command gets one. Refusals are values, never exceptions."""

from __future__ import annotations

import enum
from typing import TypeAlias

import attrs


class ErrorCode(enum.StrEnum):
    UNKNOWN_QUEUE = "unknown_queue"
    OPTIONS_MISMATCH = "options_mismatch"
    INVALID = "invalid"
    QUEUE_FULL = "queue_full"
    """The queue holds `max_length` ready messages (`reject-publish`): full for now."""
    OVER_MAX_LENGTH = "over_max_length"
    """A batch with more messages than the queue's `max_length` (`reject-publish`): it
    can never fit, whatever the queue holds (so neither could any attempt of it)."""
    OUT_OF_ORDER = "out_of_order"
    UNKNOWN_CONSUMER = "unknown_consumer"
    CONSUMER_EXISTS = "consumer_exists"
    NOT_HELD = "not_held"
    NODE_DOWN = "node_down"
    STALE_INDEX = "stale_index"
    TOO_LARGE = "too_large"
    """A command bigger than one log entry may be (the node refuses it before proposing)."""
    PRODUCER_FORGOTTEN = "producer_forgotten"
    """The producer id names a producer the queue has forgotten: a resend of it could not
    be recognised, so it is refused (start a new id, of a generation above `generation`)."""
    PRODUCER_SEALED = "producer_sealed"
    """The producer id starts with a prefix sealed by `forget_producers(seal=True)`: its
    Spark job or micro-batch committed, and a late attempt of its task writes nothing."""
    TOO_MANY_PRODUCERS = "too_many_producers"
    """The queue remembers as many producers as it may, each active within the hour."""
    QUEUE_IN_USE = "queue_in_use"
    """A delete of a queue with consumers, without `force`."""
    DISK_ALARM = "disk_alarm"
    """A node's data disk is below its free-space limit: publishes wait (`DiskAlarm`)."""


@attrs.frozen
class Ok:
    """The command took effect (or was already in effect)."""


OK = Ok()


@attrs.frozen(kw_only=True)
class Declared:
    created: bool


@attrs.frozen(kw_only=True)
class Enqueued:
    """Messages landed at offsets `offset` .. `offset + count - 1`.

    `duplicate` means a producer retried: nothing was enqueued again and `offset` is
    the original one, or None when the retry is older than the dedup window.
    """

    offset: int | None
    count: int = 1
    duplicate: bool = False


@attrs.frozen(kw_only=True)
class Forgotten:
    """`count` producers were forgotten (0 when none matched)."""

    count: int


@attrs.frozen(kw_only=True)
class QueuePurged:
    """`messages` ready messages were removed."""

    messages: int


@attrs.frozen(kw_only=True)
class QueueDeleted:
    """The queue is gone, with `messages` messages (ready and held) and `consumers`
    consumers (cancelled, reason "queue_deleted")."""

    messages: int
    consumers: int


@attrs.frozen(kw_only=True)
class Placed:
    """The queue's Raft group (`Place`)."""

    group: int


@attrs.frozen(kw_only=True)
class Error:
    code: ErrorCode
    message: str
    expected_seq: int | None = None
    """With OUT_OF_ORDER: the sequence number the queue expects next from this producer."""
    generation: int | None = None
    """With PRODUCER_FORGOTTEN: a new producer id's generation must be above this."""


Reply: TypeAlias = (
    Ok | Declared | Enqueued | Forgotten | QueuePurged | QueueDeleted | Placed | Error
)
