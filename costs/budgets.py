"""Budgets that stop spending (R-COST-3).

Two checks, both against the spend summed from the model rows
(:func:`costs.selectors.spent_usd`) in the current period — the calendar
day or month in ``BUDGET_TIME_ZONE`` — of the budget that applies to the
user (their own, else the default, else none):

* **Admission** (:func:`budget_admit`), in the transaction that creates a
  run (turn or resume). Refused — :class:`BudgetExceeded`, HTTP 402, and
  the transaction creates nothing — when the spend has reached the limit,
  or when the spend plus ``BUDGET_RUN_RESERVE_USD`` for each of the user's
  unfinished runs, the new one included, would pass it. The reserve is
  what makes "fits" meaningful before any call has a cost: a budget with
  room for one more run admits one, not every submission that arrives at
  the same moment.
* **Before each model call**, in the statement that opens the call's
  model row before the request is sent (:func:`budget_allows_sql`, the
  condition of that insert — ``audit.ledger.model_call_open``), and when
  that statement opened nothing, by :func:`budget_check_running`, which
  names the limit and the spend: when the spend has reached the limit, no
  row opens and the call is not made; the run ends ``failed`` with error
  type ``budget_exceeded`` and its rows are closed as for any failure. The
  budget that applies and the spend are read at each call, so a budget set
  while a run runs counts at its next call.
"""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import zoneinfo
from decimal import Decimal
from typing import Any

from django.db import connection, transaction
from django.utils import timezone

from core.config import get_config
from core.db import execute_prepared, stand_ins_bound, stand_ins_checked
from core.errors import ApplicationError

from .models import Budget
from .selectors import spent_usd, usd_text


class BudgetExceeded(ApplicationError):
    """The user's budget for the current period has no room (R-COST-3).

    The API answers 402 with ``{"error": "budget_exceeded", "limit_usd",
    "spent_usd", "period", "reserved_usd", "run_reserve_usd", "message"}``
    (amounts as decimal strings, USD; ``run_reserve_usd`` is the reserve the
    refused run needed, ``BUDGET_RUN_RESERVE_USD``, given by admission). The
    message says which of two things happened: the budget is used up (the
    spend and the unfinished runs' reserves reach the limit), or what is left
    is less than the new run's reserve. A run stopped by it ends ``failed``
    with error type ``budget_exceeded``."""

    code = "budget_exceeded"
    http_status = 402

    def __init__(
        self,
        *,
        limit_usd: Decimal,
        spent_usd: Decimal,
        period: str,
        reserved_usd: Decimal = Decimal(0),
        run_reserve_usd: Decimal | None = None,
    ):
        held = f", {usd_text(reserved_usd)} USD held by unfinished runs" if reserved_usd else ""
        left = limit_usd - spent_usd - reserved_usd
        if run_reserve_usd is not None and left > 0:
            # Room is left, but less than a run reserves: "used up" would be false.
            message = (
                f"the {period} budget of {usd_text(limit_usd)} USD has {usd_text(left)} USD left "
                f"({usd_text(spent_usd)} USD spent{held}), less than the reserve of {usd_text(run_reserve_usd)} USD "
                "a new run needs (BUDGET_RUN_RESERVE_USD)"
            )
        else:
            message = (
                f"the {period} budget of {usd_text(limit_usd)} USD is used up: {usd_text(spent_usd)} USD spent{held}"
            )
        extra = {
            "limit_usd": usd_text(limit_usd),
            "spent_usd": usd_text(spent_usd),
            "period": period,
            "reserved_usd": usd_text(reserved_usd),
        }
        if run_reserve_usd is not None:
            extra["run_reserve_usd"] = usd_text(run_reserve_usd)
        super().__init__(message, extra=extra)

    def body(self) -> dict[str, Any]:
        """The 402 body: the contract's flat shape."""
        return {"error": self.code, **self.extra, "message": self.message}


def budget_for(user_id: int) -> Budget | None:
    """The budget that applies to the user: their own, else the default."""
    budgets = list(Budget.objects.filter(user_id=user_id) | Budget.objects.filter(user__isnull=True))
    return next((b for b in budgets if b.user_id == user_id), None) or (budgets[0] if budgets else None)


def period_start(period: str, *, now: dt.datetime | None = None) -> dt.datetime:
    """Start (aware) of the current ``day`` or ``month`` in
    ``BUDGET_TIME_ZONE``."""
    zone = zoneinfo.ZoneInfo(get_config().BUDGET_TIME_ZONE)
    today = (now or timezone.now()).astimezone(zone).date()
    first = today.replace(day=1) if period == Budget.Period.MONTH else today
    return dt.datetime.combine(first, dt.time.min, tzinfo=zone)


