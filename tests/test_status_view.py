"""`quorumq status`'s node table notes a node close to its limits."""

from __future__ import annotations

from quorumq.ops.status_view import ClusterReading, NodeReading, _near_limits, not_ready


def test_a_node_near_its_file_limit_or_client_cap_has_a_note() -> None:
    assert (
        _near_limits({"files_open": 100, "files_limit": 256, "clients": 3, "max_clients": 64}) == []
    )
    assert _near_limits({"files_open": 230, "files_limit": 256}) == ["open files: 230 of 256"]
    assert _near_limits({"clients": 60, "max_clients": 64}) == ["clients: 60 of 64"]
    assert _near_limits({"files_open": None, "files_limit": 256}) == []


def _status(node: str, *, leader: bool = False) -> dict[str, object]:
    return {
        "node": node,
        "is_leader": leader,
        "leader": "A",
        "term": 1,
        "commit_index": 5,
        "last_applied": 5,
        "clients": 1,
        "members": {"A": "10.0.0.1:7000", "B": "10.0.0.2:7000", "C": "10.0.0.3:7000"},
        "queues": {},
    }


def _rows(reading: object) -> list[list[str]]:
    """The printed nodes table's rows, cells split on blanks of two or more (so that a
    note stays one cell)."""
    import io
    import re

    from rich.console import Console

    from quorumq.ops.status_view import nodes_table

    out = io.StringIO()
    Console(file=out, width=200).print(nodes_table(reading))  # type: ignore[arg-type]
    lines = out.getvalue().splitlines()
    body = lines[next(i for i, line in enumerate(lines) if "───" in line) + 1 :]
    rows = []
    for line in body:
        if not line.strip():  # the table's end; its caption follows
            break
        rows.append(re.split(r"\s{2,}", line.strip()))
    return rows


def _read(
    answers: dict[str, str], down: dict[str, str], **options: object
) -> tuple[object, list[str]]:
    """A reading of endpoints that answer as `answers` (endpoint -> node; "A" leads)
    and of `down` ones (endpoint -> the error); and the endpoints asked."""
    from quorumq.ops.status_view import read_cluster

    asked: list[str] = []

    def status_of(endpoint: str) -> dict[str, object]:
        asked.append(endpoint)
        if endpoint in down:
            raise OSError(down[endpoint])
        return _status(answers[endpoint], leader=answers[endpoint] == "A")

    endpoints = [*answers, *down]
    return read_cluster(endpoints, status_of, (OSError,), **options), asked  # type: ignore[arg-type]


def test_a_node_that_does_not_answer_is_one_row_named_as_the_caller_knew_it() -> None:
    """Issue 31: a node of three down was two rows, "C not asked" and "? unreachable"."""
    answers = {"a:1": "A", "b:1": "B"}
    reading, _ = _read(answers, {"c:1": "connection refused"}, names={"c:1": "C"})
    rows = _rows(reading)
    assert [row[0] for row in rows] == ["A", "B", "C"], rows
    assert rows[2][1] == "unreachable" and rows[2][-2:] == ["c:1", "connection refused"]


def test_an_unknown_endpoint_that_does_not_answer_is_probably_the_member_on_its_host() -> None:
    """The members' Raft addresses suggest which node an unreachable endpoint is: the
    one member on its host, or, one endpoint and one member left over, that member. A
    guess, shown as one (a stale or mistyped endpoint is named so too: a hostile review
    found a healthy C shown as plainly unreachable behind a stale endpoint)."""
    answers = {"10.0.0.1:9000": "A", "10.0.0.2:9000": "B"}
    reading, _ = _read(answers, {"10.0.0.3:9000": "timed out"})
    rows = _rows(reading)
    assert [row[0] for row in rows] == ["A", "B", "C?"]
    assert rows[2][-1] == "C, if this is its endpoint: timed out"
    by_elimination, _ = _read({"a:1": "A", "b:1": "B"}, {"c:1": "timed out"})
    assert [row[0] for row in _rows(by_elimination)] == ["A", "B", "C?"]


def test_endpoints_that_cannot_be_told_apart_say_which_nodes_they_may_be() -> None:
    reading, _ = _read({"h:1": "A"}, {"h:2": "connection refused", "h:3": "timed out"})
    rows = _rows(reading)
    assert [row[0] for row in rows] == ["A", "?", "?"], rows  # not B and C "not asked" too
    assert rows[1][-1] == "one of B, C: connection refused"
    assert rows[2][-1] == "one of B, C: timed out"


def test_a_second_reading_does_not_ask_again_an_endpoint_that_did_not_answer() -> None:
    """Rates need a second reading: an unreachable node cost its connect timeout twice."""
    answers = {"a:1": "A", "b:1": "B"}
    first, asked = _read(answers, {"c:1": "timed out"})
    second, asked_again = _read(answers, {"c:1": "timed out"}, carry=first)
    assert sorted(asked) == ["a:1", "b:1", "c:1"]
    assert sorted(asked_again) == ["a:1", "b:1"]
    assert second.nodes[2] == first.nodes[2]  # type: ignore[attr-defined]


