"""Budgets: a spending limit per user, or the default for every user
without one, per day or per month (R-COST-3)."""

from __future__ import annotations

from decimal import Decimal

from django.conf import settings
from django.core.validators import MinValueValidator
from django.db import models
from django.db.models import F, Q, Value
from django.db.models.functions import Coalesce


class Budget(models.Model):
    """A limit in USD on what one user's model calls may cost in one period
    (a calendar day or month in ``BUDGET_TIME_ZONE``). ``user`` null is the
    default budget of every user who has none of their own; there is at
    most one default. Spend is always summed from the model rows."""

    class Period(models.TextChoices):
        DAY = "day"
        MONTH = "month"

    user = models.OneToOneField(
        settings.AUTH_USER_MODEL,
        on_delete=models.CASCADE,
        null=True,
        blank=True,
        related_name="budget",
        help_text="Empty: the default budget of every user without one of their own.",
    )
    limit_usd = models.DecimalField(
        "limit (USD)", max_digits=18, decimal_places=6, validators=[MinValueValidator(Decimal("0"))]
    )
    period = models.CharField(max_length=10, choices=Period.choices)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            models.CheckConstraint(condition=Q(limit_usd__gte=0), name="budget_limit_not_negative"),
            models.CheckConstraint(condition=Q(period__in=["day", "month"]), name="budget_period_known"),
            # One budget per user and a single default (user null -> 0).
            models.UniqueConstraint(Coalesce(F("user"), Value(0)), name="budget_one_per_user_or_default"),
        ]

    def __str__(self) -> str:
        who = self.user.get_username() if self.user_id else "default"
        return f"{who}: {self.limit_usd} USD per {self.period}"
