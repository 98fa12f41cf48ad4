"""A 3-node RabbitMQ cluster on loopback, started by hand (no systemd, no Debian service).

Every node gets its own name, ports, mnesia, log and pid paths under one temporary
directory; the nodes find each other through a private `epmd` on 127.0.0.1 and a port
this script picked, and share a cookie through `HOME`. Nodes 2 and 3 join node 1. Only
processes started here are stopped, by PID: the nodes' BEAM processes (from their pid
files), their wrapper shells, and the epmd.

    python -m benchmarks peers rabbitmq   # start, print the endpoints, stop on Enter
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from quorumq.ops.local_cluster import free_ports

from .common import (
    Countdown,
    Trace,
    message_body,
    message_index,
    publish_paced,
    publish_windowed,
    run_async_child,
    run_producer_processes,
    stop_process,
    wait_delivered,
    wait_until,
)

RABBIT_BIN = Path("/usr/lib/rabbitmq/bin")
INSTALL_HINT = "sudo apt-get install -y rabbitmq-server"


def rabbitmq_missing() -> str | None:
    """Why the RabbitMQ comparison cannot run here, or None if it can."""
    if not (RABBIT_BIN / "rabbitmq-server").exists() or shutil.which("epmd") is None:
        return f"RabbitMQ is not installed: {INSTALL_HINT}"
    try:
        import pika  # noqa: F401
    except ImportError:
        return "the RabbitMQ client is missing: pip install -e '.[bench]'"
    return None


class RabbitCluster:
    """Three RabbitMQ nodes (`qqbench1..3@localhost`) clustered on loopback ports."""

    def __init__(self, n: int = 3, root: str | None = None) -> None:
        self._tmp = None if root else tempfile.TemporaryDirectory(prefix="quorumq-rabbit-")
        self.root = Path(root or self._tmp.name)  # type: ignore[union-attr]
        self.nodes = [f"qqbench{i}@localhost" for i in range(1, n + 1)]
        ports = free_ports(1 + 2 * n)
        self.epmd_port = ports[0]
        self.amqp_ports = dict(zip(self.nodes, ports[1 : 1 + n], strict=True))
        self.dist_ports = dict(zip(self.nodes, ports[1 + n :], strict=True))
        self._epmd: subprocess.Popen[bytes] | None = None
        self._procs: dict[str, subprocess.Popen[bytes]] = {}

    def __enter__(self) -> RabbitCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    # -------------------------------------------------------------- environment

    def _env(self, node: str | None = None) -> dict[str, str]:
        env = {
            **os.environ,
            "HOME": str(self.root / "home"),  # the shared .erlang.cookie
            "ERL_EPMD_ADDRESS": "127.0.0.1",
            "ERL_EPMD_PORT": str(self.epmd_port),
            "RABBITMQ_USE_LONGNAME": "false",
            "PATH": f"{RABBIT_BIN}:{os.environ.get('PATH', '')}",
        }
        if node is not None:
            d = self._dir(node)
            env |= {
                "RABBITMQ_NODENAME": node,
                "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
                "RABBITMQ_NODE_PORT": str(self.amqp_ports[node]),
                "RABBITMQ_DIST_PORT": str(self.dist_ports[node]),
                "RABBITMQ_CONFIG_FILE": str(d / "rabbitmq"),
                "RABBITMQ_ADVANCED_CONFIG_FILE": str(d / "advanced.config"),
                "RABBITMQ_ENABLED_PLUGINS_FILE": str(d / "enabled_plugins"),
                "RABBITMQ_MNESIA_BASE": str(d / "mnesia"),
                "RABBITMQ_LOG_BASE": str(d / "log"),
                "RABBITMQ_PID_FILE": str(d / "pid"),
                # loopback only; schedulers sleep instead of spinning when idle (shared host)
                "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": (
                    "-kernel inet_dist_use_interface {127,0,0,1} "
                    "+sbwt none +sbwtdcpu none +sbwtdio none"
                ),
            }
        return env

    def _dir(self, node: str) -> Path:
        return self.root / node.split("@", maxsplit=1)[0]

    def ctl(self, *args: str, node: str | None = None, timeout: float = 120) -> str:
        """Run `rabbitmqctl -n node args...`; its stdout, or RuntimeError with its output."""
        node = node or self.nodes[0]
        done = subprocess.run(
            [str(RABBIT_BIN / "rabbitmqctl"), "-q", "-n", node, *args],
            env=self._env(),
            capture_output=True,
            timeout=timeout,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"rabbitmqctl {' '.join(args)} on {node} failed ({done.returncode}): "
                f"{(done.stdout + done.stderr).decode(errors='replace')[-1500:]}"
            )
        return done.stdout.decode()

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> None:
        home = self.root / "home"
        home.mkdir(parents=True, exist_ok=True)
        cookie = home / ".erlang.cookie"
        if not cookie.exists():
            cookie.write_text("QUORUMQBENCHCOOKIE")
            cookie.chmod(0o400)
        self._epmd = subprocess.Popen(
            ["epmd", "-address", "127.0.0.1", "-port", str(self.epmd_port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        for node in self.nodes:
            d = self._dir(node)
            (d / "log").mkdir(parents=True, exist_ok=True)
            (d / "mnesia").mkdir(parents=True, exist_ok=True)
            (d / "rabbitmq.conf").write_text(
                f"listeners.tcp.1 = 127.0.0.1:{self.amqp_ports[node]}\n"
                "loopback_users.guest = true\n"
                "vm_memory_high_watermark.relative = 0.2\n"
                "disk_free_limit.absolute = 1GB\n"
                "log.file.level = warning\n"
            )
            (d / "advanced.config").write_text("[].\n")
            (d / "enabled_plugins").write_text("[].\n")
            self._spawn(node)
        for node in self.nodes:
            self._await_startup(node)
        for node in self.nodes[1:]:
            self.ctl("stop_app", node=node)
            self.ctl("join_cluster", self.nodes[0], node=node)
            self.ctl("start_app", node=node)
        status = self.ctl("cluster_status", "--formatter", "json")
        missing = [n for n in self.nodes if n not in status]
        if missing:
            raise RuntimeError(f"RabbitMQ nodes {missing} did not join: {status}")

    def _spawn(self, node: str) -> None:
        pid_file = self._dir(node) / "pid"
        pid_file.unlink(missing_ok=True)
        log = open(self._dir(node) / "server.out", "ab")  # noqa: SIM115 - the child owns it
        try:
            self._procs[node] = subprocess.Popen(
                [str(RABBIT_BIN / "rabbitmq-server")],
                env=self._env(node),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            log.close()

    def _await_startup(self, node: str, timeout: float = 120) -> None:
        proc = self._procs[node]
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                out = (self._dir(node) / "server.out").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"RabbitMQ node {node} exited ({proc.returncode}):\n{out}")
            # await_startup fails at once while the node is not registered with epmd yet
            try:
                self.ctl("await_startup", "--timeout", "10", node=node, timeout=30)
                break
            except (RuntimeError, subprocess.TimeoutExpired):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        wait_until(lambda: self._pid_file(node) is not None, 30, f"{node}'s pid file")

    def _pid_file(self, node: str) -> int | None:
        try:
            return int((self._dir(node) / "pid").read_text().strip())
        except (OSError, ValueError):
            return None

    def pid(self, node: str) -> int:
        """The node's BEAM process."""
        pid = self._pid_file(node)
        if pid is None:
            raise RuntimeError(f"{node} has no pid file")
        return pid

    def pids(self) -> dict[str, int]:
        return {n: self.pid(n) for n in self.nodes if self.alive(n)}

    def alive(self, node: str) -> bool:
        return node in self._procs and self._procs[node].poll() is None

    def kill(self, node: str) -> None:
        """kill -9 the node's BEAM process; its wrapper shell exits after it."""
        os.kill(self.pid(node), 9)
        self._procs[node].wait(timeout=30)

    def restart(self, node: str) -> None:
        """Start a killed node again on its mnesia dir; it rejoins the cluster."""
        if self.alive(node):
            raise RuntimeError(f"{node} is still running")
        self._spawn(node)
        self._await_startup(node)

    def stop(self) -> None:
        """Stop every process started here (SIGTERM to each BEAM, then epmd)."""
        for node, proc in self._procs.items():
            stop_process(proc, self._pid_file(node) if proc.poll() is None else None)
        self._procs.clear()
        if self._epmd is not None:
            stop_process(self._epmd)
            self._epmd = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    # ------------------------------------------------------------------ queues

    def url(self, node: str) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.amqp_ports[node]}/"

    def queue_leader(self, queue: str) -> str:
        """The node that leads `queue` (a quorum queue), as its members agree."""
        for line in self.ctl("list_queues", "name", "leader", "--no-table-headers").splitlines():
            name, _, leader = line.partition("\t")
            if name == queue and leader.strip():
                return leader.strip()
        raise RuntimeError(f"no leader listed for quorum queue {queue}")


