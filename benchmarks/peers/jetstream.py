"""A 3-server NATS JetStream cluster on loopback, each server with its own file store.

Client, cluster-route and monitoring ports are picked free on 127.0.0.1; every server
is a child process of this one and is stopped by its PID.

    python -m benchmarks peers nats   # start, print the endpoints, stop on Enter
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import urllib.request
from pathlib import Path

from quorumq.embedded import free_ports

from .common import stop_process, wait_until

INSTALL_HINT = "sudo apt-get install -y nats-server"


def nats_missing() -> str | None:
    """Why the NATS comparison cannot run here, or None if it can."""
    if shutil.which("nats-server") is None:
        return f"NATS server is not installed: {INSTALL_HINT}"
    try:
        import nats  # noqa: F401
    except ImportError:
        return "the NATS client is missing: pip install -e '.[bench]'"
    return None


class NatsCluster:
    """Three nats-server processes (`n1..n3`) in one JetStream cluster."""

    def __init__(self, n: int = 3, root: str | None = None) -> None:
        self._tmp = None if root else tempfile.TemporaryDirectory(prefix="quorumq-nats-")
        self.root = Path(root or self._tmp.name)  # type: ignore[union-attr]
        self.servers = [f"n{i}" for i in range(1, n + 1)]
        ports = free_ports(3 * n)
        self.client_ports = dict(zip(self.servers, ports[:n], strict=True))
        self.route_ports = dict(zip(self.servers, ports[n : 2 * n], strict=True))
        self.http_ports = dict(zip(self.servers, ports[2 * n :], strict=True))
        self._procs: dict[str, subprocess.Popen[bytes]] = {}

    def __enter__(self) -> NatsCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    def start(self) -> None:
        routes = ", ".join(f"nats-route://127.0.0.1:{p}" for p in self.route_ports.values())
        for server in self.servers:
            d = self.root / server
            (d / "store").mkdir(parents=True, exist_ok=True)
            (d / "nats.conf").write_text(
                f"server_name: {server}\n"
                f"listen: 127.0.0.1:{self.client_ports[server]}\n"
                f"http: 127.0.0.1:{self.http_ports[server]}\n"
                f'jetstream {{ store_dir: "{d / "store"}", max_memory_store: 1G, '
                "max_file_store: 20G }\n"
                "cluster {\n  name: quorumqbench\n"
                f"  listen: 127.0.0.1:{self.route_ports[server]}\n"
                f"  routes: [ {routes} ]\n}}\n"
            )
            self._spawn(server)
        wait_until(self._has_meta_leader, 60, "a JetStream meta leader", interval=0.2)

    def _spawn(self, server: str) -> None:
        d = self.root / server
        log = open(d / "server.log", "ab")  # noqa: SIM115 - the child owns it
        try:
            self._procs[server] = subprocess.Popen(
                ["nats-server", "-c", str(d / "nats.conf")],
                env={**os.environ, "GOMAXPROCS": os.environ.get("GOMAXPROCS", "2")},
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            log.close()

    def _jsz(self, server: str) -> dict[str, object]:
        url = f"http://127.0.0.1:{self.http_ports[server]}/jsz"
        with urllib.request.urlopen(url, timeout=2) as answer:
            jsz: dict[str, object] = json.load(answer)
            return jsz

    def _has_meta_leader(self) -> bool:
        for server in self.servers:
            if self.alive(server):
                try:
                    meta = self._jsz(server).get("meta_cluster")
                except OSError:
                    return False
                if not isinstance(meta, dict) or not meta.get("leader"):
                    return False
        return True

    def pids(self) -> dict[str, int]:
        return {s: p.pid for s, p in self._procs.items() if p.poll() is None}

    def alive(self, server: str) -> bool:
        return server in self._procs and self._procs[server].poll() is None

    def kill(self, server: str) -> None:
        self._procs[server].kill()
        self._procs[server].wait(timeout=30)

    def restart(self, server: str) -> None:
        if self.alive(server):
            raise RuntimeError(f"{server} is still running")
        self._spawn(server)
        wait_until(self._has_meta_leader, 60, f"{server} back in the cluster", interval=0.2)

    def stop(self) -> None:
        for proc in self._procs.values():
            stop_process(proc)
        self._procs.clear()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def url(self, server: str) -> str:
        return f"nats://127.0.0.1:{self.client_ports[server]}"
