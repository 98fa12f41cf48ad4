"""The node core's parts on their own (`quorumq.node`: `DiskWatch`, `Publishes`,
`Settling`, `Serving`, `Reading`, `Membership`, the admin rule for forgetting
producers), each driven through its inputs with the shared
`Services` over a replica that records what is proposed and reads a real machine; the
core that routes to them is tested in `test_node_core`."""

from __future__ import annotations

import random
from typing import Any

import pytest

from quorumq.machine import Declare, DiskAlarm, EnqueueBatch
from quorumq.node import NodeConfig
from quorumq.node.admin import MIN_FORGET_PREFIX, needs_admin
from quorumq.node.disk import DiskWatch
from quorumq.node.publishes import Gathered, Publishes
from quorumq.node.services import Services
from quorumq.replica import ReplicaConfig

from .test_node_core import _frames, _MachineReplica, _Shell

MIB = 1024 * 1024


def _services(replica: _MachineReplica, **config: Any) -> Services:
    node_config = NodeConfig(
        replica=ReplicaConfig(
            node_id="A", peers={"A": "127.0.0.1:1"}, data_dir="/nonexistent", secret="s"
        ),
        insecure=True,
        **config,
    )
    rng = random.Random(1)
    return Services(node_config, replica, _Shell(), lambda: 0.0, random_bytes=rng.randbytes)  # type: ignore[arg-type]


def test_the_disk_alarm_is_raised_below_the_limit_and_cleared_an_eighth_above_it() -> None:
    """No flapping around the limit; the log's record follows, proposed once at a time."""
    replica = _MachineReplica()
    disk = DiskWatch(_services(replica, min_free_disk_bytes=64 * MIB))
    disk.disk_free(65 * MIB)
    assert not disk.disk_alarm and replica.proposed == []
    disk.disk_free(63 * MIB)
    assert disk.disk_alarm
    assert [c for c, _ in replica.proposed] == [DiskAlarm(node="A", raised=True)]
    disk.disk_free(63 * MIB)  # still proposing: not again
    assert len(replica.proposed) == 1
    command, callback = replica.proposed[0]
    assert callback is not None
    callback(replica.apply(command).reply, None)
    disk.disk_free(70 * MIB)  # above the limit, within its eighth: still raised
    assert disk.disk_alarm and disk.alarms_in_log and len(replica.proposed) == 1
    disk.disk_free(73 * MIB)
    assert not disk.disk_alarm
    assert [c for c, _ in replica.proposed][1:] == [DiskAlarm(node="A", raised=False)]


def test_consecutive_publishes_of_one_producer_go_as_one_entry() -> None:
    """Gathered while read together, with consecutive numbers; a body over `max_body`
    is refused on its own and breaks nothing around it."""
    replica = _MachineReplica()
    replica.apply(Declare(queue="q"))
    services = _services(replica, max_body=8)
    publishes = Publishes(services, DiskWatch(services))
    conn = _connection(services)
    gathered = Gathered()
    for seq, body in enumerate([b"a", b"b", b"much too long", b"c"]):
        frame = {"t": "publish", "id": seq + 1, "queue": "q", "body": body, "key": None}
        publishes.gather_publish(
            conn, gathered, {**frame, "headers": None, "producer": "p", "seq": seq}
        )
    publishes.flush_publishes(conn, gathered)
    commands = [c for c, _ in replica.proposed]
    assert len(commands) == 2 and isinstance(commands[0], EnqueueBatch)
    assert [m.body for m in commands[0].messages] == [b"a", b"b"]
    assert [f["id"] for f in _frames(conn) if f["t"] == "error"] == [3]


def _connection(services: Services) -> Any:
    from quorumq.node import ConnectionCore

    conn = ConnectionCore(1, max_frame=1 << 20, outbound_bytes=1 << 20, outbound_frames=100)
    services.connections.add(conn)
    return conn


