"""Cost API schemas (R-COST-2, R-COST-3)."""

from __future__ import annotations

from typing import Literal

from ninja import Field, Schema


class BudgetExceededOut(Schema):
    """The 402 body of a turn or resume refused by the user's budget."""

    error: Literal["budget_exceeded"]
    limit_usd: str = Field(..., description="The budget, USD (decimal string).")
    spent_usd: str = Field(..., description="Spent in the current period, summed from the model rows.")
    period: Literal["day", "month"]
    reserved_usd: str = Field(..., description="Held by the user's unfinished runs (BUDGET_RUN_RESERVE_USD each).")
    run_reserve_usd: str = Field(
        ...,
        description="The reserve the refused run needed (BUDGET_RUN_RESERVE_USD); the message says when it did not fit.",
    )
    message: str
