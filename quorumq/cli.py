"""The `quorumq` command."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from .scenarios import SCENARIOS, render

DEFAULT_CLUSTER_DIR = ".quorumq-cluster"


class UsageError(Exception):
    """A bad argument: reported in one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors in one line (no usage block): `quorumq X: what (see
    quorumq X --help)`, exit status 2, as every other error of the command."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _count(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an int in [low, high]."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low or (high is not None and value > high):
            within = f"at least {low}" if high is None else f"between {low} and {high}"
            raise argparse.ArgumentTypeError(f"must be {within}, not {value}")
        return value

    return parse


def _seconds(text: str) -> float:
    """An argparse type: seconds, zero or more."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, not {text}")
    return value


def backoff_ms(text: str) -> tuple[int, int]:
    """An argparse type: MIN:MAX, whole milliseconds (a queue's `retry_backoff_ms`; the
    simulator's `--retry-backoff` takes it too). The queue checks the range."""
    low, sep, high = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return int(low), int(high)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not MIN:MAX (milliseconds, e.g. 1000:60000)"
        ) from None


def _queue_name(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("a queue name must not be empty")
    return text


def _address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise argparse.ArgumentTypeError(f"{text!r} is not host:port")
    return host, int(port)


def _peer(text: str) -> tuple[str, str]:
    name, sep, address = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"{text!r} is not NODE=host:port")
    _address(address)
    return name, address


def _timeouts(text: str) -> tuple[float, float]:
    low, sep, high = text.partition(",")
    try:
        pair = (float(low), float(high))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not MIN,MAX seconds") from None
    if not sep or not 0 < pair[0] < pair[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: need 0 < MIN < MAX")
    return pair


def _secret(file: str | None, env: str, what: str) -> str | None:
    if file is not None:
        try:
            value = Path(file).read_text().strip()
        except OSError as e:
            raise UsageError(f"cannot read the {what} file: {e}") from None
        if not value:
            raise UsageError(f"the {what} file {file} is empty")
        return value
    return os.environ.get(env) or None


def _node(args: argparse.Namespace) -> int:
    import trio  # noqa: PLC0415 - only the node needs the server stack

    from .replica import ConfigError  # noqa: PLC0415
    from .server.local_node import AsyncNode, node_config  # noqa: PLC0415

    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format=f"%(asctime)s {args.id} %(levelname)s %(name)s: %(message)s",
    )
    raft = f"{args.raft[0]}:{args.raft[1]}"
    try:
        config = node_config(
            id=args.id,
            data_dir=args.data_dir,
            raft=raft,
            peers=dict(args.peer),
            secret=_secret(args.secret_file, "QUORUMQ_SECRET", "cluster secret"),
            listen=f"{args.listen[0]}:{args.listen[1]}",
            token=_secret(args.token_file, "QUORUMQ_TOKEN", "client token"),
            admin_token=_secret(args.admin_token_file, "QUORUMQ_ADMIN_TOKEN", "admin token"),
            insecure=args.insecure,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            fsync=args.fsync,
            node_down_grace_s=args.node_down_grace,
            election_timeout_s=args.election_timeout,
            compaction_entries=args.compaction_entries,
            max_body=args.max_body,
            outbound_frames=args.outbound_frames,
            min_free_disk_bytes=args.min_free_disk * 1024 * 1024,
        )
    except ConfigError as e:
        raise UsageError(str(e)) from None

    async def run() -> None:
        # the start-up and the stop of `quorumq.Node`: the data directory taken, the
        # replica started, served until SIGTERM or SIGINT, then leadership handed over
        async with AsyncNode.from_config(config, metrics=args.metrics, own_process=True) as node:
            server = node.server
            metrics = server.metrics.address if server.metrics is not None else None
            print(
                f"quorumq node {args.id} ready: clients on {node.address}"
                + (" (TLS)" if server.tls is not None else "")
                + f", raft on {raft}, fsync={args.fsync}"
                + (f", metrics on http://{metrics[0]}:{metrics[1]}/metrics" if metrics else ""),
                flush=True,
            )
            import signal  # noqa: PLC0415

            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    break

    from .raft.first_configuration import PeersChangedError  # noqa: PLC0415
    from .raft.journal import JournalDamagedError, JournalFailedError  # noqa: PLC0415

    refusals = (JournalDamagedError, JournalFailedError, PeersChangedError, OSError)
    try:
        trio.run(run)
    except (*refusals, ConfigError) as e:  # start-up
        raise UsageError(str(e)) from None
    except BaseExceptionGroup as group:  # trio wraps what the node's tasks raised
        found = group.subgroup(refusals)
        if found is None:
            raise
        cannot: BaseException = found
        while isinstance(cannot, BaseExceptionGroup):
            cannot = cannot.exceptions[0]
        raise UsageError(str(cannot)) from None
    return 0


