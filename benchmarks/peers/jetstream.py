"""A 3-server NATS JetStream cluster on loopback, each server with its own file store.

Client, cluster-route and monitoring ports are picked free on 127.0.0.1; every server
is a child process of this one and is stopped by its PID.

    python -m benchmarks peers nats   # start, print the endpoints, stop on Enter
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
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


# ------------------------------------------------------------------ workloads

DURABILITY = (
    "R3 file stream (work-queue retention); NATS 2.9 writes to the page cache and does "
    "not fsync per message"
)


async def _quiet(*_args: Any) -> None:
    """nats-py reports every disconnect and reconnect through callbacks; the runs expect them."""


async def _connect(urls: list[str]) -> Any:
    """A client on `urls[0]` first, that reconnects to the others in order when it dies."""
    import nats

    return await nats.connect(
        urls,
        dont_randomize=True,
        reconnect_time_wait=0.05,
        max_reconnect_attempts=-1,
        connect_timeout=2,
        error_cb=_quiet,
        disconnected_cb=_quiet,
        reconnected_cb=_quiet,
    )


async def _add_stream(url: str, name: str) -> str:
    """An R3 file stream `name` on subject `name`; returns the server that leads it."""
    from nats.js.api import RetentionPolicy, StorageType, StreamConfig

    nc = await _connect([url])
    try:
        js = nc.jetstream()
        await js.add_stream(
            StreamConfig(
                name=name,
                subjects=[name],
                storage=StorageType.FILE,
                retention=RetentionPolicy.WORK_QUEUE,
                num_replicas=3,
                duplicate_window=120,
            )
        )
        info = await js.stream_info(name)
        return str(info.cluster.leader)
    finally:
        await nc.close()


async def _delete_stream(url: str, name: str) -> None:
    nc = await _connect([url])
    try:
        await nc.jetstream().delete_stream(name)
    finally:
        await nc.close()


async def _publisher(urls: list[str], subject: str, trace: Trace | None = None) -> tuple[Any, Any]:
    """(connection, publish(index)): each publish carries `Nats-Msg-Id`, so a publish
    that timed out (nats-py leaves requests to a dead server hanging) is sent again and
    the stream drops the copy."""
    import nats.errors

    nc = await _connect(urls)
    js = nc.jetstream()

    async def publish(index: int) -> None:
        body, headers = message_body(index), {"Nats-Msg-Id": str(index)}
        while True:
            try:
                await js.publish(subject, body, timeout=2.0, headers=headers)
            except (nats.errors.Error, TimeoutError):
                await asyncio.sleep(0.02)
                continue
            if trace is not None:
                trace.on_confirm(index)
            return

    return nc, publish


async def _consume(url: str, subject: str, prefetch: int, on_message: Any) -> Any:
    """A push subscriber in the shared durable consumer's deliver group, acking each."""
    from nats.js.api import AckPolicy, ConsumerConfig

    nc = await _connect([url])

    async def handle(msg: Any) -> None:
        on_message(message_index(msg.data), msg.metadata.num_delivered > 1)
        await msg.ack()

    await nc.jetstream().subscribe(
        subject,
        queue="workers",
        durable="workers",
        cb=handle,
        manual_ack=True,
        config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, max_ack_pending=prefetch, ack_wait=30),
    )
    return nc


def _producer_process(url: str, subject: str, n: int, window: int, start: Any, out: Any) -> None:
    async def main() -> None:
        nc, publish = await _publisher([url], subject)
        out.put("ready")
        await asyncio.get_running_loop().run_in_executor(None, start.wait)
        await publish_windowed(publish, n, window)
        await nc.close()
        out.put(n)

    try:
        asyncio.run(main())
    except Exception as e:
        out.put(f"{type(e).__name__}: {e}")


def _queue_process(
    route: tuple[str, list[str], str], n: int, window: int, start: Any, out: Any
) -> None:
    """One stream's client process of a many-queues run: publish `n` through the
    stream's leader, consume and ack them on another server; reports once all arrived."""
    subject, leader_urls, follower = route

    async def main() -> None:
        delivered = Countdown(n)
        consumer = await _consume(follower, subject, window, delivered.on_message)
        nc, publish = await _publisher(leader_urls, subject)
        out.put("ready")
        await asyncio.get_running_loop().run_in_executor(None, start.wait)
        await publish_windowed(publish, n, window)
        await asyncio.wait_for(delivered.finished.wait(), 300)
        for c in (nc, consumer):
            await c.close()
        out.put(n)

    run_async_child(main, out)


