"""Dashboard figures (R-DASH-1), shared by ``/api/dashboard/...`` and the
admin dashboard page.

Every figure counts through the QuerySet predicates of
:mod:`conversations.models`, so the counting rules are the same as
everywhere else (R-READ-4): message counts and feedback exclude audit rows;
tool statistics count executions (rows with ``started_at``), never
declarations or rejected calls.

Days are calendar days in the caller's time zone; a window is
``[from 00:00, to + 1 day 00:00)`` in that zone.
"""

from __future__ import annotations

import datetime as dt
import functools
import re
import zoneinfo
from dataclasses import dataclass

from django.db import connection, connections
from django.db.models import (
    Aggregate,
    Count,
    F,
    FloatField,
    IntegerField,
    Q,
    Sum,
    TextField,
    Value,
)
from django.db.models.fields.json import KeyTextTransform
from django.db.models.functions import Cast, Coalesce, TruncDate
from django.utils import timezone

from audit.models import AgentRun
from conversations.models import Conversation, Message, MessageFeedback
from core.errors import InvalidInput

from . import facts
from .models import RUN_STATUS_COLUMNS, RollupDay
from .triggers import ACTIVE_DAY_TABLE, ACTIVE_HOUR_TABLE

DEFAULT_DAYS = 30
MAX_DAYS = 366
EARLIEST_DAY = dt.date(1970, 1, 1)
LATEST_DAY = dt.date(9000, 12, 31)
UNKNOWN_MODEL = "unknown"


def models_used() -> list[str]:
    """The configured model names (``Run.model``) of the counted runs in the
    audit, sorted: the model filter of the run list lists these, not every
    model a thread could use (issue 37). Replays are left out: each runs
    under a model name of its own (R-REPLAY-2).

    One query and no ``SELECT DISTINCT`` over the runs table: the models of
    the rolled-up runs come from the per-day rollups (one row per UTC day ×
    model × agent × tool, thousands where the runs are millions), those of
    the runs not rolled up yet — active ones, a few — through the partial
    index of unmarked runs (``run_not_rolled_up_idx``)."""
    rolled_up = RollupDay.objects.order_by().values_list("model", flat=True).distinct()
    not_yet = (
        AgentRun.objects.counted()
        .filter(rolled_up_at__isnull=True)
        .order_by()
        .values_list("model", flat=True)
        .distinct()
    )
    return sorted(rolled_up.union(not_yet))


@dataclass(frozen=True)
class Window:
    """A date range in one time zone: ``start`` inclusive, ``end`` exclusive
    (aware datetimes), plus the zone the days are counted in."""

    first_day: dt.date
    last_day: dt.date
    tz: zoneinfo.ZoneInfo

    @property
    def start(self) -> dt.datetime:
        return dt.datetime.combine(self.first_day, dt.time.min, tzinfo=self.tz)

    @property
    def end(self) -> dt.datetime:
        return dt.datetime.combine(self.last_day + dt.timedelta(days=1), dt.time.min, tzinfo=self.tz)

    def days(self) -> list[dt.date]:
        count = (self.last_day - self.first_day).days + 1
        return [self.first_day + dt.timedelta(days=i) for i in range(count)]


def dashboard_window(*, first_day: dt.date | None = None, last_day: dt.date | None = None, tz: str = "UTC") -> Window:
    """Validate the dashboard's ``from``/``to``/``tz`` parameters.

    ``first_day``/``last_day`` are calendar days (inclusive) in ``tz`` (an
    IANA name such as ``Asia/Shanghai``); missing ones default to the last
    :data:`DEFAULT_DAYS` days ending today in ``tz``. Raises
    :class:`InvalidInput` (422) for an unknown zone, ``from`` after ``to``
    or a range longer than :data:`MAX_DAYS` days (R-READ-6).
    """
    # Only names of the IANA database: PostgreSQL must know the zone too.
    if tz not in _time_zone_names():
        raise InvalidInput(f"unknown time zone {tz!r}", extra={"field": "tz"})
    zone = zoneinfo.ZoneInfo(tz)
    for name, day in (("from", first_day), ("to", last_day)):
        if day is not None and not EARLIEST_DAY <= day <= LATEST_DAY:
            raise InvalidInput(f"'{name}' must be between {EARLIEST_DAY} and {LATEST_DAY}", extra={"field": name})
    today = timezone.now().astimezone(zone).date()
    last_day = last_day or (today if first_day is None else max(today, first_day))
    first_day = first_day or last_day - dt.timedelta(days=DEFAULT_DAYS - 1)
    if first_day > last_day:
        raise InvalidInput("'from' is after 'to'", extra={"field": "from"})
    if (last_day - first_day).days + 1 > MAX_DAYS:
        raise InvalidInput(f"the range is longer than {MAX_DAYS} days", extra={"field": "to"})
    return Window(first_day=first_day, last_day=last_day, tz=zone)