def budget_admit(*, user, now: dt.datetime | None = None) -> None:
    """Admit one more run of ``user`` under their budget, or refuse it.

    Must be called inside ``transaction.atomic()``, in the transaction that
    creates the run, after the thread lock (lock order: thread, then this
    lock). On PostgreSQL it takes a transaction-scoped advisory lock keyed
    by the user (``pg_advisory_xact_lock``), held until commit, so two
    submissions of one user — in different threads too — check one after
    the other and the second one sees the first one's run among the
    unfinished runs. An advisory lock rather than a row lock: users under
    the default budget have no row of their own, locking the default row
    would serialise every user, and locking the ``auth_user`` row would
    collide with unrelated writes (logins). Users without a budget take no
    lock.

    Raises:
        BudgetExceeded: spend ≥ limit, or spend + reserve × (unfinished
            runs + 1) > limit (see the module docstring).
    """
    from audit.models import AgentRun

    if not transaction.get_connection().in_atomic_block:
        raise RuntimeError("budget_admit must be called inside transaction.atomic()")
    budget = budget_for(user.pk)
    if budget is None:
        return
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [_lock_key(user.pk)])
    spent = spent_usd(user_id=user.pk, since=period_start(budget.period, now=now))
    reserve = get_config().BUDGET_RUN_RESERVE_USD
    unfinished = AgentRun.objects.filter(user=user, status__in=AgentRun.ACTIVE_STATUSES).count()
    if spent >= budget.limit_usd or spent + reserve * (unfinished + 1) > budget.limit_usd:
        raise BudgetExceeded(
            limit_usd=budget.limit_usd,
            spent_usd=spent,
            period=budget.period,
            reserved_usd=reserve * unfinished,
            run_reserve_usd=reserve,
        )


def budget_check_running(*, user_id: int, now: dt.datetime | None = None) -> None:
    """Refuse the next model call of a running run when the user's spend
    in the current period has reached the limit (no reserve: the run's own
    calls are the spend). Raises :class:`BudgetExceeded`. One statement:
    no budget applies (no row), or the budget with the spend of its period."""
    found = _budget_with_spend(user_id, now=now)
    if found is None:
        return
    budget, spent = found
    if spent >= budget.limit_usd:
        raise BudgetExceeded(limit_usd=budget.limit_usd, spent_usd=spent, period=budget.period)


def _budget_with_spend(user_id: int, *, now: dt.datetime | None = None) -> tuple[Budget, Decimal] | None:
    """The budget that applies to the user (their own, else the default)
    and what they spent in its current period (the sum of
    :func:`costs.selectors.spent_calls`), in one statement of fixed text
    (prepared once per connection); None when no budget applies."""
    row = execute_prepared(*_budget_with_spend_bound(user_id, now=now))
    if row is None:
        return None
    limit_usd, period, spent = row
    budget = Budget(user_id=user_id, limit_usd=_decimal(limit_usd), period=period)
    return budget, _decimal(spent or 0)


def budget_allows_sql(user_id: int, *, now: dt.datetime | None = None) -> tuple[str, list]:
    """An SQL condition, with its parameters, that holds while the budget
    that applies to the user (if any) has room: its period's spend below
    its limit (R-COST-3). Made part of the statement that opens a model
    row, so the check costs no round trip of its own; a statement that
    opened nothing then learns why from :func:`budget_check_running`.
    ``now`` (default: now) picks the period."""
    sql, params = _budget_with_spend_bound(user_id, now=now)
    return (
        f"NOT EXISTS (SELECT FROM ({sql}) AS b(limit_usd, period, spent) WHERE COALESCE(b.spent, 0) >= b.limit_usd)",
        params,
    )


def _budget_with_spend_bound(user_id: int, *, now: dt.datetime | None) -> tuple[str, list]:
    """:func:`_budget_with_spend_sql` with this call's values bound."""
    now = now or timezone.now()
    sql, spend_params = _budget_with_spend_sql()
    values = {
        _SPEND_USER: user_id,
        _SPEND_SINCE_MONTH: period_start(Budget.Period.MONTH, now=now),
        _SPEND_SINCE_DAY: period_start(Budget.Period.DAY, now=now),
    }
    return sql, [*stand_ins_bound(spend_params, values), user_id]


def _decimal(value: Any) -> Decimal:
    return value if isinstance(value, Decimal) else Decimal(str(value))


# Stand-ins compiled into the statement in place of the user and the period
# starts, found again by identity and replaced by the real values at each
# call.
_SPEND_USER = -0x5EED
_SPEND_SINCE_MONTH = dt.datetime(1901, 1, 1, 1, 1, 1, 1, tzinfo=dt.UTC)
_SPEND_SINCE_DAY = dt.datetime(1901, 2, 2, 2, 2, 2, 2, tzinfo=dt.UTC)


@functools.cache
def _budget_with_spend_sql() -> tuple[str, tuple]:
    """The statement of :func:`_budget_with_spend` and its parameters but
    the last (the user id), with the stand-ins above in them. The spend is
    :func:`costs.selectors.spent_calls` compiled by the ORM (for the month
    and for the day; PostgreSQL evaluates the branch of the budget's
    period only)."""
    from .selectors import spent_calls

    def spend(since: dt.datetime) -> tuple[str, tuple]:
        calls = spent_calls(user_id=_SPEND_USER, since=since).order_by().values("cost_usd")
        sql, params = calls.query.get_compiler(using=connection.alias).as_sql()
        return f"(SELECT SUM(s.cost_usd) FROM ({sql}) s)", stand_ins_checked(params, _SPEND_USER, since)

    month_sql, month_params = spend(_SPEND_SINCE_MONTH)
    day_sql, day_params = spend(_SPEND_SINCE_DAY)
    budget = connection.ops.quote_name(Budget._meta.db_table)
    return (
        f"SELECT b.limit_usd, b.period, CASE WHEN b.period = '{Budget.Period.MONTH}' THEN {month_sql} "
        f"ELSE {day_sql} END FROM {budget} b WHERE b.user_id = %s OR b.user_id IS NULL "
        "ORDER BY b.user_id NULLS LAST LIMIT 1",
        (*month_params, *day_params),
    )


def _lock_key(user_id: int) -> int:
    """A signed 64-bit advisory lock key for one user's budget."""
    digest = hashlib.blake2b(f"yuxi.budget:{user_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)
