"""Three programs, each with a `quorumq.Node` inside: one log, local deliveries, through
a SIGKILL of the leader's program."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

import quorumq
from quorumq.ops.local_cluster import free_ports

from .embedded_program import TOKEN
from .helpers import wait_for

NAMES = ("A", "B", "C")
KEYS = 6
ROOT = Path(__file__).resolve().parent.parent


def _records(root: Path, name: str) -> list[list[Any]]:
    path = root / f"{name}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("]")]


@pytest.mark.slow
def test_three_programs_deliver_locally_in_order_through_a_sigkill_of_the_leaders(
    tmp_path: Path,
) -> None:
    """Every message is delivered, each by the node in the consuming program's own
    process; per key, each program's first deliveries come in offset order; the killed
    program's unacked messages come again to the others, and every one is settled."""
    raft_ports = free_ports(3)
    client_ports = free_ports(3)
    peers = {n: f"127.0.0.1:{p}" for n, p in zip(NAMES, raft_ports, strict=True)}
    # three Python processes, each a program with a node inside (`embedded_program`)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    programs: dict[str, subprocess.Popen[bytes]] = {}
    endpoints = [f"127.0.0.1:{p}" for p in client_ports]
    try:
        for name, port in zip(NAMES, client_ports, strict=True):
            command = [sys.executable, "-m", "tests.embedded_program", name, str(tmp_path)]
            command += [str(port), json.dumps(peers)]
            programs[name] = subprocess.Popen(command, cwd=ROOT, env=env)
        wait_for(
            lambda: all((tmp_path / f"{n}.ready").exists() for n in NAMES), "ready", timeout=60
        )
        with quorumq.connect(endpoints, TOKEN, timeout=30.0) as publisher:
            leader = publisher.status()["leader"]
            total = 600
            killed = threading.Event()

            def kill_the_leader() -> None:
                wait_for(lambda: len(_records(tmp_path, leader)) >= 40, "the leader consuming")
                programs[leader].kill()
                killed.set()

            killer = threading.Thread(target=kill_the_leader)
            killer.start()
            for i in range(total):
                publisher.publish("jobs", f"job {i}".encode(), key=f"k{i % KEYS}")
                time.sleep(0.004)
            killer.join()
            assert killed.is_set()
            survivors = [n for n in NAMES if n != leader]

            def settled() -> bool:
                stats = publisher.status()["queues"]["jobs"]
                return bool(stats["ready"] == 0 and stats["unacked"] == 0)

            wait_for(settled, "every message settled", timeout=60)
        records = {name: _records(tmp_path, name) for name in NAMES}
        delivered = {r[0] for rs in records.values() for r in rs}
        assert delivered == set(range(total))
        for name, rs in records.items():
            assert {r[2] for r in rs} <= {name}, f"{name} was handed another node's delivery"
            by_key: dict[str, list[int]] = defaultdict(list)
            for offset, key, _, redelivered in rs:
                if not redelivered:
                    by_key[key].append(offset)
            for key, offsets in by_key.items():
                assert offsets == sorted(offsets), f"{name}, key {key}: {offsets}"
        taken_over = {r[0] for n in survivors for r in records[n] if r[3]}
        assert taken_over, "the killed program held no message the others took over"
        assert len(records[leader]) >= 40
    finally:
        for program in programs.values():
            if program.poll() is None:
                program.terminate()  # a clean stop: the node leaves its block
        for program in programs.values():
            try:
                program.wait(timeout=20)
            except subprocess.TimeoutExpired:
                program.kill()
                program.wait(timeout=10)
    # the killed program by SIGKILL; the others stopped cleanly on SIGTERM (their nodes
    # left the block: Downs applied, leadership handed over, journal closed)
    assert {n: p.returncode for n, p in programs.items()} == {
        n: -9 if n == leader else 0 for n in NAMES
    }


def test_a_client_port_taken_before_the_node_binds_it_is_moved_at_the_first_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A port picked free can be taken before the node binds it (another connection's
    ephemeral port: a suite run once lost a test to it). The local cluster starts the
    node again on another client port instead of failing."""
    import socket

    from quorumq.ops import local_cluster

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    taken = holder.getsockname()[1]
    real = local_cluster.free_ports
    calls = []

    def first_one_taken(n: int) -> list[int]:
        calls.append(n)
        ports = real(n)
        return [taken, *ports[1:]] if len(calls) == 1 else ports

    monkeypatch.setattr(local_cluster, "free_ports", first_one_taken)
    try:
        with local_cluster.Cluster(1) as cluster:
            assert cluster.client_ports["A"] != taken
            client = cluster.client()
            client.declare("q")
            assert client.publish("q", b"x") == 0
            assert "Address already in use" in cluster.log_path("A").read_text()
    finally:
        holder.close()
