"""Maintenance of the dashboard rollups (R-DASH-1, R-COST-2).

The figures of a set of runs are defined once, in :mod:`dashboard.facts`
(:func:`~dashboard.facts.facts_sql`, shared with the dashboard's reads);
this module writes them to the rollup tables for three callers, so they
cannot disagree:

* :func:`run_roll_up`: inside the run's terminal transaction (run finish,
  its fallback and the lease sweeper all end in
  ``audit.ledger.terminal._terminate``) the run is marked ``rolled_up_at``
  — only if it is not marked yet: by the write of the run's end, which
  holds the run locked and sees its mark — and one statement adds the
  run's figures to the rollup tables (hourly and per UTC day). A second
  terminal attempt, a redelivered task or a replayed call finds the mark
  and adds nothing.
  Runs ending in the same hour and model share rollup rows; the terminal
  transaction waits for such a row at most ``ROLLUP_LOCK_WAIT_MS``
  (another run's commit takes milliseconds) and otherwise leaves the run
  unmarked — a worker frozen inside its own terminal transaction never
  holds up the ends of other runs. :func:`rollups_catch_up` (every dispatch
  round on the maintenance queue) adds such runs later; until then the
  dashboard counts them from their rows, like active runs.
* :func:`feedback_changed`: feedback is given after the run ended; its
  like/dislike delta is added to the hour the feedback was created in.
* :func:`rebuild_day`: ``rebuild_rollups`` recomputes one UTC day from the
  rows of the marked runs, and the day's conversation counts from its
  threads (kept between rebuilds by the database itself, as threads change:
  :mod:`conversations.triggers`).

The links of the users' active hours (active users, :mod:`dashboard.triggers`)
follow the per-user hour rows by themselves, whoever writes them; a
rebuild ends by recomputing them all (:func:`rebuild_active_links`).

Every writer adds the same facts to an hourly table and to its per-UTC-day
twin (:data:`~dashboard.facts.DAY_TABLES`), in the same statement (the
terminal roll-up, feedback), or recomputes the day rows as the sum of the
day's hour rows (rebuild), so a day row always equals the sum of the hour
rows of its UTC day.

Everything is set-based SQL: INSERT … ON CONFLICT DO UPDATE SET
x = x + EXCLUDED.x adds the deltas of the facts.
"""

from __future__ import annotations

import datetime as dt
import logging

from django.db import connection

from audit.models import AgentRun

from .facts import (
    _MODEL,
    _RUN_MESSAGES,
    COUNTED_RUNS,
    DAY_TABLE,
    DAY_TABLES,
    HOUR_COUNTERS,
    HOUR_TABLE,
    RUN_DAY_TABLES,
    TABLES,
    USER_COUNTERS,
    USER_DAY_TABLE,
    USER_SPANS,
    _block,
    _bucket,
    _day,
    facts_sql,
)
from .triggers import LINK_COUNTS_SQL, LINKS_REWRITE_SQL, USER_HOUR_TABLE

log = logging.getLogger(__name__)

TERMINAL = ", ".join(f"'{status}'" for status in AgentRun.TERMINAL_STATUSES)


def _upsert_sql(table: str, select: str) -> str:
    keys, counters, _ = TABLES[table]
    columns = ", ".join((*keys, *counters))
    adds = ", ".join(f"{c} = {table}.{c} + EXCLUDED.{c}" for c in counters)
    return f"INSERT INTO {table} ({columns}) {select} ON CONFLICT ({', '.join(keys)}) DO UPDATE SET {adds}"


