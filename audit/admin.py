"""Admin for agent runs: a changelist that stays fast on millions of rows
and the run page with its audit timeline (R-ADM-1).

Runs and their audit rows are written by workers only: the admin reads
them and never adds, changes or deletes them. The timeline is read through
:func:`audit.selectors.run_timeline`, the same selector as the audit API.
"""

from __future__ import annotations

import datetime as dt
import json
import uuid

from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.db.models import Count, DecimalField, IntegerField, OuterRef, Q, Subquery, Sum, Value
from django.db.models.functions import Coalesce
from django.http import Http404
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import timezone
from django.utils.html import format_html

from conversations.models import Message
from costs.selectors import run_cost, usd_text
from yuxi_project.errors import InvalidInput
from yuxi_project.paginator import EstimatingPaginator
from yuxi_project.storable import visible, visible_fields

from . import selectors
from .agents.assistant import AGENTS
from .agents.models import available_models
from .models import AgentRun

# Minimum width of a waterfall bar, in percent of the run's span, so that
# a 1 ms call stays visible next to a 30 s one.
_MIN_BAR_PERCENT = 0.6


def _count_of(rows) -> Subquery:
    """A correlated ``COUNT`` of ``rows`` of the outer run. Evaluated only
    for the rows of the page (after ORDER BY ... LIMIT), unlike a JOIN with
    GROUP BY, which would aggregate every run's rows first."""
    counted = rows.filter(run=OuterRef("pk")).order_by().values("run").annotate(n=Count("id")).values("n")
    return Coalesce(Subquery(counted, output_field=IntegerField()), Value(0))


def cost_of(rows, *, by: str = "run") -> Subquery:
    """A correlated ``SUM(cost_usd)`` of the model calls of the outer run
    (``by="run"``) or thread (``by="thread"``): the cost summed from the
    rows (R-COST-2), evaluated for the page's rows only; null when no call
    has a known cost."""
    summed = rows.filter(**{by: OuterRef("pk")}).order_by().values(by).annotate(usd=Sum("cost_usd")).values("usd")
    return Subquery(summed, output_field=DecimalField(max_digits=24, decimal_places=12))


def cost_text(value) -> str:
    text = usd_text(value)
    return f"${text}" if text is not None else "—"


class AgentFilter(admin.SimpleListFilter):
    """Agents from the code's agent list: no ``SELECT DISTINCT`` over the
    runs table."""

    title = "agent"
    parameter_name = "agent"

    def lookups(self, request, model_admin):
        return [(agent, agent) for agent in AGENTS]

    def queryset(self, request, queryset):
        return queryset.filter(agent_id=self.value()) if self.value() else queryset


class ModelFilter(admin.SimpleListFilter):
    """Models from the configured model list (no ``SELECT DISTINCT``)."""

    title = "model"
    parameter_name = "model"

    def lookups(self, request, model_admin):
        return [(name, name) for name in available_models()]

    def queryset(self, request, queryset):
        return queryset.filter(model=self.value()) if self.value() else queryset


def status_badge(status: str | None) -> str:
    return format_html('<span class="yx-badge yx-status-{}">{}</span>', status or "none", status or "—")


def duration_text(start: dt.datetime | None, end: dt.datetime | None) -> str:
    if start is None:
        return "—"
    seconds = ((end or timezone.now()) - start).total_seconds()
    text = f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"
    return text if end else f"{text} (running)"


