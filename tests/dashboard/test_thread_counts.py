"""Conversation counts kept by the database (R-DASH-1, conversations.triggers):
every change of a thread moves its hour's count in the same transaction,
a replay's scratch thread is never counted, a rebuild recomputes the same
rows, and the dashboard reads them instead of every thread of its window
(91 of the overview's 110 ms at 10 M audit rows)."""

from __future__ import annotations

import datetime as dt
import importlib
import types

import pytest
from django.db import connection

from audit.models import AgentRun
from conversations.models import Conversation
from dashboard import facts, rollups, selectors
from tests.conftest import make_run

from .test_rollups import rollup_state

pytestmark = pytest.mark.django_db

# Near now: a rebuild recomputes every day from the first fact to today.
HOUR = (dt.datetime.now(dt.UTC) - dt.timedelta(days=4)).replace(hour=14, minute=0, second=0, microsecond=0)


def _counts() -> dict[str, list[tuple]]:
    """The thread rollup rows with a count: ``{table: [(bucket, model, agent, n)]}``."""
    state = rollup_state()
    return {table: state[table] for table in (facts.THREAD_TABLE, facts.THREAD_DAY_TABLE)}


def _thread(user, *, at: dt.datetime = HOUR, model: str = "replay:plain_answer", agent: str = "assistant"):
    thread = Conversation.objects.create(user=user, agent_id=agent, model=model)
    Conversation.objects.filter(pk=thread.pk).update(created_at=at)
    thread.refresh_from_db()
    return thread


def _window(first: dt.date, last: dt.date | None = None, tz: str = "UTC"):
    return selectors.dashboard_window(first_day=first, last_day=last or first, tz=tz)


def _counted_from_rows(window) -> int:
    return Conversation.objects.counted().filter(created_at__gte=window.start, created_at__lt=window.end).count()


def test_a_thread_is_counted_in_its_hour_and_day_as_it_is_written_R_DASH_1(user):
    first = _thread(user)
    _thread(user, at=HOUR + dt.timedelta(minutes=59))
    late = _thread(user, at=HOUR + dt.timedelta(hours=1), agent="researcher")
    assert _counts() == {
        facts.THREAD_TABLE: [
            (HOUR, "replay:plain_answer", "assistant", 2),
            (HOUR + dt.timedelta(hours=1), "replay:plain_answer", "researcher", 1),
        ],
        facts.THREAD_DAY_TABLE: [
            (HOUR.date(), "replay:plain_answer", "assistant", 2),
            (HOUR.date(), "replay:plain_answer", "researcher", 1),
        ],
    }
    # Moved to another day, then deleted: the counts follow.
    Conversation.objects.filter(pk=late.pk).update(created_at=HOUR + dt.timedelta(days=1))
    first.delete()
    assert _counts() == {
        facts.THREAD_TABLE: [
            (HOUR, "replay:plain_answer", "assistant", 1),
            (HOUR + dt.timedelta(days=1), "replay:plain_answer", "researcher", 1),
        ],
        facts.THREAD_DAY_TABLE: [
            (HOUR.date(), "replay:plain_answer", "assistant", 1),
            (HOUR.date() + dt.timedelta(days=1), "replay:plain_answer", "researcher", 1),
        ],
    }
    window = _window(HOUR.date(), HOUR.date() + dt.timedelta(days=1))
    assert selectors.overview(window)["conversations"] == 2 == _counted_from_rows(window)
    assert [day["conversations"] for day in selectors.timeseries(window)] == [1, 1]


def test_threads_written_in_bulk_are_counted_once_per_hour_by_the_statement_R_DASH_1(user):
    # One INSERT of many threads (a bulk import, a benchmark's dataset):
    # counted once per statement, grouped by hour. A trigger per row
    # upserted the same hour row once per thread (577 s for 400,000).
    written = _rows_written(facts.THREAD_TABLE)
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO conversations_conversation (id, user_id, agent_id, model, title, status, created_at,"
            " updated_at) SELECT gen_random_uuid(), %s, 'assistant', 'replay:plain_answer', '', 'active',"
            " %s + i * interval '1 minute', now() FROM generate_series(0, 5999) i",
            [user.id, HOUR],
        )
    assert _rows_written(facts.THREAD_TABLE) - written == 100  # one version per hour, not per thread
    hours = _counts()[facts.THREAD_TABLE]
    assert [(hour, n) for hour, _, _, n in hours] == [(HOUR + dt.timedelta(hours=h), 60) for h in range(100)]
    assert sum(n for *_, n in _counts()[facts.THREAD_DAY_TABLE]) == 6000
    Conversation.objects.filter(created_at__lt=HOUR + dt.timedelta(hours=50)).delete()
    assert sum(n for *_, n in _counts()[facts.THREAD_TABLE]) == 3000
    assert _counts()[facts.THREAD_TABLE][0][0] == HOUR + dt.timedelta(hours=50)


