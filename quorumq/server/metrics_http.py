"""Prometheus metrics over HTTP, served from the node's own trio loop and bounded, so
that no number of connections to the metrics port can starve the node.

prometheus_client's server took a thread and a file descriptor per connection, with no
cap and no read deadline: about 1,007 idle sockets (no bytes sent, no credentials) used
up a 1,024 file limit, the node's next journal write failed with EMFILE, and it stopped.
Here at most `MAX_METRICS_CONNECTIONS` are open at once (one more is closed as soon as
it is accepted), each must send its request within `READ_DEADLINE_S` and the whole
exchange must end within `EXCHANGE_DEADLINE_S`, and a request head is read up to
`MAX_REQUEST_BYTES`. Only `GET /metrics` (and `/`) is served; the page is rendered on a
worker thread, one scrape at a time, so the loop never waits on it.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import trio

from ..raft.cipher import ThrottledWarning

logger = logging.getLogger(__name__)

MAX_METRICS_CONNECTIONS = 16
"""Open connections to the metrics port at most (Prometheus uses one per scrape)."""
READ_DEADLINE_S = 5.0
"""A connection must have sent its whole request head by then, or it is closed."""
EXCHANGE_DEADLINE_S = 30.0
"""A connection is closed by then, whatever it is doing (a scraper that never reads)."""
MAX_REQUEST_BYTES = 8 * 1024
"""The longest request head read; a longer one is answered 431 and closed."""
CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"


class MetricsServer:
    """Serves `render()` (the exposition text) on the listeners given to `serve`."""

    def __init__(self, render: Callable[[], bytes]) -> None:
        self._render = render
        self._rendering = trio.CapacityLimiter(1)
        self.open_connections = 0
        self.refused = 0
        """Connections closed at once because `MAX_METRICS_CONNECTIONS` were open."""
        self._render_failed = _LoggedFailure()
        self._refusing = ThrottledWarning(
            logger,
            f"the metrics port has {MAX_METRICS_CONNECTIONS} open connections: closing more "
            "at once (idle or slow scrapers, or a flood)",
        )

    async def serve(self, listeners: list[trio.SocketListener]) -> None:
        """Serve until cancelled."""
        await trio.serve_listeners(self._connection, listeners)

    async def _connection(self, stream: trio.SocketStream) -> None:
        if self.open_connections >= MAX_METRICS_CONNECTIONS:
            self.refused += 1
            self._refusing()
            await trio.aclose_forcefully(stream)
            return
        self.open_connections += 1
        try:
            with trio.move_on_after(EXCHANGE_DEADLINE_S):
                await self._exchange(stream)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass  # the scraper went away
        finally:
            self.open_connections -= 1
            await trio.aclose_forcefully(stream)

    async def _exchange(self, stream: trio.SocketStream) -> None:
        head = bytearray()
        with trio.move_on_after(READ_DEADLINE_S):
            while b"\r\n\r\n" not in head and len(head) <= MAX_REQUEST_BYTES:
                chunk = await stream.receive_some(4096)
                if not chunk:
                    return
                head += chunk
        if b"\r\n\r\n" not in head:
            if len(head) > MAX_REQUEST_BYTES:
                await _answer(stream, 431, b"request head too long\n")
            return  # (silent past the deadline: nothing to answer)
        request_line = bytes(head.split(b"\r\n", 1)[0])
        parts = request_line.split(b" ")
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
            await _answer(stream, 400, b"not an HTTP/1 request\n")
            return
        method, target = parts[0], parts[1].split(b"?", 1)[0]
        if method not in (b"GET", b"HEAD"):
            await _answer(stream, 405, b"only GET\n", extra=b"Allow: GET, HEAD\r\n")
            return
        if target not in (b"/metrics", b"/"):
            await _answer(stream, 404, b"metrics are at /metrics\n")
            return
        try:
            body = await trio.to_thread.run_sync(self._render, limiter=self._rendering)
        except Exception:  # a collector failed, or no thread could start: this scrape only
            self._render_failed()
            await _answer(stream, 500, b"the metrics could not be rendered: see the node's log\n")
            return
        await _answer(stream, 200, body, content_type=CONTENT_TYPE, head_only=method == b"HEAD")


class _LoggedFailure:
    """Logs the exception being handled, at most once every 60 s."""

    def __init__(self) -> None:
        self._last = -math.inf

    def __call__(self) -> None:
        now = time.monotonic()
        if now - self._last >= 60:
            self._last = now
            logger.exception("rendering the metrics failed (the node serves on)")


_REASONS = {
    200: b"OK",
    500: b"Internal Server Error",
    400: b"Bad Request",
    404: b"Not Found",
    405: b"Method Not Allowed",
    431: b"Request Header Fields Too Large",
}


async def _answer(
    stream: trio.SocketStream,
    status: int,
    body: bytes,
    *,
    content_type: bytes = b"text/plain; charset=utf-8",
    extra: bytes = b"",
    head_only: bool = False,
) -> None:
    head = b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\nConnection: close\r\n" % (
        status,
        _REASONS[status],
        content_type,
        len(body),
    )
    await stream.send_all(head + extra + b"\r\n" + (b"" if head_only else body))


__all__ = ["MAX_METRICS_CONNECTIONS", "MetricsServer"]
