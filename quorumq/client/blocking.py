"""The blocking client: a socket, a reader thread, and futures, around a `ClientSession`.

Publishing is idempotent: the client is a producer with an id and a sequence per queue,
so a resend (after a leader change, a timeout or a reconnect to another node) is
recognised by the queue and never gets a second offset. When the connection breaks,
the reader thread connects to the next endpoint, resends every unconfirmed publish in
order and subscribes its consumers again (messages they held come back redelivered). A
subscribe that fails because of a leader change or a lost connection is tried again,
with backoff, until the client's `timeout` has passed (`ClientSession.subscribe_retry_delay`).

Two locks: `_send_lock` orders writes (a publish takes its sequence number and is
written under it, so send order is sequence order), `_lock` guards the session. A
write never holds `_lock`, and ends by the client's `timeout` (else the connection is
dropped and the reader thread reconnects): a node that stops reading cannot stall the
reader thread, the other callers or `close()`.

Its connection (one socket at a time, reconnects, the reader thread, requests and
their deadlines, and `Consumer`) is `ClientConnection` (`connection.py`), which
`Client` extends with the verbs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

from .connection import ClientConnection, Consumer, handshake
from .core import (
    ReadResult,
    check_message,
    read_continues_at,
    read_frame,
    read_result,
)

MessageLike = (
    bytes
    | tuple[bytes, str | None]
    | tuple[bytes, str | None, Mapping[str, str] | None]
    | Mapping[str, Any]
)

_ROW_FIELDS = frozenset({"body", "key", "headers"})


def landed_offsets(answer: Mapping[str, Any], count: int) -> list[int]:
    """The offsets of a batch's messages that landed: all `count` of them, or (a batch
    numbered by `seqs`) the last `answer["count"]`; none for a duplicate."""
    first: int | None = answer["offset"]
    landed = answer.get("count", count)
    return [] if first is None else list(range(first, first + landed))


def batch_rows(messages: Iterable[MessageLike]) -> list[list[Any]]:
    """[body, key, headers] rows from bodies, (body, key[, headers]) tuples, or maps with
    the named fields `body` (required), `key` and `headers`; each checked before
    anything is sent (`TypeError` says what is wrong)."""
    rows: list[list[Any]] = []
    for m in messages:
        if isinstance(m, bytes):
            body, key, headers = m, None, None
        elif isinstance(m, Mapping):
            unknown = set(m) - _ROW_FIELDS
            if unknown or "body" not in m:
                raise TypeError(
                    f"a message given as a map has the fields body (required), key and "
                    f"headers; got {sorted(m)}"
                )
            body, key, headers = m["body"], m.get("key"), m.get("headers")
        elif isinstance(m, tuple) and len(m) in (2, 3):
            body, key, headers = m[0], m[1], m[2] if len(m) == 3 else None
        else:
            raise TypeError(
                "a message is bytes, a (body, key[, headers]) tuple or a map with body, key "
                f"and headers; got {type(m).__name__}"
            )
        check_message(body, key, headers)
        rows.append([body, key, dict(headers) if headers else None])
    return rows


class Client(ClientConnection):
    """A connection to a quorumq cluster through any of its nodes."""

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
        """Publish without waiting; the future's result has the `offset` once committed.

        It fails as `publish` would: with `OutcomeUnknownError` (the key paused) if no
        confirm comes within the client's `timeout`; the publish then stays live."""
        return self._publish(queue, body, key, headers)[1]

    def _publish(
        self, queue: str, body: bytes, key: str | None, headers: Mapping[str, str] | None
    ) -> tuple[int, Future[dict[str, Any]]]:
        check_message(body, key, headers)
        return self._issue(self._session.publish, queue, body, key, headers, publish=True)

    def publish(
        self,
        queue: str,
        body: bytes,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> int:
        """Publish and wait for the confirm; return the message's offset.

        `OutcomeUnknownError` (no confirm within the client's `timeout`): the publish is
        still being resent and may land, once; don't publish it again. Its key is paused
        until `resume(key)`. Any other error: it was not published, and its key is paused."""
        request_id, future = self._publish(queue, body, key, headers)
        offset: int = self._wait(request_id, future, publish=True)["offset"]
        return offset

    def publish_batch(
        self,
        queue: str,
        messages: Iterable[MessageLike],
        *,
        producer: str | None = None,
        first_seq: int | None = None,
        seqs: Sequence[int] | None = None,
        opens: bool = False,
    ) -> list[int]:
        """Publish messages as one log entry (all land, in order, or none); their offsets.

        By default the batch takes this client's next sequence numbers. A caller that
        replays its input after a crash passes its own `producer` id and `first_seq`,
        derived from that input: a resent batch is then recognised and not enqueued
        again. Its offsets come back while the queue remembers them (the last 1,024
        sequence numbers of the producer); an older resend returns an empty list.

        Or `producer` and `seqs`, one number per message, strictly increasing but with
        gaps allowed (say, each input record's own offset): the messages numbered above
        the producer's last land, the others are duplicates, so a replay that reads
        fewer records still numbers each as before. The offsets of those that landed
        come back. One such batch per producer at a time: wait for its answer. The
        producer's first batch says so (`opens=True`): a producer the queue does not
        know (never seen, or forgotten) takes only that one, and refuses a later one
        (`out_of_order`) rather than landing it a second time."""
        rows = batch_rows(messages)
        wanted = None if seqs is None else list(seqs)
        request_id, future = self._issue(
            self._session.publish_batch,
            queue,
            rows,
            producer,
            first_seq,
            wanted,
            opens,
            publish=True,
        )
        return landed_offsets(self._wait(request_id, future, publish=True), len(rows))

    def paused_keys(self) -> set[str]:
        """Keys whose publishes fail fast (`KeyPausedError`) until `resume(key)`."""
        with self._lock:
            return set(self.producer.paused)

    def settling_keys(self) -> set[str]:
        """Keys with a publish still live (unconfirmed, resent until a node answers it).
        After `OutcomeUnknownError`, wait until its key has left: then nothing more can
        land for it, a `read` tells whether it landed, and `resume(key)` is allowed."""
        with self._lock:
            return self._session.settling_keys()

    def resume(self, key: str) -> None:
        """Publishing for `key` may go on after a failure was handled. `KeyPausedError`
        while the key is in `settling_keys()` (a publish of it may still land)."""
        with self._lock:
            self._session.resume(key)

    def subscribe(
        self, queue: str, prefetch: int = 100, *, timeout_ms: int | None = None
    ) -> Consumer:
        """Start receiving from `queue`; at most `prefetch` unacked deliveries at a time.

        A subscribe that fails because of a leader change, or because the connection
        broke, is tried again until the client's `timeout` has passed; the consumer
        subscribes again by itself, the same way, after its node goes away.

        `timeout_ms`: how long the consumer may hold a delivery before the queue cancels
        it (reason `consumer_timeout`) and its messages return; by default the queue's
        `consumer_timeout_ms`, else 30 minutes."""
        consumer = Consumer(self, queue, prefetch)
        consumer.timeout_ms = timeout_ms
        self._subscribe_retrying(consumer)
        return consumer

    def read(
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
        """Stream view: retained messages with offsets in [start, end) that this node has
        committed (and in `bucket` of `buckets` by key), in offset order.

        Without `wait` the result stops where this node's replica is (`next_offset`).
        With `wait` (seconds) the range is known to be committed (say `end` came from
        `status`): a node whose replica lags waits for it, and past `wait` the read
        fails with `ServerError` code `lagging` (ask another node); it never returns
        part of the range.

        `columns`: the messages column by column (`ReadResult.columns`, bodies in one
        bytes object), for readers that build Arrow arrays; `rows` is empty then."""
        frames = []
        position: int | None = start
        while position is not None:
            reply = self._request(read_frame(queue, position, end, bucket, buckets, wait, columns))
            frames.append(reply)
            position = read_continues_at(reply, position, end)
        return read_result(frames)

    def commit_offset(self, queue: str, group: str, offset: int) -> None:
        self._request({"t": "commit_offset", "queue": queue, "group": group, "offset": offset})

    def forget_producers(self, queue: str, prefix: str, *, seal: bool = False) -> int:
        """Forget the idempotent producers of `queue` whose id starts with `prefix` (not
        empty); return how many. Only for producers that will never resend: a forgotten
        producer is new again, so its next publish must have sequence number 0, and any
        other is refused (`out_of_order`, expected 0). With `seal` (a prefix ending in
        "-"), no new producer under the prefix is taken for 7 days either
        (`producer_sealed`): what the Spark sink does once a job or batch committed."""
        frame: dict[str, Any] = {"t": "forget_producers", "queue": queue, "prefix": prefix}
        if seal:
            frame["seal"] = True
        reply = self._request(frame)
        return int(reply["forgotten"])

    def purge_queue(self, queue: str) -> int:
        """Remove every ready message of `queue` (those waiting for a retry delay too);
        return how many. Delivered ones stay with their consumers, to ack or nack as
        before; the stream view (`read`) keeps everything until retention drops it."""
        reply = self._request({"t": "purge_queue", "queue": queue})
        return int(reply["messages"])

    def delete_queue(self, queue: str, force: bool = False) -> dict[str, int]:
        """Delete `queue` with its messages, stream view, producers and committed
        offsets; return {"messages": removed, "consumers": cancelled}. A queue with
        consumers is refused (`ServerError` "queue_in_use") unless `force`: then each
        of its consumers ends (`cancel_reason == "queue_deleted"`), and what they held
        is deleted with the rest (nothing is dead-lettered). Like `declare`, it is not
        sent again by the client: after `outcome_unknown`, `status()` tells. A queue
        declared again under the name is empty, and carries on from the offset where
        this one ended; it refuses this one's producer ids (another client's next
        publish to it fails with `producer_forgotten`, and the one after goes through)."""
        reply = self._request({"t": "delete_queue", "queue": queue, "force": force})
        with self._lock:
            self._session.queue_deleted(queue)
        return {"messages": int(reply["messages"]), "consumers": int(reply["consumers"])}

    def add_member(self, node: str, raft_address: str) -> dict[str, str]:
        """Add a replica to the cluster (start its node first, with the current members and
        itself as peers). Returns the members once the change is committed."""
        reply = self._request({"t": "add_member", "node": node, "raft_address": raft_address})
        return dict(reply["members"])

    def remove_member(self, node: str) -> dict[str, str]:
        """Remove a replica (send this to another member; a leader hands leadership over
        first). Returns the members once the change is committed; stop that node then."""
        reply = self._request({"t": "remove_member", "node": node})
        return dict(reply["members"])

    def status(self, *, audit: bool = False) -> dict[str, Any]:
        """The node's status. `audit`: with the state `digest` too (equal digests at an
        equal `machine_index` mean equal replicas); it hashes every message, so the node
        computes it in a worker thread, and it costs time with many messages queued."""
        frame: dict[str, Any] = {"t": "status", "audit": True} if audit else {"t": "status"}
        status: dict[str, Any] = self._request(frame)["status"]
        return status


def connect(endpoints: str | list[str], token: str | None = None, **options: Any) -> Client:
    """A blocking client connected to one of `endpoints` ("host:port", comma-separated or
    a list); it moves to the others when its node goes away. `tls=True` (the system's
    CAs), `tls="ca.pem"` or `tls=<ssl.SSLContext>`: over TLS (see `Client`)."""
    return Client(endpoints, token, **options)


__all__ = [
    "Client",
    "Consumer",
    "MessageLike",
    "batch_rows",
    "connect",
    "handshake",
    "landed_offsets",
]
