"""Active users counted from the links of their active days (R-DASH-1,
dashboard.triggers): the links the database keeps equal a recomputation
after any statement on the per-user day rows, two transactions changing
one user's days link them as one would, the dashboard's answer equals the
row-based one in every window and zone, and it reads a few rows per day
of the window whatever the number of users (the probe of each user it
replaces was O(users): 6.3 ms at 501 users, 14.8 ms at 2,001)."""

from __future__ import annotations

import datetime as dt
import importlib
import random
import threading
import time
import types

import pytest
from django.contrib.auth import get_user_model
from django.db import connection

from audit import ledger
from conversations.models import Conversation, Message
from dashboard import facts, rollups, selectors
from dashboard.triggers import ACTIVE_DAY_TABLE, ACTIVE_HOUR_TABLE
from tests.conftest import acquire, make_run

pytestmark = pytest.mark.django_db

# Near now: a rebuild recomputes every day from the first fact to today.
D0 = (dt.datetime.now(dt.UTC) - dt.timedelta(days=12)).date()
H0 = dt.datetime.combine(D0, dt.time.min, tzinfo=dt.UTC)


def _day(n: int) -> dt.date:
    return D0 + dt.timedelta(days=n)


def _hour(n: int) -> dt.datetime:
    return H0 + dt.timedelta(hours=n)


def _links() -> dict[str, list[tuple]]:
    """The link counts the triggers keep: ``{table: [(hour or day, since,
    users)]}``, zeros left out."""
    links = {}
    for table, bucket in ((ACTIVE_HOUR_TABLE, "hour"), (ACTIVE_DAY_TABLE, "day")):
        with connection.cursor() as cursor:
            cursor.execute(f"SELECT {bucket}, since, users FROM {table} WHERE users <> 0 ORDER BY 1, 2 NULLS FIRST")
            links[table] = cursor.fetchall()
    return links


def _recomputed() -> dict[str, list[tuple]]:
    """The link counts as their definition gives them from the hour rows alone."""
    links = (
        "SELECT hour, LAG(hour) OVER (PARTITION BY user_id ORDER BY hour) AS since"
        f" FROM {facts.USER_TABLE} WHERE user_messages > 0"
    )
    day = "(hour AT TIME ZONE 'UTC')::date"
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT hour, since, COUNT(*) FROM ({links}) l GROUP BY 1, 2 ORDER BY 1, 2 NULLS FIRST")
        hours = cursor.fetchall()
        cursor.execute(
            f"SELECT {day}, since, COUNT(*) FROM ({links}) l"
            f" WHERE since IS NULL OR (since AT TIME ZONE 'UTC')::date < {day} GROUP BY 1, 2 ORDER BY 1, 2 NULLS FIRST"
        )
        return {ACTIVE_HOUR_TABLE: hours, ACTIVE_DAY_TABLE: cursor.fetchall()}


def _users(n: int) -> list:
    model = get_user_model()
    return model.objects.bulk_create(model(username=f"active-{i}-{random.random():.12f}") for i in range(n))


def _execute(sql: str, params=None) -> None:
    with connection.cursor() as cursor:
        cursor.execute(sql, params)


def _row(user_id: int, hour: dt.datetime, messages: int) -> str:
    return f"('{hour.isoformat()}'::timestamptz, {user_id}, {messages})"


def _insert(rows: list[str], *, upsert: bool = False) -> None:
    sql = f"INSERT INTO {facts.USER_TABLE} (hour, user_id, user_messages) VALUES {', '.join(rows)}"
    if upsert:
        sql += " ON CONFLICT (user_id, hour) DO UPDATE SET user_messages = EXCLUDED.user_messages"
    _execute(sql)