@functools.cache
def _time_zone_names() -> frozenset[str]:
    return frozenset(zoneinfo.available_timezones())


class Percentile(Aggregate):
    """PostgreSQL ``percentile_cont(fraction) WITHIN GROUP (ORDER BY expr)``."""

    function = "percentile_cont"
    template = "%(function)s(%(fraction)s) WITHIN GROUP (ORDER BY %(expressions)s)"
    output_field = FloatField()

    def __init__(self, expression, *, fraction: float, **extra):
        if not 0.0 <= fraction <= 1.0:
            raise ValueError("fraction must be within [0, 1]")
        # A float literal, not a parameter: the fraction is ours, never input.
        super().__init__(expression, fraction=repr(float(fraction)), **extra)


def _json_int(field: str, key: str):
    return Coalesce(Cast(KeyTextTransform(key, field), IntegerField()), Value(0))


def _model_name():
    """The configured model name of the call's run (``replay:plain_answer``,
    ``openai:gpt-4o-mini``): the name threads, runs, the API and the admin
    use, known also for calls cut off before the provider named its model
    (the provider's own name, ``metadata.model_name``, is kept on the row).
    One instance of this expression must be used for both the SELECT and
    the GROUP BY of a query: PostgreSQL only accepts the grouped expression
    in the select list when both are the same expression."""
    return Coalesce(F("run__model"), Value(UNKNOWN_MODEL), output_field=TextField())


def _in(window: Window, field: str) -> Q:
    return Q(**{f"{field}__gte": window.start, f"{field}__lt": window.end})


def overview_from_rows(window: Window) -> dict:
    """Totals of the window (R-DASH-1): ``conversations`` created,
    ``active_users`` (users who wrote an ordinary message), ``messages``
    (ordinary only, audit rows excluded), ``runs`` and ``runs_by_status``
    (``{status: count}`` over the whole run vocabulary), ``tokens``
    (``{input_tokens, output_tokens, total_tokens}`` over model calls)."""
    messages = Message.objects.counted().ordinary().filter(_in(window, "created_at"))
    by_status = dict(
        AgentRun.objects.counted()
        .filter(_in(window, "created_at"))
        .values_list("status")
        .annotate(n=Count("id"))
        .order_by()
        .values_list("status", "n")
    )
    tokens = (
        Message.objects.counted()
        .model_calls()
        .filter(_in(window, "started_at"))
        .aggregate(
            input_tokens=Coalesce(Sum(_json_int("usage", "input_tokens")), 0),
            output_tokens=Coalesce(Sum(_json_int("usage", "output_tokens")), 0),
            total_tokens=Coalesce(Sum(_json_int("usage", "total_tokens")), 0),
        )
    )
    return {
        "conversations": Conversation.objects.counted().filter(_in(window, "created_at")).count(),
        "active_users": messages.filter(role=Message.Role.USER).values("thread__user_id").distinct().count(),
        "messages": messages.count(),
        "runs": sum(by_status.values()),
        "runs_by_status": {status: by_status.get(status, 0) for status in AgentRun.Status.values},
        "tokens": tokens,
    }


def tokens_by_model_day_from_rows(window: Window) -> list[dict]:
    """Token usage of model calls per model and calendar day in the window's
    zone: ``[{model, day, calls, input_tokens, output_tokens, total_tokens}]``
    ordered by day then model. Calls cut off before the provider reported
    usage count as calls with 0 tokens."""
    return list(tokens_by_model_day_query(window))


