"""What a purge and an erasure do to one row (R-GOV-1, R-GOV-2): the payload
goes, the anonymous facts stay (ids, status, timing, usage, cost, tool
names), so statistics do not change."""

from __future__ import annotations

from datetime import datetime
from typing import Any

PURGED = "payload_purged_at"
ERASED = "payload_erased_at"

# Metadata that carries words (tool output, errors that may quote it, an
# approval decision's message and edited arguments) or confirms a guess of
# them (the fingerprint of a model request: hashes of short, guessable
# text, R-REPLAY-2): a purge removes them.
PAYLOAD_METADATA_KEYS = frozenset({"raw_output", "tool_error", "error", "attempt_errors", "request"})

# Metadata an erasure keeps: anonymous facts for statistics and reading
# (everything else goes, whatever it is).
ANONYMOUS_METADATA_KEYS = frozenset(
    {
        "namespace",
        "model_run_id",
        "model_name",
        "model_provider",
        "finish_reason",
        "system_fingerprint",
        "state_reconciled",
        "source",
        "closed_by",
        "usage_unknown",
        "cost_unknown",
        "attempts",
        "content_partial",
        "parent_operation_id",
        PURGED,
    }
)


def _bare_tool_calls(tool_calls: Any) -> Any:
    """Declared tool calls without their arguments: ``[{id, name, args: {}}]``."""
    if not isinstance(tool_calls, list):
        return tool_calls
    return [
        {**{k: v for k, v in call.items() if k not in ("args", "arguments")}, "args": {}}
        if isinstance(call, dict)
        else call
        for call in tool_calls
    ]


def _bare_decision(decision: Any) -> Any:
    return {"type": decision.get("type")} if isinstance(decision, dict) else None


def purge_row(row, *, at: datetime) -> list[str]:
    """Empty one audit row's payload in place (content, tool input, declared
    tool call arguments, raw output and the metadata that quotes it) and
    mark it ``payload_purged_at``. Returns the fields to save."""
    metadata = {k: v for k, v in (row.metadata or {}).items() if k not in PAYLOAD_METADATA_KEYS}
    if "decision" in metadata:
        metadata["decision"] = _bare_decision(metadata["decision"])
    metadata[PURGED] = at.isoformat()
    row.content = ""
    row.tool_input = None
    row.tool_calls = _bare_tool_calls(row.tool_calls)
    row.metadata = metadata
    return ["content", "tool_input", "tool_calls", "metadata", "updated_at"]


def erase_row(row, *, at: datetime) -> list[str]:
    """Erase one message or audit row of a user in place: no content, no
    tool input or arguments, only anonymous metadata, marked
    ``payload_erased_at``. Returns the fields to save."""
    metadata = {k: v for k, v in (row.metadata or {}).items() if k in ANONYMOUS_METADATA_KEYS}
    if isinstance((row.metadata or {}).get("decision"), dict):
        metadata["decision"] = _bare_decision(row.metadata["decision"])
    metadata[ERASED] = at.isoformat()
    row.content = ""
    row.tool_input = None
    row.tool_calls = _bare_tool_calls(row.tool_calls)
    row.metadata = metadata
    return ["content", "tool_input", "tool_calls", "metadata", "updated_at"]


def erase_run_input(run) -> list[str]:
    """A run's input, pending approval and error without the user's words,
    keeping their shape: ``{"text": ""}``, decisions as their types only,
    action requests as tool names only."""
    data = run.input or {}
    if "decisions" in data:
        run.input = {"decisions": [_bare_decision(d) for d in data.get("decisions") or []]}
    else:
        run.input = {"text": ""}
    if run.interrupts:
        run.interrupts = [
            {"value": {"action_requests": [{"name": a.get("name")} for a in _actions(item) if isinstance(a, dict)]}}
            for item in run.interrupts
        ]
    run.error_message = ""
    return ["input", "interrupts", "error_message", "updated_at"]


def _actions(item: Any) -> list:
    value = item.get("value") if isinstance(item, dict) else None
    return (value.get("action_requests") or []) if isinstance(value, dict) else []


def payload_note(metadata: dict[str, Any] | None) -> str | None:
    """``"payload purged on <date>"`` / ``"payload erased on <date>"`` for a
    row whose payload is gone, else None: what API and admin show
    (R-GOV-1)."""
    metadata = metadata or {}
    for key, verb in ((ERASED, "erased"), (PURGED, "purged")):
        if metadata.get(key):
            return f"payload {verb} on {str(metadata[key])[:10]}"
    return None
