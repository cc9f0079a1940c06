"""Turn the live objects of the v3 stream (tuples, BaseMessage, Interrupt,
pydantic models) into JSON-safe data for the database and the event stream."""

from __future__ import annotations

import dataclasses
import datetime as dt
import uuid
from typing import Any

from langchain_core.messages import BaseMessage
from pydantic import BaseModel


def to_jsonable(value: Any, _depth: int = 0) -> Any:
    """Return a JSON-serialisable copy of ``value``. Unknown objects become
    ``{"__class__": name, "repr": repr}`` rather than raising."""
    if _depth > 40:
        return repr(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): to_jsonable(v, _depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [to_jsonable(v, _depth + 1) for v in value]
    if isinstance(value, BaseMessage):
        data = value.model_dump()
        data["type"] = value.type
        return to_jsonable(data, _depth + 1)
    if isinstance(value, BaseModel):
        return to_jsonable(value.model_dump(), _depth + 1)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return to_jsonable(dataclasses.asdict(value), _depth + 1)
    if isinstance(value, (dt.datetime, dt.date)):
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    if hasattr(value, "value") and hasattr(value, "id") and type(value).__name__ == "Interrupt":
        return {"id": value.id, "value": to_jsonable(value.value, _depth + 1)}
    return {"__class__": type(value).__name__, "repr": repr(value)[:2000]}


def message_text(content: Any) -> str:
    """The plain text of a message's content: a string, or the text blocks
    of a v1 content list joined in order."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for block in content:
            if isinstance(block, str):
                parts.append(block)
            elif isinstance(block, dict) and block.get("type") == "text":
                parts.append(str(block.get("text") or ""))
        return "".join(parts)
    return str(content)
