"""Dashboard figures against a hand-built world with known answers
(R-DASH-1, R-READ-4). See :mod:`tests.dashboard.world`."""

from __future__ import annotations

import datetime as dt

import psycopg
import pytest
from django.db import connection

from core.errors import InvalidInput
from dashboard import selectors

from .world import MODEL_A, MODEL_B, D, build_world

pytestmark = pytest.mark.django_db


@pytest.fixture
def world(user, other_user):
    return build_world(user, other_user)


def utc_day():
    return selectors.dashboard_window(first_day=D, last_day=D, tz="UTC")


def test_overview_counts_ordinary_messages_only_R_DASH_1_R_READ_4(world):
    figures = selectors.overview(utc_day())
    assert figures["conversations"] == 2
    assert figures["active_users"] == 2
    # 3 ordinary messages; the 7 audit rows of the same window do not count.
    assert figures["messages"] == 3
    assert figures["runs"] == 2
    assert figures["runs_by_status"]["completed"] == 1
    assert figures["runs_by_status"]["failed"] == 1
    assert figures["runs_by_status"]["pending"] == 0
    assert figures["tokens"] == {"input_tokens": 31, "output_tokens": 17, "total_tokens": 48}


def test_tokens_by_model_and_day_groups_by_one_bound_json_expression_R_DASH_1(world):
    """Runs on PostgreSQL: the model name is an expression that is both
    selected and grouped by. It is the configured model of the call's run,
    as everywhere else, also for a call cut off before the provider named
    its model (never "unknown")."""
    rows = selectors.tokens_by_model_day(utc_day())
    assert [(r["day"], r["model"], r["calls"], r["total_tokens"]) for r in rows] == [
        (D, MODEL_B, 2, 3),
        (D, MODEL_A, 2, 45),
    ]
    assert rows[1]["input_tokens"] == 30 and rows[1]["output_tokens"] == 15


def test_tokens_by_model_day_follows_time_zone_R_DASH_1(world):
    window = selectors.dashboard_window(first_day=D, last_day=D + dt.timedelta(days=1), tz="Asia/Shanghai")
    rows = selectors.tokens_by_model_day(window)
    # Run 2 ran at 20:00 UTC: the next day in Shanghai.
    assert [(r["day"], r["model"]) for r in rows] == [
        (D, MODEL_A),
        (D + dt.timedelta(days=1), MODEL_B),
    ]
    only_d = selectors.dashboard_window(first_day=D, last_day=D, tz="Asia/Shanghai")
    assert selectors.overview(only_d)["messages"] == 2


def test_model_latency_percentiles_of_completed_calls_R_DASH_1(world):
    rows = {r["model"]: r for r in selectors.model_latency(utc_day())}
    assert set(rows) == {MODEL_A, MODEL_B}
    assert rows[MODEL_A]["calls"] == 2
    assert rows[MODEL_B]["calls"] == 1  # the abandoned call has no latency
    assert rows[MODEL_A]["p50_ms"] == pytest.approx(200.0)
    assert rows[MODEL_A]["p95_ms"] == pytest.approx(290.0)
    assert rows[MODEL_B]["p50_ms"] == pytest.approx(200.0)


def test_python_percentiles_match_postgresql_percentile_cont_R_DASH_1():
    """The embedded SQLite default computes latency percentiles in Python;
    they must agree with PostgreSQL's for the same values."""
    values = [400, 100, 250, 90, 3000, 120, 180]
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY v), percentile_cont(0.95) WITHIN GROUP (ORDER BY v)"
            " FROM unnest(%s::int[]) AS v",
            [values],
        )
        p50, p95 = cursor.fetchone()
    assert selectors.percentile_cont(sorted(values), 0.5) == pytest.approx(p50)
    assert selectors.percentile_cont(sorted(values), 0.95) == pytest.approx(p95)
    assert selectors.percentile_cont([7], 0.95) == 7.0


def test_tool_statistics_count_executions_only_R_DASH_1_R_READ_4(world):
    by_tool = {r["tool_name"]: r for r in selectors.tools_by_name(utc_day())}
    # The rejected send_email never started: it is no execution.
    assert set(by_tool) == {"get_weather", "calculator"}
    assert by_tool["get_weather"] == {"tool_name": "get_weather", "executions": 2, "successes": 1, "failures": 1}
    # Interrupted is neither a success nor a failure.
    assert by_tool["calculator"] == {"tool_name": "calculator", "executions": 1, "successes": 0, "failures": 0}
    totals = [sum(r[k] for r in by_tool.values()) for k in ("executions", "successes", "failures")]
    assert totals == [3, 1, 1]


def test_tool_executions_over_time_every_day_present_R_DASH_1(world):
    window = selectors.dashboard_window(first_day=D - dt.timedelta(days=1), last_day=D + dt.timedelta(days=1))
    days = selectors.tools_by_day(window)
    assert [(r["day"], r["executions"], r["successes"], r["failures"]) for r in days] == [
        (D - dt.timedelta(days=1), 0, 0, 0),
        (D, 3, 1, 1),
        (D + dt.timedelta(days=1), 0, 0, 0),
    ]


