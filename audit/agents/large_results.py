"""Large tool results leave the graph State for the thread workspace (R-TA-4).

Why not deepagents' ``FilesystemMiddleware``: its eviction counts tokens
(``4 × tool_token_limit_before_evict`` characters), writes under its own
``/large_tool_results`` root through a backend, and adds six filesystem tools
to the agent. The product needs a character threshold
(``LARGE_TOOL_RESULT_CHARS``), the per-execution workspace path
``outputs/large_tool_results/<run id>/<tool_call_id>`` (R-TA-7, see
:mod:`core.workspace`) and an unchanged tool set, so a small
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

from core.workspace import PREVIEW_CHARS, large_result_path, offloaded_summary

from ..jsonable import message_text


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
