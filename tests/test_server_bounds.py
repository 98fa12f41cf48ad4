"""What an unauthenticated peer can make a node hold is bounded (issue 13, item 5): a
small frame limit before `hello`, a handshake deadline, and a cap on connections."""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable
from pathlib import Path

import attrs
import trio

import quorumq.aio
from quorumq.server import NodeServer
from quorumq.wire.protocol import FrameDecoder, encode_frame

from .test_server import _config, _serve_with


async def _frames_until_closed(stream: trio.SocketStream, within: float) -> list[dict[str, object]]:
    """Every frame the node sends until it closes the connection (fails after `within`)."""
    decoder = FrameDecoder()
    frames: list[dict[str, object]] = []
    with trio.fail_after(within):
        while True:
            try:
                data = await stream.receive_some(65536)
            except trio.BrokenResourceError:
                break
            if not data:
                break
            decoder.feed(data)
            frames.extend(decoder.frames())
    return frames


async def _wait_for(condition: Callable[[], bool], within: float, what: str) -> None:
    """Poll `condition` until it holds; fail, saying `what`, after `within` seconds."""
    deadline = trio.current_time() + within
    for _ in itertools.count():
        if condition():
            return
        if trio.current_time() > deadline:
            raise AssertionError(f"not within {within} s: {what}")
        await trio.sleep(0.01)


def test_a_peer_that_says_nothing_is_dropped_after_the_handshake_deadline(tmp_path: Path) -> None:
    config = attrs.evolve(_config(tmp_path), handshake_timeout_s=0.5)
    server = NodeServer(config)

    async def body(endpoint: str) -> None:
        host, port = endpoint.rsplit(":", 1)
        async with await trio.open_tcp_stream(host, int(port)) as stream:
            frames = await _frames_until_closed(stream, 5)  # it stayed open for good before
        assert [f["t"] for f in frames] == ["welcome", "error"]
        assert frames[1]["code"] == "hello_timeout"
        for _ in range(100):  # the node forgets it right after closing: 1 s at most
            if not server.connections:
                break
            await trio.sleep(0.01)
        assert not server.connections
        async with quorumq.aio.connect(endpoint) as client:  # a real client says hello
            await client.declare("q")

    _serve_with(server, body)


def test_a_big_frame_before_hello_closes_the_connection_at_once(tmp_path: Path) -> None:
    async def body(endpoint: str) -> None:
        host, port = endpoint.rsplit(":", 1)
        async with await trio.open_tcp_stream(host, int(port)) as stream:
            await stream.send_all(encode_frame({"t": "hello", "pad": b"x" * 100_000}))
            frames = await _frames_until_closed(stream, 3)
        assert frames[-1]["t"] == "error" and frames[-1]["code"] == "frame_too_large"

    _serve_with(NodeServer(_config(tmp_path)), body)


def test_garbage_before_hello_gets_one_error_frame_and_the_connection_closed(
    tmp_path: Path,
) -> None:
    """A frame that failed to decode before `hello` was answered and skipped: 20,000
    five-byte garbage frames queued 17,439 error frames (1.6 MB) on one connection."""
    config = attrs.evolve(_config(tmp_path), handshake_timeout_s=30)
    server = NodeServer(config)

    async def body(endpoint: str) -> None:
        host, port = endpoint.rsplit(":", 1)
        garbage = b"\x00\x00\x00\x01\xc1" * 20_000  # 0xc1 is never msgpack
        async with await trio.open_tcp_stream(host, int(port)) as stream:
            await stream.send_all(garbage)
            decoder = FrameDecoder()
            frames: list[dict[str, object]] = []
            # closed at once, long before the handshake deadline (with unread garbage in
            # the node's buffer the close is a reset: what came before it is still read)
            with trio.move_on_after(5), contextlib.suppress(trio.BrokenResourceError):
                while data := await stream.receive_some(65536):
                    decoder.feed(data)
                    frames.extend(decoder.frames())
        kinds = [f["t"] for f in frames]
        assert kinds == ["welcome", "error"], f"{len(kinds)} frames: {kinds[:4]}..."
        assert frames[1]["code"] == "bad_frame"
        await _wait_for(lambda: not server.connections, 1, "the node forgets it at once")

    _serve_with(server, body)


def test_connections_over_the_cap_are_refused_with_a_reason(tmp_path: Path) -> None:
    config = attrs.evolve(_config(tmp_path), max_connections=3, max_unauthenticated=2)

    async def body(endpoint: str) -> None:
        host, port = endpoint.rsplit(":", 1)
        async with contextlib.AsyncExitStack() as clients:
            for _ in range(3):  # three real clients: they said hello
                client = await clients.enter_async_context(quorumq.aio.connect(endpoint))
                await client.status()
            async with await trio.open_tcp_stream(host, int(port)) as extra:
                frames = await _frames_until_closed(extra, 3)
            assert [f.get("code") for f in frames] == ["too_many_connections"]

    _serve_with(NodeServer(config), body)


