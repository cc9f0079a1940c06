"""Tools of the built-in ``assistant`` agent (SPEC §5).

All are deterministic so that scenarios and tests are repeatable. Each
declares whether it is idempotent (``metadata["idempotent"]``, read by
:func:`tool_is_idempotent`, R-EFF-1).
"""

from __future__ import annotations

import ast
import asyncio
import json
import operator
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from langchain.tools import ToolRuntime
from langchain_core.tools import ToolException, tool

from core.workspace import outbox_path

#: The tool metadata key that declares a tool idempotent (R-EFF-1).
IDEMPOTENT = "idempotent"

#: The tool metadata key that declares a tool a runner of an agent (a
#: subagent's ``task``): a replay runs it, its calls inside replayed one
#: by one (R-REPLAY-2).
RUNS_AGENT = "runs_agent"


def declare_idempotent(tool: Any, idempotent: bool) -> Any:
    """Declare whether ``tool`` (a LangChain ``BaseTool``) is idempotent —
    executing it twice under one effect key has the effect of executing it
    once — in its ``metadata["idempotent"]``, keeping its other metadata;
    returns ``tool``. Implements R-EFF-1."""
    tool.metadata = {**(tool.metadata or {}), IDEMPOTENT: bool(idempotent)}
    return tool


def declare_runs_agent(tool: Any) -> Any:
    """Declare that ``tool`` runs an agent (deepagents' ``task`` starts a
    subagent) in its ``metadata["runs_agent"]``, keeping its other
    metadata; returns ``tool``. A replay with recorded tool results runs
    such a tool, so that the subagent's own model and tool calls are
    replayed (R-REPLAY-2)."""
    tool.metadata = {**(tool.metadata or {}), RUNS_AGENT: True}
    return tool


def tool_runs_agent(tool: Any) -> bool:
    """Whether ``tool`` declared that it runs an agent
    (:func:`declare_runs_agent`). Never raises."""
    metadata = getattr(tool, "metadata", None)
    return isinstance(metadata, dict) and metadata.get(RUNS_AGENT) is True


def tool_is_idempotent(tool: Any) -> bool:
    """Whether ``tool`` (a LangChain ``BaseTool``, or anything with a
    ``metadata`` dict) declared itself idempotent: True only for
    ``metadata["idempotent"] is True``. A tool that declares nothing is not
    idempotent — the safe default: a tool whose outcome is unknown is
    executed again only when it said it may be (R-EFF-1, R-RUN-15). Never
    raises."""
    metadata = getattr(tool, "metadata", None)
    return isinstance(metadata, dict) and metadata.get(IDEMPOTENT) is True


@dataclass(frozen=True)
class AgentContext:
    """Runtime context given to every tool: the thread and its workspace."""

    thread_id: str
    run_id: str
    workspace: str


_WEATHER = {
    "paris": {"city": "Paris", "temperature_c": 18, "conditions": "sunny"},
    "berlin": {"city": "Berlin", "temperature_c": 12, "conditions": "cloudy"},
    "tokyo": {"city": "Tokyo", "temperature_c": 22, "conditions": "light rain"},
    "london": {"city": "London", "temperature_c": 14, "conditions": "overcast"},
    "new york": {"city": "New York", "temperature_c": 20, "conditions": "clear"},
}


@tool
def get_weather(city: str) -> str:
    """Current weather for a city. An unknown city is reported as a tool error."""
    data = _WEATHER.get(city.strip().lower())
    if data is None:
        # Handled: the agent sees an error ToolMessage and carries on.
        raise ToolException(f"unknown city: {city}")
    return json.dumps(data)


# A ToolException becomes an error ToolMessage (status="error") instead of
# propagating: the handled-tool-error path (R-TA-3).
get_weather.handle_tool_error = True
# Reads a fixed table.
declare_idempotent(get_weather, True)


_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        right = _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 100:
            raise ValueError("exponent too large")
        return _OPERATORS[type(node.op)](_evaluate(node.left), right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"unsupported expression element: {type(node).__name__}")


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression (+ - * / // % ** and parentheses).

    Raises on an invalid expression or a division by zero: an unhandled tool
    error that fails the run."""
    result = _evaluate(ast.parse(expression, mode="eval"))
    return str(result)


declare_idempotent(calculator, True)  # a pure function


_DOC_TEXT = (
    "Records are retained for 400 days and then deleted. Audit rows are kept for the life of the thread. "
    "Exports are produced nightly. Access to raw tool output is limited to staff. "
)


@tool
async def lookup_docs(query: str, size: int = 800, latency_ms: int = 0) -> str:
    """Search the product documentation; returns about ``size`` characters of text.
    ``latency_ms`` (at most 30000) simulates a slow backend, so that a run can
    be cancelled while the tool runs (R-TA-6)."""
    if latency_ms > 0:
        # Async, so that cancelling the run really stops the tool.
        await asyncio.sleep(min(int(latency_ms), 30_000) / 1000)
    size = max(1, min(int(size), 1_000_000))
    header = f"Results for {query!r}:\n"
    body = (_DOC_TEXT * (size // len(_DOC_TEXT) + 1))[: max(0, size - len(header))]
    return header + body


declare_idempotent(lookup_docs, True)  # reads only


@tool
def send_email(to: str, subject: str, body: str, runtime: ToolRuntime[AgentContext]) -> str:
    """Send an email. Requires human approval; the email is recorded in the
    thread workspace (``outbox/``) and nothing is actually sent."""
    # One record per execution (R-TA-7): a tool call id reused by a later
    # run never overwrites an earlier run's record. A call without an id
    # (never from the agent loop) still gets its own file.
    relative = outbox_path(
        run_id=runtime.context.run_id, tool_call_id=runtime.tool_call_id or f"unnamed-{uuid.uuid4().hex}"
    )
    target = Path(runtime.context.workspace) / relative
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps({"to": to, "subject": subject, "body": body}))
    return f"Email to {to} recorded as {relative.as_posix()}."


# Sending an email twice sends two emails: never executed again when its
# outcome is unknown (R-EFF-1, R-RUN-15).
declare_idempotent(send_email, False)


ASSISTANT_TOOLS = [get_weather, calculator, lookup_docs, send_email]
