"""The blocking client's connection (`ClientConnection`, which `Client` is): one socket
at a time to one of the endpoints, the handshake, reconnects, a reader thread handing
frames to the session, requests and their deadlines, and a `Consumer`'s queue of
deliveries."""

from __future__ import annotations

import logging
import math
import queue as queue_module
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any, Self

from .. import pathtiming
from ..wire.protocol import ProtocolError
from .core import (
    WELCOME_S,
    ConnectFailures,
    ConnectionLostError,
    Delivery,
    NoWelcomeError,
    QuorumqError,
    check_hello_answer,
    hello_frame,
    parse_endpoints,
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
)
from .tls import TlsOption, client_context
from .wire import Dialer, Link, TcpDialer

logger = logging.getLogger(__name__)

CLOSE_JOIN_S = 5.0
"""How long `close` waits for each of the client's threads to end (they end at once:
their connection is gone, and the session closed)."""


def handshake(
    link: Link,
    token: str | None,
    admin_token: str | None = None,
    *,
    timeout: float = 5.0,
    welcome_s: float | None = None,
) -> dict[str, Any]:
    """Welcome, hello (with proof), reply, on a new connection (whose reads still time
    out: a socket's after `timeout`, or `welcome_s` if shorter, `TcpDialer.dial`); the
    welcome. `NoWelcomeError` if none came by then."""
    frames = link.frames()

    def receive() -> dict[str, Any]:
        frame = next(frames, None)
        if frame is None:
            raise ConnectionLostError("the node closed the connection")
        return frame

    try:
        welcome = receive()
    except TimeoutError:
        raise NoWelcomeError(timeout if welcome_s is None else min(timeout, welcome_s)) from None
    hello = hello_frame(welcome, token, admin_token)
    if link.send_frame_by(hello, time.monotonic() + timeout) is not None:
        raise ConnectionLostError("the node did not take the hello")
    check_hello_answer(receive())
    return welcome


class Consumer:
    """Deliveries of one subscription, in order. Iterate it, or `get(timeout)`."""

    def __init__(self, client: ClientConnection, queue: str, prefetch: int) -> None:
        self.client = client
        self.queue = queue
        self.prefetch = prefetch
        self.id = ""
        self._deliveries: queue_module.Queue[Delivery | None] = queue_module.Queue()
        self.cancelled = False
        self.cancel_reason = ""
        self.cancel_requested = False
        """Cancelled, or ended: never subscribed again (`ClientSession.cancel`)."""
        self.timeout_ms: int | None = None
        """How long it may hold a delivery (None: the queue's consumer timeout)."""

    def get(self, timeout: float | None = None) -> Delivery | None:
        """The next delivery, or None after `timeout` seconds or once cancelled."""
        if self.cancelled and self._deliveries.empty():
            return None
        try:
            delivery = self._deliveries.get(timeout=timeout)
        except queue_module.Empty:
            return None
        if pathtiming.ENABLED and delivery is not None:
            pathtiming.mark("client.handed", ("o", delivery.offset))
        return delivery

    def __iter__(self) -> Iterator[Delivery]:
        while True:
            delivery = self.get()
            if delivery is None:
                return
            yield delivery

    def cancel(self) -> None:
        """No new deliveries; ack what you hold. Never subscribed again after a reconnect
        (nor by a subscribe of it still out: that one is cancelled when answered)."""
        client = self.client
        try:
            with client._lock:
                request = client._session.cancel(self)
            if request is not None:
                client._wait(*client._issue(lambda: request))
        finally:
            self._stop("cancelled")

    def _stop(self, reason: str) -> None:
        self.cancel_requested = True
        self.cancelled = True
        self.cancel_reason = reason
        self._deliveries.put(None)


