"""Named mutations of the machine, the Raft rules, the node core and the client session,
each run against the tests that claim to guard it: a mutation the tests let pass is a
hole in the net.

    python -m tests.mutation_run            # every mutation; prints the score
    python -m tests.mutation_run ttl_half   # some, by name

Each mutation replaces one exact piece of source text (it must occur once), runs the
named tests in a fresh interpreter, and restores the file whatever happens. "killed":
a test failed (pytest's exit status 1; any other but 0, say a test file that does not
exist, stops the run: it would pass for a kill); "survived": every test passed (print
it, add the missing test). The score is per package: killed / run.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent


class Mutation(NamedTuple):
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


MACHINE_TESTS = ("tests/test_machine_properties.py", "tests/test_machine.py")
RAFT_TESTS = ("tests/test_raft_elections.py", "tests/test_raft_rules.py")
SESSION_TESTS = ("tests/test_session.py", "tests/test_session_properties.py")
CORE_TESTS = (
    "tests/test_node_core.py",
    "tests/test_node_parts.py",
    "tests/test_memory_bounds.py",
    "tests/test_server.py",
    "tests/test_server_bounds.py",
)

MUTATIONS = (
    Mutation(
        "ttl_half",
        "quorumq/machine/queue.py",
        "                if msg[4] + ttl > now:",
        "                if msg[4] + ttl // 2 > now:",
        MACHINE_TESTS,
    ),
    Mutation(
        "drop_head_one_short",
        "quorumq/machine/queue.py",
        "        while self.ready_count > limit:",
        "        while self.ready_count > limit - 1:",
        MACHINE_TESTS,
    ),
    Mutation(
        "delivery_limit_one_early",
        "quorumq/machine/consumers.py",
        "            if limit is not None and count > limit:",
        "            if limit is not None and count >= limit:",
        MACHINE_TESTS,
    ),
    Mutation(
        "reject_publish_off_by_one",
        "quorumq/machine/enqueueing.py",
        "            and q.ready_count + len(messages) > opts.max_length",
        "            and q.ready_count + len(messages) > opts.max_length + 1",
        MACHINE_TESTS,
    ),
    Mutation(
        "node_down_keeps_consumers",
        "quorumq/machine/machine.py",
        "            gone = [c for c in q.consumers.values() if c.node == cmd.node]",
        "            gone = []",
        MACHINE_TESTS,
    ),
    Mutation(
        "disk_alarm_ignored",
        "quorumq/machine/enqueueing.py",
        "        if self._disk_alarms and not _is_resend(q, producer, seq, len(messages)):",
        "        if False:",
        MACHINE_TESTS,
    ),
    Mutation(
        "sealed_prefix_ignored",
        "quorumq/machine/enqueueing.py",
        "            if sealed is not None:",
        "            if False:",
        MACHINE_TESTS,
    ),
    Mutation(
        "forgotten_generation_ignored",
        "quorumq/machine/enqueueing.py",
        "            if generation is not None and generation <= q.forgotten_generation:",
        "            if False:",
        MACHINE_TESTS,
    ),
    Mutation(
        "new_producer_may_start_past_zero",
        "quorumq/machine/enqueueing.py",
        "            if seq != 0:",
        "            if False:",
        MACHINE_TESTS,
    ),
    Mutation(
        "pre_vote_grants_a_stale_log",
        "quorumq/raft/elections.py",
        '            and self._log_up_to_date(message.get("last_log_index"), '
        'message.get("last_log_term"))',
        "            and True",
        RAFT_TESTS,
    ),
    Mutation(
        "learner_added_at_once",
        "quorumq/raft/membership.py",
        "        if round_s <= self._SyncObj__conf.raftMaxTimeout:",
        "        if True:",
        RAFT_TESTS,
    ),
    Mutation(
        "outsider_votes_for_anyone",
        "quorumq/raft/elections.py",
        "        return type(added_at) is int and added_at > self._SyncObj__getCurrentLogIndex()",
        "        return True",
        RAFT_TESTS,
    ),
    Mutation(
        "stickiness_ignores_the_lease",
        "quorumq/raft/elections.py",
        "            and not (self.leader_stickiness and self.in_lease())",
        "            and True",
        RAFT_TESTS,
    ),
    Mutation(
        "stale_leader_snapshot_installed",
        "quorumq/raft/membership.py",
        "    def accept_leader_snapshot(self, last_index: int, last_term: int) -> bool:\n",
        "    def accept_leader_snapshot(self, last_index: int, last_term: int) -> bool:\n"
        "        return True\n",
        RAFT_TESTS,
    ),
    Mutation(
        "silence_counted_across_a_stall",
        "quorumq/raft/rules.py",
        "        since = max(self._leader_since, self.awake_since if self.stall_aware_silence "
        "else 0.0)",
        "        since = self._leader_since",
        RAFT_TESTS,
    ),
    Mutation(
        "lease_ignores_the_majority",
        "quorumq/raft/elections.py",
        "            return self._majority(1 + heard)",
        "            return True",
        RAFT_TESTS,
    ),
    Mutation(
        "disk_alarm_flaps_at_the_limit",
        "quorumq/node/disk.py",
        "            raised = free_bytes < limit + limit // 8",
        "            raised = free_bytes < limit",
        CORE_TESTS,
    ),
    Mutation(
        "any_spark_prefix_forgettable",
        "quorumq/node/admin.py",
        "        return SPARK_PREFIXES.match(prefix) is None",
        "        return False",
        (*CORE_TESTS, "tests/test_broker.py"),
    ),
    Mutation(
        "parked_publishes_wait_a_second_each",
        "quorumq/client/publishing.py",
        "            events += self._release_parked(queue)",
        "            events += self._retry_parked_later(queue)",
        SESSION_TESTS,
    ),
    Mutation(
        "disk_alarm_retries_back_off",
        "quorumq/client/publishing.py",
        'steady=code == "disk_alarm"',
        "steady=False",
        SESSION_TESTS,
    ),
    Mutation(
        "cancelled_consumers_kept",
        "quorumq/node/serving.py",
        "            if consumer in conn.cancelling and consumer not in placed:",
        "            if False:",
        CORE_TESTS,
    ),
    Mutation(
        "short_forget_prefix_allowed",
        "quorumq/node/admin.py",
        "    if len(prefix) < MIN_FORGET_PREFIX or may_start_generation_id(prefix):",
        "    if len(prefix) < 1:",
        CORE_TESTS,
    ),
)


def run(mutation: Mutation) -> tuple[bool, float]:
    """(killed, seconds)."""
    path = ROOT / mutation.path
    original = path.read_text()
    if original.count(mutation.old) != 1:
        raise SystemExit(f"{mutation.name}: its text is not in {mutation.path} exactly once")
    started = time.monotonic()
    try:
        path.write_text(original.replace(mutation.old, mutation.new))
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *mutation.tests],
            cwd=ROOT,
            capture_output=True,
            check=False,
        )
    finally:
        path.write_text(original)
    if result.returncode not in (0, 1):  # 2-5: interrupted, internal or usage error, no tests
        raise SystemExit(
            f"{mutation.name}: pytest exited {result.returncode} (not a test failing): "
            + result.stdout.decode(errors="replace")[-2000:]
        )
    return result.returncode == 1, time.monotonic() - started


def main(names: list[str]) -> int:
    chosen = [m for m in MUTATIONS if not names or m.name in names]
    score: dict[str, list[int]] = {}
    survivors = []
    for mutation in chosen:
        killed, seconds = run(mutation)
        package = mutation.path.split("/")[1]
        tally = score.setdefault(package, [0, 0])
        tally[0] += killed
        tally[1] += 1
        if not killed:
            survivors.append(mutation.name)
        print(f"{mutation.name:32} {'killed' if killed else 'SURVIVED':9} {seconds:6.1f} s")
    for package, (killed, total) in sorted(score.items()):
        print(f"{package}: {killed} of {total} killed")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
