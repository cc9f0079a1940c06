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
* asks a human when an execution under the key was cut off and the tool
  is not idempotent (nobody knows whether the effect happened): the run
  stops ``interrupted`` with an "outcome unknown" action request whose
  allowed decisions are ``retry`` (execute it again, accepting that the
  effect may then happen twice) and ``skip`` (go on without it: the graph
  is told it was not executed again, and a ``rejected`` row records the
  decision). The resume run that answers it carries the decision, matched
  to the cut-off row, and the guard applies it when the call comes again;
* else lets the tool run (an idempotent tool whose execution was cut off
  runs again).

A run's first attempt of a new turn has nothing recorded under its keys:
the guard then asks nothing, and the run path costs what it did.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from django.utils import timezone
from langchain.agents.middleware import AgentMiddleware
from langchain_core.messages import ToolMessage
from langgraph.types import interrupt

from .. import ledger
from ..agents.tools import tool_is_idempotent, tool_runs_agent
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
        replay = getattr(executor, "replay", None)
        if replay is not None and replay.tool_results is not None and not tool_runs_agent(request.tool):
            return await self._answer_as_recorded(request, replay.tool_results)
        if run.attempt == 1 and not run.resumed_from_id:
            return await handler(request)
        call = request.tool_call or {}
        tool_call_id = call.get("id")
        if not tool_call_id:
            return await handler(request)
        namespace = _namespace_of(request)
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
        if check.action == "skipped":
            return _skipped_message(check.replay, call)
        if check.action == "outcome_unknown":
            decision = _decision_for(executor.run.input, check.original)
            while decision is None:
                # Raises GraphInterrupt: the run stops ``interrupted``. On
                # resume the node runs again and the call returns the
                # resume value; one that answers another cut-off row (of
                # an earlier question) asks again (R-RUN-15).
                decision = _decision_for(interrupt(outcome_unknown_request(call, check.original)), check.original)
            if decision["type"] == "skip":
                skipped = await write_with_retry(
                    ledger.tool_effect_skip,
                    lease=executor.lease,
                    tool_call_id=tool_call_id,
                    tool_name=call.get("name") or "",
                    tool_input=call.get("args"),
                    original=check.original,
                    decision=decision,
                    content=(
                        f"{call.get('name')} was not executed again: its execution in attempt "
                        f"{check.original.attempt} was cut off when its worker stopped, so whether it took "
                        "effect is unknown, and the reviewer chose to skip it."
                    ),
                    namespace=namespace,
                    parent_operation_id=executor.recorder.parent_operation(namespace),
                    sequence=max(executor.recorder.last_seq, executor.recorder.sequence_base) or None,
                )
                return _skipped_message(skipped, call)
        return await handler(request)

    async def _answer_as_recorded(self, request: Any, recorded: Any) -> Any:
        """A replayed run with recorded tools (R-REPLAY-2): the call gets
        the result its recorded turn holds under its tool call id, in a row
        of its own (``metadata.source = "replay_recorded"``), and no tool
        runs. A recorded tool that raised raises :class:`RecordedToolError`
        as the run's error type was; a call the turn never made is refused
        with an error ToolMessage (a ``rejected`` row, source
        ``replay_unrecorded``): the replay never executes a tool."""
        executor = self._executor
        call = request.tool_call or {}
        tool_call_id = call.get("id") or ""
        name = call.get("name") or ""
        namespace = _namespace_of(request)
        result = recorded.get(tool_call_id)
        if result is not None and result.get("status") in CUT_STATUSES:
            return await self._cut_as_recorded(request, namespace)
        if result is None:
            content = f"{name} was not executed: the replayed turn recorded no result for tool call {tool_call_id}."
            status, source, error_type = "rejected", "replay_unrecorded", ""
        else:
            content = str(result.get("content") or "")
            status, source = str(result.get("status") or "completed"), "replay_recorded"
            error_type = str(result.get("error_type") or "")
        await write_with_retry(
            ledger.tool_effect_recorded,
            lease=executor.lease,
            tool_call_id=tool_call_id,
            tool_name=name,
            tool_input=call.get("args"),
            content=content,
            status=status,
            source=source,
            error_type=error_type,
            namespace=namespace,
            parent_operation_id=executor.recorder.parent_operation(namespace),
            sequence=max(executor.recorder.last_seq, executor.recorder.sequence_base) or None,
        )
        if error_type:
            raise RecordedToolError(content, error_type)
        failed = status != "completed"
        return ToolMessage(
            content=content, tool_call_id=tool_call_id, name=name, status="error" if failed else "success"
        )

    async def _cut_as_recorded(self, request: Any, namespace: list[str]) -> Any:
        """The recorded turn was cancelled while this tool call ran: the
        replay opens its row as a started tool does, asks for the run's
        cancel and waits for it, so the run ends cancelled here with the
        row cut off, as recorded (R-REPLAY-2)."""
        executor = self._executor
        call = request.tool_call or {}
        await write_with_retry(
            ledger.tool_call_start,
            lease=executor.lease,
            tool_call_id=call.get("id") or "",
            tool_name=call.get("name") or "",
            tool_input=call.get("args"),
            sequence=max(executor.recorder.last_seq, executor.recorder.sequence_base) or None,
            started_at=timezone.now(),
            declared_by_operation_id=None,
            metadata={"source": "replay_recorded"},
            namespace=namespace,
            parent_operation_id=executor.recorder.parent_operation(namespace),
            returning=False,
        )
        await executor.request_own_cancel()
        await asyncio.Event().wait()  # until the cancel stops the run


