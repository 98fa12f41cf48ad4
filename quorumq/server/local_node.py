"""A quorumq node inside the caller's own process: `quorumq.Node`, `quorumq.aio.Node`.

    with quorumq.Node(id="A", data_dir="data/A", raft="10.0.0.1:8001",
                      peers={"B": "10.0.0.2:8001", "C": "10.0.0.3:8001"},
                      secret=secret) as node:
        client = node.client()
        for delivery in client.subscribe("jobs"):
            ...

Three instances of a program, each with one node, replicate one log between them; each
instance's consumers get their deliveries from the replica in their own process, over
an in-process connection (`quorumq.wire.inprocess`): no socket, no encoding, and the same
prefetch, ack, redelivery and bounds as over TCP. `listen="host:port"` also opens a
client port, so other programs use the node as any other (its token and TLS required
as on a node process).

`quorumq node` runs the same code (`AsyncNode.from_config`): one start-up, one stop.
`AsyncNode` serves in the caller's trio loop; `Node` runs that in a thread of its own,
beside the Raft thread. Leaving the block ends the node's connections (their consumers'
`Down`s applied, so their messages go to the other nodes' consumers at once), hands
leadership over if the node leads, stops the replica and closes the journal: no thread
and no open file is left behind, and a node started again on the same `data_dir`
recovers, as a node process does.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import weakref
from collections.abc import AsyncIterator, Mapping
from typing import Any, Required, TypedDict, Unpack

import trio

from ..client.aio import AsyncClient, only_exception
from ..client.aio import connect as aio_connect
from ..client.blocking import Client
from ..client.core import ConnectionLostError
from ..node import NodeConfig, check_node_config
from ..raft.member import Fsync
from ..raft.wal import JournalKind
from ..replica import ConfigError, ReplicaConfig
from ..wire.inprocess import ThreadEnd, TrioEnd
from ..wire.protocol import DEFAULT_MAX_BODY
from .node import NodeServer
from .startup import in_own_thread, lock_data_dir, tls_context

logger = logging.getLogger(__name__)


class NodeSettings(TypedDict, total=False):
    """What `quorumq.Node(...)`, `quorumq.aio.Node(...)` and `node_config` take."""

    id: Required[str]
    """This node's name (as consumers' `node` names it in the log)."""
    data_dir: Required[str | os.PathLike[str]]
    """Its journal and snapshots; a node started again on it recovers."""
    raft: Required[str]
    """Its Raft address, "host:port"."""
    peers: Required[Mapping[str, str]]
    """The other members: name -> Raft address (this node may be among them)."""
    secret: Required[str | None]
    """The cluster secret: Raft traffic is authenticated and encrypted with it (PySyncObj's
    password). None only with `insecure` and loopback Raft addresses."""
    listen: str | None
    """Also serve clients of other programs on this "host:port" (port 0: any free one);
    None (the default): clients in this process only."""
    token: str | None
    """What clients on `listen` prove they know (required with `listen`, unless
    `insecure` on loopback). Clients in this process need none."""
    admin_token: str | None
    """What clients on `listen` prove for administrative verbs (membership, audits)."""
    insecure: bool
    """No secret, and no token on a loopback `listen`: for tests and local clusters."""
    tls_cert: str | None
    """PEM certificate of the `listen` port: its clients then connect over TLS only."""
    tls_key: str | None
    """PEM file of `tls_cert`'s private key."""
    fsync: Fsync
    """"always" (the default), "batch" or "never" (see the README)."""
    journal: JournalKind
    """"file" (the default) or "wal": the Raft journal (`quorumq.raft.wal`)."""
    groups: int
    """Raft groups the node hosts, queues placed over them (1, the default; every node
    of a cluster the same, for good: `quorumq.replica.groups`)."""
    node_down_grace_s: float
    election_timeout_s: tuple[float, float]
    compaction_entries: int
    max_body: int
    outbound_frames: int
    outbound_bytes: int
    min_free_disk_bytes: int
    """Raise the disk alarm below this much free space (default 64 MiB; 0: never)."""


def _address(text: str, what: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"{what} must be host:port, not {text!r}")
    return host, int(port)


