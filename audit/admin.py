"""Admin for agent runs: a changelist that stays fast on millions of rows
and the run page with its audit timeline (R-ADM-1).

Runs and their audit rows are written by workers only: the admin reads
them and never adds, changes or deletes them. The timeline is read through
:func:`audit.reads.selectors.run_timeline`, the same selector as the audit API.
"""

from __future__ import annotations

import datetime as dt
import json
import uuid

import orjson
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db.models import DecimalField, OuterRef, Subquery, Sum
from django.http import Http404, HttpResponse, HttpResponseNotAllowed, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import timezone
from django.utils.html import format_html
from django.utils.safestring import mark_safe
from pydantic import ValidationError

from conversations.models import Message
from core.errors import InvalidInput
from core.storable import visible, visible_fields
from costs.selectors import run_cost, usd_text
from dashboard.selectors import models_used
from yuxi_project.admin_rows import ActionCheckboxMixin, ReadOnlyAdminMixin
from yuxi_project.paginator import EstimatingPaginator

from . import export
from .agents.researcher import RESEARCHER_TOOL_NAMES
from .agents.tools import ASSISTANT_TOOLS
from .catalogue import AGENTS
from .execution.rerun import replay_request
from .models import AgentRun, RunRollback
from .reads import search, selectors
from .schemas import RunFilterQuery
from .templatetags.yx_admin import model_html, time_html
from .timeline_html import rows_html

# The characters of each payload of a timeline row (content, declared tool
# calls, tool input, raw tool output) that the run page carries; the rest
# loads from the payload view when the row is expanded (issue 37: a
# 1,000,000-character tool result was inlined twice, in full).
PAYLOAD_PREVIEW_CHARS = 2000
# The parts of a row the payload view serves, and their display dict keys.
PAYLOAD_PARTS = {
    "content": "content",
    "tool_calls": "tool_calls_json",
    "tool_input": "tool_input_json",
    "raw_output": "raw_output_json",
}

# Minimum width of a waterfall bar, in percent of the run's span, so that
# a 1 ms call stays visible next to a 30 s one.
_MIN_BAR_PERCENT = 0.6


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
    """Models the audit's runs used (:func:`dashboard.selectors.models_used`,
    no ``SELECT DISTINCT`` over the runs table), not every model a thread
    could use (issue 37); any other name works in the URL (``?model=``)."""

    title = "model"
    parameter_name = "model"

    def lookups(self, request, model_admin):
        names = models_used()
        # A model asked for in the URL stays selectable, even one no run used.
        if self.value() and self.value() not in names:
            names.append(self.value())
        return [(name, name) for name in names]

    def queryset(self, request, queryset):
        return queryset.filter(model=self.value()) if self.value() else queryset


class RunFilter(admin.SimpleListFilter):
    """A run filter of :mod:`audit.reads.search` under its API parameter name, so
    the admin and ``GET /api/audit/runs`` share one definition (R-ADM-2).
    A malformed value shows an error and no runs, never all runs."""

    #: Parameters of other filters applied here with this one, as one
    #: filter of the search (``tool`` with ``tool_status``: one tool row
    #: with both, R-ADM-2).
    together: tuple[str, ...] = ()

    def queryset(self, request, queryset):
        value = self.value()
        if value in (None, ""):
            return queryset
        values = {name: request.GET[name] for name in self.together if request.GET.get(name)}
        try:
            query = RunFilterQuery.model_validate({**values, self.parameter_name: value})
            return search.filter_runs(queryset, query.as_filters())
        except ValidationError as exc:
            error = exc.errors()[0]
            field = str(error["loc"][0]) if error.get("loc") else self.parameter_name
            title = self.title if field == self.parameter_name else field.replace("_", " ")
            messages.error(request, f"{title}: {error['msg']}")
        except InvalidInput as exc:
            messages.error(request, f"{self.title}: {exc.message}")
        return queryset.none()