def tokens_by_model_day_query(window: Window):
    """The QuerySet behind :func:`tokens_by_model_day`. The model and day
    expressions are built once and referred to by alias afterwards (ORDER
    BY "model"), never rebuilt: with server-side parameter binding a
    rebuilt JSON key expression carries new placeholders and PostgreSQL
    rejects it as not grouped (GroupingError)."""
    model = _model_name()  # one bound expression for SELECT and GROUP BY
    day = TruncDate("started_at", tzinfo=window.tz)
    return (
        Message.objects.counted()
        .model_calls()
        .filter(_in(window, "started_at"))
        .values(model=model, day=day)
        .annotate(
            calls=Count("id"),
            input_tokens=Sum(_json_int("usage", "input_tokens")),
            output_tokens=Sum(_json_int("usage", "output_tokens")),
            total_tokens=Sum(_json_int("usage", "total_tokens")),
        )
        .order_by("day", "model")
    )


def model_latency_from_rows(window: Window) -> list[dict]:
    """Latency of completed model calls per model, in ms:
    ``[{model, calls, p50_ms, p95_ms}]`` ordered by model. Percentiles are
    continuous (PostgreSQL's ``percentile_cont``); on the embedded SQLite
    default they are computed the same way in Python."""
    model = _model_name()  # one bound expression for SELECT and GROUP BY
    calls = (
        Message.objects.counted()
        .model_calls()
        .filter(_in(window, "started_at"), execution_status=Message.ExecutionStatus.COMPLETED)
        .exclude(duration_ms__isnull=True)
    )
    if connections[calls.db].vendor != "postgresql":
        durations: dict[str, list[int]] = {}
        for name, duration in calls.values_list(model, "duration_ms"):
            durations.setdefault(name, []).append(duration)
        return [
            {
                "model": name,
                "calls": len(values),
                "p50_ms": percentile_cont(sorted(values), 0.5),
                "p95_ms": percentile_cont(sorted(values), 0.95),
            }
            for name, values in sorted(durations.items())
        ]
    rows = (
        calls.values(model=model)
        .annotate(
            calls=Count("id"),
            p50_ms=Percentile("duration_ms", fraction=0.5),
            p95_ms=Percentile("duration_ms", fraction=0.95),
        )
        .order_by("model")
    )
    return list(rows)


def percentile_cont(ordered: list[float], fraction: float) -> float:
    """The continuous percentile of an ascending, non-empty list, as
    PostgreSQL's ``percentile_cont``: linear between the two nearest ranks."""
    position = fraction * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return float(ordered[low] + (ordered[high] - ordered[low]) * (position - low))


def _tool_counts() -> dict:
    completed, failed = Message.ExecutionStatus.COMPLETED, Message.ExecutionStatus.FAILED
    return {
        "executions": Count("id"),
        "successes": Count("id", filter=Q(execution_status=completed)),
        # Failures are counted, never derived as executions - successes:
        # running, interrupted and abandoned executions are neither.
        "failures": Count("id", filter=Q(execution_status=failed)),
    }


def tools_by_name_from_rows(window: Window) -> list[dict]:
    """Tool executions per tool: ``[{tool_name, executions, successes,
    failures}]`` ordered by executions (most first). Only executions count
    (rows with ``started_at``); a rejected call or a bare declaration is
    never an execution (R-READ-4, R-TA-5)."""
    return list(
        Message.objects.counted()
        .tool_executions()
        .filter(_in(window, "started_at"))
        .values("tool_name")
        .annotate(**_tool_counts())
        .order_by("-executions", "tool_name")
    )


def tools_by_day_from_rows(window: Window) -> list[dict]:
    """Tool executions per calendar day of the window, every day present:
    ``[{day, executions, successes, failures}]``."""
    day = TruncDate("started_at", tzinfo=window.tz)
    found = {
        row["day"]: row
        for row in Message.objects.counted()
        .tool_executions()
        .filter(_in(window, "started_at"))
        .values(day=day)
        .annotate(**_tool_counts())
        .order_by("day")
    }
    empty = {"executions": 0, "successes": 0, "failures": 0}
    return [{**empty, **found.get(day, {}), "day": day} for day in window.days()]


