"""The demo's HTML timeline (`quorumq.ops.demo._write_timeline`), written from events
made up here: its time axis, where it starts, and the leader's kill marked."""

from __future__ import annotations

import itertools
import re
import xml.etree.ElementTree as ET
from pathlib import Path

from quorumq.ops.demo import KEYS, Event, _write_timeline

SVG = "{http://www.w3.org/2000/svg}"


def _run_events() -> list[Event]:
    """A run as the demo notes it: 3 s of start-up with C leading, then publishes and
    deliveries from 3.0 s to 5.0 s, C killed at 4.0 s, B leading at 4.2 s, one
    redelivery."""
    events = [Event(2.9, "C", "leader", "C leads")]
    for i in range(100):
        t = 3.0 + i * 0.02
        key = KEYS[i % len(KEYS)]
        events.append(Event(t, "producer", "publish", f"{key}#{i}"))
        node = "A" if i % 2 == 0 else "B"
        events.append(Event(t + 0.01, node, "deliver", f"{key}#{i}"))
    events.append(Event(4.0, "C", "kill", "SIGKILL C"))
    events.append(Event(4.2, "B", "leader", "B leads"))
    events.append(Event(4.3, "A", "deliver", "alice#48*"))
    return sorted(events, key=lambda e: e.t)


def _svg(tmp_path: Path) -> ET.Element:
    page = tmp_path / "timeline.html"
    _write_timeline(page, _run_events(), "C", "B")
    found = re.search(r"<svg.*</svg>", page.read_text(), re.S)
    assert found is not None
    return ET.fromstring(found.group(0))


def test_the_timeline_has_a_time_axis_in_seconds_since_the_first_publish(tmp_path: Path) -> None:
    """Issue 31: the page had no time axis at all."""
    svg = _svg(tmp_path)
    ticks = [g for g in svg.iter(f"{SVG}g") if g.get("class") == "tick"]
    labels = [g.find(f"{SVG}text").text for g in ticks]  # type: ignore[union-attr]
    assert labels == ["0", "0.2", "0.4", "0.6", "0.8", "1", "1.2", "1.4", "1.6", "1.8", "2"]
    xs = [float(g.find(f"{SVG}line").get("x1")) for g in ticks]  # type: ignore[union-attr,arg-type]
    gaps = [b - a for a, b in itertools.pairwise(xs)]
    assert max(gaps) - min(gaps) < 0.2, gaps  # evenly spaced (to the 0.1 px written)
    titles = [t.text for t in svg.iter(f"{SVG}text") if t.get("class") == "axis-title"]
    assert titles == ["seconds since the first publish"]


def test_the_timeline_starts_shortly_before_the_first_publish(tmp_path: Path) -> None:
    """Issue 31: it started at the demo's start, and half the page was the cluster's
    start-up (here 3 s of 5)."""
    svg = _svg(tmp_path)
    axes = [line for line in svg.iter(f"{SVG}line") if line.get("class") == "axis"]
    assert len(axes) == 1, "no time axis"
    left, right = float(axes[0].get("x1", "nan")), float(axes[0].get("x2", "nan"))
    publishes = [line for line in svg.iter(f"{SVG}line") if line.get("class") == "publish"]
    assert len(publishes) == 100
    first = min(float(line.get("x1", "nan")) for line in publishes)
    assert left < first < left + 0.06 * (right - left), (left, first, right)
    last = max(float(line.get("x1", "nan")) for line in publishes)
    assert last > left + 0.9 * (right - left)  # the run fills the plot


def test_the_leaders_kill_and_the_election_are_marked_and_labelled(tmp_path: Path) -> None:
    svg = _svg(tmp_path)
    texts = [t.text or "" for t in svg.iter(f"{SVG}text")]
    assert "SIGKILL C (the leader) at 1.00 s" in texts
    assert "B leads, 0.20 s after the kill" in texts
    (kill,) = [line for line in svg.iter(f"{SVG}line") if line.get("class") == "kill"]
    one = [g for g in svg.iter(f"{SVG}g") if g.get("class") == "tick"][5]  # "1": the kill
    assert kill.get("x1") == one.find(f"{SVG}line").get("x1")  # type: ignore[union-attr]
    redelivered = [c for c in svg.iter(f"{SVG}circle") if c.get("stroke") == "black"]
    assert len(redelivered) == 1
