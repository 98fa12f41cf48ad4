"""Timelines as self-contained HTML, in the manner of the RabbitMQ post's diagrams.

`run_html(result)`: one lane per replica along simulated time: when it was down,
when it led, its applied log index, and per second the deliveries it sent itself (its
consumers are local) above the line and those it only tracked (another replica sends
them) below; faults as red marks; then the service-queue changes, replica by replica.

`scenario_html(scenario)`: the post's event sequences played on three machines, one
column per replica: what each applies, sends, only tracks, and its service queue.
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING

from quorumq.ops.scenarios import Scenario, describe, play

if TYPE_CHECKING:
    from .runner import Result

WIDTH = 1200
LANE = 90
LEFT = 60

_STYLE = """
body { font-family: sans-serif; margin: 20px; color: #222; }
pre { background: #f6f6f6; padding: 10px; }
table { border-collapse: collapse; font-size: 13px; }
td, th { border: 1px solid #ccc; padding: 3px 6px; vertical-align: top; text-align: left; }
.sent { color: #1a7f37; font-weight: bold; } .tracked { color: #888; }
"""


def _page(title: str, body: str) -> str:
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}"
        f"</title><style>{_STYLE}</style></head><body><h1>{html.escape(title)}</h1>"
        f"{body}</body></html>\n"
    )


def run_html(result: Result) -> str:
    history = result.history
    span = max(result.sim_s, 1e-6)

    def x(t: float) -> float:
        return LEFT + (t / span) * WIDTH

    def period(start: float, end: float, y: float, h: float, fill: str, what: str) -> str:
        end = result.sim_s if end < 0 else end  # -1: still lasting at the end
        return (
            f"<rect x='{x(start):.1f}' y='{y}' width='{max(x(end) - x(start), 1):.1f}' "
            f"height='{h}' fill='{fill}'><title>{what} {start:.2f}-{end:.2f}s</title></rect>"
        )

    names = list(history.lanes)
    height = LANE * len(names) + 40
    svg = [
        f"<svg width='{LEFT + WIDTH + 20}' height='{height}' xmlns='http://www.w3.org/2000/svg'>"
    ]
    peak = max(
        [1]
        + [
            v
            for lane in history.lanes.values()
            for v in (*lane.sent.values(), *lane.tracked.values())
        ]
    )
    top_index = max([1] + [i for lane in history.lanes.values() for i in lane.index.values()])
    for row, name in enumerate(names):
        lane = history.lanes[name]
        y0 = 20 + row * LANE
        mid = y0 + LANE / 2
        svg.append(f"<text x='5' y='{mid + 5}' font-size='16'>{html.escape(name)}</text>")
        svg.append(f"<line x1='{LEFT}' y1='{mid}' x2='{LEFT + WIDTH}' y2='{mid}' stroke='#ccc'/>")
        for start, end in lane.down:
            svg.append(period(start, end, y0, LANE - 6, "#ddd", "down"))
        for start, end in lane.led:
            svg.append(period(start, end, y0, 6, "#e0a800", "leader"))
        for start, end, what in lane.periods:
            svg.append(period(start, end, y0 + LANE - 12, 6, "#8250df", html.escape(what)))
        bar = WIDTH / span * 0.8
        for second, n in sorted(lane.sent.items()):
            h = (LANE / 2 - 10) * n / peak
            svg.append(
                f"<rect x='{x(second):.1f}' y='{mid - h:.1f}' width='{bar:.1f}' height='{h:.1f}' "
                f"fill='#1a7f37'><title>{second}s: sent {n}</title></rect>"
            )
        for second, n in sorted(lane.tracked.items()):
            h = (LANE / 2 - 10) * n / peak
            svg.append(
                f"<rect x='{x(second):.1f}' y='{mid:.1f}' width='{bar:.1f}' height='{h:.1f}' "
                f"fill='#bbb'><title>{second}s: tracked only {n}</title></rect>"
            )
        points = " ".join(
            f"{x(s + 1):.1f},{y0 + LANE - 6 - (LANE - 12) * i / top_index:.1f}"
            for s, i in sorted(lane.index.items())
        )
        svg.append(f"<polyline points='{points}' fill='none' stroke='#0969da'/>")
    for at, text in history.faults:
        svg.append(
            f"<line x1='{x(at):.1f}' y1='12' x2='{x(at):.1f}' y2='{height - 20}' "
            f"stroke='#cf222e' stroke-dasharray='3,3'><title>{html.escape(text)}</title></line>"
        )
    svg.append(f"<text x='{LEFT}' y='{height - 5}' font-size='12'>0 s</text>")
    svg.append(
        f"<text x='{LEFT + WIDTH - 60}' y='{height - 5}' font-size='12'>{result.sim_s:.1f} s</text>"
    )
    svg.append("</svg>")
    legend = (
        "<p>Grey: node down. Gold: leader. Purple, at the bottom of a lane: the node "
        "paused, its Raft thread stalled, cut off alone, or a direction from it slow "
        "(hover for what and how long). Blue line: applied log index. Green above the "
        "line: deliveries the replica sent itself, per second; grey below: deliveries it "
        "only tracked. Red dashes: faults (hover for details).</p>"
    )
    faults = "".join(f"<li>{html.escape(t)}</li>" for _, t in history.faults)
    rows = "".join(
        f"<tr><td>{c.at_s:.3f}</td><td>{html.escape(c.node)}</td><td>{c.index}</td>"
        f"<td>{html.escape(c.what)}</td>"
        f"<td>{html.escape(' '.join(c.service_queue) or '-')}</td></tr>"
        for c in history.sq_changes
    )
    body = (
        f"<pre>{html.escape(result.summary())}</pre>{legend}{''.join(svg)}"
        f"<h2>Faults</h2><ul>{faults}</ul>"
        f"<h2>Service queue after each consumer change</h2><table><tr><th>s</th><th>replica"
        f"</th><th>index</th><th>applies</th><th>service queue</th></tr>{rows}</table>"
    )
    return _page(f"quorumq simulation, seed {result.config.seed}", body)


def scenario_html(scenarios: list[Scenario]) -> str:
    parts = []
    for scenario in scenarios:
        notes = dict(scenario.notes)
        head = "".join(f"<th>{html.escape(r)}</th>" for r in scenario.replicas)
        rows = []
        for step in play(scenario):
            for event in sorted(e for e in notes if e < step.event):
                cols = len(scenario.replicas)
                rows.append(
                    f"<tr><td>{event}</td><td colspan='{cols}'><i>"
                    f"{html.escape(notes.pop(event))}</i></td></tr>"
                )
            cells = []
            for replica in scenario.replicas:
                if replica != step.replica:
                    cells.append("<td></td>")
                    continue
                sent = ", ".join(f"{d.body.decode()}&rarr;{d.consumer}" for d in step.sent)
                tracked = ", ".join(f"{d.body.decode()}&rarr;{d.consumer}" for d in step.tracked)
                cell = f"{step.index}: {html.escape(describe(step.command))}"
                if sent:
                    cell += f"<br><span class='sent'>sends {sent}</span>"
                if tracked:
                    cell += f"<br><span class='tracked'>tracks {tracked}</span>"
                cell += f"<br>SQ: {html.escape(' '.join(step.service_queue) or '-')}"
                cells.append(f"<td>{cell}</td>")
            rows.append(f"<tr><td>{step.event}</td>{''.join(cells)}</tr>")
        parts.append(
            f"<h2>{html.escape(scenario.title)}</h2><table><tr><th>event</th>{head}</tr>"
            f"{''.join(rows)}</table>"
        )
    return _page("RabbitMQ post: local delivery, played on quorumq's machine", "".join(parts))
