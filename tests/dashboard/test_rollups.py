"""Dashboard rollups (R-DASH-1, R-COST-2): maintained once in the terminal
transaction, equal to a recomputation from the rows, and giving the same
dashboard answers as the row-based figures."""

from __future__ import annotations

import datetime as dt
import random
import uuid
from decimal import Decimal

import pytest
from django.core.management import call_command
from django.db import connection
from django.utils import timezone

from audit import ledger
from audit.errors import RunTerminal
from audit.ledger import StateMessage
from audit.models import AgentRun
from conversations.models import Conversation
from conversations.services import message_feedback_submit
from costs import selectors as cost_selectors
from dashboard import facts, rollups, selectors
from tests.conftest import acquire, make_run

from .world import MODEL_A, MODEL_B, D, build_world

pytestmark = pytest.mark.django_db

# Facts spread over the three days before now: a full rebuild then spans
# about four days (runs are created now, their calls are dated by T0).
T0 = (dt.datetime.now(dt.UTC) - dt.timedelta(days=3)).replace(minute=0, second=0, microsecond=0)
EMAIL = {"to": "ops@example.com", "subject": "status", "body": "all good"}
INTERRUPT = [
    {
        "id": "intr-1",
        "value": {
            "action_requests": [{"name": "send_email", "args": EMAIL, "description": "Send an email"}],
            "review_configs": [{"action_name": "send_email", "allowed_decisions": ["approve", "reject"]}],
        },
    }
]


def rollup_state() -> dict[str, list[tuple]]:
    """Every rollup row, without ids and without all-zero rows (a delta that
    went back to 0 leaves a row of zeros a recomputation does not have)."""
    state = {}
    for table, (keys, counters, _) in facts.TABLES.items():
        with connection.cursor() as cursor:
            cursor.execute(
                f"SELECT {', '.join((*keys, *counters))} FROM {table}"
                f" WHERE {' OR '.join(f'{c} <> 0' for c in counters)} ORDER BY {', '.join(keys)}"
            )
            state[table] = cursor.fetchall()
    return state


def figures(window) -> dict:
    """Every dashboard figure of the window, as the endpoints compute them."""
    result = {
        "overview": selectors.overview(window),
        "models": selectors.models_report(window),
        "tools": selectors.tools_report(window),
        "timeseries": selectors.timeseries(window),
        "feedback": selectors.feedback_summary(window),
        "cost": cost_selectors.cost_summary(window),
        "cost_by_model_day": cost_selectors.cost_by_model_day(window),
    }
    for group_by in cost_selectors.GROUPS:
        result[f"costs_by_{group_by}"] = cost_selectors.costs_by(window, group_by=group_by)
    return result


def figures_from_rows(window) -> dict:
    """The same figures computed from the rows, as before the rollups."""
    result = {
        "overview": selectors.overview_from_rows(window),
        "models": {
            "tokens_by_model_day": selectors.tokens_by_model_day_from_rows(window),
            "latency": selectors.model_latency_from_rows(window),
        },
        "tools": {
            "by_tool": selectors.tools_by_name_from_rows(window),
            "by_day": selectors.tools_by_day_from_rows(window),
        },
        "timeseries": selectors.timeseries_from_rows(window),
        "feedback": selectors.feedback_summary_from_rows(window),
    }
    rows_only = _rows_only(window)
    result["cost"] = cost_selectors.cost_summary(rows_only)
    result["cost_by_model_day"] = cost_selectors.cost_by_model_day(rows_only)
    for group_by in cost_selectors.GROUPS:
        result[f"costs_by_{group_by}"] = cost_selectors.costs_by(rows_only, group_by=group_by)
    return result


class _RowsWindow(selectors.Window):
    """A window the rollups refuse (as for a half-hour zone), so the cost
    selectors take their row-based path."""


def _rows_only(window):
    return _RowsWindow(first_day=window.first_day, last_day=window.last_day, tz=window.tz)


@pytest.fixture(autouse=True)
def _rows_window_is_not_rolled_up(monkeypatch):
    # The test's own window subclass selects the row-based reading; every
    # real window still goes through selectors.uses_rollups unchanged.
    real = selectors.uses_rollups
    monkeypatch.setattr(selectors, "uses_rollups", lambda w: not isinstance(w, _RowsWindow) and real(w))


def windows(first: dt.date, last: dt.date):
    return [
        selectors.dashboard_window(first_day=first, last_day=last, tz=tz)
        for tz in ("UTC", "Asia/Shanghai", "America/New_York", "Asia/Kolkata")
    ]