def _demo(args: argparse.Namespace) -> int:
    if args.post:
        names = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
        for name in names:
            print(render(SCENARIOS[name]))
            print()
        print(
            "Three queue machines applied the same log, each at its own pace: every replica\n"
            "computed the same assignment and only the replica local to a consumer sent to it."
        )
        return 0
    from .demo import run  # noqa: PLC0415 - starts processes: only when asked

    timeline = Path(args.timeline) if args.timeline else None
    result = run(messages=args.messages, timeline=timeline)
    return 0 if result.ok else 1


def _endpoints(args: argparse.Namespace) -> list[str]:
    if args.endpoints:
        return [e.strip() for e in args.endpoints.split(",") if e.strip()]
    root = Path(args.dir)
    state = _cluster_state(root)
    if not _running(state):
        raise UsageError(
            f"the cluster in {root} is stopped (start it with: quorumq cluster up"
            f"{_dir_option(root)}), or give --endpoints"
        )
    return [f"127.0.0.1:{n['client_port']}" for n in state["nodes"].values()]


def _tls(args: argparse.Namespace) -> bool | str | None:
    """The clients' `tls=`: `--tls-ca FILE`, or `--tls` (the system's CAs), or None."""
    if args.tls_ca is not None:
        return str(args.tls_ca)
    return True if args.tls else None


def _client(args: argparse.Namespace) -> Any:
    from .client import Client, QuorumqError  # noqa: PLC0415

    token = _secret(args.token_file, "QUORUMQ_TOKEN", "client token")
    admin = _secret(None, "QUORUMQ_ADMIN_TOKEN", "admin token")  # for `members`
    try:
        return Client(
            _endpoints(args),
            token,
            connect_timeout=args.timeout,
            admin_token=admin,
            tls=_tls(args),
        )
    except (QuorumqError, ValueError) as e:
        raise UsageError(str(e)) from None


def _publish(args: argparse.Namespace) -> int:
    bodies = args.message or [line.rstrip("\n") for line in sys.stdin]
    with _client(args) as client:
        for i, body in enumerate(bodies, 1):
            offset = client.publish(args.queue, body.encode(), key=args.key)
            print(f"{offset}" if args.quiet else f"published offset {offset}", flush=True)
            if not args.quiet and len(bodies) > 20 and i % 100 == 0:
                print(f"  {i}/{len(bodies)}", file=sys.stderr, flush=True)
    return 0


def _declare(args: argparse.Namespace) -> int:
    from .client import QuorumqError  # noqa: PLC0415

    options = {
        name: getattr(args, name)
        for name in (
            "max_length",
            "overflow",
            "delivery_limit",
            "dead_letter_queue",
            "retention_messages",
            "retention_bytes",
            "message_ttl_ms",
            "retry_backoff_ms",
        )
        if getattr(args, name) is not None
    }
    if args.single_active_consumer:
        options["single_active_consumer"] = True
    with _client(args) as client:
        try:
            created = client.declare(args.queue, **options)
        except QuorumqError as e:
            raise UsageError(str(e)) from None
    print(f"queue {args.queue} {'created' if created else 'exists with these options'}")
    return 0


def _many(count: int, thing: str) -> str:
    return f"{count} {thing}" + ("" if count == 1 else "s")


