"""Admin for threads, messages, feedback and API tokens (R-ADM-1).

Audit rows (model calls and tool executions) are machine-written: the
admin shows them read-only and never adds, changes or deletes them. Large
changelists never run a full ``COUNT(*)`` nor ``SELECT DISTINCT`` filters.
"""

from __future__ import annotations

import uuid

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db.models import Q
from django.http import Http404
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils.html import format_html, format_html_join

from audit import export as audit_export
from audit.admin import cost_of, cost_text, status_badge, timeline_page_context
from audit.models import AgentRun
from audit.reads import search as audit_search
from audit.reads import selectors as audit_selectors
from audit.templatetags.yx_admin import time_column, time_html
from core.storable import visible, visible_fields
from governance.payloads import payload_note
from yuxi_project.admin_rows import ActionCheckboxMixin, ReadOnlyAdminMixin
from yuxi_project.paginator import EstimatingPaginator

from .models import ApiToken, Conversation, Message, MessageFeedback

HISTORY_ROWS = 50


def _uuid_or_none(term: str) -> uuid.UUID | None:
    try:
        return uuid.UUID(term.strip())
    except ValueError:
        return None


@admin.register(Conversation)
class ConversationAdmin(ActionCheckboxMixin, admin.ModelAdmin):
    """Threads; the page shows the ordinary history and links to the
    thread's audit timeline."""

    thread_timeline_template = "admin/conversations/conversation/timeline.html"
    list_display = ("short_id", "title", "user", "agent_id", "model", "status", "cost", "created_display")
    list_filter = ("status", ("created_at", admin.DateFieldListFilter))
    list_select_related = ("user",)
    search_fields = ("id",)  # replaced by get_search_results: exact matches only
    search_help_text = "Exact thread id or username."
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER  # one COUNT per filter option
    paginator = EstimatingPaginator
    # Who owns a thread, and which agent and model its runs used, are facts
    # of the audit (issue 37): shown, never changed here. Title and status
    # stay the owner's settings.
    readonly_fields = (
        "id",
        "user",
        "agent_id",
        "model",
        "history",
        "timeline_link",
        "created_display",
        "updated_display",
    )
    fields = ("id", "user", "agent_id", "model", "title", "status", "timeline_link", "history", "created_display")
    created_display = time_column("created_at", "created")
    updated_display = time_column("updated_at", "updated")

    def has_add_permission(self, request):
        # Threads are created through the API by their owner.
        return False

    def has_delete_permission(self, request, obj=None):
        # A thread's runs and audit rows are append-only (R-GOV-3): the
        # database refuses the cascade; erase_user erases a user's threads.
        return False

    def get_queryset(self, request):
        # Cost summed from the thread's model rows, for the page's rows only
        # unless the list is sorted by it (R-COST-2).
        return super().get_queryset(request).annotate(cost_usd=cost_of(Message.objects.model_calls(), by="thread"))

    @admin.display(description="cost (USD)", ordering="cost_usd")
    def cost(self, thread):
        return cost_text(thread.cost_usd)

    def get_search_results(self, request, queryset, search_term):
        term = search_term.strip()
        if not term:
            return queryset, False
        as_uuid = _uuid_or_none(term)
        condition = Q(user__username=term) | (Q(pk=as_uuid) if as_uuid else Q(pk__in=[]))
        return queryset.filter(condition), False

    @admin.display(description="thread", ordering="created_at")
    def short_id(self, thread):
        return str(thread.id)[:8]

    @admin.display(description="audit timeline")
    def timeline_link(self, thread):
        if thread.pk is None:
            return "—"
        url = reverse("admin:conversations_conversation_timeline", args=[thread.pk])
        export = reverse("admin:conversations_conversation_export", args=[thread.pk])
        return format_html(
            '<a class="yx-thread-timeline" href="{}">Audit timeline of this thread →</a>'
            ' · export: <a class="yx-export" href="{}?format=jsonl">JSON lines</a>'
            ' · <a class="yx-export" href="{}?format=csv">CSV</a>',
            url,
            export,
            export,
        )

    @admin.display(description=f"history (last {HISTORY_ROWS} ordinary messages)")
    def history(self, thread):
        """Ordinary messages only: audit rows are on the timeline (R-READ-4)."""
        if thread.pk is None:
            return "—"
        rows = list(Message.objects.ordinary().filter(thread=thread).order_by("-id")[:HISTORY_ROWS])[::-1]
        if not rows:
            return "—"
        return format_html(
            '<ol class="yx-history">{}</ol>',
            format_html_join(
                "", "<li><strong>{}</strong>: {}</li>", ((m.role, visible(m.content[:500])) for m in rows)
            ),
        )

    def get_urls(self):
        return [
            path(
                "<uuid:thread_id>/timeline/",
                self.admin_site.admin_view(self.thread_timeline_view),
                name="conversations_conversation_timeline",
            ),
            path(
                "<uuid:thread_id>/export/",
                self.admin_site.admin_view(self.thread_export_view),
                name="conversations_conversation_export",
            ),
            *super().get_urls(),
        ]

    def thread_export_view(self, request, thread_id):
        """Every run of the thread as a download, ``?format=jsonl|csv``
        (R-ADM-2); staff with view permission on runs."""
        thread = Conversation.objects.filter(pk=thread_id).only("id").first()
        if thread is None:
            raise Http404("thread not found")
        if not self.admin_site._registry[AgentRun].has_view_permission(request):
            raise PermissionDenied
        fmt = request.GET.get("format", "jsonl")
        if fmt not in audit_export.FORMATS:
            raise Http404("unknown export format")
        pieces = audit_export.render(audit_export.records(audit_export.thread_rows(thread.pk)), fmt)
        return audit_export.streaming_response(
            request, pieces, fmt=fmt, filename=audit_export.export_filename("thread", thread.pk)
        )

    def thread_timeline_view(self, request, thread_id):
        """The audit timeline of every run of the thread (R-READ-3), paged
        back with ``?before=<cursor>``; staff with view permission on runs."""
        thread = Conversation.objects.select_related("user").filter(pk=thread_id).first()
        if thread is None:
            raise Http404("thread not found")
        if not self.admin_site._registry[AgentRun].has_view_permission(request):
            raise PermissionDenied
        context = {
            **self.admin_site.each_context(request),
            "title": f"Audit timeline of thread {thread}",
            "opts": self.model._meta,
            "thread": thread,
            **timeline_page_context(
                request,
                lambda before: audit_selectors.thread_timeline(thread_id=thread.pk, before=before),
                base_url=reverse("admin:conversations_conversation_timeline", args=[thread.pk]),
                by_run=True,
            ),
        }
        return TemplateResponse(request, self.thread_timeline_template, context)