# --------------------------------------------------------------------------
# The hand-built world: the same answers before and after the rollups
# --------------------------------------------------------------------------


def test_dashboard_answers_equal_the_row_based_answers_on_the_world_before_and_after_a_rebuild_R_DASH_1(
    user, other_user
):
    build_world(user, other_user)
    cases = windows(D, D) + windows(D - dt.timedelta(days=1), D + dt.timedelta(days=1))
    expected = [figures_from_rows(window) for window in cases]
    # The world's runs were written as rows, never ended through the
    # service: they are counted live from their rows.
    assert not AgentRun.objects.filter(rolled_up_at__isnull=False).exists()
    assert [figures(window) for window in cases] == expected

    call_command("rebuild_rollups", stdout=open("/dev/null", "w"))  # noqa: SIM115
    assert AgentRun.objects.filter(rolled_up_at__isnull=True).count() == 0
    assert rollup_state()[facts.HOUR_TABLE], "the rebuild wrote rollup rows"
    assert [figures(window) for window in cases] == expected
    utc = selectors.dashboard_window(first_day=D, last_day=D)
    overview = figures(utc)["overview"]
    assert overview["runs_by_status"]["completed"] == 1 and overview["tokens"]["total_tokens"] == 48
    assert {r["model"]: r["p95_ms"] for r in selectors.model_latency(utc)}[MODEL_A] == pytest.approx(290.0)
    assert {r["model"] for r in selectors.tokens_by_model_day(utc)} == {MODEL_A, MODEL_B}


def test_a_zone_with_a_half_hour_offset_is_counted_from_the_rows_R_DASH_1():
    assert selectors.uses_rollups(selectors.dashboard_window(first_day=D, last_day=D, tz="Europe/Paris"))
    assert not selectors.uses_rollups(selectors.dashboard_window(first_day=D, last_day=D, tz="Asia/Kolkata"))


# --------------------------------------------------------------------------
# Exactly once
# --------------------------------------------------------------------------


def _completed_run(thread, *, op: str = "lc_run--a", answer: str = "It is sunny.") -> AgentRun:
    run = make_run(thread)
    lease = acquire(run)
    ledger.model_call_start(lease=lease, operation_id=op, sequence=1, started_at=T0)
    ledger.model_call_finish(
        lease=lease,
        operation_id=op,
        content=answer,
        tool_calls=[],
        usage={"input_tokens": 7, "output_tokens": 3, "total_tokens": 10},
        finished_at=T0 + dt.timedelta(seconds=1),
        duration_ms=250,
    )
    state = [StateMessage(kind="human", id=f"human-{run.id}"), StateMessage(kind="ai", id=op, content=answer)]
    run = ledger.run_finish(lease=lease, status="completed", final_state=state)
    return run, lease


def test_a_second_terminal_attempt_or_roll_up_adds_nothing_R_DASH_1(thread):
    run, lease = _completed_run(thread)
    run.refresh_from_db()
    assert run.rolled_up_at is not None
    once = rollup_state()
    assert once[facts.HOUR_TABLE] and once[facts.LATENCY_TABLE]

    assert rollups.run_roll_up(run_id=run.id) is False
    with pytest.raises(RunTerminal):
        ledger.run_finish(lease=lease, status="completed")
    with pytest.raises(RunTerminal):
        ledger.run_finish_fallback(lease=lease, error_type="x", error_message="again")
    assert ledger.run_sweep_expired_leases(now=timezone.now() + dt.timedelta(hours=1)) == []
    assert rollup_state() == once


