"""The built-in agents: ``assistant`` (SPEC §5), a ``create_agent`` agent
with four tools, human approval for ``send_email``, and large tool results
moved to the thread workspace; and ``researcher`` with its subagent
(R-SUB-1, :mod:`audit.agents.researcher`)."""

from __future__ import annotations

from typing import Any

from deepagents.middleware.patch_tool_calls import PatchToolCallsMiddleware
from langchain.agents import create_agent
from langchain.agents.middleware import HumanInTheLoopMiddleware

from core.config import get_config

from ..catalogue import validate_agent_id
from .large_results import LargeToolResultMiddleware
from .models import chat_model
from .tools import ASSISTANT_TOOLS, AgentContext

# Tools that stop the run for a human decision (R-TA-5).
APPROVAL_REQUIRED = {"send_email": {"allowed_decisions": ["approve", "edit", "reject"]}}

SYSTEM_PROMPT = (
    "You are a helpful assistant. Use the tools when they help: get_weather for weather, "
    "calculator for arithmetic, lookup_docs for product documentation, send_email to send email."
)


def build_agent(
    agent_id: str,
    *,
    model: str,
    checkpointer: Any,
    http_async_client: Any = None,
    tool_guard: Any = None,
    replay_url: str | None = None,
) -> Any:
    """Compile the agent ``agent_id`` with the chat model ``model``.

    ``tool_guard``: a tool-call middleware that every agent of the graph
    (a subagent's too) runs innermost, right around each tool — the
    worker's replay guard (R-EFF-1); None: none. ``replay_url``: the replay
    model server that ``replay:`` models of this graph ask instead of
    ``REPLAY_MODEL_URL`` (a replayed run's own server, R-REPLAY-2).

    Raises :class:`~audit.catalogue.UnknownAgent` / :class:`~audit.catalogue.UnknownModel`.
    """
    validate_agent_id(agent_id)
    guard = [tool_guard] if tool_guard is not None else []
    if agent_id == "researcher":
        from .researcher import build_researcher

        return build_researcher(
            model=model,
            checkpointer=checkpointer,
            http_async_client=http_async_client,
            tool_guard=tool_guard,
            replay_url=replay_url,
        )
    return create_agent(
        chat_model(model, http_async_client=http_async_client, replay_url=replay_url),
        tools=ASSISTANT_TOOLS,
        system_prompt=SYSTEM_PROMPT,
        middleware=[
            # A new turn after a cancelled approval or a cancelled tool finds
            # tool calls without results in the checkpoint; answer them in the
            # State (no tool ran, so no audit row) so providers accept the
            # history.
            PatchToolCallsMiddleware(),
            # Approval first: a rejected call never reaches the tool (R-TA-5).
            HumanInTheLoopMiddleware(interrupt_on=APPROVAL_REQUIRED),
            LargeToolResultMiddleware(threshold_chars=get_config().LARGE_TOOL_RESULT_CHARS),
            # Innermost: a replayed result is offloaded as a fresh one.
            *guard,
        ],
        context_schema=AgentContext,
        checkpointer=checkpointer,
        name=agent_id,
    )