def test_timeseries_excludes_audit_rows_R_DASH_1_R_READ_4(world):
    (day,) = selectors.timeseries(utc_day())
    assert day == {
        "day": D,
        "conversations": 2,
        "messages": 3,
        "runs": 2,
        "total_tokens": 48,
        "tool_executions": 3,
    }


def test_feedback_excludes_feedback_on_audit_rows_R_DASH_1_R_READ_4(world):
    summary = selectors.feedback_summary(utc_day())
    assert summary == {"likes": 1, "dislikes": 1, "total": 2, "satisfaction_rate": 0.5}
    listed = list(selectors.feedback_list(utc_day()))
    assert [f.rating for f in listed] == ["dislike", "like"]  # newest first
    assert all(f.message_id == world.answer.id for f in listed)
    assert [f.rating for f in selectors.feedback_list(utc_day(), rating="like")] == ["like"]


def test_empty_window_has_no_figures_R_DASH_1(world):
    window = selectors.dashboard_window(first_day=D + dt.timedelta(days=5), last_day=D + dt.timedelta(days=6))
    assert selectors.overview(window)["messages"] == 0
    assert selectors.feedback_summary(window)["satisfaction_rate"] is None
    assert selectors.tokens_by_model_day(window) == []


@pytest.mark.parametrize(
    "kwargs",
    [
        {"tz": "Mars/Olympus"},
        {"first_day": D, "last_day": D - dt.timedelta(days=1)},
        {"first_day": D - dt.timedelta(days=400), "last_day": D},
        {"tz": "posixrules"},
        {"tz": "../etc/passwd"},
        {"last_day": dt.date(1, 1, 1)},
        {"first_day": dt.date(9999, 12, 31)},
    ],
)
def test_bad_window_is_invalid_input_R_READ_6(kwargs):
    with pytest.raises(InvalidInput):
        selectors.dashboard_window(**kwargs)


def _server_side_rows(queryset):
    """Run a QuerySet's SQL with server-side parameter binding (psycopg's
    plain cursor sends ``$n`` placeholders and the values separately), on
    the test connection and inside the test transaction."""
    sql, params = queryset.query.sql_with_params()
    connection.ensure_connection()
    raw = connection.connection
    with psycopg.Cursor(raw) as cursor:
        cursor.execute("SAVEPOINT server_side_probe")
        try:
            cursor.execute(sql, params)
            return cursor.fetchall()
        finally:
            cursor.execute("ROLLBACK TO SAVEPOINT server_side_probe")


def test_json_group_by_works_with_server_side_binding_and_rebuilt_expression_fails_R_DASH_1(world):
    """The selector's query works on PostgreSQL also with server-side
    binding; the negative control rebuilds the JSON key expression for the
    ORDER BY and PostgreSQL refuses it (GroupingError): the same bound
    expression must be used wherever it is grouped."""
    query = selectors.tokens_by_model_day_query(utc_day())
    rows = _server_side_rows(query)
    assert [(r[0], r[2]) for r in rows] == [(MODEL_B, 2), (MODEL_A, 2)]

    class Rebuilt:
        """SELECT and GROUP BY each with their own JSON key placeholder."""

        class query:  # noqa: N801 - quacks like QuerySet.query
            @staticmethod
            def sql_with_params():
                return (
                    'SELECT "metadata" ->> %s, COUNT(*) FROM "conversations_message" GROUP BY "metadata" ->> %s',
                    ("model_name", "model_name"),
                )

    with pytest.raises(psycopg.errors.GroupingError):
        _server_side_rows(Rebuilt)


def test_conversation_counts_read_only_the_replayed_runs_R_DASH_1(user):
    # The scratch thread of a replay (a thread holding a replayed run) is
    # not a conversation; leaving it out read every run of the table (a
    # parallel scan of the whole run table at every overview and time
    # series: 108 ms of 150 at 1 M audit rows). The partial index of the
    # replayed runs (run_replay_thread_idx) gives them by thread.
    import uuid

    from audit.models import AgentRun
    from conversations.models import Conversation

    from .test_rollups import _run_rows_read

    threads = Conversation.objects.bulk_create(
        Conversation(user=user, agent_id="assistant", model=MODEL_A) for _ in range(200)
    )
    AgentRun.objects.bulk_create(
        AgentRun(
            request_id=uuid.uuid4().hex,
            thread=threads[i % len(threads)],
            user=user,
            agent_id="assistant",
            model=MODEL_A,
            status=AgentRun.Status.COMPLETED,
            rolled_up_at=dt.datetime.now(dt.UTC),  # their figures are in the rollups: none is read live
            replay_of=str(uuid.uuid4()) if i == 0 else "",
        )
        for i in range(2_000)
    )
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE audit_agentrun")
    today = dt.datetime.now(dt.UTC).date()
    window = selectors.dashboard_window(first_day=today, last_day=today, tz="UTC")
    before = _run_rows_read()
    assert selectors.overview(window)["conversations"] == 199
    assert sum(row["conversations"] for row in selectors.timeseries(window)) == 199
    # Two statements, each reading the one replayed run (by thread, or once
    # per thread at this size): never the table's 2,000 runs.
    assert _run_rows_read() - before < 2_000 // 2, "the conversation counts read the run table"