def _run_rows_updated() -> int:
    """Versions of audit_agentrun rows this transaction has written."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT n_tup_upd FROM pg_stat_xact_user_tables WHERE relname = 'audit_agentrun'")
        return cursor.fetchone()[0]


def test_the_run_end_and_its_roll_up_mark_are_one_write_of_the_run_R_DASH_1(thread):
    # The mark was a second UPDATE of the run in the terminal transaction:
    # a second version of the run row, written to every index of the run
    # table (the mark's column is the predicate of one), at every run's end.
    # The write of the run's end marks it now; the figures follow.
    run = make_run(thread)
    lease = acquire(run)
    ledger.model_call_start(lease=lease, operation_id="lc_run--a", sequence=1, started_at=T0)
    before = _run_rows_updated()
    ledger.run_finish(lease=lease, status="completed")
    assert _run_rows_updated() - before == 1
    run.refresh_from_db()
    assert run.rolled_up_at is not None
    assert rollup_state()[facts.HOUR_TABLE]
    window = selectors.dashboard_window(first_day=T0.date(), last_day=timezone.now().date())
    assert figures(window) == figures_from_rows(window)


@pytest.mark.django_db(transaction=True)
def test_a_rollup_row_held_by_a_frozen_transaction_delays_no_run_end_R_DASH_1(thread, db_name):
    """A worker frozen inside its terminal transaction holds the rollup rows
    of its hour and model. Another run ending in that hour must not wait for
    it (nor fail): it ends at once, unmarked, the dashboard counts it from its
    rows, and the next catch-up round adds it exactly once."""
    import psycopg

    first, _ = _completed_run(thread, op="lc_run--first")
    assert AgentRun.objects.get(pk=first.pk).rolled_up_at is not None
    window = selectors.dashboard_window(first_day=T0.date(), last_day=timezone.now().date())
    with psycopg.connect(dbname=db_name, host="127.0.0.1", user="postgres") as frozen:
        frozen.execute(f"SELECT 1 FROM {facts.HOUR_TABLE} FOR UPDATE")  # held, never committed
        frozen.execute(f"SELECT 1 FROM {facts.LATENCY_TABLE} FOR UPDATE")
        other = Conversation.objects.create(user=thread.user, agent_id="assistant", model=thread.model)
        second, _ = _completed_run(other, op="lc_run--second")
        second.refresh_from_db()
        assert second.status == "completed" and second.rolled_up_at is None
        # Counted from its rows meanwhile: the same answers as from rows.
        assert figures(window) == figures_from_rows(window)
        assert figures(window)["overview"]["runs_by_status"]["completed"] == 2
        # The holder is still there: the catch-up waits no longer than the
        # run's end did, and leaves the run for the next round.
        assert rollups.rollups_catch_up() == 0
        frozen.rollback()
    assert rollups.rollups_catch_up() == 1
    assert rollups.rollups_catch_up() == 0
    assert AgentRun.objects.get(pk=second.pk).rolled_up_at is not None
    incremental = rollup_state()
    assert figures(window) == figures_from_rows(window)
    rollups.rollups_rebuild()
    assert rollup_state() == incremental


@pytest.mark.django_db(transaction=True)
def test_a_deadlock_over_a_rollup_row_delays_the_run_instead_of_failing_its_end_R_DASH_1(thread, db_name, monkeypatch):
    """With a lock limit above PostgreSQL's deadlock_timeout, a roll-up
    waiting in a cycle of locks gets a deadlock, not the limit: its run's
    end must still commit, with the run left for the catch-up."""
    import threading
    import time

    import psycopg
    from django.db import transaction

    from core.config import get_config

    monkeypatch.setattr(get_config(), "ROLLUP_LOCK_WAIT_MS", 20_000)
    run, _ = _completed_run(thread)
    AgentRun.objects.filter(pk=run.pk).update(rolled_up_at=None)
    with psycopg.connect(dbname=db_name, host="127.0.0.1", user="postgres") as other:
        other.execute(f"SELECT 1 FROM {facts.HOUR_TABLE} FOR UPDATE")  # the rollup rows the run's end adds to
        closing = []

        def close_the_cycle() -> None:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # until the roll-up waits for those rows
                with psycopg.connect(dbname=db_name, host="127.0.0.1", user="postgres", autocommit=True) as probe:
                    if probe.execute("SELECT COUNT(*) FROM pg_locks WHERE NOT granted").fetchone()[0]:
                        break
                time.sleep(0.05)
            try:  # waits for the run row the terminal transaction holds
                other.execute("SELECT 1 FROM audit_agentrun WHERE id = %s FOR UPDATE", [run.pk])
            except psycopg.Error as exc:
                closing.append(exc)

        closer = threading.Thread(target=close_the_cycle)
        with transaction.atomic():
            AgentRun.objects.select_for_update(no_key=True).filter(pk=run.pk).exists()
            closer.start()
            assert rollups.run_roll_up(run_id=run.pk) is False
        closer.join(timeout=60)
        assert not closer.is_alive() and not closing, closing
        other.rollback()
    assert AgentRun.objects.get(pk=run.pk).rolled_up_at is None
    assert rollups.rollups_catch_up() == 1


def test_a_run_that_is_not_terminal_is_not_rolled_up_R_DASH_1(thread):
    run = make_run(thread)
    assert rollups.run_roll_up(run_id=run.id) is False
    run.refresh_from_db()
    assert run.rolled_up_at is None
    state = rollup_state()
    # The thread is counted when it is created (conversations.triggers); the
    # run adds nothing until it ends.
    assert [row[-1] for row in state.pop(facts.THREAD_TABLE)] == [1]
    assert [row[-1] for row in state.pop(facts.THREAD_DAY_TABLE)] == [1]
    assert state == {table: [] for table in state}


def test_feedback_changes_move_the_rollup_counts_R_DASH_1(thread):
    run, _ = _completed_run(thread)
    window = selectors.dashboard_window(tz="UTC")
    feedback, _ = message_feedback_submit(user=thread.user, message_id=run.output_message_id, rating="like")
    assert selectors.feedback_summary(window)["likes"] == 1
    message_feedback_submit(user=thread.user, message_id=run.output_message_id, rating="dislike")
    message_feedback_submit(user=thread.user, message_id=run.output_message_id, rating="dislike")
    assert (selectors.feedback_summary(window)["likes"], selectors.feedback_summary(window)["dislikes"]) == (0, 1)
    before = rollup_state()
    rollups.rollups_rebuild()
    assert rollup_state() == before


# --------------------------------------------------------------------------
# Random histories: incremental rollups == a recomputation
# --------------------------------------------------------------------------


class World:
    """Drives the real services with a seeded generator."""

    def __init__(self, rng: random.Random, threads: list[Conversation]):
        self.rng = rng
        self.threads = threads
        self.interrupted: dict[uuid.UUID, AgentRun] = {}  # thread id -> run waiting for approval
        self.answers: list[AgentRun] = []

    def when(self) -> dt.datetime:
        return T0 + dt.timedelta(minutes=self.rng.randrange(0, 3 * 24 * 60), seconds=self.rng.random())

    def model(self, lease, op: str, seq: int, state: list, *, content: str = "", tool_calls=None, finish=True):
        started = self.when()
        ledger.model_call_start(lease=lease, operation_id=op, sequence=seq, started_at=started)
        if not finish:
            return
        usage = None if self.rng.random() < 0.1 else {"input_tokens": self.rng.randrange(1, 500)}
        if usage:
            usage["output_tokens"] = self.rng.randrange(0, 200)
            usage["total_tokens"] = usage["input_tokens"] + usage["output_tokens"]
        ledger.model_call_finish(
            lease=lease,
            operation_id=op,
            content=content,
            tool_calls=tool_calls or [],
            usage=usage,
            finished_at=started + dt.timedelta(seconds=self.rng.randrange(0, 7200)),
            duration_ms=int(self.rng.lognormvariate(6, 1.5)),
        )
        state.append(StateMessage(kind="ai", id=op, content=content, tool_calls=tool_calls or []))

    def tool(self, lease, call_id: str, seq: int, declared_by: str, *, name: str, finish: bool = True):
        started = self.when()
        ledger.tool_call_start(
            lease=lease,
            tool_call_id=call_id,
            tool_name=name,
            tool_input={"city": "Paris"},
            sequence=seq,
            started_at=started,
            declared_by_operation_id=declared_by,
        )
        if finish:
            status = self.rng.choice(["completed", "completed", "failed"])
            ledger.tool_call_finish(
                lease=lease,
                tool_call_id=call_id,
                status=status,
                content="sunny" if status == "completed" else "unknown city",
                raw_output={"content": "x"},
                finished_at=started + dt.timedelta(milliseconds=5),
                duration_ms=self.rng.randrange(1, 900),
            )

    def step(self, i: int) -> None:
        thread = self.rng.choice(self.threads)
        waiting = self.interrupted.pop(thread.id, None)
        if waiting is not None:
            decision = self.rng.choice(["approve", "reject"])
            run, _ = ledger.run_resume(
                user=thread.user, run_id=waiting.id, request_id=f"resume-{i}", decisions=[{"type": decision}]
            )
        else:
            run = make_run(thread, text=f"turn {i}")
        lease = acquire(run, ttl=60)
        state = [StateMessage(kind="human", id=f"human-{run.id}")]
        op = f"lc_run--{i}"
        outcome = self.rng.choice(["completed", "completed", "tools", "failed", "cancelled", "swept", "fallback"])
        if waiting is None and outcome == "tools" and self.rng.random() < 0.4:
            outcome = "interrupt"
        if outcome == "interrupt":
            call = {"id": f"call_email_{i}", "name": "send_email", "args": EMAIL}
            self.model(lease, op, 1, state, tool_calls=[call])
            ledger.run_finish(lease=lease, status="interrupted", final_state=state, interrupts=INTERRUPT)
            self.interrupted[thread.id] = run
            return
        if outcome == "tools":
            names = [self.rng.choice(["get_weather", "calculator"]) for _ in range(self.rng.randrange(1, 3))]
            calls = [{"id": f"call_{i}_{k}", "name": name, "args": {}} for k, name in enumerate(names)]
            self.model(lease, op, 1, state, tool_calls=calls)
            for k, call in enumerate(calls):
                self.tool(lease, call["id"], 2 + k, op, name=call["name"], finish=self.rng.random() < 0.8)
            self.model(lease, f"{op}b", 9, state, content=f"answer {i}")
            outcome = "completed"
        else:
            self.model(lease, op, 1, state, content=f"answer {i}", finish=outcome != "swept" or self.rng.random() < 0.5)
        if outcome == "completed":
            run = ledger.run_finish(lease=lease, status="completed", final_state=state)
            if run.output_message_id:
                self.answers.append(run)
        elif outcome == "failed":
            ledger.run_finish(lease=lease, status="failed", error_type="model_error")
        elif outcome == "cancelled":
            ledger.run_request_cancel(user=thread.user, run_id=run.id)
            ledger.run_finish(lease=lease, status="cancelled")
        elif outcome == "fallback":
            ledger.run_finish_fallback(lease=lease, error_type="storage_refused", error_message="refused")
        elif outcome == "swept":
            swept = ledger.run_sweep_expired_leases(now=timezone.now() + dt.timedelta(seconds=61))
            assert run.id in swept
        if self.answers and self.rng.random() < 0.5:
            answer = self.rng.choice(self.answers)
            message_feedback_submit(
                user=answer.user, message_id=answer.output_message_id, rating=self.rng.choice(["like", "dislike"])
            )


@pytest.mark.usefixtures("recovery_fail")
@pytest.mark.parametrize("seed", [11])
def test_incremental_rollups_equal_a_recomputation_after_random_histories_R_DASH_1(seed, user, other_user):
    rng = random.Random(seed)
    threads = [
        Conversation.objects.create(user=owner, agent_id="assistant", model=model)
        for owner in (user, other_user)
        for model in ("replay:tool_then_answer", "replay:plain_answer")
    ]
    world = World(rng, threads)
    for i in range(40):
        world.step(i)
    # One run left running: counted live, never in the rollups.
    live_thread = Conversation.objects.create(user=user, agent_id="assistant", model="replay:plain_answer")
    live = make_run(live_thread)
    world.model(acquire(live), "lc_run--live", 1, [], content="streaming")

    incremental = rollup_state()
    assert incremental[facts.HOUR_TABLE]
    cases = windows(T0.date(), T0.date() + dt.timedelta(days=3))
    answers = [figures(window) for window in cases]
    expected = [figures_from_rows(window) for window in cases]
    assert answers == expected

    rollups.rollups_rebuild()
    assert rollup_state() == incremental
    assert [figures(window) for window in cases] == expected
    assert any(figures["cost"]["total_usd"] not in (None, Decimal(0)) for figures in expected)


# --------------------------------------------------------------------------
# The latency sketch
# --------------------------------------------------------------------------


def test_the_latency_sketch_stays_within_its_error_bound_R_DASH_1():
    rng = random.Random(7)
    for _ in range(50):
        values = sorted(int(rng.lognormvariate(rng.uniform(2, 9), rng.uniform(0.1, 2))) + 1 for _ in range(200))
        buckets: dict[int, int] = {}
        for value in values:
            buckets[facts.bucket_of(value)] = buckets.get(facts.bucket_of(value), 0) + 1
        for fraction in (0.5, 0.95):
            exact = selectors.percentile_cont(values, fraction)
            sketch = selectors.sketch_percentile(buckets, fraction)
            assert exact / 2 ** (1 / 8) - 1e-9 <= sketch <= exact * 2 ** (1 / 8) + 1e-9


def test_the_sql_bucket_matches_the_python_bucket_R_DASH_1():
    durations = [0, 1, 2, 3, 7, 8, 100, 1000, 12345, 2**31 - 1]
    with connection.cursor() as cursor:
        expr = facts._latency_branches()[0].keys["bucket"].replace("m.duration_ms", "d")
        cursor.execute(f"SELECT d, {expr} FROM unnest(%s::bigint[]) AS d", [durations])
        assert dict(cursor.fetchall()) == {d: facts.bucket_of(d) for d in durations}


# --------------------------------------------------------------------------
# Day rows and per-user blocks: the same answers as the hour rows and the rows
# --------------------------------------------------------------------------


def _hour_rows_only(window) -> dict:
    """The rollup figures read from the hour rows only, as before the day
    rows existed (every window treated as holding no whole UTC day)."""
    real = selectors.rollup_params

    def no_whole_days(w):
        params = real(w)
        end = params["end"].astimezone(dt.UTC)
        return {
            **params,
            "days_from": end,
            "days_until": end,
            "first_utc_day": end.date(),
            "end_utc_day": end.date(),
            "block_days": [],
            "block_spans": [],
        }

    selectors.rollup_params = no_whole_days
    try:
        return figures(window)
    finally:
        selectors.rollup_params = real


def _day_rows_disagreeing_with_their_hours() -> list:
    """Day rows that are not the sum of their UTC day's hour rows, and
    per-user blocks that are not the sum of their days (both empty when
    the invariant of dashboard.rollups holds)."""
    wrong = []
    with connection.cursor() as cursor:
        for hour_table, day_table in facts.DAY_TABLES.items():
            keys, counters, _ = facts.TABLES[hour_table]
            rest = ", ".join(keys[1:])
            sums = ", ".join(f"SUM({c}) AS {c}" for c in counters)
            one = " WHERE span = 1" if day_table == facts.USER_DAY_TABLE else ""
            cursor.execute(
                f"SELECT * FROM ((SELECT (hour AT TIME ZONE 'UTC')::date AS day, {rest}, {sums} FROM {hour_table}"
                f" GROUP BY 1, {rest}) EXCEPT (SELECT day, {rest}, {', '.join(counters)} FROM {day_table}{one})) a"
                f" UNION ALL SELECT * FROM ((SELECT day, {rest}, {', '.join(counters)} FROM {day_table}{one})"
                f" EXCEPT (SELECT (hour AT TIME ZONE 'UTC')::date AS day, {rest}, {sums} FROM {hour_table}"
                f" GROUP BY 1, {rest})) b"
            )
            wrong += cursor.fetchall()
        counters = ", ".join(f"b.{c}" for c in facts.USER_COUNTERS)
        sums = ", ".join(f"SUM(d.{c})" + ("" if c == "cost_usd" else "::bigint") for c in facts.USER_COUNTERS)
        for span in facts.USER_SPANS[1:]:
            cursor.execute(
                f"SELECT b.day, b.user_id FROM {facts.USER_DAY_TABLE} b CROSS JOIN LATERAL (SELECT ROW({sums}) AS v"
                f" FROM {facts.USER_DAY_TABLE} d WHERE d.span = 1 AND d.user_id = b.user_id"
                " AND d.day >= b.day AND d.day < b.day + %(span)s) s"
                f" WHERE b.span = %(span)s AND ROW({counters}) IS DISTINCT FROM s.v",
                {"span": span},
            )
            wrong += cursor.fetchall()
            # Every day row is inside a block of each span.
            cursor.execute(
                f"SELECT d.day, d.user_id FROM {facts.USER_DAY_TABLE} d WHERE d.span = 1 AND NOT EXISTS"
                f" (SELECT 1 FROM {facts.USER_DAY_TABLE} b WHERE b.span = %(span)s AND b.user_id = d.user_id"
                " AND b.day <= d.day AND d.day < b.day + %(span)s)",
                {"span": span},
            )
            wrong += cursor.fetchall()
    return wrong


@pytest.mark.usefixtures("recovery_fail")
def test_day_rows_and_blocks_answer_as_the_hour_rows_and_the_rows_in_every_window_and_zone_R_DASH_1_R_COST_2(
    user, other_user
):
    """Windows of 1 to 6 days around a random history, in zones ahead of,
    at and behind UTC (London is UTC+0 in the history's November but not
    in summer; Kathmandu's +05:45 is counted from the rows): the figures
    read through the day rows and per-user blocks equal those read from
    the hour rows only (the reading before the day rows) and those
    computed from the audit rows. The day rows are the sums of their hour
    rows, incrementally and after a rebuild."""
    rng = random.Random(23)
    threads = [
        Conversation.objects.create(user=owner, agent_id="assistant", model=model)
        for owner in (user, other_user)
        for model in ("replay:tool_then_answer", "replay:plain_answer")
    ]
    world = World(rng, threads)
    for i in range(30):
        world.step(i)
    state = rollup_state()
    assert state[facts.DAY_TABLE] and state[facts.LATENCY_DAY_TABLE]
    assert {row[1] for row in state[facts.USER_DAY_TABLE]} == set(facts.USER_SPANS)
    assert _day_rows_disagreeing_with_their_hours() == []

    first = T0.date() - dt.timedelta(days=1)
    cases = [
        selectors.dashboard_window(first_day=first + dt.timedelta(days=a), last_day=first + dt.timedelta(days=b), tz=tz)
        for tz in ("UTC", "Europe/London", "Asia/Shanghai", "America/New_York", "Pacific/Kiritimati", "Asia/Kathmandu")
        for a, b in ((0, 5), (1, 1), (1, 3), (2, 2), (0, 2), (2, 5))
    ]
    assert any(sum(selectors.rollup_params(w)["block_spans"]) >= 2 for w in cases if selectors.uses_rollups(w))
    for window in cases:
        answer = figures(window)
        assert answer == _hour_rows_only(window), window
        assert answer == figures_from_rows(window), window

    rollups.rollups_rebuild()
    assert rollup_state() == state
    assert _day_rows_disagreeing_with_their_hours() == []


def test_a_window_reads_day_rows_for_its_whole_utc_days_and_hour_rows_at_its_edges_R_DASH_1():
    utc = selectors.rollup_params(
        selectors.dashboard_window(first_day=dt.date(2026, 11, 1), last_day=dt.date(2026, 11, 30), tz="UTC")
    )
    assert utc["days_from"] == utc["start"] and utc["days_until"] == utc["end"]
    assert sum(utc["block_spans"]) == 30 and len(utc["block_spans"]) <= 2 * len(facts.USER_SPANS)
    shanghai = selectors.rollup_params(
        selectors.dashboard_window(first_day=dt.date(2026, 11, 1), last_day=dt.date(2026, 11, 30), tz="Asia/Shanghai")
    )
    # 2026-11-01 00:00 +08:00 is 10-31 16:00 UTC: 8 edge hours, 29 whole
    # UTC days, then 16 edge hours.
    assert shanghai["days_from"] == dt.datetime(2026, 11, 1, tzinfo=dt.UTC)
    assert shanghai["days_until"] == dt.datetime(2026, 11, 30, tzinfo=dt.UTC)
    assert sum(shanghai["block_spans"]) == 29
    one_day = selectors.rollup_params(
        selectors.dashboard_window(first_day=dt.date(2026, 11, 1), last_day=dt.date(2026, 11, 1), tz="Asia/Shanghai")
    )
    assert one_day["days_from"] == one_day["days_until"] == one_day["end"] and one_day["block_spans"] == []


def test_day_blocks_are_aligned_and_cover_the_days_exactly_R_COST_2():
    rng = random.Random(3)
    for _ in range(300):
        first = dt.date(2026, 1, 1) + dt.timedelta(days=rng.randrange(-800, 800))
        end = first + dt.timedelta(days=rng.randrange(0, 367))
        blocks = facts.day_blocks(first, end)
        day = first
        for start, span in blocks:
            assert start == day and span in facts.USER_SPANS
            assert (start - facts.BLOCK_EPOCH).days % span == 0
            day += dt.timedelta(days=span)
        assert day == end
        for span in facts.USER_SPANS[:-1]:
            assert sum(1 for _, s in blocks if s == span) <= 2
        with connection.cursor() as cursor:
            for start, span in blocks:
                last = f"DATE '{start + dt.timedelta(days=span - 1)}'"
                cursor.execute(f"SELECT {facts._block(last, str(span))}")
                assert cursor.fetchone()[0] == start


def _estimated_unmarked_runs() -> int:
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN (FORMAT JSON) SELECT id FROM audit_agentrun WHERE rolled_up_at IS NULL")
        plan = cursor.fetchone()[0]
    return (plan if isinstance(plan, list) else __import__("json").loads(plan))[0]["Plan"]["Plan Rows"]


def test_a_rebuild_that_marks_many_runs_refreshes_the_planners_statistics_R_DASH_1(thread):
    """The dashboard counts the runs not rolled up yet through their partial
    index; with the statistics of before a rebuild marked them, PostgreSQL
    took them for most of the table and scanned it (seconds per dashboard
    query at 1M audit rows, until autovacuum analysed the table)."""
    with connection.cursor() as cursor:
        cursor.execute(
            """INSERT INTO audit_agentrun (id, request_id, request_fingerprint, turn_id, agent_id, model, input,
                   status, fencing_token, error_type, error_message, trace_id, created_at, started_at,
                   finished_at, updated_at, thread_id, user_id)
               SELECT md5('unmarked' || n)::uuid, 'unmarked-' || n, '', md5('turn-unmarked' || n)::uuid,
                   'assistant', 'replay:plain_answer', '{}', 'completed', 1, '', '', '',
                   now(), now(), now(), now(), %s, %s
               FROM generate_series(1, 2000) n""",
            [str(thread.pk), thread.user_id],
        )
        cursor.execute("ANALYZE audit_agentrun")
    assert _estimated_unmarked_runs() > 1000
    rollups.rollups_rebuild()
    assert not AgentRun.objects.filter(rolled_up_at__isnull=True).exists()
    assert _estimated_unmarked_runs() < 50


def test_the_roll_up_gives_the_transaction_its_lock_limit_back_R_DASH_1(thread):
    """The rollup waits at most ROLLUP_LOCK_WAIT_MS for a rollup row; the
    rest of the terminal transaction keeps the limit it had."""
    from django.db import connection, transaction

    run = make_run(thread)
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL lock_timeout = '7s'")
        assert rollups.run_roll_up(run_id=run.id) is False  # not terminal: nothing to add
        cursor.execute("SELECT current_setting('lock_timeout')")
        assert cursor.fetchone()[0] == "7s"
        cursor.execute("SELECT 1")  # the transaction is usable: the savepoint was released, not left failed


def test_a_failed_lead_statement_rolls_up_nothing_R_DASH_1(thread):
    """The terminal path sends the run's end first in the rollup's round
    trip: when that statement fails, its error is raised and nothing else
    of the round trip ran."""
    from django.db import DataError, transaction

    run, _ = _completed_run(thread)
    before = rollup_state()
    with pytest.raises(DataError), transaction.atomic():
        rollups.run_roll_up(run_id=run.id, lead=("SELECT 1 / %s", [0]))
    assert rollup_state() == before
    with transaction.atomic():
        assert rollups.run_roll_up(run_id=run.id, lead=("SELECT %s", [7])) == (False, [(7,)])  # rolled up already


def _run_rows_read() -> int:
    """Rows of audit_agentrun this transaction has read, by scan or index."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT COALESCE(seq_tup_read, 0) + COALESCE(idx_tup_fetch, 0) FROM pg_stat_xact_user_tables"
            " WHERE relname = 'audit_agentrun'"
        )
        return cursor.fetchone()[0]


