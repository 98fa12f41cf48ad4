"""The trio client: the blocking client's verbs, async, over the same `ClientSession`.

    async with quorumq.aio.connect("127.0.0.1:7001,127.0.0.1:7002") as client:
        offset = await client.publish("orders", b"hello", key="customer-7")
        async for delivery in await client.subscribe("orders", prefetch=100):
            await delivery.ack()

The client runs a reader task in its own nursery for as long as the `async with` lasts.
Its connection is a `Link`: a socket's (TCP or TLS), or, for `quorumq.aio.Node.client`,
one to the node in the same trio loop (`quorumq.wire.inprocess.TrioEnd`).
Sends go through one lock held from the moment a sequence number is taken until the
frame is written, so send order is sequence order. When the connection breaks, the
reader connects to the next endpoint, resends every unconfirmed publish in order and
subscribes the consumers again (through a leader change too, as the blocking client).
"""

from __future__ import annotations

import logging
import math
import ssl
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager, suppress
from typing import Any, Protocol

import trio

from ..wire.protocol import FrameDecoder, ProtocolError, encode_frame, keep_alive
from .blocking import MessageLike, batch_rows, landed_offsets
from .core import (
    WELCOME_S,
    ConnectFailures,
    ConnectionLostError,
    Delivery,
    NoWelcomeError,
    QuorumqError,
    ReadResult,
    check_hello_answer,
    check_message,
    hello_frame,
    parse_endpoints,
    read_continues_at,
    read_frame,
    read_result,
    report_node_error,
)
from .session import (
    MAX_UNCONFIRMED,
    MAX_UNCONFIRMED_BYTES,
    ClientSession,
    ConsumerEnded,
    Delivered,
    Event,
    Failed,
    Resolved,
    Resubscribe,
    RewindLater,
    Send,
    keys_of,
)
from .tls import TlsOption, client_context, handshake_failed

logger = logging.getLogger(__name__)

Stream = trio.SocketStream | trio.SSLStream[trio.SocketStream]
"""A connection to a node: plain, or TLS."""
RECEIVE_BYTES = 262144


class Link(Protocol):
    """A connection to a node, as the trio client uses it."""

    async def receive_frame(self) -> dict[str, Any] | None:
        """The node's next frame, checked; None once the connection is closed.
        `ProtocolError` for a bad one."""
        ...

    async def send_frame(self, frame: dict[str, Any]) -> None:
        """Send `frame` whole (`trio.BrokenResourceError` once the connection is gone)."""

    async def aclose(self) -> None: ...


class Dialer(Protocol):
    """How the trio client reaches nodes: `targets` names each (for errors), `dial`
    connects to one (the caller bounds it with a cancel scope)."""

    @property
    def targets(self) -> Sequence[str]: ...

    async def dial(self, target: int) -> Link: ...


class StreamLink:
    """A connection over a socket's stream: frames encoded, and decoded."""

    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self._decoder = FrameDecoder()

    async def receive_frame(self) -> dict[str, Any] | None:
        while True:
            for frame in self._decoder.frames():
                return frame
            data = await self.stream.receive_some(RECEIVE_BYTES)
            if not data:
                return None
            self._decoder.feed(data)

    async def send_frame(self, frame: dict[str, Any]) -> None:
        await self.stream.send_all(encode_frame(frame))

    async def aclose(self) -> None:
        await self.stream.aclose()


class TcpDialer:
    """Nodes at "host:port" endpoints, over TCP (TLS with a `context`)."""

    def __init__(self, endpoints: list[tuple[str, int]], context: ssl.SSLContext | None) -> None:
        self.endpoints = endpoints
        self.targets = [f"{host}:{port}" for host, port in endpoints]
        self.context = context

    async def dial(self, target: int) -> StreamLink:
        host, port = self.endpoints[target]
        tcp = await trio.open_tcp_stream(host, port)
        keep_alive(tcp.socket)
        if self.context is None:
            return StreamLink(tcp)
        # https_compatible: as the node, no close_notify (frames carry their length)
        stream = trio.SSLStream(tcp, self.context, server_hostname=host, https_compatible=True)
        try:
            await stream.do_handshake()
        except trio.BrokenResourceError as e:
            await stream.aclose()
            if isinstance(e.__cause__, ssl.SSLError):
                raise handshake_failed(e.__cause__) from None
            raise
        except BaseException:
            await stream.aclose()
            raise
        return StreamLink(stream)


