"""Dashboard API schemas (R-DASH-1)."""

from __future__ import annotations

import uuid
from datetime import date, datetime

from ninja import Field, Schema


class WindowOut(Schema):
    from_day: date
    to_day: date
    tz: str


class TokensOut(Schema):
    input_tokens: int
    output_tokens: int
    total_tokens: int


class OverviewOut(Schema):
    window: WindowOut
    conversations: int
    active_users: int
    messages: int
    runs: int
    runs_by_status: dict[str, int]
    tokens: TokensOut


class ModelTokensOut(Schema):
    model: str
    day: date
    calls: int
    input_tokens: int
    output_tokens: int
    total_tokens: int


class ModelLatencyOut(Schema):
    model: str
    calls: int
    p50_ms: float
    p95_ms: float


class ModelsOut(Schema):
    window: WindowOut
    tokens_by_model_day: list[ModelTokensOut]
    latency: list[ModelLatencyOut]


class ToolCountsOut(Schema):
    tool_name: str
    executions: int
    successes: int
    failures: int


class ToolDayOut(Schema):
    day: date
    executions: int
    successes: int
    failures: int


class ToolsOut(Schema):
    window: WindowOut
    by_tool: list[ToolCountsOut]
    by_day: list[ToolDayOut]


class DayOut(Schema):
    day: date
    conversations: int
    messages: int
    runs: int
    total_tokens: int
    tool_executions: int


class TimeseriesOut(Schema):
    window: WindowOut
    days: list[DayOut]


class FeedbackItemOut(Schema):
    id: int
    rating: str
    reason: str
    created_at: datetime
    username: str
    message_id: int
    thread_id: uuid.UUID
    message_excerpt: str


class FeedbackOut(Schema):
    window: WindowOut
    likes: int
    dislikes: int
    total: int
    satisfaction_rate: float | None
    count: int
    items: list[FeedbackItemOut]


class CostGroupOut(Schema):
    key: str = Field(..., description="The model name, the username or the day (YYYY-MM-DD).")
    user_id: int | None = None
    total_usd: str | None = Field(..., description="USD, decimal string; null when no call has a known cost.")
    calls: int
    unknown_cost_calls: int


class CostsOut(Schema):
    """Cost of the model calls that closed in the window (R-COST-2)."""

    window: WindowOut
    group_by: str
    total_usd: str | None
    calls: int
    unknown_cost_calls: int
    items: list[CostGroupOut]
