"""The cluster identity's parts (`quorumq.raft.cluster_identity`): the log entry, the file
in the data directory, and which messages a node that knows an identity drops. Whole
clusters: `test_sim_cluster_identity` (simulated) and `test_cluster` (processes)."""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from quorumq.raft.base import CLUSTER, IDENTITY_ENTRY, PREV_CRC
from quorumq.raft.cluster_identity import (
    FILE_NAME,
    ClusterIdentity,
    ForeignClusterError,
    decode_identity,
    encode_identity,
    identity_in,
    identity_no_op,
    load_identity,
)
from quorumq.raft.files import OS_FILES
from quorumq.raft.journal import DurableJournal, JournalDamagedError

MINE = "0123456789abcdef0123456789abcdef"
THEIRS = "fedcba9876543210fedcba9876543210"


def test_the_entry_carries_the_identity_under_pysyncobjs_no_op_type() -> None:
    command = identity_no_op(MINE)
    assert command[:1] == b"\x01"  # what an earlier version applies as nothing
    assert identity_in(command) == MINE
    assert identity_in(b"\x01") is None  # a leader's plain no-op
    assert identity_in(command[:-1]) is None
    assert identity_in(b"\x04" + command[1:]) is None
    assert identity_in(command[:-1] + b"G") is None  # not hex


def test_the_file_keeps_the_identity_and_a_damaged_one_is_refused_saying_the_way_out(
    tmp_path: Path,
) -> None:
    assert load_identity(OS_FILES, str(tmp_path)) is None
    data = encode_identity(MINE)
    assert decode_identity(data, "f") == MINE
    (tmp_path / FILE_NAME).write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(JournalDamagedError, match="remove it, and the node learns"):
        load_identity(OS_FILES, str(tmp_path))
    (tmp_path / FILE_NAME).write_bytes(data)
    assert load_identity(OS_FILES, str(tmp_path)) == MINE
    assert issubclass(ForeignClusterError, JournalDamagedError)  # the node stops


Y = "00000000000000000000000000000001"


class _Member(ClusterIdentity):
    """The rules alone, on a node of three (A) whose log holds PySyncObj's first entry,
    the identity entry of `holds` at (2, 1), and a command at (3, 1)."""

    def __init__(self, *, known: str | None = MINE, holds: str = MINE) -> None:
        # (no PySyncObj: only what the rules read)
        self.cluster_identity = known
        self._SyncObj__otherNodes = {"B", "C"}
        self._SyncObj__raftLog = [(b"\x01", 1, 0), (identity_no_op(holds), 2, 1), (b"\x04a", 3, 1)]
        self.ticked_soon = 0

    def tick_soon(self) -> None:
        self.ticked_soon += 1


def _append(*entries: tuple[bytes, int, int], **more: Any) -> dict[str, Any]:
    return {"type": "append_entries", "term": 2, "entries": list(entries), **more}


def _vote(**more: Any) -> dict[str, Any]:
    return {"type": "request_vote", "term": 9, **more}


@pytest.mark.parametrize(
    ("message", "dropped"),
    [
        (_vote(), False),  # an earlier version's: no keys
        (_vote(**{CLUSTER: ""}), False),  # it knows none yet
        (_vote(**{CLUSTER: MINE}), False),
        (_vote(**{CLUSTER: THEIRS}), True),
        ({"type": "quorumq_keepalive", CLUSTER: THEIRS}, True),
        (_vote(**{CLUSTER: 7}), False),  # not an identity: read as if absent
        (_vote(**{CLUSTER: THEIRS.upper()}), False),
        # the entry it names: the same index and term, other bytes, from anyone
        (_vote(**{IDENTITY_ENTRY: [2, 1, THEIRS]}), True),
        (_vote(**{IDENTITY_ENTRY: [2, 1, MINE]}), False),
        (_vote(**{IDENTITY_ENTRY: [2, 2, THEIRS]}), False),  # another term: Raft's conflict
        (_vote(**{IDENTITY_ENTRY: [9, 4, THEIRS]}), False),  # a candidate may lack mine
        # a leader's log holds every committed entry: the identity entry too
        (_append(**{IDENTITY_ENTRY: [9, 4, THEIRS]}), True),
        (_append(**{IDENTITY_ENTRY: [2, 1, MINE], CLUSTER: ""}), False),
        # entries this log holds with the same index and term must be the same bytes
        (_append((b"\x04a", 3, 1), (b"\x04b", 4, 2)), False),
        (_append((b"\x04b", 3, 1)), True),
        (_append((b"\x04b", 3, 2)), False),  # another term: Raft's conflict, cut
        (_append((identity_no_op(THEIRS), 2, 1), (b"\x04a", 3, 1)), True),
        (_append((b"\x04b", 4, 1)), False),  # new to this log
    ],
)
def test_a_node_drops_what_another_history_sends(message: dict[str, Any], dropped: bool) -> None:
    member = _Member()
    assert member._foreign("B", message) is dropped
    assert member._foreign_error is None  # one peer of two is no majority


