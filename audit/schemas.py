from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any, Literal

from ninja import Field, Schema


class TurnInput(Schema):
    text: str = Field(..., min_length=1, max_length=100_000)


class RunIn(Schema):
    request_id: str = Field(..., min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:\-]+$")
    input: TurnInput


class DecisionIn(Schema):
    """One reviewer decision for one pending action request (R-TA-5)."""

    type: Literal["approve", "edit", "reject"]
    args: dict[str, Any] | None = Field(None, description="edit: the arguments the tool runs with instead.")
    message: str | None = Field(None, max_length=10_000, description="reject: the reason given to the model.")


class RunResumeIn(Schema):
    request_id: str = Field(..., min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:\-]+$")
    decisions: list[DecisionIn] = Field(..., min_length=1, max_length=100)


class UsageOut(Schema):
    input_tokens: int = 0
    output_tokens: int = 0
    total_tokens: int = 0
    # Model calls cut off before the provider reported usage: their tokens
    # are unknown, not zero.
    unknown_calls: int = 0


class RunCostOut(Schema):
    """Summed from the run's model rows (R-COST-2)."""

    total_usd: str | None = Field(None, description="USD, decimal string; null only when no call has a known cost.")
    unknown_cost_calls: int = Field(0, description="Finished model calls whose cost is unknown (never counted as 0).")


class RunOut(Schema):
    run_id: uuid.UUID
    thread_id: uuid.UUID
    turn_id: uuid.UUID
    resumed_from: uuid.UUID | None
    request_id: str
    agent_id: str
    model: str
    status: Literal["pending", "running", "cancel_requested", "completed", "failed", "cancelled", "interrupted"]
    error_type: str
    error_message: str
    output_message_id: int | None
    pending_approval: list[dict[str, Any]] | None = Field(
        None, description="The interrupt payloads (action requests and review configs) while interrupted."
    )
    usage: UsageOut | None
    cost: RunCostOut
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None

    @staticmethod
    def from_run(run) -> RunOut:
        from costs.selectors import run_cost, usd_text

        cost = run_cost(run.id)
        return RunOut(
            run_id=run.id,
            thread_id=run.thread_id,
            turn_id=run.turn_id,
            resumed_from=run.resumed_from_id,
            request_id=run.request_id,
            agent_id=run.agent_id,
            model=run.model,
            status=run.status,
            error_type=run.error_type,
            error_message=run.error_message,
            output_message_id=run.output_message_id,
            pending_approval=run.interrupts if run.status == "interrupted" else None,
            usage=run.usage,
            cost=RunCostOut(total_usd=usd_text(cost["total_usd"]), unknown_cost_calls=cost["unknown_cost_calls"]),
            created_at=run.created_at,
            started_at=run.started_at,
            finished_at=run.finished_at,
        )


class TimelineQuery(Schema):
    limit: int = Field(500, ge=1, le=500, description="At most 500 rows per page.")
    before: str | None = Field(None, max_length=500, description="`next_before` of the newer page.")


class TimelineItemOut(Schema):
    """One model call or tool execution of the audit (staff only)."""

    id: int
    kind: Literal["model", "tool"]
    run_id: uuid.UUID
    operation_id: str
    sequence: int | None
    status: Literal["running", "completed", "failed", "interrupted", "abandoned", "rejected"] | None
    started_at: datetime | None
    finished_at: datetime | None
    duration_ms: int | None = Field(None, description="Monotonic duration in ms.")
    usage: dict[str, Any] | None = Field(None, description="Tokens as the provider reported them.")
    cost_usd: str | None = Field(
        None, description="Model calls: USD, decimal string; null while running or when unknown (R-COST-1)."
    )
    price_source: str = Field("", description="Where the price came from (genai-prices, MODEL_PRICES, ...).")
    price_version: str = Field("", description="Version of that price.")
    content: str
    tool_calls: list[dict[str, Any]] | None = Field(None, description="Tool calls the model declared.")
    tool_name: str | None
    tool_input: Any = None
    declared_by_id: int | None
    is_final_answer: bool
    metadata: dict[str, Any]
    raw_output: Any = Field(None, description="The tool's raw output envelope.")
    workspace_path: str | None = Field(
        None, description="Workspace file of a large tool result (per execution, R-TA-7), else null."
    )


class TimelineOut(Schema):
    items: list[TimelineItemOut] = Field(..., description="Runs in creation order, then sequence.")
    truncated: bool = Field(..., description="Older rows exist; page back with `next_before`.")
    next_before: str | None