def _delete_queue(args: argparse.Namespace) -> int:
    with _client(args) as client:
        deleted = client.delete_queue(args.queue, force=args.force)
    cancelled = deleted["consumers"]
    print(
        f"deleted queue {args.queue}: {_many(deleted['messages'], 'message')} removed"
        + (f", {_many(cancelled, 'consumer')} cancelled" if cancelled else "")
    )
    return 0


def _purge_queue(args: argparse.Namespace) -> int:
    with _client(args) as client:
        removed = client.purge_queue(args.queue)
    print(f"purged queue {args.queue}: {_many(removed, 'ready message')} removed")
    return 0


def _consume(args: argparse.Namespace) -> int:
    import json  # noqa: PLC0415

    with _client(args) as client:
        consumer = client.subscribe(args.queue, prefetch=args.prefetch)
        seen = 0
        while args.count == 0 or seen < args.count:
            d = consumer.get(timeout=args.wait)
            if d is None:
                break
            print(
                json.dumps(
                    {
                        "offset": d.offset,
                        "key": d.key,
                        "body": d.body.decode("utf-8", "backslashreplace"),
                        "redelivered": d.redelivered,
                        "delivery_count": d.delivery_count,
                        "node": d.node,
                    }
                ),
                flush=True,
            )
            if not args.no_ack:
                d.ack()
            seen += 1
    return 0


def _status(args: argparse.Namespace) -> int:
    import json  # noqa: PLC0415

    from .client import ServerError  # noqa: PLC0415

    if args.json:
        if args.watch:
            raise UsageError("--watch shows tables; for a program, run status --json each time")
        with _client(args) as client:
            try:
                status = client.status(audit=args.audit)
            except ServerError as e:
                if e.code == "admin_required":
                    raise UsageError(
                        f"{e} (an audit needs the admin token: set QUORUMQ_ADMIN_TOKEN)"
                    ) from None
                raise
        print(json.dumps(status, indent=2, sort_keys=True))
        return 0
    return _status_tables(args)


def _console() -> Any:
    """A rich console: the terminal's width, or (into a pipe or file) wide enough that no
    column is cut."""
    from rich.console import Console  # noqa: PLC0415

    console = Console()
    return console if console.is_terminal else Console(width=200)


def _status_tables(args: argparse.Namespace) -> int:
    """Tables of every endpoint's node and of the queues, with rates over `--interval`;
    with `--watch`, refreshed in place until Ctrl-C."""
    import time  # noqa: PLC0415

    from rich.console import Group  # noqa: PLC0415
    from rich.live import Live  # noqa: PLC0415
    from rich.text import Text  # noqa: PLC0415

    from .client import Client, QuorumqError  # noqa: PLC0415
    from .status_view import read_cluster, status_view  # noqa: PLC0415

    endpoints = _endpoints(args)
    token = _secret(args.token_file, "QUORUMQ_TOKEN", "client token")
    admin = _secret(None, "QUORUMQ_ADMIN_TOKEN", "admin token")

    def status_of(endpoint: str) -> dict[str, Any]:
        timeout = 300.0 if args.audit else max(args.timeout, 1.0)
        with Client(
            [endpoint],
            token,
            connect_timeout=args.timeout,
            timeout=timeout,
            admin_token=admin,
            tls=_tls(args),
        ) as client:
            status: dict[str, Any] = client.status(audit=args.audit)
            return status

    def read() -> Any:
        return read_cluster(endpoints, status_of, (QuorumqError, OSError, ValueError))

    console = _console()
    before = read()
    if not before.answered and not args.watch:
        errors = "; ".join(f"{n.endpoint}: {n.error}" for n in before.nodes)
        hint = " (set QUORUMQ_ADMIN_TOKEN)" if "admin_required" in errors else ""
        raise UsageError(f"no node gave its status: {errors}{hint}")
    if not args.watch:
        if args.audit:  # an audit hashes every message: once is enough, and no rates
            console.print(status_view(before, None, audit=True))
            return 0
        time.sleep(max(0.0, before.taken_at + args.interval - time.monotonic()))
        console.print(status_view(read(), before))
        return 0

    def view(now: Any, earlier: Any) -> Any:
        heading = Text(
            f"quorumq status: every {args.interval:g} s, {time.strftime('%H:%M:%S')} "
            "(Ctrl-C to stop)",
            style="dim",
        )
        return Group(heading, status_view(now, earlier, audit=args.audit))

    try:
        with Live(view(before, None), console=console) as live:
            while True:
                time.sleep(max(0.0, before.taken_at + args.interval - time.monotonic()))
                now = read()
                live.update(view(now, before))
                before = now
    except KeyboardInterrupt:  # how --watch ends
        return 0