# ------------------------------------------------------------------ workloads

DURABILITY = "quorum queue, 3 members; persistent messages; Ra fdatasyncs its WAL before confirming"


class _Channel:
    """One pika connection and channel on the running asyncio loop, as awaitables.

    In confirm mode, `publish` returns a future that the broker's ack resolves; when the
    connection closes, every unconfirmed future fails with ConnectionError.
    """

    def __init__(self, url: str, confirm: bool) -> None:
        self.url = url
        self.confirm = confirm
        self.connection: Any = None
        self.channel: Any = None
        self._pending: dict[int, asyncio.Future[None]] = {}
        self._next_tag = 0
        self.closed = False

    async def open(self, within: float = 3.0) -> _Channel:
        import pika
        from pika.adapters.asyncio_connection import AsyncioConnection

        loop = asyncio.get_running_loop()
        opened: asyncio.Future[None] = loop.create_future()

        def on_channel(channel: Any) -> None:
            self.channel = channel
            channel.add_on_close_callback(self._on_close)
            if self.confirm:
                channel.confirm_delivery(self._on_confirm, lambda _frame: resolve(opened))
            else:
                resolve(opened)

        def on_open_error(_connection: Any, error: BaseException) -> None:
            if not opened.done():
                opened.set_exception(ConnectionError(f"{self.url}: {error}"))

        self.connection = AsyncioConnection(
            pika.URLParameters(self.url),
            on_open_callback=lambda c: c.channel(on_open_callback=on_channel),
            on_open_error_callback=on_open_error,
            on_close_callback=self._on_close,
            custom_ioloop=loop,
        )
        try:
            await asyncio.wait_for(opened, within)
        except BaseException:
            self.close()
            raise
        return self

    def _on_confirm(self, frame: Any) -> None:
        import pika

        tag, ok = frame.method.delivery_tag, isinstance(frame.method, pika.spec.Basic.Ack)
        if frame.method.multiple:  # tags only grow, and the dict keeps them in order
            tags = list(itertools.takewhile(lambda t: t <= tag, self._pending))
        else:
            tags = [tag]
        for t in tags:
            future = self._pending.pop(t, None)
            if future is not None and not future.done():
                if ok:
                    future.set_result(None)
                else:
                    future.set_exception(ConnectionError("the broker nacked the publish"))

    def _on_close(self, _connection: Any, error: BaseException) -> None:
        self.closed = True
        pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(ConnectionError(f"connection closed: {error}"))

    def publish(self, queue: str, body: bytes) -> asyncio.Future[None]:
        import pika

        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.closed:
            future.set_exception(ConnectionError("connection closed"))
            return future
        try:
            self.channel.basic_publish("", queue, body, pika.BasicProperties(delivery_mode=2))
        except pika.exceptions.AMQPError as e:  # closing under us: the caller reconnects
            future.set_exception(ConnectionError(f"publish failed: {e!r}"))
            return future
        self._next_tag += 1
        self._pending[self._next_tag] = future
        return future

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """A channel method that takes a `callback`, awaited."""
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        getattr(self.channel, method)(*args, callback=lambda f: resolve(done, f), **kwargs)
        return await asyncio.wait_for(done, 30)

    def close(self) -> None:
        if self.connection is not None and not self.connection.is_closed:
            with contextlib.suppress(Exception):
                self.connection.close()


