"""Maintenance of the dashboard rollups (R-DASH-1, R-COST-2).

One definition of "the figures of a set of runs" — :func:`facts_sql` —
serves three callers, so they cannot disagree:

* :func:`run_roll_up`: inside the run's terminal transaction (run finish,
  its fallback and the lease sweeper all end in
  ``audit.services.terminal._terminate``) one statement marks the run
  ``rolled_up_at`` — only if it is not marked yet — and adds the run's
  figures to the rollup tables (hourly and per UTC day). A second
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
  rows of the marked runs.

Each hourly table has a per-UTC-day twin (:data:`DAY_TABLES`) with the same
keys and counters, ``day`` in place of ``hour``. Every writer adds the same
facts to both, in the same statement (the terminal roll-up, feedback), or
recomputes the day rows as the sum of the day's hour rows (rebuild), so a
day row always equals the sum of the hour rows of its UTC day.

The dashboard adds the figures of the runs not marked yet (active runs,
and runs from before the rollups existed until ``rebuild_rollups`` ran)
from their rows with the same SQL, so its answers never depend on whether
a run has been rolled up.

Everything is set-based SQL: each branch aggregates one kind of fact with
GROUP BY, and INSERT … ON CONFLICT DO UPDATE SET x = x + EXCLUDED.x adds
the deltas.
"""

from __future__ import annotations

import datetime as dt
import logging
import math
from dataclasses import dataclass, field

from django.db import connection

from audit.models import AgentRun

from .models import RUN_STATUS_COLUMNS

log = logging.getLogger(__name__)

GRAIN = "1 hour"
ORIGIN = "TIMESTAMPTZ '2000-01-01 00:00:00+00'"
LATENCY_BUCKETS = 128
# Four buckets per doubling: bucket i >= 1 is [2**((i-1)/4), 2**(i/4)) ms.
BUCKETS_PER_DOUBLING = 4

HOUR_TABLE = "dashboard_rolluphour"
USER_TABLE = "dashboard_rollupuserhour"
LATENCY_TABLE = "dashboard_rolluplatencyhour"
DAY_TABLE = "dashboard_rollupday"
USER_DAY_TABLE = "dashboard_rollupuserday"
LATENCY_DAY_TABLE = "dashboard_rolluplatencyday"
# Each hourly table -> its per-UTC-day twin (same keys after the first,
# same counters).
DAY_TABLES = {HOUR_TABLE: DAY_TABLE, USER_TABLE: USER_DAY_TABLE, LATENCY_TABLE: LATENCY_DAY_TABLE}
# The per-user day table also holds aligned blocks of these many days
# (block starts are multiples of the span after BLOCK_EPOCH): a window's
# whole days are then at most two blocks per span, a few rows per user.
USER_SPANS = (1, 2, 4, 8, 16, 32, 64, 128)
BLOCK_EPOCH = dt.date(1970, 1, 1)

HOUR_KEYS = ("hour", "model", "agent_id", "tool_name")
HOUR_COUNTERS = (
    *RUN_STATUS_COLUMNS,
    "messages",
    "model_calls",
    "input_tokens",
    "output_tokens",
    "total_tokens",
    "unknown_usage_calls",
    "closed_calls",
    "unknown_cost_calls",
    "cost_usd",
    "tool_executions",
    "tool_successes",
    "tool_failures",
    "all_tool_executions",
    "all_tool_successes",
    "all_tool_failures",
    "likes",
    "dislikes",
)
USER_KEYS = ("hour", "user_id")  # conflict target: the (user, hour) key
USER_DAY_KEYS = ("day", "span", "user_id")
USER_COUNTERS = ("user_messages", "closed_calls", "unknown_cost_calls", "cost_usd")
LATENCY_KEYS = ("hour", "model", "bucket")
LATENCY_COUNTERS = ("calls",)

TERMINAL = ", ".join(f"'{status}'" for status in AgentRun.TERMINAL_STATUSES)