def _queues(args: argparse.Namespace) -> int:
    import json  # noqa: PLC0415

    from .status_view import queue_list  # noqa: PLC0415

    with _client(args) as client:
        status = client.status()
    if args.json:
        print(json.dumps(status["queues"], indent=2, sort_keys=True))
    elif not status["queues"]:
        print(f"no queues (node {status['node']}); declare one: quorumq declare NAME")
    else:
        _console().print(queue_list(status))
    return 0


def _members(args: argparse.Namespace) -> int:
    from .client import Client, QuorumqError  # noqa: PLC0415

    if args.action == "list":
        if args.member:
            raise UsageError("list takes no member")
        with _client(args) as client:
            members = client.status()["members"]
    elif args.action == "add":
        try:
            name, address = _peer(args.member or "")
        except argparse.ArgumentTypeError as e:
            raise UsageError(f"add takes NAME=HOST:PORT: {e}") from None
        print(f"adding {name} ({address}); waiting for the change to commit...", flush=True)
        with _client(args) as client:
            try:
                members = client.add_member(name, address)
            except QuorumqError as e:
                raise UsageError(str(e)) from None
    else:
        if not args.member or "=" in args.member:
            raise UsageError("remove takes a member name, e.g. B")
        token = _secret(args.token_file, "QUORUMQ_TOKEN", "client token")
        admin = _secret(None, "QUORUMQ_ADMIN_TOKEN", "admin token")
        members = {}
        for endpoint in _endpoints(args):  # a node does not remove itself: ask another
            try:
                with Client(
                    [endpoint],
                    token,
                    connect_timeout=args.timeout,
                    admin_token=admin,
                    tls=_tls(args),
                ) as client:
                    if client.node == args.member:
                        continue
                    print(f"removing {args.member} via {client.node}...", flush=True)
                    members = client.remove_member(args.member)
                    break
            except QuorumqError as e:
                raise UsageError(str(e)) from None
        else:
            raise UsageError(f"no endpoint other than {args.member}'s answered")
        print(f"{args.member} removed: stop its process now (it no longer gets the log)")
    for name, address in sorted(members.items()):
        print(f"  {name}: raft {address}")
    return 0


def _cluster_state(root: Path) -> dict[str, Any]:
    import json  # noqa: PLC0415

    try:
        state: dict[str, Any] = json.loads((root / "cluster.json").read_text())
    except FileNotFoundError:
        raise UsageError(f"no cluster in {root} (start one with: quorumq cluster up)") from None
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot read {root / 'cluster.json'}: {e}") from None
    return state


def _dir_option(root: Path) -> str:
    """` --dir ROOT`, unless ROOT is the default (for the commands a message suggests)."""
    return "" if str(root) == DEFAULT_CLUSTER_DIR else f" --dir {root}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _running(state: dict[str, Any]) -> list[str]:
    """The nodes of a dev cluster whose processes run (none once it was stopped: their
    process ids may belong to other processes by now)."""
    if state.get("stopped"):
        return []
    return [name for name, node in state["nodes"].items() if _pid_alive(node["pid"])]


