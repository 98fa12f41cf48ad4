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


def _write_timeline(path: Path, events: list[Event], first: str, second: str) -> None:
    nodes = sorted({e.node for e in events} | {first, second})
    end = max((e.t for e in events), default=1.0) or 1.0
    width, lane = 1000, 60
    colours = {k: f"hsl({i * 60},70%,45%)" for i, k in enumerate(KEYS)}
    svg = [
        f'<svg width="{width + 120}" height="{lane * len(nodes) + 40}" '
        'xmlns="http://www.w3.org/2000/svg" font-family="sans-serif" font-size="12">'
    ]
    for i, node in enumerate(nodes):
        y = 30 + i * lane
        svg.append(f'<text x="5" y="{y + 5}">node {html.escape(node)}</text>')
        svg.append(f'<line x1="100" y1="{y}" x2="{100 + width}" y2="{y}" stroke="#ccc"/>')
    for e in events:
        x = 100 + width * e.t / end
        y = 30 + nodes.index(e.node) * lane
        title = html.escape(f"{e.t:.3f}s {e.node} {e.kind} {e.detail}")
        if e.kind == "deliver":
            key = e.detail.split("#")[0]
            fill = colours.get(key, "#555")
            radius = 4 if e.detail.endswith("*") else 2
            svg.append(
                f'<circle cx="{x:.1f}" cy="{y}" r="{radius}" fill="{fill}">'
                f"<title>{title}</title></circle>"
            )
        else:
            colour = "red" if e.kind == "kill" else "green"
            svg.append(
                f'<line x1="{x:.1f}" y1="10" x2="{x:.1f}" y2="{lane * len(nodes) + 20}" '
                f'stroke="{colour}" stroke-dasharray="4"><title>{title}</title></line>'
            )
            svg.append(
                f'<text x="{x + 3:.1f}" y="{y - 8}" fill="{colour}">{html.escape(e.detail)}</text>'
            )
    svg.append("</svg>")
    legend = " ".join(f'<span style="color:{c}">&#9679; {k}</span>' for k, c in colours.items())
    path.write_text(
        "<!doctype html><meta charset=utf-8><title>quorumq demo timeline</title>"
        "<h1>quorumq demo: deliveries per node</h1>"
        f"<p>Each dot is a delivery sent by that node's replica to its local consumer, "
        f"coloured by key; big dots are redeliveries. Red: leader {html.escape(first)} "
        f"killed; green: leadership.</p><p>{legend}</p>" + "".join(svg)
    )
