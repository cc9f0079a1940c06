"""The staff dashboard page in the admin (R-DASH-1). It renders the figures
of :mod:`dashboard.selectors` (the same reads as ``/api/dashboard/...``)
and draws them with the vendored Chart.js; nothing is loaded from a CDN."""

from __future__ import annotations

import datetime as dt

from django.contrib import admin
from django.template.response import TemplateResponse

from yuxi_project.errors import InvalidInput

from . import selectors

FEEDBACK_ROWS = 50
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
    }
    context = {
        **admin.site.each_context(request),
        "title": "Dashboard",
        "error": error,
        "window": window,
        "figures": figures,
        "feedback_rows": list(selectors.feedback_list(window)[:FEEDBACK_ROWS]),
    }
    return TemplateResponse(request, template_name, context)
