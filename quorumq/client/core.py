"""What the blocking and the trio client share: values, errors, and producer bookkeeping."""

from __future__ import annotations

import functools
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import attrs

from ..machine.commands import MAX_RETRY_DELAY_MS
from ..machine.views import StreamMessage
from ..wire.protocol import PROTOCOL_VERSION, READ_COLUMNS, ProtocolError, auth_proof, check_columns

logger = logging.getLogger("quorumq.client")

RETRIABLE = frozenset({"not_applied", "outcome_unknown"})
"""Error codes after which resending the same (producer, seq) is safe and right."""


class QuorumqError(Exception):
    """Base of the errors the client raises."""


class ServerError(QuorumqError):
    """The node refused a request; `code` says why (see quorumq.machine.ErrorCode)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class RefusedBeforeError(QuorumqError):
    """Not published: an earlier publish under the same producer id was refused (say, the
    queue was full), and the queue takes a producer's sequence numbers in order, so this
    one can never land. Publish it again if it is still wanted."""


class KeyPausedError(QuorumqError):
    """Not sent: a publish for this key failed earlier (call `resume(key)` once it is
    handled), or one is still live under another producer id (wait until the key has
    left `settling_keys()`); also `resume(key)`'s refusal while the key is settling."""


class TooManyUnconfirmedError(QuorumqError):
    """Not sent, and its key not paused: the client already holds as many unconfirmed
    publishes (or bytes of them) as its `max_unconfirmed` (`max_unconfirmed_bytes`)
    allows. Wait for confirms, then publish it again (or raise the limit)."""


class ConnectionLostError(QuorumqError):
    """No endpoint could be reached (or the connection broke and could not be restored)."""


class TlsError(QuorumqError):
    """No TLS session with the nodes: their certificates did not verify (not signed by
    the CA the client trusts, or not for the host name it dialled), the client spoke TLS
    to nodes that do not, or spoke plain text to nodes that serve TLS only. Trying again
    does not mend it: the client or the nodes need another configuration."""


class NoWelcomeError(ConnectionLostError):
    """The endpoint took the connection but sent no `welcome` in time (`WELCOME_S` for a
    client that does not wait for nodes, its connect timeout otherwise): not a
    quorumq client port (a node's Raft port waits in silence for its peer's secret), or
    a node too stalled to answer."""

    def __init__(self, within: float) -> None:
        super().__init__(
            f"took the connection but sent no quorumq welcome within {within:g} s: not a "
            "quorumq client port (a node's Raft port, or another service?), or a stalled node"
        )


class UnreachableError(ConnectionLostError):
    """Every endpoint refused the connection, or took it and said nothing: what a client
    made with `wait_for_nodes=False` raises at once instead of trying until its
    `connect_timeout`. `refused`, `silent`: those endpoints ("host:port")."""

    def __init__(self, message: str, *, refused: list[str], silent: list[str]) -> None:
        super().__init__(message)
        self.refused = refused
        self.silent = silent


class OutcomeUnknownError(ConnectionLostError):
    """No confirm came in time (or the waiting caller was cancelled), and the publish is
    still live: the client keeps resending it, so it may yet land, exactly once.

    Do not publish it again (that would be a second message): its key is paused, so
    later publishes of that key fail fast (`KeyPausedError`) instead of overtaking it.
    Wait until the key has left the client's `settling_keys()`: then nothing more can
    land for it, and a `read` tells whether it landed. Then `resume(key)` (refused
    before), and publish it again only if it did not land."""


Row = list[Any]
"""[offset, key, body, headers, ts_ms] of one message, as the node sends it."""


@attrs.frozen(kw_only=True)
class ReadColumns:
    """A read's messages column by column (`read(..., columns=True)`): what a bulk reader
    (the Spark source) builds Arrow arrays from. The bodies are one bytes object, cut by
    `body_lengths`, instead of an object per message."""

    offsets: list[int]
    keys: list[str | None]
    bodies: bytes
    body_lengths: list[int]
    headers: list[dict[str, str] | None]
    ts_ms: list[int]

    def rows(self) -> list[Row]:
        """The same messages as [offset, key, body, headers, ts_ms] rows."""
        rows: list[Row] = []
        at = 0
        for offset, key, length, headers, ts in zip(
            self.offsets, self.keys, self.body_lengths, self.headers, self.ts_ms, strict=True
        ):
            rows.append([offset, key, self.bodies[at : at + length], headers, ts])
            at += length
        return rows


