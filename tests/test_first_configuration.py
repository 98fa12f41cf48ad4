"""A node's first configuration, recorded in its data directory and checked at every
start (`quorumq.raft.first_configuration`, issue 27): a node restarted with another
`--peer` list before its first snapshot counted votes over other voters than the
others, and two quorums need not overlap."""

from __future__ import annotations

import logging
import random
import zlib
from pathlib import Path
from typing import Any

import pytest

from quorumq.machine import encoding
from quorumq.ops.local_cluster import free_ports
from quorumq.raft.files import OS_FILES
from quorumq.raft.first_configuration import (
    FILE_NAME,
    PeersChangedError,
    decode_first_configuration,
    encode_first_configuration,
    settle_first_configuration,
)
from quorumq.raft.journal import JournalDamagedError

ABC = {"A": "127.0.0.1:7001", "B": "127.0.0.1:7002", "C": "127.0.0.1:7003"}


def _settle(root: Path, members: dict[str, str], *, state: bool) -> dict[str, str]:
    return settle_first_configuration(OS_FILES, str(root), members, holds_raft_state=state)


def test_the_first_start_records_its_members_and_a_restart_given_them_runs_with_them(
    tmp_path: Path,
) -> None:
    assert _settle(tmp_path, ABC, state=False) == ABC
    record = (tmp_path / FILE_NAME).read_bytes()
    assert decode_first_configuration(record, "the record") == ABC
    assert _settle(tmp_path, dict(reversed(ABC.items())), state=True) == ABC  # order is no matter
    assert (tmp_path / FILE_NAME).read_bytes() == record
    assert not list(tmp_path.glob("*.tmp"))


def test_a_restart_given_other_peers_is_refused_in_one_line_naming_what_differs(
    tmp_path: Path,
) -> None:
    """A of {A, B, C} restarted with B and D: A and D are a majority of {A, B, D}, B and
    C one of {A, B, C}, and the two quorums do not overlap."""
    _settle(tmp_path, ABC, state=False)
    other = {"A": ABC["A"], "B": "127.0.0.1:7012", "D": "127.0.0.1:7004"}
    with pytest.raises(PeersChangedError) as refused:
        _settle(tmp_path, other, state=True)
    line = str(refused.value)
    assert "\n" not in line
    a, b, c = ABC.values()
    assert f"was first started with the members {{A={a}, B={b}, C={c}}}" in line
    assert f"now gives {{A={a}, B=127.0.0.1:7012, D=127.0.0.1:7004}}" in line
    assert f"(C={c} missing; D=127.0.0.1:7004 added; B at 127.0.0.1:7012, not {b})" in line
    assert "`quorumq members`" in line
    assert decode_first_configuration((tmp_path / FILE_NAME).read_bytes(), "-") == ABC
    with pytest.raises(PeersChangedError, match=r"A at 127\.0\.0\.1:9, not"):  # its own address too
        _settle(tmp_path, {**ABC, "A": "127.0.0.1:9"}, state=True)


def test_a_node_that_never_took_part_in_raft_records_the_peers_it_is_given_again(
    tmp_path: Path,
) -> None:
    """No term, vote or snapshot on disk: the node never voted nor took in an entry, so
    nothing depends on what it was given (a first start whose Raft port was taken, or
    whose peers were all unreachable, is corrected by starting it again)."""
    _settle(tmp_path, ABC, state=False)
    corrected = {**ABC, "A": "127.0.0.1:7011"}
    assert _settle(tmp_path, corrected, state=False) == corrected
    with pytest.raises(PeersChangedError):
        _settle(tmp_path, ABC, state=True)  # and from its first term on, it is pinned


def test_a_damaged_record_refuses_to_start_and_says_the_way_out(tmp_path: Path) -> None:
    path = tmp_path / FILE_NAME
    good = encode_first_configuration(ABC)
    flipped = bytearray(good)
    flipped[len(good) - 3] ^= 0x10  # in an address
    for damaged, says in [
        (bytes(flipped), "fails its checksum"),
        (good[:-5], "fails its checksum"),
        (b"", "is not a quorumq first configuration"),
        (b"QQJ2 something else", "is not a quorumq first configuration"),
    ]:
        path.write_bytes(damaged)
        for state in (True, False):
            with pytest.raises(JournalDamagedError, match=says) as refused:
                _settle(tmp_path, ABC, state=state)
            assert "\n" not in str(refused.value)
            assert f"remove {path} and start it with exactly those" in str(refused.value)
    payload = encoding.encode({"format": "quorumq-first-configuration", "version": 2})
    later = b"QQF1" + zlib.crc32(payload).to_bytes(4, "little") + payload
    with pytest.raises(ValueError, match="unsupported version 2"):
        decode_first_configuration(later, "a record of a later quorumq")


def test_a_data_directory_from_before_the_record_takes_the_peers_given_and_checks_them_since(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """What such a node was first started with is written nowhere: it is recorded as
    given, with a warning (it is what the node counted votes over until now), and a
    later start must give the same."""
    with caplog.at_level(logging.WARNING, logger="quorumq.raft.first_configuration"):
        assert _settle(tmp_path, ABC, state=True) == ABC
    assert "from before the record" in caplog.text
    assert decode_first_configuration((tmp_path / FILE_NAME).read_bytes(), "-") == ABC
    with pytest.raises(PeersChangedError):
        _settle(tmp_path, {"A": ABC["A"], "B": ABC["B"]}, state=True)


def test_the_record_survives_a_power_loss_right_after_it_is_written() -> None:
    """Written to a temporary file, synced, renamed and the directory synced: a node
    whose host loses power right after its first start finds it."""
    from simulations.disk import SimFiles

    files = SimFiles(random.Random(1))
    settle_first_configuration(files, "/", ABC, holds_raft_state=False)
    files.power_loss(torn=True)
    assert sorted(files.names) == [f"/{FILE_NAME}"]
    assert decode_first_configuration(files.read(f"/{FILE_NAME}") or b"", "-") == ABC


# ---------------------------------------------------------------- a Raft member


def _member(root: Path, members: dict[str, str]) -> Any:
    from .test_raft_rules import _restart

    return _restart(root, members)


def test_a_raft_member_restarted_with_other_peers_is_refused_and_runs_with_its_first_ones(
    tmp_path: Path,
) -> None:
    from quorumq.raft import member as member_module

    a, b, c, d = (f"127.0.0.1:{p}" for p in free_ports(4))
    first = {"A": a, "B": b, "C": c}
    member = _member(tmp_path, first)
    member._SyncObj__setCurrentTerm(1, None)  # it took part in an election: Raft state
    member.stop()
    with pytest.raises(PeersChangedError, match=r"C=\S+ missing; D=\S+ added"):
        _member(tmp_path, {"A": a, "B": b, "D": d})
    assert not member_module._JOURNALS  # refused before it opened anything
    again = _member(tmp_path, first)
    try:
        assert again.members() == first
        assert again.raftCurrentTerm == 1
    finally:
        again.stop()