class InputFilter(RunFilter):
    """A run filter typed into a text box (values that no list holds)."""

    template = "admin/audit/input_filter.html"
    placeholder = ""
    input_type = "text"

    def __init__(self, request, params, model, model_admin):
        self.other_params = [(k, v) for k, v in request.GET.items() if k not in (self.parameter_name, "p", "e")]
        super().__init__(request, params, model, model_admin)

    def lookups(self, request, model_admin):
        return ()

    def has_output(self):
        return True

    def choices(self, changelist):
        yield {
            "selected": self.value() in (None, ""),
            "query_string": changelist.get_query_string(remove=[self.parameter_name]),
            "display": "All",
            "value": self.value() or "",
            "hidden": self.other_params,
        }


class ErrorTypeFilter(InputFilter):
    title = "error type"
    parameter_name = "error_type"
    placeholder = "model_error"


class UserFilter(InputFilter):
    title = "user"
    parameter_name = "user"
    placeholder = "username or id"


class CreatedFromFilter(InputFilter):
    title = "created from"
    parameter_name = "from"
    placeholder = "2026-11-30T06:00"
    input_type = "datetime-local"


class CreatedToFilter(InputFilter):
    title = "created before"
    parameter_name = "to"
    placeholder = "2026-11-30T18:00"
    input_type = "datetime-local"


class MinDurationFilter(InputFilter):
    title = "duration at least (ms)"
    parameter_name = "min_duration_ms"
    placeholder = "5000"
    input_type = "number"


class StatusFilter(RunFilter):
    """``?status=failed`` or several, ``?status=failed,cancelled``."""

    title = "status"
    parameter_name = "status"

    def lookups(self, request, model_admin):
        return AgentRun.Status.choices


class ToolFilter(RunFilter):
    """Tools of the built-in agents, the researcher's ``task`` included
    (no ``SELECT DISTINCT``); any other
    tool name works in the URL (``?tool=name``)."""

    title = "tool"
    parameter_name = "tool"
    # One tool row with the name and the status, as the API asks: apart,
    # they found a run whose other tool failed, with a second EXISTS.
    together = ("tool_status",)

    def lookups(self, request, model_admin):
        names = dict.fromkeys([tool.name for tool in ASSISTANT_TOOLS] + list(RESEARCHER_TOOL_NAMES))
        return [(name, name) for name in names]


class ToolStatusFilter(RunFilter):
    title = "tool status"
    parameter_name = "tool_status"

    def queryset(self, request, queryset):
        if request.GET.get(ToolFilter.parameter_name):
            return queryset  # applied with the tool (ToolFilter.together)
        return super().queryset(request, queryset)

    def lookups(self, request, model_admin):
        return Message.ExecutionStatus.choices


class RejectedFilter(RunFilter):
    title = "rejected approval"
    parameter_name = "rejected"

    def lookups(self, request, model_admin):
        return [("true", "has a rejected approval"), ("false", "has none")]


class ReplayFilter(admin.SimpleListFilter):
    """Replayed runs (``replay_of`` set, R-REPLAY-2) or the others."""

    title = "replays"
    parameter_name = "replay"

    def lookups(self, request, model_admin):
        return [("yes", "yes"), ("no", "no")]

    def queryset(self, request, queryset):
        if self.value() == "yes":
            return queryset.exclude(replay_of="")
        if self.value() == "no":
            return queryset.counted()
        return queryset


def status_badge(status: str | None) -> str:
    return format_html('<span class="yx-badge yx-status-{}">{}</span>', status or "none", status or "—")


def duration_text(start: dt.datetime | None, end: dt.datetime | None) -> str:
    if start is None:
        return "—"
    seconds = ((end or timezone.now()) - start).total_seconds()
    text = f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"
    return text if end else f"{text} (running)"


#: The run whose turn rolled the outer run's turn back (R-API-2), or null:
#: a primary-key lookup per run shown.
_ROLLED_BACK_BY = Subquery(RunRollback.objects.filter(run_id=OuterRef("pk")).values("by_run_id")[:1])

#: The newest replays of a run shown on its page.
REPLAYS_SHOWN = 10


