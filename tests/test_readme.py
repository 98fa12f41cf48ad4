"""The README's and the documentation's examples run as written.

Every fenced ```python block of README.md and of every page under docs/ runs in a fresh
interpreter, its `print(...)  # expected` comments checked against what it printed;
blocks that start their own cluster (or none) run as they are, and blocks written for
"nodes you run yourself" run against a 3-node cluster that requires a token: its
endpoints replace 127.0.0.1:7001, :7002 and :7003, and the token is in QUORUMQ_TOKEN,
where the pages tell the reader to put it. Every ```sh block runs in bash in an empty
directory, each command's output checked against its comment when the comment says what
it prints (`# prints: ...`, whole or up to its first ": ", "..." for anything; `# prints
nothing`); the ports a block names for nodes it starts by hand (7001-7003, 8001-8003) are
swapped for free ones, and whatever it leaves running is stopped with its process
group. Other blocks are not run: output (```text), configuration for other programs
(```yaml), and plain ``` blocks of commands for hosts that are not here (10.0.0.x,
/var/lib) or this checkout's own entry points (`./run`).
"""

from __future__ import annotations

import os
import random
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from quorumq.ops.local_cluster import Cluster, free_ports

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
SKETCHES = {ROOT / "docs" / "pysyncobj-notes.md"}
"""Pages whose code blocks are sketches of experiments run elsewhere (the notes from
reading PySyncObj), not examples for a reader to run."""
DOCUMENTS = [README, *sorted(set((ROOT / "docs").rglob("*.md")) - SKETCHES)]
_BLOCK = re.compile(r"^```(?P<lang>[\w-]*)\n(?P<body>.*?)^```", re.S | re.M)
_EXPECTED = re.compile(r"^\s*print\(.*\)\s+#\s*(?P<expected>.+)$", re.M)
_ENDPOINT = re.compile(r"127\.0\.0\.1:700([1-3])")


def blocks_of(path: Path, lang: str) -> list[tuple[str, str]]:
    """(where, body) of each block of `path` in `lang`; `where` is "file:line"."""
    text = path.read_text()
    name = path.relative_to(ROOT)
    return [
        (f"{name}:{text.count(chr(10), 0, block.start()) + 1}", block["body"])
        for block in _BLOCK.finditer(text)
        if block["lang"] == lang
    ]


def readme_blocks(lang: str) -> list[Any]:
    """Every README and docs block in `lang`, as pytest params."""
    found = []
    for path in DOCUMENTS:
        for where, body in blocks_of(path, lang):
            marks = [pytest.mark.spark, pytest.mark.slow] if "pyspark" in body else []
            found.append(pytest.param(where, body, id=where, marks=marks))
    return found


def test_the_pages_have_the_examples_these_tests_run() -> None:
    """A page reformatted so that its blocks lose their language would skip them all."""
    assert len(blocks_of(README, "python")) >= 3
    assert len(blocks_of(README, "sh")) >= 2
    assert len(readme_blocks("python")) >= 12
    assert len(readme_blocks("sh")) >= 6


def expected_prints(code: str) -> list[str]:
    """What each `print(...)  # expected` promises."""
    return [m["expected"].strip() for m in _EXPECTED.finditer(code)]


def prints_as_promised(output: str, promised: str) -> bool:
    """`output` (one printed line) matches the comment: whole, or up to its first ": "
    (what follows is an explanation); "..." stands for anything."""
    for want in (promised, promised.split(": ", 1)[0]):
        pattern = ".*".join(re.escape(part) for part in want.split("..."))
        if re.fullmatch(pattern, output.strip()):
            return True
    return False


def test_expected_prints_are_read_from_the_comments() -> None:
    code = "print(a)  # 1000: each once\nprint(b)  # {'spark-...': 900}\nprint(c)\n"
    assert expected_prints(code) == ["1000: each once", "{'spark-...': 900}"]
    assert prints_as_promised("1000", "1000: each once")
    assert prints_as_promised("{'spark-quorumq-1f2e': 900}", "{'spark-...': 900}")
    assert not prints_as_promised("999", "1000: each once")
    assert not prints_as_promised("{'spark-quorumq-1f2e': 800}", "{'spark-...': 900}")


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """Nodes "you run yourself": three, requiring a client token."""
    with Cluster(3, token=secrets.token_hex(16)) as cluster:
        cluster.leader()
        yield cluster


@pytest.mark.parametrize(("line", "code"), readme_blocks("python"))
def test_readme_python_example_runs(line: str, code: str, cluster: Cluster, tmp_path: Path) -> None:
    filled = _ENDPOINT.sub(lambda m: cluster.endpoint("ABC"[int(m[1]) - 1]), code)
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUORUMQ_")}
    assert cluster.token is not None
    env["QUORUMQ_TOKEN"] = cluster.token
    result = subprocess.run(
        [sys.executable, "-c", filled],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=tmp_path,
        env=env,
    )
    assert result.returncode == 0, f"{line}:\n{result.stdout}\n{result.stderr}"
    printed = result.stdout.splitlines()
    for promised in expected_prints(code):
        while printed and not prints_as_promised(printed[0], promised):
            printed.pop(0)
        assert printed, f"{line}: nothing printed {promised!r}:\n{result.stdout}"
        printed.pop(0)


