"""Purges, erasures and re-seals, read-only (R-GOV-1..3): written by the
governance commands only."""

from __future__ import annotations

from django.contrib import admin

from audit.templatetags.yx_admin import time_column
from yuxi_project.admin_rows import ReadOnlyAdminMixin, ReadOnlyInlineMixin

from .models import GovernanceAction, RunReseal


class RunResealInline(ReadOnlyInlineMixin, admin.TabularInline):
    model = RunReseal
    fields = ("run", "previous_head", "previous_row_count", "previous_verified", "head", "row_count", "created_display")
    readonly_fields = fields
    created_display = time_column("created_at", "created")
    raw_id_fields = ("run",)


@admin.register(GovernanceAction)
class GovernanceActionAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    list_display = (
        "id",
        "kind",
        "status",
        "actor",
        "criterion",
        "rows_changed",
        "runs_resealed",
        "runs_skipped",
        "files_deleted",
        "started_display",
        "finished_display",
    )
    list_filter = ("kind", "status")
    readonly_fields = (
        "kind",
        "status",
        "actor",
        "subject_user_id",
        "criterion",
        "rows_changed",
        "runs_resealed",
        "runs_skipped",
        "files_deleted",
        "started_display",
        "finished_display",
        "note",
    )
    fields = readonly_fields
    started_display = time_column("started_at", "started")
    finished_display = time_column("finished_at", "finished")
    inlines = (RunResealInline,)
    show_full_result_count = False