class AuditRowFilter(admin.SimpleListFilter):
    title = "row"
    parameter_name = "row"

    def lookups(self, request, model_admin):
        return [("ordinary", "ordinary messages"), ("audit", "audit rows")]

    def queryset(self, request, queryset):
        if self.value() == "ordinary":
            return queryset.ordinary()
        if self.value() == "audit":
            return queryset.audit()
        return queryset


@admin.register(Message)
class MessageAdmin(ActionCheckboxMixin, admin.ModelAdmin):
    """All messages. Audit rows are read-only; nothing is added here."""

    # What fits at 1280 px beside the filters; the row's page has the rest.
    list_display = (
        "id",
        "run_short",
        "message_type",
        "operation_short",
        "status_display",
        "sequence",
        "created_display",
    )
    list_filter = (AuditRowFilter, "message_type", "role", "execution_status")

    class Media:
        css = {"all": ("audit/timeline.css",)}

    list_select_related = ()
    search_fields = ("operation_id",)  # replaced by get_search_results: exact matches only
    search_help_text = (
        "A thread or run id (or its first 8 characters), an operation id, "
        'or words of the content ("a phrase", or, -word).'
    )
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER  # one COUNT per filter option
    paginator = EstimatingPaginator
    ordering = ("-id",)
    raw_id_fields = ("thread", "run", "declared_by")
    # Times are shown by time_column, in the admin's one form (issue 37):
    # the fields themselves are left out of the form.
    exclude = ("started_at", "finished_at", "created_at", "updated_at")
    readonly_fields = (
        "thread",
        "run",
        "role",
        "message_type",
        "operation_id",
        "sequence",
        "execution_status",
        "started_display",
        "finished_display",
        "duration_ms",
        "usage",
        "tool_calls",
        "tool_name",
        "tool_input",
        "declared_by",
        "workspace_file",
        "payload",
        "metadata",
        "created_full",
        "updated_display",
    )
    started_display = time_column("started_at", "started")
    finished_display = time_column("finished_at", "finished")
    created_full = time_column("created_at", "created")
    updated_display = time_column("updated_at", "updated")

    @admin.display(description="payload")
    def payload(self, message):
        """Says "payload purged on <date>" once a purge or erasure emptied it (R-GOV-1)."""
        return payload_note(message.metadata) or "—"

    @admin.display(description="workspace file")
    def workspace_file(self, message):
        """Where a large tool result was saved, per execution (R-TA-7)."""
        if message.pk is None or message.role != Message.Role.TOOL:
            return "—"
        return audit_selectors.tool_row_workspace_path(message) or "—"

    def get_actions(self, request):
        actions = super().get_actions(request)
        actions.pop("delete_selected", None)  # a bulk delete could take audit rows
        return actions

    def has_add_permission(self, request):
        return False

    def get_object(self, request, object_id, from_field=None):
        message = super().get_object(request, object_id, from_field)
        if message is not None and message.is_audit:
            # Read-only page: HTML shows unstorable characters escaped (R-RUN-11).
            visible_fields(message)
        return message

    def has_change_permission(self, request, obj=None):
        if obj is not None and obj.is_audit:
            return False
        return super().has_change_permission(request, obj)

    def has_delete_permission(self, request, obj=None):
        if obj is None or obj.is_audit:
            return False
        return super().has_delete_permission(request, obj)

    def get_search_results(self, request, queryset, search_term):
        """Indexed lookups only (R-ADM-2): ids or id prefixes, an exact
        operation id, or words through the GIN-indexed full-text search."""
        term = search_term.strip()
        if not term:
            return queryset, False
        condition = Q(operation_id=term)
        ids = audit_search.id_range(term)
        if ids:
            condition |= Q(thread__pk__range=ids) | Q(run__pk__range=ids)
        else:
            condition |= audit_search.words_condition(term, using=queryset.db)
        return queryset.filter(condition), False

    # FK columns shown as ids: no join and no per-row query.
    @admin.display(description="thread")
    def thread_short(self, message):
        return str(message.thread_id)[:8]

    @admin.display(description="operation")
    def operation_short(self, message):
        if not message.operation_id:
            return "—"
        op = message.operation_id
        return format_html('<code title="{}">{}</code>', op, op if len(op) <= 24 else op[:23] + "…")

    @admin.display(description="created", ordering="id")
    def created_display(self, message):
        return time_html(message.created_at)

    @admin.display(description="run")
    def run_short(self, message):
        return str(message.run_id)[:8] if message.run_id else "—"

    @admin.display(description="status", ordering="execution_status")
    def status_display(self, message):
        return status_badge(message.execution_status) if message.execution_status else "—"