@attrs.frozen(kw_only=True)
class ReadResult:
    """Messages with offsets in the requested range (and bucket) that are retained.

    `first_retained` > the range's start means retention trimmed part of it;
    `next_offset` is where the queue ended on the replica that answered. `rows` are
    the raw [offset, key, body, headers, ts_ms] lists, for bulk readers that build
    columns (the Spark source); `messages` makes objects of them on first use.
    """

    rows: list[Row]
    first_retained: int
    next_offset: int
    columns: ReadColumns | None = None
    """The messages column by column, when the read asked for them (`rows` is empty
    then), and the node knew how."""

    @functools.cached_property
    def messages(self) -> tuple[StreamMessage, ...]:
        rows = self.rows if self.columns is None else self.columns.rows()
        return tuple(
            StreamMessage(offset=o, key=k, body=b, headers=h, ts_ms=t) for o, k, b, h, t in rows
        )

    def __iter__(self) -> Iterator[StreamMessage]:
        return iter(self.messages)

    def __len__(self) -> int:
        return len(self.rows)


@attrs.frozen(kw_only=True)
class Delivery:
    """A message given to one of this client's consumers. Ack or nack it."""

    queue: str
    offset: int
    key: str | None
    body: bytes
    headers: Mapping[str, str] | None
    redelivered: bool
    delivery_count: int
    node: str
    """The node whose replica sent it: the one this client is connected to."""
    consumer: str
    _settle: Callable[[Delivery, bool, bool, int | None], Any] = attrs.field(
        eq=False, repr=False, alias="settle"
    )
    _settled: list[str] = attrs.field(factory=list, eq=False, repr=False, init=False)

    def ack(self) -> Any:
        """Done with it: it is never delivered again."""
        self._once("acked")
        return self._settle(self, True, False, None)

    def nack(self, requeue: bool = True, delay_ms: int | None = None) -> Any:
        """Give it back (`requeue`), or drop or dead-letter it.

        Given back, it waits `delay_ms` before it is delivered again (None: what the
        queue's `retry_backoff_ms` says, or not at all; 0: at once), and keeps its
        place meanwhile: it comes before any later message once due, its key waits
        behind it, and a single-active-consumer queue waits for it."""
        check_retry_delay(requeue, delay_ms)
        self._once("nacked")
        return self._settle(self, False, requeue, delay_ms)

    def _once(self, how: str) -> None:
        # a second ack would travel with others of the consumer and spoil their batch
        if self._settled:
            raise QuorumqError(
                f"delivery {self.offset} of {self.queue!r} is already {self._settled[0]}"
            )
        self._settled.append(how)


MAX_GENERATION = 2**64 - 1
"""The largest generation an id carries (16 hex digits: the queue parses no more)."""


def generation_id(generation: int, random_bits: int | None = None) -> str:
    """A producer id of `generation`, "g<hex>-<32 random hex>": a queue that forgot
    producers of this generation or below refuses it (`producer_forgotten`) instead of
    taking a resend of a forgotten producer for a new one. `random_bits` (128 of them)
    in place of a random UUID: the simulator's, from its seed."""
    bits = uuid.uuid4().int if random_bits is None else random_bits
    return f"g{generation:x}-{bits:032x}"


def wall_clock_ms() -> int:
    return int(time.time() * 1000)