def resolve(future: asyncio.Future[Any], value: Any = None) -> None:
    if not future.done():
        future.set_result(value)


class _Producer:
    """A confirming publisher that moves to the next node when its node dies and
    republishes what was not confirmed (RabbitMQ has no dedup: a resend may duplicate)."""

    def __init__(self, urls: list[str], queue: str) -> None:
        self.urls = urls
        self.queue = queue
        self._channel: _Channel | None = None
        self._generation = 0
        self._lock = asyncio.Lock()

    async def connect(self) -> None:
        async with self._lock:
            await self._connect_next()

    async def _connect_next(self) -> None:
        for attempt in range(200):
            url = self.urls[(self._generation + attempt) % len(self.urls)]
            try:
                self._channel = await _Channel(url, confirm=True).open()
            except (ConnectionError, TimeoutError):
                await asyncio.sleep(0.05)
                continue
            self._generation += attempt + 1
            return
        raise RuntimeError(f"no RabbitMQ node accepts connections: {self.urls}")

    async def _reconnect(self, generation: int) -> None:
        """Connect to the next node, unless another publish already did since `generation`."""
        async with self._lock:
            if generation != self._generation:
                return
            if self._channel is not None:
                self._channel.close()
            await self._connect_next()

    async def publish(self, index: int, trace: Trace | None = None) -> None:
        body = message_body(index)
        while True:
            generation, channel = self._generation, self._channel
            assert channel is not None
            try:
                await asyncio.wait_for(channel.publish(self.queue, body), 5)
            except (ConnectionError, TimeoutError):
                await self._reconnect(generation)
                continue
            if trace is not None:
                trace.on_confirm(index)
            return

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()


