"""The examples run as their docstrings say."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_the_embedded_service_example_gives_a_killed_copys_jobs_to_the_others() -> None:
    """`examples/embedded_service.py`: three copies of a service, each with a node inside
    consuming locally; one copy is killed while it holds unacked jobs, and the other two
    do every job, those among them."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, str(ROOT / "examples" / "embedded_service.py"), "--jobs", "60"]
    # its own session: should it hang, the example and the copies it started go together
    example = subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = example.communicate(timeout=180)
    finally:
        if example.poll() is None:
            os.killpg(example.pid, signal.SIGKILL)
            example.wait()
    assert example.returncode == 0, out
    summary = out.splitlines()[-1]
    assert summary.startswith("-- all 60 jobs done") and "copy B was killed" in summary, out
    held = int(summary.split("killed holding ")[1].split(",")[0])
    redone = [line for line in out.splitlines() if "(again" in line]
    assert held == len(redone) > 0, out
    assert all(line.startswith(("A did", "C did")) for line in redone), out