def test_silent_connections_cannot_lock_real_clients_out(tmp_path: Path) -> None:
    """Unauthenticated connections counted against the one cap of 1,024: re-opening
    1,024 silent connections every 5 s locked every real client out. Now at most
    `max_unauthenticated` wait for their `hello`, and a new one closes the oldest."""
    config = attrs.evolve(
        _config(tmp_path), max_connections=8, max_unauthenticated=3, handshake_timeout_s=30
    )
    server = NodeServer(config)

    async def body(endpoint: str) -> None:
        host, port = endpoint.rsplit(":", 1)
        silent: list[trio.SocketStream] = []
        most = 0
        try:
            with trio.fail_after(20):
                for _ in range(40):  # an attacker opening connections and saying nothing
                    stream = await trio.open_tcp_stream(host, int(port))
                    silent.append(stream)
                    await _first_frame(stream)  # welcomed: being served
                    most = max(most, len(server.connections))
                assert most <= 3  # what they hold is bounded: 3 connections, not 40
                for _ in range(3):  # and real clients still get in, and stay
                    async with quorumq.aio.connect(endpoint) as client:
                        await client.declare("q")
                        stream = await trio.open_tcp_stream(host, int(port))
                        silent.append(stream)  # one more silent peer meanwhile
                        await _first_frame(stream)
                        assert (await client.status())["clients"] >= 1
                # the node closed the evicted ones; the newest 3 are still open
                ended = [await _ended_within(stream, 0.5) for stream in silent]
                assert ended == [True] * (len(silent) - 3) + [False] * 3
        finally:
            for stream in silent:
                await stream.aclose()

    _serve_with(server, body)


async def _ended_within(stream: trio.SocketStream, within: float) -> bool:
    """Whether the node closes `stream` within `within` seconds (reading what is left)."""
    with trio.move_on_after(within):
        try:
            while await stream.receive_some(65536):
                pass
        except trio.BrokenResourceError:
            pass
        return True
    return False


async def _first_frame(stream: trio.SocketStream) -> dict[str, object]:
    decoder = FrameDecoder()
    with trio.fail_after(5):
        while True:
            decoder.feed(await stream.receive_some(65536))
            for frame in decoder.frames():
                return frame


def test_status_never_hashes_the_state_unless_audited(tmp_path: Path, monkeypatch: object) -> None:
    """`status` hashed the whole state under the replica lock on the event loop (0.5 s
    at 200,000 messages: a follower stalled past the election timeout). Now only an
    audit encodes the state, and not in the node's process (in a forked child)."""
    from quorumq.machine import Machine

    calls: list[str] = []
    real_digest, real_snapshot = Machine.digest, Machine.snapshot

    def counted_digest(self: Machine) -> str:
        calls.append("digest")
        return real_digest(self)

    def counted_snapshot(self: Machine) -> bytes:
        calls.append("snapshot")  # in the audit's child, this list is the child's copy
        return real_snapshot(self)

    monkeypatch.setattr(Machine, "digest", counted_digest)  # type: ignore[attr-defined]
    monkeypatch.setattr(Machine, "snapshot", counted_snapshot)  # type: ignore[attr-defined]

    async def body(endpoint: str) -> None:
        async with quorumq.aio.connect(endpoint) as client:
            await client.declare("q")
            await client.publish_batch("q", [b"m"] * 500)
            status = await client.status()
            assert "digest" not in status and calls == []
            audited = await client.status(audit=True)
            assert len(audited["digest"]) == 64 and calls == []

    _serve_with(NodeServer(_config(tmp_path)), body)


def test_an_audit_is_the_digest_of_the_state_at_the_index_it_names(tmp_path: Path) -> None:
    from quorumq.machine import Declare, EnqueueBatch, Message

    server = NodeServer(_config(tmp_path))

    async def body(endpoint: str) -> None:
        replica = server.replica
        rows = [Message(body=bytes([i % 256]) * 100, key=f"k{i % 7}") for i in range(5000)]
        for command in (Declare(queue="q"), EnqueueBatch(queue="q", messages=rows)):
            await trio.to_thread.run_sync(replica.submit, command)
        with trio.fail_after(10):  # no producers, no TTL: nothing moves the state now
            index, digest = await trio.to_thread.run_sync(replica.audit)
            status = await trio.to_thread.run_sync(lambda: replica.status(audit=True))
        assert (index, digest) == replica.query(lambda m: (m.last_index, m.digest()))
        assert (status["machine_index"], status["digest"]) == (index, digest)

    _serve_with(server, body)