class Producer:
    """An idempotent producer: an id and a sequence per queue, and the paused keys.

    After a publish fails for good (queue full, too large, ...) the queue gets a fresh
    producer id: later sequence numbers of the old id can never be accepted, since the
    queue expects the failed one next. Ids carry a generation, the wall clock in ms
    when made, and always above any generation a queue said it forgot (`above`).
    """

    def __init__(
        self,
        clock_ms: Callable[[], int] = wall_clock_ms,
        make_id: Callable[[int], str] = generation_id,
    ) -> None:
        self._ids: dict[str, str] = {}
        self._next: dict[str, int] = {}
        self.paused: set[str] = set()
        self._clock_ms = clock_ms
        self._make_id = make_id
        self._floor = 0

    def id_for(self, queue: str) -> str:
        producer = self._ids.get(queue)
        if producer is None:
            generation = min(max(self._clock_ms(), self._floor + 1), MAX_GENERATION)
            producer = self._ids[queue] = self._make_id(generation)
        return producer

    def above(self, generation: int) -> None:
        """Ids made from now on have a generation above `generation` (one a queue
        forgot: an id of it or below would be refused)."""
        self._floor = max(self._floor, generation)

    def current(self, queue: str) -> str | None:
        """The id of this producer for `queue`, if it has one yet."""
        return self._ids.get(queue)

    def take(self, queue: str, count: int = 1) -> tuple[str, int]:
        seq = self._next.get(queue, 0)
        self._next[queue] = seq + count
        return self.id_for(queue), seq

    def renew(self, queue: str) -> None:
        self._ids.pop(queue, None)
        self._next.pop(queue, None)

    def check(self, key: str | None) -> None:
        if key is not None and key in self.paused:
            raise KeyPausedError(
                f"an earlier publish for key {key!r} failed; call resume({key!r}) first"
            )

    def failed(self, key: str | None) -> None:
        if key is not None:
            self.paused.add(key)


def check_message(body: object, key: object, headers: object) -> None:
    """A message's fields, checked before anything is sent: `TypeError` says what is
    expected (text must be encoded: a str body is refused, not guessed at)."""
    if type(body) is not bytes:
        raise TypeError(
            f"a message body must be bytes, not {type(body).__name__} "
            "(encode text first, e.g. text.encode())"
        )
    if key is not None and type(key) is not str:
        raise TypeError(f"a message key must be a str or None, not {type(key).__name__}")
    if headers is not None and (
        not isinstance(headers, Mapping)
        or not all(type(k) is str and type(v) is str for k, v in headers.items())
    ):
        raise TypeError("message headers must map str to str")


def publish_frame(
    request_id: int,
    queue: str,
    body: bytes,
    key: str | None,
    headers: Mapping[str, str] | None,
    producer: str,
    seq: int,
) -> dict[str, Any]:
    return {
        "t": "publish",
        "id": request_id,
        "queue": queue,
        "body": body,
        "key": key,
        "headers": dict(headers) if headers else None,
        "producer": producer,
        "seq": seq,
    }


def check_retry_delay(requeue: bool, delay_ms: int | None) -> None:
    """A nack's `delay_ms`: None, or an int from 0 to a day, with `requeue=True`."""
    if delay_ms is None:
        return
    if type(delay_ms) is not int:
        raise TypeError(f"delay_ms must be an int (milliseconds), got {type(delay_ms).__name__}")
    if not requeue:
        raise ValueError("delay_ms goes with requeue=True: a rejected message does not return")
    if not 0 <= delay_ms <= MAX_RETRY_DELAY_MS:
        raise ValueError(f"delay_ms must be from 0 to {MAX_RETRY_DELAY_MS}, got {delay_ms}")


def delivery_from(frame: dict[str, Any], queue: str, settle: Callable[..., Any]) -> Delivery:
    return Delivery(
        queue=queue,
        offset=frame["offset"],
        key=frame["key"],
        body=frame["body"],
        headers=frame["headers"],
        redelivered=frame["redelivered"],
        delivery_count=frame["delivery_count"],
        node=frame["node"],
        consumer=frame["consumer"],
        settle=settle,
    )


def read_result(frames: list[dict[str, Any]]) -> ReadResult:
    """A read's reply frames (pages) as one result: rows, or columns when the node sent
    columns (a node that does not know them answers rows)."""
    last = frames[-1]
    if all("columns" in f for f in frames):
        pages = [check_columns(f["columns"]) for f in frames]

        def joined(name: str) -> Any:
            if len(pages) == 1:  # the common case: nothing to copy
                return pages[0][name]
            if name == "bodies":
                return b"".join(p[name] for p in pages)
            return [v for p in pages for v in p[name]]

        columns = ReadColumns(**{name: joined(name) for name in READ_COLUMNS})
        return ReadResult(
            rows=[],
            first_retained=last["first_retained"],
            next_offset=last["next_offset"],
            columns=columns,
        )
    return ReadResult(
        rows=[r for f in frames for r in f.get("messages", [])],
        first_retained=last["first_retained"],
        next_offset=last["next_offset"],
    )


