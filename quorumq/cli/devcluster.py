"""`quorumq cluster up|down|status`: a local dev cluster of node processes, its state
in a directory (`DEFAULT_CLUSTER_DIR`), stopped by the pids it recorded."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .args import UsageError

DEFAULT_CLUSTER_DIR = ".quorumq-cluster"


def cluster_state(root: Path) -> dict[str, Any]:

    try:
        state: dict[str, Any] = json.loads((root / "cluster.json").read_text())
    except FileNotFoundError:
        raise UsageError(f"no cluster in {root} (start one with: quorumq cluster up)") from None
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot read {root / 'cluster.json'}: {e}") from None
    return state


def dir_option(root: Path) -> str:
    """` --dir ROOT`, unless ROOT is the default (for the commands a message suggests)."""
    return "" if str(root) == DEFAULT_CLUSTER_DIR else f" --dir {root}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def running_nodes(state: dict[str, Any]) -> list[str]:
    """The nodes of a dev cluster whose processes run (none once it was stopped: their
    process ids may belong to other processes by now)."""
    if state.get("stopped"):
        return []
    return [name for name, node in state["nodes"].items() if _pid_alive(node["pid"])]


def _cluster_up(root: Path, nodes: int) -> int:
    import secrets  # noqa: PLC0415
    import subprocess  # noqa: PLC0415

    from ..ops.local_cluster import NODE_NAMES, free_ports  # noqa: PLC0415

    again = (root / "cluster.json").exists()
    if again:
        # a stopped cluster starts again on its own ports and secret: its members'
        # Raft addresses live in its logs, so new ports would leave nodes unreachable
        state = cluster_state(root)
        if running_nodes(state):
            raise UsageError(
                f"a cluster already runs from {root}: quorumq cluster down{dir_option(root)} first"
            )
        names = list(state["nodes"])
        ports = {
            n: (state["nodes"][n]["client_port"], state["nodes"][n]["raft_port"]) for n in names
        }
        try:
            secret = (root / "secret").read_text().strip()
        except OSError as e:
            raise UsageError(f"cannot read the stopped cluster's secret: {e}") from None
        print(f"starting the stopped cluster in {root} again ({len(names)} nodes, its data kept)")
    else:
        root.mkdir(parents=True, exist_ok=True)
        names = list(NODE_NAMES[:nodes])
        picked = free_ports(2 * len(names))
        ports = {n: (picked[i], picked[len(names) + i]) for i, n in enumerate(names)}
        secret = secrets.token_hex(16)
        (root / "secret").write_text(secret)
        (root / "secret").chmod(0o600)
    started: dict[str, Any] = {}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    for name in names:
        client_port, raft_port = ports[name]
        command = [
            sys.executable,
            "-m",
            "quorumq",
            "node",
            "--id",
            name,
            "--data-dir",
            str(root / name),
            "--listen",
            f"127.0.0.1:{client_port}",
            "--raft",
            f"127.0.0.1:{raft_port}",
            "--secret-file",
            str(root / "secret"),
            "--insecure",  # a local dev cluster on loopback: no client token
            "--log-level",
            "info",
        ]
        for other in names:
            if other != name:
                command += ["--peer", f"{other}=127.0.0.1:{ports[other][1]}"]
        log_path = root / f"{name}.log"
        marks = log_path.read_bytes().count(b" ready: ") if log_path.exists() else 0
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        procs[name] = proc
        started[name] = {
            "pid": proc.pid,
            "client_port": client_port,
            "raft_port": raft_port,
            "ready_marks": marks,
        }
        print(f"  started node {name} (pid {proc.pid}): clients on 127.0.0.1:{client_port}")
    state = {
        "nodes": {n: {k: v for k, v in s.items() if k != "ready_marks"} for n, s in started.items()}
    }
    (root / "cluster.json").write_text(json.dumps(state, indent=2))
    deadline = time.monotonic() + 30
    for name in names:
        log_path = root / f"{name}.log"
        while log_path.read_bytes().count(b" ready: ") <= started[name]["ready_marks"]:
            if procs[name].poll() is not None or time.monotonic() > deadline:
                why = (
                    _last_line(log_path) if procs[name].poll() is not None else "not ready in 30 s"
                )
                raise UsageError(
                    f"node {name} did not start ({why}); see {log_path}, and stop the "
                    f"others with: quorumq cluster down{dir_option(root)}"
                )
            time.sleep(0.05)
    endpoints = ",".join(f"127.0.0.1:{n['client_port']}" for n in started.values())
    print(f"cluster up in {root}; endpoints {endpoints}")
    return 0


def _last_line(path: Path) -> str:
    lines = path.read_text(errors="replace").strip().splitlines()
    return lines[-1] if lines else "no output"


def run_cluster(args: argparse.Namespace) -> int:
    import time  # noqa: PLC0415

    root = Path(args.dir)
    if args.action == "up":
        return _cluster_up(root, args.nodes)
    state = cluster_state(root)
    data = ", ".join(str(root / name) for name in state["nodes"])
    if args.action == "down":
        running = running_nodes(state)
        for name in running:
            node = state["nodes"][name]
            os.kill(node["pid"], signal.SIGTERM)
            print(f"  stopping node {name} (pid {node['pid']})")
        deadline = time.monotonic() + 15
        for name in running:
            pid = state["nodes"][name]["pid"]
            while _pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if _pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        state["stopped"] = True
        (root / "cluster.json").write_text(json.dumps(state, indent=2))
        print(
            f"cluster down; its data is kept in {data} (start it again with: "
            f"quorumq cluster up{dir_option(root)})"
        )
        return 0
    running = running_nodes(state)
    if not running:
        print(
            f"cluster in {root} is stopped; its data is kept in {data} (start it again "
            f"with: quorumq cluster up{dir_option(root)})"
        )
        return 0
    for name, node in state["nodes"].items():
        alive = "running" if name in running else "stopped"
        print(
            f"  node {name}: pid {node['pid']} {alive}, clients on 127.0.0.1:{node['client_port']}"
            f", data in {root / name}"
        )
    return 0
