"""What a replica turns applied entries and time into: the effects this node runs
(`local_effects`), and as leader the `NodeDown` / `NodeUp` commands its peers' silence
calls for (`failure_commands`)."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping

from ..machine import (
    ConsumerDown,
    Deliver,
    Effect,
    NodeDown,
    NodeUp,
)

logger = logging.getLogger(__name__)


def local_effects(
    effects: tuple[Effect, ...], node: str, *, proxy: bool, replicas: frozenset[str]
) -> tuple[Effect, ...]:
    """The effects node `node` runs: deliveries and consumer-down notices for its own
    consumers and, when it leads (`proxy`), for consumers on nodes that host no replica."""
    return tuple(
        e
        for e in effects
        if type(e) in (Deliver, ConsumerDown)
        and (e.node == node or (proxy and e.node not in replicas))  # type: ignore[union-attr]
    )


def failure_commands(
    leader: str,
    silence_s: Mapping[str, float],
    down: frozenset[str],
    grace_s: float,
    removed: Iterable[str] = (),
    answered_s: Mapping[str, float] | None = None,
) -> list[NodeDown | NodeUp]:
    """What `leader` proposes about its peers: `NodeDown` for a node silent longer than
    the grace period, `NodeUp` for a down node that answered within half of it
    (`answered_s`, seconds since its last real answer; `silence_s` by default).
    `silence_s` is counted only while the leader could hear (`RaftRules.peer_silence`),
    so it restarts at the leader's election and after its stalls: a node down for good
    looks silent for a moment then, and only a real answer may bring it up.

    And about itself: an earlier leader may have marked it down while it was cut off,
    and it may win an election before that leader's `NodeUp` is committed. Only a
    leader proposes these, so without `NodeUp` for itself, consumers on the leader's
    node could not subscribe until another node led.

    And about the members `removed` from the cluster: they never answer, so they are
    marked down. (A removed node was marked down only by the node that removed it, once,
    from memory: a leader change or a restart lost that, and the removed node's
    consumers kept their messages.)"""
    commands: list[NodeDown | NodeUp] = []
    never = {node: math.inf for node in removed if node not in silence_s and node != leader}
    answered = silence_s if answered_s is None else answered_s
    for node, silent_s in sorted({**never, **silence_s, leader: 0.0}.items()):
        if silent_s > grace_s and node not in down:
            commands.append(NodeDown(node=node))
        elif node in down and (node == leader or answered.get(node, math.inf) < grace_s / 2):
            commands.append(NodeUp(node=node))
    return commands
