"""Whatever the codec accepts, the machine can hold, snapshot and restore.

A command field of an unexpected type (a float `max_length`, a bool where an int
belongs, text that is not UTF-8) once passed the codec and the machine, and then broke
every snapshot after it: compaction failed for good and the journal grew without
bound. Here hypothesis builds raw command frames from arbitrary msgpack values, shaped
like each command, and every one the codec accepts must apply, snapshot, restore to an
equal digest, and go on the same way as the original."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quorumq.codec import _COMMIT_OFFSET, VERSION, CodecError, decode_command
from quorumq.machine import Declare, Enqueue, Machine, Meta, QueueOptions, Subscribe

_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=6),
    st.sampled_from(["q", "dlq", "c1", "A", "k", "drop-head", "reject-publish"]),
    st.binary(max_size=8),
)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)
_OPTION_NAMES = [
    "max_length",
    "overflow",
    "delivery_limit",
    "dead_letter_queue",
    "single_active_consumer",
    "retention_messages",
    "retention_bytes",
    "message_ttl_ms",
    "consumer_timeout_ms",
    "retry_backoff_ms",
]
_OPTIONS = st.dictionaries(
    st.sampled_from(_OPTION_NAMES),
    st.one_of(_SCALARS, st.lists(st.integers(-2, 2**64 - 1) | _SCALARS, max_size=3)),
    max_size=4,
)
_ARITY = {
    **{1: 2, 2: 6, 3: 4, 4: 4, 5: 2, 6: 3, 7: 4, 8: 1, 9: 1, 10: 1, 11: 3, 12: 0, 13: 2},
    **{14: 1, 15: 2},  # purge, delete (queue, force)
}
_OPTIONAL_LAST = {3: 2, 4: 1, 7: 1}
"""Commands with optional last fields, how many: a batch's seqs and opens, a
subscribe's timeout, a nack's retry delay."""


@st.composite
def raw_commands(draw: Any) -> bytes:
    tag = draw(st.sampled_from(sorted(_ARITY)))
    optional = draw(st.integers(0, _OPTIONAL_LAST.get(tag, 0)))
    fields: list[Any] = [draw(_VALUES) for _ in range(_ARITY[tag] + optional)]
    if tag == 1 and fields:
        fields[1] = draw(_OPTIONS)
    if tag == 3 and len(fields) > 1:  # a batch: a list of [body, key, headers]
        fields[1] = draw(st.lists(st.lists(_SCALARS, min_size=3, max_size=3), max_size=3))
    if tag == 3 and optional:  # per-message seqs: often a list of ints
        fields[4] = draw(st.one_of(_VALUES, st.lists(st.integers(-2, 40), max_size=3)))
    if tag == 3 and optional == 2:  # opens: often a bool
        fields[5] = draw(st.one_of(_VALUES, st.booleans()))
    if tag == 7 and len(fields) > 3:  # a nack: often a requeue with a small delay
        fields[2] = draw(st.one_of(_VALUES, st.lists(st.integers(0, 3), max_size=2)))
        fields[3] = draw(st.one_of(_VALUES, st.just(True)))
    if tag == 7 and optional:
        fields[4] = draw(st.one_of(_VALUES, st.integers(-5, 10**6)))
    if fields and draw(st.booleans()):
        fields[0] = "q"  # often about the queue that exists
    return bytes(msgpack.packb([VERSION, tag, *fields], use_bin_type=True))


def _machine() -> Machine:
    m = Machine()
    m.apply(Meta(1, 1000), Declare(queue="q", options=QueueOptions(message_ttl_ms=5)))
    m.apply(Meta(2, 1000), Subscribe(queue="q", consumer="c1", node="A", prefetch=1))
    m.apply(Meta(3, 1000), Enqueue(queue="q", body=b"x", key="k"))
    return m


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frames=st.lists(raw_commands(), min_size=1, max_size=6))
def test_every_command_the_codec_accepts_survives_apply_snapshot_and_restore(
    frames: list[bytes],
) -> None:
    machine = _machine()
    index = 4
    for frame in frames:
        try:
            command = decode_command(frame)
        except CodecError:
            continue  # refused at the edge, with a reason: nothing reaches the machine
        machine.apply(Meta(index, 1000 + index), command)
        index += 1
        restored = Machine.restore(machine.snapshot())  # never raises
        assert restored.digest() == machine.digest()
        later = Meta(index, 10_000 + index)
        probe = Enqueue(queue="q", body=b"y", key="k")
        assert restored.apply(later, probe) == machine.apply(later, probe)
        index += 1


def test_a_commit_offset_without_an_offset_is_refused_by_the_codec() -> None:
    # Found by the test above: CommitOffset's validator let None through (it allowed
    # None, as for optional fields), and the machine failed comparing None with an int.
    frame = bytes(msgpack.packb([VERSION, _COMMIT_OFFSET, "q", "", None], use_bin_type=True))
    with pytest.raises(CodecError, match="offset must be an int"):
        decode_command(frame)
