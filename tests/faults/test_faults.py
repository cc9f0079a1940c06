"""Faults injected mid-batch into a private stack; after recovery every
invariant holds, nothing is lost or stuck, and a new turn on every affected
thread completes (SPEC §6: R-RUN-9, R-RUN-10; issue 9 findings 1, 2, 5, 6,
7). Each test prints its figures (``FAULT FIGURES {...}``)."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import pytest
from celery import Celery

from . import invariants
from .harness import Batch, FaultStack, figures, new_turn_on_each_thread, settle

# The first test also pays for the private stack's start-up.
pytestmark = [pytest.mark.faults, pytest.mark.timeout(600)]


def accepted(batch: Batch) -> list[str]:
    return [t.request_id for t in batch.turns if t.status_code in (200, 202)]


def verify(name: str, stack: FaultStack, batch: Batch, recovery: float) -> dict:
    """Invariants, the new turn on every thread, the figures; asserts none
    lost, none stuck, no violation."""
    with stack.db() as conn:
        violations = invariants.check(conn, threads=list(batch.threads), accepted_request_ids=accepted(batch))
    violations += new_turn_on_each_thread(stack, batch)
    with stack.db() as conn:
        violations += invariants.check(conn, threads=list(batch.threads), accepted_request_ids=accepted(batch))
    result = figures(name, stack, batch, violations=violations, recovery_seconds=recovery)
    assert result["lost"] == 0 and result["stuck"] == 0 and not violations, result
    return result


def wait_until(predicate, timeout: float = 30, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"condition not met in {timeout}s")


def running_count(stack: FaultStack, batch: Batch) -> int:
    with stack.db() as conn:
        return conn.execute(
            "SELECT count(*) FROM audit_agentrun WHERE thread_id = ANY(%s::uuid[]) AND status = 'running'",
            [list(batch.threads)],
        ).fetchone()[0]


def wait_for_slow_lookup(stack: FaultStack, run_id: str) -> None:
    """Wait until the run's ``slow_lookup`` tool call has started (its row
    exists): the worker is then inside the tool for a while."""
    with stack.db() as conn:
        wait_until(
            lambda: conn.execute(
                "SELECT 1 FROM conversations_message WHERE run_id = %s AND operation_id = 'call_lookup_slow'",
                [run_id],
            ).fetchone(),
            timeout=60,
        )


def worker_pgid_of_run(stack: FaultStack, run_id: str) -> int:
    with stack.db() as conn:
        owner = conn.execute("SELECT lease_owner FROM audit_agentrun WHERE id = %s", [run_id]).fetchone()[0]
    return os.getpgid(int(owner.split(":")[1]))


# --------------------------------------------------------------------------
# Broker lost (findings 1, 5, 7)
# --------------------------------------------------------------------------


def test_redis_killed_and_restarted_empty_mid_batch_loses_no_run_R_RUN_9(stack):
    """Finding 1: Redis ``kill -9`` mid-batch, back without persistence; and
    finding 7: the workers reconnect instead of exiting (two kills)."""
    batch = Batch(stack)
    # Half the threads stream for about 6 s a turn, so the batch is still in
    # flight when Redis goes: quick turns alone could all end while the
    # batch is being submitted, and the kill would then hit an idle system.
    batch.spread(threads=6, turns_per_thread=3, models=["replay:slow_answer", "replay:tool_then_answer"])
    wait_until(lambda: running_count(stack, batch) >= 1)
    for _ in range(2):
        stack.redis.kill9()
        time.sleep(1.0)
        stack.redis.start()
        time.sleep(1.0)
    recovered_at = time.monotonic()
    settle(stack, batch, timeout=90)
    recovery = time.monotonic() - recovered_at
    exited = [w.name for w in stack.workers if w.popen.poll() is not None]
    assert not exited, f"workers exited after losing Redis: {exited}"
    assert stack.maintenance.popen.poll() is None, "the maintenance worker exited after losing Redis"
    # A worker that gave up is still alive while it finishes its runs: its
    # log says so before it exits.
    gave_up = [p.name for p in [*stack.workers, stack.maintenance] if "Unrecoverable error" in p.output()]
    assert not gave_up, f"workers gave up after losing Redis: {gave_up}"
    # Their consumers reconnected without Mingle's exchange with the other
    # workers, which reports of workers that stop consuming after Redis
    # flapped implicate (yuxi_project.broker.Consumer).
    mingled = [w.name for w in stack.workers if "mingle:" in w.output()]
    assert not mingled, f"workers ran Celery's Mingle step on (re)connecting: {mingled}"
    verify("redis kill -9 + restart empty (x2)", stack, batch, recovery)


def test_a_turn_submitted_while_redis_is_down_is_202_and_runs_once_redis_is_back_R_RUN_9(stack):
    """Finding 5: the enqueue after commit fails; the answer is still 202,
    the retry with the same request_id is 200 with the same run, and both
    turns run once Redis is back."""
    batch = Batch(stack)
    thread_id = batch.new_thread("user1")
    first = batch.submit(thread_id, "turn 1")
    assert first.status_code == 202
    settle(stack, batch)
    stack.redis.kill9()
    began = time.monotonic()
    second = batch.submit(thread_id, "turn 2")
    answered = time.monotonic() - began
    assert second.status_code == 202, f"submit while Redis is down answered {second.status_code}"
    stack.redis.start()
    again = batch.submit(thread_id, "turn 2", request_id=second.request_id)
    assert again.status_code == 200 and again.run_id == second.run_id
    batch.turns.remove(again)
    third = batch.submit(thread_id, "turn 3")
    assert third.status_code == 202
    back_at = time.monotonic()
    settle(stack, batch, timeout=60)
    recovery = time.monotonic() - back_at
    with stack.db() as conn:
        statuses = dict(
            conn.execute(
                "SELECT id::text, status FROM audit_agentrun WHERE id = ANY(%s::uuid[])",
                [[second.run_id, third.run_id]],
            ).fetchall()
        )
    assert statuses == {second.run_id: "completed", third.run_id: "completed"}
    print(f"submit with Redis down answered in {answered:.2f} s")
    verify("submit while redis is down", stack, batch, recovery)


# --------------------------------------------------------------------------
# Database lost (findings 6, 7)
# --------------------------------------------------------------------------


def test_a_task_picked_up_while_postgres_is_down_is_retried_not_dropped_R_RUN_9(stack):
    """Finding 6: worker paused, turn submitted, PostgreSQL stopped, worker
    resumed: the task is retried (the maintenance worker and its beat paused
    too, so the dispatcher cannot
    be what saves it), and the turn runs once PostgreSQL is back."""
    batch = Batch(stack)
    thread_id = batch.new_thread("user2")
    assert batch.submit(thread_id, "turn 1").status_code == 202
    settle(stack, batch)
    groups = [os.getpgid(w.popen.pid) for w in stack.workers] + [os.getpgid(stack.maintenance.popen.pid)]
    for group in groups:
        os.killpg(group, signal.SIGSTOP)
    try:
        second = batch.submit(thread_id, "turn 2")
        third = batch.submit(thread_id, "turn 3")
        assert second.status_code == third.status_code == 202
        stack.pg.stop("fast")
        for group in groups[:-1]:
            os.killpg(group, signal.SIGCONT)
        time.sleep(4)
        stack.pg.start()
        back_at = time.monotonic()
        settle(stack, batch, timeout=60)
        recovery = time.monotonic() - back_at
    finally:
        for group in groups:
            os.killpg(group, signal.SIGCONT)
    logs = "".join(w.output() for w in stack.workers)
    assert "database_unavailable" in logs or "DatabaseUnavailable" in logs, "no pickup met the database down"
    assert "retry" in logs.lower()
    with stack.db() as conn:
        statuses = [
            row[0]
            for row in conn.execute(
                "SELECT status FROM audit_agentrun WHERE id = ANY(%s::uuid[]) ORDER BY created_at",
                [[second.run_id, third.run_id]],
            ).fetchall()
        ]
    assert statuses == ["completed", "completed"]
    verify("task picked up while postgres is down", stack, batch, recovery)


@pytest.mark.parametrize("outage", [5, 10])
def test_postgres_restarted_mid_batch_fails_runs_as_audit_write_failed_not_lease_expired_R_RUN_8(stack, outage):
    """Finding 7: a PostgreSQL outage longer than the lease (10 s), or
    shorter (5 s: the database is back just after the leases of the runs
    whose writes failed ran out, and the sweeper may reach them before
    their workers do — 3 or 4 runs in 20 were labelled ``lease_expired``);
    the runs it broke end ``audit_write_failed`` (the cause), never
    ``lease_expired``."""
    batch = Batch(stack)
    batch.spread(threads=6, turns_per_thread=2, models=["replay:slow_answer", "replay:tool_then_answer"])
    wait_until(lambda: running_count(stack, batch) >= 2)
    with stack.db() as conn:
        outage_began = conn.execute("SELECT now()").fetchone()[0]
    stack.pg.stop("fast")
    time.sleep(outage)  # the lease is 8 s
    stack.pg.start()
    back_at = time.monotonic()
    settle(stack, batch, timeout=90)
    recovery = time.monotonic() - back_at
    verify(f"postgres stop -m fast + start ({outage} s)", stack, batch, recovery)
    with stack.db() as conn:
        mislabelled = conn.execute(
            "SELECT id::text, error_message FROM audit_agentrun WHERE thread_id = ANY(%s::uuid[])"
            " AND error_type = 'lease_expired' AND finished_at >= %s",
            [list(batch.threads), outage_began],
        ).fetchall()
    assert not mislabelled, f"runs ended by the outage labelled lease_expired: {mislabelled}"


# --------------------------------------------------------------------------
# Workers lost (finding 7) and duplicate delivery
# --------------------------------------------------------------------------


def test_a_worker_killed_mid_batch_is_swept_within_the_interval_while_the_other_is_busy_R_RUN_7(stack):
    """Worker SIGKILL mid-batch while the other worker's slots are all busy:
    the sweeper (own queue) still runs every interval, so the killed runs
    end within a sweep interval of their lease's expiry (finding 7)."""
    batch = Batch(stack)
    batch.spread(threads=8, turns_per_thread=2, models=["replay:slow_answer"])
    victim_run = wait_until(lambda: _a_running_run(stack, batch))
    group = worker_pgid_of_run(stack, victim_run)
    victim = next(w for w in stack.workers if os.getpgid(w.popen.pid) == group)
    victim.kill()
    stack.workers.remove(victim)
    killed_at = time.monotonic()
    settle(stack, batch, timeout=120)
    recovery = time.monotonic() - killed_at
    with stack.db() as conn:
        swept = conn.execute(
            "SELECT error_message, finished_at FROM audit_agentrun "
            "WHERE thread_id = ANY(%s::uuid[]) AND error_type = 'lease_expired'",
            [list(batch.threads)],
        ).fetchall()
    assert swept, "the killed worker's runs were swept"
    lateness = [(finished - _expiry(message)).total_seconds() for message, finished in swept]
    lines = stack.maintenance.output().splitlines()
    received = sum("sweep_expired_leases" in line and "received" in line for line in lines)
    succeeded = sum("sweep_expired_leases" in line and "succeeded" in line for line in lines)
    discarded = sum("sweep_expired_leases" in line and "revoked" in line.lower() for line in lines)
    print(
        f"swept {len(swept)} run(s), at most {max(lateness):.2f} s after lease expiry "
        f"(interval {stack.env['LEASE_SWEEP_INTERVAL_SECONDS']} s); sweeps received {received}, "
        f"succeeded {succeeded}, discarded as expired {discarded}"
    )
    # Loose bound (a loaded 2-core machine): finding 7 saw 4-7 s.
    assert max(lateness) < 3.0
    verify("worker SIGKILL mid-batch", stack, batch, recovery)


