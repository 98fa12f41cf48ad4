"""A node's configuration, and the checks that refuse one it cannot serve safely."""

from __future__ import annotations

import attrs

from ..raft.member import MAX_COMMAND_BYTES
from ..replica import ConfigError, ReplicaConfig, is_loopback
from ..wire.protocol import DEFAULT_MAX_BODY, FRAME_OVERHEAD

MAX_BODY = MAX_COMMAND_BYTES - FRAME_OVERHEAD
"""The largest `--max-body` a node takes: a body must fit one Raft log entry."""
DISK_CHECK_EVERY_S = 1.0
"""How often a node measures its data disk's free space (the disk alarm) when free space
is near its limit; with room to spare, less often (`disk_check_in_s`)."""
DISK_CHECK_MOST_S = 5.0
DISK_FILL_BYTES_S = 200 * 1024 * 1024
"""A fast fill of the data disk (a node's own journal writes far less, even flat out)."""


def disk_check_in_s(free: int | None, limit: int) -> float:
    """When to measure the data disk again, having found `free` bytes free (None:
    unreadable) against the disk alarm's `limit` (0: no alarm): before a fill at
    `DISK_FILL_BYTES_S` could take it from here to the limit, every second at least
    often, every `DISK_CHECK_MOST_S` at most (an idle node woke twice a second for it,
    the loop and a worker thread). The simulator measures every second, as near the
    limit."""
    if limit <= 0:
        return DISK_CHECK_MOST_S
    if free is None:
        return DISK_CHECK_EVERY_S
    return min(DISK_CHECK_MOST_S, max(DISK_CHECK_EVERY_S, (free - limit) / DISK_FILL_BYTES_S))


START_FREE_BYTES = 4 * 1024 * 1024
"""A node starts only with this much free on its data disk (it waits until then: started
on a full disk it would fail at its first write, and a supervisor would restart it in a
loop)."""
READ_REPLY_BYTES = 768 * 1024
"""A `read` reply carries about this many bytes of messages at most (one larger message
goes alone), so it stays within the clients' frame limit; the client asks again."""


@attrs.frozen(kw_only=True)
class NodeConfig:
    replica: ReplicaConfig
    listen_host: str = "127.0.0.1"
    listen_port: int | None = 0
    """The client port (0: any free one). None: no client port, only clients in the
    node's own process (`quorumq.Node`), which need no token."""
    token: str | None = None
    """Clients prove they know it (HMAC of a nonce); None: no client authentication, only
    with `insecure` on a loopback listen address, or with no client port."""
    admin_token: str | None = None
    """Administrative verbs (membership) need a proof of it too. None: refused, unless
    the node runs insecure on loopback (a local dev cluster)."""
    insecure: bool = False
    """Allow no client token (only when listening on loopback)."""
    max_body: int = DEFAULT_MAX_BODY
    """The largest message body; at most `MAX_BODY` (a message must fit one log entry)."""
    handshake_timeout_s: float = 5.0
    """A connection that has not said `hello` by then is closed."""
    max_connections: int = 1024
    """Client connections served at once. One more closes the oldest connection that has
    not said `hello`, if there is one; otherwise it is refused (`too_many_connections`)."""
    max_unauthenticated: int = 64
    """Connections that have not said `hello` yet, at once; one more closes the oldest of
    them (a real client says `hello` within one round trip, so silent peers cannot hold
    the connection cap and lock real clients out)."""
    outbound_frames: int = 20_000
    """Frames waiting for a client, besides its consumers' prefetch, before it counts as
    a slow consumer and is cut off."""
    outbound_bytes: int = 32 * 1024 * 1024
    """Bytes waiting for a client (frames' encoded bytes plus 128 each) before it counts
    as a slow consumer and is cut off. Past a quarter of it the node reads no more of
    the client's requests until it has caught up (back-pressure). At least four of the
    largest frames a node sends (a delivery of `max_body`, or a read reply of 768 KiB,
    plus 64 KiB)."""
    min_free_disk_bytes: int = 64 * 1024 * 1024
    """Below this much free space on the data disk, the node raises its disk alarm:
    publishes are refused everywhere (`disk_alarm`) until it is back above, while
    deliveries, acks and reads go on (0: no alarm). 64 MiB: above RabbitMQ's 50 MB
    default, room for the publishes in flight when it is raised (a node holds at most
    `outbound_bytes`, 32 MiB, per client before back-pressure; entries are at most
    3 MiB) and for the entries that settle what is held (acks, downs, the alarm's own)."""
    max_consumers: int = 1024
    """Consumers one connection may have (cancelled ones count until they hold nothing);
    one more subscribe is refused (`too_many_consumers`)."""
    tls_cert: str | None = None
    """PEM file of the certificate (and any intermediates) the client port presents: with
    `tls_key`, clients are served over TLS only. None: plain TCP."""
    tls_key: str | None = None
    """PEM file of `tls_cert`'s private key."""
    tls_silence_s: float = 1.0
    """On a TLS client port, a peer that sends nothing this long is taken for a client
    without TLS (a TLS client sends its first handshake message at once, and a quorumq
    client without TLS waits for the node to speak): it is told so in plain text
    (`tls_required`) and the connection closed."""

    @property
    def open_admin(self) -> bool:
        """Administrative verbs need no admin proof: an insecure node on loopback."""
        return not self.token and not self.admin_token


def check_node_config(config: NodeConfig) -> None:
    """`ConfigError` for a configuration the node cannot serve."""
    if not config.token and config.listen_port is not None:
        if not config.insecure:
            raise ConfigError(
                "a client token is required (QUORUMQ_TOKEN or --token-file): without one "
                "anyone who reaches the client port may publish, consume and read"
            )
        if not is_loopback(f"{config.listen_host}:0"):
            raise ConfigError(
                f"insecure mode is for loopback only; the client address "
                f"{config.listen_host} is not"
            )
    if not 1 <= config.max_unauthenticated <= config.max_connections:
        raise ConfigError(
            f"max unauthenticated connections must be between 1 and max connections "
            f"({config.max_connections}), not {config.max_unauthenticated}"
        )
    if not 1 <= config.max_body <= MAX_BODY:
        raise ConfigError(
            f"max body must be between 1 and {MAX_BODY} bytes (a message must fit one log "
            f"entry of at most {MAX_COMMAND_BYTES}), not {config.max_body}"
        )
    largest_frame = max(config.max_body, READ_REPLY_BYTES) + FRAME_OVERHEAD  # sent
    if config.outbound_bytes < 4 * largest_frame:
        raise ConfigError(
            f"outbound bytes must be at least four of the largest frames a node sends "
            f"({4 * largest_frame} bytes with this max body), not {config.outbound_bytes}"
        )
    if config.max_consumers < 1:
        raise ConfigError(f"max consumers must be at least 1, not {config.max_consumers}")
    if (config.tls_cert is None) != (config.tls_key is None):
        raise ConfigError("TLS needs both a certificate and its key (--tls-cert and --tls-key)")
    if not config.tls_silence_s > 0:
        raise ConfigError(f"TLS silence must be more than 0 s, not {config.tls_silence_s}")