def test_an_audit_needs_the_admin_token(tmp_path: Path) -> None:
    """Any client could start audits, each a copy of the whole state."""
    from quorumq.client import ServerError

    config = attrs.evolve(_config(tmp_path), token="client", admin_token="admin", insecure=False)

    async def body(endpoint: str) -> None:
        with trio.fail_after(10):
            async with quorumq.aio.connect(endpoint, "client") as client:
                assert "digest" not in await client.status()  # plain status: any client
                try:
                    await client.status(audit=True)
                    raise AssertionError("a client without the admin token audited")
                except ServerError as e:
                    assert e.code == "admin_required" and "QUORUMQ_ADMIN_TOKEN" in e.message
            async with quorumq.aio.connect(endpoint, "client", admin_token="admin") as admin:
                assert len((await admin.status(audit=True))["digest"]) == 64

    _serve_with(NodeServer(config), body)


def test_an_audit_leaves_the_replica_free_while_it_encodes_and_runs_alone(
    tmp_path: Path, monkeypatch: object
) -> None:
    """The audit encoded the whole state under the replica lock: the Raft thread, which
    needs it for every entry it applies, stopped for 0.29 s at 200,000 messages (and
    sent no heartbeats), and every pipelined audit took a thread and a copy of the
    state. Here the encoding is held up until the test lets it go: meanwhile the node
    applies and answers, and a second audit is refused."""
    from quorumq.client import ServerError
    from quorumq.machine import Machine

    started, release = tmp_path / "encoding", tmp_path / "release"
    real_snapshot = Machine.snapshot

    def held_snapshot(self: Machine) -> bytes:  # wherever the audit encodes the state
        started.touch()
        for _ in range(2000):  # 20 s at most
            if release.exists():
                break
            time.sleep(0.01)
        return real_snapshot(self)

    monkeypatch.setattr(Machine, "snapshot", held_snapshot)  # type: ignore[attr-defined]

    async def body(endpoint: str) -> None:
        audits: list[dict[str, object]] = []

        async def audit(client: quorumq.aio.AsyncClient) -> None:
            audits.append(await client.status(audit=True))

        async with (
            quorumq.aio.connect(endpoint) as first,
            quorumq.aio.connect(endpoint) as other,
            trio.open_nursery() as nursery,
        ):
            try:
                with trio.fail_after(10):
                    await other.declare("q")
                    await other.publish_batch("q", [b"m"] * 100)
                    nursery.start_soon(audit, first)
                    await _wait_for(started.exists, 10, "the audit encoding the state")
                with trio.fail_after(5):  # the lock is free: the node applies and answers
                    offset = await other.publish("q", b"during the audit")
                    assert (await other.status())["queues"]["q"]["next_offset"] == offset + 1
                with trio.fail_after(5):
                    try:
                        await other.status(audit=True)
                        raise AssertionError("a second audit ran alongside the first")
                    except ServerError as e:
                        assert e.code == "audit_busy"
                assert not audits
            finally:
                release.touch()  # never leave the encoding waiting
        (audited,) = audits
        assert len(audited["digest"]) == 64  # type: ignore[arg-type]
        assert audited["machine_index"] < (await _status_index(endpoint))  # type: ignore[operator]

    _serve_with(NodeServer(_config(tmp_path)), body)


async def _status_index(endpoint: str) -> int:
    async with quorumq.aio.connect(endpoint) as client:
        index: int = (await client.status())["machine_index"]
        return index


# ------------------------------------------------------------------ credentials


def test_a_node_without_a_client_token_needs_insecure_and_loopback(tmp_path: Path) -> None:
    import pytest

    from quorumq.replica import ConfigError

    open_to_all = attrs.evolve(_config(tmp_path), insecure=False)
    with pytest.raises(ConfigError, match="client token is required"):
        NodeServer(open_to_all)
    public = attrs.evolve(_config(tmp_path), listen_host="0.0.0.0")
    with pytest.raises(ConfigError, match="loopback only"):
        NodeServer(public)
    NodeServer(attrs.evolve(_config(tmp_path), token="t", listen_host="0.0.0.0"))