_PRINTS = re.compile(r"#\s*prints(?::\s*(?P<output>.+)|(?P<nothing> nothing\b.*))$")
_MARK = "@@readme-line "


def shell_promises(script: str) -> dict[int, str | None]:
    """Line number in the block -> what that command promises to print (None: nothing)."""
    promises: dict[int, str | None] = {}
    for number, line in enumerate(script.splitlines()):
        found = _PRINTS.search(line)
        if found:
            promises[number] = None if found["nothing"] else found["output"].strip()
    return promises


def marked(script: str) -> str:
    """`script` with a marker printed before each command, to split its output by line
    (not before a line that continues the one above it)."""
    lines = script.splitlines()
    return "\n".join(
        f"printf '\\n{_MARK}{number}\\n'; {line}"
        if line.strip() and not (number and lines[number - 1].endswith("\\"))
        else line
        for number, line in enumerate(lines)
    )


def outputs_by_line(stdout: str) -> dict[int, list[str]]:
    by_line: dict[int, list[str]] = {}
    current: list[str] = []
    for text in stdout.splitlines():
        if text.startswith(_MARK):
            current = by_line.setdefault(int(text[len(_MARK) :]), [])
        elif text.strip():
            current.append(text)
    return by_line


def test_a_shell_blocks_promised_outputs_are_read_from_its_comments() -> None:
    script = "a   # prints: x: why\nb  # prints nothing: done\nc  # a table\n"
    assert shell_promises(script) == {0: "x: why", 1: None}
    out = f"\n{_MARK}0\nx\n\n{_MARK}1\n\n{_MARK}2\nrow\n"
    assert outputs_by_line(out) == {0: ["x"], 1: [], 2: ["row"]}
    assert all(_MARK in line for line in marked(script).splitlines())
    assert _MARK not in marked("a \\\n  --flag\n").splitlines()[1]  # a continued line


_HAND_PORT = re.compile(r"\b(700[1-3]|800[1-3])\b")


def ports_outside_the_ephemeral_range(n: int) -> list[int]:
    """`n` ports on 127.0.0.1 free a moment ago, below the kernel's range for outgoing
    connections' local ports: a block restarts nodes on their ports while the others
    dial out, and a port of that range, free while its node is down, could become the
    local port of such a connection."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return free_ports(n)
    chosen: list[int] = []
    while len(chosen) < n:
        port = random.randrange(10_000, max(low, 10_001))
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        if port not in chosen:
            chosen.append(port)
    return chosen


def with_free_ports(script: str) -> str:
    """`script` with the ports of nodes started by hand (7001-7003 for clients, 8001-8003
    for Raft) swapped for free ones, each the same everywhere in the block."""
    named = sorted(set(_HAND_PORT.findall(script)))
    if not named:
        return script
    ports = dict(zip(named, map(str, ports_outside_the_ephemeral_range(len(named))), strict=True))
    return _HAND_PORT.sub(lambda m: ports[m[1]], script)


def test_hand_started_ports_are_swapped_the_same_everywhere() -> None:
    script = "node --listen 127.0.0.1:7001 --raft 127.0.0.1:8001\nnode A 7001 8001\n# 17001"
    swapped = with_free_ports(script)
    client, raft = re.findall(r":(\d+)", swapped.splitlines()[0])
    assert {client, raft}.isdisjoint({"7001", "8001"}) and client != raft
    assert swapped.splitlines()[1] == f"node A {client} {raft}"
    assert swapped.endswith("# 17001")


def stop_group(process: subprocess.Popen[str]) -> None:
    """Stop what a block left running: its whole process group (it was started in a
    session of its own), by SIGTERM, then SIGKILL after 20 s."""
    for sig, wait in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                os.killpg(process.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)


@pytest.mark.parametrize(("line", "script"), readme_blocks("sh"))
def test_readme_shell_example_runs(line: str, script: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUORUMQ_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    out, err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with out.open("w") as stdout_file, err.open("w") as stderr_file:
        # files, not pipes: nodes a block leaves running would hold a pipe open
        process = subprocess.Popen(
            ["bash", "-euo", "pipefail", "-c", marked(with_free_ports(script))],
            stdout=stdout_file,
            stderr=stderr_file,
            text=True,
            cwd=tmp_path,
            env=env,
            start_new_session=True,
        )
    try:
        try:
            process.wait(timeout=300)
        except subprocess.TimeoutExpired:
            stop_group(process)
            pytest.fail(f"{line} did not end within 300 s:\n{out.read_text()}\n{err.read_text()}")
        stdout, stderr = out.read_text(), err.read_text()
        assert process.returncode == 0, f"{line}:\n{stdout}\n{stderr}"
        printed = outputs_by_line(stdout)
        for number, promised in shell_promises(script).items():
            where = f"{line} + {1 + number}"
            if promised is None:
                assert printed[number] == [], f"{where} printed {printed[number]}"
            else:
                assert any(prints_as_promised(out, promised) for out in printed[number]), (
                    f"{where} did not print {promised!r}: {printed[number]}"
                )
    finally:  # a dev cluster the script left running is stopped (by its pids), and
        # whatever else it started, with its process group
        if (tmp_path / ".quorumq-cluster" / "cluster.json").exists():
            subprocess.run(
                [sys.executable, "-m", "quorumq", "cluster", "down"],
                cwd=tmp_path,
                capture_output=True,
                timeout=60,
                check=False,
            )
        stop_group(process)
