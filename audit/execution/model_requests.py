"""Model calls audited from the moment their request is sent (R-MA-10) and
each failed attempt before the first chunk (R-RUN-12).

The v3 stream says nothing about a model call until its first chunk
(message-start is built from it, PROTOCOL.md §4), so a call cancelled or
failed before then would leave no trace. LangChain's callbacks do: the
chat-model start callback fires with the model run id before the request
goes out, and langchain-core names the streamed message
``lc_run--<model run id>`` — the id message-start then carries. This handler
feeds those callbacks to the run's :class:`~audit.execution.recorder.LifecycleRecorder`:

- ``on_chat_model_start`` → the row opens (``running``,
  ``awaiting_first_chunk``), awaited before the request is sent, only
  while the user's budget has room (checked in the same statement): a run
  over its budget opens no row and sends no request (R-COST-3). The row
  keeps the request's fingerprint (``metadata.request``,
  :func:`~audit.execution.fingerprint.request_fingerprint`), so a replay
  tells at which step the request changed (R-REPLAY-2);
- ``on_retry`` with ``attempt_failure`` (sent by
  :class:`~audit.agents.provider.AuditedChatOpenAI`) → the attempt is counted
  on the row;
- ``on_llm_end`` → the call's end (R-SUB-2) and, for a call that never
  streamed, which whole message is its answer (a non-streaming model's
  message may come without a run id);
- ``on_tool_start`` → which tool call a subagent started inside the tool
  belongs to (its namespace), before the subagent's first model request
  (R-SUB-1), and the tool's start; ``on_tool_end`` / ``on_tool_error`` →
  its end (R-SUB-2);
- ``on_llm_error`` → remembered for the terminal transaction, which closes
  the row ``failed`` with the error (a cancel is closed ``interrupted``).

``raise_error`` is on: a write refused because the lease is gone stops the
model call, as any audit write does (R-RUN-4).

These callbacks run where the call is made, when it starts or ends; the
worker reads the stream events of those moments later (it awaits each
audit write), so the times of the audit rows are read here (R-SUB-2).
The tool callbacks are plain functions, not coroutines: LangChain then
calls them in line, in handler order, in the tool's own thread for a
tool that runs in one (a coroutine would be run after every other
handler, on a loop of its own), and this handler comes before
langgraph's stream handlers (the run's callbacks are configured first),
so a tool's stamp is taken before its stream event exists.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from langchain_core.callbacks import AsyncCallbackHandler
from langchain_core.messages import BaseMessage

from .fingerprint import request_fingerprint
from .recorder import LifecycleRecorder

logger = logging.getLogger(__name__)


class ModelRequestAudit(AsyncCallbackHandler):
    """Callback handler for one run's graph config (``callbacks=[...]``)."""

    raise_error = True
    run_inline = True
    # The events this handler reads are the chat model's, the tools' and
    # the retries'; LangChain skips it for the others (every chain step of
    # the graph would cost a coroutine of it, issue 11).
    ignore_chain = True
    ignore_retriever = True
    ignore_custom_event = True

    def __init__(self, recorder: LifecycleRecorder):
        self._recorder = recorder

    async def on_chat_model_start(
        self,
        serialized: dict[str, Any],
        messages: list[list[BaseMessage]],
        *,
        run_id: uuid.UUID,
        parent_run_id: uuid.UUID | None = None,
        tags: list[str] | None = None,
        metadata: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        try:
            fingerprint = request_fingerprint(messages[0] if messages else [], kwargs.get("invocation_params"))
        except Exception:
            # A fingerprint is a help for replays, not an audit fact the
            # call may wait for: the row opens without one.
            logger.debug("no request fingerprint for model run %s", run_id, exc_info=True)
            fingerprint = None
        await self._recorder.model_request(model_run_id=str(run_id), metadata=metadata or {}, request=fingerprint)

    # The tool callbacks are plain functions, called in line (see the
    # module docstring).
    def on_tool_start(
        self,
        serialized: dict[str, Any],
        input_str: str,
        *,
        run_id: uuid.UUID,
        metadata: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        # Before the tool's body runs: a subagent started by this call
        # (deepagents' task) runs in the tool's namespace (R-SUB-1). A tool
        # not called by a model has its run id as its key on the stream
        # (langgraph's StreamToolCallHandler).
        tool_call_id = kwargs.get("tool_call_id")
        if not isinstance(tool_call_id, str) or not tool_call_id:
            tool_call_id = str(run_id)
        self._recorder.tool_request(tool_call_id=tool_call_id, metadata=metadata or {}, tool_run_id=str(run_id))

    def on_tool_end(self, output: Any, *, run_id: uuid.UUID, **kwargs: Any) -> None:
        self._recorder.tool_end(tool_run_id=str(run_id))

    def on_tool_error(self, error: BaseException, *, run_id: uuid.UUID, **kwargs: Any) -> None:
        self._recorder.tool_end(tool_run_id=str(run_id), error=error)

    async def on_retry(self, retry_state: Any, *, run_id: uuid.UUID, **kwargs: Any) -> None:
        failure = kwargs.get("attempt_failure")
        if isinstance(failure, dict):
            await self._recorder.model_retry(model_run_id=str(run_id), failure=failure)

    async def on_llm_end(self, response: Any, *, run_id: uuid.UUID, **kwargs: Any) -> None:
        generations = getattr(response, "generations", None) or [[]]
        first = generations[0][0] if generations and generations[0] else None
        message = getattr(first, "message", None)
        self._recorder.model_end(model_run_id=str(run_id), message_id=getattr(message, "id", None))

    async def on_llm_error(self, error: BaseException, *, run_id: uuid.UUID, **kwargs: Any) -> None:
        self._recorder.model_error(model_run_id=str(run_id), error=error)