@admin.register(AgentRun)
class AgentRunAdmin(ActionCheckboxMixin, ReadOnlyAdminMixin, admin.ModelAdmin):
    """Runs, newest first; the run page shows the audit timeline."""

    change_form_template = "admin/audit/agentrun/change_form.html"
    timeline_template = "admin/audit/timeline.html"
    # What fits at 1280 px beside the filters; thread, agent, ids and times
    # of each step are on the run page.
    list_display = (
        "short_id",
        "status_display",
        "created_display",
        "user",
        "model_display",
        "calls",
        "tokens",
        "cost",
        "duration",
    )
    list_filter = (
        StatusFilter,
        ErrorTypeFilter,
        AgentFilter,
        ModelFilter,
        UserFilter,
        ToolFilter,
        ToolStatusFilter,
        RejectedFilter,
        ReplayFilter,
        MinDurationFilter,
        CreatedFromFilter,
        CreatedToFilter,
        ("created_at", admin.DateFieldListFilter),
    )
    search_help_text = (
        "A run, thread or turn id (or its first 8 characters), a request id, a tool call id, "
        'or words of the messages and audit rows ("a phrase", or, -word).'
    )
    actions = ("export_jsonl", "export_csv")
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
                    "replay_of_display",
                    ("usage_text", "cost_text", "duration"),
                    ("created_full", "started_display", "finished_display"),
                    "error_type",
                    "output_message_link",
                    "export_links",
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
                    ("lease_owner", "fencing_token", "attempt", "lease_expires_at"),
                    "trace_id",
                    "cancel_requested_display",
                    "seal_display",
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

    @admin.display(description="seal")
    def seal_display(self, run):
        """The run's seal (R-GOV-3): head, row count and when; runs that
        ended before sealing existed are unsealed."""
        if run.sealed_at is None:
            return "unsealed"
        rows = run.seal_row_count
        # From seal version 4 the run's own facts are sealed too.
        scope = "the run and " if (run.seal_version or 1) >= 4 else ""
        return format_html(
            "<code>{}</code> over {}{} row{}, {}",
            run.seal_head,
            scope,
            rows,
            "" if rows == 1 else "s",
            time_html(run.sealed_at),
        )

    # Read-only (ReadOnlyAdminMixin): workers write runs (R-RUN-4).

    # --- changelist ---------------------------------------------------------

    @admin.display(description="model", ordering="model")
    def model_display(self, run):
        """The run's model name, wrapping only between its parts (issue 37)."""
        return model_html(run.model) if run.model else self.get_empty_value_display()

    def get_queryset(self, request):
        return selectors.with_operation_counts(super().get_queryset(request)).annotate(
            cost_usd=cost_of(Message.objects.model_calls()),
            rolled_back_by_id=_ROLLED_BACK_BY,
        )

    def get_search_results(self, request, queryset, search_term):
        """Ids (whole or their first 8+ hex digits), request ids and tool
        call ids through B-tree indexes; words through the GIN-indexed
        full-text search of :mod:`audit.reads.search` (R-ADM-2). A ``LIKE
        '%term%'`` over millions of rows is never run."""
        term = search_term.strip()
        if not term:
            return queryset, False
        size = self._walk_size(request)
        walk = search.PageWalk(runs=queryset, size=size) if size is not None else None
        return queryset.filter(search.search_condition(term, walk=walk)), False

    def _walk_size(self, request) -> int | None:
        """How many runs the list's search must find for the page asked for,
        plus one (more pages follow), when the list is in its own order
        (newest first); None when the user sorted by a column or asked for
        all rows, and for an action (its "select all" means every match).
        Words many rows hold are then looked for in the newest runs,
        stopping when the page is full (R-ADM-2, :class:`search.PageWalk`):
        the count then says "at least"."""
        from django.contrib.admin.views.main import ALL_VAR, ORDER_VAR, PAGE_VAR, SEARCH_VAR

        if (
            request.method != "GET"  # an action ("select all") takes every match, not a page
            or not request.GET.get(SEARCH_VAR, "").strip()
            or ORDER_VAR in request.GET
            or ALL_VAR in request.GET
        ):
            return None
        try:
            page = max(1, int(request.GET.get(PAGE_VAR, 1)))
        except ValueError:
            page = 1
        return page * self.list_per_page + 1

    def get_paginator(self, request, queryset, per_page, orphans=0, allow_empty_first_page=True):
        paginator = super().get_paginator(request, queryset, per_page, orphans, allow_empty_first_page)
        paginator.lower_bound_at = self._walk_size(request)
        return paginator

    @admin.action(description="Export the audit of the selected runs as JSON lines")
    def export_jsonl(self, request, queryset):
        return self._export(request, queryset, "jsonl")

    @admin.action(description="Export the audit of the selected runs as CSV")
    def export_csv(self, request, queryset):
        return self._export(request, queryset, "csv")

    def _export(self, request, queryset, fmt: str):
        """The selected runs (or, with "select all", every run the filters
        match) streamed in creation order (R-ADM-2)."""
        pieces = export.render(export.records(export.runs_rows(queryset)), fmt)
        return export.streaming_response(request, pieces, fmt=fmt, filename=export.export_filename("runs"))

    @admin.display(description="run", ordering="created_at")
    def short_id(self, run):
        return str(run.id)[:8]

    @admin.display(description="status", ordering="status")
    def status_display(self, run):
        badge = format_html('<span data-yx-live="status">{}</span>', status_badge(run.status))
        if run.replay_of:
            # Replays are kept out of every figure (issue 34): say so where
            # a run is listed.
            badge = format_html(
                '{} <span class="yx-badge yx-replay" title="replay of {}">replay</span>', badge, run.replay_of
            )
        rolled_back_by = getattr(run, "rolled_back_by_id", None)
        if rolled_back_by:
            # Its turn left the history and the memory; its rows stay (R-API-2).
            badge = format_html(
                '{} <a class="yx-badge yx-rolled-back" href="{}" title="its turn was rolled back by run {}: out of '
                "the history and the agent's memory, its audit rows kept\">rolled back</a>",
                badge,
                reverse("admin:audit_agentrun_change", args=[rolled_back_by]),
                rolled_back_by,
            )
        if run.error_type:
            return format_html('{} <span class="yx-error-type">{}</span>', badge, run.error_type)
        return badge

    @admin.display(description="created", ordering="created_at")
    def created_display(self, run):
        # The one form of every admin time (issue 37); it wraps between
        # date and time to fit 1280 px.
        return time_html(run.created_at)

    @admin.display(description="created")
    def created_full(self, run):
        return time_html(run.created_at)

    @admin.display(description="started")
    def started_display(self, run):
        return time_html(run.started_at)

    @admin.display(description="finished")
    def finished_display(self, run):
        return format_html('<span data-yx-live="finished">{}</span>', time_html(run.finished_at))

    @admin.display(description="cancel requested")
    def cancel_requested_display(self, run):
        return time_html(run.cancel_requested_at)

    @admin.display(description="calls")
    def calls(self, run):
        return format_html(
            '<span title="{} model calls, {} tool executions">{} / {}</span>',
            run.model_call_count,
            run.tool_execution_count,
            run.model_call_count,
            run.tool_execution_count,
        )

    @admin.display(description="export")
    def export_links(self, run):
        url = reverse("admin:audit_agentrun_export", args=[run.pk])
        return format_html(
            '<a class="yx-export" href="{}?format=jsonl">JSON lines</a> · <a class="yx-export" href="{}?format=csv">CSV</a>',
            url,
            url,
        )

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

    @admin.display(description="cost", ordering="cost_usd")
    def cost(self, run):
        return cost_text(run.cost_usd)

    @admin.display(description="duration")
    def duration(self, run):
        return format_html(
            '<span data-yx-live="duration">{}</span>',
            duration_text(run.started_at, run.finished_at if run.is_terminal else None),
        )

    # --- run page -----------------------------------------------------------

    def get_object(self, request, object_id, from_field=None):
        # change_view reads the run for the timeline and Django reads it
        # again for the form: one query per request. Not the list's query:
        # its per-run counts and cost are correlated aggregates over every
        # row of the run (27 ms for a 20,000-row run), and the page shows
        # neither (its cost is the summary's, run_cost).
        cache = request.__dict__.setdefault("_agent_run_objects", {})
        if object_id not in cache:
            try:
                pk = uuid.UUID(str(object_id))
            except ValueError:
                return None
            run = (
                super()
                .get_queryset(request)
                .select_related("user", "thread", "output_message", "resumed_from")
                .annotate(rolled_back_by_id=_ROLLED_BACK_BY)
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

    @admin.display(description="replay")
    def replay_of_display(self, run):
        """What a replayed run replays (R-REPLAY-2): a link to the recorded
        run when that is a run id here, else the scenario file's path."""
        if not run.replay_of:
            return "not a replay"
        try:
            recorded = uuid.UUID(run.replay_of)
        except ValueError:
            return format_html("Replay of <code>{}</code>", run.replay_of)
        if not AgentRun.objects.filter(pk=recorded).exists():
            return format_html("Replay of run <code>{}</code> (not in this audit)", run.replay_of)
        url = reverse("admin:audit_agentrun_change", args=[recorded])
        return format_html('Replay of run <a href="{}">{}</a>', url, str(recorded)[:8])

    @admin.display(description="input")
    def input_text(self, run):
        return json.dumps(run.input, ensure_ascii=False, indent=1)

    @admin.display(description="usage")
    def usage_text(self, run):
        return format_html('<span data-yx-live="usage">{}</span>', run_usage_text(run))

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
            path(
                "<uuid:run_id>/export/",
                self.admin_site.admin_view(self.export_view),
                name="audit_agentrun_export",
            ),
            path(
                "<uuid:run_id>/payload/<int:row_id>/<str:part>/",
                self.admin_site.admin_view(self.payload_view),
                name="audit_agentrun_payload",
            ),
            path(
                "<uuid:run_id>/replay/",
                self.admin_site.admin_view(self.replay_view),
                name="audit_agentrun_replay",
            ),
            *super().get_urls(),
        ]

    def change_view(self, request, object_id, form_url="", extra_context=None):
        run = self.get_object(request, object_id)
        extra_context = dict(extra_context or {})
        if run is not None and self.has_view_permission(request, run):
            extra_context.update(self.timeline_context(request, run))
            extra_context["replays"] = list(run.replays.all()[:REPLAYS_SHOWN])
            extra_context["replay_url"] = reverse("admin:audit_agentrun_replay", args=[run.pk])
        return super().change_view(request, object_id, form_url, extra_context)

    def timeline_view(self, request, run_id):
        """The timeline fragment alone, for the run page's live refresh."""
        run = AgentRun.objects.filter(pk=run_id).first()
        if run is None:
            raise Http404("run not found")
        if not self.has_view_permission(request, run):
            raise PermissionDenied
        return TemplateResponse(request, self.timeline_template, self.timeline_context(request, run))

    def export_view(self, request, run_id):
        """The run's whole audit as a download, ``?format=jsonl|csv`` (R-ADM-2)."""
        run = AgentRun.objects.filter(pk=run_id).only("id").first()
        if run is None:
            raise Http404("run not found")
        if not self.has_view_permission(request, run):
            raise PermissionDenied
        fmt = request.GET.get("format", "jsonl")
        if fmt not in export.FORMATS:
            raise Http404("unknown export format")
        pieces = export.render(export.records(export.run_rows(run.pk)), fmt)
        return export.streaming_response(request, pieces, fmt=fmt, filename=export.export_filename("run", run.pk))

    def payload_view(self, request, run_id, row_id, part):
        """One payload of one audit row of the run, whole, as plain text:
        ``part`` is ``content``, ``tool_calls``, ``tool_input`` or
        ``raw_output`` (JSON parts indented as on the run page). The run
        page carries the first :data:`PAYLOAD_PREVIEW_CHARS` characters
        and fetches the rest from here when a row is expanded (R-ADM-1,
        issue 37). Staff who may view runs only (raw tool output is staff
        data, R-READ-5)."""
        if part not in PAYLOAD_PARTS:
            raise Http404("unknown payload part")
        if not self.has_view_permission(request):
            raise PermissionDenied
        row = Message.objects.filter(pk=row_id, run_id=run_id, operation_id__isnull=False).first()
        if row is None:
            raise Http404("row not found")
        item = visible(selectors.timeline_item(row, include_raw_output=True))
        text = item["content"] if part == "content" else _pretty(item[part])
        response = HttpResponse(text or "", content_type="text/plain; charset=utf-8")
        # Staff data: not kept by shared caches.
        response["Cache-Control"] = "private, no-store"
        return response

    def replay_view(self, request, run_id):
        """POST: ask for a replay of the run's turn (R-REPLAY-2); a worker
        runs it with the recorded tool results and the run page shows the
        report. Staff who may view the run may ask; GET is 405."""
        if request.method != "POST":
            return HttpResponseNotAllowed(["POST"])
        run = AgentRun.objects.filter(pk=run_id).first()
        if run is None:
            raise Http404("run not found")
        if not self.has_view_permission(request, run):
            raise PermissionDenied
        replay_request(run_id=run.pk, user=request.user)
        self.message_user(
            request,
            "Replay asked for: a worker runs the turn again against its recorded answers; "
            "the report appears below when it is done.",
            messages.SUCCESS,
        )
        return HttpResponseRedirect(reverse("admin:audit_agentrun_change", args=[run.pk]) + "#yx-replays-title")

    def timeline_context(self, request, run: AgentRun) -> dict:
        """Rows of one page of the run's timeline (``?before=<cursor>``
        pages back) with their waterfall geometry (R-ADM-1, R-READ-3)."""
        return timeline_page_context(
            request,
            lambda before: selectors.run_timeline(run_id=run.pk, before=before),
            base_url=reverse("admin:audit_agentrun_change", args=[run.pk]),
            live=not run.is_terminal,
            refresh_url=reverse("admin:audit_agentrun_timeline", args=[run.pk]),
            extra={
                "run": run,
                "approval": approval_display(selectors.approval_of(run)),
                "run_live": {
                    "status": status_badge(run.status),
                    "usage": run_usage_text(run),
                    "duration": duration_text(run.started_at, run.finished_at if run.is_terminal else None),
                    "finished": time_html(run.finished_at),
                },
            },
        )


