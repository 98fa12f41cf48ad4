"""Three copies of a small worker service, each with a quorumq node inside.

    python examples/embedded_service.py [--jobs 60]

starts three copies of the service below on loopback (three processes, no broker). They
replicate one log between them; each copy consumes jobs from the node in its own
process. The demo publishes jobs through one copy's client port, kills one copy with
SIGKILL while it holds unacked jobs, and shows the other two doing those jobs. It exits
with status 0 once every job is done (1 if one is missing).

A copy alone, as a service would run it (the secret and the token from the environment,
QUORUMQ_SECRET and QUORUMQ_TOKEN):

    python examples/embedded_service.py worker --name A --data-dir data/A \\
        --raft 127.0.0.1:7101 --listen 127.0.0.1:7001 \\
        --peer B=127.0.0.1:7102 --peer C=127.0.0.1:7103
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import quorumq


def serve(name: str, data_dir: str, raft: str, listen: str, peers: dict[str, str]) -> None:
    """The service: a node inside, and a worker that takes its jobs from that node."""
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    with quorumq.Node(
        id=name,
        data_dir=data_dir,
        raft=raft,
        peers=peers,
        secret=os.environ["QUORUMQ_SECRET"],
        listen=listen,  # other programs may publish through this copy's client port
        token=os.environ["QUORUMQ_TOKEN"],
        node_down_grace_s=1.0,  # a copy gone this long gives its unacked jobs back
    ) as node:
        client = node.client()  # in-process: no socket, no encoding
        client.declare("jobs")
        jobs = client.subscribe("jobs", prefetch=10)
        print(f"{name} ready", flush=True)
        while not stopping.is_set():
            job = jobs.get(timeout=0.2)
            if job is None:
                continue
            time.sleep(0.05)  # the work
            again = " (again: its first worker went away)" if job.redelivered else ""
            print(f"{name} did {job.body.decode()}{again}", flush=True)
            job.ack()
    # leaving the block: leadership handed over if this copy led, journal closed


def _free_ports(count: int) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def demo(jobs: int) -> int:
    """Start three copies, publish `jobs` jobs, kill one copy midway; 0 once all are done."""
    names = ["A", "B", "C"]
    raft = dict(zip(names, _free_ports(3), strict=True))
    client_ports = dict(zip(names, _free_ports(3), strict=True))
    env = {**os.environ, "QUORUMQ_SECRET": secrets.token_hex(16)}
    env["QUORUMQ_TOKEN"] = token = secrets.token_hex(16)
    done: dict[str, list[str]] = {name: [] for name in names}
    again: list[str] = []
    with tempfile.TemporaryDirectory(prefix="embedded-service-") as root:
        copies = {}
        for name in names:
            command = [sys.executable, __file__, "worker", "--name", name]
            command += ["--data-dir", os.path.join(root, name)]
            command += ["--raft", f"127.0.0.1:{raft[name]}"]
            command += ["--listen", f"127.0.0.1:{client_ports[name]}"]
            for other in names:
                if other != name:
                    command += ["--peer", f"{other}=127.0.0.1:{raft[other]}"]
            copies[name] = subprocess.Popen(
                command, env=env, stdout=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL
            )
        ready = threading.Barrier(len(names) + 1)

        def follow(name: str) -> None:
            stdout = copies[name].stdout
            assert stdout is not None
            for line in stdout:
                print(line, end="", flush=True)
                if line.strip() == f"{name} ready":
                    ready.wait()
                elif " did " in line:
                    job = line.split(" did ")[1].split(" ")[0].strip()
                    done[name].append(job)
                    if "(again" in line:
                        again.append(job)

        readers = [threading.Thread(target=follow, args=(n,), daemon=True) for n in names]
        for reader in readers:
            reader.start()
        try:
            ready.wait(timeout=60)
            victim = "B"
            with quorumq.connect(f"127.0.0.1:{client_ports['A']}", token) as client:
                for i in range(jobs):
                    client.publish("jobs", f"job-{i}".encode())
                    if i == jobs // 2:
                        # kill one copy while it holds unacked jobs (up to its prefetch)
                        copies[victim].kill()
                        print(f"-- killed copy {victim} (SIGKILL)", flush=True)
                wanted = {f"job-{i}" for i in range(jobs)}
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    if wanted <= {job for did in done.values() for job in did}:
                        break
                    time.sleep(0.1)
        finally:
            for copy in copies.values():
                if copy.poll() is None:
                    copy.terminate()
            for copy in copies.values():
                try:
                    copy.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    copy.kill()
                    copy.wait()
            for reader in readers:
                reader.join(timeout=5)
    seen = {job for did in done.values() for job in did}
    missing = sorted(wanted - seen, key=lambda job: int(job.split("-")[1]))
    by = ", ".join(f"{name} {len(did)}" for name, did in done.items())
    if missing:
        print(f"-- {len(missing)} of {jobs} jobs never done: {missing}", flush=True)
        return 1
    print(
        f"-- all {jobs} jobs done (by copy: {by}); copy {victim} was killed holding "
        f"{len(again)}, which the others did again",
        flush=True,
    )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command")
    worker = commands.add_parser("worker", help="run one copy of the service")
    worker.add_argument("--name", required=True)
    worker.add_argument("--data-dir", required=True)
    worker.add_argument("--raft", required=True, help="this copy's Raft address host:port")
    worker.add_argument("--listen", required=True, help="its client port host:port")
    worker.add_argument("--peer", action="append", default=[], help="NAME=host:port")
    parser.add_argument("--jobs", type=int, default=60, help="jobs the demo publishes")
    args = parser.parse_args()
    if args.command == "worker":
        peers = dict(peer.split("=", 1) for peer in args.peer)
        serve(args.name, args.data_dir, args.raft, args.listen, peers)
        return 0
    return demo(args.jobs)


if __name__ == "__main__":
    sys.exit(main())
