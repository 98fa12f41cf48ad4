"""The versioned msgpack codec for commands, log entries and replies."""

from __future__ import annotations

import contextlib

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from quorumq.codec import (
    UNSTAMPED,
    VERSION,
    CodecError,
    decode_command,
    decode_entry,
    decode_reply,
    encode_command,
    encode_entry,
    encode_reply,
    entry_time,
    stamp_entry,
)
from quorumq.machine import (
    OK,
    Ack,
    Cancel,
    CommitOffset,
    Declare,
    Declared,
    DeleteQueue,
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
    Place,
    Placed,
    PurgeQueue,
    QueueDeleted,
    QueueOptions,
    QueuePurged,
    Subscribe,
    Tick,
)

names = st.text(min_size=1, max_size=12)
headers = st.none() | st.dictionaries(st.text(max_size=5), st.text(max_size=5), min_size=1)
offsets = st.lists(st.integers(0, 2**40), max_size=5)
options = st.builds(
    QueueOptions,
    max_length=st.none() | st.integers(0, 100),
    overflow=st.sampled_from(["drop-head", "reject-publish"]),
    delivery_limit=st.none() | st.integers(0, 5),
    dead_letter_queue=st.none() | names,
    single_active_consumer=st.booleans(),
    retention_messages=st.none() | st.integers(0, 10**9),
    retention_bytes=st.none() | st.integers(0, 10**12),
    message_ttl_ms=st.none() | st.integers(1, 10**9),
    retry_backoff_ms=st.none()
    | st.integers(1, 1000).flatmap(lambda low: st.tuples(st.just(low), st.integers(low, 10**6))),
)
messages = st.builds(Message, body=st.binary(), key=st.none() | names, headers=headers)
commands = st.one_of(
    st.builds(Declare, queue=names, options=options),
    st.builds(
        Enqueue,
        queue=names,
        body=st.binary(),
        key=st.none() | names,
        headers=headers,
        producer=st.none() | names,
        seq=st.none() | st.integers(0, 2**40),
    ),
    st.builds(
        EnqueueBatch,
        queue=names,
        messages=st.lists(messages, max_size=4),
        producer=st.none() | names,
        first_seq=st.none() | st.integers(0, 2**40),
    ),
    st.builds(Subscribe, queue=names, consumer=names, node=names, prefetch=st.integers(0, 65_535)),
    st.builds(Cancel, queue=names, consumer=names),
    st.builds(Ack, queue=names, consumer=names, offsets=offsets),
    st.builds(Nack, queue=names, consumer=names, offsets=offsets, requeue=st.booleans()),
    st.builds(Nack, queue=names, consumer=names, offsets=offsets, delay_ms=st.integers(0, 10**6)),
    st.builds(Down, consumer=names),
    st.builds(NodeDown, node=names),
    st.builds(NodeUp, node=names),
    st.builds(CommitOffset, queue=names, group=names, offset=st.integers(0, 2**40)),
    st.builds(ForgetProducers, queue=names, prefix=names, seal=st.booleans()),
    st.builds(PurgeQueue, queue=names),
    st.builds(DeleteQueue, queue=names, force=st.booleans()),
    st.builds(Place, queue=names, groups=st.integers(1, 64), dead_letter_queue=st.none() | names),
    st.just(Tick()),
)
replies = st.one_of(
    st.just(OK),
    st.builds(Declared, created=st.booleans()),
    st.builds(
        Enqueued,
        offset=st.none() | st.integers(0, 2**40),
        count=st.integers(1, 1000),
        duplicate=st.booleans(),
    ),
    st.builds(Forgotten, count=st.integers(0, 2**40)),
    st.builds(QueuePurged, messages=st.integers(0, 2**40)),
    st.builds(QueueDeleted, messages=st.integers(0, 2**40), consumers=st.integers(0, 10**6)),
    st.builds(Placed, group=st.integers(0, 63)),
    st.builds(
        Error,
        code=st.sampled_from(list(ErrorCode)),
        message=st.text(),
        expected_seq=st.none() | st.integers(0, 2**40),
    ),
)


@given(commands)
def test_commands_round_trip(cmd: object) -> None:
    assert decode_command(encode_command(cmd)) == cmd  # type: ignore[arg-type]


@given(commands, st.integers(0, 2**50))
def test_log_entries_carry_the_proposers_clock(cmd: object, ts_ms: int) -> None:
    assert decode_entry(encode_entry(ts_ms, cmd)) == (ts_ms, cmd)  # type: ignore[arg-type]


@given(replies)
def test_replies_round_trip(reply: object) -> None:
    assert decode_reply(encode_reply(reply)) == reply  # type: ignore[arg-type]


@given(st.binary())
def test_garbage_is_refused_with_codec_error(data: bytes) -> None:
    for decode in (decode_command, decode_entry, decode_reply):
        with contextlib.suppress(CodecError):
            decode(data)


