"""`quorumq status`'s node table notes a node close to its limits."""

from __future__ import annotations

from quorumq.ops.status_view import _near_limits


def test_a_node_near_its_file_limit_or_client_cap_has_a_note() -> None:
    assert (
        _near_limits({"files_open": 100, "files_limit": 256, "clients": 3, "max_clients": 64}) == []
    )
    assert _near_limits({"files_open": 230, "files_limit": 256}) == ["open files: 230 of 256"]
    assert _near_limits({"clients": 60, "max_clients": 64}) == ["clients: 60 of 64"]
    assert _near_limits({"files_open": None, "files_limit": 256}) == []
