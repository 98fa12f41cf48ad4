"""A cluster's identity (`ClusterIdentity`): which history a node's log belongs to.

Raft compares logs by (index, term) alone. Nodes started empty beside one node restored
from a backup elect a leader of their own, number their terms from the start again, and
build a second history whose (index, term) pairs look like the first's (the first
leader's no-op is entry 2 of term 1 in both): depending on which log was longer, the
restored node refused the new leader's entries at every message, or appended them after
its own old ones and diverged in silence (both seen with real processes). Two checks
tell the histories apart.

* **Log matching, checked.** Within one history two entries of the same index and term
  are the same entry (one leader per term, one entry per index). A node that holds an
  entry of the same index and term as one a peer sends or names, with other bytes,
  drops the peer's message: the entries of an AppendEntries, the entry it attaches to
  (`PREV_CRC`: the CRC-32 of the leader's entry at `prevLogIdx`), and the identity entry
  every message names (below).
* **An identity, drawn once.** A new leader that knows no identity, holds no identity
  entry and whose log starts at the first index (it sees the whole history) writes 16
  random bytes, as hex, into the no-op PySyncObj appends as the first entry of every
  term (`identity_no_op`): an earlier version applies it as the no-op it is, it costs
  no entry of its own, and it commits with the term's first commit. A log never holds
  two: a leader whose log holds one draws none, and a leader whose log was compacted
  may not know whether the history had one before (a node of an earlier version
  compacts it away unread), so it draws none either.
* **Known once applied.** A node knows the identity of the first identity entry it
  applies, and keeps it in `cluster-identity` in its data directory (atomically and
  durably, before it goes on). A node that knows none takes the one its current leader
  says it knows, in an AppendEntries of the current term (a node added empty, or whose
  snapshot install skipped the entry).
* **In every message**: `CLUSTER`, the identity the sender knows (or ""), and
  `IDENTITY_ENTRY`, the identity entry its log holds (index, term, identity), if any. A
  node that knows an identity drops every message that says it knows another; and an
  AppendEntries whose leader's log holds another's identity entry, or that carries one
  (a leader's log holds every committed entry, so the identity entry this node applied
  is the one in its leader's log). A message without the keys comes from an earlier
  version and is read as before.
* **A peer of another history is not heard** for `FOREIGN_WINDOW_S` after it showed it:
  a restored leader whose colliding AppendEntries are dropped would otherwise hold its
  followers with heartbeats that name no entry they hold, and nobody would elect.
* **The odd one out stops.** A node that heard so many of its configuration's other
  members of another history (each within `FOREIGN_WINDOW_S`) that no majority can form
  without them stops with `ForeignClusterError`, saying what to do; the others only
  drop its messages, so a cluster goes on beside a wrongly restored node, its terms not
  raised by the restored node's campaigns.

What it does not catch: a leader that knows no identity and whose log shares no entry
of the same index and term with a follower's (data from before the identity, or a
cluster that compacted its logs before it was upgraded: it draws none) sends that
follower its snapshot, and the follower takes it even if it knows an identity (a
snapshot from a leader that knows none is what a follower that knew the identity
needs after a rolling upgrade: refusing it left such a node behind for good, and a
live majority without a leader); and two histories that attach at an entry of the
same bytes in both (a plain no-op). There Raft's own rule decides, by log length and
term, which whole history the nodes keep; none mixes the two. A cluster upgraded after
its first compaction (50,000 entries by default) has no identity: only the
log-matching checks guard it.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import zlib
from typing import Any, TypeGuard

import pysyncobj.syncobj as _syncobj

from .base import CLUSTER, IDENTITY_ENTRY, PREV_CRC, Entry, RaftFields
from .files import Files, decode_record, encode_record, write_atomically
from .journal import NO_OP_PREFIX, JournalDamagedError, JournalFailedError

logger = logging.getLogger(__name__)

FILE_NAME = "cluster-identity"
_MAGIC = b"QQI1"
_FORMAT = "quorumq-cluster-identity"
_VERSION = 1

_ENTRY_MARK = NO_OP_PREFIX + b"QQID"
FOREIGN_WINDOW_S = 10.0
"""A peer counts as of another history for this long after it last showed it."""

_IDENTITY = re.compile(r"[0-9a-f]{32}")
FOREIGN_STOP = "this node's data belongs to"
"""How `ForeignClusterError`'s message begins."""