def _run_roll_up_sql(*, marked_before: bool = False) -> str:
    """The roll-up of run ``%(run_id)s``. It marks the run itself, and adds
    only through that mark; ``marked_before``: the caller's statement
    before it, in its transaction, marked the run (the terminal path's
    write of the run's end), and the figures of ``%(run_id)s`` are added as
    they are."""
    if marked_before:
        ctes, runs, result = [], "r.id = %(run_id)s", "SELECT 1"
    else:
        marked = (
            "UPDATE audit_agentrun SET rolled_up_at = now() "
            f"WHERE id = %(run_id)s AND rolled_up_at IS NULL AND status IN ({TERMINAL}) RETURNING id"
        )
        ctes, runs, result = [f"marked AS ({marked})"], "r.id IN (SELECT id FROM marked)", "SELECT COUNT(*) FROM marked"
    for i, (table, day_table) in enumerate(RUN_DAY_TABLES.items()):
        keys, counters, _ = TABLES[table]
        ctes.append(f"f{i} AS MATERIALIZED ({facts_sql(table, runs=runs)})")
        ctes.append(f"h{i} AS ({_upsert_sql(table, f'SELECT * FROM f{i} ORDER BY {", ".join(keys)}')})")
        # The day rows get the sums of the same hour facts: a day row is
        # the sum of its hour rows by construction (and a block the sum of
        # its days).
        rest = ", ".join(keys[1:])
        sums = ", ".join(f"SUM({c})" + ("" if c == "cost_usd" else "::bigint") for c in counters)
        if day_table == USER_DAY_TABLE:
            spans = f"unnest(ARRAY{list(USER_SPANS)}::smallint[]) AS span"
            day_select = (
                f"SELECT {_block(_day('hour'), 'span')} AS day, span, {rest}, {sums} FROM f{i} CROSS JOIN {spans}"
                f" GROUP BY 1, 2, {rest} ORDER BY 2, 1, {rest}"
            )
        else:
            day_select = f"SELECT {_day('hour')} AS day, {rest}, {sums} FROM f{i} GROUP BY 1, {rest} ORDER BY 1, {rest}"
        ctes.append(f"d{i} AS ({_upsert_sql(day_table, day_select)})")
    return f"WITH {', '.join(ctes)} {result}"


_RUN_ROLL_UP = _run_roll_up_sql()
_RUN_FIGURES = _run_roll_up_sql(marked_before=True)
# Undoes the caller's mark when the figures could not be added.
_UNMARK = "UPDATE audit_agentrun SET rolled_up_at = NULL WHERE id = %s"


