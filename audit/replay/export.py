"""An audited turn as a replay scenario (R-REPLAY-1).

:func:`export_scenario` reads the audit rows of a run's turn — the turn's
first run and every resume run after it, whichever of them is asked for —
and writes them in the format the replay model server plays
(:mod:`audit.replay.scenarios`): the root agent's model calls become
``turns``, each subagent's calls ``subagents[<name>]``, and what the server
does not play goes to ``recorded`` (tool results, resume decisions, how the
last run ended).

Which rows become turns. The replay server picks a turn by the number of
assistant messages in the request (:func:`audit.replay.server.turn_index`),
so a scenario holds one turn per step the model was asked on the path the
turn finally took, in that order:

- runs in order (first run, then its resumes); in each run, rows by
  ``sequence``;
- a root model row written by an earlier attempt of its run (``attempt``
  below the run's, R-RUN-15) counts only when the final State holds its
  answer (``metadata.state_reconciled``): a call cut off by a worker that
  stopped, or whose answer never reached the checkpoint, was asked again
  by the next attempt, and that later row is the step;
- a subagent's rows (``namespace`` set) count only from the highest
  attempt that made model calls under its ``task`` call
  (``parent_operation_id``): a task cut off is run again from its start;
  a task replayed from the ledger made no new calls, so its original rows
  count;
- tool rows never become turns. Their results go to
  ``recorded.tool_results`` by tool call id; a replayed row
  (``replayed_from``, R-EFF-1) repeats its original's result, and the last
  row of a tool call id on the path wins.

Failures are written as the server plays them: the leading attempts that
never connected (``metadata.attempt_errors``) as ``connect_error_times``,
the following ones answered with an HTTP status as
``fail_before_first_chunk``; the model call a cancel cut off (the last of
a cancelled run) as the text that streamed + ``stall_after_chunks`` (the
server hangs there, and a replay cancels the run, R-REPLAY-2); a call that failed ``model_http_error`` as
``http_status`` + ``error_message``; ``model_stream_broken`` as the text
that streamed + ``fail_after_chunks``; ``model_unreachable`` as an empty
turn none of whose attempts connects. A call cut off otherwise (cancel,
hand-over) keeps the text it streamed. Timing (``chunk_delay_ms``,
``chunk_chars``) is not audited and is left at the server's defaults;
``usage_mode`` is not recorded on the rows either (the worker stores the
folded total), so it is left out (``final``).

Text is read through the storable fields, which decode what PostgreSQL
could not store (U+0000, lone surrogates; :mod:`core.storable`), so the
scenario holds the original characters; write it as JSON with
:func:`scenario_json`.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from conversations.models import Message
from conversations.selectors import thread_memory

from ..models import AgentRun
from .scenarios import SUBAGENT_SEPARATOR, Scenario

_HTTP_ERROR = re.compile(r"Error code: (\d{3}) - (.*)", re.DOTALL)
_STREAM_BROKEN = re.compile(r"stream broke after (\d+) chunk")


class RunNotFound(LookupError):
    """No run has the id given to :func:`export_scenario`."""


def turn_runs(run: AgentRun) -> list[AgentRun]:
    """The runs of ``run``'s turn: the first run of the turn, then each
    resume run in order, to the newest (the chain of ``resumed_from``,
    whichever of them ``run`` is). One query per run of the chain."""
    chain = [run]
    while chain[0].resumed_from_id is not None:
        chain.insert(0, AgentRun.objects.get(pk=chain[0].resumed_from_id))
    while (after := AgentRun.objects.filter(resumed_from_id=chain[-1].pk).first()) is not None:
        chain.append(after)
    return chain


def export_scenario(run_id: uuid.UUID | str) -> dict[str, Any]:
    """The turn of run ``run_id`` (a UUID or its text) as a replay scenario
    dict without ``name``: ``{"description", "turns": [...], "subagents":
    {name: [...]}, "recorded": {...}}``, which
    ``Scenario.model_validate({"name": ..., **result})`` accepts and the
    replay server plays (``subagents`` only when the agent has some). See
    the module docstring for which rows become turns; token counts are
    tokens as the provider reported them.

    Raises:
        RunNotFound: no run has that id (a malformed id included).
        ValueError: the turn made no model call that a scenario could hold
            (e.g. a run cancelled before it started).

    Implements R-REPLAY-1.
    """
    try:
        run = AgentRun.objects.filter(pk=uuid.UUID(str(run_id))).first()
    except ValueError:
        run = None
    if run is None:
        raise RunNotFound(f"no run {run_id}")
    runs = turn_runs(run)
    rows_by_run: dict[uuid.UUID, list[Message]] = {r.id: [] for r in runs}
    rows = Message.objects.audit().filter(run_id__in=list(rows_by_run)).order_by("sequence", "id")
    for row in rows:
        rows_by_run[row.run_id].append(row)

    turns: list[dict[str, Any]] = []
    requests: list[dict[str, Any] | None] = []
    subagents: dict[str, list[dict[str, Any]]] = {}
    subagent_requests: dict[str, list[dict[str, Any] | None]] = {}
    tool_results: dict[str, dict[str, str]] = {}
    for each in runs:
        run_rows = rows_by_run[each.id]
        latest_task_attempt = _latest_task_attempts(run_rows)
        last_model_row = next((r for r in reversed(run_rows) if r.role == Message.Role.ASSISTANT), None)
        for row in run_rows:
            if row.role == Message.Role.TOOL:
                tool_results[row.operation_id] = _tool_result(row, each)
                continue
            if row.namespace:
                if row.attempt != latest_task_attempt.get(row.parent_operation_id):
                    continue
                turn = _turn(row, each if row is last_model_row else None)
                name = _subagent_name(row)
                subagents.setdefault(name, []).append(turn)
                subagent_requests.setdefault(name, []).append(_request(row))
                continue
            if row.attempt < each.attempt and not (row.metadata or {}).get("state_reconciled"):
                continue
            turns.append(_turn(row, each if row is last_model_row else None))
            requests.append(_request(row))
    if not turns:
        raise ValueError(f"run {run.id}: its turn made no model call to export")

    scenario: dict[str, Any] = {
        "description": f"Exported from the audit of run {run.id} (turn {run.turn_id}, agent {run.agent_id}).",
        "turns": turns,
    }
    if subagents:
        scenario["subagents"] = subagents
    scenario["recorded"] = {
        "agent_id": run.agent_id,
        "run_ids": [str(r.id) for r in runs],
        "status": runs[-1].status,
        "error_type": runs[-1].error_type,
        "resumes": [{"run_id": str(r.id), "decisions": list((r.input or {}).get("decisions") or [])} for r in runs[1:]],
        "tool_results": tool_results,
        "input": str((runs[0].input or {}).get("text") or ""),
        "history": thread_memory(thread_id=run.thread_id, include_tools=True, before_run=runs[0]),
        "requests": requests,
        "subagent_requests": subagent_requests,
    }
    return scenario


def scenario_json(scenario: dict[str, Any]) -> str:
    """``scenario`` as indented JSON text for a UTF-8 file: non-ASCII
    characters as they are, unless the text holds a lone surrogate (no
    UTF-8 form), in which case every non-ASCII character is ``\\u``-escaped
    so that the file reads back exactly (R-REPLAY-1, R-RUN-11)."""
    text = json.dumps(scenario, ensure_ascii=False, indent=2)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(scenario, indent=2)
    return text + "\n"


def validate(scenario: dict[str, Any], name: str) -> Scenario:
    """``scenario`` (as :func:`export_scenario` returns it) validated as the
    replay server would load it under ``name``. Raises pydantic's
    ``ValidationError`` when it does not follow the format."""
    return Scenario.model_validate({"name": name, **scenario})


def _tool_result(row: Message, run: AgentRun) -> dict[str, str]:
    """A tool row as a recorded result: its content and status, and, for a
    tool whose exception ended its run (the run failed with
    ``agent_error:<the class the tool raised>``), that class as
    ``error_type``. A tool error the tool node answered with an error
    ToolMessage (invalid arguments) did not end the run: no
    ``error_type``, the status ``failed`` says it."""
    result = {"content": row.content, "status": row.execution_status or "running"}
    error_type = (row.metadata or {}).get("error_type")
    if (
        row.execution_status == Message.ExecutionStatus.FAILED
        and isinstance(error_type, str)
        and error_type
        and run.status == AgentRun.Status.FAILED
        and run.error_type == f"agent_error:{error_type}"
    ):
        result["error_type"] = error_type
    return result


def _request(row: Message) -> dict[str, Any] | None:
    """The fingerprint of the request a model row was sent
    (``metadata.request``, R-REPLAY-2), or None for a row without one."""
    request = (row.metadata or {}).get("request")
    return request if isinstance(request, dict) else None


def _latest_task_attempts(rows: list[Message]) -> dict[str | None, int]:
    """For each ``task`` call (``parent_operation_id``) of a run: the
    highest attempt that made subagent model calls under it."""
    latest: dict[str | None, int] = {}
    for row in rows:
        if row.role == Message.Role.ASSISTANT and row.namespace:
            latest[row.parent_operation_id] = max(latest.get(row.parent_operation_id, 0), row.attempt)
    return latest


def _subagent_name(row: Message) -> str:
    """The subagent a namespaced model row belongs to: the agent name the
    recorder stored, else the part of the model name after the scenario's
    (``<scenario>/<subagent>``)."""
    metadata = row.metadata or {}
    name = metadata.get("agent_name")
    if isinstance(name, str) and name and SUBAGENT_SEPARATOR not in name:
        return name
    model = str(metadata.get("model_name") or "")
    return model.partition(SUBAGENT_SEPARATOR)[2] or "subagent"


def _turn(row: Message, run: AgentRun | None) -> dict[str, Any]:
    """The scenario turn that plays model row ``row`` back. ``run`` is the
    row's run when the row is its last model call: a failure without
    ``metadata.error`` then takes the run's error."""
    metadata = row.metadata or {}
    turn: dict[str, Any] = {}
    connect_errors, refused = _attempt_failures(metadata.get("attempt_errors") or [])
    error = str(metadata.get("error") or "")
    if not error and run is not None and row.execution_status == Message.ExecutionStatus.FAILED:
        error = f"{run.error_type}: {run.error_message}"
    error_type = error.partition(":")[0]
    if row.execution_status == Message.ExecutionStatus.FAILED and error_type == "model_unreachable":
        # No attempt connected: nothing was answered, and the server must
        # close as many requests as the worker sent.
        return {"text": "", "connect_error_times": int(metadata.get("attempts") or len(connect_errors) or 1)}
    if row.execution_status == Message.ExecutionStatus.FAILED and error_type == "model_http_error":
        http = _HTTP_ERROR.search(error)
        if http is not None:
            status, message = int(http.group(1)), http.group(2).strip()
            turn["http_status"] = status
            if message and message != f"replay: HTTP {status}":
                turn["error_message"] = message
            if connect_errors:
                turn["connect_error_times"] = len(connect_errors)
            return turn
    if row.content or not row.tool_calls:
        turn["text"] = row.content
    if row.tool_calls:
        turn["tool_calls"] = [
            {"id": call.get("id"), "name": call.get("name"), "arguments": call.get("args") or {}}
            for call in row.tool_calls
        ]
    usage = _usage(row.usage)
    if usage is not None:
        turn["usage"] = usage
    if (
        run is not None
        and run.status == AgentRun.Status.CANCELLED
        and row.execution_status == Message.ExecutionStatus.INTERRUPTED
        and not row.namespace
    ):
        # Cut off by the cancel that ended the run: the server streams
        # what had streamed, then hangs; a replay cancels there.
        turn["stall_after_chunks"] = 1 + -(-len(row.content) // 4)
        turn.pop("usage", None)
    if row.execution_status == Message.ExecutionStatus.FAILED and error_type == "model_stream_broken":
        broken = _STREAM_BROKEN.search(error)
        # The role chunk, then the text in chunks of the server's default size.
        turn["fail_after_chunks"] = int(broken.group(1)) if broken else 1 + -(-len(row.content) // 4)
    if connect_errors:
        turn["connect_error_times"] = len(connect_errors)
    if refused:
        first = refused[0]
        failing: dict[str, Any] = {"status": first["status"], "times": len(refused)}
        if first.get("retry_after") is not None:
            failing["retry_after"] = float(first["retry_after"])
        http = _HTTP_ERROR.search(str(first.get("error") or ""))
        message = http.group(2).strip() if http else ""
        if message and message != f"replay: HTTP {first['status']} before the first chunk":
            failing["error_message"] = message
        turn["fail_before_first_chunk"] = failing
    return turn


def _attempt_failures(errors: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The failed attempts of a model call (``metadata.attempt_errors``)
    split as the server plays them: first those that got no HTTP answer
    (never connected, or broke before any status), then those answered
    with an HTTP status. An attempt out of that order is counted with its
    kind, the order being the only one a scenario can play."""
    connect = [e for e in errors if isinstance(e, dict) and e.get("status") is None]
    refused = [e for e in errors if isinstance(e, dict) and isinstance(e.get("status"), int)]
    return connect, refused


def _usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """A row's usage (LangChain's ``UsageMetadata``: ``input_tokens``,
    ``output_tokens``, ``input_token_details.cache_read`` /
    ``cache_creation``, ``output_token_details.reasoning``) in the
    provider's terms a scenario uses (``prompt_tokens``,
    ``completion_tokens``, ``prompt_tokens_details.cached_tokens`` /
    ``cache_write_tokens``, ``completion_tokens_details.reasoning_tokens``);
    None when the usage is unknown."""
    if not usage:
        return None
    out: dict[str, Any] = {
        "prompt_tokens": int(usage.get("input_tokens") or 0),
        "completion_tokens": int(usage.get("output_tokens") or 0),
    }
    prompt = usage.get("input_token_details") or {}
    prompt_details = {
        key: int(prompt[source])
        for key, source in (("cached_tokens", "cache_read"), ("cache_write_tokens", "cache_creation"))
        if prompt.get(source) is not None
    }
    if prompt_details:
        out["prompt_tokens_details"] = prompt_details
    completion = usage.get("output_token_details") or {}
    if completion.get("reasoning") is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": int(completion["reasoning"])}
    return out
