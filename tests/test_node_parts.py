"""The node core's parts on their own (`quorumq.node`: `DiskWatch`, `Publishes`, the
admin rule for forgetting producers), each driven through its inputs with the shared
`Services` over a replica that records what is proposed and reads a real machine; the
core that routes to them is tested in `test_node_core`."""

from __future__ import annotations

import random
from typing import Any

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
