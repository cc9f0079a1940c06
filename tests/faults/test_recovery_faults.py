"""Workers killed (SIGKILL) at the step boundaries of multi-step runs, with
``RUN_RECOVERY=resume`` (R-RUN-15, R-EFF-1): every run is continued by
another worker and ends ``completed``; no row is left running; the
approved email is sent once; the usage of each run counts every model call
the replay server served, once; the stale attempts wrote nothing after
their worker died (R-RUN-4, the invariants). Prints the matrix
(``RECOVERY MATRIX {...}``).

Each kill point is reached by watching the database: a model call's row is
opened when its request is sent (R-MA-10), a tool's row when it starts and
closed when it ends, so the worker is killed right after the boundary
named, while the run still has work to do."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
import uuid

import pytest

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
    stack.env = {**saved, "RUN_RECOVERY": "resume", "RUN_RECOVERY_ATTEMPTS": "3"}
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


def _kill_owner(stack: FaultStack, run_id: str) -> None:
    """SIGKILL the worker (its whole process group) that holds ``run_id``
    and start a fresh one in its place."""
    group = worker_pgid_of_run(stack, run_id)
    victim = next(w for w in stack.workers if os.getpgid(w.popen.pid) == group)
    victim.kill()
    stack.workers.remove(victim)
    stack.start_worker()


# (kill point, scenario, the SQL that is true once the run is past it).
MODEL_ROWS = "SELECT count(*) FROM conversations_message WHERE run_id = %s AND role = 'assistant'"
TOOL_ROW = "SELECT execution_status FROM conversations_message WHERE run_id = %s AND role = 'tool'"
POINTS = [
    ("model request sent", "replay:slow_answer", lambda row: row(MODEL_ROWS)[0] >= 1),
    ("tool running", "replay:slow_lookup", lambda row: (row(TOOL_ROW) or [None])[0] == "running"),
    ("tool ended, next model call sent", "replay:tool_then_slow_answer", lambda row: row(MODEL_ROWS)[0] >= 2),
    ("between chunks of the answer", "replay:slow_tool_then_answer", lambda row: row(MODEL_ROWS)[0] >= 2),
]


def test_workers_killed_at_each_step_boundary_leave_every_run_completed_and_every_effect_once_R_RUN_15_R_EFF_1(
    stack,
):
    batch = Batch(stack)
    replay_log_start = len(stack.replay.output())
    matrix: dict[str, dict] = {}
    with recovering(stack):
        for point, model, reached in POINTS:
            thread_id = batch.new_thread(sorted(stack.tokens)[len(matrix) % len(stack.tokens)], model)
            turn = batch.submit(thread_id, text=f"kill at: {point}")
            assert turn.status_code == 202, turn
            run_id = turn.run_id
            wait_until(lambda r=reached, run=run_id: r(lambda sql: _row(stack, sql, [run])), timeout=60)
            if point == "between chunks of the answer":
                time.sleep(1.0)  # a second of its six-second answer streamed
            _kill_owner(stack, turn.run_id)
            matrix[point] = {"run_id": turn.run_id, "model": model}

        # The approved email, killed after it was sent while its run goes on.
        point = "email sent, confirmation streaming"
        thread_id = batch.new_thread(sorted(stack.tokens)[0], "replay:approval_send_email_slow_confirmation")
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
        sent = (
            "SELECT 1 FROM conversations_message WHERE run_id = %s AND operation_id = 'call_email_1' "
            "AND execution_status = 'completed'"
        )
        wait_until(lambda: _row(stack, sent, [resume_id]), timeout=60)
        _kill_owner(stack, resume_id)
        matrix[point] = {"run_id": resume_id, "model": "replay:approval_send_email_slow_confirmation"}

        settle(stack, batch, timeout=240)

    with stack.db() as conn:
        violations = invariants.check(
            conn,
            threads=list(batch.threads),
            accepted_request_ids=[t.request_id for t in batch.turns if t.status_code in (200, 202)],
        )
        for entry in matrix.values():
            status, error_type, attempt = conn.execute(
                "SELECT status, error_type, attempt FROM audit_agentrun WHERE id = %s", [entry["run_id"]]
            ).fetchone()
            entry.update(status=status, error_type=error_type, attempt=attempt)
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
    served = sum(
        "replay request: scenario=" in line
        and any(e["model"].removeprefix("replay:") + " " in line for e in matrix.values())
        for line in stack.replay.output()[replay_log_start:].splitlines()
    )
    print(
        f"\nRECOVERY MATRIX {
            json.dumps(
                {'points': matrix, 'emails_sent': sends, 'model_rows': model_rows, 'model_requests_served': served}
            )
        }"
    )
    assert not violations, violations
    for point, entry in matrix.items():
        assert (entry["status"], entry["error_type"]) == ("completed", ""), (point, entry)
        assert entry["attempt"] >= 2, (point, entry)
    assert sends == 1, "the approved email was sent once"
    # Every request the replay server served is a model row of these runs
    # (a row opens when its request is sent); a row more only where a kill
    # may have come between a row and its request.
    assert served <= model_rows <= served + len(matrix), (served, model_rows)


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
