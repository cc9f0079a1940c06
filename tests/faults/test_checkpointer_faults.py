"""The checkpointer under real faults (R-RUN-8): a PostgreSQL restart or a
killed ``yuxi-checkpointer`` backend while runs are in flight. Every run
ends completed or failed with a named error type, none stays open, no audit
row stays running, a completed run's State is in the thread's checkpoint,
and no checkpointer connection outlives its run in use (a worker process
keeps one idle for its next run)."""

from __future__ import annotations

import os
import threading
import time

import psycopg
import pytest

from audit.execution.checkpoint import CHECKPOINTER_APPLICATION_NAME

from . import harness, invariants
from .harness import Batch, FaultStack, figures, new_turn_on_each_thread, settle

pytestmark = [pytest.mark.faults, pytest.mark.timeout(900)]

SLOW_MODELS = [
    "replay:slow_answer",
    "replay:tool_then_slow_answer",
    "replay:slow_tool_then_answer",
    "replay:tool_then_answer",
]


@pytest.fixture(scope="module")
def cstack():
    """A private stack of this module's own; ``ATTACK_AUDIT_WRITE_ATTEMPTS``
    (default the harness's) sets the retries."""
    attempts = os.environ.get("ATTACK_AUDIT_WRITE_ATTEMPTS")
    saved = dict(harness.FAST_SETTINGS)
    if attempts:
        harness.FAST_SETTINGS["AUDIT_WRITE_ATTEMPTS"] = attempts
    try:
        stack = harness.fault_stack()
    finally:
        harness.FAST_SETTINGS.clear()
        harness.FAST_SETTINGS.update(saved)
    yield stack
    stack.stop()


@pytest.fixture
def stack(cstack):
    cstack.ensure_running()
    return cstack


def _accepted(batch: Batch) -> list[str]:
    return [t.request_id for t in batch.turns if t.status_code in (200, 202)]


def _running(stack: FaultStack, batch: Batch) -> int:
    with stack.db() as conn:
        return conn.execute(
            "SELECT count(*) FROM audit_agentrun WHERE thread_id = ANY(%s::uuid[]) AND status = 'running'",
            [list(batch.threads)],
        ).fetchone()[0]


