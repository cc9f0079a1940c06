"""Workers killed (SIGKILL: a crash) or stopped (SIGTERM to the main
process: a deploy) at the step boundaries of multi-step runs, each several
times, with ``RUN_RECOVERY=resume`` (R-RUN-15, R-EFF-1): every run is
continued by another worker and ends ``completed``; no row is left
running; each approved email is sent once; the usage of each run counts
every model call the replay server served, once; the stale attempts wrote
nothing after their worker died (R-RUN-4, the invariants). Prints the
matrix (``RECOVERY MATRIX {...}``).

Each point is reached by watching the database: a model call's row is
opened when its request is sent (R-MA-10), a tool's row when it starts and
closed when it ends, so the worker is stopped right after the boundary
named, while the run still has work to do; the last point (the last model
call ended, the terminal write to come) holds the worker in its last State
write with a lock on the checkpoint table."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
import uuid

import pytest

from core.db import session_tag_of

from . import invariants
from .harness import Batch, FaultStack, settle
from .test_faults import wait_until, worker_pgid_of_run

pytestmark = [pytest.mark.faults, pytest.mark.timeout(900)]


@contextlib.contextmanager
def recovering(stack: FaultStack):
    """The stack with ``RUN_RECOVERY=resume`` (the product's default, which
    the other fault tests set aside) in the maintenance worker (the lease
    sweeper) and in fresh run workers; the stack's own processes come back
    afterwards."""
    saved = stack.env
    stack.maintenance.stop()
    for worker in stack.workers:
        worker.stop()
    stack.workers = []
    # Every worker stopped hands over each run it holds, not only the one
    # a case aims at: a run may be hit several times, more than the
    # default bound of 3 that stops a crash loop.
    stack.env = {**saved, "RUN_RECOVERY": "resume", "RUN_RECOVERY_ATTEMPTS": "10"}
    try:
        stack.maintenance = stack.launch_maintenance()
        launched = [stack.launch_worker() for _ in range(2)]
        stack.maintenance.wait_for_line(" ready.", timeout=180)
        for worker in launched:
            worker.wait_for_line(" ready.", timeout=180)
            stack.workers.append(worker)
        yield
    finally:
        for process in [*stack.workers, stack.maintenance]:
            process.stop()
        stack.workers = []
        stack.env = saved
        stack.ensure_running()


def _row(stack: FaultStack, sql: str, params: list):
    with stack.db() as conn:
        return conn.execute(sql, params).fetchone()


def _stop_owner(stack: FaultStack, run_id: str, how: str, *, then=None) -> None:
    """Stop the worker that holds ``run_id`` and start a fresh one in its
    place: ``SIGKILL`` to its whole process group (a crash, an OOM kill),
    or ``SIGTERM`` to its main process only (a deploy), then wait until its
    warm shutdown, having handed its runs over, ends. ``then`` runs right
    after the signal (it releases what the run is held on)."""
    group = worker_pgid_of_run(stack, run_id)
    victim = next(w for w in stack.workers if os.getpgid(w.popen.pid) == group)
    if how == "SIGKILL":
        victim.kill()
    else:
        os.kill(victim.popen.pid, signal.SIGTERM)
    if then is not None:
        then()
    if how == "SIGTERM":
        victim.popen.wait(timeout=180)
    stack.workers.remove(victim)
    stack.start_worker()


# The SQL that is true once a run is past a boundary.
MODEL_ROWS = "SELECT count(*) FROM conversations_message WHERE run_id = %s AND role = 'assistant'"
TOOL_ROW = "SELECT execution_status FROM conversations_message WHERE run_id = %s AND role = 'tool'"
EMAIL_SENT = (
    "SELECT 1 FROM conversations_message WHERE run_id = %s AND operation_id = 'call_email_1' "
    "AND execution_status = 'completed'"
)
# (kill point, scenario, true once the run is past it): reached by watching
# the database, then the worker is stopped while the run has work to do.
POINTS = [
    ("model request sent", "replay:slow_answer", lambda row: row(MODEL_ROWS)[0] >= 1),
    ("tool running", "replay:slow_lookup", lambda row: (row(TOOL_ROW) or [None])[0] == "running"),
    ("tool ended, next model call sent", "replay:tool_then_slow_answer", lambda row: row(MODEL_ROWS)[0] >= 2),
    ("between chunks of the answer", "replay:slow_tool_then_answer", lambda row: row(MODEL_ROWS)[0] >= 2),
]
SIGNALS = ("SIGKILL", "SIGTERM")
# Each (point, signal) this many times; more with YUXI_FAULT_REPEAT=N.
REPEAT = int(os.environ.get("YUXI_FAULT_REPEAT", "2"))


def _stop_at_point(stack: FaultStack, batch: Batch, user: str, point: str, model: str, reached, how: str) -> str:
    thread_id = batch.new_thread(user, model)
    turn = batch.submit(thread_id, text=f"{how} at: {point}")
    assert turn.status_code == 202, turn
    wait_until(lambda: reached(lambda sql: _row(stack, sql, [turn.run_id])), timeout=60)
    if point == "between chunks of the answer":
        time.sleep(1.0)  # a second of its six-second answer streamed
    _stop_owner(stack, turn.run_id, how)
    return turn.run_id


def _stop_after_email_sent(stack: FaultStack, batch: Batch, user: str, how: str) -> str:
    """The approved email, its worker stopped after it was sent while its
    run goes on (its confirmation streams)."""
    thread_id = batch.new_thread(user, "replay:approval_send_email_slow_confirmation")
    first = batch.submit(thread_id, text="send the report")
    wait_until(
        lambda: _row(stack, "SELECT status FROM audit_agentrun WHERE id = %s", [first.run_id])[0] == "interrupted",
        timeout=60,
    )
    with stack.client(batch.threads[thread_id]) as client:
        response = client.post(
            f"/api/runs/{first.run_id}/resume",
            json={"request_id": uuid.uuid4().hex, "decisions": [{"type": "approve"}]},
        )
    assert response.status_code == 202, response.text
    resume_id = response.json()["run_id"]
    wait_until(lambda: _row(stack, EMAIL_SENT, [resume_id]), timeout=60)
    _stop_owner(stack, resume_id, how)
    return resume_id


def _stop_before_terminal_write(stack: FaultStack, batch: Batch, user: str, how: str) -> tuple[str, bool]:
    """The run's last model call has ended and the run's final State and
    terminal write are still to come: the worker is held there by a lock on
    the checkpoint table — seen waiting for it in its last State write —
    and stopped (the call's row may not be closed yet). The lock is taken in turns shorter
    than the worker's lock timeout, so other runs' State writes only wait;
    if the run slipped through between two turns the point was missed
    (returned False, the run then ended on its own)."""
    thread_id = batch.new_thread(user, "replay:slow_tool_then_answer")
    turn = batch.submit(thread_id, text=f"{how} before the terminal write")
    assert turn.status_code == 202, turn
    wait_until(lambda: _row(stack, MODEL_ROWS, [turn.run_id])[0] >= 2, timeout=60)
    owner = _row(stack, "SELECT lease_owner FROM audit_agentrun WHERE id = %s", [turn.run_id])[0]
    session_tag = session_tag_of(owner)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with stack.db() as conn:  # autocommit: the lock's transaction by hand
            (locker,) = conn.execute("SELECT pg_backend_pid()").fetchone()
            conn.execute("BEGIN")
            conn.execute("LOCK TABLE checkpoints IN EXCLUSIVE MODE")
            until = time.monotonic() + 3.0
            while time.monotonic() < until:
                (waiting,) = _row(
                    stack,
                    "SELECT count(*) FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid)) "
                    "AND application_name LIKE %s",
                    [locker, f"%{session_tag}"],
                )
                status = _row(stack, "SELECT status FROM audit_agentrun WHERE id = %s", [turn.run_id])[0]
                if status != "running":
                    conn.execute("COMMIT")
                    return turn.run_id, False
                if waiting:
                    # The only State write of the run since its last call
                    # was sent: the one after that call ended.
                    _stop_owner(stack, turn.run_id, how, then=lambda: conn.execute("COMMIT"))
                    return turn.run_id, True
                time.sleep(0.02)
            conn.execute("COMMIT")
    raise AssertionError(f"run {turn.run_id} never wrote its last State")


def test_workers_killed_or_stopped_at_each_step_boundary_leave_every_run_completed_and_every_effect_once_R_RUN_15_R_EFF_1(
    stack,
):
    """SIGKILL and SIGTERM at each boundary of multi-step runs, each
    ``REPEAT`` times."""
    batch = Batch(stack)
    replay_log_start = len(stack.replay.output())
    cases: list[dict] = []
    users = sorted(stack.tokens)
    with recovering(stack):
        for repetition in range(REPEAT):
            for how in SIGNALS:
                for point, model, reached in POINTS:
                    user = users[len(cases) % len(users)]
                    run_id = _stop_at_point(stack, batch, user, point, model, reached, how)
                    cases.append({"point": point, "how": how, "run_id": run_id, "model": model, "reached": True})
                user = users[len(cases) % len(users)]
                run_id = _stop_after_email_sent(stack, batch, user, how)
                cases.append(
                    {
                        "point": "email sent, confirmation streaming",
                        "how": how,
                        "run_id": run_id,
                        "model": "replay:approval_send_email_slow_confirmation",
                        "reached": True,
                    }
                )
                user = users[len(cases) % len(users)]
                run_id, hit = _stop_before_terminal_write(stack, batch, user, how)
                cases.append(
                    {
                        "point": "last model call ended, before the terminal write",
                        "how": how,
                        "run_id": run_id,
                        "model": "replay:slow_tool_then_answer",
                        "reached": hit,
                    }
                )
            print(f"repetition {repetition + 1}/{REPEAT}: {len(cases)} cases")

        settle(stack, batch, timeout=300)

    with stack.db() as conn:
        violations = invariants.check(
            conn,
            threads=list(batch.threads),
            accepted_request_ids=[t.request_id for t in batch.turns if t.status_code in (200, 202)],
        )
        for case in cases:
            status, error_type, attempt = conn.execute(
                "SELECT status, error_type, attempt FROM audit_agentrun WHERE id = %s", [case["run_id"]]
            ).fetchone()
            case.update(status=status, error_type=error_type, attempt=attempt)
        sends = conn.execute(
            "SELECT count(*) FROM conversations_message WHERE thread_id = ANY(%s::uuid[]) AND tool_name = "
            "'send_email' AND replayed_from_id IS NULL AND started_at IS NOT NULL",
            [list(batch.threads)],
        ).fetchone()[0]
        model_rows = conn.execute(
            "SELECT count(*) FROM conversations_message WHERE thread_id = ANY(%s::uuid[]) AND role = 'assistant' "
            "AND operation_id IS NOT NULL",
            [list(batch.threads)],
        ).fetchone()[0]
    models = {case["model"].removeprefix("replay:") + " " for case in cases}
    served = sum(
        "replay request: scenario=" in line and any(model in line for model in models)
        for line in stack.replay.output()[replay_log_start:].splitlines()
    )
    matrix: dict[str, dict] = {}
    for case in cases:
        cell = matrix.setdefault(f"{case['how']} at {case['point']}", {"runs": 0, "completed": 0, "attempts": []})
        cell["runs"] += 1
        cell["completed"] += case["status"] == "completed"
        cell["attempts"].append(case["attempt"])
        if not case["reached"]:
            cell["missed"] = cell.get("missed", 0) + 1
    emails = sum(case["point"].startswith("email") for case in cases)
    summary = {"matrix": matrix, "emails_sent": sends, "emails_approved": emails}
    summary.update(model_rows=model_rows, model_requests_served=served)
    print(f"\nRECOVERY MATRIX {json.dumps(summary)}")
    assert not violations, violations
    for case in cases:
        assert (case["status"], case["error_type"]) == ("completed", ""), case
        if case["how"] == "SIGKILL" and case["reached"]:
            # SIGTERM may let a run that is about to end end on its own.
            assert case["attempt"] >= 2, case
    assert sends == emails, "each approved email was sent once"
    # Every request the replay server served is a model row of these runs
    # (a row opens when its request is sent); a row more only where a kill
    # may have come between a row and its request.
    assert served <= model_rows <= served + len(cases), (served, model_rows)


def test_a_worker_stopped_by_sigterm_hands_its_run_over_at_once_and_exits_R_RUN_15(stack):
    """A deploy's SIGTERM to a worker's main process (as a platform sends
    it): its pool process hands the run over at its next step boundary
    instead of keeping it until the lease expires, the worker's warm
    shutdown ends by itself, and another worker completes the run."""
    batch = Batch(stack)
    with recovering(stack):
        thread_id = batch.new_thread(sorted(stack.tokens)[0], "replay:slow_answer")
        turn = batch.submit(thread_id, text="stop the worker")
        wait_until(lambda: _row(stack, MODEL_ROWS, [turn.run_id])[0] >= 1, timeout=60)
        group = worker_pgid_of_run(stack, turn.run_id)
        victim = next(w for w in stack.workers if os.getpgid(w.popen.pid) == group)
        os.kill(victim.popen.pid, signal.SIGTERM)  # the main process only
        victim.popen.wait(timeout=120)  # the warm shutdown ends: the task returned
        stack.workers.remove(victim)
        stack.start_worker()
        settle(stack, batch, timeout=120)
        status, attempt = _row(stack, "SELECT status, attempt FROM audit_agentrun WHERE id = %s", [turn.run_id])
        handed_over = [line for line in victim.output().splitlines() if turn.run_id in line and "continues as" in line]
        swept = [line for line in stack.maintenance.output().splitlines() if turn.run_id in line]
    print(f"\nSIGTERM hand-over: run {status}, attempt {attempt}; worker said {handed_over}")
    assert (status, attempt) == ("completed", 2)
    assert handed_over and "shutting down" in handed_over[0], victim.output()[-3000:]
    assert not swept, "the sweeper had to hand the run over: the worker kept it"
    with stack.db() as conn:
        violations = invariants.check(
            conn, threads=list(batch.threads), accepted_request_ids=[t.request_id for t in batch.turns]
        )
    assert not violations, violations