class ClientConnection:
    """A connection to a quorumq cluster through any of its nodes."""

    def __init__(
        self,
        endpoints: str | list[str] | Dialer,
        token: str | None = None,
        *,
        timeout: float = 30.0,
        connect_timeout: float = 5.0,
        admin_token: str | None = None,
        max_unconfirmed: int = MAX_UNCONFIRMED,
        max_unconfirmed_bytes: int = MAX_UNCONFIRMED_BYTES,
        tls: TlsOption = None,
        wait_for_nodes: bool = True,
    ) -> None:
        """`connect_timeout`: how long to keep trying the endpoints in turn, and each
        step of one (connect, TLS, the node's welcome).
        `wait_for_nodes=False`: give up connecting at once when every endpoint refused
        the connection a few times in a row, or refused it or sent no welcome within
        `WELCOME_S` (not a quorumq client port), with one line saying so
        (`UnreachableError`); the command line's choice, where a user waits for the
        answer. By default the client keeps
        trying for `connect_timeout`: a node being started refuses until it listens.
        Reconnects always keep trying, for the client's `timeout`.
        `admin_token`: for administrative verbs (`add_member`, `remove_member`).
        `max_unconfirmed`, `max_unconfirmed_bytes`: how many publishes, and how many
        bytes of them, may wait for their confirms at once; past either, a publish fails
        before anything is sent (`TooManyUnconfirmedError`; its key is not paused).
        `tls`: connect over TLS (every connection, reconnects too): True verifies the
        nodes' certificates against the system's CAs, a path against the CA certificates
        in that PEM file; an `ssl.SSLContext` is used as it is. A node whose certificate
        does not verify is not used; if none can be, `TlsError`.

        `endpoints` may also be a `Dialer`: how `quorumq.Node.client` reaches the node in
        its own process (`tls` does not apply then)."""
        self._dialer: Dialer = (
            TcpDialer(parse_endpoints(endpoints), client_context(tls))
            if isinstance(endpoints, str | list)
            else endpoints
        )
        self._token = token
        self._admin_token = admin_token
        self.timeout = timeout
        self._connect_timeout = connect_timeout
        self._lock = threading.RLock()
        """Guards the session, the futures and the socket reference. Never held while a
        socket blocks: the reader thread and `close` need it at any time."""
        self._send_lock = threading.Lock()
        """Serialises writes, so that send order is sequence order. Taken before `_lock`
        (never while holding it); held while writing, which ends by the `timeout`."""
        self._link: Link | None = None
        self._generation = 0
        self._endpoint_index = 0
        self._session = ClientSession(
            self._settle,
            max_unconfirmed=max_unconfirmed,
            max_unconfirmed_bytes=max_unconfirmed_bytes,
        )
        self._futures: dict[int, Future[dict[str, Any]]] = {}
        self.producer = self._session.producer
        self.node: str | None = None
        """The node this client is connected to."""
        self._deadlines: dict[int, tuple[float, float]] = {}
        """Unanswered publishes -> (monotonic deadline, the timeout it was given): their
        futures fail with outcome unknown then (`_watch_deadlines`)."""
        self._deadline_changed = threading.Condition(self._lock)
        self._watching_until = math.inf
        self._reader: threading.Thread | None = None
        self._connect(deadline=time.monotonic() + connect_timeout, wait_for_nodes=wait_for_nodes)
        self._watcher = threading.Thread(
            target=self._watch_deadlines, daemon=True, name="quorumq-client-deadlines"
        )
        self._watcher.start()

    def _connect(self, deadline: float, *, wait_for_nodes: bool = True) -> None:
        targets = self._dialer.targets
        failures = ConnectFailures(len(targets), wait_for_nodes=wait_for_nodes)
        welcome_s = None if wait_for_nodes else WELCOME_S
        while True:
            for _ in range(len(targets)):
                if self._session.closed:
                    raise QuorumqError("the client is closed")
                target = self._endpoint_index % len(targets)
                self._endpoint_index += 1
                try:
                    link = self._dialer.dial(target, self._connect_timeout, welcome_s)
                    try:
                        welcome = handshake(
                            link,
                            self._token,
                            self._admin_token,
                            timeout=self._connect_timeout,
                            welcome_s=welcome_s,
                        )
                    except BaseException:
                        link.hang_up()
                        raise
                    self._install(link, welcome)
                    return
                except (OSError, ProtocolError, QuorumqError) as e:
                    failures.add(targets[target], e)
            if time.monotonic() > deadline:
                raise failures.give_up()
            time.sleep(0.1)

    def _install(self, link: Link, welcome: dict[str, Any]) -> None:
        """Use the new connection (unless the client was closed meanwhile); first resend
        every unconfirmed publish, in order, under the send lock, so no new publish
        overtakes them."""
        link.serve()
        with self._send_lock:
            with self._lock:
                if self._session.closed:
                    link.hang_up()
                    raise QuorumqError("the client is closed")
                self._link = link
                self._session.connection_made(welcome)
                self._generation += 1
                self.node = str(welcome["node"])
                generation = self._generation
                resends = self._session.unconfirmed()
            for frame in resends:
                self._write(link, frame)
        self._reader = threading.Thread(
            target=self._read_loop,
            args=(link, generation),
            daemon=True,
            name="quorumq-client",
        )
        self._reader.start()

    def _read_loop(self, link: Link, generation: int) -> None:
        try:
            while True:
                try:
                    for frame in link.frames():
                        if pathtiming.ENABLED:
                            _mark_read(frame)
                        if frame["t"] == "error" and not isinstance(frame.get("id"), int):
                            report_node_error(frame)
                            continue
                        with self._lock:
                            events = self._session.receive(frame)
                        self._handle(events)
                    break  # the connection is closed
                except ProtocolError as e:
                    logger.warning("bad frame from the node: %s", e)
                    if e.fatal:
                        break
        except OSError:  # ssl.SSLError too: a TLS record that does not check
            pass
        except Exception:  # a bug of ours: lose this connection, not the client
            logger.exception("the client failed on a frame from the node; reconnecting")
        link.hang_up()
        self._on_lost(generation)

    def _on_lost(self, generation: int) -> None:
        with self._lock:
            if self._session.closed or generation != self._generation:
                return
            self._link = None
            events = self._session.connection_lost()
        self._handle([e for e in events if not isinstance(e, Resubscribe)])
        try:
            self._connect(deadline=time.monotonic() + self.timeout)
        except QuorumqError as e:
            with self._lock:
                failed = self._session.give_up(ConnectionLostError(str(e)))
            ended: list[Event] = [
                ConsumerEnded(r.consumer, f"connection lost: {e}")
                for r in events
                if isinstance(r, Resubscribe)
            ]
            self._handle(failed + ended)
            return
        self._handle([e for e in events if isinstance(e, Resubscribe)])

    def _handle(self, events: list[Event]) -> None:
        """Act on the session's events (never holding `_lock`)."""
        sends = [e.frame for e in events if isinstance(e, Send)]
        if sends:  # not in the reader thread: a write may wait for the send lock
            threading.Thread(target=self._send_frames, args=(sends,), daemon=True).start()
        for e in events:
            if isinstance(e, Resolved | Failed):
                with self._lock:
                    future = self._futures.pop(e.request_id, None)
                    self._deadlines.pop(e.request_id, None)
                if future is None or future.done():
                    continue
                if isinstance(e, Resolved):
                    future.set_result(e.frame)
                    if pathtiming.ENABLED and isinstance(e.frame.get("offset"), int):
                        pathtiming.mark("client.confirmed", ("o", e.frame["offset"]))
                else:
                    future.set_exception(e.error)
            elif isinstance(e, Delivered):
                e.consumer._deliveries.put(e.delivery)
            elif isinstance(e, ConsumerEnded):
                e.consumer._stop(e.reason)
            elif isinstance(e, Resubscribe):
                threading.Thread(target=self._resubscribe, args=(e.consumer,), daemon=True).start()
            elif isinstance(e, RewindLater):
                timer = threading.Timer(e.delay, self._rewind, args=(e.queue,))
                timer.daemon = True
                timer.start()

    def _rewind(self, queue: str) -> None:
        with self._send_lock:
            with self._lock:
                frames, link = self._session.rewind(queue), self._link
            for frame in frames:
                self._write(link, frame)

    def _resubscribe(self, consumer: Consumer) -> None:
        try:
            self._subscribe_retrying(consumer)
        except QuorumqError as e:
            if not consumer.cancel_requested:  # (a cancelled one has ended already)
                consumer._stop(self._session.resubscribe_failed(consumer.queue, e))

    def _write(self, link: Link | None, frame: dict[str, Any]) -> None:
        """Write `frame` whole on `wire`, under the send lock, by the client's `timeout`
        from now: a node that stopped reading (stopped, its buffers full) would otherwise
        block the writer for ever. Past the deadline, or on an error, the connection is
        dropped (part of the frame may be out); the reader reconnects and the
        unconfirmed publishes are sent again. No connection (None): a publish goes with
        the resends after the reconnect."""
        if link is None:
            return
        failed = link.send_frame_by(frame, time.monotonic() + self.timeout)
        if failed is not None:
            if failed is TimeoutError:
                logger.warning("a frame could not be written in %s s: reconnecting", self.timeout)
            link.hang_up()  # the reader notices and reconnects

    def _send_frames(self, frames: list[dict[str, Any]]) -> None:
        with self._send_lock:
            with self._lock:
                link = self._link
            for frame in frames:
                self._write(link, frame)

    def _issue(
        self,
        make: Callable[..., tuple[int, dict[str, Any]]],
        *args: Any,
        publish: bool = False,
    ) -> tuple[int, Future[dict[str, Any]]]:
        """Take a request id (and a publish's sequence number) and send, in one step
        under the send lock, so send order is sequence order; the session lock only
        while taking them. A `publish`'s future fails with outcome unknown if no answer
        comes within the client's `timeout` (`_watch_deadlines`)."""
        with self._send_lock:
            with self._lock:
                request_id, frame = make(*args)
                future = self._futures[request_id] = Future()
                link = self._link
                if publish:
                    deadline = time.monotonic() + self.timeout
                    self._deadlines[request_id] = (deadline, self.timeout)
                    if deadline < self._watching_until:
                        self._deadline_changed.notify()
            timed = pathtiming.ENABLED and publish and frame.get("seq") is not None
            if timed:
                pathtiming.mark("client.publish", ("p", frame["producer"], frame["seq"]))
            self._write(link, frame)
            if timed:
                pathtiming.mark("client.sent", ("p", frame["producer"], frame["seq"]))
        return request_id, future

    def _watch_deadlines(self) -> None:
        """Fail the future of a publish with no answer within the client's `timeout` (as
        it was when the publish was sent) with the session's outcome unknown, which
        pauses its keys: a `publish_async` future is held to `publish`'s contract, and
        an application waiting on it with its own timeout cannot take a publish that
        is still live for a failed one. Runs until the client is closed."""
        while True:
            expired: list[tuple[Future[dict[str, Any]], QuorumqError]] = []
            with self._lock:
                while not expired:
                    if self._session.closed:
                        return
                    now = time.monotonic()
                    due = [r for r, (at, _) in self._deadlines.items() if at <= now]
                    for request_id in due:
                        _, timeout = self._deadlines.pop(request_id)
                        future = self._futures.get(request_id)
                        if future is None or future.done():
                            continue  # its caller gave up already (`publish`), or answered
                        why = f"no answer within {timeout} s"
                        error = self._session.outcome_unknown(request_id, why)
                        if error is None:
                            continue  # answered just now: the reader thread hands it over
                        del self._futures[request_id]
                        expired.append((future, error))
                    if not expired:
                        self._watching_until = min(
                            (at for at, _ in self._deadlines.values()), default=math.inf
                        )
                        wait = self._watching_until - now
                        self._deadline_changed.wait(None if wait == math.inf else wait)
                self._watching_until = -math.inf  # no need to wake it: it looks again now
            for future, failure in expired:
                future.set_exception(failure)

    def _wait(
        self,
        request_id: int,
        future: Future[dict[str, Any]],
        deadline: float | None = None,
        *,
        publish: bool = False,
    ) -> dict[str, Any]:
        """The answer, by `deadline` (monotonic; by default the client's `timeout` from now).
        No answer in time: `ConnectionLostError`, and the request is forgotten
        (`ClientSession.abandon`); for a `publish`, `OutcomeUnknownError`: the publish
        stays live and its key is paused (`ClientSession.outcome_unknown`)."""
        limit = self.timeout if deadline is None else max(deadline - time.monotonic(), 0.0)
        try:
            return future.result(limit)
        except TimeoutError:
            why = f"no answer within {self.timeout} s"
            error: QuorumqError | None
            with self._lock:
                if publish:
                    error = self._session.outcome_unknown(request_id, why)
                elif self._session.abandon(request_id):
                    error = ConnectionLostError(why)
                else:
                    error = None
                if error is not None:
                    self._futures.pop(request_id, None)
            if error is None:  # the answer was read just now: the reader hands it over
                return future.result(self.timeout)
            raise error from None

    def _request(self, frame: dict[str, Any]) -> dict[str, Any]:
        return self._wait(*self._issue(self._session.request, frame))

    def _subscribe_retrying(self, consumer: Consumer) -> None:
        """Subscribe `consumer`. After a failure that a leader change or a lost connection
        explains, again, with backoff, until the client's `timeout` has passed (the
        session decides); raise the last error."""
        deadline = time.monotonic() + self.timeout
        attempt = 0
        while True:
            attempt += 1
            try:
                self._wait(*self._issue(self._session.subscribe, consumer), deadline)
                return
            except QuorumqError as e:
                with self._lock:
                    delay = self._session.subscribe_retry_delay(
                        e, attempt, deadline - time.monotonic()
                    )
                if delay is None:
                    raise
                logger.info("subscribing to %r again in %.2f s: %s", consumer.queue, delay, e)
                time.sleep(delay)

    def _settle(self, delivery: Delivery, ack: bool, requeue: bool, delay_ms: int | None) -> None:
        with self._lock:
            frame = self._session.settle_frame(delivery, ack, requeue, delay_ms)
        if frame is not None:
            self._send_frames([frame])

    def close(self) -> None:
        """Fail what is pending, end the consumers, drop the connection; return once the
        client's reader and deadline threads have ended (they end at once). Never waits
        for a write: one in progress fails at once, its connection gone."""
        with self._lock:
            events = self._session.close()
            link, self._link = self._link, None
            self._deadlines.clear()
            self._deadline_changed.notify()  # the deadline watcher ends
        if link is not None:
            link.hang_up()
        self._handle(events)
        for thread in (self._reader, getattr(self, "_watcher", None)):
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout=CLOSE_JOIN_S)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def _mark_read(frame: dict[str, Any]) -> None:
    """Path timing: a confirm or a delivery was read off the socket."""
    offset = frame.get("offset")
    if not isinstance(offset, int):
        return
    if frame["t"] == "deliver":
        pathtiming.mark("client.deliver.read", ("o", offset))
    elif frame["t"] == "reply":
        pathtiming.mark("client.confirm.read", ("o", offset))
