"""File descriptors budgeted, so that no port can take the ones the journal needs.

A node stopped when its next journal write failed with EMFILE: idle sockets on its
metrics port (now bounded, `metrics_http`) or clients past the file limit had used every
descriptor. At start the node raises its soft limit to the hard one, keeps
`RESERVED_FILES` for everything but clients, and caps client connections to what is
left (`client_caps`), so clients are refused (`too_many_connections`) before the node
could run out.
"""

from __future__ import annotations

import contextlib
import logging
import resource

import attrs

from ..node.config import NodeConfig
from ..replica import ConfigError

logger = logging.getLogger(__name__)

RESERVED_FILES = 192
"""Descriptors kept for all but client connections: the journal, snapshots and log
(about 10), the listeners (3), the Raft port (32 peers yet to authenticate, 2 per member
or learner, 16 nodes reached outside the configuration), the metrics port (16 + 1),
trio's and the threads' own (epoll, wake-up pipes: about 10), an audit's pipes, and a
margin for what a library opens."""
MIN_CLIENT_CONNECTIONS = 16
"""Fewer client connections than this and the node refuses to start."""
FILE_LIMIT_CEILING = 1 << 20
"""The soft limit is raised at most this far (Linux's default `nr_open`)."""


def current_file_limit() -> int:
    """This process's soft RLIMIT_NOFILE (unlimited: `FILE_LIMIT_CEILING`)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return FILE_LIMIT_CEILING if soft == resource.RLIM_INFINITY else int(soft)


def raise_file_limit() -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit (best effort); return
    the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = FILE_LIMIT_CEILING if hard == resource.RLIM_INFINITY else hard
    target = min(target, FILE_LIMIT_CEILING) if soft != resource.RLIM_INFINITY else soft
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return FILE_LIMIT_CEILING if soft == resource.RLIM_INFINITY else int(soft)


def client_caps(config: NodeConfig, file_limit: int, open_now: int = 0) -> NodeConfig:
    """`config` with its client connection caps lowered to fit `file_limit`, with
    `open_now` descriptors open already (a node in a program's own process shares its
    limit), or `ConfigError` if it leaves fewer than `MIN_CLIENT_CONNECTIONS`. A node
    with no client port has nothing to cap."""
    if config.listen_port is None:
        return config
    room = file_limit - open_now - RESERVED_FILES
    if room < MIN_CLIENT_CONNECTIONS:
        raise ConfigError(
            f"the open file limit ({file_limit}, {open_now} open already) leaves room for "
            f"{max(room, 0)} client connections ({RESERVED_FILES} are kept for the journal, "
            f"Raft and metrics): raise it (ulimit -n) to at least "
            f"{open_now + RESERVED_FILES + MIN_CLIENT_CONNECTIONS}"
        )
    if config.max_connections <= room:
        return config
    capped = min(config.max_unauthenticated, max(1, room // 4))
    logger.warning(
        "the open file limit (%d) allows %d client connections, not %d (raise it with "
        "ulimit -n to serve more)",
        file_limit,
        room,
        config.max_connections,
    )
    return attrs.evolve(config, max_connections=room, max_unauthenticated=capped)


__all__ = ["RESERVED_FILES", "client_caps", "current_file_limit", "raise_file_limit"]