def run_roll_up(
    *,
    run_id,
    lead: tuple[str, list] | None = None,
    commit_then: tuple[str, list] | None = None,
    marked_by_lead: bool = False,
) -> bool | tuple[bool, list[tuple]] | tuple[bool, list[tuple], list[tuple] | None]:
    """Add the figures of the terminal run ``run_id`` to the rollups, once.

    One statement (one round trip): marks the run ``rolled_up_at`` where it
    is terminal and not marked yet, and adds its figures to the six
    rollup tables (hourly and per UTC day) only through that mark — so a
    repeated terminal path adds nothing. Must be called inside the terminal transaction, after the
    run's status and rows were written (with the run row locked): the
    figures then commit or roll back with the run's end. Returns whether
    the run was rolled up now (R-DASH-1).

    A rollup row that another transaction holds longer than
    ``ROLLUP_LOCK_WAIT_MS`` (a worker frozen inside its terminal
    transaction), or held in a cycle of locks PostgreSQL breaks as a
    deadlock, is not waited for: the statement is undone to a savepoint,
    the run stays unmarked (the dashboard counts it from its rows) and
    :func:`rollups_catch_up` adds it later; returns False then.

    ``lead`` (``(sql, params)``, prepared, returning rows) is a statement of
    the caller's transaction sent first in the same round trip — the terminal path's
    write of the run's end, which the rollup must follow. With it, returns
    ``(rolled up, lead's rows)``; an error of ``lead`` is raised as it is,
    with nothing rolled up.

    ``marked_by_lead``: ``lead`` itself sets ``rolled_up_at`` of the run,
    which the caller holds locked and knows was not marked (the terminal
    path: its one write of the run's end then also marks it, one version
    of the run row fewer than a mark of its own). The figures are added
    without a further mark; when a held rollup row stops them, the mark is
    undone (``rolled_up_at`` NULL again) and False returned, as above.

    ``commit_then`` (``(sql, params)``, prepared, returning rows): in a
    pooled transaction (:func:`core.db.commit_in_pipeline`), the
    transaction is committed in the same round trip, and this statement run
    after the commit, in its own; a third item is returned: its rows, or
    ``None`` when the transaction is Django's (which commits when its
    atomic block ends: nothing is committed here, nothing run after).
    """
    from django.db import Error, OperationalError, transaction

    from core.config import get_config
    from core.db import commit_in_pipeline, in_transaction, raw_connection

    if marked_by_lead and lead is None:
        raise ValueError("marked_by_lead needs the lead that marks the run")
    if not in_transaction():
        with transaction.atomic():
            return run_roll_up(run_id=run_id, lead=lead, commit_then=commit_then, marked_by_lead=marked_by_lead)
    import psycopg

    wait_ms = get_config().ROLLUP_LOCK_WAIT_MS
    raw = raw_connection()
    led = psycopg.Cursor(raw) if lead is not None else None
    after = psycopg.Cursor(raw) if commit_then is not None else None
    lead_rows = after_rows = None
    try:
        # One round trip (a pipeline): the lead; the savepoint; the lock
        # limit set inside it (so undoing to the savepoint restores it too),
        # the previous one kept in a setting of the transaction; the
        # statement (prepared: planning it took three times its execution,
        # on every run's end); the savepoint released and the previous
        # limit back; the commit and what follows it.
        with connection.wrap_database_errors, psycopg.Cursor(raw) as cursor, psycopg.Cursor(raw) as statement:
            with raw.pipeline():
                if led is not None:
                    led.execute(*lead, prepare=True)
                cursor.execute(f"SAVEPOINT {_SAVEPOINT}")
                cursor.execute(
                    "SELECT set_config(%s, current_setting('lock_timeout'), true), "
                    "set_config('lock_timeout', %s, true)",
                    [_PREVIOUS_LOCK_TIMEOUT, f"{wait_ms}ms"],
                )
                statement.execute(_RUN_FIGURES if marked_by_lead else _RUN_ROLL_UP, {"run_id": run_id}, prepare=True)
                # A commit that follows ends the savepoint and the limit with
                # the transaction: two statements fewer in the round trip.
                committed = after is not None and commit_in_pipeline(raw)
                if committed:
                    after.execute(*commit_then, prepare=True)
                else:
                    cursor.execute(f"RELEASE SAVEPOINT {_SAVEPOINT}")
                    cursor.execute(
                        "SELECT set_config('lock_timeout', current_setting(%s), true)", [_PREVIOUS_LOCK_TIMEOUT]
                    )
            # Fetched once the pipeline ended (its Sync the one round trip).
            if led is not None:
                lead_rows = led.fetchall()
            rolled_up = bool(statement.fetchone()[0])
            if committed:
                after_rows = after.fetchall()
    except Exception as exc:
        if led is not None and lead_rows is None:
            # A pipeline raises the first error at the first fetch, whichever
            # statement it came from: the lead's own result tells.
            if led.pgresult is None or led.pgresult.status != psycopg.pq.ExecStatus.TUPLES_OK:
                raise  # the lead failed: nothing after it ran, no savepoint to undo
            lead_rows = led.fetchall()
        try:
            with connection.wrap_database_errors:
                raw.execute(f"ROLLBACK TO SAVEPOINT {_SAVEPOINT}")
                raw.execute(f"RELEASE SAVEPOINT {_SAVEPOINT}")
            undone = True
        except Error:
            # As an atomic block whose savepoint cannot be undone.
            if connection.in_atomic_block:
                connection.needs_rollback = True
            undone = False
        if not undone or not isinstance(exc, OperationalError):
            raise
        # lock_not_available (the lock limit), deadlock_detected (a limit
        # set above deadlock_timeout): either way a held row, try later.
        if getattr(exc.__cause__, "sqlstate", None) not in ("55P03", "40P01"):
            raise
        log.warning("run %s: a rollup row is held by another transaction; rolled up later", run_id)
        rolled_up = False
        if marked_by_lead:
            with connection.wrap_database_errors:
                raw.execute(_UNMARK, [run_id])
        if after is not None:
            # The commit queued after the failed statement never ran: again.
            with connection.wrap_database_errors:
                with raw.pipeline():
                    committed = commit_in_pipeline(raw)
                    if committed:
                        after.execute(*commit_then, prepare=True)
                if committed:
                    after_rows = after.fetchall()
    finally:
        if led is not None:
            led.close()
        if after is not None:
            after.close()
    if commit_then is not None:
        return rolled_up, lead_rows, after_rows
    return (rolled_up, lead_rows) if lead is not None else rolled_up


