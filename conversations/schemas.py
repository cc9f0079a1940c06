from __future__ import annotations

import uuid
from datetime import datetime

from ninja import Field, Schema


class ThreadIn(Schema):
    agent_id: str = Field(..., min_length=1, max_length=100)
    model: str | None = Field(None, min_length=1, max_length=200)
    title: str = Field("", max_length=200)


class ThreadOut(Schema):
    thread_id: uuid.UUID = Field(..., alias="id")
    agent_id: str
    model: str
    title: str
    status: str
    created_at: datetime
    updated_at: datetime


class ErrorDetail(Schema):
    code: str
    message: str


class ErrorOut(Schema):
    """Every error answer: ``{"error": {"code", "message", ...}}``."""

    error: ErrorDetail
