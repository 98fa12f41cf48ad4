"""`quorumq demo`: a real 3-node cluster, a leader killed mid-stream, and the proof.

It starts three node processes on loopback, attaches one consumer to each follower,
publishes keyed messages, SIGKILLs the leader halfway, keeps publishing through the
election, and then checks what every consumer received:

* each delivery came from the replica of the node its consumer is connected to;
* per key, first deliveries came in publish order;
* nothing confirmed was lost; nothing arrived twice unless marked redelivered.

It prints a table and writes an HTML timeline of the run (by default under `out/`).
"""

from __future__ import annotations

import html
import math
import sys
import threading
import time
from collections import Counter, defaultdict
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TextIO

import attrs
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from ..client import Delivery
from .local_cluster import Cluster

KEYS = ("alice", "bob", "carol", "dave", "erin", "frank")


@attrs.frozen
class Event:
    t: float
    node: str
    kind: str
    detail: str


@attrs.define
class DemoResult:
    published: int
    delivered: int
    lost: int
    unmarked_duplicates: int
    key_order_ok: bool
    local_delivery_ok: bool
    killed: str
    new_leader: str
    timeline: Path

    @property
    def ok(self) -> bool:
        return (
            self.lost == 0
            and self.unmarked_duplicates == 0
            and self.key_order_ok
            and self.local_delivery_ok
        )


def _progress_bar(out: TextIO) -> Progress:
    """The publishing progress bar (rich), drawn on `out` when it is a terminal."""
    return Progress(
        TextColumn("  publishing"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.description}"),
        console=Console(file=out),
    )


def default_timeline(now: float | None = None) -> Path:
    """Where the HTML timeline goes unless told: `out/` (ignored by git), never the
    current directory itself."""
    return Path("out") / f"quorumq-demo-{int(time.time() if now is None else now)}.html"


