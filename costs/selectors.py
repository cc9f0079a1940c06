"""Cost totals (R-COST-2): every figure is a sum over the model rows'
``cost_usd`` — for a run, a thread, a user's budget period, or a dashboard
window — never a stored second copy, so the figures agree to the last
decimal.

Rules shared by every total:

* only model calls count (``Message.objects.model_calls()``: audit rows of
  the assistant, including the one that became the final answer); tool
  rows and chat messages have no cost;
* ``total_usd`` is the sum of the known costs, ``None`` only when no call
  has a known cost; ``unknown_cost_calls`` counts closed calls whose cost
  is unknown (``cost_unknown()``), never adding 0 for them; running calls
  are neither;
* a call belongs to the day (and budget period) in which it closed
  (``finished_at``).
* a dashboard window's totals leave replayed runs out
  (``AgentRun.replay_of``, issue 34); a run's own cost does not.
"""

from __future__ import annotations

import datetime as dt
import uuid
from decimal import Decimal
from typing import Any, Literal

from django.db import connection
from django.db.models import Count, F, Q, Sum
from django.db.models.functions import TruncDate

from conversations.models import Message
from core.errors import InvalidInput
from dashboard import facts
from dashboard import selectors as dashboard

GROUPS = ("model", "user", "day")


def usd_text(value: Decimal | None) -> str | None:
    """A USD amount as the API shows it: a plain decimal string without
    trailing zeros (``"0.000108"``), or ``None``."""
    if value is None:
        return None
    return format(value.normalize(), "f") if value else "0"


def _closed_calls():
    return Message.objects.model_calls().exclude(execution_status=Message.ExecutionStatus.RUNNING)


_UNKNOWN = Q(cost_usd__isnull=True)


def _totals() -> dict[str, Any]:
    return {
        "total_usd": Sum("cost_usd"),
        "calls": Count("id"),
        "unknown_cost_calls": Count("id", filter=_UNKNOWN),
    }


def run_cost(run_id: uuid.UUID) -> dict[str, Any]:
    """``{total_usd: Decimal | None, unknown_cost_calls: int}`` of one run,
    summed from its model rows (R-COST-2)."""
    totals = _closed_calls().filter(run_id=run_id).aggregate(**_totals())
    return {"total_usd": totals["total_usd"], "unknown_cost_calls": totals["unknown_cost_calls"]}


def run_costs(run_ids) -> dict[uuid.UUID, dict[str, Any]]:
    """:func:`run_cost` of each of ``run_ids`` in one grouped query (a page
    of runs, R-API-1); a run without a closed model call gets
    ``{total_usd: None, unknown_cost_calls: 0}``, as :func:`run_cost` gives it."""
    costs = {run_id: {"total_usd": None, "unknown_cost_calls": 0} for run_id in run_ids}
    grouped = _closed_calls().filter(run_id__in=list(costs)).order_by().values("run_id").annotate(**_totals())
    for row in grouped:
        costs[row["run_id"]] = {"total_usd": row["total_usd"], "unknown_cost_calls": row["unknown_cost_calls"]}
    return costs


def spent_calls(*, user_id: int, since: dt.datetime):
    """The model calls whose cost is ``user_id``'s spend since ``since``:
    closed at or after it, with a known cost (unknown costs add nothing).
    Index ``message_model_finished_idx`` serves the time range (R-COST-3).
    The one definition of spend: :func:`spent_usd` sums it, and the budget
    check before each model call compiles it into its statement
    (``costs.budgets``)."""
    return Message.objects.model_calls().filter(run__user_id=user_id, finished_at__gte=since, cost_usd__isnull=False)


def spent_usd(*, user_id: int, since: dt.datetime) -> Decimal:
    """What ``user_id``'s model calls that closed at or after ``since`` cost,
    in USD (:func:`spent_calls`; R-COST-3)."""
    total = spent_calls(user_id=user_id, since=since).aggregate(total=Sum("cost_usd"))["total"]
    return total or Decimal(0)


def _in_window(window) -> Any:
    # Dashboard figures leave replays out (issue 34); a run's own cost
    # (run_cost) and a user's spend (spent_calls) do not.
    return _closed_calls().counted().filter(finished_at__gte=window.start, finished_at__lt=window.end)


def cost_summary(window) -> dict[str, Any]:
    """``{total_usd, calls, unknown_cost_calls}`` of the model calls that
    closed in a dashboard window (``dashboard.selectors.Window``). Read
    from the dashboard rollups where the window allows (R-DASH-1)."""
    if not dashboard.uses_rollups(window):
        return _in_window(window).aggregate(**_totals())
    (row,) = dashboard.rollup_figures(window, extra=_ROLLUP_TOTALS, where=dashboard.NOT_TOOLS)
    return row


