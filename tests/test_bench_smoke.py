"""The comparison benchmark, small: quorumq alone, every workload once, in seconds.

The peers are hidden from it (PATH holds only this Python's directory), so it also
checks that a missing RabbitMQ or NATS is reported with its install command and
does not fail the run.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_comparison_measures_every_quorumq_workload_and_skips_missing_peers(
    tmp_path: Path,
) -> None:
    env = {**os.environ, "PATH": str(Path(sys.executable).parent)}
    small = ["--repeat", "1", "--messages", "600", "--producers", "1,2", "--rates", "300"]
    small += ["--queues", "3"]
    short = ["--latency-seconds", "1", "--failover-seconds", "3", "--idle-seconds", "0.5"]
    command = [sys.executable, "-m", "benchmarks", "compare", "--systems", "quorumq,rabbitmq,nats"]
    result = subprocess.run(
        [*command, *small, *short, "--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "skipping rabbitmq: " in out and "apt-get install -y rabbitmq-server" in out, out
    assert "skipping nats: " in out and "apt-get install -y nats-server" in out, out

    results = json.loads((tmp_path / "compare.json").read_text())
    assert list(results["systems"]) == ["quorumq"]
    assert results["failures"] == []
    runs = {workload: by_system["quorumq"] for workload, by_system in results["runs"].items()}
    for workload in ("publish_confirm_1", "publish_confirm_2", "end_to_end", "end_to_end_3_queues"):
        assert runs[workload][0] > 0, workload
    latency = runs["latency_300"][0]
    assert latency["sent"] == 300
    assert 0 < latency["deliver_p50_ms"] <= latency["deliver_p99_ms"] <= latency["deliver_p999_ms"]
    failover = runs["failover"][0]
    assert failover["unconfirmed"] == 0
    assert failover["lost"] == 0
    assert failover["unmarked_duplicates"] == 0
    assert 0 < failover["confirms_resumed_s"] < 30
    assert 0 < failover["deliveries_resumed_s"] < 30
    assert results["elections"]["failover"]["quorumq"][0] >= 1  # the kill forced one
    assert results["peak_rss_mb"]["quorumq"] > 10
    assert results["idle_cpu_percent"]["quorumq"] >= 0
    assert all(v[0] > 0 for v in results["cpu_s_per_100k"]["end_to_end"].values())
    assert not math.isnan(results["machine"]["load_after"]["load1"])

    page = (tmp_path / "compare.md").read_text()
    assert "| publish-confirm msg/s, 1 producer | " in page
    assert "| publish->consume->ack msg/s, 3 queues (a client process each) | " in page
    assert "- **rabbitmq**: not measured (RabbitMQ is not installed" in page


def test_the_simulator_benchmark_runs_each_of_its_measures() -> None:
    """`benchmarks/bench_sim.py`, small: one rate, two default seeds, one CI seed."""
    command = [sys.executable, "-m", "benchmarks.bench_sim", "--rates", "100", "--nodes", "3"]
    small = ["--steps", "100", "--seeds", "2", "--jobs", "2", "--ci-seeds", "1"]
    result = subprocess.run(
        [*command, *small],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "| 3 | 100 |" in out and "10,000 seeds would take" in out, out
    assert "3 nodes, CI configuration:" in out and "5 nodes, CI configuration:" in out, out


def test_the_path_breakdown_joins_the_marks_of_every_process() -> None:
    """`benchmarks/bench_path.py`, small: a real cluster with path timing on; every
    message's confirm path and delivery path are found in the four processes' marks."""
    import re

    command = [sys.executable, "-m", "benchmarks.bench_path", "--rate", "200", "--seconds", "1"]
    result = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=240, check=False
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    for path in ("confirm", "delivery"):
        found = re.search(rf"{path} path \((\d+) messages", out)
        assert found and int(found.group(1)) >= 150, out
    assert "| follower's fdatasync done | follower |" in out, out


def _run_benchmark(module: str, *options: str) -> str:
    """`python -m benchmarks.<module> <options>` from the checkout: its output, after
    checking that it exited 0 (within 240 s; past that it gets SIGTERM, which the
    benchmarks turn into their own teardown, and SIGKILL only 60 s later)."""
    command = [sys.executable, "-m", f"benchmarks.{module}", *options]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as proc:
        try:
            out, _ = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                out, _ = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, _ = proc.communicate()
            raise AssertionError(f"{module} ran past 240 s:\n{out}") from None
    assert proc.returncode == 0, out
    return out


def _table_rows(out: str, first_cell: str) -> list[list[str]]:
    """The cells of every markdown table row of `out` whose first cell starts so."""
    rows = []
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and cells[0].startswith(first_cell):
            rows.append(cells)
    return rows


def test_the_embedded_benchmark_measures_both_paths_side_by_side() -> None:
    """`benchmarks/bench_embedded.py`, small: node A in the benchmark's process (and
    leading), B and C node processes; both paths measured, the ratios printed."""
    out = _run_benchmark(
        "bench_embedded",
        "--seconds",
        "1",
        "--messages",
        "500",
        "--rounds",
        "1",
        "--rate",
        "300",
        "--fsync",
        "never",
    )
    assert "| in-process | 1 |" in out and "| tcp | 1 |" in out, out
    assert "in-process / tcp (medians of the rounds): p50 " in out, out


def test_the_reads_benchmark_measures_publishes_under_each_load_of_waiting_reads() -> None:
    """`benchmarks/bench_reads.py`, small: one node process, a few connections of
    waiting reads, each load's publishes measured."""
    out = _run_benchmark(
        "bench_reads", "--connections", "3", "--reads", "4", "--seconds", "0.5", "--rate", "100"
    )
    for load in ("none", "idle queue", "same queue"):
        assert f"| this tree | {load} | " in out, out