def test_a_node_that_knows_no_identity_still_drops_an_entry_that_collides_with_its_own() -> None:
    """The reviewer's race: C holds the empty nodes' identity entry at (2, 1), applied by
    nobody yet, and a restored node elected leader names its own at (2, 1)."""
    member = _Member(known=None, holds=Y)
    assert member._foreign("A", _append(**{IDENTITY_ENTRY: [2, 1, THEIRS], CLUSTER: THEIRS}))
    assert not member._foreign("B", _append(**{IDENTITY_ENTRY: [2, 1, Y], CLUSTER: Y}))
    assert not member._foreign("C", _append(**{CLUSTER: THEIRS}))  # it knows none: no verdict
    # A is not heard at all for a while: a foreign leader's refused heartbeats would
    # otherwise hold this node as its follower
    assert member._foreign("A", _append(**{IDENTITY_ENTRY: [2, 1, Y], CLUSTER: Y}))


def test_a_majority_of_foreign_peers_stops_the_node_and_one_does_not() -> None:
    member = _Member()
    message = {"type": "quorumq_keepalive", CLUSTER: THEIRS}
    assert member._foreign("B", message)
    assert member._foreign("B", message)
    assert member._foreign_error is None
    assert member._foreign("D", message)  # not a member: not counted
    assert member._foreign_error is None
    assert member._foreign("C", message)
    assert isinstance(member._foreign_error, ForeignClusterError)
    assert str(member._foreign_error).startswith(
        f"this node's data belongs to cluster {MINE}, but a majority of its peers (B, C) "
        f"hold another (cluster {THEIRS};"
    )
    assert member.ticked_soon == 1
    with pytest.raises(ForeignClusterError):
        member._onTick()


def test_the_journal_keeps_track_of_its_identity_entry(tmp_path: Path) -> None:
    """Which identity entry a log holds (what every message names): set as it is
    appended (or written in place of a new leader's no-op), kept through compaction,
    forgotten when cut or replaced by a snapshot install, found again at open."""
    path = str(tmp_path / "raft.log")
    journal = DurableJournal(path)
    journal.setCurrentTerm(3, None)
    journal.add(b"\x01", 1, 0)
    assert journal.carrying_no_op is None
    journal.next_no_op = identity_no_op(MINE)
    journal.add(b"\x01", 2, 1)  # a new leader's no-op
    assert journal.carrying_no_op == (identity_no_op(MINE), 2, 1)
    journal.add(b"\x04a", 3, 1)
    journal.add(b"\x01", 4, 2)  # the next leader's plain no-op
    assert journal[3][0] == b"\x01" and journal.carrying_no_op == (identity_no_op(MINE), 2, 1)
    journal.sync()
    journal._destroy()
    journal = DurableJournal(path)
    assert journal.carrying_no_op == (identity_no_op(MINE), 2, 1)
    journal.deleteEntriesTo(2)  # compacted: the history still had it there
    assert journal.carrying_no_op == (identity_no_op(MINE), 2, 1)
    journal.add(b"\x04c", 5, 3)
    journal.deleteEntriesFrom(2)  # entries 5 on cut (positions, not indexes)
    assert journal.carrying_no_op == (identity_no_op(MINE), 2, 1)
    journal.clear()  # a snapshot install
    assert journal.carrying_no_op is None
    journal.add(b"\x04d", 6, 3)
    journal.add(identity_no_op(THEIRS), 7, 4)  # an uncommitted one, which a leader cuts
    journal.deleteEntriesFrom(1)
    assert journal.carrying_no_op is None
    journal._destroy()


_ODD = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.text(max_size=40),
    st.binary(max_size=40),
    st.sampled_from([MINE, THEIRS, "", MINE.upper()]),
    st.lists(st.integers(), max_size=4),
)


@given(
    kind=st.sampled_from(["append_entries", "request_vote", "quorumq_keepalive", None]),
    said=_ODD,
    entry=st.one_of(_ODD, st.tuples(_ODD, _ODD, _ODD).map(list)),
    crc=_ODD,
    prev=st.tuples(_ODD, _ODD),
    entries=st.one_of(
        _ODD,
        st.lists(st.one_of(_ODD, st.tuples(st.binary(max_size=8), _ODD, _ODD)), max_size=4),
    ),
)
def test_whatever_a_peer_puts_in_the_keys_a_node_judges_without_raising(
    kind: Any, said: Any, entry: Any, crc: Any, prev: Any, entries: Any
) -> None:
    """A Raft message comes from an authenticated peer, but of any version, and the
    check runs on the Raft thread before anything else: odd values in the keys it reads
    are an answer (read as absent, or another history), never an exception."""
    message = {"type": kind, CLUSTER: said, IDENTITY_ENTRY: entry, PREV_CRC: crc}
    message.update({"prevLogIdx": prev[0], "prevLogTerm": prev[1], "entries": entries})
    for member in (_Member(), _Member(known=None, holds=Y)):
        assert member._foreign("B", message) in (True, False)


@given(st.integers(1, 3), st.integers(0, 3), st.booleans())
def test_a_peer_of_the_same_log_is_never_taken_for_another_history(
    prev: int, sent: int, leading: bool
) -> None:
    """What this node's own log says, said back by a peer (its identity, its identity
    entry, the CRC of an entry it holds, entries it holds): never another history."""
    member = _Member()
    log = member._SyncObj__raftLog
    message: dict[str, Any] = {"type": "append_entries" if leading else "request_vote"}
    message[CLUSTER] = MINE
    message[IDENTITY_ENTRY] = [2, 1, MINE]
    message["prevLogIdx"], message["prevLogTerm"] = log[prev - 1][1], log[prev - 1][2]
    message[PREV_CRC] = zlib.crc32(log[prev - 1][0])
    message["entries"] = list(log[prev : prev + sent])
    assert not member._foreign("B", message)