def timeline_page_context(
    request,
    read_page,
    *,
    base_url: str,
    live: bool = False,
    refresh_url: str = "",
    show_run: bool = False,
    by_run: bool = False,
    extra: dict | None = None,
) -> dict:
    """Template context of ``admin/audit/timeline.html`` for one timeline
    page. ``read_page(before)`` returns a :class:`selectors.TimelinePage`
    (``before`` is the ``?before=`` cursor or ``None``); a malformed cursor
    shows the newest page. ``live`` turns on the self-refresh (newest page
    only); ``show_run`` adds a run column. ``by_run`` (thread timelines)
    groups the rows by run, each run on its own waterfall axis, the newest
    :data:`RUN_GROUPS_OPEN` runs open and older ones collapsed
    (``timeline_groups``, issue 37)."""
    before = request.GET.get("before") or None
    try:
        page = read_page(before)
    except InvalidInput:
        before, page = None, read_page(None)
    now = timezone.now()
    # HTML cannot carry U+0000 or lone surrogates: show the escaped form (R-RUN-11).
    rows = [visible(selectors.timeline_item(row, include_raw_output=True)) for row in page.items]
    # One waterfall axis per run when grouped: on one axis for the whole
    # thread, a 40-turn thread's calls were 1-2 px bars (issue 37).
    axes: dict = {}
    for r in rows:
        axes.setdefault(r["run_id"] if by_run else None, []).append(r)
    axes = {key: _axis(of_axis, now, live) for key, of_axis in axes.items()}
    for row, r in zip(page.items, rows, strict=True):
        t0, span = axes[r["run_id"] if by_run else None]
        r["status_badge"] = status_badge(r["status"])
        # The configured model name (``replay:...``), as everywhere else.
        r["label"] = r["tool_name"] if r["kind"] == "tool" else getattr(row, "run_model", None) or "model call"
        # An answer that declares tool calls asks for them (an interrupted
        # run's call waiting for approval): no final answer, no feedback.
        r["asks_for_tools"] = r["kind"] == "model" and row.message_type == Message.Type.TEXT and row.asks_for_tools
        r["tool_calls_json"] = _pretty(r["tool_calls"])
        r["tool_input_json"] = _pretty(r["tool_input"])
        r["raw_output_json"] = _pretty(r.get("raw_output"))
        for part, key in PAYLOAD_PARTS.items():
            r[key], r[f"{part}_cut"] = _preview(r[key], run_id=r["run_id"], row_id=r["id"], part=part)
        r["usage_text"] = _usage_text(r["usage"])
        # cost_usd is already the API's decimal string here (R-COST-1).
        closed_model_call = r["kind"] == "model" and r["status"] != "running"
        r["cost_text"] = (f"${r['cost_usd']}" if r["cost_usd"] is not None else "—") if closed_model_call else ""
        r["bar"] = _bar(r, t0, span, now, live)
        # A subagent's calls name the subagent (``lc_agent_name``) beside the row.
        r["agent_name"] = (r["metadata"] or {}).get("agent_name") if r["namespace"] else None
        if show_run:
            r["run_url"] = reverse("admin:audit_agentrun_change", args=[r["run_id"]])
    rows = nest_timeline_rows(rows)
    groups = run_groups(rows) if by_run else None
    return {
        **(extra or {}),
        "timeline_rows": rows,
        # Values escaped by rows_html, as the template would have.
        "timeline_rows_html": "" if by_run else mark_safe("".join(rows_html(rows, show_run=show_run))),  # noqa: S308
        "timeline_groups": groups,
        "timeline_truncated": page.truncated,
        "timeline_older_url": f"{base_url}?before={page.next_before}" if page.next_before else None,
        "timeline_newest_url": base_url if before else None,
        "timeline_live": live and before is None,
        "timeline_refresh_url": refresh_url,
        "timeline_limit": selectors.TIMELINE_MAX_ROWS,
        "timeline_show_run": show_run,
    }