def bucket_value(bucket: int) -> float:
    """The value (ms) a latency bucket stands for: 0 for bucket 0, else the
    geometric middle ``2**((i - 0.5)/4)`` of ``[2**((i-1)/4), 2**(i/4))``.
    Every duration of the bucket is within a factor ``2**(1/8)`` of it, so
    a percentile interpolated between two such values is within +9.05 % /
    -8.30 % of the exact ``percentile_cont``."""
    if bucket <= 0:
        return 0.0
    return 2 ** ((bucket - 0.5) / BUCKETS_PER_DOUBLING)


def bucket_of(duration_ms: float) -> int:
    """The latency bucket of a duration in ms (Python twin of the SQL)."""
    if duration_ms < 1:
        return 0
    return min(1 + math.floor(BUCKETS_PER_DOUBLING * math.log2(duration_ms)), LATENCY_BUCKETS - 1)


def hour_bucket(column: str) -> str:
    """The SQL of the UTC hour (its start) holding the timestamp ``column``."""
    return _hour(column)


def _hour(column: str) -> str:
    return f"date_bin('{GRAIN}', {column}, {ORIGIN})"


def _day(column: str) -> str:
    return f"({column} AT TIME ZONE 'UTC')::date"


def _block(day: str, span: str) -> str:
    """The first day of the aligned block of ``span`` days (SQL) holding the
    date ``day`` (SQL); ``mod`` twice: a date before the epoch too (``mod``,
    not ``%``, which a parametrized statement would take for a placeholder)."""
    offset = f"({day} - DATE '{BLOCK_EPOCH.isoformat()}')"
    return f"({day} - mod(mod({offset}, {span}) + {span}, {span}))"


def day_blocks(first: dt.date, end: dt.date) -> list[tuple[dt.date, int]]:
    """The UTC days ``[first, end)`` as aligned blocks ``[(start, span)]``
    of :data:`USER_SPANS` days, largest first from the left: at most two
    blocks per span."""
    blocks = []
    day = first
    while day < end:
        span = USER_SPANS[-1]
        while span > 1 and ((day - BLOCK_EPOCH).days % span or day + dt.timedelta(days=span) > end):
            span //= 2
        blocks.append((day, span))
        day += dt.timedelta(days=span)
    return blocks


def _bucket(grain: str, column: str) -> str:
    """The SQL of the bucket (``hour`` or ``day`` key) a timestamp belongs to."""
    return _hour(column) if grain == "hour" else _day(column)


@dataclass(frozen=True)
class Branch:
    """One kind of fact: rows ``source`` (with run ``r`` joined), bucketed
    by ``time`` and aggregated into ``counters``."""

    source: str
    time: str
    where: str
    keys: dict[str, str]
    counters: dict[str, str] = field(default_factory=dict)


_MODEL = "r.model"
_MODEL_CALL = "m.operation_id IS NOT NULL AND m.role = 'assistant'"
_RUN_MESSAGES = "conversations_message m JOIN audit_agentrun r ON r.id = m.run_id"


def _tokens(key: str) -> str:
    # The same reading as the row-based figures: missing key -> 0.
    return f"COALESCE(SUM(COALESCE((m.usage ->> '{key}')::integer, 0)), 0)"