def timeseries_from_rows(window: Window) -> list[dict]:
    """Per calendar day of the window, every day present: ``[{day,
    conversations, messages, runs, total_tokens, tool_executions}]``;
    messages are ordinary messages only (R-READ-4)."""
    series: dict[dt.date, dict] = {
        day: {"day": day, "conversations": 0, "messages": 0, "runs": 0, "total_tokens": 0, "tool_executions": 0}
        for day in window.days()
    }

    def fill(queryset, field: str, name: str, aggregate) -> None:
        day = TruncDate(field, tzinfo=window.tz)
        for row in queryset.filter(_in(window, field)).values(day=day).annotate(value=aggregate).order_by("day"):
            if row["day"] in series:
                series[row["day"]][name] = row["value"] or 0

    fill(Conversation.objects.counted(), "created_at", "conversations", Count("id"))
    fill(Message.objects.counted().ordinary(), "created_at", "messages", Count("id"))
    fill(AgentRun.objects.counted(), "created_at", "runs", Count("id"))
    fill(Message.objects.counted().model_calls(), "started_at", "total_tokens", Sum(_json_int("usage", "total_tokens")))
    fill(Message.objects.counted().tool_executions(), "started_at", "tool_executions", Count("id"))
    return list(series.values())


def feedback_summary_from_rows(window: Window) -> dict:
    """Likes and dislikes of ordinary messages given in the window:
    ``{likes, dislikes, total, satisfaction_rate}``; the rate is
    ``likes / total`` in [0, 1], ``None`` without feedback. Feedback on
    audit rows is excluded (R-READ-4)."""
    like, dislike = MessageFeedback.Rating.LIKE, MessageFeedback.Rating.DISLIKE
    counts = (
        MessageFeedback.objects.counted()
        .ordinary()
        .filter(_in(window, "created_at"))
        .aggregate(likes=Count("id", filter=Q(rating=like)), dislikes=Count("id", filter=Q(rating=dislike)))
    )
    total = counts["likes"] + counts["dislikes"]
    return {**counts, "total": total, "satisfaction_rate": (counts["likes"] / total) if total else None}


def feedback_list(window: Window, *, rating: str | None = None):
    """Feedback on ordinary messages given in the window, newest first, as a
    QuerySet of :class:`MessageFeedback` with message, thread and user
    loaded; ``rating`` (``like``/``dislike``) narrows it. Audit rows never
    appear (R-READ-4). Raises :class:`InvalidInput` for another rating."""
    if rating is not None and rating not in MessageFeedback.Rating.values:
        raise InvalidInput(f"unknown rating {rating!r}", extra={"field": "rating"})
    queryset = (
        MessageFeedback.objects.counted()
        .ordinary()
        .filter(_in(window, "created_at"))
        .select_related("user", "message", "message__thread")
        .order_by("-created_at", "-id")
    )
    if rating:
        queryset = queryset.filter(rating=rating)
    return queryset


def tools_report(window: Window) -> dict:
    """``{by_tool, by_day}``: :func:`tools_by_name` and :func:`tools_by_day`."""
    return {"by_tool": tools_by_name(window), "by_day": tools_by_day(window)}


def models_report(window: Window) -> dict:
    """``{tokens_by_model_day, latency}``: :func:`tokens_by_model_day` and
    :func:`model_latency`."""
    return {"tokens_by_model_day": tokens_by_model_day(window), "latency": model_latency(window)}


# --------------------------------------------------------------------------
# The figures from the rollups (dashboard.models): O(hours × groups) rows.
# Each figure = the rollup rows of the window + the figures of the runs not
# rolled up yet, computed from their rows by the same SQL
# (dashboard.facts.facts_sql), so the answers equal the row-based ones
# above, which stay as the fallback for windows the hourly grain cannot cut.
# --------------------------------------------------------------------------

# Up to this many completed model calls in the window, latency percentiles
# are computed exactly from the rows (one index range scan of at most this
# many calls); above it they come from the latency sketch (error bound in
# dashboard.facts.bucket_value).
EXACT_LATENCY_CALLS = 5000


def uses_rollups(window: Window) -> bool:
    """Whether the window can be read from the hourly rollups: on
    PostgreSQL, when each of its day boundaries in its zone is a whole UTC
    hour (every zone whose offsets are whole hours: UTC, Asia/Shanghai,
    Europe/Paris with its DST, ...). Zones with half- or quarter-hour
    offsets (Asia/Kolkata, Asia/Kathmandu) are counted from the rows."""
    if connection.vendor != "postgresql":
        return False
    for day in [*window.days(), window.last_day + dt.timedelta(days=1)]:
        offset = dt.datetime.combine(day, dt.time.min, tzinfo=window.tz).utcoffset()
        if offset is None or offset.total_seconds() % 3600:
            return False
    return True