def test_the_idle_benchmark_measures_cpu_and_both_failovers() -> None:
    """`benchmarks/bench_idle.py`, small: three node processes, short idle samples, one
    failover of each kind (the nodes it stops and kills, it starts again and stops)."""
    out = _run_benchmark("bench_idle", "--seconds", "1", "--kills", "1", "--messages", "10")
    for line in ("idle, fresh:", "idle, after traffic:", "idle leader SIGKILL:", "SIGSTOP:"):
        assert line in out, out


def test_the_roles_benchmark_measures_each_roles_cpu_and_projects_it() -> None:
    """`benchmarks/bench_roles.py`, small: three node processes, each workload once, the
    per-role CPU and the projection for 3, 9 and 27 nodes."""
    out = _run_benchmark("bench_roles", "--messages", "400", "--repeat", "1", "--seconds", "1")
    for line in ("| publish-confirm | ", "| end to end | ", "| paced 1,000 msg/s | 27 | "):
        assert line in out, out


def test_the_queues_benchmark_measures_one_group_and_three_side_by_side() -> None:
    """`benchmarks/bench_queues.py`, small: one cluster with 1 and 3 queues, three
    clusters with 3 queues spread over them (12 node processes, all stopped). Every
    setup moved messages and took Raft entries to do it."""
    out = _run_benchmark(
        "bench_queues", "--queues", "3", "--messages", "300", "--repeat", "1", "--no-rabbitmq"
    )
    rows = {cells[0]: cells for cells in _table_rows(out, "quorumq, ")}
    for setup in (
        "quorumq, 1 group, 1 queue",
        "quorumq, 1 group, 3 queues",
        "quorumq, 3 groups (9 processes), 3 queues",
    ):
        assert setup in rows, out
        rate, _cpu, entries = rows[setup][1:]
        assert float(rate.split()[0].replace(",", "")) > 0, out
        assert float(entries) > 0, out