def _hour_branches() -> list[Branch]:
    hour_keys = {"model": _MODEL, "agent_id": "r.agent_id", "tool_name": "''"}
    return [
        Branch(
            source="audit_agentrun r",
            time="r.created_at",
            where="TRUE",
            keys=hour_keys,
            counters={
                f"runs_{status}": f"COUNT(*) FILTER (WHERE r.status = '{status}')" for status in AgentRun.Status.values
            },
        ),
        Branch(
            source=_RUN_MESSAGES,
            time="m.created_at",
            where="m.message_type = 'text'",
            keys=hour_keys,
            counters={"messages": "COUNT(*)"},
        ),
        Branch(
            source=_RUN_MESSAGES,
            time="m.started_at",
            where=_MODEL_CALL,
            keys=hour_keys,
            counters={
                "model_calls": "COUNT(*)",
                "input_tokens": _tokens("input_tokens"),
                "output_tokens": _tokens("output_tokens"),
                "total_tokens": _tokens("total_tokens"),
                "unknown_usage_calls": "COUNT(*) FILTER (WHERE m.usage IS NULL OR m.usage = 'null'::jsonb)",
            },
        ),
        Branch(
            source=_RUN_MESSAGES,
            time="m.finished_at",
            where=f"{_MODEL_CALL} AND m.execution_status <> 'running'",
            keys=hour_keys,
            counters={
                "closed_calls": "COUNT(*)",
                "unknown_cost_calls": "COUNT(*) FILTER (WHERE m.cost_usd IS NULL)",
                "cost_usd": "COALESCE(SUM(m.cost_usd), 0)",
            },
        ),
        Branch(
            source=_RUN_MESSAGES,
            time="m.started_at",
            where="m.message_type = 'tool_audit'",
            keys={**hour_keys, "tool_name": "m.tool_name"},
            counters={
                "tool_executions": "COUNT(*)",
                "tool_successes": "COUNT(*) FILTER (WHERE m.execution_status = 'completed')",
                # Counted, never derived: running, interrupted and
                # abandoned executions are neither success nor failure.
                "tool_failures": "COUNT(*) FILTER (WHERE m.execution_status = 'failed')",
            },
        ),
        Branch(
            # The same executions once more on the row of no tool, summed
            # over the tools: per-day figures then skip the per-tool rows.
            source=_RUN_MESSAGES,
            time="m.started_at",
            where="m.message_type = 'tool_audit'",
            keys=hour_keys,
            counters={
                "all_tool_executions": "COUNT(*)",
                "all_tool_successes": "COUNT(*) FILTER (WHERE m.execution_status = 'completed')",
                "all_tool_failures": "COUNT(*) FILTER (WHERE m.execution_status = 'failed')",
            },
        ),
        Branch(
            source=f"conversations_messagefeedback f JOIN {_RUN_MESSAGES} ON m.id = f.message_id",
            time="f.created_at",
            where="m.message_type = 'text'",
            keys=hour_keys,
            counters={
                "likes": "COUNT(*) FILTER (WHERE f.rating = 'like')",
                "dislikes": "COUNT(*) FILTER (WHERE f.rating = 'dislike')",
            },
        ),
    ]


def _user_branches() -> list[Branch]:
    keys = {"user_id": "r.user_id"}
    return [
        Branch(
            source=_RUN_MESSAGES,
            time="m.created_at",
            where="m.message_type = 'text' AND m.role = 'user'",
            keys=keys,
            counters={"user_messages": "COUNT(*)"},
        ),
        Branch(
            source=_RUN_MESSAGES,
            time="m.finished_at",
            where=f"{_MODEL_CALL} AND m.execution_status <> 'running'",
            keys=keys,
            counters={
                "closed_calls": "COUNT(*)",
                "unknown_cost_calls": "COUNT(*) FILTER (WHERE m.cost_usd IS NULL)",
                "cost_usd": "COALESCE(SUM(m.cost_usd), 0)",
            },
        ),
    ]


def _latency_branches() -> list[Branch]:
    bucket = (
        "CASE WHEN m.duration_ms < 1 THEN 0 ELSE LEAST("
        f"1 + floor({BUCKETS_PER_DOUBLING} * ln(m.duration_ms::float8) / ln(2.0))::integer, {LATENCY_BUCKETS - 1}) END"
    )
    return [
        Branch(
            source=_RUN_MESSAGES,
            time="m.started_at",
            where=f"{_MODEL_CALL} AND m.execution_status = 'completed' AND m.duration_ms IS NOT NULL",
            keys={"model": _MODEL, "bucket": bucket},
            counters={"calls": "COUNT(*)"},
        )
    ]