class NatsSystem:
    """The benchmark workloads against a `NatsCluster`."""

    name = "NATS JetStream"
    durability = DURABILITY

    def __init__(self, cluster: NatsCluster) -> None:
        self.cluster = cluster
        version = subprocess.run(["nats-server", "--version"], capture_output=True, check=False)
        self.version = version.stdout.decode().strip()
        self._runs = 0

    def server_pids(self) -> dict[str, int]:
        return self.cluster.pids()

    def _live(self) -> list[str]:
        return [s for s in self.cluster.servers if self.cluster.alive(s)]

    def _fresh_stream(self, kind: str) -> tuple[str, str]:
        """A new stream and the server that leads it."""
        self._runs += 1
        name = f"{kind}_{os.getpid()}_{self._runs}_{time.monotonic_ns()}"
        live = self._live()
        leader = asyncio.run(_add_stream(self.cluster.url(live[self._runs % len(live)]), name))
        return name, leader

    def _delete(self, name: str) -> None:
        asyncio.run(_delete_stream(self.cluster.url(self._live()[0]), name))

    def _urls(self, first: str) -> list[str]:
        return [self.cluster.url(first)] + [self.cluster.url(s) for s in self._live() if s != first]

    def publish_confirm(self, producers: int, messages: int, window: int) -> float:
        subject, _leader = self._fresh_stream("pc")
        live = self._live()
        per = messages // producers
        args = [
            (self.cluster.url(live[i % len(live)]), subject, per, window) for i in range(producers)
        ]
        try:
            return run_producer_processes(_producer_process, args)
        finally:
            self._delete(subject)

    def end_to_end(self, messages: int, window: int) -> float:
        subject, leader = self._fresh_stream("e2e")
        followers = [s for s in self._live() if s != leader]

        async def main() -> float:
            got = [0]
            finished = asyncio.Event()

            def on_message(_index: int, _redelivered: bool) -> None:
                got[0] += 1
                if got[0] >= messages:
                    finished.set()

            consumers = [
                await _consume(self.cluster.url(f), subject, window, on_message) for f in followers
            ]
            nc, publish = await _publisher(self._urls(leader), subject)
            began = time.perf_counter()
            await publish_windowed(publish, messages, window)
            await asyncio.wait_for(finished.wait(), 300)
            elapsed = time.perf_counter() - began
            for c in [nc, *consumers]:
                await c.close()
            return messages / elapsed

        try:
            return asyncio.run(main())
        finally:
            self._delete(subject)

    def end_to_end_queues(self, queues: int, messages: int, window: int) -> float:
        """`queues` R3 streams at once (their leaders where the servers put them), each
        with a client process of its own."""
        routes = []
        try:
            for _ in range(queues):
                subject, leader = self._fresh_stream("e2eq")
                follower = next(s for s in self._live() if s != leader)
                routes.append((subject, self._urls(leader), self.cluster.url(follower)))
            args = [(r, messages // queues, window) for r in routes]
            return run_producer_processes(_queue_process, args)
        finally:
            for subject, *_ in routes:
                self._delete(subject)

    def paced(self, rate: int, seconds: float, kill_at: float | None = None) -> Trace:
        subject, leader = self._fresh_stream("lat")
        follower = next(s for s in self._live() if s != leader)
        trace = Trace(rate)

        async def main() -> None:
            consumer = await _consume(self.cluster.url(follower), subject, 1000, trace.on_delivery)
            nc, publish = await _publisher(self._urls(leader), subject, trace)
            await publish_paced(
                trace,
                seconds,
                publish,
                (lambda: self.cluster.kill(leader)) if kill_at is not None else None,
                kill_at or 0.0,
            )
            await wait_delivered(trace)
            for c in (nc, consumer):
                await c.close()

        try:
            asyncio.run(main())
        finally:
            if kill_at is not None:
                self.cluster.restart(leader)
            self._delete(subject)
        return trace