def test_the_nodes_table_says_what_its_columns_are_and_counts_other_clients_only() -> None:
    """Issue 31, read as a newcomer: every node showed "clients 1" with nothing
    connected (the status command's own connection), and nothing said what term,
    commit, applied or lag were."""
    reading, _ = _read({"a:1": "A", "b:1": "B", "c:1": "C"}, {})
    rows = _rows(reading)
    assert [row[6] for row in rows] == ["0", "0", "0"], rows

    import io

    from rich.console import Console

    from quorumq.ops.status_view import nodes_table

    out = io.StringIO()
    Console(file=out, width=200).print(nodes_table(reading))  # type: ignore[arg-type]
    for column in ("term:", "commit:", "applied:", "lag:", "clients:"):
        assert column in out.getvalue(), out.getvalue()


def test_with_no_queues_the_queues_table_says_how_to_make_one() -> None:
    import io

    from rich.console import Console

    from quorumq.ops.status_view import queues_table

    reading, _ = _read({"a:1": "A"}, {})
    out = io.StringIO()
    Console(file=out, width=200).print(queues_table(reading, None))  # type: ignore[arg-type]
    assert "no queues yet (quorumq declare NAME makes one)" in out.getvalue()


def _reading(**applied: tuple[int, int] | None) -> ClusterReading:
    """Node -> (commit, applied), or None for an endpoint that gave no status; A leads."""
    nodes = []
    for node, indexes in applied.items():
        if indexes is None:
            nodes.append(NodeReading(endpoint=f"{node}:1", error="connection refused"))
            continue
        status = {**_status(node, leader=node == "A")}
        status["commit_index"], status["last_applied"] = indexes
        nodes.append(NodeReading(endpoint=f"{node}:1", node=node, status=status))
    return ClusterReading(taken_at=0.0, nodes=tuple(nodes))


def test_a_cluster_is_ready_once_every_node_answers_one_leads_and_none_lags() -> None:
    """`quorumq status --wait`: what a script that starts nodes waits for. Under load the
    leader's commit moves on, so a node is caught up once it has applied what the
    leader had committed at the reading before."""
    first = _reading(A=(10, 10), B=(10, 10), C=(8, 8))
    assert not_ready(first, None) == "waiting for a second reading"
    assert not_ready(_reading(A=(12, 12), B=(12, 11), C=(9, 9)), first) == (
        "C still catching up with the leader"
    )
    assert not_ready(_reading(A=(14, 14), B=(12, 12), C=(10, 10)), first) is None
    assert not_ready(_reading(A=(14, 14), B=(12, 12), C=None), first) == "no status from C:1"
    no_leader = _reading(B=(10, 10), C=(10, 10))
    assert not_ready(no_leader, no_leader) == "no node leads yet"


def test_a_node_of_another_cluster_or_knowing_one_its_leader_does_not_has_a_note() -> None:
    from quorumq.ops.status_view import identity_note

    leader = {**_status("A", leader=True), "cluster": "9f2c" * 8}
    assert identity_note({**_status("B"), "cluster": "9f2c" * 8}, leader) is None
    assert identity_note({**_status("B"), "cluster": None}, leader) is None  # learning
    assert identity_note({**_status("B"), "cluster": "41d7" * 8}, leader) == (
        "of another cluster (41d741d7, the leader's 9f2c9f2c)"
    )
    unknowing = {**_status("A", leader=True), "cluster": None}
    assert identity_note({**_status("B"), "cluster": "41d7" * 8}, unknowing) == (
        "knows cluster 41d741d7, the leader none"
    )
    older = _status("A", leader=True)  # a version without the identity says nothing
    assert identity_note({**_status("B"), "cluster": "41d7" * 8}, older) is None
    assert identity_note(leader, leader) is None
    assert identity_note({**_status("B"), "cluster": "41d7" * 8}, None) is None


def test_a_node_on_the_write_ahead_log_says_so_with_its_size() -> None:
    from quorumq.ops.status_view import read_cluster

    def status_of(endpoint: str) -> dict[str, object]:
        status = _status(endpoint, leader=endpoint == "A")
        if endpoint == "B":
            status["journal"] = {"kind": "wal", "entries": 9, "segments": 3, "bytes": 5 << 20}
        else:
            status["journal"] = {"kind": "file", "entries": 9, "bytes": 1 << 20}
        return status

    reading = read_cluster(["A", "B"], status_of, (OSError,))
    notes = {row[0]: row[-1] for row in _rows(reading)}
    assert notes["B"].endswith("journal: write-ahead log, 3 segment(s), 5.0 MiB"), notes
    assert "journal" not in notes["A"], notes


def test_a_node_with_many_groups_says_which_it_leads_and_its_most_lagging() -> None:
    from quorumq.ops.status_view import read_cluster

    def status_of(endpoint: str) -> dict[str, object]:
        status = _status(endpoint, leader=endpoint == "A")
        status["groups"] = [
            {
                "group": g,
                "role": "leader" if "ABC"[g] == endpoint else "follower",
                "commit_index": 10 * (g + 1),
                "last_applied": 10 * (g + 1) - (7 if (endpoint, g) == ("C", 1) else 0),
            }
            for g in range(3)
        ]
        return status

    reading = read_cluster(["A", "B", "C"], status_of, (OSError,))
    notes = {row[0]: row[-1] for row in _rows(reading)}
    assert notes["A"] == "3 Raft groups, leads 0", notes
    assert notes["C"] == "3 Raft groups, leads 2; group 1 lags 7", notes