#: Runs of a thread timeline shown open; older runs are collapsed.
RUN_GROUPS_OPEN = 3


def run_groups(rows: list[dict]) -> list[dict]:
    """The rows of a thread timeline page (nested, in display order) by
    run, in the page's order (oldest run first), each ``{run_id, run_url,
    short_id, status_badge, model, created, duration, calls, open,
    rows_html, rows_url}``: ``calls`` counts the run's rows on this page,
    ``open`` is true for the newest :data:`RUN_GROUPS_OPEN` runs. Only
    those carry their rows (``rows_html``); a collapsed run carries the URL
    of its timeline fragment (``rows_url``), which ``static/audit/timeline.js``
    loads when it is opened, so that the page's weight is that of the runs
    shown. One query reads the runs (R-ADM-1, issue 37)."""
    by_run: dict = {}
    for r in rows:
        by_run.setdefault(r["run_id"], []).append(r)
    runs = AgentRun.objects.only("id", "status", "model", "created_at", "started_at", "finished_at").in_bulk(by_run)
    groups = []
    for index, (run_id, of_run) in enumerate(by_run.items()):
        run = runs.get(run_id)
        is_open = index >= len(by_run) - RUN_GROUPS_OPEN
        groups.append(
            {
                "run_id": run_id,
                "run_url": reverse("admin:audit_agentrun_change", args=[run_id]),
                "short_id": str(run_id)[:8],
                "status_badge": status_badge(run.status if run else None),
                "model": run.model if run else "",
                "created": time_html(run.created_at) if run else "—",
                "duration": duration_text(run.started_at, run.finished_at if run.is_terminal else None) if run else "—",
                "calls": len(of_run),
                "open": is_open,
                # Values escaped by rows_html, as the template would have.
                "rows_html": mark_safe("".join(rows_html(of_run, show_run=False))) if is_open else None,  # noqa: S308
                "rows_url": None if is_open else reverse("admin:audit_agentrun_timeline", args=[run_id]),
            }
        )
    return groups