# The totals of _totals() over rollup rows: no known cost -> None, never 0.
_ROLLUP_TOTALS = {
    "total_usd": "CASE WHEN SUM(closed_calls) > SUM(unknown_cost_calls) THEN SUM(cost_usd) END",
    "calls": "COALESCE(SUM(closed_calls), 0)::bigint",
    "unknown_cost_calls": "COALESCE(SUM(unknown_cost_calls), 0)::bigint",
}
_ROLLUP_ORDER = "total_usd DESC NULLS LAST, calls DESC, key"


def _costs_by_from_rollups(window, *, group_by: str, limit: int) -> list[dict[str, Any]]:
    having = "SUM(closed_calls) > 0"
    if group_by == "model":
        rows = dashboard.rollup_figures(
            window,
            group={"key": "model"},
            extra=_ROLLUP_TOTALS,
            having=having,
            order=f"{_ROLLUP_ORDER} LIMIT {limit:d}",
            where=dashboard.NOT_TOOLS,
        )
        return rows
    if group_by == "user":
        # Summed per user id first, then the (few) sums joined to their names.
        inner = dashboard.rollup_sql(
            window, table=facts.USER_TABLE, group={"user_id": "user_id"}, extra=_ROLLUP_TOTALS, having=having
        )
        sql = (
            "SELECT u.username AS key, a.user_id, a.total_usd, a.calls, a.unknown_cost_calls"
            f" FROM ({inner}) a JOIN auth_user u ON u.id = a.user_id ORDER BY {_ROLLUP_ORDER} LIMIT {limit:d}"
        )
        with connection.cursor() as cursor:
            cursor.execute(sql, dashboard.rollup_params(window))
            names = [column.name for column in cursor.description]
            return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]
    found = {
        row["key"]: row
        for row in dashboard.rollup_figures(
            window, group={"key": dashboard.DAY}, extra=_ROLLUP_TOTALS, having=having, where=dashboard.NOT_TOOLS
        )
    }
    empty = {"total_usd": None, "calls": 0, "unknown_cost_calls": 0}
    return [{**empty, **found.get(day, {}), "key": day} for day in window.days()]


def costs_by(window, *, group_by: Literal["model", "user", "day"], limit: int = 100) -> list[dict[str, Any]]:
    """Cost of the window's model calls per group:
    ``[{key, total_usd, calls, unknown_cost_calls}]`` (plus ``user_id`` for
    ``user``). ``model`` is the run's configured model name (the name
    prices are set for); ``day`` lists every day of the window in its
    zone, oldest first; ``model`` and ``user`` are ordered by cost (highest
    first), at most ``limit`` groups.

    Raises :class:`InvalidInput` for another ``group_by``.
    """
    if group_by not in GROUPS:
        raise InvalidInput(f"group_by must be one of {', '.join(GROUPS)}", extra={"field": "group_by"})

    if dashboard.uses_rollups(window):
        return _costs_by_from_rollups(window, group_by=group_by, limit=limit)
    rows = _in_window(window)
    if group_by == "model":
        grouped = rows.values(key=F("run__model"))
    elif group_by == "user":
        grouped = rows.values(key=F("run__user__username"), user_id=F("run__user_id"))
    elif group_by == "day":
        found = {
            row["key"]: row
            for row in rows.values(key=TruncDate("finished_at", tzinfo=window.tz)).annotate(**_totals()).order_by()
        }
        empty = {"total_usd": None, "calls": 0, "unknown_cost_calls": 0}
        return [{**empty, **found.get(day, {}), "key": day} for day in window.days()]
    else:
        raise InvalidInput(f"group_by must be one of {', '.join(GROUPS)}", extra={"field": "group_by"})
    return list(grouped.annotate(**_totals()).order_by(F("total_usd").desc(nulls_last=True), "-calls", "key")[:limit])


def cost_by_model_day(window) -> list[dict[str, Any]]:
    """``[{model, day, total_usd, calls, unknown_cost_calls}]`` of the
    window, by day then model (the dashboard's stacked chart)."""
    if dashboard.uses_rollups(window):
        return dashboard.rollup_figures(
            window,
            group={"model": "model", "day": dashboard.DAY},
            extra=_ROLLUP_TOTALS,
            having="SUM(closed_calls) > 0",
            order="day, model",
            where=dashboard.NOT_TOOLS,
        )
    return list(
        _in_window(window)
        .values(model=F("run__model"), day=TruncDate("finished_at", tzinfo=window.tz))
        .annotate(**_totals())
        .order_by("day", "model")
    )


def costliest_runs(window, *, limit: int = 10) -> list[dict[str, Any]]:
    """The ``limit`` runs whose model calls that closed in the window cost
    most: ``[{run_id, total_usd, calls, unknown_cost_calls, model,
    username}]``, highest first."""
    return list(
        _in_window(window)
        .values("run_id", model=F("run__model"), username=F("run__user__username"))
        .annotate(**_totals())
        .filter(total_usd__isnull=False)
        .order_by("-total_usd", "run_id")[:limit]
    )