def node_config(**settings: Unpack[NodeSettings]) -> NodeConfig:
    """The `NodeConfig` these settings make, checked (`ConfigError` says what is wrong):
    the one wiring of a node's settings, for `quorumq node` and `quorumq.Node` alike."""
    name, raft = settings["id"], settings["raft"]
    _address(raft, "the Raft address")
    peers = dict(settings["peers"])
    if peers.setdefault(name, raft) != raft:
        raise ConfigError(f"{name} is at {raft}, but its peers say {peers[name]}")
    insecure = settings.get("insecure", False)
    replica = ReplicaConfig(
        node_id=name,
        peers=peers,
        data_dir=os.fspath(settings["data_dir"]),
        secret=settings["secret"],
        insecure=insecure,
        fsync=settings.get("fsync", "always"),
        journal=settings.get("journal", "file"),
        node_down_grace_s=settings.get("node_down_grace_s", 5.0),
        raft_timeouts=settings.get("election_timeout_s", (0.25, 0.6)),
        compaction_entries=settings.get("compaction_entries", 50_000),
        groups=settings.get("groups", 1),
    )
    listen = settings.get("listen")
    host, port = ("127.0.0.1", None) if listen is None else _address(listen, "listen")
    defaults = NodeConfig(replica=replica, insecure=True)
    config = NodeConfig(
        replica=replica,
        listen_host=host,
        listen_port=port,
        token=settings.get("token"),
        admin_token=settings.get("admin_token"),
        insecure=insecure,
        max_body=settings.get("max_body", DEFAULT_MAX_BODY),
        outbound_frames=settings.get("outbound_frames", defaults.outbound_frames),
        outbound_bytes=settings.get("outbound_bytes", defaults.outbound_bytes),
        min_free_disk_bytes=settings.get("min_free_disk_bytes", defaults.min_free_disk_bytes),
        tls_cert=settings.get("tls_cert"),
        tls_key=settings.get("tls_key"),
    )
    check_node_config(config)
    tls_context(config)  # the certificate and its key load, or one line says why
    return config


class AsyncNode:
    """A quorumq node serving in the caller's trio loop (`quorumq.aio.Node`):

        async with quorumq.aio.Node(id="A", ...) as node:
            async with node.client() as client:
                ...

    Its Raft member runs on a thread of its own (PySyncObj's tick thread); everything
    else on the caller's loop."""

    def __init__(self, **settings: Unpack[NodeSettings]) -> None:
        """See `NodeSettings` (`ConfigError` for settings a node cannot serve)."""
        self._setup(node_config(**settings))

    @classmethod
    def from_config(
        cls,
        config: NodeConfig,
        *,
        metrics: tuple[str, int] | None = None,
        own_process: bool = False,
    ) -> AsyncNode:
        """A node of `config`. `metrics`: serve Prometheus metrics on this (host, port).
        `own_process`: the node is its process's only job (`quorumq node`): what its
        start-up made is frozen out of the garbage collector's sight (`gc.freeze`),
        which a node in another program's process must not do to that program."""
        node = cls.__new__(cls)
        node._setup(config, metrics, own_process)
        return node

    def _setup(
        self,
        config: NodeConfig,
        metrics: tuple[str, int] | None = None,
        own_process: bool = False,
    ) -> None:
        self.config = config
        self.id = config.replica.node_id
        self.server = NodeServer(config, metrics=metrics, freeze_startup=own_process)
        self._stack = contextlib.AsyncExitStack()

    @property
    def address(self) -> str | None:
        """Where the client port listens ("host:port"), or None without one."""
        if not self.server.listeners:
            return None
        host, port = self.server.listeners[0].socket.getsockname()[:2]
        return f"{host}:{port}"

    def status(self) -> dict[str, Any]:
        """The node's status, as `client.status()` gives it."""
        return self.server.status()

    async def __aenter__(self) -> AsyncNode:
        """Take the data directory (`ConfigError` if another node has it), start the
        replica and serve; errors of the start-up are raised as they are."""
        stack = self._stack
        try:
            stack.callback(os.close, lock_data_dir(self.config.replica.data_dir))
            await self.server.start()
            nursery = await stack.enter_async_context(trio.open_nursery())
            stack.callback(nursery.cancel_scope.cancel)
            await nursery.start(self.server.run)
        except BaseException:
            if self.server._replica is not None:  # `run` did not start: stop it here
                replica = self.server._replica
                with trio.CancelScope(shield=True):
                    await in_own_thread(replica.stop, name=f"quorumq-stop-{self.id}")
            await stack.aclose()
            raise
        return self

    async def __aexit__(self, *exc: Any) -> bool | None:
        """Stop (see the module's docstring). An exception raised in the block comes out
        as itself, as from `quorumq.aio.connect` (the node's nursery wrapped it in an
        `ExceptionGroup`); only several at once stay a group."""
        try:
            return await self._stack.__aexit__(*exc)
        except BaseExceptionGroup as group:
            only = only_exception(group)
            if only is None:
                raise
            raise only from None

    @contextlib.asynccontextmanager
    async def client(self, **options: Any) -> AsyncIterator[AsyncClient]:
        """A trio client of this node, over an in-process connection, for the `async
        with` block: the verbs and options of `quorumq.aio.connect` (no token or TLS)."""
        async with aio_connect(_TrioDialer(self.server), **options) as client:
            yield client


class _TrioDialer:
    """How the trio client reaches its node in the same loop."""

    def __init__(self, server: NodeServer) -> None:
        self.server = server
        self.targets = [f"node {server.node_id} (in this process)"]

    async def dial(self, target: int) -> TrioEnd:
        await trio.lowlevel.checkpoint()
        try:
            to_client, to_node = self.server.open_local_connection()
        except ConfigError as e:
            raise ConnectionLostError(str(e)) from None
        return TrioEnd(to_client, to_node, trio.lowlevel.current_trio_token())


