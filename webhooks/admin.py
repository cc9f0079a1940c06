"""Webhook deliveries and their attempts, read-only (R-API-3): written by
the delivery passes only. A failed delivery can be sent again."""

from __future__ import annotations

from django.contrib import admin, messages
from django.db.models import F
from django.utils import timezone

from audit.templatetags.yx_admin import time_column, time_html
from yuxi_project.admin_rows import ReadOnlyAdminMixin, ReadOnlyInlineMixin

from .models import WebhookAttempt, WebhookDelivery


class WebhookAttemptInline(ReadOnlyInlineMixin, admin.TabularInline):
    model = WebhookAttempt
    fields = ("number", "started_display", "duration_display", "status_code", "error")
    readonly_fields = fields
    started_display = time_column("started_at", "started")

    @admin.display(description="duration")
    def duration_display(self, attempt):
        return f"{attempt.duration_ms:,.0f} ms"


# A delivery's progress, on the list and on its page.
_OUTCOME = (
    "status",
    "attempts",
    "last_status_code",
    "last_error",
    "created_display",
    "next_attempt_display",
    "delivered_display",
)


@admin.register(WebhookDelivery)
class WebhookDeliveryAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    list_display = ("id", "run", "run_status", "receiver", *_OUTCOME)
    list_filter = ("status", "run_status")
    search_fields = ("=id", "=run__id", "url")
    readonly_fields = ("id", "run", "run_status", "run_finished_display", "url", "receiver", *_OUTCOME)
    fields = readonly_fields
    raw_id_fields = ("run",)
    created_display = time_column("created_at", "queued")
    delivered_display = time_column("delivered_at", "delivered")
    run_finished_display = time_column("run_finished_at", "run ended")
    inlines = (WebhookAttemptInline,)
    actions = ("send_again",)
    show_full_result_count = False

    @admin.display(description="next attempt", ordering="next_attempt_at")
    def next_attempt_display(self, delivery):
        """Only while the delivery is pending: a delivered, failed or
        skipped one has no next attempt (its field keeps the last claim)."""
        if delivery.status != WebhookDelivery.Status.PENDING:
            return self.get_empty_value_display()
        return time_html(delivery.next_attempt_at)

    @admin.action(description="Send the selected failed deliveries again")
    def send_again(self, request, queryset):
        """A given-up delivery gets another ``WEBHOOK_MAX_ATTEMPTS`` from
        now: its attempts so far stay listed."""
        again = queryset.filter(status=WebhookDelivery.Status.FAILED)
        changed = 0
        for delivery in again:
            changed += WebhookDelivery.objects.filter(pk=delivery.pk, status=WebhookDelivery.Status.FAILED).update(
                status=WebhookDelivery.Status.PENDING, next_attempt_at=timezone.now(), resent_after=F("attempts")
            )
        self.message_user(request, f"{changed} deliveries will be sent again.", messages.SUCCESS)