_INDENT_EM = 1.4


def nest_timeline_rows(rows: list[dict]) -> list[dict]:
    """The timeline rows of one page (display dicts of
    :func:`selectors.timeline_item`, in display order) with each subagent's
    calls moved under the tool row that spawned them — same run, its
    ``operation_id`` is their ``parent_operation_id`` — in their own order,
    nested as deep as subagents nest (R-SUB-1, R-ADM-1). Each row gains
    ``depth`` (0 at the root), ``indent_em`` (its operation cell's indent),
    ``ancestor_ids`` (space-separated ids of the rows it is nested under,
    for collapsing) and ``descendants`` (how many rows are nested under it).
    A row whose spawning tool row is on another page stays where it is,
    at depth 0, with ``parent_elsewhere`` set."""
    spawners = {(r["run_id"], r["operation_id"]): r for r in rows if r["kind"] == "tool"}
    children: dict[int, list[dict]] = {}
    roots: list[dict] = []
    for r in rows:
        parent = spawners.get((r["run_id"], r["parent_operation_id"])) if r["parent_operation_id"] else None
        r["parent_elsewhere"] = bool(r["parent_operation_id"]) and parent is None
        if parent is None or parent is r:
            roots.append(r)
        else:
            children.setdefault(parent["id"], []).append(r)
    ordered: list[dict] = []

    def place(r: dict, ancestors: list[int]) -> int:
        r["depth"] = len(ancestors)
        r["indent_em"] = round(len(ancestors) * _INDENT_EM, 2)
        r["ancestor_ids"] = " ".join(str(a) for a in ancestors)
        ordered.append(r)
        count = 0
        for child in children.get(r["id"], []):
            if child["id"] not in ancestors:  # never loops, even on odd data
                count += 1 + place(child, [*ancestors, r["id"]])
        r["descendants"] = count
        return count

    for r in roots:
        place(r, [])
    placed = {id(r) for r in ordered}
    for r in rows:  # unreachable only on inconsistent data: shown, not lost
        if id(r) not in placed:
            place(r, [])
    return ordered