def test_marking_a_rebuild_reads_each_run_about_once_R_DASH_1(thread):
    # A batch that searched from the first id again, and joined the whole
    # table to write its runs, read the table once per batch: 4 M runs took
    # the best part of an hour to mark (issue 38). Each batch goes on from
    # the last run of the one before, in creation order.
    runs = 2_000
    AgentRun.objects.bulk_create(
        AgentRun(
            request_id=uuid.uuid4().hex,
            thread=thread,
            user=thread.user,
            agent_id="assistant",
            model=thread.model,
            status=AgentRun.Status.COMPLETED if i % 2 else AgentRun.Status.FAILED,
            finished_at=timezone.now(),
        )
        for i in range(runs)
    )
    running = AgentRun.objects.create(
        request_id=uuid.uuid4().hex, thread=thread, user=thread.user, agent_id="assistant", model=thread.model
    )
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE audit_agentrun")
        # A table of 2,000 runs is read whole more cheaply than through an
        # index, and the planner may do so (a few pages, whatever earlier
        # tests left): what is tested is the order of the batches.
        cursor.execute("SET LOCAL enable_seqscan = off")
    before = _run_rows_read()
    assert rollups.mark_terminal_runs(batch=100) == runs
    read = _run_rows_read() - before
    # Each run read three times (chosen, locked in id order, written), and
    # a little more; a whole-table read per batch is 20 x 2,001.
    assert read < 4 * runs, read
    assert not AgentRun.objects.filter(status__in=AgentRun.TERMINAL_STATUSES, rolled_up_at__isnull=True).exists()
    running.refresh_from_db()
    assert running.rolled_up_at is None
    assert rollups.mark_terminal_runs(batch=100) == 0
