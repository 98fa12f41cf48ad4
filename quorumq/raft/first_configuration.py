"""A node's first configuration, kept in its data directory.

Until a node holds a snapshot, the voters it counts are its first configuration changed
by the configuration entries of its log (`RaftRules._take_configuration_from_log`).
That first configuration came from `--peer` at every start, and nothing on disk said
what it had been: a node of {A, B, C} restarted with `--peer B --peer D` before its
first snapshot counted votes in {A, B, D}, where A and D are a majority, while B and C
are one of {A, B, C}: two quorums that need not overlap, two leaders of one term
(issue 27). So the members a node first runs with (name -> Raft address, itself
included) are written to `first-configuration` in its data directory, and the node runs
with the stored ones. The rule, at every start (`settle_first_configuration`):

* the node holds no Raft state yet (no journal meta file, so no term, vote or commit
  index, and no snapshot): the members given are recorded, again if an earlier start
  recorded others. Such a node never voted, stood for election or took in an entry
  (each stores a term first), so nothing depends on what it was given before: a first
  start that failed on a taken Raft port, or whose peers were all unreachable, can be
  corrected by starting again.
* it holds Raft state and a record: the members given must be the recorded ones,
  exactly (names and Raft addresses, its own included); otherwise it refuses to start
  (`PeersChangedError`, one line naming what differs). The record, not the
  configuration the log has come to: membership changes after the first start live in
  the log and snapshots, `--peer` only seeds the first configuration (README), and a
  node added to a running cluster was first started with every current member and
  itself, which is then its record. Accepting the current configuration too would need
  the journal and snapshot read first, and it may hold uncommitted changes; "the flags
  of the first start" is one rule, checked before anything is loaded, that an operator
  can follow. (Once the node has a snapshot its configuration comes from there and the
  record decides nothing, but it is checked all the same: one rule.)
* it holds Raft state and no record: a data directory from before this file. What it
  was first started with cannot be read anywhere (the journal holds changes, not the
  start), so the members given are recorded, with a warning: they are what the node
  counted votes over until now (every start took `--peer`), and refusing would leave
  every existing node unable to start, with no tool to write the file. From then on
  they are checked.
* a record that fails its checksum or cannot be read: refused (`JournalDamagedError`),
  saying the way out.

The record is written before the node holds Raft state (before its journal is opened,
on a real node), atomically and durably: a temporary file, fsynced, renamed, the
directory fsynced (`files.write_atomically`). Its bytes: b"QQF1", the CRC-32 of the
payload (4 bytes, little-endian), then the payload in our encoding
(`quorumq.machine.encoding`): {"format": "quorumq-first-configuration", "version": 1,
"members": {name: address}}.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from .files import Files, decode_record, encode_record, write_atomically
from .journal import JournalDamagedError

logger = logging.getLogger(__name__)

FILE_NAME = "first-configuration"
VERSION = 1
_MAGIC = b"QQF1"
_FORMAT = "quorumq-first-configuration"

__all__ = [
    "FILE_NAME",
    "PeersChangedError",
    "decode_first_configuration",
    "encode_first_configuration",
    "settle_first_configuration",
]


class PeersChangedError(Exception):
    """The members a node is started with are not those its data directory was first
    started with: it refuses to start (see the module's docstring)."""


def encode_first_configuration(members: Mapping[str, str]) -> bytes:
    """The record's bytes: magic, CRC-32 of the payload, the payload."""
    return encode_record(_MAGIC, {"format": _FORMAT, "version": VERSION, "members": dict(members)})


def decode_first_configuration(data: bytes, source: str) -> dict[str, str]:
    """The members `encode_first_configuration` wrote, read from `source`; `ValueError`
    naming `source` and what is wrong if the bytes are not such a record."""
    value = decode_record(data, source, _MAGIC, _FORMAT, "a quorumq first configuration")
    if value.get("version") != VERSION:
        raise ValueError(f"{source} has unsupported version {value.get('version')!r}")
    members = value.get("members")
    if not (
        isinstance(members, dict) and members and all(isinstance(a, str) for a in members.values())
    ):
        raise ValueError(f"{source} holds no members")
    return dict(members)


def settle_first_configuration(
    files: Files,
    data_dir: str,
    members: Mapping[str, str],
    *,
    holds_raft_state: bool,
) -> dict[str, str]:
    """The members (name -> Raft address, this node included) the node starting on
    `data_dir` runs with: `members` recorded, or checked against the record (the rule
    of the module's docstring). `holds_raft_state`: the directory holds a journal meta
    file or a snapshot. `PeersChangedError` or `JournalDamagedError` if it must not
    start; `OSError` if the record cannot be written."""
    path = os.path.join(data_dir, FILE_NAME)
    given = dict(members)
    data = files.read(path)
    if data is not None:
        try:
            recorded = decode_first_configuration(data, path)
        except ValueError as e:
            raise JournalDamagedError(
                f"{e}: the node refuses to start, not knowing the members it counts votes "
                "over before its first snapshot. Restore the file; or, knowing the peers "
                f"this node was first started with, remove {path} and start it with exactly "
                "those; or remove the node from the cluster, move its data directory away "
                "and add it again empty, at a new Raft address"
            ) from None
        if recorded == given:
            return recorded
        if holds_raft_state:
            raise PeersChangedError(_differs(data_dir, recorded, given))
        logger.info(
            "%s holds no Raft state yet: recording its first configuration %s again (was %s)",
            data_dir,
            _listed(given),
            _listed(recorded),
        )
    elif holds_raft_state:
        logger.warning(
            "%s holds Raft state but no record of its first configuration (a data directory "
            "from before the record): recording the members given, %s, as its first "
            "configuration; later starts must give the same",
            data_dir,
            _listed(given),
        )
    write_atomically(files, path, encode_first_configuration(given))
    return given


def _listed(members: Mapping[str, str]) -> str:
    return "{" + ", ".join(f"{n}={a}" for n, a in sorted(members.items())) + "}"


def _differs(data_dir: str, recorded: Mapping[str, str], given: Mapping[str, str]) -> str:
    """The refusal, one line: both member lists and what differs."""
    changes = [f"{n}={recorded[n]} missing" for n in sorted(recorded.keys() - given.keys())]
    changes += [f"{n}={given[n]} added" for n in sorted(given.keys() - recorded.keys())]
    changes += [
        f"{n} at {given[n]}, not {recorded[n]}"
        for n in sorted(recorded.keys() & given.keys())
        if recorded[n] != given[n]
    ]
    return (
        f"the data directory {data_dir} was first started with the members "
        f"{_listed(recorded)}, and --peer (with --id and --raft) now gives {_listed(given)} "
        f"({'; '.join(changes)}): start the node with the peers it was first started with "
        "(until its first snapshot it counts votes over them, as its log changed them; "
        "membership changes go through `quorumq members`)"
    )
