"""How long service took to come back after each kind of fault.

The answer a user of a failover simulation wants after "was anything lost": when the
leader was killed, how long did publishers wait for a confirm, and consumers for a
delivery? Under load, confirms and first deliveries come every few milliseconds; a
fault that stops them shows as a gap.

A fault's recovery is measured from when it stopped acting (its end: a partition
healed, a paused node resumed, a slow link fast again; an instant fault, a link reset
or a clock jump, ends when it starts) to the next confirm (or first delivery). A
fault whose process dies (`FROM_START`: a crash, a killed leader, a power loss; and a
membership change, whose "end" is only when the operator undoes it) is measured from
its start instead: the pause it causes is the failover, while it is down.

A fault is charged its recovery only if no other fault was active during it, that is
between the moment it is measured from and the confirm that ended it. A fault is
active from its start until it ends and the service came back after it (its own
recovery), so a fault that lands in another's recovery, or during another's
partition, leaves both uncharged: they are counted as `overlapped`. The heal ends
every fault at once and producers stop: a recovery that reaches it is overlapped too.
The resolution is the time between two publishes (about 20 ms at 150 records/s,
300 ms at 10). Each fault kind gets the p50, p99 and maximum of its charged faults'
recoveries; a sweep pools them over its seeds.

(Before this, a fault was charged the longest gap between confirms that overlapped it
or the 2 s after it: with faults every 0.6-1.2 s the windows overlapped and nearly
every kind was charged the same few seconds.)
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence

import attrs

FROM_START = frozenset(
    {
        "crash",
        "kill_leader",
        "torn_power_loss",
        "bit_flip",
        "meta_ahead",
        "remove_member",
        "remove_leader",
        "add_spare",
        "concurrent_changes",
    }
)
"""Kinds measured from their start (see the module's docstring)."""


@attrs.frozen
class Pauses:
    """One fault kind's recoveries, in seconds: its `count` faults, of which those in
    `charged` (in the order of the faults) had no other fault active meanwhile."""

    count: int
    charged: tuple[float, ...] = ()

    @property
    def overlapped(self) -> int:
        return self.count - len(self.charged)

    @property
    def p50(self) -> float | None:
        return quantile(self.charged, 0.5)

    @property
    def p99(self) -> float | None:
        return quantile(self.charged, 0.99)

    @property
    def max(self) -> float | None:
        return max(self.charged, default=None)


def quantile(values: Sequence[float], q: float) -> float | None:
    """The `q` quantile (nearest rank, rounding up) of `values`; None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def next_after(times_s: Sequence[float], t: float) -> float:
    """The first of `times_s` (sorted) after `t`; infinity if none."""
    i = bisect.bisect_right(times_s, t)
    return times_s[i] if i < len(times_s) else math.inf


@attrs.frozen
class _Span:
    kind: str
    start: float
    end: float
    measured_from: float
    recovered: float

    @property
    def active_until(self) -> float:
        return max(self.end, self.recovered)


def fault_pauses(
    faults: Iterable[tuple[str, float, float]], times_s: Sequence[float], until_s: float
) -> dict[str, Pauses]:
    """Per fault kind, the recoveries of the `(kind, at_s, duration_s)` faults, as seen
    in the events at `times_s` (sorted; confirms or first deliveries), up to `until_s`
    (the heal). Faults from `until_s` on are left out."""
    spans = []
    for kind, at_s, duration_s in faults:
        if at_s >= until_s:
            continue
        end = at_s + duration_s
        measured_from = at_s if kind in FROM_START else end
        spans.append(_Span(kind, at_s, end, measured_from, next_after(times_s, measured_from)))
    charged: dict[str, list[float]] = {}
    counts: dict[str, int] = {}
    for i, f in enumerate(spans):
        counts[f.kind] = counts.get(f.kind, 0) + 1
        charged.setdefault(f.kind, [])
        if f.recovered > until_s:
            continue  # the heal came first
        if any(
            j != i and g.start < f.recovered and g.active_until > f.measured_from
            for j, g in enumerate(spans)
        ):
            continue
        charged[f.kind].append(f.recovered - f.measured_from)
    return {kind: Pauses(counts[kind], tuple(charged[kind])) for kind in sorted(counts)}


def _seconds(value: float | None) -> str:
    return "    -" if value is None else f"{value:5.2f}"


def pause_table(confirms: dict[str, Pauses], deliveries: dict[str, Pauses]) -> list[str]:
    """The summary's lines: one per fault kind."""
    lines = [
        "recovery after the faults injected (xN: of the kind, as counted above; charged: "
        "those with no other fault active meanwhile, the others overlapped; s from a "
        "fault's end, from its start for a crash or a membership change, to the next "
        "confirm / first delivery, p50 / p99 / max over the charged):"
    ]
    for kind in sorted(confirms):
        c, d = confirms[kind], deliveries.get(kind)
        line = (
            f"  {kind:<20} x{c.count:<3} charged {len(c.charged):<3} overlapped "
            f"{c.overlapped:<3} confirms {_seconds(c.p50)} / {_seconds(c.p99)} / "
            f"{_seconds(c.max)}"
        )
        if d is not None:
            line += f"   deliveries {_seconds(d.p50)} / {_seconds(d.p99)} / {_seconds(d.max)}"
        lines.append(line)
    return lines
