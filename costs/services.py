"""Writes of budgets (R-COST-3). The admin and ``set_budget`` both end here
or in the same model validation."""

from __future__ import annotations

from decimal import Decimal, InvalidOperation

from django.core.exceptions import ValidationError
from django.db import transaction

from core.errors import InvalidInput

from .models import Budget


def parse_usd(text: str | Decimal) -> Decimal:
    """A non-negative, finite USD amount with at most 6 decimal places and
    12 integer digits. Raises :class:`InvalidInput`."""
    try:
        amount = text if isinstance(text, Decimal) else Decimal(str(text).strip())
    except InvalidOperation:
        raise InvalidInput(f"not an amount of USD: {text!r}", extra={"field": "usd"}) from None
    if not amount.is_finite():
        raise InvalidInput(f"not a finite amount: {text!r}", extra={"field": "usd"})
    if amount < 0:
        raise InvalidInput(f"a budget cannot be negative: {text!r}", extra={"field": "usd"})
    if amount != amount.quantize(Decimal("0.000001")) or amount >= Decimal("1e12"):
        raise InvalidInput(f"at most 12 digits before and 6 after the decimal point: {text!r}", extra={"field": "usd"})
    return amount


def budget_set(*, user, limit_usd: str | Decimal, period: str) -> Budget:
    """Set the budget of ``user`` (``None``: the default budget) to
    ``limit_usd`` USD per ``period`` (``day`` or ``month``), replacing the
    one it had. Returns the budget.

    Raises:
        InvalidInput: a negative, non-finite or over-precise amount, or an
            unknown period; nothing is changed.
    """
    amount = parse_usd(limit_usd)
    if period not in Budget.Period.values:
        raise InvalidInput(
            f"period must be one of {', '.join(Budget.Period.values)}, not {period!r}", extra={"field": "period"}
        )
    with transaction.atomic():
        budget = Budget.objects.select_for_update().filter(user=user).first() or Budget(user=user)
        budget.limit_usd, budget.period = amount, period
        try:
            budget.full_clean(validate_constraints=False)
        except ValidationError as exc:
            raise InvalidInput("; ".join(exc.messages), extra={"field": "usd"}) from None
        budget.save()
        return budget


def budget_remove(*, user) -> bool:
    """Remove the budget of ``user`` (``None``: the default). Returns
    whether there was one."""
    deleted, _ = Budget.objects.filter(user=user).delete()
    return bool(deleted)
