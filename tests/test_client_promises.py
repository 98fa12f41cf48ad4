"""The client's promises against real node processes (SIGSTOP, big frames): a frame is
written whole whatever cancels the caller; a publish with no confirm in time is
"outcome unknown", stays live, pauses its key and lands once; a publish that can never
fit fails at once and leaves the client usable."""

from __future__ import annotations

import time

import pytest
import trio

import quorumq.aio
from quorumq.client import KeyPausedError, OutcomeUnknownError, ServerError
from quorumq.embedded import Cluster

from .helpers import wait_for

pytestmark = pytest.mark.slow


def test_a_publish_with_no_confirm_in_time_is_outcome_unknown_pauses_its_key_and_lands_once() -> (
    None
):
    with Cluster(3) as cluster:
        client = cluster.client("A", timeout=1.0)
        client.declare("q")
        cluster.pause("A")
        try:
            with pytest.raises(OutcomeUnknownError, match="may still land"):
                client.publish("q", b"m", key="k")
            assert client.paused_keys() == {"k"}
            with pytest.raises(KeyPausedError):  # the app's retry: refused, not a duplicate
                client.publish("q", b"m", key="k")
            assert client.settling_keys() == {"k"}  # still live: a read proves nothing yet
            with pytest.raises(KeyPausedError, match="settling_keys"):
                client.resume("k")
        finally:
            cluster.resume("A")
        client.timeout = 20.0
        client.publish("q", b"n", key="other")  # resends go first, in order
        wait_for(lambda: not client.settling_keys(), "k to settle")
        reader = cluster.client("B")
        wait_for(lambda: len(reader.read("q", 0, 10)) >= 2, "both in the log")
        assert [m.body for m in reader.read("q", 0, 10)] == [b"m", b"n"]  # m once
        client.resume("k")  # it landed: the application does not publish it again
        client.publish("q", b"o", key="k")


def test_a_cancelled_publish_never_leaves_half_a_frame_on_the_connection() -> None:
    """A 6 MiB publish to a stopped node, cancelled after 1 s, left half a frame on the
    stream: the node read every later frame as part of it, for good. Here 24 MB of
    publishes fill the socket buffers of a stopped node, so one is cancelled mid-frame."""
    with Cluster(3) as cluster:

        async def main() -> None:
            async with quorumq.aio.connect(cluster.endpoint("A"), timeout=3.0) as client:
                await client.declare("q")
                cluster.pause("A")
                try:
                    with trio.move_on_after(1):
                        async with trio.open_nursery() as nursery:
                            for i in range(24):
                                nursery.start_soon(
                                    client.publish, "q", b"x" * 1_000_000, f"big{i}"
                                )
                finally:
                    cluster.resume("A")
                client.timeout = 20.0
                with trio.fail_after(30):
                    assert await client.publish("q", b"small", key="other") >= 0
                assert client.paused_keys()  # the cancelled ones: outcome unknown

        trio.run(main)


def test_a_body_over_the_frame_limit_fails_at_once_and_leaves_the_client_usable() -> None:
    """It was resent in a tight loop (14,165 times in 30 s), then failed with a timeout,
    and the next small publish of the same client failed too."""
    with Cluster(3) as cluster:
        client = cluster.client("A", timeout=10.0)
        client.declare("q")
        started = time.monotonic()
        with pytest.raises(ServerError, match="too_large"):
            client.publish("q", b"x" * (2 * 1024 * 1024), key="big")
        assert time.monotonic() - started < 2
        assert client.publish("q", b"small") == 0