@pytest.mark.parametrize("seed", [3, 17, 29])
def test_the_links_equal_a_recomputation_after_any_statement_on_the_hour_rows_R_DASH_1(seed):
    # Statements of many rows, hours out of order and across midnight, an
    # hour made inactive and active again: after each one the link counts
    # are what a recomputation from the rows gives.
    rng = random.Random(seed)
    users = [user.pk for user in _users(4)]
    for _ in range(40):
        kind = rng.choice(["insert", "upsert", "update", "delete"])
        if kind in ("insert", "upsert"):
            # One row per (user, hour): a statement may not upsert a row twice.
            keys = sorted({(rng.choice(users), _hour(rng.randrange(96))) for _ in range(rng.randrange(1, 6))})
            if kind == "insert":
                _execute(
                    f"DELETE FROM {facts.USER_TABLE} WHERE (user_id, hour) IN ("
                    + ", ".join(f"({u}, '{h.isoformat()}'::timestamptz)" for u, h in keys)
                    + ")"
                )
            _insert([_row(u, h, rng.choice([0, 1, 3])) for u, h in keys], upsert=True)
        elif kind == "update":
            first = rng.randrange(96)
            _execute(
                f"UPDATE {facts.USER_TABLE} SET user_messages = %s WHERE user_id = ANY(%s) AND hour >= %s AND hour < %s",
                [rng.choice([0, 2]), rng.sample(users, 2), _hour(first), _hour(first + rng.randrange(1, 30))],
            )
        else:
            first = rng.randrange(96)
            _execute(
                f"DELETE FROM {facts.USER_TABLE} WHERE user_id = %s AND hour >= %s AND hour < %s",
                [rng.choice(users), _hour(first), _hour(first + rng.randrange(1, 20))],
            )
        assert _links() == _recomputed(), kind
    assert _links()[ACTIVE_DAY_TABLE]


def test_an_hour_between_two_active_hours_relinks_the_next_one_R_DASH_1():
    (user,) = _users(1)
    _insert([_row(user.pk, _hour(3), 1), _row(user.pk, _hour(30), 1)])
    assert _links() == {
        ACTIVE_HOUR_TABLE: [(_hour(3), None, 1), (_hour(30), _hour(3), 1)],
        ACTIVE_DAY_TABLE: [(_day(0), None, 1), (_day(1), _hour(3), 1)],
    }
    _insert([_row(user.pk, _hour(26), 2)])  # day 1, before hour 30: now the day's first
    assert _links() == {
        ACTIVE_HOUR_TABLE: [(_hour(3), None, 1), (_hour(26), _hour(3), 1), (_hour(30), _hour(26), 1)],
        ACTIVE_DAY_TABLE: [(_day(0), None, 1), (_day(1), _hour(3), 1)],
    }
    _execute(f"UPDATE {facts.USER_TABLE} SET user_messages = 0 WHERE hour = %s", [_hour(3)])
    assert _links() == {
        ACTIVE_HOUR_TABLE: [(_hour(26), None, 1), (_hour(30), _hour(26), 1)],
        ACTIVE_DAY_TABLE: [(_day(1), None, 1)],
    }
    _execute(f"DELETE FROM {facts.USER_TABLE} WHERE hour = %s", [_hour(26)])
    assert _links() == {ACTIVE_HOUR_TABLE: [(_hour(30), None, 1)], ACTIVE_DAY_TABLE: [(_day(1), None, 1)]}