def rollup_figures(
    window: Window,
    *,
    table: str = facts.HOUR_TABLE,
    group: dict[str, str] | None = None,
    sums: tuple[str, ...] = (),
    extra: dict[str, str] | None = None,
    having: str = "",
    order: str = "",
    join: str = "",
    where: str = "",
) -> list[dict]:
    """Rows of ``SELECT <group>, SUM(<sums>) … GROUP BY <group>`` over the
    rollup rows of ``table`` in the window plus the live figures of the
    runs not rolled up yet. ``group`` maps output names to SQL over the
    rollup columns (``day`` is the hour's calendar day in the window's
    zone: ``(hour AT TIME ZONE %(tz)s)::date``); counters are summed as
    bigint, ``cost_usd`` as numeric; ``extra`` adds aggregate expressions;
    ``where`` filters the rows (e.g. :data:`NOT_TOOLS`).
    Only for windows :func:`uses_rollups` accepts."""
    sql = rollup_sql(
        window, table=table, group=group, sums=sums, extra=extra, having=having, order=order, join=join, where=where
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, rollup_params(window))
        names = [column.name for column in cursor.description]
        return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]


def rollup_params(window: Window) -> dict:
    """The parameters of :func:`rollup_sql`: the window's ``start`` and
    ``end``, its zone ``tz``, and its whole UTC days ``[days_from,
    days_until)`` (UTC midnights; ``first_utc_day``/``end_utc_day`` the same
    as dates). The hour rows are read only in ``[start, days_from)`` and
    ``[days_until, end)``; a window holding no whole UTC day has
    ``days_from = days_until = end`` (hour rows only). ``block_days`` and
    ``block_spans`` are the whole UTC days as blocks of the per-user day
    table (:func:`dashboard.facts.day_blocks`)."""
    start, end = window.start.astimezone(dt.UTC), window.end.astimezone(dt.UTC)
    days_from = dt.datetime.combine(start.date(), dt.time.min, tzinfo=dt.UTC)
    if days_from < start:
        days_from += dt.timedelta(days=1)
    days_until = dt.datetime.combine(end.date(), dt.time.min, tzinfo=dt.UTC)
    if days_from >= days_until:
        days_from = days_until = end
    blocks = facts.day_blocks(days_from.date(), days_until.date())
    return {
        "start": window.start,
        "end": window.end,
        "tz": window.tz.key,
        "days_from": days_from,
        "days_until": days_until,
        "first_utc_day": days_from.date(),
        "end_utc_day": days_until.date(),
        "block_days": [day for day, _ in blocks],
        "block_spans": [span for _, span in blocks],
    }


# IANA names of UTC itself (offset 0 forever): no need to look at each hour.
_ZONES_AT_UTC = frozenset(
    ["UTC", "Etc/UTC", "Etc/UCT", "UCT", "Etc/Universal", "Universal", "Etc/Zulu", "Zulu", "Etc/GMT", "GMT"]
    + ["Etc/GMT0", "Etc/GMT+0", "Etc/GMT-0", "GMT0", "GMT+0", "GMT-0", "Etc/Greenwich", "Greenwich"]
)


def _utc_days_are_local_days(window: Window) -> bool:
    """Whether every UTC day of the window is one calendar day of its zone
    (the zone's offset is 0 throughout: UTC, or London in winter), so the
    day rows can be grouped by local day."""
    if window.tz.key in _ZONES_AT_UTC:
        return True
    start, end = window.start.astimezone(dt.UTC), window.end.astimezone(dt.UTC)
    hour = start
    while hour < end:  # at most 24 x 366 hours, and only in a zone at +00:00
        if hour.astimezone(window.tz).utcoffset():
            return False
        hour += dt.timedelta(hours=1)
    return True


