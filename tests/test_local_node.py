"""`quorumq.Node`: a node inside the test's own process, its in-process clients, its
optional client port, its stop (threads, files, leadership) and its restart."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

import quorumq
import quorumq.aio
from quorumq.client import ServerError
from quorumq.ops.local_cluster import free_ports
from quorumq.replica import ConfigError

from .helpers import wait_for


def _settings(root: Path, name: str = "A", **more: Any) -> dict[str, Any]:
    (raft,) = free_ports(1)
    return {
        "id": name,
        "data_dir": root / name,
        "raft": f"127.0.0.1:{raft}",
        "peers": {},
        "secret": None,
        "insecure": True,
        "election_timeout_s": (0.1, 0.2),
        **more,
    }


def _open_files() -> dict[str, str]:
    files = {}
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(FileNotFoundError):  # the listing's own, gone already
            files[fd] = os.readlink(f"/proc/self/fd/{fd}")
    return files


@pytest.fixture
def node(tmp_path: Path) -> Iterator[quorumq.Node]:
    with quorumq.Node(**_settings(tmp_path)) as node:
        yield node


def test_a_node_in_this_process_serves_its_clients_without_a_socket(node: quorumq.Node) -> None:
    client = node.client()
    client.declare("jobs")
    consumer = client.subscribe("jobs", prefetch=10)
    offsets = [client.publish("jobs", f"job {i}".encode(), key="k") for i in range(3)]
    deliveries = [consumer.get(5) for _ in offsets]
    assert [(d.offset, d.body, d.node) for d in deliveries if d] == [
        (0, b"job 0", "A"),
        (1, b"job 1", "A"),
        (2, b"job 2", "A"),
    ]
    for d in deliveries:
        assert d is not None
        d.ack()
    assert [m.body for m in client.read("jobs", 0, 3)] == [b"job 0", b"job 1", b"job 2"]
    assert node.address is None  # no client port
    assert [conn.local for conn in node.server.connections] == [True]


def test_a_delivery_handed_over_in_process_is_the_clients_own_copy(node: quorumq.Node) -> None:
    """Changing a delivery's headers in the program changes nothing in the replica."""
    client = node.client()
    client.declare("q")
    consumer = client.subscribe("q", prefetch=1)
    client.publish("q", b"m", headers={"trace": "t-1"})
    delivery = consumer.get(5)
    assert delivery is not None and delivery.headers == {"trace": "t-1"}
    delivery.headers["trace"] = "changed"  # type: ignore[index]
    (stored,) = client.read("q", 0, 1)
    assert stored.headers == {"trace": "t-1"}


def test_leaving_the_block_leaves_no_thread_and_no_open_file_behind(tmp_path: Path) -> None:
    """The Raft thread, the node's trio thread, the start-up and stop threads and the
    clients' threads have all ended; the journal, the Raft and client sockets, the lock
    of the data directory and trio's own descriptors are all closed."""
    threads = set(threading.enumerate())
    tasks = set(os.listdir("/proc/self/task"))  # what the kernel runs, Python threads or not
    files = _open_files()
    settings = _settings(tmp_path, listen="127.0.0.1:0")
    with quorumq.Node(**settings) as node:
        client = node.client()
        client.declare("q")
        consumer = client.subscribe("q", prefetch=5)
        client.publish("q", b"held")  # delivered, never acked
        assert consumer.get(5) is not None
        assert node.address is not None
        with quorumq.connect(node.address) as remote:
            remote.publish("q", b"from another program")
        assert len(set(threading.enumerate()) - threads) >= 3
    assert set(threading.enumerate()) - threads == set()
    # (a joined thread's last instructions may still run: its kernel task ends a moment later)
    wait_for(lambda: not set(os.listdir("/proc/self/task")) - tasks, "no task left", timeout=2)
    assert {fd: path for fd, path in _open_files().items() if fd not in files} == {}