def hello_frame(
    welcome: dict[str, Any], token: str | None, admin_token: str | None = None
) -> dict[str, Any]:
    """The answer to a node's `welcome`: our protocol version, the token's proof and,
    for administrative verbs (membership), the admin token's."""
    if welcome["t"] == "error" and welcome.get("code") == "tls_required":
        raise TlsError(str(welcome.get("message", "the node serves clients over TLS only")))
    if welcome["t"] != "welcome":
        raise ProtocolError("bad_frame", "expected welcome")
    if welcome["auth"] and token is None:
        raise ServerError("auth_failed", "the node requires a token")
    proof = auth_proof(token, welcome["nonce"]) if token else None
    hello = {"t": "hello", "v": PROTOCOL_VERSION, "client": "python", "proof": proof}
    if admin_token:
        hello["admin_proof"] = auth_proof(admin_token, welcome["nonce"])
    return hello


def check_hello_answer(answer: dict[str, Any]) -> None:
    if answer["t"] == "error":
        raise ServerError(answer["code"], answer["message"])


def read_frame(
    queue: str,
    position: int,
    end: int,
    bucket: int | None,
    buckets: int | None,
    wait: float | None = None,
    columns: bool = False,
) -> dict[str, Any]:
    """A `read` request; with `wait` (seconds) the node waits that long for its replica
    to apply the whole range, and answers `lagging` if it cannot. `columns`: the rows
    column by column (`protocol.encode_columns`)."""
    frame: dict[str, Any] = {
        "t": "read",
        "queue": queue,
        "start": position,
        "end": end,
        "bucket": bucket,
        "buckets": buckets,
    }
    if wait is not None:
        frame["wait_ms"] = round(wait * 1000)
    if columns:
        frame["columns"] = True
    return frame


def read_continues_at(reply: dict[str, Any], position: int, end: int) -> int | None:
    """Where the next read of a range starts, or None when this reply finished it (a
    reply covers at most a few MiB; a replica covers at most what it has committed)."""
    covered: int = reply["covered_until"]
    if covered >= min(end, reply["next_offset"]) or covered <= position:
        return None
    return covered


WELCOME_S = 2.5
"""How long a new connection of a client made with `wait_for_nodes=False` (the command
line's) waits for the node's `welcome` (at most its connect timeout); other clients,
and every reconnect, wait their connect timeout, as a loaded node may be slow to send
it. A node sends it as it takes the connection, and a node that serves TLS only
answers a plain client's silence with `tls_required` after 1 s (`tls_silence_s`); an
endpoint silent past this is no quorumq client port (`NoWelcomeError`)."""
REFUSED_ROUNDS = 3
"""With `wait_for_nodes=False`: the rounds in which every endpoint refused the connection
before the client gives up (0.1 s apart: about 0.2 s)."""


def refused(error: BaseException) -> bool:
    """Whether `error` is a refused connection (trio's: every address it tried refused)."""
    if isinstance(error, ConnectionRefusedError):
        return True
    cause = error.__cause__
    return (
        isinstance(error, OSError)
        and isinstance(cause, BaseExceptionGroup)
        and all(isinstance(e, ConnectionRefusedError) for e in cause.exceptions)
    )