class ForeignClusterError(JournalDamagedError):
    """This node's data belongs to another history than its peers': it must stop."""


def valid_identity(value: Any) -> TypeGuard[str]:
    return type(value) is str and _IDENTITY.fullmatch(value) is not None


def identity_no_op(identity: str) -> bytes:
    """The log entry's command that carries `identity`."""
    return _ENTRY_MARK + identity.encode("ascii")


def identity_in(command: bytes) -> str | None:
    """The identity an entry's command carries, if it is an identity entry."""
    if len(command) != len(_ENTRY_MARK) + 32 or not command.startswith(_ENTRY_MARK):
        return None
    identity = command[len(_ENTRY_MARK) :].decode("ascii", "replace")
    return identity if valid_identity(identity) else None


def encode_identity(identity: str) -> bytes:
    return encode_record(_MAGIC, {"format": _FORMAT, "version": _VERSION, "identity": identity})


def decode_identity(data: bytes, source: str) -> str:
    """The identity `encode_identity` wrote; `ValueError` naming `source` otherwise."""
    value = decode_record(data, source, _MAGIC, _FORMAT, "a quorumq cluster identity")
    identity = value.get("identity")
    if value.get("version") != _VERSION or not valid_identity(identity):
        raise ValueError(f"{source} is not a quorumq cluster identity of version {_VERSION}")
    return identity


def load_identity(files: Files, data_dir: str) -> str | None:
    """The identity kept in `data_dir`, None if it holds none yet."""
    path = os.path.join(data_dir, FILE_NAME)
    data = files.read(path)
    if data is None:
        return None
    try:
        return decode_identity(data, path)
    except ValueError as e:
        raise JournalDamagedError(
            f"{e}: the node refuses to start, not knowing which cluster its data belongs "
            f"to. Restore the file; or remove it, and the node learns the identity again "
            f"from its leader (but cannot tell a leader of another cluster until then)"
        ) from None