def test_a_start_that_fails_on_a_taken_raft_port_leaves_no_open_file_behind(
    tmp_path: Path,
) -> None:
    """PySyncObj left the socket it failed to bind open, in a reference cycle: each
    failed start kept one descriptor until the garbage collector ran."""
    import gc
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        files = _open_files()
        gc.disable()
        try:
            for attempt in range(2):
                settings = _settings(tmp_path / str(attempt), raft=f"127.0.0.1:{port}")
                with pytest.raises(OSError, match="cannot listen for Raft traffic"):
                    quorumq.Node(**settings).start()
            assert {fd: path for fd, path in _open_files().items() if fd not in files} == {}
        finally:
            gc.enable()


def test_a_node_started_again_on_its_data_dir_recovers(tmp_path: Path) -> None:
    """As a node process does: the messages are there, and one held unacked at the stop
    is delivered again."""
    settings = _settings(tmp_path)
    with quorumq.Node(**settings) as node:
        client = node.client()
        client.declare("q")
        consumer = client.subscribe("q", prefetch=1)
        for body in (b"one", b"two"):
            client.publish("q", body)
        first = consumer.get(5)
        assert first is not None and first.body == b"one"  # held at the stop
    with quorumq.Node(**settings) as node:
        client = node.client()
        assert [m.body for m in client.read("q", 0, 2)] == [b"one", b"two"]
        consumer = client.subscribe("q", prefetch=5)
        again = [consumer.get(5) for _ in range(2)]
        assert [(d.body, d.redelivered) for d in again if d] == [(b"one", True), (b"two", False)]