def _expiry(message: str):
    import datetime as dt

    return dt.datetime.fromisoformat(message.rsplit("expired at ", 1)[1].split(";")[0].strip())


def _a_running_run(stack: FaultStack, batch: Batch) -> str | None:
    with stack.db() as conn:
        row = conn.execute(
            "SELECT id::text FROM audit_agentrun WHERE thread_id = ANY(%s::uuid[]) AND status = 'running' LIMIT 1",
            [list(batch.threads)],
        ).fetchone()
    return row[0] if row else None


def test_duplicate_task_delivery_starts_nothing_twice_R_RUN_3(stack):
    """Every run's task delivered three more times, during and after the
    batch: fencing makes every duplicate a no-op."""
    batch = Batch(stack)
    batch.spread(threads=5, turns_per_thread=2)
    broker = Celery(broker=stack.redis.url)
    run_ids = [t.run_id for t in batch.turns if t.run_id]
    for _ in range(3):
        for run_id in run_ids:
            broker.send_task("audit.execute_run", args=[run_id], queue=stack.env["CELERY_QUEUE"])
    began = time.monotonic()
    settle(stack, batch, timeout=90)
    for run_id in run_ids:  # late duplicates of finished runs
        broker.send_task("audit.execute_run", args=[run_id], queue=stack.env["CELERY_QUEUE"])
    time.sleep(2)
    with stack.db() as conn:
        tokens = conn.execute(
            "SELECT max(fencing_token) FROM audit_agentrun WHERE id = ANY(%s::uuid[])", [run_ids]
        ).fetchone()[0]
    assert tokens == 1, f"a run was acquired {tokens} times"
    verify("duplicate task delivery (x4)", stack, batch, time.monotonic() - began)