@pytest.mark.django_db(transaction=True)
def test_two_transactions_activating_hours_of_one_user_link_them_in_order_R_DASH_1(db_name):
    # Each would otherwise see the other's hour missing and link both to
    # the user's earlier hour: the user would count twice in hours 5..30.
    # (Hours of different days: no link row is written by both.)
    import psycopg

    (user,) = _users(1)
    _insert([_row(user.pk, _hour(3), 1)])
    insert = f"INSERT INTO {facts.USER_TABLE} (hour, user_id, user_messages) VALUES "
    first = psycopg.connect(dbname=db_name, host="127.0.0.1", user="postgres")
    second = psycopg.connect(dbname=db_name, host="127.0.0.1", user="postgres")
    try:
        first.execute(insert + _row(user.pk, _hour(5), 1))
        errors = []

        def later() -> None:
            try:
                second.execute(insert + _row(user.pk, _hour(30), 1))
                second.commit()
            except Exception as exc:  # reported below
                errors.append(exc)

        waiter = threading.Thread(target=later)
        waiter.start()
        deadline = time.monotonic() + 60
        while waiter.is_alive():  # until the second waits for the first (or, unlocked, is done)
            with connection.cursor() as cursor:
                cursor.execute("SELECT COUNT(*) FROM pg_locks WHERE NOT granted")
                if cursor.fetchone()[0]:
                    break
            assert time.monotonic() < deadline, "the second transaction neither waited nor ended"
            time.sleep(0.05)
        first.commit()
        waiter.join(timeout=60)
        assert not waiter.is_alive() and not errors, errors
    finally:
        first.close()
        second.close()
    hours = [(_hour(3), None, 1), (_hour(5), _hour(3), 1), (_hour(30), _hour(5), 1)]
    assert _links()[ACTIVE_HOUR_TABLE] == hours
    assert _links() == _recomputed()


def _message(user, at: dt.datetime, *, finish: bool = True) -> None:
    """A turn of ``user`` whose message was written at ``at``, its run
    ended (rolled up in its terminal transaction) unless ``finish`` is
    false (counted live)."""
    thread = Conversation.objects.create(user=user, agent_id="assistant", model="replay:plain_answer")
    run = make_run(thread)
    Message.objects.filter(run=run, role=Message.Role.USER).update(created_at=at)
    lease = acquire(run)
    if finish:
        ledger.run_finish(lease=lease, status="failed", error_type="model_error")


def test_active_users_equal_the_row_based_count_in_every_window_and_zone_R_DASH_1():
    # Days written out of order, hours near midnight (the edges of a
    # zone's days), users back after gaps, runs still going.
    rng = random.Random(5)
    users = _users(6)
    for i in range(36):
        at = dt.datetime.combine(_day(rng.randrange(8)), dt.time(rng.choice([0, 3, 15, 16, 23])), tzinfo=dt.UTC)
        _message(rng.choice(users), at + dt.timedelta(minutes=rng.randrange(60)), finish=i % 9 != 4)
    assert _links() == _recomputed()
    assert len(_links()[ACTIVE_DAY_TABLE]) > 6
    checked = 0
    for tz in ("UTC", "Asia/Shanghai", "America/New_York"):
        for first in range(-1, 9):
            for last in range(first, 9):
                window = selectors.dashboard_window(first_day=_day(first), last_day=_day(last), tz=tz)
                assert selectors.uses_rollups(window)
                expected = selectors.overview_from_rows(window)["active_users"]
                assert selectors.overview(window)["active_users"] == expected, (tz, first, last)
                checked += expected > 1
    assert checked > 50


def _explained(window) -> dict:
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + selectors._ACTIVE_USERS, selectors.rollup_params(window))
        return cursor.fetchone()[0][0]["Plan"]


def _rows_of(plan: dict, relation: str) -> int:
    """Rows the plan's scans of ``relation`` read (returned or filtered
    out), over all their loops."""
    own = 0
    if plan.get("Relation Name") == relation:
        own = (plan.get("Actual Rows", 0) + plan.get("Rows Removed by Filter", 0)) * plan.get("Actual Loops", 1)
    return own + sum(_rows_of(child, relation) for child in plan.get("Plans", []))


def _relations(plan: dict) -> set[str]:
    return {plan.get("Relation Name")} | {name for child in plan.get("Plans", []) for name in _relations(child)}


