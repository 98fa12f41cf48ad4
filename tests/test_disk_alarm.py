"""The disk alarm on a small filesystem the test makes (a 48 MiB tmpfs): below the
free-space limit every node refuses publishes at once with `disk_alarm`, while
deliveries, acks and reads go on; once space returns the alarm clears and publishes
land again; nothing confirmed is lost.

A full disk stopped a node (190 publishes of 16 KiB into 3 MiB free), and its publisher
learned it only as `OutcomeUnknownError` after 30 s."""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from quorumq.client import ServerError
from quorumq.ops.local_cluster import Cluster

from .helpers import wait_for
from .test_cluster import Recorder

pytestmark = pytest.mark.slow

SIZE_MB = 48
LIMIT_MB = 16


@pytest.fixture
def small_disk() -> Iterator[Path]:
    """A tmpfs of `SIZE_MB` (needs the right to mount: root, as on CI's machine)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    path = Path(tempfile.mkdtemp(prefix="quorumq-small-disk-"))
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={SIZE_MB}m", "tmpfs", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        path.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)
        path.rmdir()


def free_mb(path: Path) -> float:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize / (1024 * 1024)


def fill_to(path: Path, free: float) -> Path:
    """A ballast file leaving about `free` MiB free on `path`'s filesystem."""
    ballast = path / "ballast"
    with ballast.open("ab") as f:
        while free_mb(path) > free + 1:
            f.write(b"\0" * (1024 * 1024))
            f.flush()
    return ballast


def test_below_the_limit_publishes_wait_and_the_rest_goes_on(small_disk: Path) -> None:
    with Cluster(3, data_dir=small_disk / "data", min_free_disk_mb=LIMIT_MB) as cluster:
        client = cluster.client(timeout=30)
        client.declare("q")
        recorder = Recorder(cluster.client().subscribe("q", prefetch=10))
        confirmed = [client.publish("q", b"before-%d" % i) for i in range(20)]
        ballast = fill_to(small_disk, LIMIT_MB - 4)  # every node's data is on this disk
        wait_for(
            lambda: all(
                cluster.status(n)["disk_alarm"] and cluster.status(n)["disk_alarms"]
                for n in cluster.nodes
            ),
            "every node raising its alarm and seeing it in the log",
            15,
        )
        for node in cluster.nodes:
            with cluster.client(node, timeout=30) as nodes_client, pytest.raises(ServerError) as e:
                nodes_client.publish("q", b"refused")
            assert e.value.code == "disk_alarm", e.value
            assert "free-space limit" in str(e.value) or "below its limit" in str(e.value)
        wait_for(
            lambda: {d.offset for d in recorder.deliveries} == set(confirmed),
            "deliveries (and acks) going on under the alarm",
            15,
        )
        read = client.read("q", 0, len(confirmed))
        assert [row[0] for row in read.rows] == confirmed
        status = cluster.status(cluster.nodes[0])
        assert status["disk_alarm"] and status["disk_free_bytes"] < LIMIT_MB * 1024 * 1024

        ballast.unlink()  # space returns
        wait_for(
            lambda: not any(cluster.status(n)["disk_alarms"] for n in cluster.nodes),
            "the alarm clearing",
            15,
        )
        confirmed += [client.publish("q", b"after-%d" % i) for i in range(20)]
        wait_for(
            lambda: {d.offset for d in recorder.deliveries} == set(confirmed),
            "every confirmed message delivered",
            15,
        )
        recorder.stop()
        assert all(cluster.alive(n) for n in cluster.nodes)


def fill_up(path: Path) -> Path:
    """A ballast file that takes every byte left on `path`'s filesystem."""
    ballast = path / "ballast-full"
    with ballast.open("ab") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    return ballast


def test_a_node_started_on_a_full_disk_waits_instead_of_failing_in_a_loop(
    small_disk: Path,
) -> None:
    """A node whose disk filled stopped at its next journal write, and started again
    on the full disk it failed at once, for a supervisor to restart in a loop. Now it
    waits for space, alive, and then starts with everything confirmed."""
    with Cluster(3, data_dir=small_disk / "data", min_free_disk_mb=LIMIT_MB) as cluster:
        client = cluster.client(timeout=30)
        client.declare("q")
        confirmed = [client.publish("q", b"m%d" % i) for i in range(20)]
        node = next(n for n in cluster.nodes if n != cluster.leader())
        cluster.kill(node)
        ballast = fill_up(small_disk)
        cluster._spawn(node)
        wait_for(
            lambda: b"waiting for" in cluster.log_path(node).read_bytes(),
            f"{node} saying it waits for space",
            15,
        )
        assert cluster.alive(node)
        ballast.unlink()
        cluster._wait_ready(node)
        for other in cluster.nodes:
            if not cluster.alive(other):  # (a journal write that met the full disk)
                cluster.restart(other)
        read = cluster.client(node, timeout=30).read("q", 0, len(confirmed), wait=10)
        assert [row[0] for row in read.rows] == confirmed


def test_the_disk_is_measured_every_second_near_its_limit_and_less_often_with_room() -> None:
    """An idle node measured its disk every second, waking its loop and a worker thread:
    now as often only when a fast fill (200 MiB/s) could reach the limit by the next
    look, and every 5 s at most."""
    from quorumq.node.config import DISK_CHECK_EVERY_S, DISK_CHECK_MOST_S, disk_check_in_s

    mib = 1024 * 1024
    assert disk_check_in_s(70 * mib, 64 * mib) == DISK_CHECK_EVERY_S
    assert disk_check_in_s(10 * mib, 64 * mib) == DISK_CHECK_EVERY_S  # the alarm is up
    assert disk_check_in_s(None, 64 * mib) == DISK_CHECK_EVERY_S
    assert disk_check_in_s(64 * mib + 600 * mib, 64 * mib) == pytest.approx(3.0)
    assert disk_check_in_s(100_000 * mib, 64 * mib) == DISK_CHECK_MOST_S
    assert disk_check_in_s(10 * mib, 0) == DISK_CHECK_MOST_S  # no alarm: status only
