"""How long confirms and deliveries paused around each kind of fault.

The answer a user of a failover simulation wants after "was anything lost": when the
leader was killed, how long did publishers wait for a confirm, and consumers for a
delivery? Under load, confirms and first deliveries come every few milliseconds; a
fault that stops them shows as a gap. A fault's pause is the longest gap between two
consecutive events (confirms, or first deliveries) that overlaps the fault's window:
from the fault until `AFTER_S` after it ends. Each fault kind gets the p50, p99 and
maximum of its faults' pauses.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence

import attrs

AFTER_S = 2.0
"""How long after a fault ends its effects still count as its pause."""


@attrs.frozen
class Pauses:
    """One fault kind's pauses, in seconds, over its `count` faults."""

    count: int
    p50: float
    p99: float
    max: float


def longest_gap(times_s: Sequence[float], start_s: float, end_s: float) -> float:
    """The longest gap between consecutive `times_s` (sorted) that overlaps
    [start_s, end_s]; a gap still open at the last event runs to `end_s`."""
    if not times_s:
        return end_s - start_s
    first = max(bisect.bisect_left(times_s, start_s) - 1, 0)
    longest, previous = 0.0, None
    for t in times_s[first:]:
        if previous is not None and t >= start_s and previous <= end_s:
            longest = max(longest, t - previous)
        if t > end_s:
            return longest
        previous = t
    if previous is not None and previous <= end_s:  # nothing came after it: open gap
        longest = max(longest, end_s - previous)
    return longest


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def fault_pauses(
    faults: Iterable[tuple[str, float, float]], times_s: Sequence[float], until_s: float
) -> dict[str, Pauses]:
    """Per fault kind, the pauses `(kind, at_s, duration_s)` faults caused in the
    events at `times_s` (sorted); windows end no later than `until_s` (the heal)."""
    by_kind: dict[str, list[float]] = {}
    for kind, at_s, duration_s in faults:
        if at_s >= until_s:
            continue
        end = min(at_s + duration_s + AFTER_S, until_s)
        by_kind.setdefault(kind, []).append(longest_gap(times_s, at_s, end))
    return {
        kind: Pauses(len(gaps), _quantile(gaps, 0.5), _quantile(gaps, 0.99), max(gaps))
        for kind, gaps in sorted(by_kind.items())
    }


def pause_table(confirms: dict[str, Pauses], deliveries: dict[str, Pauses]) -> list[str]:
    """The summary's lines: one per fault kind."""
    lines = ["pauses around faults (s; p50 / p99 / max over each kind's faults):"]
    for kind in sorted(confirms):
        c, d = confirms[kind], deliveries.get(kind)
        line = f"  {kind:<20} x{c.count:<3} confirms {c.p50:5.2f} / {c.p99:5.2f} / {c.max:5.2f}"
        if d is not None:
            line += f"   deliveries {d.p50:5.2f} / {d.p99:5.2f} / {d.max:5.2f}"
        lines.append(line)
    return lines