@admin.register(MessageFeedback)
class MessageFeedbackAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    """Users' likes and dislikes, read-only (issue 37): feedback is the
    user's own word, given through the API, and its rollup deltas are
    written by ``conversations.services`` only; an edit or delete here
    would change the audit and leave the dashboard's counts behind."""

    list_display = ("id", "rating", "user", "message_excerpt", "on_audit_row", "reason", "created_display")

    class Media:
        css = {"all": ("audit/timeline.css",)}

    list_filter = ("rating", ("created_at", admin.DateFieldListFilter))
    list_select_related = ("user", "message")
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER  # one COUNT per filter option
    paginator = EstimatingPaginator
    raw_id_fields = ("message", "user")
    ordering = ("-created_at",)
    created_display = time_column("created_at", "created")

    @admin.display(description="message")
    def message_excerpt(self, feedback):
        return visible(feedback.message.content[:80])

    @admin.display(description="on audit row (not counted)")
    def on_audit_row(self, feedback):
        """A marker only where the feedback is on an audit row, which the
        dashboard does not count (R-READ-4); ordinary feedback, the normal
        case, gets a neutral dash, not the red cross of a boolean column
        (issue 37)."""
        if feedback.message.message_type == Message.Type.TEXT:
            return "—"
        return format_html(
            '<span class="yx-badge yx-on-audit-row" title="{}">audit row</span>',
            "Feedback on an audit row: not counted in the dashboard",
        )


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    """Per-user API tokens. The plaintext is shown once, when issued; only
    its digest is stored."""

    list_display = ("prefix", "user", "name", "created_display", "last_used_display")
    list_select_related = ("user",)
    raw_id_fields = ("user",)
    search_fields = ("prefix", "user__username")
    fields = ("user", "name", "prefix", "created_display", "last_used_display")
    readonly_fields = ("prefix", "created_display", "last_used_display")
    created_display = time_column("created_at", "created")
    last_used_display = time_column("last_used_at", "last used")

    def has_change_permission(self, request, obj=None):
        return obj is None and super().has_change_permission(request, obj)

    def save_model(self, request, obj, form, change):
        if change:
            return
        issued, plaintext = ApiToken.objects.issue(user=obj.user, name=obj.name)
        obj.pk, obj.prefix, obj.key_digest, obj.created_at = (
            issued.pk,
            issued.prefix,
            issued.key_digest,
            issued.created_at,
        )
        messages.warning(request, f"API token for {obj.user}: {plaintext} — copy it now; it is not shown again.")
