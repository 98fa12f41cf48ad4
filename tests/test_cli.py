"""The `quorumq` command, run as a user runs it."""

from __future__ import annotations

import subprocess
import sys


def _quorumq(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "quorumq.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_demo_replays_both_sequences_of_the_post() -> None:
    result = _quorumq("demo")
    assert result.returncode == 0, result.stderr
    assert "m3->c2" in result.stdout
    assert "m1->c2*, m2->c2*" in result.stdout


def test_bad_arguments_get_a_one_line_error_and_nonzero_exit() -> None:
    result = _quorumq("demo", "--scenario", "nope")
    assert result.returncode == 2
    assert "invalid choice" in result.stderr
    assert "Traceback" not in result.stderr