def _day_keys(keys: tuple[str, ...]) -> tuple[str, ...]:
    return ("day", *keys[1:])


# table -> (keys, the first one the time bucket; counters; fact branches).
TABLES = {
    HOUR_TABLE: (HOUR_KEYS, HOUR_COUNTERS, _hour_branches),
    USER_TABLE: (USER_KEYS, USER_COUNTERS, _user_branches),
    LATENCY_TABLE: (LATENCY_KEYS, LATENCY_COUNTERS, _latency_branches),
    DAY_TABLE: (_day_keys(HOUR_KEYS), HOUR_COUNTERS, _hour_branches),
    USER_DAY_TABLE: (USER_DAY_KEYS, USER_COUNTERS, _user_branches),
    LATENCY_DAY_TABLE: (_day_keys(LATENCY_KEYS), LATENCY_COUNTERS, _latency_branches),
}


def facts_sql(
    table: str, *, runs: str, since: str | None = None, until: str | None = None, only: tuple[str, ...] | None = None
) -> str:
    """SELECT of the figures of ``table``'s shape (its key columns then its
    counters, one row per key) for the runs ``r`` that match the SQL
    condition ``runs``, counting only facts whose own timestamp is in
    ``[since, until)`` (SQL expressions; ``None``: unbounded), bucketed by
    UTC hour or UTC day as the table's first key says. ``only``
    keeps just these counters (and the branches that feed them)."""
    keys, counters, branches = TABLES[table]
    if only is not None:
        counters = tuple(c for c in counters if c in only)
    parts = []
    for branch in branches():
        if only is not None and not set(branch.counters) & set(counters):
            continue
        where = [f"({runs})", f"({branch.where})", f"{branch.time} IS NOT NULL"]
        if since is not None:
            where.append(f"{branch.time} >= {since}")
        if until is not None:
            where.append(f"{branch.time} < {until}")
        key_exprs = [f"{_bucket(keys[0], branch.time)} AS {keys[0]}"] + [f"{branch.keys[k]} AS {k}" for k in keys[1:]]
        counter_exprs = [f"{branch.counters.get(c, '0')} AS {c}" for c in counters]
        group = ", ".join(str(i + 1) for i in range(len(keys)))
        parts.append(
            f"SELECT {', '.join(key_exprs + counter_exprs)} FROM {branch.source} "
            f"WHERE {' AND '.join(where)} GROUP BY {group}"
        )
    # bigint, not SUM's numeric: unioned with the rollup columns, numeric
    # would turn every rollup row's counters into numeric too.
    sums = "".join(f", SUM({c})" + ("" if c == "cost_usd" else "::bigint") + f" AS {c}" for c in counters)
    group = ", ".join(keys)
    if not parts:  # nothing asked for is fed by a branch
        return f"SELECT {group}{sums} FROM {table} WHERE FALSE GROUP BY {group}"
    # ORDER BY the key: concurrent upserts (two runs ending in the same
    # hour and model) then lock their shared rows in one order, never in a
    # cycle (no deadlock); each waits at most for the other's commit.
    return f"SELECT {group}{sums} FROM ({' UNION ALL '.join(parts)}) facts GROUP BY {group} ORDER BY {group}"


def _upsert_sql(table: str, select: str) -> str:
    keys, counters, _ = TABLES[table]
    columns = ", ".join((*keys, *counters))
    adds = ", ".join(f"{c} = {table}.{c} + EXCLUDED.{c}" for c in counters)
    return f"INSERT INTO {table} ({columns}) {select} ON CONFLICT ({', '.join(keys)}) DO UPDATE SET {adds}"


def _run_roll_up_sql() -> str:
    marked = (
        "UPDATE audit_agentrun SET rolled_up_at = now() "
        f"WHERE id = %(run_id)s AND rolled_up_at IS NULL AND status IN ({TERMINAL}) RETURNING id"
    )
    ctes = [f"marked AS ({marked})"]
    for i, (table, day_table) in enumerate(DAY_TABLES.items()):
        keys, counters, _ = TABLES[table]
        ctes.append(f"f{i} AS MATERIALIZED ({facts_sql(table, runs='r.id IN (SELECT id FROM marked)')})")
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
    return f"WITH {', '.join(ctes)} SELECT COUNT(*) FROM marked"