def rollup_sql(
    window: Window,
    *,
    table: str = facts.HOUR_TABLE,
    group: dict[str, str] | None = None,
    sums: tuple[str, ...] = (),
    extra: dict[str, str] | None = None,
    having: str = "",
    order: str = "",
    join: str = "",
    where: str = "",
) -> str:
    """The SQL of :func:`rollup_figures` (parameters: :func:`rollup_params`).

    The rows read are the hour rows of ``table`` at the window's edges, the
    day rows (:data:`dashboard.facts.DAY_TABLES`) of its whole UTC days,
    each standing as one row at its UTC midnight ``hour``, and the live
    figures. A query that groups by an expression of ``hour`` (a local day)
    reads the day rows only where a UTC day is a local day
    (:func:`_utc_days_are_local_days`); otherwise it reads hour rows only.
    Either way every fact is counted once and the answer is the same."""
    keys, counters, _ = facts.TABLES[table]
    group = group or {}
    # Only the counters this query reads travel through the union, and only
    # the live branches that feed them are planned.
    text = " ".join([*sums, *(extra or {}).values(), having])
    needed = tuple(c for c in counters if re.search(rf"\b{c}\b", text))
    columns = ", ".join((*keys, *needed))
    live = facts.facts_sql(
        table, runs="r.rolled_up_at IS NULL", since="%(start)s::timestamptz", until="%(end)s::timestamptz", only=needed
    )
    condition = f" AND {where}" if where else ""
    selected = [f"{expr} AS {name}" for name, expr in group.items()]
    selected += [f"SUM({c})" + ("" if c == "cost_usd" else "::bigint") + f" AS {c}" for c in sums]
    selected += [f"{expr} AS {name}" for name, expr in (extra or {}).items()]
    per_hour = any(re.search(r"\bhour\b", expr) for expr in group.values())
    if per_hour and not _utc_days_are_local_days(window):
        stored = f"SELECT {columns} FROM {table} WHERE hour >= %(start)s AND hour < %(end)s{condition}"
    else:
        day_table = facts.DAY_TABLES[table]
        day_columns = ", ".join(("(d.day::timestamp AT TIME ZONE 'UTC') AS hour", *keys[1:], *needed))
        days = f"{day_table} d WHERE d.day >= %(first_utc_day)s AND d.day < %(end_utc_day)s"
        if day_table == facts.USER_DAY_TABLE:
            if per_hour:
                days += " AND d.span = 1"
            else:
                # A few aligned blocks per user instead of one row per user
                # and day; each block one range of the key's index: LATERAL
                # with OFFSET 0 (never flattened into a join, which would
                # be planned as a scan of the whole table).
                days = (
                    "unnest(%(block_days)s::date[], %(block_spans)s::smallint[]) b(day, span) CROSS JOIN LATERAL"
                    f" (SELECT * FROM {day_table} d WHERE d.span = b.span AND d.day = b.day OFFSET 0) d WHERE TRUE"
                )
        stored = (
            f"SELECT {columns} FROM {table} WHERE hour >= %(start)s AND hour < %(days_from)s{condition}"
            f" UNION ALL SELECT {day_columns} FROM {days}{condition}"
            f" UNION ALL SELECT {columns} FROM {table} WHERE hour >= %(days_until)s AND hour < %(end)s{condition}"
        )
    sql = (
        f"WITH rows AS ({stored} UNION ALL SELECT {columns} FROM ({live}) live WHERE TRUE{condition})"
        f" SELECT {', '.join(selected)} FROM rows {join}"
    )
    if group:
        sql += " GROUP BY " + ", ".join(str(i + 1) for i in range(len(group)))
    if having:
        sql += f" HAVING {having}"
    if order:
        sql += f" ORDER BY {order}"
    return sql


DAY = "(hour AT TIME ZONE %(tz)s)::date"
# Figures other than tools live on rows with tool_name '': their queries read
# only those (index rollup_tool_hour_idx), never the rows of each tool.
NOT_TOOLS = "tool_name = ''"
RUNS = " + ".join(RUN_STATUS_COLUMNS)


# Active users (dashboard.triggers): each user once, on their first active
# hour of the window, the link of which says they were last active before
# its start. Whole UTC days from the day links, edge hours from the hour
# links: a few rows per day or hour, however many users. Then the users of
# the runs not rolled up yet who were not active in the window's rolled-up
# hours, each probed by its (user, hour) key. The users table is not read.
_ACTIVE_USERS = (
    f"SELECT COALESCE((SELECT SUM(users) FROM {ACTIVE_DAY_TABLE} WHERE day >= %(first_utc_day)s"
    " AND day < %(end_utc_day)s AND (since IS NULL OR since < %(start)s)), 0)"
    f" + COALESCE((SELECT SUM(users) FROM {ACTIVE_HOUR_TABLE} WHERE ((hour >= %(start)s AND hour < %(days_from)s)"
    " OR (hour >= %(days_until)s AND hour < %(end)s)) AND (since IS NULL OR since < %(start)s)), 0)"
    " + (SELECT COUNT(*) FROM (SELECT DISTINCT user_id FROM ("
    + facts.facts_sql(
        facts.USER_TABLE,
        runs="r.rolled_up_at IS NULL",
        since="%(start)s::timestamptz",
        until="%(end)s::timestamptz",
        only=("user_messages",),
    )
    + ") live WHERE user_messages > 0) live"
    f" WHERE NOT EXISTS (SELECT 1 FROM {facts.USER_TABLE} h WHERE h.user_id = live.user_id"
    " AND h.hour >= %(start)s AND h.hour < %(end)s AND h.user_messages > 0))"
)