class _Answer:
    def __init__(self, request_id: int, keys: frozenset[str] = frozenset()) -> None:
        self.request_id = request_id
        self.keys = keys
        """A publish's keys (paused if its caller is cancelled while waiting)."""
        self.done = trio.Event()
        self.frame: dict[str, Any] | None = None
        self.error: QuorumqError | None = None


class AsyncConsumer:
    """Deliveries of one subscription, in order: `async for`, or `await get(timeout)`."""

    def __init__(self, client: AsyncClient, queue: str, prefetch: int) -> None:
        self.client = client
        self.queue = queue
        self.prefetch = prefetch
        self.id = ""
        self._send, self._receive = trio.open_memory_channel[Delivery | None](math.inf)
        self.cancelled = False
        self.cancel_reason = ""
        self.cancel_requested = False
        """Cancelled, or ended: never subscribed again (`ClientSession.cancel`)."""
        self.timeout_ms: int | None = None
        """How long it may hold a delivery (None: the queue's consumer timeout)."""

    async def get(self) -> Delivery | None:
        """The next delivery, or None once cancelled. (Bound the wait with a cancel scope,
        `with trio.move_on_after(5): ...`, as trio does.)"""
        return await self._receive.receive()

    def __aiter__(self) -> AsyncConsumer:
        return self

    async def __anext__(self) -> Delivery:
        delivery = await self.get()
        if delivery is None:
            raise StopAsyncIteration
        return delivery

    async def cancel(self) -> None:
        """No new deliveries; ack what you hold. Never subscribed again after a reconnect
        (nor by a subscribe of it still out: that one is cancelled when answered)."""
        client = self.client
        try:
            request = client._session.cancel(self)  # at once, before any checkpoint
            if request is not None:
                request_id, frame = request
                answer = client._answers[request_id] = _Answer(request_id)
                await client._send_whole(frame)
                await client._wait(answer)
        finally:
            self._stop("cancelled")

    def _stop(self, reason: str) -> None:
        self.cancel_requested = True
        self.cancelled = True
        self.cancel_reason = reason
        self._send.send_nowait(None)