@admin.register(AgentRun)
class AgentRunAdmin(admin.ModelAdmin):
    """Runs, newest first; the run page shows the audit timeline."""

    change_form_template = "admin/audit/agentrun/change_form.html"
    timeline_template = "admin/audit/timeline.html"
    list_display = (
        "short_id",
        "status_display",
        "thread_link",
        "user",
        "agent_id",
        "model",
        "model_call_count",
        "tool_execution_count",
        "tokens",
        "cost",
        "duration",
        "created_at",
    )
    list_filter = ("status", AgentFilter, ModelFilter, ("created_at", admin.DateFieldListFilter))
    search_help_text = "Exact run id, request id or thread id."
    search_fields = ("request_id",)  # replaced by get_search_results: exact matches only
    list_select_related = ("user", "thread")
    show_full_result_count = False
    # Facet counts are one COUNT per filter option: not on this table.
    show_facets = admin.ShowFacets.NEVER
    paginator = EstimatingPaginator
    list_per_page = 50

    class Media:
        css = {"all": ("audit/timeline.css",)}

    ordering = ("-created_at",)
    fieldsets = (
        (
            None,
            {
                "fields": (
                    ("status_display", "agent_id", "model"),
                    ("thread_link", "user"),
                    "turn_links",
                    ("usage_text", "cost_text", "duration"),
                    "error_type",
                    "output_message_link",
                )
            },
        ),
        (
            "Details",
            {
                "classes": ("collapse",),
                "fields": (
                    "id",
                    "request_id",
                    "input_text",
                    "error_message",
                    "interrupts_text",
                    ("lease_owner", "fencing_token", "lease_expires_at"),
                    "trace_id",
                    ("created_at", "started_at", "finished_at", "cancel_requested_at"),
                ),
            },
        ),
    )
    fields = None
    readonly_fields = tuple(
        name
        for _, options in fieldsets
        for entry in options["fields"]
        for name in (entry if isinstance(entry, tuple) else (entry,))
    )

    # --- read-only: workers write runs (R-RUN-4) ---------------------------

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False

    # --- changelist ---------------------------------------------------------

    def get_queryset(self, request):
        return (
            super()
            .get_queryset(request)
            .annotate(
                model_call_count=_count_of(Message.objects.model_calls()),
                tool_execution_count=_count_of(Message.objects.tool_executions()),
                cost_usd=cost_of(Message.objects.model_calls()),
            )
        )

    def get_search_results(self, request, queryset, search_term):
        """Exact lookups on indexed columns: a run id, a thread id or a
        request id. A ``LIKE '%term%'`` over millions of runs is never run."""
        term = search_term.strip()
        if not term:
            return queryset, False
        condition = Q(request_id=term)
        try:
            as_uuid = uuid.UUID(term)
        except ValueError:
            pass
        else:
            condition |= Q(pk=as_uuid) | Q(thread_id=as_uuid)
        return queryset.filter(condition), False

    @admin.display(description="run", ordering="created_at")
    def short_id(self, run):
        return str(run.id)[:8]

    @admin.display(description="status", ordering="status")
    def status_display(self, run):
        return status_badge(run.status)

    @admin.display(description="thread")
    def thread_link(self, run):
        url = reverse("admin:conversations_conversation_change", args=[run.thread_id])
        return format_html('<a href="{}">{}</a>', url, str(run.thread_id)[:8])

    @admin.display(description="model calls", ordering="model_call_count")
    def model_call_count(self, run):
        return run.model_call_count

    @admin.display(description="tool executions", ordering="tool_execution_count")
    def tool_execution_count(self, run):
        return run.tool_execution_count

    @admin.display(description="tokens")
    def tokens(self, run):
        return (run.usage or {}).get("total_tokens", "—")

    @admin.display(description="cost (USD)", ordering="cost_usd")
    def cost(self, run):
        return cost_text(run.cost_usd)

    @admin.display(description="duration")
    def duration(self, run):
        return duration_text(run.started_at, run.finished_at if run.is_terminal else None)

    # --- run page -----------------------------------------------------------

    def get_object(self, request, object_id, from_field=None):
        # change_view reads the run for the timeline and Django reads it
        # again for the form: one query per request.
        cache = request.__dict__.setdefault("_agent_run_objects", {})
        if object_id not in cache:
            try:
                pk = uuid.UUID(str(object_id))
            except ValueError:
                return None
            run = (
                self.get_queryset(request)
                .select_related("user", "thread", "output_message", "resumed_from")
                .filter(pk=pk)
                .first()
            )
            # Read-only page: HTML shows unstorable characters escaped (R-RUN-11).
            if run is not None:
                visible_fields(run)
                if run.output_message is not None:
                    visible_fields(run.output_message)
            cache[object_id] = run
        return cache[object_id]

    @admin.display(description="turn")
    def turn_links(self, run):
        """The turn's runs: the original run and its resume runs (R-TA-5)."""
        runs = AgentRun.objects.filter(turn_id=run.turn_id).order_by("created_at").only("id", "status", "resumed_from")
        links = []
        for other in runs:
            label = "original run" if other.resumed_from_id is None else "resume"
            if other.pk == run.pk:
                links.append(format_html("<strong>{} {} ({})</strong>", label, str(other.id)[:8], other.status))
            else:
                url = reverse("admin:audit_agentrun_change", args=[other.pk])
                links.append(format_html('<a href="{}">{} {} ({})</a>', url, label, str(other.id)[:8], other.status))
        return format_html('<span class="yx-turn">{}</span>', format_html(" → ".join(["{}"] * len(links)), *links))

    @admin.display(description="input")
    def input_text(self, run):
        return json.dumps(run.input, ensure_ascii=False, indent=1)

    @admin.display(description="usage")
    def usage_text(self, run):
        return json.dumps(run.usage, ensure_ascii=False) if run.usage else "—"

    @admin.display(description="cost")
    def cost_text(self, run):
        """Summed from the run's model rows; calls of unknown cost are
        counted, never priced at 0 (R-COST-2)."""
        cost = run_cost(run.pk)
        text = cost_text(cost["total_usd"])
        if cost["unknown_cost_calls"]:
            text += f" (+ {cost['unknown_cost_calls']} call(s) of unknown cost)"
        return text

    @admin.display(description="interrupts")
    def interrupts_text(self, run):
        return json.dumps(run.interrupts, ensure_ascii=False, indent=1) if run.interrupts else "—"

    @admin.display(description="output message")
    def output_message_link(self, run):
        if run.output_message_id is None:
            return "—"
        return format_html("#{}: {}", run.output_message_id, run.output_message.content[:200])

    def get_urls(self):
        return [
            path(
                "<uuid:run_id>/timeline/",
                self.admin_site.admin_view(self.timeline_view),
                name="audit_agentrun_timeline",
            ),
            *super().get_urls(),
        ]

    def change_view(self, request, object_id, form_url="", extra_context=None):
        run = self.get_object(request, object_id)
        extra_context = dict(extra_context or {})
        if run is not None and self.has_view_permission(request, run):
            extra_context.update(self.timeline_context(request, run))
        return super().change_view(request, object_id, form_url, extra_context)

    def timeline_view(self, request, run_id):
        """The timeline fragment alone, for the run page's live refresh."""
        run = AgentRun.objects.filter(pk=run_id).first()
        if run is None:
            raise Http404("run not found")
        if not self.has_view_permission(request, run):
            raise PermissionDenied
        return TemplateResponse(request, self.timeline_template, self.timeline_context(request, run))

    def timeline_context(self, request, run: AgentRun) -> dict:
        """Rows of one page of the run's timeline (``?before=<cursor>``
        pages back) with their waterfall geometry (R-ADM-1, R-READ-3)."""
        return timeline_page_context(
            request,
            lambda before: selectors.run_timeline(run_id=run.pk, before=before),
            base_url=reverse("admin:audit_agentrun_change", args=[run.pk]),
            live=not run.is_terminal,
            refresh_url=reverse("admin:audit_agentrun_timeline", args=[run.pk]),
            extra={"run": run},
        )