def overview(window: Window) -> dict:
    """Totals of the window (R-DASH-1): ``conversations`` created,
    ``active_users`` (users who wrote an ordinary message), ``messages``
    (ordinary only, audit rows excluded), ``runs`` and ``runs_by_status``
    (``{status: count}`` over the whole run vocabulary), ``tokens``
    (``{input_tokens, output_tokens, total_tokens}`` over model calls)."""
    if not uses_rollups(window):
        return overview_from_rows(window)
    token_names = ("input_tokens", "output_tokens", "total_tokens")
    (totals,) = rollup_figures(window, sums=(*RUN_STATUS_COLUMNS, "messages", *token_names), where=NOT_TOOLS)
    (conversations,) = rollup_figures(window, table=facts.THREAD_TABLE, sums=("conversations",))
    with connection.cursor() as cursor:
        cursor.execute(_ACTIVE_USERS, rollup_params(window))
        (active_users,) = cursor.fetchone()
    by_status = {status: totals[f"runs_{status}"] or 0 for status in AgentRun.Status.values}
    return {
        "conversations": conversations["conversations"] or 0,
        "active_users": active_users,
        "messages": totals["messages"] or 0,
        "runs": sum(by_status.values()),
        "runs_by_status": by_status,
        "tokens": {name: totals[name] or 0 for name in token_names},
    }


def tokens_by_model_day(window: Window) -> list[dict]:
    """Token usage of model calls per model and calendar day in the window's
    zone: ``[{model, day, calls, input_tokens, output_tokens, total_tokens}]``
    ordered by day then model. Calls cut off before the provider reported
    usage count as calls with 0 tokens."""
    if not uses_rollups(window):
        return tokens_by_model_day_from_rows(window)
    rows = rollup_figures(
        window,
        group={"model": "model", "day": DAY},
        sums=("model_calls", "input_tokens", "output_tokens", "total_tokens"),
        having="SUM(model_calls) > 0",
        order="day, model",
        where=NOT_TOOLS,
    )
    return [
        {
            "model": row["model"],
            "day": row["day"],
            "calls": row["model_calls"],
            "input_tokens": row["input_tokens"],
            "output_tokens": row["output_tokens"],
            "total_tokens": row["total_tokens"],
        }
        for row in rows
    ]


def model_latency(window: Window) -> list[dict]:
    """Latency of completed model calls per model, in ms:
    ``[{model, calls, p50_ms, p95_ms}]`` ordered by model. Continuous
    percentiles (PostgreSQL's ``percentile_cont``): exact from the rows
    when the window holds at most :data:`EXACT_LATENCY_CALLS` completed
    calls; above that, interpolated from the rollups' latency sketch, within
    +9.1 % / -8.3 % of the exact figure (:func:`dashboard.facts.bucket_value`)."""
    if not uses_rollups(window):
        return model_latency_from_rows(window)
    histogram: dict[str, dict[int, int]] = {}
    for row in rollup_figures(
        window, table=facts.LATENCY_TABLE, group={"model": "model", "bucket": "bucket"}, sums=("calls",)
    ):
        if row["calls"]:
            histogram.setdefault(row["model"], {})[row["bucket"]] = row["calls"]
    if sum(sum(buckets.values()) for buckets in histogram.values()) <= EXACT_LATENCY_CALLS:
        return model_latency_from_rows(window)
    return [
        {
            "model": model,
            "calls": sum(buckets.values()),
            "p50_ms": sketch_percentile(buckets, 0.5),
            "p95_ms": sketch_percentile(buckets, 0.95),
        }
        for model, buckets in sorted(histogram.items())
    ]


