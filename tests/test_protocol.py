"""The wire protocol from bytes alone."""

from __future__ import annotations

import struct

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from quorumq.protocol import (
    FrameDecoder,
    ProtocolError,
    auth_proof,
    encode_frame,
    proof_matches,
)

PUBLISH = {
    "t": "publish",
    "id": 1,
    "queue": "q",
    "body": b"x",
    "key": None,
    "headers": None,
    "producer": "p",
    "seq": 0,
}


def _frames(data: bytes, max_frame: int = 1 << 20) -> list[dict]:  # type: ignore[type-arg]
    d = FrameDecoder(max_frame)
    d.feed(data)
    return list(d.frames())


def test_frames_round_trip_split_at_every_byte() -> None:
    data = encode_frame(PUBLISH) + encode_frame({"t": "status", "id": 2})
    d = FrameDecoder()
    got = []
    for i in range(len(data)):
        d.feed(data[i : i + 1])
        got += list(d.frames())
    assert got == [PUBLISH, {"t": "status", "id": 2}]


def test_huge_length_prefix_is_fatal_before_any_buffering() -> None:
    d = FrameDecoder(max_frame=1000)
    d.feed(struct.pack(">I", 2**31) + b"abc")
    with pytest.raises(ProtocolError) as e:
        list(d.frames())
    assert e.value.fatal and e.value.code == "frame_too_large"


def test_bad_frame_is_skipped_and_the_next_one_decodes() -> None:
    garbage = struct.pack(">I", 3) + b"\xc1\xc1\xc1"
    d = FrameDecoder()
    d.feed(garbage + encode_frame({"t": "status", "id": 9}))
    with pytest.raises(ProtocolError) as e:
        list(d.frames())
    assert not e.value.fatal
    assert list(d.frames()) == [{"t": "status", "id": 9}]


@pytest.mark.parametrize(
    ("frame", "code", "complaint"),
    [
        ([1, 2, 3], "bad_frame", "must be a msgpack map"),
        ({"t": "launch", "id": 4}, "unknown_frame", "unknown frame type 'launch'"),
        ({**PUBLISH, "body": "text"}, "bad_frame", "field 'body' must be bytes"),
        ({**PUBLISH, "seq": "7"}, "bad_frame", "field 'seq' must be int or nil"),
        ({"t": "status"}, "bad_frame", "field 'id' must be int"),
    ],
)
def test_malformed_frames_are_refused_with_a_typed_error(
    frame: object, code: str, complaint: str
) -> None:
    raw = msgpack.packb(frame, use_bin_type=True)
    with pytest.raises(ProtocolError, match=complaint) as e:
        _frames(struct.pack(">I", len(raw)) + raw)
    assert e.value.code == code and not e.value.fatal


def test_an_error_names_the_request_it_refuses() -> None:
    with pytest.raises(ProtocolError) as e:
        _frames(encode_frame({**PUBLISH, "id": 77, "body": 5}))
    assert e.value.request_id == 77


@given(st.binary(max_size=300))
def test_random_bytes_never_raise_anything_but_protocol_error(data: bytes) -> None:
    d = FrameDecoder(max_frame=200)
    d.feed(data)
    for _ in range(50):
        try:
            for _frame in d.frames():
                pass
            return
        except ProtocolError as e:
            if e.fatal:
                return


@given(st.lists(st.sampled_from([PUBLISH, {"t": "status", "id": 3}]), max_size=5), st.data())
def test_truncated_streams_yield_only_whole_frames(frames: list, data: st.DataObject) -> None:  # type: ignore[type-arg]
    raw = b"".join(encode_frame(f) for f in frames)
    cut = data.draw(st.integers(0, len(raw)))
    got = _frames(raw[:cut])
    assert got == frames[: len(got)]


def test_auth_proof_is_an_hmac_of_the_nonce() -> None:
    proof = auth_proof("token", b"nonce")
    assert proof_matches("token", b"nonce", proof)
    assert not proof_matches("other", b"nonce", proof)
    assert not proof_matches("token", b"other-nonce", proof)
    assert not proof_matches("token", b"nonce", None)
    assert b"token" not in proof
