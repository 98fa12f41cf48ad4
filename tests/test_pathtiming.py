"""Path timing (`quorumq.pathtiming`), on: a batch publish is timed without failing, and
a long run's marks go to the file as they pile up, none lost."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

from quorumq import pathtiming


def test_a_batch_publish_with_path_timing_on_is_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    """A `publish_batch` frame has no `seq`: timing it raised KeyError after the request
    was registered, before the frame was written (review of c3b010c)."""
    from quorumq.client.blocking import Client

    monkeypatch.setattr(pathtiming, "ENABLED", True)
    client = Client.__new__(Client)
    client._send_lock = threading.RLock()
    client._lock = threading.RLock()
    client._futures = {}
    client._deadlines = {}
    client._watching_until = 0.0
    client._deadline_changed = threading.Condition(client._lock)
    client._link = None
    client.timeout = 5.0
    written: list[dict[str, Any]] = []
    client._write = lambda sock, frame: written.append(frame)  # type: ignore[method-assign]
    batch = {"t": "publish_batch", "producer": "p", "first_seq": 0, "messages": []}
    client._issue(lambda: (7, batch), publish=True)
    assert written == [batch]


def test_marks_go_to_the_file_as_they_pile_up(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(pathtiming, "_DIRECTORY", str(tmp_path))
    monkeypatch.setattr(pathtiming, "FLUSH_EVERY", 10)
    monkeypatch.setattr(pathtiming, "_marks", [])
    for i in range(25):
        pathtiming.mark("step", ("i", i))
    assert len(pathtiming._marks) == 5
    pathtiming._write()
    (path,) = tmp_path.glob("*.jsonl")
    keys = [json.loads(line)[2][1] for line in path.read_text().splitlines() if line[0] == "["]
    assert keys == list(range(25))