def _raw(*fields: object) -> bytes:
    return msgpack.packb(list(fields), use_bin_type=True)  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("data", "complaint"),
    [
        (_raw(VERSION + 1, 2), "unsupported codec version"),
        (_raw(VERSION, 99), "unknown command tag"),
        (_raw(VERSION, 8), "takes 1 fields"),
        (_raw(VERSION, 2, "q", "not bytes", None, None, None, None), "body must be bytes"),
        (_raw(VERSION, 6, "q", "c", [-1]), "non-negative"),
        (_raw(VERSION, 1, "q", {"max_length": 1, "colour": "red"}), "unknown queue options"),
        (_raw(VERSION, 1, "q", {"overflow": "sideways"}), "overflow"),
        (_raw(VERSION, 3, "q", [["body-not-bytes", None, None]], None, None), "body must be bytes"),
        (b"\xc1", "not msgpack"),
        (_raw("just", "strings"), "unsupported codec version"),
        (_raw(VERSION, 17, "q", 0, None), "groups must be from 1 to 64"),
        (_raw(VERSION, 17, "q", 65, None), "groups must be from 1 to 64"),
        (_raw(VERSION, 17, "q", True, None), "groups must be an int"),
    ],
)
def test_invalid_commands_are_refused_with_a_reason(data: bytes, complaint: str) -> None:
    with pytest.raises(CodecError, match=complaint):
        decode_command(data)


def test_a_command_is_not_a_log_entry() -> None:
    with pytest.raises(CodecError, match="not a log entry"):
        decode_entry(encode_command(Tick()))


def test_encoding_is_stable() -> None:
    # tags and layout are part of the log format: this must never change within VERSION 1
    command = Enqueue(queue="q", body=b"x", key="k", producer="p", seq=3)
    assert encode_entry(7, command) == (  # the time as a fixed-width uint64, for the leader
        b"\x94\x01\xcc\xc8\xcf\x00\x00\x00\x00\x00\x00\x00\x07\x97\x02\xa1q\xc4\x01x\xa1k\xc0\xa1p\x03"
    )
    # entries written before the time was fixed-width still read the same
    assert decode_entry(b"\x94\x01\xcc\xc8\x07\x97\x02\xa1q\xc4\x01x\xa1k\xc0\xa1p\x03") == (
        7,
        command,
    )


def test_the_leader_stamps_an_entry_without_decoding_it() -> None:
    entry = encode_entry(UNSTAMPED, Enqueue(queue="q", body=b"x"))
    stamped = stamp_entry(entry, 1_800_000_000_123)
    assert decode_entry(stamped) == (1_800_000_000_123, Enqueue(queue="q", body=b"x"))
    assert entry_time(stamped) == 1_800_000_000_123 and entry_time(entry) == 0
    assert stamp_entry(b"\x94\x01\xcc\xc8\x07\x91\x0c", 5) == b"\x94\x01\xcc\xc8\x07\x91\x0c"


def test_new_tags_are_pinned() -> None:
    # added after VERSION 1 shipped: the next free tags, never renumbered
    assert encode_command(ForgetProducers(queue="q", prefix="p-")) == b"\x94\x01\x0d\xa1q\xa2p-"
    assert encode_reply(Forgotten(count=3)) == b"\x93\x01\x68\x03"
    assert encode_command(PurgeQueue(queue="q")) == _raw(VERSION, 14, "q")
    assert encode_command(DeleteQueue(queue="q", force=True)) == _raw(VERSION, 15, "q", True)
    assert encode_reply(QueuePurged(messages=3)) == _raw(VERSION, 105, 3)
    assert encode_reply(QueueDeleted(messages=3, consumers=1)) == _raw(VERSION, 106, 3, 1)
    assert encode_command(Place(queue="q", groups=4)) == _raw(VERSION, 17, "q", 4, None)
    assert encode_reply(Placed(group=2)) == _raw(VERSION, 107, 2)


def test_a_retry_delay_and_backoff_travel_only_when_set() -> None:
    """An entry that uses neither reads as one written before they existed: a nack has
    four fields and a declare's options no `retry_backoff_ms` (a node of an earlier
    release reads it); with them, the nack takes a fifth and the options the pair."""
    plain = Nack(queue="q", consumer="c", offsets=[1])
    assert encode_command(plain) == _raw(VERSION, 7, "q", "c", [1], True)
    delayed = Nack(queue="q", consumer="c", offsets=[1], delay_ms=250)
    assert encode_command(delayed) == _raw(VERSION, 7, "q", "c", [1], True, 250)
    assert decode_command(encode_command(delayed)) == delayed
    assert "retry_backoff_ms" not in msgpack.unpackb(encode_command(Declare(queue="q")))[3]
    backoff = Declare(queue="q", options=QueueOptions(retry_backoff_ms=(100, 800)))
    assert msgpack.unpackb(encode_command(backoff))[3]["retry_backoff_ms"] == [100, 800]
    assert decode_command(encode_command(backoff)) == backoff
    with pytest.raises(CodecError, match="requeue"):
        decode_command(_raw(VERSION, 7, "q", "c", [1], False, 250))