def approval_display(approval: dict | None) -> dict | None:
    """:func:`selectors.approval_of` with pretty JSON arguments and each
    action request's decision beside it, for ``admin/audit/approval.html``."""
    if approval is None:
        return None
    decisions = approval["decisions"] or []
    actions = []
    for i, action in enumerate(approval["action_requests"]):
        decision = decisions[i] if i < len(decisions) and isinstance(decisions[i], dict) else None
        actions.append(
            {
                **action,
                "args_json": _pretty(action["args"]) or "{}",
                "decision": decision and {**decision, "args_json": _pretty(decision.get("args"))},
            }
        )
    return {**approval, "action_requests": actions}


def run_usage_text(run: AgentRun) -> str:
    """Tokens of a run; while it runs, the sum of its finished calls so far."""
    usage = run.usage
    if usage is None and not run.is_terminal:
        usage = selectors.usage_so_far(run.pk)
    if not usage:
        return "—"
    text = _usage_text(usage)
    if usage.get("unknown_calls"):
        text += f" (+{usage['unknown_calls']} call(s) with unknown usage)"
    return text if run.is_terminal else f"{text} so far"


def _pretty(value) -> str | None:
    """``value`` as indented JSON for display, or None when empty. orjson
    (the standard encoder with an indent is pure Python: 500 rows of tool
    input and output took a tenth of the run page); what orjson refuses —
    a lone surrogate, an integer above 64 bits — by the standard encoder."""
    if value in (None, "", [], {}):
        return None
    try:
        return orjson.dumps(value, default=str, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS).decode()
    except orjson.JSONEncodeError:
        return json.dumps(value, ensure_ascii=False, indent=2, default=str)