def test_the_spread_benchmark_pauses_each_node_in_turn() -> None:
    """`benchmarks/bench_spread.py`, small: one cluster, two queues, its leader and each
    follower paused for a second in turn (and continued: the test stops the nodes); then
    two clusters led by A and B, each host paused in turn. A queue whose leader is
    paused waits for a new leader, which Raft cannot elect before an election timeout
    (at least 0.25 s) has passed without a heartbeat (sent at most 0.1 s apart): a stall
    of at least 0.1 s whatever the machine's speed."""
    out = _run_benchmark(
        "bench_spread",
        *("--queues", "2", "--rate", "20", "--pause-at", "1", "--pause-seconds", "1"),
        *("--groups", "2", "--no-rabbitmq"),
    )
    rows = {cells[0]: cells for cells in _table_rows(out, "quorumq")}
    for role in ("its leader", "a follower", "the other follower"):
        assert f"quorumq (one Raft group), {role} paused" in rows, out
    stalls = rows["quorumq (one Raft group), its leader paused"][2].split(", ")
    assert len(stalls) == 2 and all(float(s) >= 0.1 for s in stalls), out
    spread = {name: cells for name, cells in rows.items() if "leaders spread" in name}
    assert len(spread) == 3, out  # hosts A, B and C
    # a host that leads a cluster, paused, makes that cluster elect (a new term); the
    # label is read from the clusters just before the pause, not assumed
    for host in ("A", "B"):
        (name,) = [n for n in spread if f"host {host}, leading 1 of 2" in n]
        assert name.endswith("(1 new terms)"), out


def test_a_queues_stall_is_the_longest_time_without_a_confirm() -> None:
    from benchmarks.bench_spread import stall_s

    assert stall_s([], 10.0, 12.0) == 2.0  # nothing confirmed: the whole window
    assert stall_s([9.0, 10.5, 11.9, 13.0], 10.0, 12.0) == pytest.approx(1.4)  # between two
    assert stall_s([10.1, 10.2], 10.0, 12.0) == pytest.approx(1.8)  # the last to the end
    assert stall_s([11.0, 11.5], 10.0, 12.0) == pytest.approx(1.0)  # the pause to the first


def test_the_wal_benchmark_syncs_once_a_round_for_every_group(tmp_path: Path) -> None:
    """`benchmarks/bench_wal.py`, small: three groups in one log make one fdatasync a
    round, three journals three (counted, not assumed)."""
    out = _run_benchmark(
        "bench_wal", "--groups", "1,3", "--rounds", "20", "--repeat", "1", "--dir", str(tmp_path)
    )
    rows = {(r[0], r[1]): r for r in _table_rows(out, "")}
    assert rows[("3", "one log")][4] == "1.00", out
    assert rows[("3", "a journal each")][4] == "3.00", out
    assert rows[("1", "one log")][4] == "1.00", out
    assert "wal / journals, 3 groups (rounds/s, medians): " in out, out
    assert os.listdir(tmp_path) == [], "the benchmark left its data behind"


def test_the_engine_benchmark_commits_through_both_kinds_of_node_process(tmp_path: Path) -> None:
    """`benchmarks/bench_engine.py`, small: three node processes with two groups each,
    a thread and a journal file per group, one engine and one log, and that on one
    Raft port per node; all commit, and their fdatasyncs are counted in the processes.
    (Whether the log syncs less per commit is the benchmark's to measure: on a loaded
    machine, with two groups, it once synced 23.4 times per 100 commits against 23.2.
    That one fdatasync covers every group's entries of a round is `test_engine`'s.)"""
    out = _run_benchmark(
        "bench_engine",
        "--groups",
        "2",
        "--seconds",
        "1",
        "--repeat",
        "1",
        "--dir",
        str(tmp_path),
    )
    rows = {r[1]: r for r in _table_rows(out, "2")}
    threads = rows["a thread, a file each"]
    engine, link = rows["one engine, one log"], rows["one engine, one log, one port"]
    for row in (engine, threads, link):
        assert float(row[2].split()[0].replace(",", "")) > 0, out
    assert all(float(row[4]) > 0 for row in (engine, threads, link)), out
    assert "engine / threads, 2 groups (commits/s, medians): " in out, out
    assert "link / threads, 2 groups (commits/s, medians): " in out, out
    assert os.listdir(tmp_path) == [], "the benchmark left its data behind"