def sketch_percentile(buckets: dict[int, int], fraction: float) -> float:
    """``percentile_cont(fraction)`` of a latency sketch ``{bucket: calls}``
    (non-empty), each call taken at its bucket's value."""
    total = sum(buckets.values())
    position = fraction * (total - 1)
    low = int(position)
    high = min(low + 1, total - 1)

    def value_at(rank: int) -> float:
        seen = 0
        for bucket in sorted(buckets):
            seen += buckets[bucket]
            if rank < seen:
                return facts.bucket_value(bucket)
        raise ValueError("rank beyond the sketch")

    low_value = value_at(low)
    return float(low_value + (value_at(high) - low_value) * (position - low))


def tools_by_name(window: Window) -> list[dict]:
    """Tool executions per tool: ``[{tool_name, executions, successes,
    failures}]`` ordered by executions (most first). Only executions count
    (rows with ``started_at``); a rejected call or a bare declaration is
    never an execution (R-READ-4, R-TA-5)."""
    if not uses_rollups(window):
        return tools_by_name_from_rows(window)
    rows = rollup_figures(
        window,
        group={"tool_name": "tool_name"},
        sums=("tool_executions", "tool_successes", "tool_failures"),
        having="SUM(tool_executions) > 0",
        order="tool_executions DESC, tool_name",
    )
    return [_tool_row(row, tool_name=row["tool_name"]) for row in rows]


def _tool_row(row: dict, **key) -> dict:
    return {
        **key,
        "executions": row.get("tool_executions") or 0,
        "successes": row.get("tool_successes") or 0,
        "failures": row.get("tool_failures") or 0,
    }


def tools_by_day(window: Window) -> list[dict]:
    """Tool executions per calendar day of the window, every day present:
    ``[{day, executions, successes, failures}]``."""
    if not uses_rollups(window):
        return tools_by_day_from_rows(window)
    found = {
        row["day"]: {
            "tool_executions": row["all_tool_executions"],
            "tool_successes": row["all_tool_successes"],
            "tool_failures": row["all_tool_failures"],
        }
        for row in rollup_figures(
            window,
            group={"day": DAY},
            sums=("all_tool_executions", "all_tool_successes", "all_tool_failures"),
            where=NOT_TOOLS,
        )
    }
    return [_tool_row(found.get(day, {}), day=day) for day in window.days()]


def timeseries(window: Window) -> list[dict]:
    """Per calendar day of the window, every day present: ``[{day,
    conversations, messages, runs, total_tokens, tool_executions}]``;
    messages are ordinary messages only (R-READ-4)."""
    if not uses_rollups(window):
        return timeseries_from_rows(window)
    found = {
        row["day"]: row
        for row in rollup_figures(
            window,
            group={"day": DAY},
            sums=("messages", "total_tokens"),
            extra={"runs": f"SUM({RUNS})::bigint", "tool_executions": "SUM(all_tool_executions)::bigint"},
            where=NOT_TOOLS,
        )
    }
    conversations = _conversations_by_day(window)
    series = []
    for day in window.days():
        row = found.get(day, {})
        series.append(
            {
                "day": day,
                "conversations": conversations.get(day, 0),
                "messages": row.get("messages") or 0,
                "runs": row.get("runs") or 0,
                "total_tokens": row.get("total_tokens") or 0,
                "tool_executions": row.get("tool_executions") or 0,
            }
        )
    return series


def _conversations_by_day(window: Window) -> dict[dt.date, int]:
    """``{day: conversations created}`` of a window :func:`uses_rollups`
    accepts (days without any left out), from the thread rollups the
    database keeps as threads change (:mod:`conversations.triggers`;
    replay scratch threads excluded, as ``Conversation.objects.counted``):
    a few rows per day, model and agent, however many threads (R-DASH-1)."""
    rows = rollup_figures(window, table=facts.THREAD_TABLE, group={"day": DAY}, sums=("conversations",))
    return {row["day"]: row["conversations"] for row in rows}


def feedback_summary(window: Window) -> dict:
    """Likes and dislikes of ordinary messages given in the window:
    ``{likes, dislikes, total, satisfaction_rate}``; the rate is
    ``likes / total`` in [0, 1], ``None`` without feedback. Feedback on
    audit rows is excluded (R-READ-4)."""
    if not uses_rollups(window):
        return feedback_summary_from_rows(window)
    (row,) = rollup_figures(window, sums=("likes", "dislikes"), where=NOT_TOOLS)
    likes, dislikes = row["likes"] or 0, row["dislikes"] or 0
    total = likes + dislikes
    return {
        "likes": likes,
        "dislikes": dislikes,
        "total": total,
        "satisfaction_rate": (likes / total) if total else None,
    }