def _preview(text: str | None, *, run_id, row_id: int, part: str) -> tuple[str | None, dict | None]:
    """``text`` cut to its first :data:`PAYLOAD_PREVIEW_CHARS` characters,
    and, when cut, ``{shown, total, url}``: characters shown, characters in
    all (both as text with thousands separators) and the payload view's
    URL of the whole text (issue 37)."""
    if not text or len(text) <= PAYLOAD_PREVIEW_CHARS:
        return text, None
    url = reverse("admin:audit_agentrun_payload", args=[run_id, row_id, part])
    return text[:PAYLOAD_PREVIEW_CHARS], {"shown": f"{PAYLOAD_PREVIEW_CHARS:,}", "total": f"{len(text):,}", "url": url}


def _usage_text(usage: dict | None) -> str:
    if not usage:
        return "—"
    parts = [f"{usage.get(k)} {label}" for k, label in (("input_tokens", "in"), ("output_tokens", "out")) if k in usage]
    total = usage.get("total_tokens")
    return " / ".join(parts) + (f" = {total}" if total is not None else "")


def _axis(rows: list[dict], now: dt.datetime, live: bool) -> tuple[dt.datetime | None, float | None]:
    """The waterfall axis of ``rows``: its start and its span in seconds
    (None, None when no row started)."""
    starts = [r["started_at"] for r in rows if r["started_at"]]
    ends = [r["finished_at"] or (now if live else r["started_at"]) for r in rows if r["started_at"]]
    t0 = min(starts, default=None)
    span = max((max(ends) - t0).total_seconds(), 0.001) if t0 and ends else None
    return t0, span


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