class Node:
    """A quorumq node inside this process (`quorumq.Node`), for programs without trio:

        with quorumq.Node(id="A", ...) as node:
            client = node.client()

    It serves on a thread of its own (a trio loop), beside its Raft thread; `start` (or
    entering the block) returns once it serves, `stop` (or leaving it) once every one
    of its threads has ended. A program that exits without stopping it stops it then
    (`atexit`), rather than wait for its threads for ever or cut them off."""

    def __init__(self, **settings: Unpack[NodeSettings]) -> None:
        """See `NodeSettings` (`ConfigError` for settings a node cannot serve)."""
        self._setup(AsyncNode(**settings))

    @classmethod
    def from_config(cls, config: NodeConfig, *, metrics: tuple[str, int] | None = None) -> Node:
        """A node of `config` (`metrics`: as `AsyncNode.from_config`'s)."""
        node = cls.__new__(cls)
        node._setup(AsyncNode.from_config(config, metrics=metrics))
        return node

    def _setup(self, node: AsyncNode) -> None:
        self._node = node
        self.id = node.id
        self.config = node.config
        self._thread: threading.Thread | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._stopping: trio.Event | None = None
        self._stop_asked = threading.Event()
        """`stop` was called (perhaps while `start` was still starting the node)."""
        self._clients: weakref.WeakSet[Client] = weakref.WeakSet()
        """Open or not, while the program holds them (a client per request must not pile
        up here)."""
        self._lock = threading.Lock()
        self.error: BaseException | None = None
        """Why the node stopped by itself (its journal failed, say), if it did."""

    @property
    def server(self) -> NodeServer:
        return self._node.server

    @property
    def address(self) -> str | None:
        """Where the client port listens ("host:port"), or None without one."""
        return self._node.address

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def status(self) -> dict[str, Any]:
        """The node's status, as `client.status()` gives it (taken on the node's loop:
        its state is that thread's alone). `RuntimeError` if it is not running."""
        token = self._token
        if token is None:
            raise RuntimeError(f"node {self.id} is not running")
        status: dict[str, Any] = trio.from_thread.run_sync(self.server.status, trio_token=token)
        return status

    def start(self) -> Node:
        """Start the node; return once it serves. Errors of the start-up are raised here
        (`ConfigError` for a data directory another node has, `OSError` for a Raft port
        in use, ...)."""
        if self._thread is not None or self._stop_asked.is_set():
            raise RuntimeError(f"node {self.id} was started or stopped already: make a new one")
        started = threading.Event()
        failure: list[BaseException] = []
        thread = threading.Thread(
            target=self._run, args=(started, failure), name=f"quorumq-node-{self.id}", daemon=True
        )
        thread.start()
        with self._lock:  # (a stop from now on joins it; one before saw none, and asked)
            self._thread = thread
        atexit.register(self.stop)
        started.wait()
        if failure:
            thread.join()
            atexit.unregister(self.stop)
            raise failure[0]
        return self

    def _run(self, started: threading.Event, failure: list[BaseException]) -> None:
        async def serve() -> None:
            async with self._node:
                self._stopping = trio.Event()
                self._token = trio.lowlevel.current_trio_token()
                started.set()
                if not self._stop_asked.is_set():  # (a stop while it started: it saw no token)
                    await self._stopping.wait()

        try:
            trio.run(serve)
        except BaseException as e:
            if not started.is_set():
                failure.append(e)
            else:
                logger.critical("node %s stopped: %r", self.id, e)
                self.error = e
        finally:
            self._token = None
            started.set()

    def client(self, **options: Any) -> Client:
        """A blocking client of this node, over an in-process connection: the verbs and
        options of `quorumq.connect` (no token or TLS). Closed when the node stops."""
        with self._lock:
            client = Client(_ThreadDialer(self), **options)
            self._clients.add(client)
        return client

    def stop(self) -> None:
        """Close the node's clients, stop the node (see the module's docstring); return
        once its threads have ended. Idempotent."""
        atexit.unregister(self.stop)
        self._stop_asked.set()
        with self._lock:
            clients, self._clients = list(self._clients), weakref.WeakSet()
        for client in clients:
            client.close()
        token, stopping = self._token, self._stopping
        if token is not None and stopping is not None:
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(stopping.set)
        with self._lock:
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def __enter__(self) -> Node:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.stop()


class _ThreadDialer:
    """How the blocking client reaches its node in this process."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.targets = [f"node {node.id} (in this process)"]

    def dial(self, target: int, timeout: float, welcome_s: float | None = None) -> ThreadEnd:
        """`welcome_s` does not apply: a node in this process has no port that could be
        another service's, and its welcome is waited for up to `timeout`."""
        token = self.node._token
        if token is None:
            raise ConnectionLostError(f"node {self.node.id} is not running")
        try:
            to_client, to_node = trio.from_thread.run_sync(
                self.node.server.open_local_connection, trio_token=token
            )
        except (trio.RunFinishedError, ConfigError) as e:
            raise ConnectionLostError(f"node {self.node.id} is not running ({e})") from None
        return ThreadEnd(to_client, to_node, timeout)
