"""The staff dashboard page in the admin (R-DASH-1). It renders the figures
of :mod:`dashboard.selectors` (the same reads as ``/api/dashboard/...``)
and draws them with the vendored Chart.js; nothing is loaded from a CDN."""

from __future__ import annotations

import datetime as dt

from django.contrib import admin
from django.template.response import TemplateResponse
from django.urls import reverse

from core.errors import InvalidInput
from costs import selectors as cost_selectors

from . import selectors

FEEDBACK_ROWS = 50
TOP_USERS = 10
COSTLIEST_RUNS = 10
template_name = "admin/dashboard/index.html"


def _day(value: str | None) -> dt.date | None:
    if not value:
        return None
    try:
        return dt.date.fromisoformat(value)
    except ValueError as exc:
        raise InvalidInput(f"not a date: {value!r}", extra={"field": "from/to"}) from exc


def dashboard_page(request):
    """``GET /admin/dashboard/?from=YYYY-MM-DD&to=YYYY-MM-DD&tz=Zone``.
    Wrapped in ``admin.site.admin_view`` (staff only). Bad parameters show
    an error and the default window; they never fail the page."""
    params = {
        "from": request.GET.get("from", ""),
        "to": request.GET.get("to", ""),
        "tz": request.GET.get("tz") or "UTC",
    }
    error = None
    try:
        window = selectors.dashboard_window(
            first_day=_day(params["from"]), last_day=_day(params["to"]), tz=params["tz"]
        )
    except InvalidInput as exc:
        error = exc.message
        window = selectors.dashboard_window()
    figures = {
        "window": {"from": window.first_day, "to": window.last_day, "tz": window.tz.key},
        "overview": selectors.overview(window),
        "models": selectors.models_report(window),
        "tools": selectors.tools_report(window),
        "timeseries": selectors.timeseries(window),
        "feedback": selectors.feedback_summary(window),
        "costs": cost_figures(window),
    }
    context = {
        **admin.site.each_context(request),
        "title": "Dashboard",
        "error": error,
        "window": window,
        "figures": figures,
        "feedback_rows": list(selectors.feedback_list(window)[:FEEDBACK_ROWS]),
        "costliest_runs": figures["costs"]["costliest_runs"],
    }
    return TemplateResponse(request, template_name, context)


def cost_figures(window: selectors.Window) -> dict:
    """The page's cost figures (R-COST-2), all summed from the model rows:
    ``summary``, ``by_model_day`` (stacked chart), ``by_user`` (top
    :data:`TOP_USERS`), ``costliest_runs`` (top :data:`COSTLIEST_RUNS`,
    each with its admin page's ``url``). USD as decimal strings."""
    usd = cost_selectors.usd_text
    summary = cost_selectors.cost_summary(window)
    return {
        "summary": {**summary, "total_usd": usd(summary["total_usd"])},
        "by_model_day": [
            {**row, "total_usd": usd(row["total_usd"])} for row in cost_selectors.cost_by_model_day(window)
        ],
        "by_user": [
            {**row, "total_usd": usd(row["total_usd"])}
            for row in cost_selectors.costs_by(window, group_by="user", limit=TOP_USERS)
        ],
        "costliest_runs": [
            {
                **row,
                "run_id": str(row["run_id"]),
                "total_usd": usd(row["total_usd"]),
                "url": reverse("admin:audit_agentrun_change", args=[row["run_id"]]),
            }
            for row in cost_selectors.costliest_runs(window, limit=COSTLIEST_RUNS)
        ],
    }
