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
import zoneinfo
from dataclasses import dataclass

from django.db import connections
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
from yuxi_project.errors import InvalidInput

DEFAULT_DAYS = 30
MAX_DAYS = 366
EARLIEST_DAY = dt.date(1970, 1, 1)
LATEST_DAY = dt.date(9000, 12, 31)
UNKNOWN_MODEL = "unknown"


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


def overview(window: Window) -> dict:
    """Totals of the window (R-DASH-1): ``conversations`` created,
    ``active_users`` (users who wrote an ordinary message), ``messages``
    (ordinary only, audit rows excluded), ``runs`` and ``runs_by_status``
    (``{status: count}`` over the whole run vocabulary), ``tokens``
    (``{input_tokens, output_tokens, total_tokens}`` over model calls)."""
    messages = Message.objects.ordinary().filter(_in(window, "created_at"))
    by_status = dict(
        AgentRun.objects.filter(_in(window, "created_at"))
        .values_list("status")
        .annotate(n=Count("id"))
        .order_by()
        .values_list("status", "n")
    )
    tokens = (
        Message.objects.model_calls()
        .filter(_in(window, "started_at"))
        .aggregate(
            input_tokens=Coalesce(Sum(_json_int("usage", "input_tokens")), 0),
            output_tokens=Coalesce(Sum(_json_int("usage", "output_tokens")), 0),
            total_tokens=Coalesce(Sum(_json_int("usage", "total_tokens")), 0),
        )
    )
    return {
        "conversations": Conversation.objects.filter(_in(window, "created_at")).count(),
        "active_users": messages.filter(role=Message.Role.USER).values("thread__user_id").distinct().count(),
        "messages": messages.count(),
        "runs": sum(by_status.values()),
        "runs_by_status": {status: by_status.get(status, 0) for status in AgentRun.Status.values},
        "tokens": tokens,
    }


def tokens_by_model_day(window: Window) -> list[dict]:
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
        Message.objects.model_calls()
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


def model_latency(window: Window) -> list[dict]:
    """Latency of completed model calls per model, in ms:
    ``[{model, calls, p50_ms, p95_ms}]`` ordered by model. Percentiles are
    continuous (PostgreSQL's ``percentile_cont``); on the embedded SQLite
    default they are computed the same way in Python."""
    model = _model_name()  # one bound expression for SELECT and GROUP BY
    calls = (
        Message.objects.model_calls()
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


def tools_by_name(window: Window) -> list[dict]:
    """Tool executions per tool: ``[{tool_name, executions, successes,
    failures}]`` ordered by executions (most first). Only executions count
    (rows with ``started_at``); a rejected call or a bare declaration is
    never an execution (R-READ-4, R-TA-5)."""
    return list(
        Message.objects.tool_executions()
        .filter(_in(window, "started_at"))
        .values("tool_name")
        .annotate(**_tool_counts())
        .order_by("-executions", "tool_name")
    )


def tools_by_day(window: Window) -> list[dict]:
    """Tool executions per calendar day of the window, every day present:
    ``[{day, executions, successes, failures}]``."""
    day = TruncDate("started_at", tzinfo=window.tz)
    found = {
        row["day"]: row
        for row in Message.objects.tool_executions()
        .filter(_in(window, "started_at"))
        .values(day=day)
        .annotate(**_tool_counts())
        .order_by("day")
    }
    empty = {"executions": 0, "successes": 0, "failures": 0}
    return [{**empty, **found.get(day, {}), "day": day} for day in window.days()]


def timeseries(window: Window) -> list[dict]:
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

    fill(Conversation.objects.all(), "created_at", "conversations", Count("id"))
    fill(Message.objects.ordinary(), "created_at", "messages", Count("id"))
    fill(AgentRun.objects.all(), "created_at", "runs", Count("id"))
    fill(Message.objects.model_calls(), "started_at", "total_tokens", Sum(_json_int("usage", "total_tokens")))
    fill(Message.objects.tool_executions(), "started_at", "tool_executions", Count("id"))
    return list(series.values())


def feedback_summary(window: Window) -> dict:
    """Likes and dislikes of ordinary messages given in the window:
    ``{likes, dislikes, total, satisfaction_rate}``; the rate is
    ``likes / total`` in [0, 1], ``None`` without feedback. Feedback on
    audit rows is excluded (R-READ-4)."""
    like, dislike = MessageFeedback.Rating.LIKE, MessageFeedback.Rating.DISLIKE
    counts = (
        MessageFeedback.objects.ordinary()
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
        MessageFeedback.objects.ordinary()
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