async def _declare(url: str, queue: str) -> None:
    """A durable quorum queue, led by the node `url` points at (client-local placement)."""
    channel = await _Channel(url, confirm=False).open(30)
    try:
        await channel.call(
            "queue_declare", queue, durable=True, arguments={"x-queue-type": "quorum"}
        )
    finally:
        channel.close()


async def _delete(url: str, queue: str) -> None:
    channel = await _Channel(url, confirm=False).open(30)
    try:
        await channel.call("queue_delete", queue)
    finally:
        channel.close()


async def _consume(url: str, queue: str, prefetch: int, on_message: Any) -> _Channel:
    """A connection consuming `queue` with manual acks; `on_message(index, redelivered)`."""
    channel = await _Channel(url, confirm=False).open(30)
    await channel.call("basic_qos", prefetch_count=prefetch)

    def handle(ch: Any, method: Any, _properties: Any, body: bytes) -> None:
        on_message(message_index(body), bool(method.redelivered))
        ch.basic_ack(method.delivery_tag)

    channel.channel.basic_consume(queue, handle)
    return channel


def _producer_process(url: str, queue: str, n: int, window: int, start: Any, out: Any) -> None:
    async def main() -> None:
        producer = _Producer([url], queue)
        await producer.connect()
        out.put("ready")
        await asyncio.get_running_loop().run_in_executor(None, start.wait)
        await publish_windowed(producer.publish, n, window)
        producer.close()
        out.put(n)

    try:
        asyncio.run(main())
    except Exception as e:
        out.put(f"{type(e).__name__}: {e}")


def _queue_process(route: tuple[str, str, str], n: int, window: int, start: Any, out: Any) -> None:
    """One queue's client process of a many-queues run: publish `n` on the queue's
    leader, consume and ack them on a follower; reports once all are delivered."""
    queue, leader, follower = route

    async def main() -> None:
        delivered = Countdown(n)
        consumer = await _consume(follower, queue, window, delivered.on_message)
        producer = _Producer([leader], queue)
        await producer.connect()
        out.put("ready")
        await asyncio.get_running_loop().run_in_executor(None, start.wait)
        await publish_windowed(producer.publish, n, window)
        await asyncio.wait_for(delivered.finished.wait(), 300)
        producer.close()
        consumer.close()
        out.put(n)

    run_async_child(main, out)


