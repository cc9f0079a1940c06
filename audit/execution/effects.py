"""The replay guard: no tool call of a turn is executed twice (R-EFF-1).

A run continued after its worker died (R-RUN-15) goes on from its last
checkpoint. LangGraph does not run again a tool whose result reached the
checkpoint (its task's writes), but a tool that completed just before the
worker died — its row closed ``completed`` in the audit, its result not yet
in the checkpoint — would run again: an email sent twice. The audit knows
better than the checkpoint, in the same transaction as the lease: before a
tool of such a run starts, :class:`EffectLedgerGuard` asks the ledger
(:func:`audit.ledger.tool_audit.tool_effect_check`) what is recorded under
the call's effect key, and

* gives the graph the recorded result of a completed execution instead of
  running the tool (the new row says ``replayed_from``);
* stops the run ``failed`` / ``tool_outcome_unknown`` when an execution
  under the key was cut off and the tool is not idempotent
  (:class:`~audit.errors.ToolOutcomeUnknown`): nobody knows whether the
  effect happened;
* else lets the tool run (an idempotent tool whose execution was cut off
  runs again).

A run's first attempt of a new turn has nothing recorded under its keys:
the guard then asks nothing, and the run path costs what it did.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from langchain.agents.middleware import AgentMiddleware
from langchain_core.messages import ToolMessage

from .. import ledger
from ..agents.tools import tool_is_idempotent
from ..errors import ToolOutcomeUnknown
from .recorder import namespace_of_checkpoint
from .writes import write_with_retry


class EffectLedgerGuard(AgentMiddleware):
    """Tool-call middleware of every agent a run drives, innermost (after
    approval and large-result offloading, so a replayed result is treated
    as a fresh one). ``executor`` is the run's
    :class:`~audit.execution.runner.RunExecutor`: its lease, run and
    recorder (which knows the ``task`` call a subagent's tool runs under)."""

    def __init__(self, executor: Any):
        super().__init__()
        self._executor = executor

    def wrap_tool_call(self, request: Any, handler: Callable[[Any], Any]) -> Any:
        # The worker drives agents asynchronously only; a synchronous
        # caller (a test, a script) has no run to guard.
        return handler(request)

    async def awrap_tool_call(self, request: Any, handler: Callable[[Any], Awaitable[Any]]) -> Any:
        executor = self._executor
        run = executor.run
        if run.attempt == 1 and not run.resumed_from_id:
            return await handler(request)
        call = request.tool_call or {}
        tool_call_id = call.get("id")
        if not tool_call_id:
            return await handler(request)
        config = getattr(request.runtime, "config", None) or {}
        namespace = namespace_of_checkpoint((config.get("metadata") or {}).get("langgraph_checkpoint_ns") or "")
        check = await write_with_retry(
            ledger.tool_effect_check,
            lease=executor.lease,
            tool_call_id=tool_call_id,
            tool_name=call.get("name") or "",
            idempotent=tool_is_idempotent(request.tool) if request.tool is not None else False,
            namespace=namespace,
            parent_operation_id=executor.recorder.parent_operation(namespace),
            # Where the stream is now: the replay sorts after what came before.
            sequence=max(executor.recorder.last_seq, executor.recorder.sequence_base) or None,
        )
        if check.action == "replayed":
            # The replay row carries the original's result.
            return ToolMessage(content=check.replay.content, tool_call_id=tool_call_id, name=call.get("name"))
        if check.action == "outcome_unknown":
            raise ToolOutcomeUnknown(
                f"tool call {tool_call_id} ({call.get('name')}) was cut off by a worker that died "
                f"(attempt {check.original.attempt}); {call.get('name')} is not idempotent, so it is not "
                "executed again: nobody knows whether its effect happened",
                extra={"tool_call_id": tool_call_id, "tool_name": call.get("name"), "row_id": check.original.pk},
            )
        return await handler(request)