class AsyncClient:
    def __init__(
        self,
        endpoints: str | list[str] | Dialer,
        token: str | None,
        nursery: trio.Nursery | None,
        *,
        timeout: float = 30.0,
        connect_timeout: float = 5.0,
        admin_token: str | None = None,
        max_unconfirmed: int = MAX_UNCONFIRMED,
        max_unconfirmed_bytes: int = MAX_UNCONFIRMED_BYTES,
        tls: TlsOption = None,
        wait_for_nodes: bool = True,
    ) -> None:
        """As the blocking client's options (`tls`: over TLS, every connection;
        `wait_for_nodes`: for the first connection only;
        `endpoints` may be a `Dialer`, as `quorumq.aio.Node.client`'s). The client's tasks
        run in `nursery` (`connect` gives it one once connected)."""
        self._dialer: Dialer = (
            TcpDialer(parse_endpoints(endpoints), client_context(tls))
            if isinstance(endpoints, str | list)
            else endpoints
        )
        self._token = token
        self._admin_token = admin_token
        self._nursery = nursery
        self.timeout = timeout
        self._connect_timeout = connect_timeout
        self._wait_for_nodes = wait_for_nodes
        self._session = ClientSession(
            self._settle,
            max_unconfirmed=max_unconfirmed,
            max_unconfirmed_bytes=max_unconfirmed_bytes,
        )
        self.producer = self._session.producer
        self._answers: dict[int, _Answer] = {}
        self._send_lock = trio.Lock()
        self._link: Link | None = None
        self._resubscribing: list[Any] = []
        """Consumers of a lost connection waiting to be subscribed again on the next."""
        self._welcome: dict[str, Any] | None = None
        self._endpoint_index = 0
        self.node: str | None = None

    # -------------------------------------------------------------- connecting

    async def _connect(self, within: float, *, wait_for_nodes: bool = True) -> Link:
        """A handshaken connection to the next endpoint that answers, trying them in turn
        for up to `within` seconds (see `ConnectFailures` for `wait_for_nodes`)."""
        targets = self._dialer.targets
        failures = ConnectFailures(len(targets), wait_for_nodes=wait_for_nodes)
        with trio.move_on_after(within):
            while True:
                for _ in range(len(targets)):
                    target = self._endpoint_index % len(targets)
                    self._endpoint_index += 1
                    try:
                        with trio.fail_after(self._connect_timeout):
                            return await self._handshake(target, wait_for_nodes=wait_for_nodes)
                    except (
                        OSError,
                        trio.TooSlowError,
                        trio.BrokenResourceError,
                        ProtocolError,
                        QuorumqError,
                    ) as e:
                        failures.add(targets[target], e)
                await trio.sleep(0.1)
        raise failures.give_up()

    async def _handshake(self, target: int, *, wait_for_nodes: bool) -> Link:
        """Welcome, hello, reply. A client that waits for nodes waits for the welcome as
        long as for the rest (a loaded node may be slow to send it); one that does not
        gives up on a silent endpoint after `WELCOME_S`."""
        link = await self._dialer.dial(target)
        try:

            async def receive() -> dict[str, Any]:
                frame = await link.receive_frame()
                if frame is None:
                    raise ConnectionLostError("the node closed the connection")
                return frame

            within = self._connect_timeout
            if not wait_for_nodes:
                within = min(within, WELCOME_S)
            try:
                with trio.fail_after(within):
                    welcome = await receive()
            except trio.TooSlowError:
                raise NoWelcomeError(within) from None
            await link.send_frame(hello_frame(welcome, self._token, self._admin_token))
            check_hello_answer(await receive())
        except BaseException:
            await link.aclose()
            raise
        self.node = str(welcome["node"])
        self._welcome = welcome
        return link

    async def _install(self, link: Link) -> bool:
        """Make `link` the connection and resend what is unconfirmed; False (and the
        connection closed) if the client was closed meanwhile."""
        async with self._send_lock:
            if self._session.closed:
                await link.aclose()
                return False
            self._link = link
            self._session.connection_made(self._welcome)
            for frame in self._session.unconfirmed():
                await self._write(frame)
        return True

    async def _run(self, link: Link) -> None:
        """The reader task: frames in, events out; reconnects when the connection breaks."""
        while True:
            try:
                while (frame := await link.receive_frame()) is not None:
                    if frame["t"] == "error" and not isinstance(frame.get("id"), int):
                        report_node_error(frame)
                        continue
                    self._handle(self._session.receive(frame))
            except (trio.BrokenResourceError, trio.ClosedResourceError, ProtocolError):
                pass
            except Exception:  # a bug of ours: lose this connection, not the client
                logger.exception("the client failed on a frame from the node; reconnecting")
            if self._session.closed:
                return
            self._link = None
            await link.aclose()
            lost = self._session.connection_lost()
            self._handle([e for e in lost if not isinstance(e, Resubscribe)])
            # the session no longer holds these consumers until they are subscribed
            # again: if the client is closed meanwhile (even cancelled in `_connect`),
            # `aclose` ends them, or their callers would wait for a delivery for good
            self._resubscribing = [r.consumer for r in lost if isinstance(r, Resubscribe)]
            try:
                link = await self._connect(self.timeout)
            except QuorumqError as e:
                ended: list[Event] = [
                    ConsumerEnded(c, f"connection lost: {e}") for c in self._resubscribing
                ]
                self._resubscribing = []
                self._handle(self._session.give_up(ConnectionLostError(str(e))) + ended)
                return
            if not await self._install(link):  # closed while it reconnected
                return  # (`aclose` ended the consumers)
            consumers, self._resubscribing = self._resubscribing, []
            self._handle([Resubscribe(c) for c in consumers])

    # ----------------------------------------------------------------- events

    def _handle(self, events: list[Event]) -> None:
        assert self._nursery is not None, "the client runs in a nursery once connected"
        for e in events:
            if isinstance(e, Resolved | Failed):
                answer = self._answers.pop(e.request_id, None)
                if answer is None:
                    continue
                if isinstance(e, Resolved):
                    answer.frame = e.frame
                else:
                    answer.error = e.error
                answer.done.set()
            elif isinstance(e, Delivered):
                e.consumer._send.send_nowait(e.delivery)
            elif isinstance(e, ConsumerEnded):
                e.consumer._stop(e.reason)
            elif isinstance(e, Resubscribe):
                self._nursery.start_soon(self._resubscribe, e.consumer)
            elif isinstance(e, RewindLater):
                self._nursery.start_soon(self._rewind, e.queue, e.delay)
            elif isinstance(e, Send):
                self._nursery.start_soon(self._send_whole, e.frame)

    async def _rewind(self, queue: str, delay: float) -> None:
        await trio.sleep(delay)
        async with self._send_lock:
            for frame in self._session.rewind(queue):
                await self._write(frame)

    async def _resubscribe(self, consumer: AsyncConsumer) -> None:
        try:
            await self._subscribe_retrying(consumer)
        except QuorumqError as e:
            if not consumer.cancel_requested:  # (a cancelled one has ended already)
                consumer._stop(self._session.resubscribe_failed(consumer.queue, e))

    async def _subscribe_retrying(self, consumer: AsyncConsumer) -> None:
        """Subscribe `consumer`. After a failure that a leader change or a lost connection
        explains, again, with backoff, until the client's `timeout` has passed (the
        session decides); raise the last error."""
        deadline = trio.current_time() + self.timeout
        attempt = 0
        while True:
            attempt += 1
            try:
                await self._wait(await self._issue(self._session.subscribe, consumer), deadline)
                return
            except QuorumqError as e:
                time_left = deadline - trio.current_time()
                delay = self._session.subscribe_retry_delay(e, attempt, time_left)
                if delay is None:
                    raise
                logger.info("subscribing to %r again in %.2f s: %s", consumer.queue, delay, e)
                await trio.sleep(delay)

    # ---------------------------------------------------------------- sending

    async def _write(self, frame: dict[str, Any]) -> None:
        """Write under the send lock, a whole frame whatever cancels the caller: half a
        frame left on the stream would make the node misread every later frame, on a
        connection that still looks alive. A write that cannot finish within the client's
        `timeout` (the node stopped reading) drops the connection instead; the reader
        reconnects and the unconfirmed publishes are sent again. A broken stream is left
        to the reader to replace."""
        link = self._link
        if link is None:
            return  # publishes are sent again after the reconnect
        with trio.CancelScope(shield=True):
            with trio.move_on_after(self.timeout) as writing:
                with suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    await link.send_frame(frame)
            if writing.cancelled_caught:
                logger.warning("a frame could not be written in %s s: reconnecting", self.timeout)
                if self._link is link:
                    self._link = None
                await link.aclose()

    async def _issue(self, make: Any, *args: Any) -> _Answer:
        """Take a request id (and sequence) and send, in one step under the send lock."""
        async with self._send_lock:
            request_id, frame = make(*args)
            answer = self._answers[request_id] = _Answer(request_id, keys_of(frame))
            await self._write(frame)
        return answer

    async def _wait(self, answer: _Answer, deadline: float | None = None) -> dict[str, Any]:
        """The answer, by `deadline` (trio time; by default the client's `timeout` from now).
        No answer by then (or the caller cancelled): the request is forgotten
        (`ClientSession.abandon`: a subscribe answered later is cancelled at once)."""
        if deadline is None:
            deadline = trio.current_time() + self.timeout
        try:
            with trio.move_on_at(deadline):
                await answer.done.wait()
        finally:
            if not answer.done.is_set():
                self._answers.pop(answer.request_id, None)
                self._session.abandon(answer.request_id)
        if not answer.done.is_set():
            raise ConnectionLostError(f"no answer within {self.timeout} s")
        if answer.error is not None:
            raise answer.error
        assert answer.frame is not None
        return answer.frame

    async def _confirm(self, answer: _Answer) -> dict[str, Any]:
        """A publish's confirm. No answer within the client's `timeout`, or the caller
        cancelled: the publish stays live and its key is paused (`OutcomeUnknownError`;
        a cancellation itself is re-raised, as trio wants)."""
        try:
            with trio.move_on_after(self.timeout):
                await answer.done.wait()
        except trio.Cancelled:
            self._answers.pop(answer.request_id, None)
            self._session.cancelled_while_waiting(answer.request_id, answer.keys)
            raise
        if not answer.done.is_set():
            self._answers.pop(answer.request_id, None)
            why = f"no answer within {self.timeout} s"
            error = self._session.outcome_unknown(answer.request_id, why)
            assert error is not None  # an answer, once read, sets `done` at once
            raise error
        if answer.error is not None:
            raise answer.error
        assert answer.frame is not None
        return answer.frame

    async def _request(self, frame: dict[str, Any]) -> dict[str, Any]:
        return await self._wait(await self._issue(self._session.request, frame))

    async def _send_whole(self, frame: dict[str, Any]) -> None:
        """Send `frame` (nobody waits for its answer), whatever cancels the caller."""
        with trio.CancelScope(shield=True):
            async with self._send_lock:
                await self._write(frame)

    async def _settle(
        self, delivery: Delivery, ack: bool, requeue: bool, delay_ms: int | None
    ) -> None:
        """Send an ack or nack, whatever cancels the caller: the delivery is marked
        settled already, so one lost waiting for the send lock could not be sent again
        ("already acked"), and the message would stay held."""
        frame = self._session.settle_frame(delivery, ack, requeue, delay_ms)
        if frame is not None:
            await self._send_whole(frame)

    # --------------------------------------------------------------- the verbs

    async def declare(self, queue: str, **options: Any) -> bool:
        reply = await self._request({"t": "declare", "queue": queue, "options": options})
        return bool(reply.get("created"))

    async def publish(
        self,
        queue: str,
        body: bytes,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> int:
        """Publish and wait for the confirm; return the offset. Run many at once in a
        nursery to pipeline them."""
        check_message(body, key, headers)
        answer = await self._issue(self._session.publish, queue, body, key, headers)
        offset: int = (await self._confirm(answer))["offset"]
        return offset

    async def publish_batch(
        self,
        queue: str,
        messages: Iterable[MessageLike],
        *,
        producer: str | None = None,
        first_seq: int | None = None,
        seqs: Sequence[int] | None = None,
        opens: bool = False,
    ) -> list[int]:
        """As the blocking client's `publish_batch` (a caller's own producer, `seqs`)."""
        rows = batch_rows(messages)
        wanted = None if seqs is None else list(seqs)
        answer = await self._issue(
            self._session.publish_batch, queue, rows, producer, first_seq, wanted, opens
        )
        return landed_offsets(await self._confirm(answer), len(rows))

    def paused_keys(self) -> set[str]:
        """Keys whose publishes fail fast (`KeyPausedError`) until `resume(key)`."""
        return set(self.producer.paused)

    def settling_keys(self) -> set[str]:
        """As the blocking client's: keys with a publish still live."""
        return self._session.settling_keys()

    def resume(self, key: str) -> None:
        """As the blocking client's (`KeyPausedError` while the key is settling)."""
        self._session.resume(key)

    async def subscribe(
        self, queue: str, prefetch: int = 100, *, timeout_ms: int | None = None
    ) -> AsyncConsumer:
        """As the blocking client's `subscribe` (tried again through a leader change;
        `timeout_ms`: the consumer's delivery timeout)."""
        consumer = AsyncConsumer(self, queue, prefetch)
        consumer.timeout_ms = timeout_ms
        await self._subscribe_retrying(consumer)
        return consumer

    async def read(
        self,
        queue: str,
        start: int,
        end: int,
        bucket: int | None = None,
        buckets: int | None = None,
        *,
        wait: float | None = None,
        columns: bool = False,
    ) -> ReadResult:
        frames = []
        position: int | None = start
        while position is not None:
            reply = await self._request(
                read_frame(queue, position, end, bucket, buckets, wait, columns)
            )
            frames.append(reply)
            position = read_continues_at(reply, position, end)
        return read_result(frames)

    async def commit_offset(self, queue: str, group: str, offset: int) -> None:
        await self._request(
            {"t": "commit_offset", "queue": queue, "group": group, "offset": offset}
        )

    async def forget_producers(self, queue: str, prefix: str, *, seal: bool = False) -> int:
        """Forget the idempotent producers of `queue` whose id starts with `prefix` (not
        empty); return how many. Only for producers that will never resend: a forgotten
        producer is new again, so its next publish must have sequence number 0, and any
        other is refused (`out_of_order`, expected 0). With `seal` (a prefix ending in
        "-"), no new producer under the prefix is taken for 7 days either
        (`producer_sealed`): what the Spark sink does once a job or batch committed."""
        frame: dict[str, Any] = {"t": "forget_producers", "queue": queue, "prefix": prefix}
        if seal:
            frame["seal"] = True
        reply = await self._request(frame)
        return int(reply["forgotten"])

    async def purge_queue(self, queue: str) -> int:
        """Remove every ready message of `queue` (those waiting for a retry delay too);
        return how many. Delivered ones stay with their consumers."""
        reply = await self._request({"t": "purge_queue", "queue": queue})
        return int(reply["messages"])

    async def delete_queue(self, queue: str, force: bool = False) -> dict[str, int]:
        """Delete `queue` and everything in it; return {"messages": removed,
        "consumers": cancelled}. Refused while it has consumers (`queue_in_use`) unless
        `force`: they end (`cancel_reason == "queue_deleted"`) and what they held goes
        too. Not sent again by the client, as `declare`. A queue declared again under
        the name carries on from this one's offsets (see the blocking client's)."""
        reply = await self._request({"t": "delete_queue", "queue": queue, "force": force})
        self._session.queue_deleted(queue)
        return {"messages": int(reply["messages"]), "consumers": int(reply["consumers"])}

    async def add_member(self, node: str, raft_address: str) -> dict[str, str]:
        """Add a replica to the cluster (start its node first, with the current members and
        itself as peers). Returns the members once the change is committed."""
        reply = await self._request({"t": "add_member", "node": node, "raft_address": raft_address})
        return dict(reply["members"])

    async def remove_member(self, node: str) -> dict[str, str]:
        """Remove a replica (send this to another member; a leader hands leadership over
        first). Returns the members once the change is committed; stop that node then."""
        reply = await self._request({"t": "remove_member", "node": node})
        return dict(reply["members"])

    async def status(self, *, audit: bool = False) -> dict[str, Any]:
        """As the blocking client's `status` (`audit`: with the state digest)."""
        frame: dict[str, Any] = {"t": "status", "audit": True} if audit else {"t": "status"}
        status: dict[str, Any] = (await self._request(frame))["status"]
        return status

    async def aclose(self) -> None:
        ended: list[Event] = [ConsumerEnded(c, "client closed") for c in self._resubscribing]
        self._resubscribing = []
        self._handle(self._session.close() + ended)
        if self._link is not None:
            link, self._link = self._link, None
            await link.aclose()


@asynccontextmanager
async def connect(
    endpoints: str | list[str] | Dialer, token: str | None = None, **options: Any
) -> AsyncIterator[AsyncClient]:
    """A trio client connected to one of `endpoints`, for the `async with` block. It
    connects before its nursery opens, so that a failure to connect (`TlsError`, a wrong
    token's `ServerError`, `ConnectionLostError`) is raised as itself, not in an
    exception group. An exception raised inside the block, the caller's own or a
    `ServerError` of a request, comes out as itself too (trio's nursery wrapped each in
    an `ExceptionGroup`, so `except ServerError` around the block missed them); only
    several at once stay a group."""
    client = AsyncClient(endpoints, token, None, **options)
    link = await client._connect(client._connect_timeout, wait_for_nodes=client._wait_for_nodes)
    try:
        async with trio.open_nursery() as nursery:
            client._nursery = nursery
            await client._install(link)
            nursery.start_soon(client._run, link)
            try:
                yield client
            finally:
                await client.aclose()
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        only = only_exception(group)
        if only is None:
            raise
        raise only from None


def only_exception(group: BaseExceptionGroup[BaseException]) -> BaseException | None:
    """The one exception in `group` (nested groups flattened), or None if there are
    several."""
    leaves: list[BaseException] = []
    pending: list[BaseException] = [group]
    while pending and len(leaves) < 2:
        exc = pending.pop()
        if isinstance(exc, BaseExceptionGroup):
            pending.extend(exc.exceptions)
        else:
            leaves.append(exc)
    return leaves[0] if len(leaves) == 1 and not pending else None