_RUN_ROLL_UP = _run_roll_up_sql()


def run_roll_up(
    *, run_id, lead: tuple[str, list] | None = None, commit_then: tuple[str, list] | None = None
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
    transaction) is not waited for: the statement is undone to a savepoint,
    the run stays unmarked (the dashboard counts it from its rows) and
    :func:`rollups_catch_up` adds it later; returns False then.

    ``lead`` (``(sql, params)``, prepared, returning rows) is a statement of
    the caller's transaction sent first in the same round trip — the terminal path's
    write of the run's end, which the rollup must follow. With it, returns
    ``(rolled up, lead's rows)``; an error of ``lead`` is raised as it is,
    with nothing rolled up.

    ``commit_then`` (``(sql, params)``, prepared, returning rows): in a
    pooled transaction (:func:`yuxi_project.db.commit_in_pipeline`), the
    transaction is committed in the same round trip, and this statement run
    after the commit, in its own; a third item is returned: its rows, or
    ``None`` when the transaction is Django's (which commits when its
    atomic block ends: nothing is committed here, nothing run after).
    """
    from django.db import Error, OperationalError, transaction

    from yuxi_project.config import get_config
    from yuxi_project.db import commit_in_pipeline, in_transaction, raw_connection

    if not in_transaction():
        with transaction.atomic():
            return run_roll_up(run_id=run_id, lead=lead, commit_then=commit_then)
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
                statement.execute(_RUN_ROLL_UP, {"run_id": run_id}, prepare=True)
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
        if getattr(exc.__cause__, "sqlstate", None) != "55P03":  # lock_not_available
            raise
        log.warning("run %s: a rollup row is held by another transaction; rolled up later", run_id)
        rolled_up = False
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
            " AND r.rolled_up_at IS NOT NULL"
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


def mark_terminal_runs() -> int:
    """Mark every terminal run not marked yet as rolled up (the first step
    of a rebuild, whose day batches then count them). Returns how many."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE audit_agentrun SET rolled_up_at = now() WHERE rolled_up_at IS NULL AND status IN ({TERMINAL})"
        )
        return cursor.rowcount


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
                table, runs="r.rolled_up_at IS NOT NULL", since="%(since)s::timestamptz", until="%(until)s::timestamptz"
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
    creation, message, call or feedback), or ``None`` without runs."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT LEAST((SELECT MIN(created_at) FROM audit_agentrun),"
            " (SELECT MIN(created_at) FROM conversations_message WHERE message_type = 'text'),"
            " (SELECT MIN(started_at) FROM conversations_message WHERE operation_id IS NOT NULL),"
            " (SELECT MIN(finished_at) FROM conversations_message WHERE operation_id IS NOT NULL AND role = 'assistant'),"
            " (SELECT MIN(created_at) FROM conversations_messagefeedback)),"
            " GREATEST((SELECT MAX(created_at) FROM conversations_messagefeedback),"
            " (SELECT MAX(finished_at) FROM conversations_message WHERE operation_id IS NOT NULL AND role = 'assistant'),"
            " (SELECT MAX(started_at) FROM conversations_message WHERE operation_id IS NOT NULL),"
            " (SELECT MAX(created_at) FROM conversations_message WHERE message_type = 'text'),"
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
    dashboard of the database they ran on counted their runs).
    ``progress(day, done, total)`` is called after each day. Returns the
    number of days recomputed (R-DASH-1).
    """
    from django.db import transaction
    from django.utils import timezone

    with transaction.atomic():
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
        with transaction.atomic(), connection.cursor() as cursor:
            for table in TABLES:
                cursor.execute(f"DELETE FROM {table}")
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
    return len(days)