class ConnectFailures:
    """Why the endpoints could not be connected to, in one attempt to connect (both
    clients): what trying again cannot mend ends it at once. With `wait_for_nodes=False`
    so does what will not mend soon: every endpoint refusing the connection
    (`REFUSED_ROUNDS` rounds in a row), or a round of refusals and silences, one of them
    an endpoint that took the connection and sent no welcome (`UnreachableError`).
    Otherwise a node being started, which refuses until it listens, is waited for."""

    def __init__(self, endpoints: int, *, wait_for_nodes: bool = True) -> None:
        self._endpoints = endpoints
        self._wait_for_nodes = wait_for_nodes
        kept = max(endpoints, 1)
        self._errors: deque[tuple[str, str]] = deque(maxlen=6 * kept)
        """(endpoint, why) of the last failures, in order (a client that keeps trying for
        hours keeps only these)."""
        self._tls: dict[str, list[str]] = {}
        """TLS failures in a row, since the last failure of another kind: the endpoints
        that failed, by what went wrong."""
        self._tls_count = 0
        self._stuck: deque[tuple[str, bool]] = deque(maxlen=REFUSED_ROUNDS * kept)
        """Refusals and silences in a row, since the last failure of another kind, the
        last `REFUSED_ROUNDS` rounds of them: (endpoint, silent)."""

    def add(self, where: str, error: Exception) -> None:
        """Note that the endpoint `where` ("host:port") failed with `error`; raise it (a
        wrong token), a `TlsError` once every endpoint in a row failed TLS, or (not
        waiting for nodes) an `UnreachableError` once every endpoint refused or was
        silent."""
        if isinstance(error, ServerError) and error.code == "auth_failed":
            raise error
        was_refused = refused(error)
        self._errors.append((where, "connection refused" if was_refused else str(error)))
        if was_refused or isinstance(error, NoWelcomeError):
            self._stuck.append((where, not was_refused))
            if not self._wait_for_nodes:
                self._give_up_if_stuck()
        else:
            self._stuck.clear()
        if not isinstance(error, TlsError):
            self._tls.clear()
            self._tls_count = 0
            return
        self._tls.setdefault(str(error), []).append(where)
        self._tls_count += 1
        if self._tls_count >= self._endpoints:
            raise TlsError(
                "; ".join(
                    f"{', '.join(dict.fromkeys(where))}: {why}" for why, where in self._tls.items()
                )
            ) from None

    def _give_up_if_stuck(self) -> None:
        stuck = self._stuck
        if len(stuck) < self._endpoints:
            return
        last_round = list(stuck)[-self._endpoints :]
        if not any(silent for _, silent in last_round) and len(stuck) < (
            REFUSED_ROUNDS * self._endpoints
        ):
            return
        silent = list(dict.fromkeys(w for w, s in last_round if s))
        refusing = list(dict.fromkeys(w for w, s in last_round if not s))
        raise UnreachableError(self._message(last_round), refused=refusing, silent=silent) from None

    def _message(self, failures: list[tuple[str, bool]] | None = None) -> str:
        """Why no node answered, the endpoints that failed alike together: of the last
        few failures, or of `failures`."""
        errors = list(self._errors)
        if failures is not None:
            errors = errors[-len(failures) :]
        by_why: dict[str, list[str]] = {}
        for where, why in errors:
            endpoints = by_why.setdefault(why, [])
            if where not in endpoints:
                endpoints.append(where)
        parts = []
        for why, endpoints in list(by_why.items())[-6:]:
            hint = " (is a quorumq node running there?)" if why == "connection refused" else ""
            parts.append(f"{', '.join(endpoints)}: {why}{hint}")
        return "no quorumq node answered: " + "; ".join(parts)

    def give_up(self) -> ConnectionLostError:
        """The error once the time to connect is over."""
        return ConnectionLostError(self._message())


def parse_endpoints(endpoints: str | list[str] | tuple[str, ...]) -> list[tuple[str, int]]:
    """'host:port,host:port' or a list of 'host:port' -> [(host, port)]."""
    items = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
    parsed = []
    for item in items:
        host, sep, port = item.strip().rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"endpoint {item!r} is not host:port")
        parsed.append((host or "127.0.0.1", int(port)))
    if not parsed:
        raise ValueError("no endpoints given")
    return parsed


def report_node_error(frame: dict[str, Any]) -> None:
    """Log an error frame that answers no request (acks and nacks carry no id). A settle
    refused because its consumer is gone is expected after a failover: the message
    comes back to the queue anyway, so it is not worth a warning."""
    if frame.get("code") == "settle_failed":
        logger.info("the node refused an ack or nack: %s", frame["message"])
    else:
        logger.warning("node reports %s: %s", frame["code"], frame["message"])
