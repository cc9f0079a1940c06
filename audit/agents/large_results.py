"""Large tool results leave the graph State for the thread workspace (R-TA-4).

Why not deepagents' ``FilesystemMiddleware``: its eviction counts tokens
(``4 × tool_token_limit_before_evict`` characters), writes under its own
``/large_tool_results`` root through a backend, and adds six filesystem tools
to the agent. The product needs a character threshold
(``LARGE_TOOL_RESULT_CHARS``), the per-execution workspace path
``outputs/large_tool_results/<run id>/<tool_call_id>`` (R-TA-7, see
:mod:`audit.agents.workspace`) and an unchanged tool set, so a small
``wrap_tool_call`` middleware does it.

The tool's own ``tool-finished`` event carries the full ToolMessage: the
tool callbacks fire inside the tool, before this middleware rewrites the
result, so the audit row keeps the full raw output while the State gets a
path and a preview.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from langchain.agents.middleware import AgentMiddleware
from langchain_core.messages import ToolMessage

from ..jsonable import message_text
from .workspace import large_result_path

PREVIEW_CHARS = 500


class LargeToolResultMiddleware(AgentMiddleware):
    """Moves a tool result longer than ``threshold_chars`` characters to the
    thread workspace (``runtime.context.workspace``, an
    :class:`~audit.agents.tools.AgentContext`; the file is named per
    execution, under ``runtime.context.run_id``) and gives the State a
    ToolMessage with the same id, ``tool_call_id`` and status whose content
    is the path plus a preview of ``PREVIEW_CHARS`` characters (R-TA-4)."""

    def __init__(self, *, threshold_chars: int):
        super().__init__()
        self.threshold_chars = threshold_chars

    def wrap_tool_call(self, request: Any, handler: Callable[[Any], Any]) -> Any:
        return self._offload(request, handler(request))

    async def awrap_tool_call(self, request: Any, handler: Callable[[Any], Awaitable[Any]]) -> Any:
        return self._offload(request, await handler(request))

    def _offload(self, request: Any, result: Any) -> Any:
        if not isinstance(result, ToolMessage):
            return result
        text = message_text(result.content)
        if len(text) <= self.threshold_chars:
            return result
        context = getattr(request.runtime, "context", None)
        workspace = getattr(context, "workspace", None)
        run_id = getattr(context, "run_id", None)
        tool_call_id = result.tool_call_id or (request.tool_call or {}).get("id")
        if not workspace or not run_id or not tool_call_id:
            return result
        relative = large_result_path(run_id=run_id, tool_call_id=tool_call_id)
        target = Path(workspace) / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
        return result.model_copy(update={"content": offloaded_summary(relative, text[:PREVIEW_CHARS], len(text))})


def offloaded_summary(path: Path, preview: str, size_chars: int) -> str:
    """What the graph State (and the agent's memory, and the chat history)
    holds instead of a large result: its size in characters, its
    workspace-relative ``path`` and the first ``PREVIEW_CHARS`` characters
    of ``preview`` (R-TA-4, R-READ-2, R-READ-7)."""
    return (
        f"The result has {size_chars} characters and was saved to the workspace file "
        f"{path.as_posix()}. Preview:\n{preview[:PREVIEW_CHARS]}"
    )