def _cluster_up(root: Path, nodes: int) -> int:
    import json  # noqa: PLC0415
    import secrets  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import time  # noqa: PLC0415

    from .embedded import NODE_NAMES, free_ports  # noqa: PLC0415

    again = (root / "cluster.json").exists()
    if again:
        # a stopped cluster starts again on its own ports and secret: its members'
        # Raft addresses live in its logs, so new ports would leave nodes unreachable
        state = _cluster_state(root)
        if _running(state):
            raise UsageError(
                f"a cluster already runs from {root}: quorumq cluster down{_dir_option(root)} first"
            )
        names = list(state["nodes"])
        ports = {
            n: (state["nodes"][n]["client_port"], state["nodes"][n]["raft_port"]) for n in names
        }
        try:
            secret = (root / "secret").read_text().strip()
        except OSError as e:
            raise UsageError(f"cannot read the stopped cluster's secret: {e}") from None
        print(f"starting the stopped cluster in {root} again ({len(names)} nodes, its data kept)")
    else:
        root.mkdir(parents=True, exist_ok=True)
        names = list(NODE_NAMES[:nodes])
        picked = free_ports(2 * len(names))
        ports = {n: (picked[i], picked[len(names) + i]) for i, n in enumerate(names)}
        secret = secrets.token_hex(16)
        (root / "secret").write_text(secret)
        (root / "secret").chmod(0o600)
    started: dict[str, Any] = {}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    for name in names:
        client_port, raft_port = ports[name]
        command = [
            sys.executable,
            "-m",
            "quorumq",
            "node",
            "--id",
            name,
            "--data-dir",
            str(root / name),
            "--listen",
            f"127.0.0.1:{client_port}",
            "--raft",
            f"127.0.0.1:{raft_port}",
            "--secret-file",
            str(root / "secret"),
            "--insecure",  # a local dev cluster on loopback: no client token
            "--log-level",
            "info",
        ]
        for other in names:
            if other != name:
                command += ["--peer", f"{other}=127.0.0.1:{ports[other][1]}"]
        log_path = root / f"{name}.log"
        marks = log_path.read_bytes().count(b" ready: ") if log_path.exists() else 0
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        procs[name] = proc
        started[name] = {
            "pid": proc.pid,
            "client_port": client_port,
            "raft_port": raft_port,
            "ready_marks": marks,
        }
        print(f"  started node {name} (pid {proc.pid}): clients on 127.0.0.1:{client_port}")
    state = {
        "nodes": {n: {k: v for k, v in s.items() if k != "ready_marks"} for n, s in started.items()}
    }
    (root / "cluster.json").write_text(json.dumps(state, indent=2))
    deadline = time.monotonic() + 30
    for name in names:
        log_path = root / f"{name}.log"
        while log_path.read_bytes().count(b" ready: ") <= started[name]["ready_marks"]:
            if procs[name].poll() is not None or time.monotonic() > deadline:
                why = (
                    _last_line(log_path) if procs[name].poll() is not None else "not ready in 30 s"
                )
                raise UsageError(
                    f"node {name} did not start ({why}); see {log_path}, and stop the "
                    f"others with: quorumq cluster down{_dir_option(root)}"
                )
            time.sleep(0.05)
    endpoints = ",".join(f"127.0.0.1:{n['client_port']}" for n in started.values())
    print(f"cluster up in {root}; endpoints {endpoints}")
    return 0


def _last_line(path: Path) -> str:
    lines = path.read_text(errors="replace").strip().splitlines()
    return lines[-1] if lines else "no output"


def _cluster(args: argparse.Namespace) -> int:
    import json  # noqa: PLC0415
    import signal  # noqa: PLC0415
    import time  # noqa: PLC0415

    root = Path(args.dir)
    if args.action == "up":
        return _cluster_up(root, args.nodes)
    state = _cluster_state(root)
    data = ", ".join(str(root / name) for name in state["nodes"])
    if args.action == "down":
        running = _running(state)
        for name in running:
            node = state["nodes"][name]
            os.kill(node["pid"], signal.SIGTERM)
            print(f"  stopping node {name} (pid {node['pid']})")
        deadline = time.monotonic() + 15
        for name in running:
            pid = state["nodes"][name]["pid"]
            while _pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if _pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        state["stopped"] = True
        (root / "cluster.json").write_text(json.dumps(state, indent=2))
        print(
            f"cluster down; its data is kept in {data} (start it again with: "
            f"quorumq cluster up{_dir_option(root)})"
        )
        return 0
    running = _running(state)
    if not running:
        print(
            f"cluster in {root} is stopped; its data is kept in {data} (start it again "
            f"with: quorumq cluster up{_dir_option(root)})"
        )
        return 0
    for name, node in state["nodes"].items():
        alive = "running" if name in running else "stopped"
        print(
            f"  node {name}: pid {node['pid']} {alive}, clients on 127.0.0.1:{node['client_port']}"
            f", data in {root / name}"
        )
    return 0