class RabbitSystem:
    """The benchmark workloads against a `RabbitCluster`."""

    name = "RabbitMQ"
    durability = DURABILITY

    def __init__(self, cluster: RabbitCluster) -> None:
        self.cluster = cluster
        self.version = cluster.ctl("version").strip()
        self._runs = 0

    def server_pids(self) -> dict[str, int]:
        return self.cluster.pids()

    def pids(self) -> list[int]:
        return list(self.server_pids().values())

    def _fresh_queue(self, kind: str, leader: str) -> str:
        """A new quorum queue led by `leader` (a reused name can leave a member down)."""
        self._runs += 1
        queue = f"{kind}-{os.getpid()}-{self._runs}-{time.monotonic_ns()}"
        asyncio.run(_declare(self.cluster.url(leader), queue))
        return queue

    def _delete(self, queue: str) -> None:
        node = next(n for n in self.cluster.nodes if self.cluster.alive(n))
        asyncio.run(_delete(self.cluster.url(node), queue))

    def _roles(self) -> tuple[str, list[str]]:
        nodes = [n for n in self.cluster.nodes if self.cluster.alive(n)]
        return nodes[self._runs % len(nodes)], nodes

    def publish_confirm(self, producers: int, messages: int, window: int) -> float:
        leader, nodes = self._roles()
        queue = self._fresh_queue("pc", leader)
        per = messages // producers
        args = [
            (self.cluster.url(nodes[i % len(nodes)]), queue, per, window) for i in range(producers)
        ]
        try:
            return run_producer_processes(_producer_process, args)
        finally:
            self._delete(queue)

    def end_to_end(self, messages: int, window: int) -> float:
        leader, nodes = self._roles()
        queue = self._fresh_queue("e2e", leader)
        followers = [n for n in nodes if n != leader]

        async def main() -> float:
            got = [0]
            finished = asyncio.Event()

            def on_message(_index: int, _redelivered: bool) -> None:
                got[0] += 1
                if got[0] >= messages:
                    finished.set()

            consumers = [
                await _consume(self.cluster.url(f), queue, window, on_message) for f in followers
            ]
            producer = _Producer([self.cluster.url(leader)], queue)
            await producer.connect()
            began = time.perf_counter()
            await publish_windowed(producer.publish, messages, window)
            await asyncio.wait_for(finished.wait(), 300)
            elapsed = time.perf_counter() - began
            producer.close()
            for c in consumers:
                c.close()
            return messages / elapsed

        try:
            return asyncio.run(main())
        finally:
            self._delete(queue)

    def end_to_end_queues(self, queues: int, messages: int, window: int) -> float:
        """`queues` quorum queues at once, their leaders round robin over the nodes
        (client-local declares), each with a client process of its own."""
        nodes = [n for n in self.cluster.nodes if self.cluster.alive(n)]
        routes = []
        try:
            for q in range(queues):
                leader, follower = nodes[q % len(nodes)], nodes[(q + 1) % len(nodes)]
                queue = self._fresh_queue("e2eq", leader)
                routes.append((queue, self.cluster.url(leader), self.cluster.url(follower)))
            args = [(r, messages // queues, window) for r in routes]
            return run_producer_processes(_queue_process, args)
        finally:
            for queue, *_ in routes:
                self._delete(queue)

    def paced(self, rate: int, seconds: float, kill_at: float | None = None) -> Trace:
        leader, nodes = self._roles()
        queue = self._fresh_queue("lat", leader)
        if kill_at is not None:
            leader = self.cluster.queue_leader(queue)
        follower = next(n for n in nodes if n != leader)
        trace = Trace(rate)

        def kill() -> None:
            self.cluster.kill(leader)

        async def main() -> None:
            consumer = await _consume(self.cluster.url(follower), queue, 1000, trace.on_delivery)
            urls = [self.cluster.url(leader)] + [self.cluster.url(n) for n in nodes if n != leader]
            producer = _Producer(urls, queue)
            await producer.connect()
            await publish_paced(
                trace,
                seconds,
                lambda i: producer.publish(i, trace),
                kill if kill_at is not None else None,
                kill_at or 0.0,
            )
            await wait_delivered(trace)
            producer.close()
            consumer.close()

        try:
            asyncio.run(main())
        finally:
            if kill_at is not None:
                self.cluster.restart(leader)
            self._delete(queue)
        return trace