# The savepoint of :func:`run_roll_up` (never nested: it calls nothing that
# takes one).
_SAVEPOINT = "run_roll_up"
# Where the transaction keeps the lock limit that the rollup replaces.
_PREVIOUS_LOCK_TIMEOUT = "yuxi.lock_timeout_before_roll_up"


def rollups_catch_up(*, limit: int = 200) -> int:
    """Roll up terminal runs their terminal transaction left unmarked (see
    :func:`run_roll_up`), each in its own short transaction with its run row
    locked (``SKIP LOCKED``: a run a worker holds is left for the next
    round). Served by the partial index of unmarked runs. Returns how many
    were rolled up (R-DASH-1)."""
    from django.db import transaction

    waiting = list(
        AgentRun.objects.filter(rolled_up_at__isnull=True, status__in=AgentRun.TERMINAL_STATUSES)
        .order_by("finished_at")
        .values_list("pk", flat=True)[:limit]
    )
    done = 0
    for run_id in waiting:
        with transaction.atomic():
            locked = AgentRun.objects.select_for_update(no_key=True, skip_locked=True).filter(pk=run_id)
            if locked.exists() and run_roll_up(run_id=run_id):
                done += 1
    return done


def _feedback_delta_sql() -> str:
    # The same delta on the hour row and on the day row, in one statement.
    ctes = []
    for i, (table, grain) in enumerate(((HOUR_TABLE, "hour"), (DAY_TABLE, "day"))):
        select = (
            "SELECT "
            + ", ".join(
                [_bucket(grain, "%(created_at)s::timestamptz"), _MODEL, "r.agent_id", "''"]
                + ["%(likes)s" if c == "likes" else "%(dislikes)s" if c == "dislikes" else "0" for c in HOUR_COUNTERS]
            )
            + f" FROM {_RUN_MESSAGES} WHERE m.id = %(message_id)s AND m.message_type = 'text'"
            f" AND r.rolled_up_at IS NOT NULL AND {COUNTED_RUNS}"
        )
        ctes.append(f"f{i} AS ({_upsert_sql(table, select)} RETURNING 1)")
    return f"WITH {', '.join(ctes)} SELECT (SELECT COUNT(*) FROM f0) + (SELECT COUNT(*) FROM f1)"


_FEEDBACK_DELTA = _feedback_delta_sql()


def feedback_changed(
    *, message_id: int, created_at: dt.datetime, old_rating: str | None, new_rating: str | None
) -> None:
    """Add a feedback change to the rollups: ``old_rating`` (``None``: the
    feedback is new) becomes ``new_rating`` (``None``: removed) on message
    ``message_id``, for feedback created at ``created_at``. Only feedback
    on a rolled-up run's ordinary message counts here; the others are
    counted from their rows. Call it in the transaction that writes the
    feedback (R-DASH-1)."""
    if old_rating == new_rating:
        return
    delta = {"like": 0, "dislike": 0}
    if old_rating in delta:
        delta[old_rating] -= 1
    if new_rating in delta:
        delta[new_rating] += 1
    with connection.cursor() as cursor:
        cursor.execute(
            _FEEDBACK_DELTA,
            {"message_id": message_id, "created_at": created_at, "likes": delta["like"], "dislikes": delta["dislike"]},
        )


#: Runs marked per transaction by :func:`mark_terminal_runs`.
MARK_BATCH = 5000