def _simulate(arguments: list[str]) -> int:
    """The simulator's own command line: shipped as `quorumq.simulations` in the wheel,
    a top-level `simulations` package in a checkout."""
    try:
        module = importlib.import_module("quorumq.simulations.__main__")
    except ModuleNotFoundError:
        module = importlib.import_module("simulations.__main__")
    result: int = module.main(arguments)
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="quorumq", description="A Raft-replicated, ordered message queue.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = commands.add_parser(
        "demo",
        help="run a 3-node cluster, kill its leader mid-stream, and show what every node delivered",
    )
    demo.add_argument("--messages", type=int, default=600, help="how many to publish")
    demo.add_argument("--timeline", help="where to write the HTML timeline")
    demo.add_argument(
        "--post",
        action="store_true",
        help="instead: replay the event sequences of RabbitMQ's local-delivery post on "
        "three in-process queue machines",
    )
    demo.add_argument(
        "--scenario",
        choices=[*SCENARIOS, "all"],
        default="all",
        help="with --post: which sequence to play (default: all)",
    )
    demo.set_defaults(run=_demo)

    simulate = commands.add_parser(
        "simulate",
        help="deterministic failover simulations: run, sweep, scenario (see simulate --help)",
        add_help=False,
    )
    simulate.add_argument("arguments", nargs=argparse.REMAINDER)
    simulate.set_defaults(run=lambda args: _simulate(list(args.arguments)))

    node = commands.add_parser("node", help="run one node of a cluster (replica and server)")
    node.add_argument("--id", required=True, help="this node's name, e.g. A")
    node.add_argument("--data-dir", required=True, help="where the journal and snapshots live")
    node.add_argument("--listen", type=_address, required=True, help="client address host:port")
    node.add_argument("--raft", type=_address, required=True, help="Raft address host:port")
    node.add_argument(
        "--peer", type=_peer, action="append", default=[], help="another replica: NODE=host:port"
    )
    node.add_argument("--secret-file", help="file with the cluster secret (or set QUORUMQ_SECRET)")
    node.add_argument(
        "--insecure",
        action="store_true",
        help="run without a cluster secret or a client token (only when every Raft and "
        "client address is loopback)",
    )
    node.add_argument("--token-file", help="file with the client token (or set QUORUMQ_TOKEN)")
    node.add_argument(
        "--admin-token-file",
        help="file with the admin token, for membership changes (or set QUORUMQ_ADMIN_TOKEN)",
    )
    node.add_argument(
        "--tls-cert",
        metavar="FILE",
        help="serve clients over TLS only, with this PEM certificate (chain); needs --tls-key",
    )
    node.add_argument("--tls-key", metavar="FILE", help="the PEM private key of --tls-cert")
    node.add_argument("--fsync", choices=["always", "batch", "never"], default="always")
    node.add_argument("--node-down-grace", type=_seconds, default=5.0, metavar="SECONDS")
    node.add_argument(
        "--election-timeout",
        type=_timeouts,
        default=(0.25, 0.6),
        metavar="MIN,MAX",
        help="seconds without a leader before a follower stands for election (randomised)",
    )
    node.add_argument("--max-body", type=int, default=1024 * 1024, metavar="BYTES")
    node.add_argument(
        "--outbound-frames",
        type=_count(1),
        default=20_000,
        metavar="N",
        help="frames waiting for a client before it is cut off as a slow consumer",
    )
    node.add_argument(
        "--min-free-disk",
        type=_count(0),
        default=64,
        metavar="MIB",
        help="below this much free space on the data disk, refuse publishes (the disk "
        "alarm) until space returns; deliveries, acks and reads go on (0: never)",
    )
    node.add_argument(
        "--compaction-entries",
        type=_count(1),
        default=50_000,
        metavar="N",
        help="snapshot the machine and compact the log past this many entries",
    )
    node.add_argument(
        "--metrics",
        type=_address,
        metavar="HOST:PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (port 0 picks one)",
    )
    node.add_argument("--log-level", default="warning", choices=["debug", "info", "warning"])
    node.set_defaults(run=_node)

    cluster = commands.add_parser("cluster", help="a local dev cluster of node processes")
    cluster.add_argument("action", choices=["up", "down", "status"])
    cluster.add_argument("--dir", default=DEFAULT_CLUSTER_DIR, help="where its data dirs live")
    cluster.add_argument("--nodes", type=int, default=3, choices=range(1, 8), metavar="N")
    cluster.set_defaults(run=_cluster)

    def client_options(p: argparse.ArgumentParser) -> None:
        p.add_argument("--endpoints", help="host:port,... (default: the local dev cluster)")
        p.add_argument("--dir", default=DEFAULT_CLUSTER_DIR, help="the local dev cluster's dir")
        p.add_argument("--token-file", help="file with the client token (or QUORUMQ_TOKEN)")
        p.add_argument("--timeout", type=_seconds, default=5.0, help="seconds to connect")
        p.add_argument(
            "--tls",
            action="store_true",
            help="connect over TLS, trusting the system's CAs (nodes run with --tls-cert)",
        )
        p.add_argument(
            "--tls-ca",
            metavar="FILE",
            help="connect over TLS, trusting the CA certificates in this PEM file",
        )

    declare = commands.add_parser("declare", help="create a queue (or check its options)")
    declare.add_argument("queue", type=_queue_name)
    declare.add_argument("--max-length", type=_count(0), help="most ready messages")
    declare.add_argument("--overflow", choices=["drop-head", "reject-publish"])
    declare.add_argument("--delivery-limit", type=_count(0), help="returns before dead-lettering")
    declare.add_argument("--dead-letter-queue", help="where rejected and expired messages go")
    declare.add_argument("--single-active-consumer", action="store_true")
    declare.add_argument("--retention-messages", type=_count(0), help="stream view: newest N kept")
    declare.add_argument(
        "--retention-bytes",
        type=_count(0),
        help="stream view: bytes kept (body, key, headers + 96 each)",
    )
    declare.add_argument(
        "--message-ttl-ms", type=_count(0), help="ready messages expire after this"
    )
    declare.add_argument(
        "--retry-backoff-ms",
        type=backoff_ms,
        metavar="MIN:MAX",
        help="a returned message waits MIN ms before it is delivered again, doubled with "
        "each failed delivery, at most MAX",
    )
    client_options(declare)
    declare.set_defaults(run=_declare)

    publish = commands.add_parser("publish", help="publish messages (arguments or stdin lines)")
    publish.add_argument("queue", type=_queue_name)
    publish.add_argument("message", nargs="*", help="message bodies (default: lines of stdin)")
    publish.add_argument("--key", help="ordering key")
    publish.add_argument("--quiet", action="store_true", help="print bare offsets")
    client_options(publish)
    publish.set_defaults(run=_publish)

    consume = commands.add_parser("consume", help="print deliveries as JSON lines and ack them")
    consume.add_argument("queue", type=_queue_name)
    consume.add_argument("--count", type=_count(0), default=0, help="stop after N (0: until idle)")
    consume.add_argument(
        "--prefetch",
        type=_count(0, 65_535),
        default=100,
        help="deliveries held unacked at most (up to 65535; 0: no limit)",
    )
    consume.add_argument("--wait", type=_seconds, default=2.0, help="idle seconds before stopping")
    consume.add_argument("--no-ack", action="store_true", help="do not ack (they come back)")
    client_options(consume)
    consume.set_defaults(run=_consume)

    delete = commands.add_parser(
        "delete-queue",
        help="delete a queue and its messages (refused while it has consumers)",
        description="Deletes the queue with its messages, stream view, producers and "
        "committed offsets, and prints how many messages went. A queue with consumers is "
        "refused unless --force. A queue declared again under the name is empty and "
        "carries on from the offset where this one ended.",
    )
    delete.add_argument("queue", type=_queue_name)
    delete.add_argument(
        "--force",
        action="store_true",
        help="delete it even with consumers: they are cancelled (reason queue_deleted) "
        "and the messages they hold are deleted too",
    )
    client_options(delete)
    delete.set_defaults(run=_delete_queue)

    purge = commands.add_parser(
        "purge-queue",
        help="remove a queue's ready messages (delivered ones stay with their consumers)",
        description="Removes the queue's ready messages, those waiting for a retry delay "
        "too, and prints how many went. Delivered ones stay with their consumers, to ack "
        "or nack as before; the stream view (read) keeps everything until retention "
        "drops it.",
    )
    purge.add_argument("queue", type=_queue_name)
    client_options(purge)
    purge.set_defaults(run=_purge_queue)

    members = commands.add_parser(
        "members",
        help="list, add or remove replicas of a running cluster (one change at a time)",
        description="To add a replica, first start its node with every current member "
        "and itself as --peer, then `members add NAME=HOST:PORT` (its Raft address). To "
        "remove one, `members remove NAME`, then stop that node.",
    )
    members.add_argument("action", choices=["list", "add", "remove"])
    members.add_argument("member", nargs="?", help="add: NAME=HOST:PORT; remove: NAME")
    client_options(members)
    members.set_defaults(run=_members)

    status = commands.add_parser(
        "status",
        help="tables of the cluster's nodes and queues (--json: one node's status as JSON)",
        description="Asks every endpoint's node for its status: a table of nodes (role, "
        "Raft term, commit and applied index, lag behind the leader's commit) and one of "
        "queues (ready, unacked, consumers, publish and deliver rates from two readings "
        "--interval apart).",
    )
    client_options(status)
    status.add_argument(
        "--json",
        action="store_true",
        help="print one node's status as JSON, for programs (what status printed before)",
    )
    status.add_argument(
        "--watch", action="store_true", help="refresh the tables in place until Ctrl-C"
    )
    status.add_argument(
        "--interval",
        type=_seconds,
        default=1.0,
        metavar="SECONDS",
        help="between the two readings rates come from, and between refreshes (default 1)",
    )
    status.add_argument(
        "--audit",
        action="store_true",
        help="also the state digest and the log index it is of (needs the admin token, "
        "QUORUMQ_ADMIN_TOKEN; one audit at a time per node; the node encodes its state in "
        "a forked child, about 1.3 s per million 100-byte messages)",
    )
    status.set_defaults(run=_status)

    queues = commands.add_parser("queues", help="a table of the queues")
    client_options(queues)
    queues.add_argument("--json", action="store_true", help="the queues' status as JSON")
    queues.set_defaults(run=_queues)
    return parser