#: Statuses of a tool row cut off before its tool ended (a cancel, a stop).
CUT_STATUSES = frozenset({"running", "interrupted", "abandoned"})


class RecordedToolError(Exception):
    """A replayed tool call whose recorded execution raised (R-REPLAY-2):
    ``str(error)`` is the recorded message and ``audit_error_type`` the
    error type the audited run ended with (``agent_error:<class>``)."""

    def __init__(self, message: str, error_type: str):
        super().__init__(message)
        self.audit_error_type = f"agent_error:{error_type}"


def _namespace_of(request: Any) -> list[str]:
    """The namespace (subagent path) a tool call request runs in."""
    config = getattr(request.runtime, "config", None) or {}
    return namespace_of_checkpoint((config.get("metadata") or {}).get("langgraph_checkpoint_ns") or "")


OUTCOME_UNKNOWN_DECISIONS = ("retry", "skip")


def outcome_unknown_request(call: dict[str, Any], cut: Any) -> dict[str, Any]:
    """The interrupt value that asks a reviewer about a tool call whose
    execution ``cut`` (its row) was cut off by a worker that stopped, in
    the approval middleware's shape (``action_requests``,
    ``review_configs``) so that the run's pending approval shows it
    (R-TA-5, R-RUN-15). The action request names the ``tool_call_id`` and
    ``outcome_unknown: {row_id, attempt}``; its decisions are ``retry`` and
    ``skip``."""
    name = call.get("name") or ""
    return {
        "action_requests": [
            {
                "name": name,
                "args": call.get("args") or {},
                "description": (
                    f"Outcome unknown: {name} was running when its worker stopped (attempt {cut.attempt}), "
                    "so whether it took effect is not known. Retry runs it again (its effect may then "
                    "happen twice); skip goes on without it."
                ),
                "tool_call_id": call.get("id"),
                "outcome_unknown": {"row_id": cut.pk, "attempt": cut.attempt},
            }
        ],
        "review_configs": [{"action_name": name, "allowed_decisions": list(OUTCOME_UNKNOWN_DECISIONS)}],
    }


def _decision_for(answer: Any, cut: Any) -> dict[str, Any] | None:
    """The ``retry``/``skip`` decision in ``answer`` (a resume run's input
    or a resume value: ``{"decisions": [...]}``) that answers the question
    about the cut-off row ``cut``, or None."""
    decisions = answer.get("decisions") if isinstance(answer, dict) else None
    for decision in decisions if isinstance(decisions, list) else []:
        if (
            isinstance(decision, dict)
            and decision.get("type") in OUTCOME_UNKNOWN_DECISIONS
            and decision.get("row_id") == cut.pk
        ):
            return decision
    return None


def _skipped_message(row: Any, call: dict[str, Any]) -> ToolMessage:
    return ToolMessage(content=row.content, tool_call_id=call.get("id"), name=call.get("name"), status="error")
