"""A program with a quorumq node inside, for `test_local_cluster`: its node (Raft secret,
client port with a token) and a consumer of that node, which appends each delivery to a
file before it acks it, taking 10 ms a message. SIGTERM stops it cleanly.

    python -m tests.embedded_program NAME ROOT CLIENT_PORT PEERS_JSON
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import quorumq

TOKEN = "t0ken-for-the-test"
SECRET = "s3cret-for-the-test"


def main(name: str, root: str, client_port: int, peers: dict[str, str]) -> None:
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    settings: dict[str, Any] = {
        "id": name,
        "data_dir": os.path.join(root, name),
        "raft": peers[name],
        "peers": peers,
        "secret": SECRET,
        "listen": f"127.0.0.1:{client_port}",
        "token": TOKEN,
        "node_down_grace_s": 1.0,
    }
    out = os.open(os.path.join(root, f"{name}.jsonl"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    with quorumq.Node(**settings) as node:
        client = node.client()
        client.declare("jobs")
        consumer = client.subscribe("jobs", prefetch=20)
        Path(root, f"{name}.ready").touch()
        while not stopping.is_set():
            delivery = consumer.get(0.1)
            if delivery is None:
                continue
            record = [delivery.offset, delivery.key, delivery.node, delivery.redelivered]
            os.write(out, (json.dumps(record) + "\n").encode())
            time.sleep(0.01)
            delivery.ack()
    os.close(out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4]))