def test_a_thread_holding_a_replayed_run_is_not_counted_and_counted_again_without_it_R_DASH_1(user):
    thread = _thread(user)
    first, second = make_run(thread), make_run(thread)
    AgentRun.objects.filter(pk=first.pk).update(replay_of="recorded-run")
    thread.refresh_from_db()
    assert thread.holds_replay
    assert _counts() == {facts.THREAD_TABLE: [], facts.THREAD_DAY_TABLE: []}
    # A second replayed run of the thread changes nothing; the thread is
    # counted again only when no run of it is a replay.
    AgentRun.objects.filter(pk=second.pk).update(replay_of="recorded-run")
    AgentRun.objects.filter(pk=first.pk).update(replay_of="")
    assert _counts() == {facts.THREAD_TABLE: [], facts.THREAD_DAY_TABLE: []}
    AgentRun.objects.filter(pk=second.pk).update(replay_of="")
    thread.refresh_from_db()
    assert not thread.holds_replay
    assert _counts()[facts.THREAD_TABLE] == [(HOUR, "replay:plain_answer", "assistant", 1)]


def test_two_runs_of_a_thread_marked_by_one_statement_take_it_out_once_R_DASH_1(user):
    # Each run's trigger sees the other marked already: a count of "other
    # replayed runs" would never take the thread out. The flag is set once.
    thread = _thread(user)
    _thread(user)  # counted throughout
    runs = [make_run(thread).pk, make_run(thread).pk]
    AgentRun.objects.filter(pk__in=runs).update(replay_of="recorded-run")
    assert _counts()[facts.THREAD_TABLE] == [(HOUR, "replay:plain_answer", "assistant", 1)]
    AgentRun.objects.filter(pk__in=runs).update(replay_of="")
    assert _counts()[facts.THREAD_TABLE] == [(HOUR, "replay:plain_answer", "assistant", 2)]


def test_the_rebuild_recomputes_the_counts_the_triggers_keep_R_DASH_1(user):
    for minutes in (0, 30, 90, 60 * 26):
        _thread(user, at=HOUR + dt.timedelta(minutes=minutes))
    replayed = _thread(user, at=HOUR + dt.timedelta(minutes=5))
    AgentRun.objects.filter(pk=make_run(replayed).pk).update(replay_of="recorded-run")
    kept = _counts()
    assert sum(row[-1] for row in kept[facts.THREAD_DAY_TABLE]) == 4
    rollups.rollups_rebuild()
    assert _counts() == kept
    # Counts that went wrong (written around the triggers) are put right.
    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE {facts.THREAD_TABLE} SET conversations = conversations + 7")
        cursor.execute(f"UPDATE {facts.THREAD_DAY_TABLE} SET conversations = 0")
    rollups.rollups_rebuild()
    assert _counts() == kept


def test_the_migration_fills_the_flags_and_counts_of_threads_already_there_R_DASH_1(user):
    threads = [_thread(user, at=HOUR + dt.timedelta(minutes=m)) for m in (0, 10, 70)]
    AgentRun.objects.filter(pk=make_run(threads[1]).pk).update(replay_of="recorded-run")
    kept = _counts()
    with connection.cursor() as cursor:  # as before the triggers existed
        cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")
        cursor.execute("ALTER TABLE conversations_conversation DISABLE TRIGGER USER")
        cursor.execute("UPDATE conversations_conversation SET holds_replay = FALSE")
        cursor.execute("ALTER TABLE conversations_conversation ENABLE TRIGGER USER")
        cursor.execute(f"DELETE FROM {facts.THREAD_TABLE}")
        cursor.execute(f"DELETE FROM {facts.THREAD_DAY_TABLE}")
    migration = importlib.import_module("dashboard.migrations.0005_thread_counts_backfill")
    migration.fill(None, types.SimpleNamespace(connection=connection))
    assert Conversation.objects.get(pk=threads[1].pk).holds_replay
    assert _counts() == kept


def _rows_written(table: str) -> int:
    """Row versions this transaction has written to ``table``."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT n_tup_ins + n_tup_upd FROM pg_stat_xact_user_tables WHERE relname = %s", [table])
        return cursor.fetchone()[0]


def _conversation_rows_read() -> int:
    """Rows of conversations_conversation this transaction has read."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT COALESCE(seq_tup_read, 0) + COALESCE(idx_tup_fetch, 0) FROM pg_stat_xact_user_tables"
            " WHERE relname = 'conversations_conversation'"
        )
        return cursor.fetchone()[0]


@pytest.mark.parametrize("tz", ["UTC", "Asia/Shanghai"])
def test_the_dashboard_counts_conversations_without_reading_the_threads_R_DASH_1(user, tz):
    # Counted from the threads, the overview and the time series read every
    # thread of the window: O(threads), 4-7x slower at 10 M audit rows
    # than at 1 M. They read the thread rollups now.
    for minutes in range(0, 60 * 72, 45):
        _thread(user, at=HOUR + dt.timedelta(minutes=minutes))
    window = _window(HOUR.date() - dt.timedelta(days=1), HOUR.date() + dt.timedelta(days=3), tz=tz)
    before = _conversation_rows_read()
    overview, series = selectors.overview(window), selectors.timeseries(window)
    assert _conversation_rows_read() == before
    assert overview["conversations"] == 96 == _counted_from_rows(window)
    by_day = {day["day"]: day["conversations"] for day in series}
    assert sum(by_day.values()) == 96
    assert by_day == {row["day"]: row["conversations"] for row in selectors.timeseries_from_rows(window)}
