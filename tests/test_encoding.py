"""The canonical encoding behind snapshots and digests."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from quorumq.machine import Machine
from quorumq.machine.encoding import DecodeError, decode, encode

values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.binary() | st.text(),
    lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner),
    max_leaves=30,
)


@given(values)
def test_decode_inverts_encode(value: object) -> None:
    assert decode(encode(value)) == value


@given(st.dictionaries(st.text(), st.integers()))
def test_equal_dicts_encode_equally_whatever_their_order(d: dict[str, int]) -> None:
    assert encode(d) == encode(dict(reversed(list(d.items()))))


@given(st.binary())
def test_garbage_raises_decode_error_never_anything_else(data: bytes) -> None:
    with contextlib.suppress(DecodeError):
        decode(data)


@given(values)
def test_every_truncation_is_refused(value: object) -> None:
    raw = encode(value)
    for cut in range(len(raw)):
        with pytest.raises(DecodeError):
            decode(raw[:cut])


def test_unsupported_types_are_refused() -> None:
    with pytest.raises(TypeError, match="float"):
        encode(1.5)
    with pytest.raises(TypeError, match="dict keys"):
        encode({1: 2})


def test_restore_refuses_bytes_that_are_not_a_snapshot() -> None:
    with pytest.raises(DecodeError, match="not a quorumq machine snapshot"):
        Machine.restore(encode(["something", "else"]))
    with pytest.raises(DecodeError):
        Machine.restore(b"\x06\x05")


# A fixed history whose digest must never change without a new snapshot version:
# the digest is compared across replicas, processes and Python versions.
HISTORY = """
from quorumq.machine import *
m = Machine()
cmds = [
    Declare(queue="dlq"),
    Declare(queue="q", options=QueueOptions(delivery_limit=1, dead_letter_queue="dlq")),
    Subscribe(queue="q", consumer="c1", node="A", prefetch=2),
    Subscribe(queue="q", consumer="c2", node="B"),
    EnqueueBatch(queue="q", messages=[Message(body=b"a", key="k"), Message(body=b"b")],
                 producer="p", first_seq=0),
    Enqueue(queue="q", body=b"c", key="k", headers={"z": "1", "a": "2"}, producer="p", seq=2),
    Nack(queue="q", consumer="c1", offsets=[0]),
    Down(consumer="c1"),
    CommitOffset(queue="q", group="spark", offset=2),
    Declare(queue="r", options=QueueOptions(retry_backoff_ms=(100, 1000))),
    Subscribe(queue="r", consumer="c3", node="C"),
    EnqueueBatch(queue="r", messages=[Message(body=b"d", key="j"), Message(body=b"e")]),
    Nack(queue="r", consumer="c3", offsets=[0]),
    Nack(queue="r", consumer="c3", offsets=[1], delay_ms=5000),
    Tick(),
    Declare(queue="gone"),
    Enqueue(queue="gone", body=b"f", producer="g1-" + "0" * 32, seq=0),
    DeleteQueue(queue="gone"),
    Declare(queue="s"),
    DeleteQueue(queue="s"),
    Declare(queue="s"),
]
for i, c in enumerate(cmds, 1):
    m.apply(Meta(i, 1000 + i), c)
print(m.digest())
"""
GOLDEN_DIGEST = "2081381f9ac58485397273782a294ef8d603201d92aa655f0eb0294eda1f0e20"
"""Snapshot version 4 (retention cost, the death path, delivery times, consumer timeouts,
the highest producer generation each queue forgot, messages waiting for a retry delay,
the `retry_backoff_ms` option, and where deleted queues ended), as written with no disk
alarm raised (version 5 adds them)."""


def _digest_in_subprocess(hash_seed: str) -> str:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    out = subprocess.run(
        [sys.executable, "-c", HISTORY], env=env, capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


def test_digest_is_the_same_in_every_process_and_hash_seed() -> None:
    digests = {_digest_in_subprocess(seed) for seed in ("0", "1", "4242")}
    assert digests == {GOLDEN_DIGEST}


def test_a_version_1_snapshot_is_still_read_and_its_retained_bytes_counted_again() -> None:
    from quorumq.machine import Declare, Enqueue, Meta, QueueOptions

    m = Machine()
    m.apply(Meta(1, 0), Declare(queue="q", options=QueueOptions(retention_bytes=10**6)))
    m.apply(Meta(2, 0), Enqueue(queue="q", body=b"x", key="k", headers={"h": "v"}))
    current = decode(m.snapshot())
    old = [current[0], 1, *current[2:6]]  # no deleted queues (version 4)
    old[5][0][4] = 1  # version 1 counted the body only
    restored = Machine.restore(encode(old))
    assert restored.digest() == m.digest()


def test_a_version_3_snapshot_is_still_read_with_no_retry_state() -> None:
    """Version 3 had no `retry_backoff_ms` option and no waiting messages: restored, its
    queues take the default and wait for nothing, and it snapshots as version 4 (5 only
    with a disk alarm raised)."""
    from quorumq.machine import Declare, Enqueue, Meta, Nack, QueueOptions, Subscribe

    m = Machine()
    m.apply(Meta(1, 0), Declare(queue="q", options=QueueOptions(delivery_limit=3)))
    m.apply(Meta(2, 0), Subscribe(queue="q", consumer="c", node="A"))
    m.apply(Meta(3, 0), Enqueue(queue="q", body=b"x", key="k"))
    m.apply(Meta(4, 0), Nack(queue="q", consumer="c", offsets=[0]))
    current = decode(m.snapshot())
    assert current[1] == 4
    old = [current[0], 3, *current[2:6]]  # no deleted queues
    queue = old[5][0]
    assert queue[-1] == []  # nothing waits
    del queue[-1]
    del queue[1][-1]  # options end with retry_backoff_ms
    restored = Machine.restore(encode(old))
    assert restored.options("q") == QueueOptions(delivery_limit=3)
    assert restored.waiting("q") == {}
    with pytest.raises(DecodeError, match="a version 3 snapshot of 7 parts"):
        Machine.restore(encode([*old, [[0, 0], []]]))
    assert restored.digest() == m.digest()
