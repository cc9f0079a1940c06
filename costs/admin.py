"""Budgets in the admin (R-COST-3): staff set a user's limit or the
default; each row shows what was spent in the current period (summed from
the model rows)."""

from __future__ import annotations

from django.contrib import admin

from audit.templatetags.yx_admin import time_column

from .budgets import period_start
from .models import Budget
from .selectors import spent_usd, usd_text


@admin.register(Budget)
class BudgetAdmin(admin.ModelAdmin):
    list_display = ("who", "limit_usd", "period", "spent_this_period", "updated_display")
    list_filter = ("period",)
    # A searchable user picker (the User admin searches usernames and
    # emails), not a raw id to look up elsewhere (issue 37).
    autocomplete_fields = ("user",)
    search_fields = ("user__username",)
    list_select_related = ("user",)
    fields = ("user", "limit_usd", "period")
    updated_display = time_column("updated_at", "updated")

    @admin.display(description="user", ordering="user__username")
    def who(self, budget):
        return budget.user.get_username() if budget.user_id else "(default for every user without one)"

    @admin.display(description="spent this period (USD)")
    def spent_this_period(self, budget):
        if budget.user_id is None:
            return "—"
        return usd_text(spent_usd(user_id=budget.user_id, since=period_start(budget.period)))
