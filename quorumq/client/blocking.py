"""The blocking client: a socket, a reader thread, and futures for replies.

Publishing is idempotent: the client is a producer with its own id and a sequence per
queue, so a resend (after a leader change, a timeout or a reconnect to another node)
is recognised by the queue and never gets a second offset. When the connection breaks,
the reader thread connects to the next endpoint, resends every unconfirmed publish in
order and subscribes its consumers again (messages they held come back redelivered).
"""

from __future__ import annotations

import logging
import queue as queue_module
import socket
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future
from typing import Any

from ..protocol import PROTOCOL_VERSION, FrameDecoder, ProtocolError, auth_proof, encode_frame
from .core import (
    RETRIABLE,
    ConnectionLostError,
    Delivery,
    Producer,
    QuorumqError,
    ReadResult,
    ServerError,
    delivery_from,
    parse_endpoints,
    publish_frame,
    read_result,
)

logger = logging.getLogger(__name__)

REWIND_DELAY = 0.05
"""Seconds before resending a queue's unconfirmed publishes after a retriable failure."""

MessageLike = bytes | tuple[bytes, str | None] | tuple[bytes, str | None, Mapping[str, str] | None]


class Consumer:
    """Deliveries of one subscription, in order. Iterate it, or `get(timeout)`."""

    def __init__(self, client: Client, queue: str, prefetch: int, consumer_id: str) -> None:
        self.client = client
        self.queue = queue
        self.prefetch = prefetch
        self.id = consumer_id
        self._deliveries: queue_module.Queue[Delivery | None] = queue_module.Queue()
        self.cancelled = False
        self.cancel_reason = ""

    def get(self, timeout: float | None = None) -> Delivery | None:
        """The next delivery, or None after `timeout` seconds or once cancelled."""
        if self.cancelled and self._deliveries.empty():
            return None
        try:
            return self._deliveries.get(timeout=timeout)
        except queue_module.Empty:
            return None

    def __iter__(self) -> Iterator[Delivery]:
        while True:
            delivery = self.get()
            if delivery is None:
                return
            yield delivery

    def cancel(self) -> None:
        """No new deliveries; ack what you hold."""
        self.client._request({"t": "cancel", "consumer": self.id})
        self._stop("cancelled")

    def _stop(self, reason: str) -> None:
        self.cancelled = True
        self.cancel_reason = reason
        self._deliveries.put(None)