def _client_error(args: argparse.Namespace, error: Exception) -> str:
    """One line for an error the client raised, with what to do where it is clear."""
    from .client import ServerError  # noqa: PLC0415

    text = str(error) or type(error).__name__
    if isinstance(error, ServerError):
        queue = getattr(args, "queue", None)
        if error.code == "unknown_queue" and queue and args.command in ("publish", "consume"):
            text += f" (declare it: quorumq declare {queue})"
        elif error.code == "queue_in_use":
            text += " (--force deletes it all the same)"
        elif error.code == "admin_required" and "QUORUMQ_ADMIN_TOKEN" not in text:
            text += " (set QUORUMQ_ADMIN_TOKEN)"
    return text


def main(argv: Sequence[str] | None = None) -> int:
    """The `quorumq` command: every error a user can cause is one line on stderr and
    exit status 2."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["simulate"]:  # its options, --help too, are the simulator's
        return _simulate(arguments[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        result: int = args.run(args)
    except UsageError as e:
        parser.exit(2, f"quorumq {args.command}: {e}\n")
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `quorumq status | head`: the reader went away
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except Exception as e:
        client = sys.modules.get("quorumq.client.core")
        if client is None or not isinstance(e, client.QuorumqError):
            raise  # a defect, not the user's doing: the traceback is for us
        parser.exit(2, f"quorumq {args.command}: {_client_error(args, e)}\n")
    return result


if __name__ == "__main__":
    sys.exit(main())
