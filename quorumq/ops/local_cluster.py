"""A local cluster of real node processes on loopback, for tests, demos and programs.

    with Cluster(n=3) as cluster:
        client = cluster.client()
        ...
        cluster.kill(cluster.leader())

Each node is a `python -m quorumq node` process with its own data dir, ports picked on
127.0.0.1 and a random cluster secret. With `tls=True` the nodes serve clients over TLS
with a certificate from a throwaway CA made for the cluster (`tls_ca`), which the
cluster's own clients trust. The cluster stops every process it started (and
only those, by PID) when the `with` block ends.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import resource
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from ..client import Client, QuorumqError

NODE_NAMES = "ABCDEFG"


@attrs.frozen(kw_only=True)
class Certificates:
    """PEM files: a throwaway certificate authority (`ca`), and a certificate it signed
    (`cert`, with its private key `key`) for a node's client port."""

    ca: Path
    cert: Path
    key: Path


def make_certificates(
    directory: str | Path,
    hosts: tuple[str, ...] = ("127.0.0.1", "localhost"),
    *,
    days: int = 30,
) -> Certificates:
    """A new CA, and a server certificate it signed for `hosts` (IP addresses or DNS
    names), written to `directory` (the key readable by its owner only). For tests and
    local clusters: a real deployment's certificates come from its own CA."""
    from cryptography import x509  # noqa: PLC0415 - only clusters with TLS need it
    from cryptography.hazmat.primitives import hashes, serialization  # noqa: PLC0415
    from cryptography.hazmat.primitives.asymmetric import ec  # noqa: PLC0415
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID  # noqa: PLC0415

    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    valid = (now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days))

    def name(common: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = name(f"quorumq test CA {secrets.token_hex(4)}")
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(valid[0])
        .not_valid_after(valid[1])
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(ca_ski, critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    alt_names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            alt_names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            alt_names.append(x509.DNSName(host))
    cert = (
        x509.CertificateBuilder()
        .subject_name(name(hosts[0]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(valid[0])
        .not_valid_after(valid[1])
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    files = Certificates(ca=root / "ca.pem", cert=root / "node.pem", key=root / "node.key")
    files.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    fd = os.open(files.key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
    return files


def free_ports(n: int) -> list[int]:
    """Ports on 127.0.0.1 that were free a moment ago (bound together, then released)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class Cluster:
    def __init__(
        self,
        n: int = 3,
        data_dir: str | None = None,
        *,
        token: str | None = None,
        fsync: str = "always",
        journal: str = "file",
        node_down_grace: float = 5.0,
        compaction_entries: int = 50_000,
        outbound_frames: int = 20_000,
        max_body: int = 1024 * 1024,
        election_timeout: tuple[float, float] = (0.25, 0.6),
        log_level: str = "warning",
        metrics: bool = False,
        tls: bool | Certificates = False,
        file_limit: int | None = None,
        min_free_disk_mb: int | None = None,
        groups: int = 1,
    ) -> None:
        """`metrics`: each node serves Prometheus metrics on a port of its own
        (`metrics_url`). `tls`: the nodes serve clients over TLS only, True with a
        certificate for 127.0.0.1 from a CA made for this cluster (`make_certificates`,
        in its directory), or with the given one; `tls_ca` is the CA's file, which the
        clients the cluster makes trust. `file_limit`: each node process runs with this
        open file limit, soft and hard (as under `ulimit -n`). `min_free_disk_mb`: the
        nodes' `--min-free-disk` (the disk alarm's limit; the default otherwise).
        `groups`: the Raft groups each node hosts (`--groups`)."""
        if not 1 <= n <= len(NODE_NAMES):
            raise ValueError(f"n must be between 1 and {len(NODE_NAMES)}")
        self._tmp = tempfile.TemporaryDirectory(prefix="quorumq-") if data_dir is None else None
        self.root = Path(data_dir if data_dir is not None else self._tmp.name)  # type: ignore[union-attr]
        self.root.mkdir(parents=True, exist_ok=True)
        self.nodes = list(NODE_NAMES[:n])
        ports = free_ports(2 * n)
        self.client_ports = dict(zip(self.nodes, ports[:n], strict=True))
        self.raft_ports = dict(zip(self.nodes, ports[n:], strict=True))
        self.metrics_ports: dict[str, int] = (
            dict(zip(self.nodes, free_ports(n), strict=True)) if metrics else {}
        )
        self.token = token
        self.fsync = fsync
        self.journal = journal
        self.node_down_grace = node_down_grace
        self.compaction_entries = compaction_entries
        self.outbound_frames = outbound_frames
        self.max_body = max_body
        self.election_timeout = election_timeout
        self.log_level = log_level
        self.file_limit = file_limit
        self.min_free_disk_mb = min_free_disk_mb
        self.groups = groups
        self.tls: Certificates | None = (
            make_certificates(self.root / "tls") if tls is True else tls or None
        )
        self.tls_ca: str | None = str(self.tls.ca) if self.tls is not None else None
        """The CA file a client of this cluster passes as `tls=` (None: no TLS)."""
        self._secret = secrets.token_hex(16)
        self.admin_token = secrets.token_hex(16)
        """For membership changes (`add_node`, `remove_node`) when the cluster has a token."""
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._ready_mark: dict[str, int] = {}
        """Per node: "ready" lines in its log before its latest start."""
        self._first_peers: dict[str, list[str]] = {}
        """Per node: the other members it was first started with. It is started again with
        the same `--peer` flags whatever the membership is now: a node refuses other
        peers than its data directory was first started with (the log and snapshots
        carry the changes since; `quorumq.raft.first_configuration`)."""
        self._clients: list[Client] = []

    # --------------------------------------------------------------- processes

    def __enter__(self) -> Cluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    def start(self) -> None:
        for node in self.nodes:
            self._spawn(node)
        for node in self.nodes:
            self._wait_ready_moving_a_taken_client_port(node)

    def _wait_ready_moving_a_taken_client_port(self, node: str, tries: int = 3) -> None:
        """Wait for a first start; if the node found its client port taken, start it
        again on another. A port picked free (`free_ports`) can be taken before the
        node binds it, by another connection's ephemeral port (a suite's other tests
        make plenty): the client port is the cluster's to choose, unlike the Raft
        port its peers already know."""
        for attempt in range(tries):
            try:
                self._wait_ready(node)
                return
            except RuntimeError as e:
                taken = "the client port" in str(e) and "Address already in use" in str(e)
                if not taken or attempt == tries - 1:
                    raise
            self.client_ports[node] = free_ports(1)[0]
            self._spawn(node)

    def log_path(self, node: str) -> Path:
        return self.root / f"{node}.log"

    def _spawn(self, node: str, secret: str | None = None) -> None:
        args = [
            sys.executable,
            "-m",
            "quorumq",
            "node",
            "--id",
            node,
            "--data-dir",
            str(self.root / node),
            "--listen",
            f"127.0.0.1:{self.client_ports[node]}",
            "--raft",
            f"127.0.0.1:{self.raft_ports[node]}",
            "--fsync",
            self.fsync,
            "--journal",
            self.journal,
            "--node-down-grace",
            str(self.node_down_grace),
            "--compaction-entries",
            str(self.compaction_entries),
            "--outbound-frames",
            str(self.outbound_frames),
            "--max-body",
            str(self.max_body),
            "--election-timeout",
            f"{self.election_timeout[0]},{self.election_timeout[1]}",
            "--log-level",
            self.log_level,
        ]
        peers = self._first_peers.setdefault(node, [n for n in self.nodes if n != node])
        for other in peers:
            args += ["--peer", f"{other}=127.0.0.1:{self.raft_ports[other]}"]
        if node in self.metrics_ports:
            args += ["--metrics", f"127.0.0.1:{self.metrics_ports[node]}"]
        if self.min_free_disk_mb is not None:
            args += ["--min-free-disk", str(self.min_free_disk_mb)]
        if self.groups != 1:
            args += ["--groups", str(self.groups)]
        if self.tls is not None:
            args += ["--tls-cert", str(self.tls.cert), "--tls-key", str(self.tls.key)]
        env = {**os.environ, "QUORUMQ_SECRET": secret or self._secret}
        env.pop("QUORUMQ_TOKEN", None)
        env.pop("QUORUMQ_ADMIN_TOKEN", None)
        if self.token is not None:
            env["QUORUMQ_TOKEN"] = self.token
            env["QUORUMQ_ADMIN_TOKEN"] = self.admin_token
        else:
            args.append("--insecure")  # loopback only, no client token: a test cluster
        log = open(self.log_path(node), "ab")  # noqa: SIM115 - the child owns it from here
        try:
            self._procs[node] = subprocess.Popen(
                args,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                stdin=subprocess.DEVNULL,
                preexec_fn=_file_limit(self.file_limit),  # noqa: PLW1509 (no threads in it)
            )
        finally:
            log.close()
        self._ready_mark[node] = self.log_path(node).read_bytes().count(b" ready: ")

    def _wait_ready(self, node: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        proc = self._procs[node]
        while self.log_path(node).read_bytes().count(b" ready: ") <= self._ready_mark[node]:
            if proc.poll() is not None:
                tail = self.log_path(node).read_text(errors="replace")[-2000:]
                raise RuntimeError(f"node {node} exited with {proc.returncode}:\n{tail}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"node {node} not ready after {timeout} s")
            time.sleep(0.02)

    def pid(self, node: str) -> int:
        return self._procs[node].pid

    def kill(self, node: str) -> None:
        """SIGKILL the node's process (no clean shutdown)."""
        proc = self._procs[node]
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)  # a paused process dies at once too
            proc.kill()
        proc.wait(timeout=10)

    def restart(self, node: str, *, secret: str | None = None) -> None:
        """Start the node again on its data dir (after `kill` or a clean stop); with
        `secret`, under another cluster secret than its peers (to see it refused)."""
        if self._procs[node].poll() is None:
            raise RuntimeError(f"node {node} is still running")
        self._spawn(node, secret)
        self._wait_ready(node)

    def add_node(self) -> str:
        """Start one more node and add it to the cluster online; return its name."""
        free = [n for n in NODE_NAMES if n not in self._procs]
        if not free:
            raise ValueError(f"at most {len(NODE_NAMES)} nodes")
        node = free[0]
        client_port, raft_port, metrics_port = free_ports(3)
        self.client_ports[node] = client_port
        self.raft_ports[node] = raft_port
        if self.metrics_ports:
            self.metrics_ports[node] = metrics_port
        members = list(self.nodes)
        self.nodes.append(node)
        self._spawn(node)
        self._wait_ready(node)
        with Client(
            [self.endpoint(n) for n in members],
            self.token,
            admin_token=self.admin_token,
            tls=self.tls_ca,
        ) as client:
            client.add_member(node, f"127.0.0.1:{raft_port}")
        return node

    def remove_node(self, node: str) -> None:
        """Remove `node` from the cluster online, then stop its process."""
        others = [n for n in self.nodes if n != node and self.alive(n)]
        with Client(
            [self.endpoint(n) for n in others],
            self.token,
            admin_token=self.admin_token,
            tls=self.tls_ca,
        ) as client:
            client.remove_member(node)
        self.nodes.remove(node)
        proc = self._procs[node]
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)

    def pause(self, node: str) -> None:
        self._procs[node].send_signal(signal.SIGSTOP)

    def resume(self, node: str) -> None:
        self._procs[node].send_signal(signal.SIGCONT)

    def alive(self, node: str) -> bool:
        return self._procs[node].poll() is None

    def stop(self) -> None:
        """Stop every node this cluster started: SIGTERM, then SIGKILL after 10 s."""
        for client in self._clients:
            client.close()
        self._clients.clear()
        for proc in self._procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.terminate()
        for proc in self._procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    # ----------------------------------------------------------------- clients

    @property
    def endpoints(self) -> list[str]:
        return [self.endpoint(n) for n in self.nodes]

    def endpoint(self, node: str) -> str:
        return f"127.0.0.1:{self.client_ports[node]}"

    def metrics_url(self, node: str) -> str:
        """Where `node` serves its Prometheus metrics (a cluster made with `metrics=True`)."""
        return f"http://127.0.0.1:{self.metrics_ports[node]}/metrics"

    def client(self, node: str | None = None, **options: Any) -> Client:
        """A connected blocking client (to `node` first, if given); closed with the cluster.
        Over TLS, trusting `tls_ca`, if the cluster serves TLS (unless `tls=` is given)."""
        order = self.nodes if node is None else [node] + [n for n in self.nodes if n != node]
        options = {"tls": self.tls_ca, **options}
        client = Client([self.endpoint(n) for n in order], self.token, **options)
        self._clients.append(client)
        return client

    def status(self, node: str, *, audit: bool = False) -> dict[str, Any]:
        """`node`'s status (`audit`: with the state digest, which hashes every message)."""
        admin = self.admin_token if audit else None  # an audit is administrative
        with Client(
            [self.endpoint(node)],
            self.token,
            connect_timeout=2.0,
            admin_token=admin,
            tls=self.tls_ca,
        ) as client:
            return client.status(audit=audit)

    def leader(self, timeout: float = 15.0) -> str:
        """The node every live node agrees leads (waits for an election to settle)."""
        deadline = time.monotonic() + timeout
        while True:
            seen = set()
            for node in self.nodes:
                if not self.alive(node):
                    continue
                try:
                    seen.add(self.status(node)["leader"])
                except (QuorumqError, OSError):
                    seen.add(None)
            if len(seen) == 1 and None not in seen:
                leader: str = seen.pop()
                if self.alive(leader):  # survivors name the dead one until they elect
                    return leader
            if time.monotonic() > deadline:
                raise RuntimeError(f"no agreed leader after {timeout} s (seen {seen})")
            time.sleep(0.05)


def _file_limit(limit: int | None) -> Callable[[], None] | None:
    """For `Popen`'s `preexec_fn`: the child's open file limit, soft and hard."""
    if limit is None:
        return None
    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