class Client:
    """A connection to a quorumq cluster through any of its nodes."""

    def __init__(
        self,
        endpoints: str | list[str],
        token: str | None = None,
        *,
        timeout: float = 30.0,
        connect_timeout: float = 5.0,
    ) -> None:
        self._endpoints = parse_endpoints(endpoints)
        self._token = token
        self.timeout = timeout
        self._connect_timeout = connect_timeout
        self._lock = threading.RLock()
        self._sock: socket.socket | None = None
        self._generation = 0
        self._next_id = 1
        self._endpoint_index = 0
        self._pending: dict[int, Future[dict[str, Any]]] = {}
        self._unconfirmed: dict[int, dict[str, Any]] = {}
        self._consumers: dict[str, Consumer] = {}
        self._rewinding: set[str] = set()
        self._subscribing: dict[int, Consumer] = {}
        self.producer = Producer()
        self.node: str | None = None
        """The node this client is connected to."""
        self._closed = False
        self._connect(deadline=time.monotonic() + connect_timeout)

    # -------------------------------------------------------------- connecting

    def _connect(self, deadline: float) -> None:
        errors = []
        while True:
            for _ in range(len(self._endpoints)):
                host, port = self._endpoints[self._endpoint_index % len(self._endpoints)]
                self._endpoint_index += 1
                try:
                    self._install(*self._handshake(host, port))
                    return
                except (OSError, ProtocolError, QuorumqError) as e:
                    if isinstance(e, ServerError) and e.code == "auth_failed":
                        raise
                    errors.append(f"{host}:{port}: {e}")
            if time.monotonic() > deadline:
                distinct = list(dict.fromkeys(errors))
                raise ConnectionLostError("no quorumq node answered: " + "; ".join(distinct[-6:]))
            time.sleep(0.1)

    def _handshake(self, host: str, port: int) -> tuple[socket.socket, FrameDecoder, str]:
        sock = socket.create_connection((host, port), timeout=self._connect_timeout)
        decoder = FrameDecoder()
        try:
            welcome = self._receive_one(sock, decoder)
            if welcome["t"] != "welcome":
                raise ProtocolError("bad_frame", "expected welcome")
            if welcome["auth"] and self._token is None:
                raise ServerError("auth_failed", "the node requires a token")
            proof = auth_proof(self._token, welcome["nonce"]) if self._token else None
            hello = {"t": "hello", "v": PROTOCOL_VERSION, "client": "python", "proof": proof}
            sock.sendall(encode_frame(hello))
            answer = self._receive_one(sock, decoder)
            if answer["t"] == "error":
                raise ServerError(answer["code"], answer["message"])
        except BaseException:
            sock.close()
            raise
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock, decoder, welcome["node"]

    def _install(self, sock: socket.socket, decoder: FrameDecoder, node: str) -> None:
        """Use the new connection; first resend every unconfirmed publish, in order, under
        the same lock, so no new publish overtakes them."""
        with self._lock:
            self._sock = sock
            self._generation += 1
            self.node = node
            generation = self._generation
            for rid, frame in self._in_order(self._unconfirmed.items()):
                self._send({**frame, "id": rid, "retry": True})
        threading.Thread(
            target=self._read_loop,
            args=(sock, decoder, generation),
            daemon=True,
            name="quorumq-client",
        ).start()

    @staticmethod
    def _in_order(
        frames: Iterable[tuple[int, dict[str, Any]]],
    ) -> list[tuple[int, dict[str, Any]]]:
        """Publishes sorted by (queue, producer, sequence)."""

        def position(item: tuple[int, dict[str, Any]]) -> tuple[str, str, int]:
            f = item[1]
            seq = f["seq"] if f["t"] == "publish" else f["first_seq"]
            return f["queue"], f["producer"], seq

        return sorted(frames, key=position)

    @staticmethod
    def _receive_one(sock: socket.socket, decoder: FrameDecoder) -> dict[str, Any]:
        while True:
            for frame in decoder.frames():
                return frame
            data = sock.recv(65536)
            if not data:
                raise ConnectionLostError("the node closed the connection")
            decoder.feed(data)

    def _read_loop(self, sock: socket.socket, decoder: FrameDecoder, generation: int) -> None:
        try:
            while True:
                try:
                    for frame in decoder.frames():
                        self._on_frame(frame)
                except ProtocolError as e:
                    logger.warning("bad frame from the node: %s", e)
                    if e.fatal:
                        break
                    continue
                data = sock.recv(262144)
                if not data:
                    break
                decoder.feed(data)
        except OSError:
            pass
        sock.close()
        self._on_lost(generation)

    def _on_lost(self, generation: int) -> None:
        with self._lock:
            if self._closed or generation != self._generation:
                return
            self._sock = None
        try:
            self._connect(deadline=time.monotonic() + self.timeout)
        except QuorumqError as e:
            with self._lock:
                pending, self._pending = self._pending, {}
                self._unconfirmed.clear()
            for future in pending.values():
                if not future.done():
                    future.set_exception(ConnectionLostError(str(e)))
            for consumer in list(self._consumers.values()):
                consumer._stop("connection lost")
            return
        self._restore_after_reconnect()

    def _restore_after_reconnect(self) -> None:
        with self._lock:  # the unconfirmed publishes were resent by _install
            others = [rid for rid in self._pending if rid not in self._unconfirmed]
            consumers = list(self._consumers.values())
            self._consumers.clear()
        for rid in others:  # not idempotent: the caller decides
            self._subscribing.pop(rid, None)
            future = self._pending.pop(rid, None)
            if future is not None and not future.done():
                future.set_exception(ConnectionLostError("the connection broke mid-request"))
        for consumer in consumers:
            threading.Thread(target=self._resubscribe, args=(consumer,), daemon=True).start()

    def _subscribe(self, consumer: Consumer) -> None:
        """Subscribe `consumer`; it is registered by the reader thread as the reply arrives,
        so the deliveries that follow the reply find it."""
        frame = {"t": "subscribe", "queue": consumer.queue, "prefetch": consumer.prefetch}
        future = self._submit(frame, subscribing=consumer)
        try:
            future.result(self.timeout)
        except TimeoutError:
            raise ConnectionLostError(f"no answer within {self.timeout} s") from None

    def _resubscribe(self, consumer: Consumer) -> None:
        try:
            self._subscribe(consumer)
        except QuorumqError as e:
            consumer._stop(f"could not subscribe again: {e}")

    # ----------------------------------------------------------------- frames

    def _on_frame(self, frame: dict[str, Any]) -> None:
        kind = frame["t"]
        if kind == "deliver":
            consumer = self._consumers.get(frame["consumer"])
            if consumer is not None:
                consumer._deliveries.put(delivery_from(frame, consumer.queue, self._settle))
        elif kind in ("reply", "error"):
            request_id = frame.get("id")
            if not isinstance(request_id, int):
                logger.warning("node reports: %s: %s", frame["code"], frame["message"])
                return
            self._resolve(request_id, frame)
        elif kind == "cancelled":
            with self._lock:
                consumer = self._consumers.pop(frame["consumer"], None)
            if consumer is not None:
                if frame["reason"] == "node_down":  # the node was cut off: come back elsewhere
                    threading.Thread(
                        target=self._resubscribe, args=(consumer,), daemon=True
                    ).start()
                else:
                    consumer._stop(frame["reason"])

    def _resolve(self, request_id: int, frame: dict[str, Any]) -> None:
        failed: list[tuple[Future[dict[str, Any]], QuorumqError]] = []
        with self._lock:
            publish = self._unconfirmed.get(request_id)
            if publish is not None and frame["t"] == "error" and self._may_resend(publish, frame):
                self._schedule_rewind(publish["queue"])
                return
            self._unconfirmed.pop(request_id, None)
            future = self._pending.pop(request_id, None)
            consumer = self._subscribing.pop(request_id, None)
            if consumer is not None and frame["t"] == "reply":
                consumer.id = frame["consumer"]
                self._consumers[consumer.id] = consumer
            if publish is not None and frame["t"] == "error":
                failed += self._give_up_after(publish)
        if future is not None and not future.done():
            if frame["t"] == "error":
                if publish is not None:
                    self.producer.failed(publish.get("key"))
                future.set_exception(ServerError(frame["code"], frame["message"]))
            else:
                future.set_result(frame)
        for later, error in failed:
            if not later.done():
                later.set_exception(error)

    def _may_resend(self, publish: dict[str, Any], error: dict[str, Any]) -> bool:
        """A retriable failure, or out of order behind an earlier publish still unconfirmed."""
        if self._closed:
            return False
        if error["code"] in RETRIABLE:
            return True
        expected = error.get("expected_seq")
        if error["code"] != "out_of_order" or expected is None:
            return False
        return any(
            f["queue"] == publish["queue"]
            and f["producer"] == publish["producer"]
            and (f["seq"] if f["t"] == "publish" else f["first_seq"]) == expected
            for f in self._unconfirmed.values()
        )

    def _schedule_rewind(self, queue: str) -> None:
        """Resend the queue's unconfirmed publishes, in order, shortly (once)."""
        if queue in self._rewinding:
            return
        self._rewinding.add(queue)

        def rewind() -> None:
            with self._lock:
                self._rewinding.discard(queue)
                mine = [(r, f) for r, f in self._unconfirmed.items() if f["queue"] == queue]
                for rid, frame in self._in_order(mine):
                    self._send({**frame, "id": rid, "retry": True})

        timer = threading.Timer(REWIND_DELAY, rewind)
        timer.daemon = True
        timer.start()

    def _give_up_after(
        self, publish: dict[str, Any]
    ) -> list[tuple[Future[dict[str, Any]], QuorumqError]]:
        """A publish failed for good: the queue expects its seq next, so the later ones of
        that producer can never land. Fail them, and use a new producer id from now on."""
        queue, producer = publish["queue"], publish["producer"]
        if self.producer.id_for(queue) == producer:
            self.producer.renew(queue)
        seq = publish["seq"] if publish["t"] == "publish" else publish["first_seq"]
        doomed = []
        for rid, f in list(self._unconfirmed.items()):
            later = f["seq"] if f["t"] == "publish" else f["first_seq"]
            if f["queue"] == queue and f["producer"] == producer and later > seq:
                del self._unconfirmed[rid]
                future = self._pending.pop(rid, None)
                if future is not None:
                    self.producer.failed(f.get("key"))
                    error = QuorumqError(
                        f"not published: an earlier publish to {queue!r} (seq {seq}) failed"
                    )
                    doomed.append((future, error))
        return doomed

    def _send(self, frame: dict[str, Any]) -> None:
        data = encode_frame(frame)
        with self._lock:
            sock = self._sock
            if sock is None:
                return  # resent after the reconnect
            try:
                sock.sendall(data)
            except OSError:
                sock.close()  # the reader notices and reconnects

    def _submit(
        self,
        frame: dict[str, Any],
        *,
        idempotent: bool = False,
        subscribing: Consumer | None = None,
    ) -> Future[dict[str, Any]]:
        if self._closed:
            raise QuorumqError("the client is closed")
        future: Future[dict[str, Any]] = Future()
        with self._lock:
            request_id = self._next_id
            self._next_id += 1
            frame = {**frame, "id": request_id}
            self._pending[request_id] = future
            if idempotent:
                self._unconfirmed[request_id] = frame
            if subscribing is not None:
                self._subscribing[request_id] = subscribing
        self._send(frame)
        return future

    def _request(self, frame: dict[str, Any]) -> dict[str, Any]:
        future = self._submit(frame)
        try:
            return future.result(self.timeout)
        except TimeoutError:
            raise ConnectionLostError(f"no answer within {self.timeout} s") from None

    def _settle(self, delivery: Delivery, ack: bool, requeue: bool) -> None:
        frame: dict[str, Any] = {
            "t": "ack" if ack else "nack",
            "consumer": delivery.consumer,
            "offsets": [delivery.offset],
        }
        if not ack:
            frame["requeue"] = requeue
        if delivery.consumer in self._consumers:  # a delivery to an earlier subscription
            self._send(frame)  # is redelivered anyway: nothing to settle

    # --------------------------------------------------------------- the verbs

    def declare(self, queue: str, **options: Any) -> bool:
        """Create `queue` (or check that it exists with these options). True if created."""
        reply = self._request({"t": "declare", "queue": queue, "options": options})
        return bool(reply.get("created"))

    def publish_async(
        self,
        queue: str,
        body: bytes,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Future[dict[str, Any]]:
        """Publish without waiting; the future's result has the `offset` once committed."""
        self.producer.check(key)
        with self._lock:  # sequence order is send order
            producer, seq = self.producer.take(queue)
            frame = publish_frame(0, queue, body, key, headers, producer, seq)
            return self._submit(frame, idempotent=True)

    def publish(
        self,
        queue: str,
        body: bytes,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> int:
        """Publish and wait for the confirm; return the message's offset."""
        try:
            reply = self.publish_async(queue, body, key, headers).result(self.timeout)
        except TimeoutError:
            self.producer.failed(key)
            raise ConnectionLostError(f"no confirm within {self.timeout} s") from None
        offset: int = reply["offset"]
        return offset

    def publish_batch(self, queue: str, messages: Iterable[MessageLike]) -> list[int]:
        """Publish messages as one log entry (all land, in order, or none); their offsets."""
        rows: list[list[Any]] = []
        for m in messages:
            if isinstance(m, bytes):
                rows.append([m, None, None])
            else:
                body, key, *rest = m
                rows.append([body, key, dict(rest[0]) if rest and rest[0] else None])
        for _, key, _ in rows:
            self.producer.check(key)
        with self._lock:  # sequence order is send order
            producer, first_seq = self.producer.take(queue, len(rows))
            frame = {
                "t": "publish_batch",
                "queue": queue,
                "messages": rows,
                "producer": producer,
                "first_seq": first_seq,
            }
            future = self._submit(frame, idempotent=True)
        try:
            reply = future.result(self.timeout)
        except ServerError:
            for _, key, _ in rows:
                self.producer.failed(key)
            raise
        first: int = reply["offset"]
        return list(range(first, first + len(rows)))

    def paused_keys(self) -> set[str]:
        return set(self.producer.paused)

    def resume(self, key: str) -> None:
        """Publishing for `key` may go on after a failure was handled."""
        self.producer.paused.discard(key)

    def subscribe(self, queue: str, prefetch: int = 100) -> Consumer:
        """Start receiving from `queue`; at most `prefetch` unacked deliveries at a time."""
        consumer = Consumer(self, queue, prefetch, "")
        self._subscribe(consumer)
        return consumer

    def read(
        self,
        queue: str,
        start: int,
        end: int,
        bucket: int | None = None,
        buckets: int | None = None,
    ) -> ReadResult:
        """Stream view: retained messages with offsets in [start, end) that this node has
        committed (and in `bucket` of `buckets` by key), in offset order."""
        frames = []
        position = start
        while True:
            reply = self._request(
                {
                    "t": "read",
                    "queue": queue,
                    "start": position,
                    "end": end,
                    "bucket": bucket,
                    "buckets": buckets,
                }
            )
            frames.append(reply)
            covered = reply["covered_until"]
            if covered >= min(end, reply["next_offset"]) or covered <= position:
                return read_result(frames)
            position = covered

    def commit_offset(self, queue: str, group: str, offset: int) -> None:
        self._request({"t": "commit_offset", "queue": queue, "group": group, "offset": offset})

    def status(self) -> dict[str, Any]:
        status: dict[str, Any] = self._request({"t": "status"})["status"]
        return status

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
        for consumer in list(self._consumers.values()):
            consumer._stop("client closed")

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def connect(endpoints: str | list[str], token: str | None = None, **options: Any) -> Client:
    """A blocking client connected to one of `endpoints` ("host:port", comma-separated or
    a list); it moves to the others when its node goes away."""
    return Client(endpoints, token, **options)
