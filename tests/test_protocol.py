"""The wire protocol from bytes alone."""

from __future__ import annotations

import struct

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from quorumq.wire.protocol import (
    FrameDecoder,
    FrameQueue,
    ProtocolError,
    auth_proof,
    copy_frame,
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


def test_read_columns_carry_the_same_messages_as_rows_and_pages_join() -> None:
    from quorumq.client.core import read_result
    from quorumq.wire.protocol import check_columns, encode_columns

    records = [
        (7, "k1", b"first", None, 1000),
        (9, None, b"", {"h": "v"}, 1001),
        (12, "k2", b"x" * 300, None, 1002),
    ]
    page = encode_columns(records)
    assert check_columns(msgpack.unpackb(msgpack.packb(page, use_bin_type=True))) == page

    def reply(part: list[tuple[object, ...]]) -> dict[str, object]:
        return {"first_retained": 0, "next_offset": 13, "columns": encode_columns(part)}

    joined = read_result([reply(records[:1]), reply(records[1:])])
    assert joined.rows == [] and joined.columns is not None
    assert joined.columns.bodies == b"first" + b"x" * 300
    assert [list(r) for r in records] == joined.columns.rows()
    assert [(m.offset, m.key, m.body, m.headers) for m in joined] == [r[:4] for r in records]
    old_node = read_result([{"first_retained": 0, "next_offset": 13, "messages": records}])
    assert old_node.columns is None and old_node.rows == records  # asked columns, got rows


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"body_lengths": [5, 0, 299]}, "body lengths do not add up to bodies"),
        ({"body_lengths": [5, -1, 301]}, "a body length is not a size"),
        ({"body_lengths": [5, 0, 300, 0]}, "the columns differ in length"),
        ({"keys": ["k1", None]}, "the columns differ in length"),
        ({"bodies": "text"}, "'bodies' is missing or malformed"),
        ({"ts_ms": None}, "'ts_ms' is missing or malformed"),
    ],
)
def test_read_columns_that_do_not_add_up_are_a_bad_frame(
    change: dict[str, object], message: str
) -> None:
    from quorumq.wire.protocol import check_columns, encode_columns

    page = encode_columns(
        [(7, "k1", b"first", None, 1), (9, None, b"", None, 2), (12, "k2", b"x" * 300, None, 3)]
    )
    with pytest.raises(ProtocolError, match=message):
        check_columns({**page, **change})


# ------------------------------------------------------------ in-process frames

_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=40)
    | st.binary(max_size=300),
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.tuples(inner, inner)
        | st.dictionaries(st.text(max_size=10), inner, max_size=5)
    ),
    max_leaves=30,
)


@given(_VALUES)
def test_a_copied_value_is_what_decoding_gives_and_counts_for_at_least_its_encoding(
    value: object,
) -> None:
    """An in-process connection's bounds are counted in `copy_frame`'s sizes: no smaller
    than the bytes msgpack makes (each value, not just a whole frame), so they are no
    looser than over TCP."""
    copy, size = copy_frame(value)
    encoded = msgpack.packb(value, use_bin_type=True)
    assert copy == msgpack.unpackb(encoded, raw=False, strict_map_key=False)
    assert size >= len(encoded)


def test_a_copied_frame_shares_no_map_or_list_with_the_original() -> None:
    """What a node hands a client in its own process must not alias the replica's state:
    a delivery's headers are the machine's own map."""
    headers = {"trace": "a"}
    rows = [(0, None, b"m", headers, 5)]
    frame = {"t": "reply", "id": 1, "headers": headers, "messages": rows}
    copy, _ = copy_frame(frame)
    copy["headers"]["trace"] = "changed"
    copy["messages"][0][3]["trace"] = "changed"
    copy["messages"].append("more")
    assert headers == {"trace": "a"} and rows == [(0, None, b"m", headers, 5)]
    assert copy["messages"][0] == [0, None, b"m", {"trace": "changed"}, 5]  # a list, as decoded


def test_a_copied_frame_holds_only_plain_values_as_msgpack_would() -> None:
    class Text(str):
        pass

    copy, _ = copy_frame({"k": Text("v"), "b": bytearray(b"xy"), "m": memoryview(b"z")})
    assert copy == {"k": "v", "b": b"xy", "m": b"z"}
    assert [type(v) for v in copy.values()] == [str, bytes, bytes]
    with pytest.raises(TypeError, match="serialize"):
        copy_frame({"t": "declare", "options": {"x": object()}})  # encode_frame refuses it too
    with pytest.raises(TypeError):
        encode_frame({"t": "declare", "options": {"x": object()}})


def test_a_frame_queue_checks_frames_as_the_decoder_does() -> None:
    """A bad frame is skipped with a typed error; one over the limit is fatal."""
    queue = FrameQueue(max_frame=100)
    queue.feed([copy_frame({"t": "status"}), copy_frame({"t": "status", "id": 2})])
    frames = queue.frames()
    with pytest.raises(ProtocolError) as bad:
        next(frames)
    assert bad.value.code == "bad_frame" and not bad.value.fatal
    assert list(queue.frames()) == [{"t": "status", "id": 2}]
    queue.feed([copy_frame({**PUBLISH, "body": b"x" * 100})])
    with pytest.raises(ProtocolError) as large:
        list(queue.frames())
    assert large.value.code == "frame_too_large" and large.value.fatal
