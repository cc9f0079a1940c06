"""Dashboard API (R-DASH-1): staff only; every figure comes from
:mod:`dashboard.selectors`, the same reads as the admin dashboard page.

Common query parameters: ``from`` and ``to`` (calendar days, ``YYYY-MM-DD``,
inclusive) and ``tz`` (IANA zone the days are counted in, default UTC).
"""

from __future__ import annotations

from typing import Literal

from ninja import Field, Query, Router, Schema

from conversations.schemas import ErrorOut
from core.errors import PermissionDenied
from costs import selectors as cost_selectors
from yuxi_project.api_types import DashboardDay, time_zone_schema
from yuxi_project.auth import staff_auth

from . import selectors
from .schemas import CostsOut, FeedbackOut, ModelsOut, OverviewOut, TimeseriesOut, ToolsOut

# Staff only: 403 before a parameter is read (yuxi_project.auth.staff_auth).
router = Router(tags=["dashboard"], auth=staff_auth("the dashboard is for staff"))


def _time_zone_enum(schema: dict) -> None:
    schema.update(time_zone_schema())


ERRORS = {401: ErrorOut, 403: ErrorOut, 422: ErrorOut}
FEEDBACK_PAGE_MAX = 200


class WindowIn(Schema):
    """The window (``dashboard.selectors.dashboard_window``): ``from`` and
    ``to`` inclusive, at most 366 days; JSON Schema cannot relate two
    parameters, so the descriptions say it and the server answers 422."""

    from_day: DashboardDay | None = Field(
        None,
        alias="from",
        description="First day (inclusive) in `tz`. Default: 29 days before `to`. "
        "At most 366 days before `to` and not after it (else 422, `field: from` or `to`).",
    )
    to_day: DashboardDay | None = Field(
        None,
        alias="to",
        description="Last day (inclusive) in `tz`. Default: today in `tz`, or `from` if that is later.",
    )
    tz: str = Field("UTC", description="IANA time zone the days are counted in.", json_schema_extra=_time_zone_enum)


def staff_window(request, params: WindowIn) -> selectors.Window:
    """Check that the caller is staff (else :class:`PermissionDenied`, 403,
    R-READ-5) and validate the window (:class:`InvalidInput`, 422)."""
    if not getattr(request.auth, "is_staff", False):
        raise PermissionDenied("the dashboard is for staff")
    return selectors.dashboard_window(first_day=params.from_day, last_day=params.to_day, tz=params.tz)


def window_out(window: selectors.Window) -> dict:
    return {"from_day": window.first_day, "to_day": window.last_day, "tz": window.tz.key}


@router.get("/dashboard/overview", response={200: OverviewOut, **ERRORS})
def dashboard_overview(request, params: Query[WindowIn]):
    """Conversations, active users, messages (audit excluded), runs by
    status and token totals of the window."""
    window = staff_window(request, params)
    return {"window": window_out(window), **selectors.overview(window)}


@router.get("/dashboard/models", response={200: ModelsOut, **ERRORS})
def dashboard_models(request, params: Query[WindowIn]):
    """Tokens per model and day; latency p50/p95 (ms) per model."""
    window = staff_window(request, params)
    return {"window": window_out(window), **selectors.models_report(window)}


@router.get("/dashboard/tools", response={200: ToolsOut, **ERRORS})
def dashboard_tools(request, params: Query[WindowIn]):
    """Tool executions, successes and failures per tool and per day
    (executions only: rows with ``started_at``)."""
    window = staff_window(request, params)
    return {"window": window_out(window), **selectors.tools_report(window)}


@router.get("/dashboard/timeseries", response={200: TimeseriesOut, **ERRORS})
def dashboard_timeseries(request, params: Query[WindowIn]):
    """Per day: conversations, messages, runs, tokens, tool executions."""
    window = staff_window(request, params)
    return {"window": window_out(window), "days": selectors.timeseries(window)}


class FeedbackQuery(WindowIn):
    rating: Literal["like", "dislike"] | None = Field(None, description="Only likes or only dislikes.")
    limit: int = Field(50, ge=1, le=FEEDBACK_PAGE_MAX)
    offset: int = Field(0, ge=0, le=1_000_000)


@router.get("/dashboard/feedback", response={200: FeedbackOut, **ERRORS})
def dashboard_feedback(request, params: Query[FeedbackQuery]):
    """Likes, dislikes, satisfaction rate and the feedback list (newest
    first, ``limit``/``offset`` paged); feedback on audit rows excluded."""
    window = staff_window(request, params)
    queryset = selectors.feedback_list(window, rating=params.rating)
    items = [
        {
            "id": row.id,
            "rating": row.rating,
            "reason": row.reason,
            "created_at": row.created_at,
            "username": row.user.get_username(),
            "message_id": row.message_id,
            "thread_id": row.message.thread_id,
            "message_excerpt": row.message.content[:200],
        }
        for row in queryset[params.offset : params.offset + params.limit]
    ]
    summary = selectors.feedback_summary(window)
    # The list's length from the same counts (no scan of the window's rows).
    count = {None: summary["total"], "like": summary["likes"], "dislike": summary["dislikes"]}[params.rating]
    return {"window": window_out(window), **summary, "count": count, "items": items}


class CostsQuery(WindowIn):
    group_by: Literal["model", "user", "day"] = "model"
    limit: int = Field(100, ge=1, le=1000, description="At most this many models or users (not days).")


@router.get("/dashboard/costs", response={200: CostsOut, **ERRORS})
def dashboard_costs(request, params: Query[CostsQuery]):
    """Cost (USD, decimal strings) of the model calls that closed in the
    window, in total and per ``model`` (configured name), ``user`` (most
    first) or ``day`` (every day of the window); calls of unknown cost are
    counted, never priced at 0. Summed from the rows (R-COST-2)."""
    window = staff_window(request, params)
    summary = cost_selectors.cost_summary(window)
    items = [
        {**row, "key": str(row["key"]), "total_usd": cost_selectors.usd_text(row["total_usd"])}
        for row in cost_selectors.costs_by(window, group_by=params.group_by, limit=params.limit)
    ]
    return {
        "window": window_out(window),
        "group_by": params.group_by,
        "total_usd": cost_selectors.usd_text(summary["total_usd"]),
        "calls": summary["calls"],
        "unknown_cost_calls": summary["unknown_cost_calls"],
        "items": items,
    }