def mark_terminal_runs(*, batch: int = MARK_BATCH) -> int:
    """Mark every terminal run not marked yet as rolled up (the first step
    of a rebuild, whose day batches then count them). Returns how many.

    ``batch`` runs per transaction, locked in id order, as the other
    writers of many runs lock theirs (a payload purge, an erasure): one
    whole-table ``UPDATE`` locked them in the order it read them, and a
    purge locking its batch in id order deadlocked with it (issue 38).
    Each batch is the next runs in creation order after the last of the
    batch before (keyset over ``(created_at, id)``, index
    ``run_not_rolled_up_idx``, which holds only the runs not marked): a
    batch reads about ``batch`` runs however large the table, and the runs
    of a batch lie together on disk. (A batch that searched from the first
    id again read the table once per batch: the best part of an hour for
    4 M runs; in id order, a random one for UUIDs, each batch touched about
    as many pages as runs: 7,800 runs a second against 10,000 measured on
    a 10 M-row dataset.) A run a concurrent terminal write marks meanwhile
    is left to it. Call it outside a transaction (R-DASH-1)."""
    from django.db import transaction

    if connection.vendor == "postgresql":
        sql = (
            "WITH batch AS (SELECT id, created_at FROM audit_agentrun"
            " WHERE (created_at, id) > (%(after_created)s, %(after_id)s) AND rolled_up_at IS NULL"
            f" AND status IN ({TERMINAL}) ORDER BY created_at, id LIMIT %(batch)s),"
            " locked AS (SELECT id FROM audit_agentrun WHERE id = ANY(ARRAY(SELECT id FROM batch))"
            " AND rolled_up_at IS NULL ORDER BY id FOR NO KEY UPDATE),"
            " marked AS (UPDATE audit_agentrun SET rolled_up_at = CURRENT_TIMESTAMP"
            " WHERE id = ANY(ARRAY(SELECT id FROM locked)) RETURNING 1),"
            " last AS (SELECT created_at, id FROM batch ORDER BY created_at DESC, id DESC LIMIT 1)"
            " SELECT (SELECT COUNT(*) FROM marked), last.created_at, last.id FROM (SELECT 1) one LEFT JOIN last ON TRUE"
        )
        after = {"after_created": "-infinity", "after_id": "00000000-0000-0000-0000-000000000000"}
    else:  # SQLite, the embedded default: one writer at a time, tables of a single machine
        sql = (
            "UPDATE audit_agentrun SET rolled_up_at = CURRENT_TIMESTAMP WHERE id IN ("
            f"SELECT id FROM audit_agentrun WHERE rolled_up_at IS NULL AND status IN ({TERMINAL})"
            " ORDER BY id LIMIT %(batch)s)"
        )
        after = None
    marked = 0
    while True:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(sql, {**(after or {}), "batch": batch})
            if after is None:
                marked += cursor.rowcount
                if cursor.rowcount < batch:
                    return marked
                continue
            count, last_created, last_id = cursor.fetchone()
            marked += count
            if last_id is None:  # nothing left after the last batch
                return marked
            after = {"after_created": last_created, "after_id": last_id}


def rebuild_day(day: dt.date) -> None:
    """Recompute the rollup rows of the UTC day ``day`` from the rows of the
    marked runs, one hour per transaction: delete the hour's rows and
    insert the recomputation. Each hour locks the rollup tables against
    concurrent terminal upserts (SHARE ROW EXCLUSIVE) for as long as its
    recomputation takes — a fraction of a second, well inside a worker's
    lock timeout — so a run ending meanwhile waits and is then added once.
    Then, in one more transaction, the day's day rows and the per-user
    blocks holding it (:func:`rebuild_day_rows`). Call it outside a
    transaction."""
    from django.db import transaction

    start = dt.datetime.combine(day, dt.time.min, tzinfo=dt.UTC)
    for hour in range(24):
        since = start + dt.timedelta(hours=hour)
        with transaction.atomic():
            _rebuild_range(since, since + dt.timedelta(hours=1))
    with transaction.atomic():
        rebuild_day_rows(day)


def _rebuild_range(since: dt.datetime, until: dt.datetime) -> None:
    params = {"since": since, "until": until}
    with connection.cursor() as cursor:
        cursor.execute(f"LOCK TABLE {', '.join(DAY_TABLES)} IN SHARE ROW EXCLUSIVE MODE")
        for table in DAY_TABLES:
            cursor.execute(f"DELETE FROM {table} WHERE hour >= %(since)s AND hour < %(until)s", params)
            select = facts_sql(
                table,
                runs="r.rolled_up_at IS NOT NULL",
                since="%(since)s::timestamptz",
                until="%(until)s::timestamptz",
                threads=True,
            )
            keys, counters, _ = TABLES[table]
            cursor.execute(f"INSERT INTO {table} ({', '.join((*keys, *counters))}) {select}", params)


