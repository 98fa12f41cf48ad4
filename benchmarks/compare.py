"""quorumq side by side with RabbitMQ quorum queues and NATS JetStream, in one run.

    python -m benchmarks compare [--repeat 3] [--messages 20000] [--systems quorumq,rabbitmq,nats]

Each system runs as 3 server processes on 127.0.0.1 (quorumq: `quorumq node` with
fsync=always; RabbitMQ: 3 clustered nodes and a quorum queue; NATS: 3 servers and an R3
file stream), started here in temporary directories and stopped by PID. The workloads
run interleaved (A B C A B C ...) so that drift on a shared host hits all alike:

* publish-confirm msg/s, 1 producer and 16 producer processes (window 1,000 in total
  per producer group of 1, 125 each for 16);
* publish -> consume -> ack msg/s, producer on the leader, consumers on both followers;
* publish -> delivery latency p50/p99/p99.9 at a fixed 1,000 and 5,000 msg/s, with the
  consumer on a follower (confirm latency recorded too);
* failover: kill -9 of the leader while publishing at 1,000 msg/s: time until confirms
  and until deliveries of messages sent after the kill resume; lost (confirmed, never
  delivered) and duplicated (delivered twice; unmarked when not flagged redelivered);
* peak RSS per server process, and server CPU seconds per 100,000 messages.

Writes `compare.json`, `compare.md` and `compare.png` under `--out`
(default `benchmarks/results/`). A peer that is not installed is skipped with the
command that installs it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

from quorumq.ops.local_cluster import Cluster

from .bench_cluster import QuorumqSystem
from .peers.common import (
    PAYLOAD,
    Trace,
    cpu_seconds,
    latency_sample,
    peak_rss_mb,
    stop_on_sigterm,
)
from .peers.jetstream import NatsCluster, NatsSystem, nats_missing
from .peers.rabbitmq import RabbitCluster, RabbitSystem, rabbitmq_missing

RESULTS = Path(__file__).parent / "results"


class System(Protocol):
    name: str
    durability: str
    version: str

    def server_pids(self) -> dict[str, int]: ...
    def publish_confirm(self, producers: int, messages: int, window: int) -> float: ...
    def end_to_end(self, messages: int, window: int) -> float: ...
    def end_to_end_queues(self, queues: int, messages: int, window: int) -> float: ...
    def paced(self, rate: int, seconds: float, kill_at: float | None = None) -> Trace: ...


def _start(key: str, stack: contextlib.ExitStack, root: Path) -> System:
    """Start `key`'s 3 servers with their data and logs under `root / key`."""
    data = root / key
    data.mkdir()
    if key == "quorumq":
        return QuorumqSystem(stack.enter_context(Cluster(3, str(data), node_down_grace=30.0)))
    if key == "rabbitmq":
        return RabbitSystem(stack.enter_context(RabbitCluster(root=str(data))))
    return NatsSystem(stack.enter_context(NatsCluster(root=str(data))))


_MISSING: dict[str, Callable[[], str | None]] = {
    "quorumq": lambda: None,
    "rabbitmq": rabbitmq_missing,
    "nats": nats_missing,
}


def _load() -> dict[str, Any]:
    load1, load5, load15 = os.getloadavg()
    return {"load1": load1, "load5": load5, "load15": load15, "at": time.strftime("%H:%M:%S")}


