"""The queue machine: pure, deterministic, replicated by running it on every node.

`Machine().apply(Meta(index, ts_ms), command) -> Applied(reply, effects)`. See
`quorumq.machine.commands` for the inputs, `effects` and `replies` for the outputs.
"""

from .commands import (
    Ack,
    Cancel,
    Command,
    CommitOffset,
    Declare,
    Down,
    Enqueue,
    EnqueueBatch,
    ForgetProducers,
    Message,
    Nack,
    NodeDown,
    NodeUp,
    QueueOptions,
    Subscribe,
    Tick,
)
from .effects import ConsumerDown, DeadLettered, Deliver, Dropped, Effect
from .machine import Applied, Machine, Meta, UnknownQueueError
from .replies import OK, Declared, Enqueued, Error, ErrorCode, Forgotten, Ok, Reply
from .views import QueueStats, StreamMessage, bucket_of

__all__ = [
    "OK",
    "Ack",
    "Applied",
    "Cancel",
    "Command",
    "CommitOffset",
    "ConsumerDown",
    "DeadLettered",
    "Declare",
    "Declared",
    "Deliver",
    "Down",
    "Dropped",
    "Effect",
    "Enqueue",
    "EnqueueBatch",
    "Enqueued",
    "Error",
    "ErrorCode",
    "ForgetProducers",
    "Forgotten",
    "Machine",
    "Message",
    "Meta",
    "Nack",
    "NodeDown",
    "NodeUp",
    "Ok",
    "QueueOptions",
    "QueueStats",
    "Reply",
    "StreamMessage",
    "Subscribe",
    "Tick",
    "UnknownQueueError",
    "bucket_of",
]