def _wait(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise TimeoutError("condition not met")


def checkpoint_problems(stack: FaultStack, batch: Batch) -> list[str]:
    """Every completed run's human message and answer are in its thread's
    latest checkpoint, and that checkpoint ends with the last completed
    run's answer when the thread's last run completed."""
    from langgraph.checkpoint.postgres import PostgresSaver

    problems = []
    with stack.db() as conn:
        rows = conn.execute(
            "SELECT r.id::text, r.thread_id::text, r.status, r.error_type, m.content"
            " FROM audit_agentrun r LEFT JOIN conversations_message m ON m.id = r.output_message_id"
            " WHERE r.thread_id = ANY(%s::uuid[]) ORDER BY r.created_at",
            [list(batch.threads)],
        ).fetchall()
    by_thread: dict[str, list] = {}
    for row in rows:
        by_thread.setdefault(row[1], []).append(row)
    with PostgresSaver.from_conn_string(stack.pg.url("yuxi")) as saver:
        for thread_id, runs in by_thread.items():
            saved = saver.get_tuple({"configurable": {"thread_id": thread_id, "checkpoint_ns": ""}})
            messages = (saved.checkpoint["channel_values"].get("messages", []) if saved else []) or []
            ids = [getattr(m, "id", None) for m in messages]
            for run_id, _, status, _, content in runs:
                if status != "completed":
                    continue
                if f"human-{run_id}" not in ids:
                    problems.append(f"thread {thread_id}: completed run {run_id} missing from the checkpoint")
                    continue
                after = messages[ids.index(f"human-{run_id}") + 1 :]
                answers = [m for m in after if m.type == "ai" and not getattr(m, "tool_calls", None)]
                if not answers:
                    problems.append(f"thread {thread_id}: completed run {run_id}'s answer not in the checkpoint")
                elif content is not None and str(content) not in [_text(a.content) for a in answers]:
                    problems.append(
                        f"thread {thread_id}: run {run_id}'s answer differs in the checkpoint:"
                        f" {str(content)[:60]!r} vs {[_text(a.content)[:60] for a in answers]!r}"
                    )
            if runs[-1][2] == "completed" and saved is not None and saved.checkpoint["channel_values"]:
                if saved.metadata.get("source") == "loop" and messages and messages[-1].type != "ai":
                    problems.append(f"thread {thread_id}: latest checkpoint ends with {messages[-1].type}")
    return problems


def _text(content) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return str(content)


def failed_without_a_name(stack: FaultStack, batch: Batch) -> list[str]:
    with stack.db() as conn:
        rows = conn.execute(
            "SELECT id::text, status, error_type, left(error_message, 200) FROM audit_agentrun"
            " WHERE thread_id = ANY(%s::uuid[]) AND status NOT IN ('completed', 'cancelled', 'interrupted')"
            " AND coalesce(error_type, '') = ''",
            [list(batch.threads)],
        ).fetchall()
    return [f"run ended without a named error: {r}" for r in rows]


def leaked_checkpointer_connections(stack: FaultStack, wait: float = 5.0) -> list[str]:
    """Once every run is terminal (after a short grace), no checkpointer
    connection is in use — none runs a statement or holds a transaction —
    and the idle ones are at most those the worker loops keep for their
    next run: one per process of the live workers' pools (a run ends its
    connection when it is not idle, and a killed worker's die with it)."""
    slots = sum(getattr(w, "concurrency", 1) for w in stack.workers if w.popen.poll() is None)
    deadline = time.monotonic() + wait
    while True:
        with stack.db() as conn:
            rows = conn.execute(
                "SELECT pid, state, backend_start::text, left(query, 80) FROM pg_stat_activity"
                " WHERE split_part(application_name, ' ', 1) = %s",  # "<role> <session tag>"
                [CHECKPOINTER_APPLICATION_NAME],
            ).fetchall()
        busy = [r for r in rows if r[1] != "idle"]
        violations = [f"checkpointer connection still in use: {r}" for r in busy]
        if len(rows) - len(busy) > slots:
            violations.append(f"{len(rows) - len(busy)} idle checkpointer connections for {slots} worker processes")
        if not violations or time.monotonic() > deadline:
            return violations
        time.sleep(0.25)


def error_types(stack: FaultStack, batch: Batch) -> dict[str, int]:
    with stack.db() as conn:
        return dict(
            conn.execute(
                "SELECT status || coalesce(':' || nullif(error_type, ''), ''), count(*) FROM audit_agentrun"
                " WHERE thread_id = ANY(%s::uuid[]) GROUP BY 1",
                [list(batch.threads)],
            ).fetchall()
        )


def verify(name: str, stack: FaultStack, batch: Batch, began: float, *, expect_all_completed: bool) -> None:
    settle(stack, batch, timeout=240)
    recovery = time.monotonic() - began
    outcomes_before = error_types(stack, batch)
    print(f"\n{name}: outcomes of the faulted batch {outcomes_before}")
    with stack.db() as conn:
        for row in conn.execute(
            "SELECT id::text, error_type, left(error_message, 300), started_at::text, finished_at::text"
            " FROM audit_agentrun WHERE thread_id = ANY(%s::uuid[]) AND status = 'failed'",
            [list(batch.threads)],
        ).fetchall():
            print(f"  failed run: {row}")
            if row[1] == "lease_expired":
                for process in [*stack.workers, stack.maintenance]:
                    for line in process.output().splitlines():
                        if row[0] in line:
                            print(f"    {process.name}: {line[:400]}")
    violations = failed_without_a_name(stack, batch)
    with stack.db() as conn:
        violations += invariants.check(conn, threads=list(batch.threads), accepted_request_ids=_accepted(batch))
    violations += checkpoint_problems(stack, batch)
    violations += leaked_checkpointer_connections(stack)
    violations += new_turn_on_each_thread(stack, batch, timeout=180)
    with stack.db() as conn:
        violations += invariants.check(conn, threads=list(batch.threads), accepted_request_ids=_accepted(batch))
    violations += checkpoint_problems(stack, batch)
    violations += leaked_checkpointer_connections(stack)
    result = figures(name, stack, batch, violations=violations, recovery_seconds=recovery)
    assert result["lost"] == 0 and result["stuck"] == 0 and not violations, result
    if expect_all_completed:
        assert set(outcomes_before) == {"completed"}, outcomes_before


def _batch(stack: FaultStack, threads: int = 10, turns: int = 2) -> Batch:
    batch = Batch(stack)
    batch.spread(threads=threads, turns_per_thread=turns, models=SLOW_MODELS)
    return batch


def test_a_short_postgres_restart_while_runs_are_in_flight_costs_retries_not_runs(stack):
    """A short outage (1.5 s) costs retries, of the audit writes and of the
    checkpointer alike: every run completes (R-RUN-8). Longer outages are
    the fault suite's database restart (test_faults.py)."""
    batch = _batch(stack, threads=4)
    _wait(lambda: _running(stack, batch) >= 3)
    time.sleep(1.0)
    stack.pg.stop("fast")
    time.sleep(1.5)
    stack.pg.start()
    verify("postgres down 1.5 s", stack, batch, time.monotonic(), expect_all_completed=True)


def _killer(stack: FaultStack, stop: threading.Event, interval: float, counter: list[int]) -> None:
    while not stop.is_set():
        try:
            with stack.pg.connect("yuxi") as conn:
                while not stop.is_set():
                    n = conn.execute(
                        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                        " WHERE split_part(application_name, ' ', 1) = %s",  # "<role> <session tag>"
                        [CHECKPOINTER_APPLICATION_NAME],
                    ).fetchone()[0]
                    counter[0] += n
                    time.sleep(interval)
        except psycopg.Error:
            time.sleep(0.2)


def test_checkpointer_backends_killed_repeatedly_cost_retries_not_runs(stack):
    batch = _batch(stack, threads=3)
    _wait(lambda: _running(stack, batch) >= 2)
    stop, killed = threading.Event(), [0]
    killer = threading.Thread(target=_killer, args=(stack, stop, 0.7, killed), daemon=True)
    killer.start()
    try:
        settle(stack, batch, timeout=240)
    finally:
        stop.set()
        killer.join(10)
    print(f"\nkilled {killed[0]} checkpointer backends")
    assert killed[0] > 0
    verify("checkpointer backends killed every 0.7 s", stack, batch, time.monotonic(), expect_all_completed=True)


def _latest_checkpoint_ids(stack: FaultStack, thread_id: str) -> list[str]:
    from langgraph.checkpoint.postgres import PostgresSaver

    with PostgresSaver.from_conn_string(stack.pg.url("yuxi")) as saver:
        saved = saver.get_tuple({"configurable": {"thread_id": thread_id, "checkpoint_ns": ""}})
    messages = (saved.checkpoint["channel_values"].get("messages", []) if saved else []) or []
    return [getattr(m, "id", None) for m in messages]


def test_a_worker_frozen_past_its_lease_does_not_overwrite_the_next_turns_state(stack):
    """Worker frozen (SIGSTOP) mid-stream past its lease: the run is swept,
    the thread's next turn runs on the other worker; then the frozen worker
    resumes. The thread's latest checkpoint must still hold the next turn,
    and a third turn must see it."""
    import os
    import signal

    batch = Batch(stack)
    thread_id = batch.new_thread("user3", "replay:slow_answer")
    first = batch.submit(thread_id, "turn 1")
    with stack.db() as conn:
        _wait(
            lambda: conn.execute(
                "SELECT 1 FROM conversations_message WHERE run_id = %s AND role = 'assistant'", [first.run_id]
            ).fetchone(),
            timeout=60,
        )
        owner = conn.execute("SELECT lease_owner FROM audit_agentrun WHERE id = %s", [first.run_id]).fetchone()[0]
    time.sleep(1.0)
    group = os.getpgid(int(owner.split(":")[1]))
    os.killpg(group, signal.SIGSTOP)
    try:
        with stack.db() as conn:
            _wait(
                lambda: (
                    conn.execute("SELECT status FROM audit_agentrun WHERE id = %s", [first.run_id]).fetchone()[0]
                    not in ("running", "pending", "cancel_requested")
                ),
                timeout=60,
            )
        frozen = next(w for w in stack.workers if os.getpgid(w.popen.pid) == group)
        stack.workers.remove(frozen)  # ensure_running must not count it
        stack.start_worker()
        second = batch.submit(thread_id, "turn 2")
        with stack.db() as conn:
            _wait(
                lambda: (
                    conn.execute("SELECT status FROM audit_agentrun WHERE id = %s", [second.run_id]).fetchone()[0]
                    == "completed"
                ),
                timeout=120,
            )
        before = _latest_checkpoint_ids(stack, thread_id)
    finally:
        os.killpg(group, signal.SIGCONT)
    time.sleep(10)  # the resumed worker finds its lease gone
    after = _latest_checkpoint_ids(stack, thread_id)
    frozen.stop()
    print(f"\ncheckpoint before resume: {before}\ncheckpoint after resume: {after}")
    assert f"human-{second.run_id}" in before
    assert f"human-{second.run_id}" in after, "the resumed worker's stale State replaced the next turn's"
    third = batch.submit(thread_id, "turn 3")
    settle(stack, batch, timeout=120)
    final = _latest_checkpoint_ids(stack, thread_id)
    assert f"human-{second.run_id}" in final and f"human-{third.run_id}" in final, final