def timeline_page_context(
    request,
    read_page,
    *,
    base_url: str,
    live: bool = False,
    refresh_url: str = "",
    show_run: bool = False,
    extra: dict | None = None,
) -> dict:
    """Template context of ``admin/audit/timeline.html`` for one timeline
    page. ``read_page(before)`` returns a :class:`selectors.TimelinePage`
    (``before`` is the ``?before=`` cursor or ``None``); a malformed cursor
    shows the newest page. ``live`` turns on the self-refresh (newest page
    only); ``show_run`` adds a run column (thread timelines)."""
    before = request.GET.get("before") or None
    try:
        page = read_page(before)
    except InvalidInput:
        before, page = None, read_page(None)
    now = timezone.now()
    # HTML cannot carry U+0000 or lone surrogates: show the escaped form (R-RUN-11).
    rows = [visible(selectors.timeline_item(row, include_raw_output=True)) for row in page.items]
    starts = [r["started_at"] for r in rows if r["started_at"]]
    ends = [r["finished_at"] or (now if live else r["started_at"]) for r in rows if r["started_at"]]
    t0 = min(starts, default=None)
    span = max((max(ends) - t0).total_seconds(), 0.001) if t0 and ends else None
    for r in rows:
        r["status_badge"] = status_badge(r["status"])
        r["label"] = r["tool_name"] if r["kind"] == "tool" else (r["metadata"].get("model_name") or "model call")
        r["tool_calls_json"] = _pretty(r["tool_calls"])
        r["tool_input_json"] = _pretty(r["tool_input"])
        r["raw_output_json"] = _pretty(r.get("raw_output"))
        r["usage_text"] = _usage_text(r["usage"])
        # cost_usd is already the API's decimal string here (R-COST-1).
        closed_model_call = r["kind"] == "model" and r["status"] != "running"
        r["cost_text"] = (f"${r['cost_usd']}" if r["cost_usd"] is not None else "—") if closed_model_call else ""
        r["bar"] = _bar(r, t0, span, now, live)
        if show_run:
            r["run_url"] = reverse("admin:audit_agentrun_change", args=[r["run_id"]])
    return {
        **(extra or {}),
        "timeline_rows": rows,
        "timeline_truncated": page.truncated,
        "timeline_older_url": f"{base_url}?before={page.next_before}" if page.next_before else None,
        "timeline_newest_url": base_url if before else None,
        "timeline_live": live and before is None,
        "timeline_refresh_url": refresh_url,
        "timeline_limit": selectors.TIMELINE_MAX_ROWS,
        "timeline_show_run": show_run,
    }


def _pretty(value) -> str | None:
    if value in (None, "", [], {}):
        return None
    return json.dumps(value, ensure_ascii=False, indent=2, default=str)


def _usage_text(usage: dict | None) -> str:
    if not usage:
        return "—"
    parts = [f"{usage.get(k)} {label}" for k, label in (("input_tokens", "in"), ("output_tokens", "out")) if k in usage]
    total = usage.get("total_tokens")
    return " / ".join(parts) + (f" = {total}" if total is not None else "")


def _bar(row: dict, t0: dt.datetime | None, span: float | None, now: dt.datetime, live: bool) -> dict | None:
    """Waterfall geometry in percent of the page's span: ``{left, width}``."""
    if not (row["started_at"] and t0 and span):
        return None
    # A row left open in a terminal run gets the minimum bar, not one that
    # stretches to now.
    end = row["finished_at"] or (now if live else row["started_at"])
    left = (row["started_at"] - t0).total_seconds() / span * 100
    width = max((end - row["started_at"]).total_seconds() / span * 100, _MIN_BAR_PERCENT)
    left = min(max(left, 0.0), 100.0 - _MIN_BAR_PERCENT)
    return {"left": round(left, 3), "width": round(min(width, 100.0 - left), 3)}
