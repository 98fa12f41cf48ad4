"""Timelines as self-contained HTML, in the manner of the RabbitMQ post's diagrams.

`run_html(result)`: one lane per replica along simulated time: when it was down,
when it led, its applied log index, and per second the deliveries it sent itself (its
consumers are local) above the line and those it only tracked (another replica sends
them) below; faults as red marks, a node that refused to start or stopped as a black
cross, on a time axis; then the faults in words (`fault_text`: what each did, with units
at a human scale), those nodes, and the service-queue changes, replica by replica. The
page wraps to its window: the summary's long lines wrap, the picture scales.

`scenario_html(scenario)`: the post's event sequences played on three machines, one
column per replica: what each applies, sends, only tracks, and its service queue.
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING

from quorumq.ops.scenarios import Scenario, describe, play

from .faults import Fault, human_s, span_ms

if TYPE_CHECKING:
    from .runner import Result

WIDTH = 1200
LANE = 90
LEFT = 60
TOP = 20
AXIS = 30
"""Room below the lanes for the time axis."""

_STYLE = """
body { font-family: sans-serif; margin: 20px; color: #222; max-width: 1400px; }
pre { background: #f6f6f6; padding: 10px; white-space: pre-wrap; overflow-wrap: anywhere; }
table { border-collapse: collapse; font-size: 13px; }
td, th { border: 1px solid #ccc; padding: 3px 6px; vertical-align: top; text-align: left; }
td.s { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
svg { display: block; width: 100%; height: auto; }
.sent { color: #1a7f37; font-weight: bold; } .tracked { color: #888; }
"""


def _page(title: str, body: str) -> str:
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}"
        f"</title><style>{_STYLE}</style></head><body><h1>{html.escape(title)}</h1>"
        f"{body}</body></html>\n"
    )


def fault_text(fault: Fault, detail: str = "") -> str:
    """What a fault did, for a reader, with units: `clock skew on B: wall clock off by
    +41.9 min`, `slow host A (the leader): its Raft thread stalls 240 ms`. `detail`:
    what the injector says it hit (a node, a consumer, the changes made)."""
    kind, nodes = fault.kind, ",".join(fault.nodes)
    on = detail or nodes
    lasting = human_s(fault.duration_s)
    if kind in ("crash", "kill_leader"):
        who = f"{on}, the leader" if kind == "kill_leader" else on
        return f"crash of {who}: its process dies, restarted {lasting} later"
    if kind == "partition":
        return f"partition: {nodes} cut off from the other hosts for {lasting}"
    if kind == "link_reset":
        return f"link reset {'-'.join(fault.nodes)}: the connection breaks, in-flight messages lost"
    if kind in ("slow_link", "one_way_delay"):
        way = "slow link" if kind == "slow_link" else "one-way delay"
        a, b = fault.nodes
        return f"{way} {a} to {b}: +{human_s(fault.amount)} for {lasting}"
    if kind == "pause":
        return f"pause of {on} (SIGSTOP) for {lasting}"
    if kind == "pause_mid_tick":
        return f"pause of {_or_leader(fault, on)} from the seam of its next tick, for {lasting}"
    if kind == "slow_host":
        return f"slow host {_or_leader(fault, on)}: its Raft thread stalls {lasting}"
    if kind == "lone_candidate":
        return f"lone candidate {on}: cut off from every other node for {lasting}"
    if kind == "consumer_death":
        return f"death of a consumer (slot {fault.amount:.0f}): another takes its place later"
    if kind in ("duplicate", "drop"):
        done = "duplicated" if kind == "duplicate" else "dropped"
        return f"{done} Raft messages: {fault.amount:.0%} of them for {lasting}"
    if kind == "reorder":
        return f"reordered Raft messages for {lasting}"
    if kind == "clock_skew":
        off = f"off by {span_ms(fault.amount)}" if fault.amount else "set right"
        return f"clock skew on {on}: wall clock {off}"
    if kind == "clock_jump":
        return f"clock jump on {on}: wall clock moves {span_ms(fault.amount)}"
    if kind == "torn_power_loss":
        return (
            f"power loss on {on}: unsynced writes lost (a torn tail may stay), back {lasting} later"
        )
    if kind == "short_write":
        return f"short write on {on}: its next journal write is short, the one after fails"
    if kind == "sync_failure":
        return f"sync failure on {on}: its next fdatasync fails"
    if kind == "bit_flip":
        return f"bit flip in the journal of {on} (power lost first): it must refuse to start"
    if kind == "meta_ahead":
        return f"meta file ahead of the journal of {on} (power lost first): it must refuse to start"
    if kind == "disk_alarm":
        free = fault.amount / (1 << 20)
        return f"disk alarm on {on}: {free:.1f} MiB free for {lasting}"
    if kind == "disk_full":
        return f"full disk on {on}: no space left for {lasting}"
    if kind == "remove_member":
        return f"membership: {detail or f'remove {nodes}'}, added back {lasting} later"
    if kind == "remove_leader":
        return f"membership: {detail or 'remove'} (the leader), added back {lasting} later"
    if kind == "add_spare":
        return f"membership: {detail or f'add {nodes}'}, removed again {lasting} later"
    if kind == "concurrent_changes":
        return f"membership: two changes at once ({detail or '?'}), undone {lasting} later"
    return fault.describe()


def _or_leader(fault: Fault, on: str) -> str:
    return on if fault.nodes else f"{on} (the leader)"


def _ticks(span_s: float) -> float:
    """Seconds between two marks of the time axis: about ten of them."""
    for step in (1, 2, 5, 10, 20, 30, 60, 120, 300, 600):
        if span_s / step <= 12:
            return step
    return span_s / 10


def run_html(result: Result) -> str:
    history = result.history
    span = max(result.sim_s, 1e-6)

    def x(t: float) -> float:
        return LEFT + (t / span) * WIDTH

    def period(start: float, end: float, y: float, h: float, fill: str, what: str) -> str:
        end = result.sim_s if end < 0 else end  # -1: still lasting at the end
        return (
            f"<rect x='{x(start):.1f}' y='{y}' width='{max(x(end) - x(start), 1):.1f}' "
            f"height='{h}' fill='{fill}'><title>{what}: {start:.2f} s to {end:.2f} s "
            f"({human_s(end - start)})</title></rect>"
        )

    names = list(history.lanes)
    bottom = TOP + LANE * len(names)
    height = bottom + AXIS
    svg = [
        f"<svg viewBox='0 0 {LEFT + WIDTH + 20} {height}' width='{LEFT + WIDTH + 20}' "
        f"height='{height}' xmlns='http://www.w3.org/2000/svg' font-family='sans-serif'>"
    ]
    for row in range(1, len(names), 2):  # shaded: what lies at a lane's edge is its own
        svg.append(
            f"<rect x='0' y='{TOP + row * LANE - 3}' width='{LEFT + WIDTH + 20}' "
            f"height='{LANE}' fill='#f3f5f8'/>"
        )
    step = _ticks(span)
    for i in range(int(span // step) + 1):
        t = i * step
        svg.append(
            f"<line x1='{x(t):.1f}' y1='{TOP}' x2='{x(t):.1f}' y2='{bottom + 4}' stroke='#eee'/>"
            f"<text x='{x(t):.1f}' y='{bottom + 18}' font-size='12' text-anchor='middle'>"
            f"{t:g} s</text>"
        )
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
        y0 = TOP + row * LANE
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
                f"fill='#1a7f37'><title>{second} s: sent {n}</title></rect>"
            )
        for second, n in sorted(lane.tracked.items()):
            h = (LANE / 2 - 10) * n / peak
            svg.append(
                f"<rect x='{x(second):.1f}' y='{mid:.1f}' width='{bar:.1f}' height='{h:.1f}' "
                f"fill='#bbb'><title>{second} s: tracked only {n}</title></rect>"
            )
        points = " ".join(
            f"{x(s + 1):.1f},{y0 + LANE - 6 - (LANE - 12) * i / top_index:.1f}"
            for s, i in sorted(lane.index.items())
        )
        svg.append(f"<polyline points='{points}' fill='none' stroke='#0969da'/>")
    heal = result.liveness.heal_s
    if heal is not None:  # the faults end: heal, then drain
        svg.append(
            f"<line x1='{x(heal):.1f}' y1='{TOP - 8}' x2='{x(heal):.1f}' y2='{bottom + 4}' "
            f"stroke='#222' stroke-width='2'><title>heal at {heal:.2f} s: the faults end; "
            "producers finish, everyone drains</title></line>"
            f"<text x='{x(heal) + 4:.1f}' y='{TOP - 2}' font-size='12'>heal</text>"
        )
    for fault, detail in history.faults:
        text = f"{fault.at_s:.2f} s: {fault_text(fault, detail)}"
        svg.append(
            f"<line x1='{x(fault.at_s):.1f}' y1='{TOP - 8}' x2='{x(fault.at_s):.1f}' "
            f"y2='{bottom}' stroke='#cf222e' stroke-dasharray='3,3'>"
            f"<title>{html.escape(text)}</title></line>"
        )
    for at, name, what in history.node_events:
        row = names.index(name) if name in names else 0
        cx, cy = x(at), TOP + row * LANE + 14
        svg.append(
            f"<path d='M{cx - 5:.1f},{cy - 5} L{cx + 5:.1f},{cy + 5} M{cx - 5:.1f},{cy + 5} "
            f"L{cx + 5:.1f},{cy - 5}' stroke='#000' stroke-width='2'>"
            f"<title>{html.escape(f'{at:.2f} s: {name} {what}')}</title></path>"
        )
    svg.append("</svg>")
    legend = (
        "<p>Time runs left to right, in simulated seconds. Grey: node down. Gold: leader. "
        "Purple, at the bottom of a lane: the node paused, its Raft thread stalled, cut off "
        "alone, its disk short of space, or a direction from it slow. Blue line: applied "
        "log index. Green above the line: deliveries the replica sent itself, per second; "
        "grey below: deliveries it only tracked. Red dashes: faults. Black crosses: a node "
        "that refused to start or stopped. Black line: the heal (the faults end). Hover "
        "over any of them for what, when and how long; the faults are listed below too.</p>"
    )
    faults = "".join(
        f"<tr><td class='s'>{fault.at_s:.2f}</td>"
        f"<td>{html.escape(fault_text(fault, detail))}</td></tr>"
        for fault, detail in history.faults
    )
    events = "".join(
        f"<tr><td class='s'>{at:.2f}</td><td>{html.escape(name)}</td>"
        f"<td>{html.escape(what)}</td></tr>"
        for at, name, what in history.node_events
    )
    rows = "".join(
        f"<tr><td class='s'>{c.at_s:.3f}</td><td>{html.escape(c.node)}</td>"
        f"<td class='s'>{c.index}</td><td>{html.escape(c.what)}</td>"
        f"<td>{html.escape(' '.join(c.service_queue) or '-')}</td></tr>"
        for c in history.sq_changes
    )
    config = result.config
    verdict = "PASS" if result.ok else f"FAIL ({result.violation_count} violations)"
    headline = (
        f"<p><b>{verdict}</b>: {config.nodes} nodes, faults {html.escape(config.faults)}, "
        f"{result.fault_count} faults injected, {result.sim_s:.1f} simulated seconds "
        "(the whole summary is below the picture).</p>"
    )
    body = (
        f"{headline}{legend}{''.join(svg)}"
        f"<h2>Summary</h2><pre>{html.escape(result.summary())}</pre>"
        f"<h2>Faults injected ({len(history.faults)})</h2>"
        f"<table><tr><th>s</th><th>fault</th></tr>{faults}</table>"
        + (
            "<h2>Nodes that refused to start or stopped</h2><table><tr><th>s</th>"
            f"<th>node</th><th>what</th></tr>{events}</table>"
            if events
            else ""
        )
        + "<h2>Service queue after each consumer change</h2><table><tr><th>s</th>"
        "<th>replica</th><th>index</th><th>applies</th><th>service queue</th></tr>"
        f"{rows}</table>"
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
