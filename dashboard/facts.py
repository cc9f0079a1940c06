"""The facts of the dashboard rollups (R-DASH-1, R-COST-2): the tables, their
keys and counters, and the one SQL that computes them from the audit rows.

One definition of "the figures of a set of runs" — :func:`facts_sql` — is
shared by the writes and the reads, so they cannot disagree:
:mod:`dashboard.rollups` adds it to the rollup tables (the terminal
roll-up, feedback, the rebuild), and the dashboard (:mod:`dashboard.selectors`,
:mod:`costs.selectors`) adds the figures of the runs not marked yet (active
runs, and runs from before the rollups existed until ``rebuild_rollups``
ran) from their rows with the same SQL, so its answers never depend on
whether a run has been rolled up.

Each hourly table has a per-UTC-day twin (:data:`DAY_TABLES`) with the same
keys and counters, ``day`` in place of ``hour``; the per-user day table also
holds aligned blocks of :data:`USER_SPANS` days (:func:`day_blocks`). The
latency table is a log-bucket sketch (:func:`bucket_of`,
:func:`bucket_value`).

Everything is set-based SQL: each branch (:class:`Branch`) aggregates one
kind of fact with GROUP BY, bucketed by the fact's own timestamp.

Definitions only, nothing here writes: both the ledger (the roll-up) and
the reads (the selectors) import it (docs/architecture.md#layers), so it
may import only the models (:mod:`audit.models`, :mod:`conversations.models`
and its :mod:`conversations.triggers`,
:mod:`dashboard.models`), the foundation (``yuxi_project``), Django and the
standard library.
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass, field

from audit.models import AgentRun, counted_runs_sql
from conversations.triggers import THREAD_DAY_TABLE, THREAD_TABLE, day_of, hour_of

from .models import RUN_STATUS_COLUMNS

LATENCY_BUCKETS = 128
# Four buckets per doubling: bucket i >= 1 is [2**((i-1)/4), 2**(i/4)) ms.
BUCKETS_PER_DOUBLING = 4

HOUR_TABLE = "dashboard_rolluphour"
USER_TABLE = "dashboard_rollupuserhour"
LATENCY_TABLE = "dashboard_rolluplatencyhour"
DAY_TABLE = "dashboard_rollupday"
USER_DAY_TABLE = "dashboard_rollupuserday"
LATENCY_DAY_TABLE = "dashboard_rolluplatencyday"
# Each hourly table of the runs' facts -> its per-UTC-day twin (same keys
# after the first, same counters): what a run's end adds to.
RUN_DAY_TABLES = {HOUR_TABLE: DAY_TABLE, USER_TABLE: USER_DAY_TABLE, LATENCY_TABLE: LATENCY_DAY_TABLE}
# Every hourly table -> its day twin: the runs' and the conversation counts
# (written by the database as threads change, conversations.triggers).
DAY_TABLES = {**RUN_DAY_TABLES, THREAD_TABLE: THREAD_DAY_TABLE}
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
THREAD_KEYS = ("hour", "model", "agent_id")
THREAD_COUNTERS = ("conversations",)


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


_hour = hour_of
_day = day_of


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
    by ``time`` and aggregated into ``counters``. ``of_runs=False``: a fact
    of the threads, no run joined (``source`` and ``where`` say which
    count); only a rebuild computes it (:func:`facts_sql`)."""

    source: str
    time: str
    where: str
    keys: dict[str, str]
    counters: dict[str, str] = field(default_factory=dict)
    of_runs: bool = True


# The runs whose facts are figures: every run but a replay (issue 34). Part of
# every facts_sql, so the terminal roll-up (which still marks a replay rolled
# up, adding nothing), the rebuild and the live figures all leave replays out.
COUNTED_RUNS = counted_runs_sql("r")

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


def _thread_branches() -> list[Branch]:
    return [
        Branch(
            # Conversation.objects.counted(): no replay's scratch thread.
            # From the runs themselves, not the threads' holds_replay flag
            # the triggers follow: a rebuild corrects the flag's counts too.
            source="conversations_conversation c",
            time="c.created_at",
            where=f"NOT EXISTS (SELECT 1 FROM audit_agentrun r WHERE r.thread_id = c.id AND NOT {COUNTED_RUNS})",
            keys={"model": "c.model", "agent_id": "c.agent_id"},
            counters={"conversations": "COUNT(*)"},
            of_runs=False,
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
    THREAD_TABLE: (THREAD_KEYS, THREAD_COUNTERS, _thread_branches),
    THREAD_DAY_TABLE: (_day_keys(THREAD_KEYS), THREAD_COUNTERS, _thread_branches),
}


def facts_sql(
    table: str,
    *,
    runs: str,
    since: str | None = None,
    until: str | None = None,
    only: tuple[str, ...] | None = None,
    threads: bool = False,
) -> str:
    """SELECT of the figures of ``table``'s shape (its key columns then its
    counters, one row per key) for the runs ``r`` that match the SQL
    condition ``runs`` and are counted at all (:data:`COUNTED_RUNS`: no
    replay), counting only facts whose own timestamp is in
    ``[since, until)`` (SQL expressions; ``None``: unbounded), bucketed by
    UTC hour or UTC day as the table's first key says. ``only``
    keeps just these counters (and the branches that feed them).
    ``threads``: the facts of the threads too (the conversation counts,
    which the database keeps as threads change: only a rebuild computes
    them; without it they are no part of any run's figures)."""
    keys, counters, branches = TABLES[table]
    if only is not None:
        counters = tuple(c for c in counters if c in only)
    parts = []
    for branch in branches():
        if only is not None and not set(branch.counters) & set(counters):
            continue
        if not branch.of_runs and not threads:
            continue
        where = [f"({branch.where})", f"{branch.time} IS NOT NULL"]
        if branch.of_runs:
            where = [f"({runs})", COUNTED_RUNS, *where]
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