def run(messages: int = 600, out: TextIO = sys.stdout, timeline: Path | None = None) -> DemoResult:
    began = time.monotonic()
    events: list[Event] = []

    def note(node: str, kind: str, detail: str) -> None:
        events.append(Event(time.monotonic() - began, node, kind, detail))

    out.write("Starting a 3-node quorumq cluster on 127.0.0.1 (fsync=always)...\n")
    with Cluster(3, node_down_grace=30.0) as cluster:
        leader = cluster.leader()
        note(leader, "leader", f"{leader} leads")
        followers = [n for n in cluster.nodes if n != leader]
        out.write(
            f"  nodes {', '.join(cluster.nodes)}; leader {leader}; "
            f"consumers on followers {', '.join(followers)}\n"
        )
        producer = cluster.client(leader, timeout=60.0)
        producer.declare("demo")
        received: dict[str, list[Delivery]] = {f: [] for f in followers}
        stop = threading.Event()

        def consume(node: str) -> None:
            consumer = cluster.client(node).subscribe("demo", prefetch=50)
            while not stop.is_set():
                d = consumer.get(timeout=0.1)
                if d is None:
                    continue
                received[node].append(d)
                note(d.node, "deliver", f"{d.key}#{d.offset}{'*' if d.redelivered else ''}")
                time.sleep(0.002)  # a consumer doing some work
                d.ack()

        threads = [threading.Thread(target=consume, args=(f,), daemon=True) for f in followers]
        for t in threads:
            t.start()
        time.sleep(0.3)
        futures: list[tuple[str, Future[dict[str, Any]]]] = []
        kill_at = messages // 2
        new_leader = leader
        with _progress_bar(out) as progress:
            task = progress.add_task("", total=messages)
            for i in range(messages):
                if i == kill_at:
                    for _, f in futures:
                        f.result(60)
                    cluster.kill(leader)
                    note(leader, "kill", f"SIGKILL {leader}")
                    progress.update(task, description=f"(killed leader {leader})")
                    new_leader = cluster.leader()
                    note(new_leader, "leader", f"{new_leader} leads")
                    progress.update(task, description=f"(new leader {new_leader})")
                key = KEYS[i % len(KEYS)]
                body = f"{key}-{i // len(KEYS)}".encode()
                futures.append((key, producer.publish_async("demo", body, key=key)))
                note("producer", "publish", f"{key}#{i}")
                progress.advance(task)
                time.sleep(0.003)
            offsets = {f.result(60)["offset"]: key for key, f in futures}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            got = {d.offset for ds in received.values() for d in ds}
            if got >= set(offsets):
                break
            time.sleep(0.05)
        stop.set()
        for t in threads:
            t.join(timeout=5)

    # ------------------------------------------------------------- checking
    all_deliveries = [d for ds in received.values() for d in ds]
    first_counts = Counter(d.offset for d in all_deliveries if not d.redelivered)
    lost = len(set(offsets) - {d.offset for d in all_deliveries})
    unmarked = sum(1 for n in first_counts.values() if n > 1)
    key_order_ok = True
    for key in KEYS:
        firsts = [d.offset for d in all_deliveries if d.key == key and not d.redelivered]
        by_consumer: dict[str, list[int]] = defaultdict(list)
        for d in all_deliveries:
            if d.key == key and not d.redelivered:
                by_consumer[d.consumer].append(d.offset)
        key_order_ok &= all(v == sorted(v) for v in by_consumer.values())
        key_order_ok &= len(firsts) == len(set(firsts))
    local_ok = all(d.node == node for node, ds in received.items() for d in ds)

    out.write("\n  node  consumer-keys                          delivered  redelivered\n")
    for node, ds in received.items():
        keys = ", ".join(sorted({d.key or "-" for d in ds}))
        redelivered = sum(d.redelivered for d in ds)
        out.write(f"  {node:<5} {keys:<38} {len(ds):>9}  {redelivered:>11}\n")
    path = timeline or default_timeline()
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_timeline(path, events, leader, new_leader)
    result = DemoResult(
        published=len(offsets),
        delivered=len({d.offset for d in all_deliveries}),
        lost=lost,
        unmarked_duplicates=unmarked,
        key_order_ok=key_order_ok,
        local_delivery_ok=local_ok,
        killed=leader,
        new_leader=new_leader,
        timeline=path.resolve(),
    )
    out.write(
        f"\n  published and confirmed {result.published}; delivered {result.delivered}; "
        f"lost {result.lost}; duplicated without the redelivered mark "
        f"{result.unmarked_duplicates}\n"
        f"  every delivery came from the consumer's own node: "
        f"{'yes' if local_ok else 'NO'}\n"
        f"  per-key order held: {'yes' if key_order_ok else 'NO'}\n"
        f"  leader {leader} was killed with SIGKILL; {new_leader} took over\n"
        f"  timeline: {result.timeline}\n"
        f"  {'OK' if result.ok else 'FAILED'} in {time.monotonic() - began:.1f} s; "
        f"every node process was stopped\n"
    )
    return result


PLOT_LEFT = 150
"""Pixels left of the plot, for the lanes' names."""
PLOT_WIDTH = 1000
TICK_STEPS = (0.05, 0.1, 0.2, 0.25, 0.5, 1.0, 2.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0)
"""Seconds between the time axis's ticks: the smallest that gives at most 12."""


def _tick_step(span: float) -> float:
    return next((step for step in TICK_STEPS if span / step <= 12), TICK_STEPS[-1])