def rebuild_day_rows(first: dt.date, last: dt.date | None = None) -> None:
    """Recompute the day rows of the UTC days ``first..last`` (default: the
    one day ``first``) as the sums of their hour rows, and the per-user
    blocks holding them as the sums of their halves, with the hour and day
    tables locked against terminal upserts (which write both in one
    statement): a run ending meanwhile waits, then adds its figures to
    both. For one day it reads a day's hour rows and two rows per user and
    span (a short lock). Call it inside a transaction."""
    last = last or first
    params = {
        "first": first,
        "last": last,
        "since": dt.datetime.combine(first, dt.time.min, tzinfo=dt.UTC),
        "until": dt.datetime.combine(last + dt.timedelta(days=1), dt.time.min, tzinfo=dt.UTC),
    }
    with connection.cursor() as cursor:
        cursor.execute(f"LOCK TABLE {', '.join((*DAY_TABLES, *DAY_TABLES.values()))} IN SHARE ROW EXCLUSIVE MODE")
        for hour_table, day_table in DAY_TABLES.items():
            keys, counters, _ = TABLES[hour_table]
            sums = ", ".join(f"SUM({c})" for c in counters)  # numeric; the insert casts back to bigint
            one = " AND span = 1" if day_table == USER_DAY_TABLE else ""
            span = ("span",) if day_table == USER_DAY_TABLE else ()
            cursor.execute(f"DELETE FROM {day_table} WHERE day >= %(first)s AND day <= %(last)s{one}", params)
            cursor.execute(
                f"INSERT INTO {day_table} ({', '.join(('day', *span, *keys[1:], *counters))})"
                f" SELECT {_day('hour')}, {'1, ' if span else ''}{', '.join(keys[1:])}, {sums}"
                f" FROM {hour_table} WHERE hour >= %(since)s AND hour < %(until)s GROUP BY 1, {', '.join(keys[1:])}",
                params,
            )
        # The blocks holding the days: the sums of their halves, bottom up.
        for span in USER_SPANS[1:]:
            first_block, last_block = _block("%(first)s::date", str(span)), _block("%(last)s::date", str(span))
            spans = {**params, "span": span, "half": span // 2}
            cursor.execute(
                f"DELETE FROM {USER_DAY_TABLE} WHERE span = %(span)s AND day >= {first_block} AND day <= {last_block}",
                spans,
            )
            cursor.execute(
                f"INSERT INTO {USER_DAY_TABLE} (day, span, user_id, {', '.join(USER_COUNTERS)})"
                f" SELECT {_block('day', str(span))}, %(span)s, user_id, {', '.join(f'SUM({c})' for c in USER_COUNTERS)}"
                f" FROM {USER_DAY_TABLE} WHERE span = %(half)s AND day >= {first_block}"
                f" AND day < {last_block} + %(span)s GROUP BY 1, user_id",
                spans,
            )


def rebuild_active_links() -> None:
    """Recompute the links of the users' active hours (each hour's
    ``previous_active_hour`` and their counts,
    :class:`~dashboard.models.RollupActiveHour` and
    :class:`~dashboard.models.RollupActiveDay`, kept by the triggers of
    :mod:`dashboard.triggers` as the hour rows change) from the hour rows,
    with them locked against writers: what a rebuild ends with, so links
    gone wrong (written with the triggers disabled) are right again. Three
    passes over the active user hours. Call it inside a transaction."""
    with connection.cursor() as cursor:
        cursor.execute(f"LOCK TABLE {USER_HOUR_TABLE} IN SHARE ROW EXCLUSIVE MODE")
        cursor.execute(LINKS_REWRITE_SQL)
        for table, counts in LINK_COUNTS_SQL.items():
            cursor.execute(f"DELETE FROM {table}")
            cursor.execute(counts)


def clear_outside(first: dt.date, last: dt.date) -> None:
    """Delete rollup rows outside the UTC days ``first..last`` (a full
    rebuild recomputes exactly those days)."""
    since = dt.datetime.combine(first, dt.time.min, tzinfo=dt.UTC)
    until = dt.datetime.combine(last + dt.timedelta(days=1), dt.time.min, tzinfo=dt.UTC)
    with connection.cursor() as cursor:
        for table, day_table in DAY_TABLES.items():
            cursor.execute(f"DELETE FROM {table} WHERE hour < %s OR hour >= %s", [since, until])
            # A block partly inside is recomputed with the days inside.
            end = " + span - 1" if day_table == USER_DAY_TABLE else ""
            cursor.execute(f"DELETE FROM {day_table} WHERE day{end} < %s OR day > %s", [first, last])


def fact_span() -> tuple[dt.date, dt.date] | None:
    """The first and last UTC day that holds a fact of a marked run (run
    creation, message, call or feedback) or a thread's creation, or
    ``None`` without runs and threads."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT LEAST((SELECT MIN(created_at) FROM audit_agentrun),"
            " (SELECT MIN(created_at) FROM conversations_conversation),"
            " (SELECT MIN(created_at) FROM conversations_message WHERE message_type = 'text'),"
            " (SELECT MIN(started_at) FROM conversations_message WHERE operation_id IS NOT NULL),"
            " (SELECT MIN(finished_at) FROM conversations_message WHERE operation_id IS NOT NULL AND role = 'assistant'),"
            " (SELECT MIN(created_at) FROM conversations_messagefeedback)),"
            " GREATEST((SELECT MAX(created_at) FROM conversations_messagefeedback),"
            " (SELECT MAX(finished_at) FROM conversations_message WHERE operation_id IS NOT NULL AND role = 'assistant'),"
            " (SELECT MAX(started_at) FROM conversations_message WHERE operation_id IS NOT NULL),"
            " (SELECT MAX(created_at) FROM conversations_message WHERE message_type = 'text'),"
            " (SELECT MAX(created_at) FROM conversations_conversation),"
            " (SELECT MAX(created_at) FROM audit_agentrun))"
        )
        first, last = cursor.fetchone()
    if first is None:
        return None
    return first.astimezone(dt.UTC).date(), last.astimezone(dt.UTC).date()


def rollups_rebuild(*, since: dt.date | None = None, progress=None) -> int:
    """Recompute the rollups from the audit rows (``rebuild_rollups``).

    Marks every terminal run not marked yet, then recomputes one UTC day
    after another, an hour per transaction and then its day rows
    (:func:`rebuild_day`). Without ``since``: from the first day holding a
    fact to the last, and the rows outside that span are deleted. With
    ``since`` (a UTC day): from it to today, so that the rows of runs
    deleted since then go too — the benchmarks, which delete the runs they
    created, call it with the day they started (found by a newcomer: the
    dashboard of the database they ran on counted their runs). Last, the
    links of the users' active days (:func:`rebuild_active_links`).
    ``progress(day, done, total)`` is called after each day. Returns the
    number of days recomputed (R-DASH-1).
    """
    from django.db import transaction
    from django.utils import timezone

    marked = mark_terminal_runs()
    if marked and connection.vendor == "postgresql":
        # The dashboard reads the runs not rolled up yet through their
        # partial index; with the statistics of before the marking the
        # planner takes them for most of the table and scans it instead
        # (seconds per dashboard query until autovacuum analyses it).
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE audit_agentrun")
    span = fact_span()
    if since is not None:
        today = timezone.now().astimezone(dt.UTC).date()
        first, last = since, max(span[1], today) if span else today
    elif span is None:
        with transaction.atomic():
            with connection.cursor() as cursor:
                for table in TABLES:
                    cursor.execute(f"DELETE FROM {table}")
            rebuild_active_links()
        return 0
    else:
        first, last = span
        with transaction.atomic():
            clear_outside(first, last)
    days = [first + dt.timedelta(days=i) for i in range((last - first).days + 1)]
    for done, day in enumerate(days, start=1):
        rebuild_day(day)
        if progress:
            progress(day, done, len(days))
    with transaction.atomic():
        rebuild_active_links()
    return len(days)
