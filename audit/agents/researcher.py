"""The built-in ``researcher`` agent (R-SUB-1): a ``create_agent`` agent
whose one tool is deepagents' ``task``, which starts the subagent
``fact_checker`` (its own ``create_agent`` graph with ``lookup_docs``).

The subagent's model and tool calls run inside the ``task`` tool call and
reach the run's v3 stream under the subagent's namespace; the audit
records them as their own rows under the ``task`` call that spawned them.

With a ``replay:<scenario>`` model the subagent asks the replay server for
``<scenario>/fact_checker``, the scenario's own turns for it (a subagent
starts from the task description alone, so it cannot share the main
agent's turn count); any other model serves both agents.
"""

from __future__ import annotations

from typing import Any

from deepagents.backends import StateBackend
from deepagents.middleware.patch_tool_calls import PatchToolCallsMiddleware
from deepagents.middleware.subagents import SubAgentMiddleware
from langchain.agents import create_agent

from ..replay.scenarios import subagent_model_name
from .models import chat_model
from .tools import AgentContext, declare_idempotent, declare_runs_agent, lookup_docs

FACT_CHECKER = "fact_checker"

SYSTEM_PROMPT = (
    "You are a researcher. Delegate checking facts against the product documentation to the "
    f"{FACT_CHECKER} subagent with the task tool, then answer with what it found."
)

FACT_CHECKER_PROMPT = (
    "You check facts against the product documentation with lookup_docs (several lookups at once "
    "when they are independent) and report what the documentation says, briefly."
)

# The tools of the researcher and its subagent, for the admin's tool filter.
RESEARCHER_TOOL_NAMES = ("task", lookup_docs.name)

# The subagent's tools; each declares its idempotency (R-EFF-1).
FACT_CHECKER_TOOLS = [lookup_docs]


def subagent_model(model: str, subagent: str) -> str:
    """The configured model name the subagent ``subagent`` uses when the
    thread uses ``model``: ``replay:<scenario>/<subagent>`` for a replay
    model, else ``model`` itself."""
    provider, _, name = model.partition(":")
    if provider == "replay" and name:
        return f"replay:{subagent_model_name(name, subagent)}"
    return model


def build_researcher(
    *,
    model: str,
    checkpointer: Any,
    http_async_client: Any = None,
    tool_guard: Any = None,
    replay_url: str | None = None,
) -> Any:
    """Compile the ``researcher`` agent with the chat model ``model``;
    ``tool_guard`` as for :func:`~audit.agents.assistant.build_agent`, in
    the researcher and its subagent.

    Raises ``UnknownModel`` for an unknown model provider.
    """
    fact_checker = {
        "name": FACT_CHECKER,
        "description": "Checks facts against the product documentation (lookup_docs) and reports them.",
        "system_prompt": FACT_CHECKER_PROMPT,
        "model": chat_model(
            subagent_model(model, FACT_CHECKER), http_async_client=http_async_client, replay_url=replay_url
        ),
        "tools": FACT_CHECKER_TOOLS,
        "middleware": [tool_guard] if tool_guard is not None else [],
    }
    # The backend is for file tools, which neither agent has.
    subagents = SubAgentMiddleware(backend=StateBackend(), subagents=[fact_checker])
    for task in subagents.tools:
        # Running the subagent again runs its own calls again under the
        # same effect keys (the task call is their parent): each of them
        # follows its own declaration (R-EFF-1).
        declare_idempotent(task, True)
        # A replay runs the subagent and replays its calls (R-REPLAY-2).
        declare_runs_agent(task)
    return create_agent(
        chat_model(model, http_async_client=http_async_client, replay_url=replay_url),
        tools=[],
        system_prompt=SYSTEM_PROMPT,
        middleware=[
            # As for the assistant: a new turn after a cancelled task call
            # finds the call without a result in the checkpoint.
            PatchToolCallsMiddleware(),
            subagents,
            *([tool_guard] if tool_guard is not None else []),
        ],
        context_schema=AgentContext,
        checkpointer=checkpointer,
        name="researcher",
    )