@pytest.mark.parametrize("tz", ["UTC", "Asia/Shanghai"])
def test_active_users_read_a_few_rows_per_day_whatever_the_users_R_DASH_1(tz):
    # Each user probed in turn, the count grew with the users (2,001 users
    # at 10 M audit rows: 14.8 ms). Now five days of 20 or of 200 users,
    # each active at 02:00 and 14:00, read the same link rows (a few per
    # day or edge hour), and no user.
    window = selectors.dashboard_window(first_day=_day(1), last_day=_day(4), tz=tz)
    read = []
    for users in (20, 180):
        _insert([_row(user.pk, _hour(24 * n + h), 1) for user in _users(users) for n in range(6) for h in (2, 14)])
        plan = _explained(window)
        assert "auth_user" not in _relations(plan)
        assert _rows_of(plan, facts.USER_TABLE) == 0  # no run counted live, no user probed
        read.append(_rows_of(plan, ACTIVE_DAY_TABLE) + _rows_of(plan, ACTIVE_HOUR_TABLE))
    assert read[0] == read[1] <= 3 * 6
    assert selectors.overview(window)["active_users"] == 200


def test_a_run_ending_in_an_hour_its_user_was_active_in_writes_no_link_R_DASH_1(user):
    at = dt.datetime.combine(_day(2), dt.time(10), tzinfo=dt.UTC)
    _message(user, at)
    assert _links() == {ACTIVE_HOUR_TABLE: [(at, None, 1)], ACTIVE_DAY_TABLE: [(_day(2), None, 1)]}
    written = _written()
    _message(user, at + dt.timedelta(minutes=20))
    assert _written() == written
    assert _links() == {ACTIVE_HOUR_TABLE: [(at, None, 1)], ACTIVE_DAY_TABLE: [(_day(2), None, 1)]}