class ClusterIdentity(RaftFields):
    """The rules of the module's docstring, a part of `RaftRules`. A member calls
    `keep_identity_in` before PySyncObj's `__init__`, and `announce_identity` after."""

    cluster_identity: str | None = None
    """The identity this node knows (None: none yet)."""
    _identity_store: tuple[Files, str] | None = None
    _foreign_error: ForeignClusterError | None = None
    """Set once no majority can form without peers of another history: the next tick
    raises it, and the member stops."""
    _crc_of: tuple[bytes | None, int] = (None, 0)
    _stamped_entry: tuple[Any, list[Any] | None] = (None, None)
    """(the journal's identity entry, what messages say of it), kept from message to
    message."""

    @property
    def _foreign_peers(self) -> dict[Any, tuple[str, float]]:
        """Peers of another history: (its identity, or "", when last shown)."""
        peers: dict[Any, tuple[str, float]] | None = self.__dict__.get("_foreign_peers_")
        if peers is None:
            peers = self.__dict__["_foreign_peers_"] = {}
        return peers

    def keep_identity_in(self, files: Files, data_dir: str) -> None:
        """Read the identity kept in `data_dir` (a member's first step), and keep the
        one it learns there."""
        self._identity_store = (files, data_dir)
        self.cluster_identity = load_identity(files, data_dir)

    def announce_identity(self) -> None:
        """Have the transport stamp every message it sends (`stamp_identity`)."""
        self._SyncObj__transport.announce = self.stamp_identity

    def stamp_identity(self, message: dict[str, Any]) -> None:
        """What every message says: the identity known, the identity entry held."""
        message[CLUSTER] = self.cluster_identity or ""
        carried: Entry | None = getattr(self._SyncObj__raftLog, "carrying_no_op", None)
        held, said = self._stamped_entry
        if carried is not held:
            said = None
            if carried is not None:
                identity = identity_in(carried[0])
                if identity is not None:
                    said = [carried[1], carried[2], identity]
            self._stamped_entry = (carried, said)
        if said is not None:
            message[IDENTITY_ENTRY] = said
        if "prevLogIdx" in message and message.get("type") == "append_entries":
            held = self._held(message["prevLogIdx"], message.get("prevLogTerm"))
            if held is not None:
                message[PREV_CRC] = self._crc(held)

    def _crc(self, command: bytes) -> int:
        """The CRC-32 of `command`, an entry's, kept for the same entry (a leader names
        one entry to a follower at every heartbeat; a follower is named its last)."""
        cached, crc = self._crc_of
        if cached is not command:
            crc = zlib.crc32(command)
            self._crc_of = (command, crc)
        return crc

    def new_cluster_identity(self) -> str:
        """A fresh identity (the simulator draws it from its world's randomness)."""
        return secrets.token_hex(16)

    # ------------------------------------------------------------------ learning

    def _learn_identity(self, identity: str, how: str) -> None:
        store = self._identity_store
        if store is not None:
            files, data_dir = store
            path = os.path.join(data_dir, FILE_NAME)
            try:
                write_atomically(files, path, encode_identity(identity))
            except OSError as e:
                raise JournalFailedError(f"cannot keep the cluster identity: {e}") from e
        self.cluster_identity = identity
        self._foreign_peers.clear()  # judged without an identity until now
        logger.info("this node belongs to cluster %s (%s)", identity, how)

    def _applied_no_op(self, command: bytes) -> None:
        """An applied no-op: the first identity entry names the cluster."""
        if self.cluster_identity is None:
            identity = identity_in(command)
            if identity is not None:
                self._learn_identity(identity, "applied from the log")

    def _SyncObj__onBecomeLeader(self) -> None:
        """A new leader that knows no identity, holds no identity entry and sees the whole
        history (its log starts at the first index) writes a fresh one into the no-op it
        appends, PySyncObj's first entry of every term."""
        log = self._SyncObj__raftLog
        if (
            self.cluster_identity is None
            and getattr(log, "carrying_no_op", True) is None
            and len(log)
            and log[0][1] == 1
        ):
            log.next_no_op = identity_no_op(self.new_cluster_identity())
        try:
            super()._SyncObj__onBecomeLeader()
        finally:
            if hasattr(log, "next_no_op"):
                log.next_no_op = None

    # ----------------------------------------------------------------- checking

    def _SyncObj__onMessageReceived(self, node: Any, message: Any) -> None:
        if type(message) is not dict:
            super()._SyncObj__onMessageReceived(node, message)
            return
        if self._foreign(node, message):
            return
        if self.cluster_identity is not None:
            super()._SyncObj__onMessageReceived(node, message)
            return
        applied = self.raftLastApplied
        super()._SyncObj__onMessageReceived(node, message)
        if (
            self.cluster_identity is None
            and message.get("type") == "append_entries"
            and message.get("term") == self.raftCurrentTerm
            and node == self._SyncObj__raftLeader
            and self._took(message, applied)
        ):
            said = message.get(CLUSTER)
            if valid_identity(said):
                self._learn_identity(said, f"as its leader {node} says")

    def _took(self, message: dict[str, Any], applied: int) -> bool:
        """Whether this node took the leader's AppendEntries: its log holds the entry the
        message ends at, or the snapshot it carried was installed (a refused one, or a
        node refusing to cut what it committed, learns nothing from it)."""
        if "serialized" in message:
            return bool(self.raftLastApplied != applied)
        entries = message.get("entries") or ()
        last = entries[-1] if entries else None
        if last is not None:
            return self._held(last[1], last[2]) is not None
        return self._held(message.get("prevLogIdx"), message.get("prevLogTerm")) is not None

    def _held(self, index: Any, term: Any) -> bytes | None:
        """The command of this log's entry of `index` and `term`, if it holds one."""
        log = self._SyncObj__raftLog
        if type(index) is not int or not len(log):
            return None
        pos = index - log[0][1]
        if 0 <= pos < len(log) and log[pos][2] == term:
            command: bytes = log[pos][0]
            return command
        return None

    def _foreign(self, node: Any, message: dict[str, Any]) -> bool:
        """Whether `message` comes from another history (dropped unread). A peer found of
        another history is not heard at all for `FOREIGN_WINDOW_S`: a restored leader
        whose colliding AppendEntries are dropped would otherwise hold its followers with
        the heartbeats that name no entry they hold, and nobody would elect."""
        peers = self.__dict__.get("_foreign_peers_")
        if peers:
            seen = peers.get(node)
            if seen is not None and _syncobj.monotonicTime() - seen[1] <= FOREIGN_WINDOW_S:
                return True
        known = self.cluster_identity
        append = message.get("type") == "append_entries"
        said = message.get(CLUSTER)
        if said != known and known is not None and valid_identity(said):
            return self._heard_foreign(node, said, "it knows another identity")
        entry = message.get(IDENTITY_ENTRY)
        if entry is None or (entry == self._stamped_entry[1] and entry[2] == known):
            pass  # none named, or the very entry this node names, of the identity it knows
        elif type(entry) is list and len(entry) == 3 and valid_identity(entry[2]):
            index, term, theirs = entry
            held = self._held(index, term)
            if held is not None and held != identity_no_op(theirs):
                return self._heard_foreign(node, theirs, f"its entry {index} differs")
            if append and known is not None and theirs != known:
                return self._heard_foreign(node, theirs, "its leader's log holds another")
        if append:
            crc = message.get(PREV_CRC)
            if type(crc) is int:
                held = self._held(message.get("prevLogIdx"), message.get("prevLogTerm"))
                if held is not None and self._crc(held) != crc:
                    index = message.get("prevLogIdx")
                    return self._heard_foreign(node, "", f"its entry {index} differs")
            log = self._SyncObj__raftLog
            last = log[-1][1] if len(log) else 0
            entries: Any = message.get("entries")
            for entry in entries if type(entries) in (list, tuple) else ():
                if type(entry) not in (tuple, list) or len(entry) != 3:
                    break  # (not an entry: PySyncObj's own handling judges the message)
                command, index, term = entry
                if type(index) is not int or index > last:
                    break  # (in order: the rest are new to this log)
                held = self._held(index, term)
                if held is not None and held != command:
                    return self._heard_foreign(node, "", f"its entry {index} differs")
        return False

    def _heard_foreign(self, node: Any, theirs: str, why: str) -> bool:
        now = _syncobj.monotonicTime()
        if node not in self._foreign_peers:
            logger.error(
                "%s is of another history than this node's (%s; it says cluster %s, this "
                "node knows %s): its messages are dropped (a node restored from a backup "
                "beside nodes started empty, or a data directory of another cluster)",
                node,
                why,
                theirs or "unknown",
                self.cluster_identity or "none",
            )
        self._foreign_peers[node] = (theirs, now)
        self._judge_foreign(now)
        return True

    def _judge_foreign(self, now: float) -> None:
        others = self._SyncObj__otherNodes
        recent = {
            node: identity
            for node, (identity, at) in self._foreign_peers.items()
            if node in others and now - at <= FOREIGN_WINDOW_S
        }
        majority = (len(others) + 1) // 2 + 1
        if len(others) - len(recent) + 1 >= majority or self._foreign_error is not None:
            return  # a majority could still form without them
        names = ", ".join(sorted(str(n) for n in recent))
        theirs = ", ".join(sorted({i for i in recent.values() if i})) or "unknown"
        known = self.cluster_identity
        mine = f"cluster {known}" if known else "a history of no known identity"
        self._foreign_error = ForeignClusterError(
            f"{FOREIGN_STOP} {mine}, but a majority of its peers ({names}) hold another "
            f"(cluster {theirs}; their logs and this node's differ at an entry of the same "
            f"index and term): it was restored from a backup beside nodes that started "
            f"empty, or its data directory is another cluster's. It stops rather than mix "
            f"the two. To join their cluster, move its data directory away and start it "
            f"again empty: it catches up from their leader"
        )
        self.tick_soon()

    def _onTick(self, timeToWait: float = 0.0) -> None:
        if self._foreign_error is not None:
            raise self._foreign_error
        super()._onTick(timeToWait)