def _write_timeline(path: Path, events: list[Event], first: str, second: str) -> None:
    """An HTML page with the run drawn on a time axis, in seconds since the first publish
    (the axis starts shortly before it: the cluster's start-up is not drawn): a lane of
    publishes, then one lane per node with a row per key of the deliveries its
    consumer got, the periods each node led, and the leader's kill marked."""
    publishes = [e.t for e in events if e.kind == "publish"]
    times = [e.t for e in events]
    zero = min(publishes, default=min(times, default=0.0))
    last = max(times, default=zero + 1.0)
    span = max(last - zero, 0.1)
    start, stop = zero - 0.04 * span, last + 0.02 * span

    def x(t: float) -> float:
        return PLOT_LEFT + PLOT_WIDTH * (min(max(t, start), stop) - start) / (stop - start)

    colours = {k: f"hsl({i * 60},70%,40%)" for i, k in enumerate(KEYS)}
    nodes = sorted({e.node for e in events if e.kind != "publish"} | {first, second})
    keys_of: dict[str, list[str]] = {
        node: sorted(
            {e.detail.split("#")[0] for e in events if e.kind == "deliver" and e.node == node}
        )
        for node in nodes
    }
    row = 13
    top = 52  # the band of the markers' labels
    lanes: dict[str, tuple[float, float]] = {}  # node -> (top, bottom)
    publish_lane = (top, top + 26)
    y = publish_lane[1] + 6
    for node in nodes:
        height = max(len(keys_of[node]), 1) * row + 14
        lanes[node] = (y, y + height)
        y += height + 6
    axis_y = y + 4
    height = axis_y + 46
    svg = [
        f'<svg class="timeline" width="{PLOT_LEFT + PLOT_WIDTH + 40}" height="{height:.0f}" '
        'xmlns="http://www.w3.org/2000/svg" font-family="sans-serif" font-size="12">'
    ]

    # the lanes, and who led when (a leader leads until the next one, or its kill)
    svg.append(
        f'<text x="{PLOT_LEFT - 10}" y="{publish_lane[0] + 17}" text-anchor="end" '
        'font-weight="bold">publishes</text>'
    )
    for node, (y0, y1) in lanes.items():
        svg.append(
            f'<rect x="{PLOT_LEFT}" y="{y0:.0f}" width="{PLOT_WIDTH}" height="{y1 - y0:.0f}" '
            'fill="#f6f6f6"/>'
        )
        svg.append(
            f'<text x="8" y="{y0 + 16:.0f}" font-weight="bold">node {html.escape(node)}</text>'
        )
    changes = sorted((e for e in events if e.kind in ("leader", "kill")), key=lambda e: e.t)
    for i, e in enumerate(changes):
        if e.kind != "leader":
            continue
        ends = next((c.t for c in changes[i + 1 :] if c.kind == "leader" or c.node == e.node), stop)
        if ends <= start:
            continue
        y0, y1 = lanes[e.node]
        x0, x1 = x(e.t), x(ends)
        svg.append(
            f'<rect class="led" x="{x0:.1f}" y="{y0:.0f}" width="{x1 - x0:.1f}" '
            f'height="{y1 - y0:.0f}" fill="hsl(120,60%,92%)"/>'
        )
        svg.append(
            f'<text x="{x1 - 4:.1f}" y="{y1 - 4:.0f}" text-anchor="end" fill="hsl(120,50%,30%)" '
            f'font-size="11">{html.escape(e.node)} leads</text>'
        )
    for node, (y0, _) in lanes.items():
        for j, key in enumerate(keys_of[node]):
            ky = y0 + 10 + j * row
            svg.append(
                f'<text x="{PLOT_LEFT - 10}" y="{ky + 4:.0f}" text-anchor="end" font-size="11" '
                f'fill="{colours.get(key, "#555")}">{html.escape(key)}</text>'
            )

    # the data: publishes as ticks, deliveries as dots on their key's row
    for t in publishes:
        if start <= t <= stop:
            svg.append(
                f'<line class="publish" x1="{x(t):.1f}" y1="{publish_lane[0] + 6}" '
                f'x2="{x(t):.1f}" y2="{publish_lane[1] - 2}" stroke="#888"/>'
            )
    for e in events:
        if e.kind != "deliver" or not start <= e.t <= stop:
            continue
        key = e.detail.split("#")[0]
        ky = lanes[e.node][0] + 10 + keys_of[e.node].index(key) * row
        redelivered = e.detail.endswith("*")
        title = html.escape(
            f"{e.t - zero:.3f} s: node {e.node} delivered {e.detail}"
            + (" (redelivered)" if redelivered else "")
        )
        svg.append(
            f'<circle cx="{x(e.t):.1f}" cy="{ky:.0f}" r="{4.5 if redelivered else 2.5}" '
            f'fill="{colours.get(key, "#555")}"'
            + (' stroke="black"' if redelivered else "")
            + f"><title>{title}</title></circle>"
        )

    # the time axis: seconds since the first publish
    step = _tick_step(stop - start)
    svg.append(
        f'<line class="axis" x1="{PLOT_LEFT}" y1="{axis_y:.0f}" x2="{PLOT_LEFT + PLOT_WIDTH}" '
        f'y2="{axis_y:.0f}" stroke="black"/>'
    )
    k = math.ceil((start - zero) / step - 1e-9)
    while zero + k * step <= stop + 1e-9:
        t = zero + k * step
        svg.append(
            f'<g class="tick"><line x1="{x(t):.1f}" y1="{axis_y:.0f}" x2="{x(t):.1f}" '
            f'y2="{axis_y + 5:.0f}" stroke="black"/><text x="{x(t):.1f}" y="{axis_y + 18:.0f}" '
            f'text-anchor="middle">{round(k * step, 3):g}</text></g>'
        )
        k += 1
    svg.append(
        f'<text class="axis-title" x="{PLOT_LEFT + PLOT_WIDTH / 2}" y="{axis_y + 38:.0f}" '
        'text-anchor="middle">seconds since the first publish</text>'
    )

    # the kill and the new leader: a line through every lane, labelled above them
    kill = next((e for e in events if e.kind == "kill"), None)
    marks: list[tuple[Event, str, str, int]] = []
    if kill is not None:
        marks.append((kill, f"{kill.detail} (the leader) at {kill.t - zero:.2f} s", "red", 16))
        took = next((e for e in changes if e.kind == "leader" and e.t >= kill.t), None)
        if took is not None:
            marks.append(
                (took, f"{took.detail}, {took.t - kill.t:.2f} s after the kill", "green", 34)
            )
    for e, label, colour, label_y in marks:
        at = x(e.t)
        anchor = "end" if at > PLOT_LEFT + PLOT_WIDTH * 0.75 else "start"
        shift = -4 if anchor == "end" else 4
        svg.append(
            f'<line class="{e.kind}" x1="{at:.1f}" y1="{label_y - 12}" x2="{at:.1f}" '
            f'y2="{axis_y:.0f}" stroke="{colour}" stroke-width="1.5" stroke-dasharray="5,3">'
            f"<title>{html.escape(f'{e.t - zero:.3f} s: {e.detail}')}</title></line>"
        )
        svg.append(
            f'<text x="{at + shift:.1f}" y="{label_y}" text-anchor="{anchor}" fill="{colour}" '
            f'font-weight="bold">{html.escape(label)}</text>'
        )
    svg.append("</svg>")
    path.write_text(
        "<!doctype html><meta charset=utf-8><title>quorumq demo timeline</title>"
        "<style>body{font-family:sans-serif;margin:16px}p{max-width:1150px}</style>"
        "<h1>quorumq demo: what each node delivered</h1>"
        "<p>Top: each grey tick is a publish. Below, one lane per node: each dot is a "
        "delivery that node's replica sent to the consumer on the same node, on the row "
        "of its key; a big dot with a black ring is a redelivery. Green: the node leading. "
        f"Red line: leader {html.escape(first)} killed with SIGKILL; green line: "
        f"{html.escape(second)} elected. Time 0 is the first publish; the run began "
        f"{zero:.1f} s before it, starting the cluster (not drawn). Hover over a dot for "
        "its offset.</p>" + "\n".join(svg)
    )