def test_a_client_forgets_only_long_prefixes_of_no_client_id_and_whole_spark_ones() -> None:
    assert needs_admin("x" * (MIN_FORGET_PREFIX - 1))
    assert not needs_admin("x" * MIN_FORGET_PREFIX)
    assert needs_admin("g18c5a1b2c3d4")  # could start a client's id ("g<ms hex>-<hex>")
    assert needs_admin("spark-write-")  # every batch write's producers
    assert not needs_admin("spark-write-0123456789abcdef0123456789abcdef-")
    assert not needs_admin("spark-01234567-89ab-cdef-0123-456789abcdef-7-")


def _greeted(services: Services, *, admin: bool = False) -> Any:
    conn = _connection(services)
    conn.greeted = True
    conn.admin = admin
    return conn


def test_settling_holds_a_consumers_acks_behind_the_one_proposed_and_sends_them_together() -> None:
    """`Settling` on its own: the first ack is proposed at once; acks that come while it
    is being proposed wait, and go as one `Ack` once it is answered."""
    from quorumq.machine import Ack
    from quorumq.node.settling import Settling

    replica = _MachineReplica()
    settling = Settling(_services(replica))
    conn = _greeted(settling.core)
    conn.consumers["c1"] = "q"
    for offsets in ([0], [1], [2, 3]):
        settling.flush_acks(conn, {("c1", False, False, None): offsets})
    acks = [c for c, _ in replica.proposed if isinstance(c, Ack)]
    assert [a.offsets for a in acks] == [(0,)]  # the rest wait for it
    replica.proposed[0][1](None, None)  # answered
    acks = [c for c, _ in replica.proposed if isinstance(c, Ack)]
    assert [a.offsets for a in acks] == [(0,), (1, 2, 3)]


def test_serving_answers_a_delivery_to_a_consumer_it_does_not_have_with_its_down() -> None:
    """`Serving` on its own: a delivery the replica hands this node for a consumer no
    connection here has (an earlier run's, a replayed entry's) is answered with that
    consumer's `Down`, so its messages go back to the queue."""
    from quorumq.machine import Deliver, Down
    from quorumq.node.reading import Reading
    from quorumq.node.serving import Serving
    from quorumq.node.settling import Settling

    replica = _MachineReplica()
    services = _services(replica)
    serving = Serving(services, Settling(services), Reading(services))
    ghost = Deliver(
        queue="q",
        consumer="A.x.1",
        offset=0,
        body=b"m",
        key=None,
        headers=None,
        node="A",
        redelivered=False,
        delivery_count=1,
    )
    serving.effects_applied(5, [ghost])
    assert [c for c, _ in replica.proposed] == [Down(consumer="A.x.1")]


def test_reading_refuses_a_wait_longer_than_it_allows() -> None:
    """`Reading` on its own: a read may ask its node to wait `MAX_READ_WAIT_MS` at most;
    a longer wait is refused (the core answers it `invalid`, with this message), and
    nothing is held."""
    from quorumq.node.reading import MAX_READ_WAIT_MS, Reading

    replica = _MachineReplica()
    replica.apply(Declare(queue="q"))
    reading = Reading(_services(replica))
    conn = _greeted(reading.core)
    frame = {"t": "read", "id": 7, "queue": "q", "start": 0, "end": 10}
    with pytest.raises(
        ValueError, match=f"wait_ms must be an integer from 0 to {MAX_READ_WAIT_MS}"
    ):
        reading.read(
            conn, {**frame, "bucket": None, "buckets": None, "wait_ms": MAX_READ_WAIT_MS + 1}
        )
    assert len(reading.waiting) == 0


def test_membership_refuses_a_change_without_the_admin_token() -> None:
    """`Membership` on its own: adding or removing a member is an administrative verb;
    a connection without the admin token is refused and nothing is proposed."""
    from quorumq.node.admin import Admin
    from quorumq.node.membership import Membership

    replica = _MachineReplica()
    services = _services(replica)
    membership = Membership(services, Admin(services, DiskWatch(services)))
    conn = _greeted(services, admin=False)
    membership.remove_member(conn, {"t": "remove_member", "id": 3, "node": "B"})
    (error,) = [f for f in _frames(conn) if f["t"] == "error"]
    assert (error["id"], error["code"]) == (3, "admin_required")
    assert replica.proposed == []