# --------------------------------------------------------------------------
# A worker frozen inside a transaction (finding 2)
# --------------------------------------------------------------------------


def test_a_worker_frozen_inside_a_transaction_blocks_nobody_R_RUN_10(stack):
    """Finding 2: a worker stopped (SIGSTOP) while it holds a run row in an
    open transaction (its terminal transaction). Cancel answers in < 2 s,
    nine cancels at once do not use up the web's connections, other users'
    requests answer in < 1 s without 5xx; PostgreSQL ends the frozen
    transaction, the run is swept (cancelled, as asked), and after SIGCONT
    everything goes on."""
    batch = Batch(stack)
    frozen_thread = batch.new_thread("user0", "replay:slow_lookup")
    others = [batch.new_thread(f"user{i}") for i in range(1, 5)]
    baseline = _others_baseline(stack)
    # Where a worker holds a run row across statements: its lifecycle writes
    # are single statements that commit at once (audit.ledger.fenced), so
    # it is the run's terminal transaction, which locks the run row first.
    # The test locks the model row that declared the tool call while the
    # tool runs; the terminal reconcile marks that row, so the worker's
    # terminal transaction waits there, inside, holding the run row. There
    # the worker is frozen.
    target = batch.submit(frozen_thread, "archive?")
    wait_for_slow_lookup(stack, target.run_id)
    blocker = stack.db()
    blocker.autocommit = False
    declaring = blocker.execute(
        "SELECT id FROM conversations_message WHERE run_id = %s AND role = 'assistant' AND tool_calls IS NOT NULL"
        " FOR NO KEY UPDATE",
        [target.run_id],
    ).fetchall()
    assert declaring, "the model row that declared the tool call"
    blocker_pid = blocker.info.backend_pid
    with stack.db() as conn:
        blocked = wait_until(
            lambda: conn.execute(
                "SELECT pid, application_name, state, xact_start IS NOT NULL, left(query, 60)"
                " FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))",
                [blocker_pid],
            ).fetchall(),
            timeout=60,
        )
    print(f"blocked behind the test's row: {blocked}")
    group = worker_pgid_of_run(stack, target.run_id)
    os.killpg(group, signal.SIGSTOP)
    frozen_at = time.monotonic()
    try:
        blocker.rollback()
        blocker.close()
        with stack.db() as conn:
            idle = conn.execute("SELECT state FROM pg_stat_activity WHERE pid = %s", [blocked[0][0]]).fetchone()
        print(f"the frozen worker's backend: {idle}")
        # Traffic while the row is held: the cancel, nine more, others' reads.
        timings: list[tuple[str, int, float]] = []

        def timed(label: str, username: str | None, method: str, path: str) -> None:
            with stack.client(username, timeout=30) as client:
                began = time.monotonic()
                response = client.request(method, path)
                timings.append((label, response.status_code, time.monotonic() - began))

        with concurrent.futures.ThreadPoolExecutor(max_workers=24) as pool:
            jobs = [pool.submit(timed, "cancel", "user0", "POST", f"/api/runs/{target.run_id}/cancel")]
            jobs += [
                pool.submit(timed, "cancel-again", "user0", "POST", f"/api/runs/{target.run_id}/cancel")
                for _ in range(9)
            ]
            for i in range(1, 5):
                jobs.append(pool.submit(timed, "threads", f"user{i}", "GET", "/api/threads"))
                jobs.append(pool.submit(timed, "dashboard", None, "GET", "/api/dashboard/overview"))
            for job in jobs:
                job.result()
        for thread_id in others:
            turn = batch.submit(thread_id, "meanwhile", timeout=5)
            assert turn.status_code == 202, turn.status_code
        cancels = [t for t in timings if t[0].startswith("cancel")]
        other = [t for t in timings if not t[0].startswith("cancel")]
        print(
            f"frozen holder: cancel max {max(t[2] for t in cancels):.2f} s; others max {max(t[2] for t in other):.2f} s"
        )
        assert all(code == 202 and took < 2.0 for _, code, took in cancels), cancels
        # < 1 s, or on a machine so loaded that the same reads take longer
        # without any fault, within three times what they took before it.
        bound = max(1.0, 3 * baseline)
        print(f"others before the freeze: max {baseline:.2f} s; bound {bound:.2f} s")
        assert all(code == 200 and took < bound for _, code, took in other), other
        # PostgreSQL ends the frozen transaction; the run is swept as asked.
        ended = wait_until(lambda: _status(stack, target.run_id) in ("cancelled", "failed"), timeout=30)
        swept_after = time.monotonic() - frozen_at
        with stack.db() as conn:
            status, error_type, message = conn.execute(
                "SELECT status, error_type, error_message FROM audit_agentrun WHERE id = %s", [target.run_id]
            ).fetchone()
        assert ended and status == "cancelled", (status, error_type, message)
        # PostgreSQL itself ended the frozen worker's transaction.
        ended_by_postgres = "idle-in-transaction timeout" in stack.pg.log.read_text(errors="replace")
        print(f"PostgreSQL ended the frozen transaction: {ended_by_postgres}")
        assert ended_by_postgres
    finally:
        os.killpg(group, signal.SIGCONT)
    settle(stack, batch, timeout=60)
    print(f"frozen run ended {swept_after:.1f} s after the freeze")
    verify("worker SIGSTOP inside a transaction", stack, batch, swept_after)


def _others_baseline(stack: FaultStack) -> float:
    """The slowest of the same reads of other users, without a fault."""
    took = []
    for path, user in (("/api/threads", "user1"), ("/api/dashboard/overview", None)) * 2:
        with stack.client(user) as client:
            began = time.monotonic()
            assert client.get(path).status_code == 200
            took.append(time.monotonic() - began)
    return max(took)


def _status(stack: FaultStack, run_id: str) -> str:
    with stack.db() as conn:
        return conn.execute("SELECT status FROM audit_agentrun WHERE id = %s", [run_id]).fetchone()[0]