def run(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """Start the systems, run every workload interleaved, return the results."""
    keys = [k.strip() for k in args.systems.split(",") if k.strip()]
    unknown = sorted(set(keys) - set(_MISSING))
    if unknown:
        raise SystemExit(f"unknown systems {unknown}: choose from {sorted(_MISSING)}")
    skipped = {}
    for key in list(keys):
        reason = _MISSING[key]()
        if reason is not None:
            print(f"skipping {key}: {reason}", flush=True)
            skipped[key] = reason
            keys.remove(key)
    producers = [int(p) for p in args.producers.split(",")]
    rates = [int(r) for r in args.rates.split(",")]
    results: dict[str, Any] = {
        "command": " ".join(["python -m benchmarks compare", *argv]),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_before": _load(),
        },
        "settings": {
            "messages": args.messages,
            "window": args.window,
            "payload_bytes": PAYLOAD,
            "repeat": args.repeat,
            "latency_seconds": args.latency_seconds,
            "failover_seconds": args.failover_seconds,
            "producers": producers,
            "rates": rates,
            "queues": args.queues,
        },
        "skipped": skipped,
        "systems": {},
        "runs": {},
        "latency_samples": {},
        "peak_rss_mb": {},
        "cpu_s_per_100k": {},
        "idle_cpu_percent": {},
        "elections": {},
        "failures": [],
    }
    workloads: list[tuple[str, int, Callable[[System], Any]]] = []
    for p in producers:
        window = max(1, args.window // (8 if p > 1 else 1))
        workloads.append(
            (
                f"publish_confirm_{p}",
                args.messages,
                lambda s, p=p, w=window: s.publish_confirm(p, args.messages, w),
            )
        )
    workloads.append(
        ("end_to_end", args.messages, lambda s: s.end_to_end(args.messages, args.window))
    )
    if args.queues > 1:
        workloads.append(
            (
                f"end_to_end_{args.queues}_queues",
                args.messages,
                lambda s: s.end_to_end_queues(args.queues, args.messages, max(1, args.window // 2)),
            )
        )
    for rate in rates:
        workloads.append((f"latency_{rate}", 0, lambda s, r=rate: s.paced(r, args.latency_seconds)))
    workloads.append(
        (
            "failover",
            0,
            lambda s: s.paced(1000, args.failover_seconds, kill_at=args.failover_seconds / 3),
        )
    )
    if args.only:
        chosen = set(args.only.split(","))
        unknown = chosen - {w for w, _, _ in workloads}
        if unknown:
            raise SystemExit(f"unknown workloads {sorted(unknown)}: {[w for w, _, _ in workloads]}")
        workloads = [w for w in workloads if w[0] in chosen]
    root = Path(tempfile.mkdtemp(prefix="quorumq-compare-"))
    with contextlib.ExitStack() as stack:
        systems = {}
        for key in keys:
            print(f"starting {key} ...", flush=True)
            systems[key] = _start(key, stack, root)
            s = systems[key]
            results["systems"][s.name] = {"version": s.version, "durability": s.durability}
        _idle_cpu(results, systems.values(), args.idle_seconds)
        for r in range(args.repeat):
            for workload, messages, measure in workloads:
                for s in systems.values():
                    _measure(results, r, workload, messages, s, measure)
    results["machine"]["load_after"] = _load()
    if results["failures"]:
        print(f"{len(results['failures'])} runs failed; servers' data and logs kept in {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)
    return results


def _idle_cpu(results: dict[str, Any], systems: Iterable[System], seconds: float) -> None:
    """CPU the idle servers take (all three together, % of one core): they all stay up
    during the whole run, so this is what each system costs the others in the background."""
    if seconds <= 0:
        return
    pids = {s.name: list(s.server_pids().values()) for s in systems}
    before = {name: sum(cpu_seconds(p) for p in ps) for name, ps in pids.items()}
    time.sleep(seconds)
    for name, ps in pids.items():
        spent = sum(cpu_seconds(p) for p in ps) - before[name]
        results["idle_cpu_percent"][name] = 100 * spent / seconds
        print(f"idle {name:<15} {100 * spent / seconds:.1f}% of a core", flush=True)


def _measure(
    results: dict[str, Any],
    r: int,
    workload: str,
    messages: int,
    s: System,
    measure: Callable[[System], Any],
) -> None:
    pids = s.server_pids()
    cpu_before = {pid: cpu_seconds(pid) for pid in pids.values()}
    term = getattr(s, "raft_term", None)
    term_before = term() if term is not None else 0
    began = time.monotonic()
    try:
        value = measure(s)
    except Exception as e:  # one failed run must not cost the others: reported, not hidden
        error = f"{type(e).__name__}: {e}"
        results["failures"].append({"run": r + 1, "workload": workload, "system": s.name})
        results["failures"][-1]["error"] = error
        print(f"run {r + 1} {workload:<20} {s.name:<15} FAILED {error}", flush=True)
        return
    took = time.monotonic() - began
    if term is not None:
        elections = results["elections"].setdefault(workload, {}).setdefault(s.name, [])
        elections.append(term() - term_before)
    if messages:  # a throughput run (no process killed): server CPU per message
        spent = sum(cpu_seconds(pid) - cpu_before[pid] for pid in pids.values())
        results["cpu_s_per_100k"].setdefault(workload, {}).setdefault(s.name, []).append(
            spent / messages * 100_000
        )
    rss = max([peak_rss_mb(pid) for pid in s.server_pids().values()] + [0.0])
    results["peak_rss_mb"][s.name] = max(results["peak_rss_mb"].get(s.name, 0.0), rss)
    if isinstance(value, Trace):
        if workload != "failover":
            samples = results["latency_samples"].setdefault(workload, {})
            samples.setdefault(s.name, []).extend(latency_sample(value))
        value = value.analyse()
        shown = ", ".join(f"{k} {v:.4g}" for k, v in value.items())
    else:
        shown = f"{value:,.0f} msg/s"
    results["runs"].setdefault(workload, {}).setdefault(s.name, []).append(value)
    print(f"run {r + 1} {workload:<20} {s.name:<15} {shown}  ({took:.0f} s)", flush=True)


# ------------------------------------------------------------------- reporting


def _rows(settings: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(label, workload, field ("" for a plain number), format) for the table."""
    rows = [
        (
            f"publish-confirm msg/s, {p} producer{'s' if p > 1 else ''}",
            f"publish_confirm_{p}",
            "",
            "rate",
        )
        for p in settings["producers"]
    ]
    rows.append(("publish->consume->ack msg/s, consumers on followers", "end_to_end", "", "rate"))
    queues = settings.get("queues", 0)
    if queues > 1:
        rows.append(
            (
                f"publish->consume->ack msg/s, {queues} queues (a client process each)",
                f"end_to_end_{queues}_queues",
                "",
                "rate",
            )
        )
    for rate in settings["rates"]:
        w = f"latency_{rate}"
        rows += [
            (f"{rate:,} msg/s: publish->delivery p50 ms", w, "deliver_p50_ms", "ms"),
            (f"{rate:,} msg/s: publish->delivery p99 ms", w, "deliver_p99_ms", "ms"),
            (f"{rate:,} msg/s: publish->delivery p99.9 ms", w, "deliver_p999_ms", "ms"),
            (f"{rate:,} msg/s: publish->confirm p50 ms", w, "confirm_p50_ms", "ms"),
            (f"{rate:,} msg/s: publish->confirm p99 ms", w, "confirm_p99_ms", "ms"),
            (f"{rate:,} msg/s: rate achieved", w, "achieved_rate", "rate"),
        ]
    rows += [
        ("failover: kill -9 leader -> confirms resume, s", "failover", "confirms_resumed_s", "s"),
        (
            "failover: kill -9 leader -> deliveries resume, s",
            "failover",
            "deliveries_resumed_s",
            "s",
        ),
        ("failover: lost (all runs)", "failover", "lost", "sum"),
        ("failover: duplicated, unmarked (all runs)", "failover", "unmarked_duplicates", "sum"),
        ("failover: duplicated, marked redelivered (all runs)", "failover", "marked", "sum"),
    ]
    return rows


def _values(results: dict[str, Any], workload: str, field: str, name: str) -> list[float]:
    runs = results["runs"].get(workload, {}).get(name, [])
    if field == "marked":
        return [v["duplicated"] - v["unmarked_duplicates"] for v in runs]
    return [v[field] if field else v for v in runs]


def _cell(values: list[float], kind: str) -> str:
    if not values:
        return "-"
    if kind == "sum":
        return f"{sum(values):,.0f}"
    digits = {"rate": 0, "ms": 1, "s": 2, "mb": 0, "cpu": 1}[kind]
    median = statistics.median(values)
    if len(values) == 1:
        return f"{median:,.{digits}f}"
    return f"{median:,.{digits}f} ({min(values):,.{digits}f}-{max(values):,.{digits}f})"


def _ratio(ours: list[float], theirs: list[float], kind: str) -> str:
    if not ours or not theirs or kind == "sum":
        return "-"
    a, b = statistics.median(ours), statistics.median(theirs)
    if b == 0 or math.isnan(a) or math.isnan(b):
        return "-"
    return f"{a / b:.2f}x"


def table(results: dict[str, Any]) -> str:
    """Markdown: medians (min-max) per system, and quorumq / peer ratios."""
    names = list(results["systems"])
    peers = [n for n in names if n != "quorumq"]
    header = ["measure", *names, *[f"quorumq / {p}" for p in peers]]
    lines = ["| " + " | ".join(header) + " |", "|---" + "|---:" * (len(header) - 1) + "|"]
    rows = _rows(results["settings"])
    rows += [("peak RSS per server process, MiB", "", "rss", "mb")]
    if results["elections"]:
        rows.append(("Raft elections during the failover runs (all runs)", "", "kill", "sum"))
        rows.append(("Raft elections during every other run", "", "no-kill", "sum"))
    if results.get("idle_cpu_percent"):
        rows += [("idle CPU of the 3 servers, % of a core", "", "idle", "cpu")]
    for workload in results["cpu_s_per_100k"]:
        rows.append((f"server CPU s per 100,000 msgs, {workload}", workload, "cpu", "cpu"))
    for label, workload, field, kind in rows:
        if field in ("rss", "idle"):
            key = "peak_rss_mb" if field == "rss" else "idle_cpu_percent"
            per = {n: [results[key][n]] for n in names if n in results[key]}
        elif field == "cpu":
            per = results["cpu_s_per_100k"][workload]
        elif field in ("kill", "no-kill"):
            per = {}
            for w, by_system in results["elections"].items():
                if (w == "failover") == (field == "kill"):
                    for n, counts in by_system.items():
                        per.setdefault(n, []).extend(counts)
        else:
            per = {n: _values(results, workload, field, n) for n in names}
        if not any(per.get(n) for n in names):
            continue
        cells = [_cell(per.get(n, []), kind) for n in names]
        ratios = [_ratio(per.get("quorumq", []), per.get(p, []), kind) for p in peers]
        lines.append("| " + " | ".join([label, *cells, *ratios]) + " |")
    return "\n".join(lines)


def report(results: dict[str, Any]) -> str:
    """The whole markdown page: setup, durability, table, targets."""
    m, st = results["machine"], results["settings"]
    out = [
        "# quorumq, RabbitMQ and NATS JetStream side by side",
        "",
        f"`{results['command']}`",
        "",
        f"{m['platform']}, {m['cpus']} CPUs, CPython {m['python']}; load average "
        f"{m['load_before']['load1']:.2f} at the start ({m['load_before']['at']}), "
        f"{m['load_after']['load1']:.2f} at the end ({m['load_after']['at']}). "
        f"3 server processes per system on 127.0.0.1, {st['payload_bytes']}-byte messages, "
        f"{st['messages']:,} per throughput run, window/prefetch {st['window']:,}, "
        f"{st['repeat']} interleaved runs: median (min-max).",
        "",
    ]
    for name, info in results["systems"].items():
        out.append(f"- **{name}** ({info['version']}): {info['durability']}")
    for key, reason in results["skipped"].items():
        out.append(f"- **{key}**: not measured ({reason})")
    out += ["", table(results), ""]
    for f in results["failures"]:
        out.append(f"- run {f['run']} of {f['workload']} on {f['system']} failed: {f['error']}")
    if results["failures"]:
        out.append("")
    out += targets(results)
    return "\n".join(out) + "\n"


def targets(results: dict[str, Any]) -> list[str]:
    """Issue 18's targets (and issue 7's that still hold), each with what was measured
    and met / missed."""
    rabbit, nats = "RabbitMQ", "NATS JetStream"
    if rabbit not in results["systems"] or "quorumq" not in results["systems"]:
        return ["Targets need both quorumq and RabbitMQ measured."]

    def med(workload: str, field: str, name: str) -> float:
        return statistics.median(_values(results, workload, field, name) or [math.nan])

    lines = ["| target | measured | |", "|---|---|---|"]

    def check(label: str, value: float, goal: float, higher_is_better: bool, shown: str) -> None:
        if math.isnan(value):
            lines.append(f"| {label} | not measured in this run | |")
            return
        met = value >= goal if higher_is_better else value <= goal
        lines.append(f"| {label} | {shown} | {'met' if met else 'missed'} |")

    def against(label: str, workload: str, field: str, other: str, factor: float) -> None:
        ours, theirs = med(workload, field, "quorumq"), med(workload, field, other)
        check(label, ours / (factor * theirs), 1.0, False, f"{ours:.1f} ms vs {theirs:.1f} ms")

    against("1,000 msg/s: delivery p50 <= RabbitMQ's", "latency_1000", "deliver_p50_ms", rabbit, 1)
    against(
        "1,000 msg/s: delivery p99 <= 0.5x RabbitMQ's",
        "latency_1000",
        "deliver_p99_ms",
        rabbit,
        0.5,
    )
    if nats in results["systems"]:
        against("1,000 msg/s: delivery p50 <= 3x NATS's", "latency_1000", "deliver_p50_ms", nats, 3)
    for field, name in (("p50", "p50"), ("p99", "p99"), ("p999", "p99.9")):
        against(
            f"5,000 msg/s: delivery {name} <= RabbitMQ's",
            "latency_5000",
            f"deliver_{field}_ms",
            rabbit,
            1,
        )
    for label, workload in (
        ("publish-confirm >= 2.5x RabbitMQ (1 producer)", "publish_confirm_1"),
        ("publish->consume->ack >= 2.5x RabbitMQ", "end_to_end"),
    ):
        ratio = med(workload, "", "quorumq") / med(workload, "", rabbit)
        check(label, ratio, 2.5, True, f"{ratio:.2f}x")
    queues = results["settings"].get("queues", 0)
    if queues > 1:  # issue 33's
        many = f"end_to_end_{queues}_queues"
        ratio = med(many, "", "quorumq") / med("end_to_end", "", "quorumq")
        check(f"{queues} queues end to end >= 1.2x one queue's", ratio, 1.2, True, f"{ratio:.2f}x")
        ratio = med(many, "", "quorumq") / med(many, "", rabbit)
        check(f"{queues} queues end to end >= 2.5x RabbitMQ's", ratio, 2.5, True, f"{ratio:.2f}x")
    cpu = results["cpu_s_per_100k"].get("end_to_end", {})
    if "quorumq" in cpu and rabbit in cpu:
        ours_cpu, theirs_cpu = statistics.median(cpu["quorumq"]), statistics.median(cpu[rabbit])
        check(
            "server CPU s per 100,000 messages end to end <= RabbitMQ's",
            ours_cpu / theirs_cpu,
            1.0,
            False,
            f"{ours_cpu:.1f} s vs {theirs_cpu:.1f} s",
        )
    ours_s, theirs_s = (
        med("failover", "deliveries_resumed_s", "quorumq"),
        med("failover", "deliveries_resumed_s", rabbit),
    )
    check(
        "failover (leader SIGKILL -> deliveries resume) <= RabbitMQ's",
        ours_s / theirs_s,
        1.0,
        False,
        f"{ours_s:.2f} s vs {theirs_s:.2f} s",
    )
    lost = sum(_values(results, "failover", "lost", "quorumq"))
    unmarked = sum(_values(results, "failover", "unmarked_duplicates", "quorumq"))
    check(
        "zero lost, zero unmarked duplicates",
        lost + unmarked,
        0,
        False,
        f"{lost:.0f} lost, {unmarked:.0f} unmarked",
    )
    return lines


def plot(results: dict[str, Any], path: Path) -> bool:
    """Throughput bars (median, min-max whiskers) and publish->delivery latency CDFs."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = list(results["systems"])
    throughput = [w for w in results["runs"] if w.startswith(("publish_confirm", "end_to_end"))]
    latencies = sorted(results["latency_samples"], key=lambda w: int(w.split("_")[1]))
    fig, axes = plt.subplots(1, 1 + len(latencies), figsize=(5 + 4.5 * len(latencies), 4.5))
    axes = list(axes) if latencies else [axes]
    width = 0.8 / max(1, len(names))
    for j, name in enumerate(names):
        meds, lows, highs = [], [], []
        for w in throughput:
            v = results["runs"][w].get(name, [0.0])
            meds.append(statistics.median(v))
            lows.append(statistics.median(v) - min(v))
            highs.append(max(v) - statistics.median(v))
        xs = [i + (j - (len(names) - 1) / 2) * width for i in range(len(throughput))]
        axes[0].bar(xs, meds, width, yerr=[lows, highs], capsize=3, label=name)
    axes[0].set_xticks(range(len(throughput)))
    axes[0].set_xticklabels(
        [
            w.replace("publish_confirm_", "confirm, ")
            .replace("end_to_end_", "pub->ack,\n")
            .replace("_queues", " queues")
            .replace("end_to_end", "pub->ack")
            for w in throughput
        ]
    )
    axes[0].set_ylabel("msg/s (higher is better)")
    axes[0].set_title("throughput")
    axes[0].legend()
    for ax, w in zip(axes[1:], latencies, strict=True):
        for name in names:
            sample = sorted(results["latency_samples"][w].get(name, []))
            if sample:
                ys = [(i + 1) / len(sample) for i in range(len(sample))]
                achieved = statistics.median(_values(results, w, "achieved_rate", name))
                ax.plot(sample, ys, label=f"{name} ({achieved:,.0f} msg/s sent)")
        ax.set_xscale("log")
        ax.set_xlabel("publish -> delivery, ms (log)")
        ax.set_ylabel("fraction of messages")
        ax.set_title(f"latency at {w.split('_')[1]} msg/s")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small", loc="lower right")
    m = results["machine"]
    fig.suptitle(
        f"3 servers per system on one {m['cpus']}-CPU host, load average "
        f"{m['load_before']['load1']:.1f} at the start, {m['load_after']['load1']:.1f} at the end; "
        f"{results['settings']['repeat']} interleaved runs (bars: median, min-max; CDFs: pooled)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _json(results: dict[str, Any]) -> str:
    """Indented JSON with every list of numbers on one line (the latency samples)."""
    text = json.dumps(results, indent=1)
    return re.sub(r"\[\s*(-?[0-9.e+-]+(?:,\s*-?[0-9.e+-]+)*)\s*\]", _one_line, text) + "\n"


def _one_line(match: re.Match[str]) -> str:
    return "[" + ", ".join(v.strip() for v in match.group(1).split(",")) + "]"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks compare", description=__doc__.splitlines()[0]
    )
    add = parser.add_argument
    add("--systems", default="quorumq,rabbitmq,nats", help="comma-separated, in run order")
    add("--repeat", type=int, default=3, help="interleaved runs of every workload")
    add("--messages", type=int, default=20_000, help="messages per throughput run")
    add("--window", type=int, default=1000, help="unconfirmed publishes / consumer prefetch")
    add("--producers", default="1,16", help="producer process counts, comma-separated")
    add("--queues", type=int, default=16, help="queues of the many-queues run (1: none)")
    add("--rates", default="1000,5000", help="paced latency rates in msg/s, comma-separated")
    add("--latency-seconds", type=float, default=5.0, help="length of a paced latency run")
    add("--failover-seconds", type=float, default=6.0, help="paced run; the kill is at 1/3")
    add("--only", default="", help="run only these workloads (comma-separated names)")
    add("--idle-seconds", type=float, default=10.0, help="idle CPU sample after start-up")
    add("--out", type=Path, default=RESULTS, help="where compare.json/.md/.png go")
    add("--report-only", type=Path, help="only write the table and plot of this compare.json")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.report_only is not None:
        results = json.loads(args.report_only.read_text())
        (args.report_only.parent / "compare.md").write_text(report(results))
        plot(results, args.report_only.parent / "compare.png")
        return
    if args.queues > 1 and args.messages < args.queues:
        parser.error("--messages must be at least --queues (each queue carries some)")
    stop_on_sigterm()
    print(f"load average {_load()}", flush=True)
    results = run(args, argv)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compare.json").write_text(_json(results))
    page = report(results)
    (args.out / "compare.md").write_text(page)
    print()
    print(page)
    if plot(results, args.out / "compare.png"):
        print(f"wrote {args.out / 'compare.json'}, compare.md and compare.png")
    else:
        print(
            f"wrote {args.out / 'compare.json'} and compare.md; no plot: pip install -e '.[bench]'"
        )


if __name__ == "__main__":
    main()