def _written() -> int:
    """Row versions this transaction has written to the link tables and the
    user hour rows' links."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT SUM(n_tup_ins + n_tup_upd) FROM pg_stat_xact_user_tables WHERE relname = ANY(%s)",
            [[ACTIVE_HOUR_TABLE, ACTIVE_DAY_TABLE]],
        )
        return cursor.fetchone()[0] or 0


def test_the_rebuild_and_the_migration_recompute_the_links_R_DASH_1(user, other_user):
    for who, day in ((user, 1), (user, 4), (other_user, 4), (other_user, 6)):
        _message(who, dt.datetime.combine(_day(day), dt.time(12), tzinfo=dt.UTC))
    kept = _links()
    noon = [dt.datetime.combine(_day(n), dt.time(12), tzinfo=dt.UTC) for n in range(7)]
    assert kept[ACTIVE_DAY_TABLE] == [
        (_day(1), None, 1),
        (_day(4), None, 1),
        (_day(4), noon[1], 1),
        (_day(6), noon[4], 1),
    ]
    rollups.rollups_rebuild()
    assert _links() == kept
    # Links that went wrong (written around the triggers) are put right.
    _execute(f"UPDATE {ACTIVE_HOUR_TABLE} SET users = users + 5")
    _execute(f"INSERT INTO {ACTIVE_DAY_TABLE} (day, since, users) VALUES (%s, NULL, 9)", [_day(2)])
    _execute("SET CONSTRAINTS ALL IMMEDIATE")
    _execute(f"ALTER TABLE {facts.USER_TABLE} DISABLE TRIGGER USER")
    _execute(f"UPDATE {facts.USER_TABLE} SET previous_active_hour = NULL")
    _execute(f"ALTER TABLE {facts.USER_TABLE} ENABLE TRIGGER USER")
    rollups.rollups_rebuild()
    assert _links() == kept
    for table in (ACTIVE_HOUR_TABLE, ACTIVE_DAY_TABLE):
        _execute(f"DELETE FROM {table}")
    migration = importlib.import_module("dashboard.migrations.0006_active_user_links")
    migration.fill(None, types.SimpleNamespace(connection=connection))
    assert _links() == kept


def _all_counts() -> dict[str, list[tuple]]:
    """Every row of the link counts, zeros included."""
    rows = {}
    for table, bucket in ((ACTIVE_HOUR_TABLE, "hour"), (ACTIVE_DAY_TABLE, "day")):
        with connection.cursor() as cursor:
            cursor.execute(f"SELECT {bucket}, since, users FROM {table} ORDER BY 1, 2 NULLS FIRST")
            rows[table] = cursor.fetchall()
    return rows


def test_a_new_hour_writes_only_its_net_links_R_DASH_1():
    # Counted first as a user's first hour ("since" NULL) and then moved, a
    # new hour left a row of zero behind and made every first run of an
    # hour, of every user, wait on that one row until the run's commit.
    (user,) = _users(1)
    _insert([_row(user.pk, _hour(3), 1)])
    _insert([_row(user.pk, _hour(5), 1)])  # the same day
    _insert([_row(user.pk, _hour(30), 1)])  # the next day
    _insert([_row(user.pk, _hour(4), 1)])  # between: the next hour relinked
    assert _all_counts() == {
        ACTIVE_HOUR_TABLE: [(_hour(3), None, 1), (_hour(4), _hour(3), 1), (_hour(5), _hour(3), 0)]
        + [(_hour(5), _hour(4), 1), (_hour(30), _hour(5), 1)],
        ACTIVE_DAY_TABLE: [(_day(0), None, 1), (_day(1), _hour(5), 1)],
    }


def _own_locks() -> dict[str, int]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT COUNT(*) FILTER (WHERE locktype = 'advisory'), COUNT(*) FILTER (WHERE relation = %s::regclass"
            " AND mode = 'ShareRowExclusiveLock') FROM pg_locks WHERE pid = pg_backend_pid()",
            [facts.USER_TABLE],
        )
        advisory, table = cursor.fetchone()
    return {"advisory": advisory, "table": table}


@pytest.mark.parametrize("users", [12, 300])
def test_a_statement_flipping_many_users_locks_the_table_not_each_user_R_DASH_1(users):
    # One advisory lock per user of a rebuild's hour or a benchmark's fill
    # would fill the server's shared lock table ("out of shared memory").
    ids = [user.pk for user in _users(users)]
    _insert([_row(u, _hour(h), 1) for u in ids for h in (2, 9)])
    assert _own_locks() == ({"advisory": users, "table": 0} if users <= 256 else {"advisory": 0, "table": 1})
    assert _links() == _recomputed()
    assert _links()[ACTIVE_DAY_TABLE] == [(_day(0), None, users)]


def test_truncating_the_hour_rows_empties_the_counts_R_DASH_1():
    (user,) = _users(1)
    _insert([_row(user.pk, _hour(3), 1), _row(user.pk, _hour(30), 1)])
    _execute("SET CONSTRAINTS ALL IMMEDIATE")
    _execute(f"TRUNCATE {facts.USER_TABLE}")
    assert _all_counts() == {ACTIVE_HOUR_TABLE: [], ACTIVE_DAY_TABLE: []}


def test_links_are_refused_outside_read_committed_R_DASH_1(db_name):
    # Under REPEATABLE READ the relinking would not see hours another
    # transaction committed while it waited for the user's lock.
    import psycopg

    with psycopg.connect(dbname=db_name, host="127.0.0.1", user="postgres") as other:
        other.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        (user_id,) = other.execute(
            "INSERT INTO auth_user (password, is_superuser, username, first_name, last_name, email, is_staff,"
            " is_active, date_joined) VALUES ('!', false, 'rr-user', '', '', '', false, true, now()) RETURNING id"
        ).fetchone()
        with pytest.raises(psycopg.errors.RaiseException, match="READ COMMITTED"):
            other.execute(
                f"INSERT INTO {facts.USER_TABLE} (hour, user_id, user_messages) VALUES {_row(user_id, _hour(1), 1)}"
            )
        other.rollback()