def test_membership_needs_the_admin_token(tmp_path: Path) -> None:
    """Three fake `members add` by any client left a 3-node cluster without a quorum."""
    from quorumq.client import ServerError

    config = attrs.evolve(_config(tmp_path), token="client", admin_token="admin", insecure=False)

    async def body(endpoint: str) -> None:
        async with quorumq.aio.connect(endpoint, "client") as client:
            with trio.fail_after(10):
                await client.declare("q")  # an ordinary verb: the client token is enough
                try:
                    await client._request(
                        {"t": "add_member", "node": "X", "raft_address": "127.0.0.1:1"}
                    )
                    raise AssertionError("a client without the admin token changed members")
                except ServerError as e:
                    assert e.code == "admin_required" and "QUORUMQ_ADMIN_TOKEN" in e.message
        async with quorumq.aio.connect(endpoint, "client", admin_token="wrong") as client:
            with trio.fail_after(10):
                try:
                    await client._request({"t": "remove_member", "node": "X"})
                    raise AssertionError("a wrong admin token was taken")
                except ServerError as e:
                    assert e.code == "admin_required"
        async with quorumq.aio.connect(endpoint, "client", admin_token="admin") as client:
            with trio.fail_after(10):
                try:
                    await client._request({"t": "remove_member", "node": "X"})
                except ServerError as e:  # past the credential check: X is no member
                    assert e.code == "unknown_member"

    _serve_with(NodeServer(config), body)


def test_a_stuck_consumer_is_cancelled_with_a_reason_and_its_message_goes_to_another(
    tmp_path: Path,
) -> None:
    async def body(endpoint: str) -> None:
        async with quorumq.aio.connect(endpoint) as client:
            with trio.fail_after(20):
                await client.declare("q", consumer_timeout_ms=300)
                stuck = await client.subscribe("q", prefetch=1)
                await client.publish("q", b"m")
                first = await stuck.get()
                assert first is not None and not first.redelivered  # never acked
                patient = await client.subscribe("q", prefetch=1, timeout_ms=60_000)
                again = await patient.get()  # ticks move time: the stuck one times out
                assert again is not None and again.redelivered and again.body == b"m"
                assert await stuck.get() is None  # ended ...
                assert stuck.cancel_reason == "consumer_timeout"  # ... saying why
                await again.ack()

    _serve_with(NodeServer(_config(tmp_path)), body)


def test_a_client_cannot_forget_other_clients_producers_with_a_short_prefix(
    tmp_path: Path,
) -> None:
    """Any client could forget every client producer of a queue with the prefixes
    "0".."f"; a forgotten producer's resend can then be accepted as new. Client ids
    begin with their generation ("g<ms>-"), which anyone can guess: 169 prefixes of 12
    characters forgot other clients' producers (review F). And forgetting even its own
    id moves the queue's forgotten generation, failing other clients' first publishes:
    a client looped it (second review, 4). Client ids are the admin's to forget."""
    from quorumq.client import ServerError

    config = attrs.evolve(_config(tmp_path), token="client", admin_token="admin", insecure=False)
    min_prefix = 12

    async def producers(client: quorumq.aio.AsyncClient) -> int:
        count: int = (await client.status())["queues"]["q"]["producers"]
        return count

    async def body(endpoint: str) -> None:
        with trio.fail_after(20):
            async with quorumq.aio.connect(endpoint, "client") as producer:
                await producer.declare("q")
                await producer.publish("q", b"m")  # under its random 32-hex producer id
                own = producer.producer.id_for("q")
            past_generation = own.index("-") + 1  # "g<generation>-"
            async with quorumq.aio.connect(endpoint, "client") as other:
                for prefix in [
                    *"0123456789abcdefg",
                    own[: min_prefix - 1],
                    own[:min_prefix],  # "g" and the generation: a time, guessed
                    own[: past_generation + min_prefix],
                    own,  # its own, whole: moves the mark for every client
                ]:
                    try:
                        await other.forget_producers("q", prefix)
                        raise AssertionError(f"a client forgot the producers {prefix!r}*")
                    except ServerError as e:
                        assert e.code == "admin_required", e
                        assert f"at least {min_prefix}" in e.message
                assert await producers(other) == 1  # every short prefix refused
                # a long prefix (its own producer's, a Spark batch's) is a client's to forget
                query = "01234567-89ab-cdef-0123-456789abcdef"
                await other.publish_batch("q", [b"s"], producer=f"spark-{query}-7-0", first_seq=0)
                assert await producers(other) == 2
                # a long prefix that is no client id (a Spark batch's) is a client's to forget
                assert await other.forget_producers("q", f"spark-{query}-7-") == 1
                assert await producers(other) == 1
            async with quorumq.aio.connect(endpoint, "client", admin_token="admin") as admin:
                await admin.publish("q", b"n")
                assert await producers(admin) == 2
                short = admin.producer.id_for("q")[0]  # an operator's cleanup: allowed
                assert await admin.forget_producers("q", short) == 2

    _serve_with(NodeServer(config), body)