def test_a_data_dir_serves_one_node_at_a_time(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    with quorumq.Node(**settings):
        other = {**settings, "raft": f"127.0.0.1:{free_ports(1)[0]}"}
        with pytest.raises(ConfigError, match="in use by another quorumq node"):
            quorumq.Node(**other).start()


def test_the_client_port_asks_the_token_of_a_node_process(tmp_path: Path) -> None:
    """Clients in the process are trusted; clients on `listen=` prove the token, and a
    node cannot listen off loopback, or without a token, unless told it is insecure."""
    with pytest.raises(ConfigError, match="client token is required"):
        quorumq.Node(**_settings(tmp_path, listen="127.0.0.1:0", insecure=False, secret="s"))
    settings = _settings(tmp_path, listen="127.0.0.1:0", token="t0ken", secret="s3cret")
    settings["insecure"] = False
    with quorumq.Node(**settings) as node:
        node.client().declare("q")  # no token in the process
        assert node.address is not None
        with pytest.raises(ServerError, match="auth_failed"):
            quorumq.connect(node.address, connect_timeout=2.0)
        with pytest.raises(ServerError, match="auth_failed"):
            quorumq.connect(node.address, "wrong", connect_timeout=2.0)
        with quorumq.connect(node.address, "t0ken") as remote:
            assert remote.publish("q", b"m") == 0


def test_a_client_stuck_in_a_callback_is_cut_off_and_the_node_serves_on(tmp_path: Path) -> None:
    """A program's callback that blocks holds up its own client's reader, never the
    node: the deliveries it does not take fill its in-process connection, then its
    outbox, and the node cuts it off as a slow consumer, as over TCP, while serving
    the others as before. (A callback that raises is logged by `Future`: nothing more.)"""
    settings = _settings(tmp_path, max_body=64 * 1024, outbound_bytes=4 * 832 * 1024)
    release = threading.Event()
    with quorumq.Node(**settings) as node:
        stuck = node.client(timeout=60.0)
        stuck.declare("q")
        consumer = stuck.subscribe("q", prefetch=1000)

        def raise_error(_: Any) -> None:
            raise RuntimeError("a callback that fails")

        stuck.publish_async("q", b"first").add_done_callback(raise_error)
        assert consumer.get(5) is not None  # the client goes on after it
        stuck.publish_async("q", b"second").add_done_callback(lambda _: release.wait(60))
        other = node.client()
        body = b"x" * 60_000
        started = time.monotonic()
        for _ in range(150):  # 9 MB of deliveries for the stuck consumer
            other.publish("q", body)
        assert time.monotonic() - started < 30
        wait_for(lambda: len(node.server.connections) == 1, "the stuck client cut off")
        slowest = max(_timed(lambda: other.publish("q", b"after")) for _ in range(20))
        assert slowest < 1.0
        assert node.server.replica.member._engine.alive()
        release.set()


def _timed(call: Any) -> float:
    started = time.monotonic()
    call()
    return time.monotonic() - started


def _leader(nodes: list[quorumq.Node]) -> str | None:
    leaders = {n.status()["leader"] for n in nodes if n.running}
    return leaders.pop() if len(leaders) == 1 else None


def test_a_leader_leaving_the_block_hands_leadership_over(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A leader that stops hands leadership over before it goes (the others need not
    notice it gone, nor wait out an election), and its consumers' messages go to the
    others' consumers at once (their `Down`s applied before the stop)."""
    caplog.set_level(logging.INFO, logger="quorumq.server.node")
    rafts = [f"127.0.0.1:{port}" for port in free_ports(3)]
    names = ["A", "B", "C"]
    peers = dict(zip(names, rafts, strict=True))
    nodes = [
        quorumq.Node(
            id=name,
            data_dir=tmp_path / name,
            raft=peers[name],
            peers=peers,
            secret="s3cret",
            election_timeout_s=(1.5, 2.0),
        )
        for name in names
    ]
    try:
        for n in nodes:
            n.start()
        wait_for(lambda: _leader(nodes) is not None, "a leader", timeout=30)
        leader = next(n for n in nodes if n.id == _leader(nodes))
        rest = [n for n in nodes if n is not leader]
        client = leader.client()
        client.declare("q")
        held = client.subscribe("q", prefetch=1)
        client.publish("q", b"held by the leader's consumer")
        assert held.get(5) is not None
        other = rest[0].client().subscribe("q", prefetch=1)
        stopping = time.monotonic()
        leader.stop()
        # bounded (its settle and handover waits are 2 s and 3 s; a loaded CI adds to them)
        assert time.monotonic() - stopping < 10.0
        handed = [r for r in caplog.records if r.getMessage().startswith("handed leadership over")]
        assert len(handed) == 1 and handed[0].threadName == f"quorumq-node-{leader.id}"
        wait_for(lambda: _leader(rest) not in (None, leader.id), "a new leader", timeout=10)
        delivery = other.get(1)  # at once: no grace period for the stopped node
        assert delivery is not None and delivery.redelivered
    finally:
        for n in nodes:
            n.stop()


def _script(consumer: Any, count: int) -> list[tuple[Any, ...]]:
    """Take `count` first deliveries (and the redeliveries they cause): every third one
    is given back once (requeued), the rest acked; what came, as the client saw it."""
    seen: list[tuple[Any, ...]] = []
    given_back: set[int] = set()
    while len({s[0] for s in seen}) < count or len(given_back) > sum(s[5] for s in seen):
        d = consumer.get(10)
        assert d is not None, f"only {seen}"
        seen.append((d.offset, d.key, d.body, d.headers, d.delivery_count, d.redelivered))
        if d.offset % 3 == 0 and d.offset not in given_back:
            given_back.add(d.offset)
            d.nack(requeue=True)
        else:
            d.ack()
    return seen


def test_the_in_process_and_the_tcp_path_deliver_the_same_sequence(tmp_path: Path) -> None:
    """One node, one log: the same publishes to two queues, one consumed in the process,
    the other over TCP by the same script of acks and requeues, give the same deliveries
    (offsets, keys, bodies, headers, delivery counts, redelivered flags), and `read`
    gives the same rows both ways. The bodies and headers cover what an encoding could
    change: empty, binary, non-ASCII, and a body near the size limit."""
    messages: list[tuple[bytes, str | None, dict[str, str] | None]] = [
        (b"", None, None),
        (bytes(range(256)), "k\u00e9y", {"h\u00e9": "v\u00e0l", "": ""}),
        (b"x" * (256 * 1024 - 100), "big", {"n": "1"}),
        *((f"m{i}".encode(), f"k{i % 4}", {"i": str(i)} if i % 2 else None) for i in range(40)),
    ]
    settings = _settings(tmp_path, listen="127.0.0.1:0", max_body=256 * 1024, fsync="never")
    with quorumq.Node(**settings) as node:
        local = node.client()
        assert node.address is not None
        with quorumq.connect(node.address) as remote:
            for queue in ("local", "remote"):
                local.declare(queue)
            for body, key, headers in messages:
                for queue in ("local", "remote"):
                    local.publish(queue, body, key=key, headers=headers)
            # (prefetch 1: which message comes next does not depend on when a settle lands)
            in_process = _script(local.subscribe("local", prefetch=1), len(messages))
            over_tcp = _script(remote.subscribe("remote", prefetch=1), len(messages))
            assert in_process == over_tcp
            assert sum(1 for s in in_process if s[5]) == len(range(0, len(messages), 3))
            rows_local = local.read("local", 0, len(messages)).rows
            rows_tcp = remote.read("local", 0, len(messages)).rows
            assert rows_local == rows_tcp and len(rows_local) == len(messages)


def test_a_node_in_a_trio_program_serves_in_the_programs_own_loop(tmp_path: Path) -> None:
    """`quorumq.aio.Node`: the server's tasks run in the caller's trio loop (the only
    thread it adds is the Raft member's), its trio clients talk to it in-process, and
    it leaves nothing behind either."""
    threads = set(threading.enumerate())
    files = _open_files()

    async def main() -> None:
        async with quorumq.aio.Node(**_settings(tmp_path, listen="127.0.0.1:0")) as node:
            added = set(threading.enumerate()) - threads
            assert [t.name.split("-")[0] for t in added] == ["raft"]
            async with node.client() as client:
                await client.declare("q")
                consumer = await client.subscribe("q", prefetch=5)
                assert await client.publish("q", b"m", key="k", headers={"h": "v"}) == 0
                with trio.fail_after(5):
                    delivery = await consumer.get()
                assert delivery is not None
                assert (delivery.body, delivery.key, delivery.node) == (b"m", "k", "A")
                await delivery.ack()
                assert [conn.local for conn in node.server.connections] == [True]
            assert node.address is not None
            async with quorumq.aio.connect(node.address) as remote:
                assert (await remote.read("q", 0, 1)).rows[0][2] == b"m"

    trio.run(main)
    assert set(threading.enumerate()) - threads == set()
    assert {fd: path for fd, path in _open_files().items() if fd not in files} == {}


def test_an_error_inside_a_trio_nodes_block_comes_out_as_itself(tmp_path: Path) -> None:
    """As from `quorumq.aio.connect` (issue 31): the node's nursery wrapped an exception
    raised in `async with quorumq.aio.Node(...)`, the caller's own or a request's
    `ServerError`, in an `ExceptionGroup`, so `except ServerError` missed it."""
    from quorumq.client import ServerError

    async def refused() -> None:
        async with (
            quorumq.aio.Node(**_settings(tmp_path / "a")) as node,
            node.client() as client,
        ):
            await client.declare("q", max_length=3)
            await client.declare("q", max_length=4)

    async def mine() -> None:
        async with quorumq.aio.Node(**_settings(tmp_path / "b")):
            raise ValueError("the caller's own")

    with pytest.raises(ServerError) as mismatch:
        trio.run(refused)
    assert mismatch.value.code == "options_mismatch"
    with pytest.raises(ValueError, match="the caller's own"):
        trio.run(mine)


def test_a_program_that_reaps_every_child_process_does_not_stop_its_node(tmp_path: Path) -> None:
    """The node writes snapshots in a forked child of the program's process; a program
    that reaps any child (`os.wait()`, a SIGCHLD handler) takes it first. The node
    serves on, and compacts its log all the same (once, a child reaped there failed
    every Raft tick, and the node stopped talking to anyone)."""
    reaped: list[int] = []
    reaping = threading.Event()
    reaping.set()

    def reap() -> None:
        while reaping.is_set():
            try:
                pid, _ = os.waitpid(-1, 0)  # woken as a child exits: before the node looks
            except ChildProcessError:
                time.sleep(0.001)
                continue
            reaped.append(pid)

    with quorumq.Node(**_settings(tmp_path, compaction_entries=30, fsync="never")) as node:
        client = node.client(timeout=5.0)
        client.declare("q")
        reaper = threading.Thread(target=reap)
        reaper.start()
        try:
            for i in range(5000):
                client.publish("q", f"m{i}".encode())
                if len(reaped) >= 2:
                    break
            assert len(reaped) >= 2, "no snapshot child to reap"
            assert client.publish("q", b"after") >= 0  # served on
            wait_for(lambda: node.status()["compaction_error"] is None, "a compaction")
        finally:
            reaping.clear()
            reaper.join()
        assert len(client.read("q", 0, 6000)) >= 31


def test_a_program_that_exits_without_stopping_its_node_stops_it_at_exit(tmp_path: Path) -> None:
    """No `with`, no `stop()`: the program's exit stops the node as leaving the block
    would (it neither waits for the node's threads for ever nor cuts them off): its
    consumer's `Down` is applied before the exit, so a node started again on its data
    finds no consumer holding the message (cut off, the consumer would hold it until
    the restarted node's sweep of lost consumers)."""
    import subprocess
    import sys

    settings = _settings(tmp_path)
    program = f"""
import quorumq
node = quorumq.Node(id="A", data_dir={str(settings["data_dir"])!r}, raft={settings["raft"]!r},
                    peers={{}}, secret=None, insecure=True)
client = node.start().client()
client.declare("kept")
consumer = client.subscribe("kept", prefetch=1)
client.publish("kept", b"held")
assert consumer.get(5) is not None
print("exiting", flush=True)
"""
    root = Path(__file__).resolve().parent.parent
    result = subprocess.run(
        [sys.executable, "-c", program],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert result.returncode == 0 and result.stdout == "exiting\n", result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    with quorumq.Node(**settings) as node:
        wait_for(lambda: "kept" in node.status()["queues"], "the log applied again")
        stats = node.status()["queues"]["kept"]  # (the sweep of lost consumers takes 1-2 s)
        assert (stats["consumers"], stats["unacked"], stats["ready"]) == (0, 0, 1)


def test_a_stop_while_the_node_starts_stops_it_once_started(tmp_path: Path) -> None:
    """stop() from a signal handler or another thread during start() joined a thread
    that then waited for ever (it had not yet set what stop() wakes)."""

    def start(node: quorumq.Node) -> None:
        with contextlib.suppress(RuntimeError):  # (stopped before it started: refused)
            node.start()

    for delay in [i * 0.0005 for i in range(16)]:  # (a start here takes about 5 ms)
        node = quorumq.Node(**_settings(tmp_path / f"d{delay}"))
        stopper = threading.Timer(delay, node.stop)
        stopper.daemon = True  # (red: these hang; the run must still end)
        stopper.start()
        starting = threading.Thread(target=start, args=(node,), daemon=True)
        starting.start()
        starting.join(10)
        stopper.join(10)
        assert not starting.is_alive() and not stopper.is_alive(), f"hung (stop after {delay} s)"
        node.stop()
        assert not node.running


def test_an_integer_a_frame_cannot_carry_fails_in_the_caller_as_over_tcp(
    node: quorumq.Node,
) -> None:
    """An in-process copy let 2**70 through; the node's log encoding then failed in the
    connection's task and dropped the whole connection, and its consumers' messages."""
    client = node.client()
    client.declare("big")
    consumer = client.subscribe("big", prefetch=1)
    client.publish("big", b"held")
    held = consumer.get(timeout=5)
    with pytest.raises(OverflowError):
        client.commit_offset("big", "g", 2**70)
    client.publish("big", b"served on")  # the connection is still there
    held.ack()
    assert consumer.get(timeout=5).body == b"served on"


def test_clients_a_program_let_go_of_do_not_pile_up_in_the_node(node: quorumq.Node) -> None:
    import gc

    for _ in range(50):
        with node.client() as client:
            client.status()
    gc.collect()
    assert len(node._clients) <= 1


def test_a_node_stopped_before_it_started_refuses_to_start(tmp_path: Path) -> None:
    """stop() first marked the node as stopping; a later start() then returned a node
    that stopped at once."""
    node = quorumq.Node(**_settings(tmp_path))
    node.stop()
    with pytest.raises(RuntimeError, match="make a new one"):
        node.start()
    assert not node.running
