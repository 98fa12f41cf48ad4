"""`quorumq simulate sweep --spark MASTER`: the seeds as Spark tasks give what a local
sweep gives, seed by seed (issue 32)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.spark, pytest.mark.slow]


def _simulate(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """`quorumq simulate ...` as a user runs it, in `cwd` (not the checkout)."""
    return subprocess.run(
        [sys.executable, "-m", "quorumq", "simulate", *args],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=cwd,
        env={**os.environ, **env},
    )


def _report(stdout: str) -> list[str]:
    """The sweep's report: its verdict line without the wall time and speed, and every
    line after it (records, liveness, recoveries per fault kind); not the progress."""
    lines = stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if ": " in line and " seeds " in line)
    return [lines[at].split(" in ", 1)[0], *lines[at + 1 :]]


def test_a_sweep_on_spark_gives_each_seed_the_verdict_and_trace_of_a_local_sweep(
    tmp_path: Path,
) -> None:
    """Every seed's verdict and trace hash, in seed order, and the sweep's summary: the
    same through `--spark local[2]` as in this process. (A mix-up of outcomes and seeds,
    a seed run twice or left out, or a run that depends on where it runs, all differ.)"""
    common = ["sweep", "--seeds", "0:16", "--steps", "300", "--keep-going"]
    local = _simulate(*common, "--jobs", "1", "--json", str(tmp_path / "local.json"), cwd=tmp_path)
    spark = _simulate(
        *common, "--spark", "local[2]", "--json", str(tmp_path / "spark.json"), cwd=tmp_path
    )
    assert spark.returncode == local.returncode, spark.stdout + spark.stderr
    runs = json.loads((tmp_path / "spark.json").read_text())["runs"]
    assert [r["seed"] for r in runs] == list(range(16))
    assert len({r["trace"] for r in runs}) == 16
    assert runs == json.loads((tmp_path / "local.json").read_text())["runs"]
    assert _report(spark.stdout) == _report(local.stdout)
    assert _report(local.stdout)[0].startswith("all 16 seeds pass: ")


def test_a_master_spark_cannot_use_is_one_line_before_any_jvm(tmp_path: Path) -> None:
    failed = _simulate("sweep", "--seeds", "0:2", "--spark", "nowhere://x", cwd=tmp_path)
    assert failed.returncode == 2, failed.stdout + failed.stderr
    assert failed.stderr.strip() == (
        "quorumq simulate sweep: argument --spark: 'nowhere://x' is no Spark master: "
        "local[N], spark://HOST:PORT, k8s://..., or yarn (see quorumq simulate sweep --help)"
    )


def test_a_seed_that_raises_on_an_executor_fails_alone(tmp_path: Path) -> None:
    """A seed whose run raises (a simulator bug, no memory) is a failing seed, named
    with its replay command; the other seeds of its task and of the sweep run on."""
    raised = _simulate(
        "sweep",
        "--seeds",
        "0:6",
        "--steps",
        "300",
        "--keep-going",
        "--spark",
        "local[2]",
        "--json",
        str(tmp_path / "runs.json"),
        cwd=tmp_path,
        QUORUMQ_SIM_TEST_RAISE_ON_SEED="3",
    )
    assert raised.returncode == 1, raised.stdout + raised.stderr
    assert "seed 3 raised RuntimeError: QUORUMQ_SIM_TEST_RAISE_ON_SEED names" in raised.stdout
    assert "1 of 6 seeds fail" in raised.stdout
    runs = json.loads((tmp_path / "runs.json").read_text())["runs"]
    assert [(r["seed"], r["ok"]) for r in runs] == [(s, s != 3) for s in range(6)]
