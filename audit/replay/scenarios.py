"""Scenario files for the replay model server (SPEC §5, "Models and the
replay model server").

A scenario is a JSON file whose stem is the scenario name (the ``model`` a
client asks for). It holds an ordered list of assistant turns::

    {"description": "...",
     "turns": [
        {"text": "Let me check.",
         "tool_calls": [{"id": "call_weather_paris", "name": "get_weather",
                         "arguments": {"city": "Paris"}}],
         "usage": {"prompt_tokens": 52, "completion_tokens": 14},
         "chunk_delay_ms": 0, "chunk_chars": 8},
        {"text": "It is 18°C and sunny in Paris.",
         "usage": {"prompt_tokens": 90, "completion_tokens": 11}}]}

A scenario for an agent with subagents (the built-in ``researcher``,
R-SUB-1) also gives each subagent's own turns under ``subagents``::

    {"turns": [...the main agent's turns...],
     "subagents": {"fact_checker": [...the subagent's turns...]}}

The subagent's model asks for ``<scenario>/<subagent>`` (see
:func:`subagent_model_name`); its turns are counted the same way, from its
own conversation (a subagent starts from the task description alone).

Turn keys: ``text``, ``tool_calls``, ``usage`` (with optional
``prompt_tokens_details`` / ``completion_tokens_details``), ``usage_mode``,
``chunk_delay_ms``, ``chunk_chars``, ``http_status`` + ``error_message``,
``fail_after_chunks``, ``stall_after_chunks``, ``connect_error_times``,
``fail_before_first_chunk``, ``text_if_rejected`` (see :class:`Turn`). A
top-level ``"chat": true`` offers a scenario meant for a person to try in
the chat page's model select (R-UI-1). Validation is strict: unknown keys and wrongly typed
values are rejected, and every problem is reported as :class:`ScenarioError`
naming the file.

A scenario exported from an audited run (:mod:`audit.replay.export`,
R-REPLAY-1) also carries ``recorded`` (:class:`Recorded`): the facts the
server does not play (tool results, resume decisions, how the run ended).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..catalogue import BUNDLED_SCENARIO_DIR as BUNDLED_DIR

DEFAULT_CHUNK_CHARS = 4
"""Characters per streamed text chunk when a turn gives no ``chunk_chars``:
small, so that even a short answer streams as many chunks."""


class ScenarioError(ValueError):
    """A scenario file cannot be read or does not follow the format.

    ``path`` is the offending file and ``problem`` a human-readable
    description; ``str(error)`` is ``"<file name>: <problem>"``.
    """

    def __init__(self, path: Path, problem: str) -> None:
        self.path = path
        self.problem = problem
        super().__init__(f"{path.name}: {problem}")


class _Strict(BaseModel):
    # strict=True: a JSON "5" is not a number and true is not 1, so a typo
    # in a hand-written scenario fails loudly instead of replaying wrongly.
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class ToolCall(_Strict):
    """One tool call the model declares: ``arguments`` is the decoded
    arguments object; it is sent JSON-encoded, as OpenAI does."""

    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: dict[str, Any] = Field(default_factory=dict)

    def arguments_json(self) -> str:
        """The arguments as the JSON string OpenAI puts in
        ``function.arguments`` (non-ASCII kept as is)."""
        return json.dumps(self.arguments, ensure_ascii=False)


class PromptTokensDetails(_Strict):
    """Parts of ``prompt_tokens`` as OpenAI reports them: ``cached_tokens``
    (read from the prompt cache) and ``cache_write_tokens`` (written to it;
    langchain-openai maps it to ``cache_creation``). Both are included in
    ``prompt_tokens``, never added to it."""

    cached_tokens: int | None = Field(default=None, ge=0)
    cache_write_tokens: int | None = Field(default=None, ge=0)


class CompletionTokensDetails(_Strict):
    """Parts of ``completion_tokens``: ``reasoning_tokens`` (included in
    ``completion_tokens``)."""

    reasoning_tokens: int | None = Field(default=None, ge=0)


class Usage(_Strict):
    """Token counts the provider bills for a turn; ``total_tokens`` is
    ``prompt_tokens + completion_tokens`` (details are parts of those, never
    counted twice)."""

    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @model_validator(mode="after")
    def _details_within_totals(self) -> Usage:
        prompt = self.prompt_tokens_details
        if prompt is not None and (prompt.cached_tokens or 0) + (prompt.cache_write_tokens or 0) > self.prompt_tokens:
            raise ValueError("cached_tokens + cache_write_tokens exceed prompt_tokens")
        completion = self.completion_tokens_details
        if completion is not None and (completion.reasoning_tokens or 0) > self.completion_tokens:
            raise ValueError("reasoning_tokens exceed completion_tokens")
        return self


UsageMode = Literal["final", "cumulative", "delta"]
"""How a provider reports usage while streaming (R-MA-11): ``final`` — one
report in a last chunk with empty ``choices`` (OpenAI's
``stream_options.include_usage``); ``cumulative`` — running totals on every
chunk, then the totals (vLLM's continuous usage stats); ``delta`` —
increments on every chunk that add up to the totals."""

USAGE_MODE_HEADER = "x-yuxi-usage-mode"
"""Response header of a streamed replay answer: the ``usage_mode`` of the
turn the server plays, so that the worker folds its reports by the mode of
the scenario actually served, from whatever directory (R-MA-12)."""


class FailBeforeFirstChunk(_Strict):
    """Answer the first ``times`` requests of a turn with HTTP ``status``
    (and an OpenAI-style error body) before any chunk; ``retry_after`` (s)
    adds ``Retry-After`` (whole seconds, rounded up) and ``retry-after-ms``
    headers, as OpenAI sends them. Later requests play the turn."""

    status: int = Field(ge=400, le=599)
    times: int = Field(default=1, ge=1)
    retry_after: float | None = Field(default=None, ge=0)
    error_message: str | None = None


class Turn(_Strict):
    """One assistant turn of a scenario.

    - ``text``: the answer text (may accompany ``tool_calls``).
    - ``tool_calls``: tool calls declared by the turn.
    - ``usage``: token counts; absent means zeros are reported.
    - ``chunk_delay_ms``: milliseconds slept before each streamed chunk (a
      non-streaming answer sleeps as long as the whole stream would).
    - ``chunk_chars``: characters per text chunk (and per piece of tool-call
      arguments) when streaming.
    - ``http_status`` / ``error_message``: answer with this HTTP error and an
      OpenAI-style error body instead of a completion.
    - ``fail_after_chunks``: when streaming, send this many chunks (the first,
      role-only chunk included) then break the connection: no finish chunk,
      no usage, no ``[DONE]``. A non-streaming request gets a 500 error.
    - ``usage_mode``: how the streamed usage is reported (:data:`UsageMode`);
      default ``final``. A ``replay:<scenario>`` model in the worker takes
      this mode unless ``MODEL_USAGE_MODES`` names the model (R-MA-11).
    - ``connect_error_times``: close the connection of the first N requests
      of this turn without any response (R-RUN-12).
    - ``stall_after_chunks``: when streaming, send this many chunks (the
      role chunk included) then send nothing more, holding the connection
      open until the client goes away: a model that hangs mid-answer. A
      replay plays a call that was cut off by a cancel this way, and
      cancels the run once it has the text (R-REPLAY-2).
    - ``fail_before_first_chunk``: see :class:`FailBeforeFirstChunk`.
    - ``text_if_rejected``: the answer text played instead of ``text`` when
      a tool result the request sends since the last user message (in this
      turn) is a human's rejection (:data:`REJECTION_PREFIX`, R-TA-5): a
      scenario that asks for approval then answers truthfully either way,
      also after more tool calls that follow the rejection.

    The requests of a turn are counted per distinct request: the scenario,
    the turn and the request's messages (a client's retry re-sends the same
    messages). The first ``connect_error_times`` requests are closed, the
    next ``fail_before_first_chunk.times`` answer its status, the rest play
    the turn. Counts live in the server process: a restarted server counts
    from zero, and two conversations that send byte-identical messages share
    one count.
    """

    text: str | None = None
    # strict=False only so a JSON array becomes a tuple; items stay strict.
    tool_calls: tuple[ToolCall, ...] = Field(default=(), strict=False)
    usage: Usage | None = None
    chunk_delay_ms: int = Field(default=0, ge=0)
    chunk_chars: int = Field(default=DEFAULT_CHUNK_CHARS, ge=1)
    http_status: int | None = Field(default=None, ge=400, le=599)
    error_message: str | None = None
    fail_after_chunks: int | None = Field(default=None, ge=0)
    usage_mode: UsageMode = "final"
    connect_error_times: int = Field(default=0, ge=0)
    fail_before_first_chunk: FailBeforeFirstChunk | None = None
    stall_after_chunks: int | None = Field(default=None, ge=1)
    text_if_rejected: str | None = None

    @model_validator(mode="after")
    def _check_shape(self) -> Turn:
        if self.stall_after_chunks is not None and self.fail_after_chunks is not None:
            raise ValueError("a turn cannot give both stall_after_chunks and fail_after_chunks")
        if self.http_status is not None:
            extra = [
                key
                for key in (
                    "text",
                    "tool_calls",
                    "usage",
                    "fail_after_chunks",
                    "stall_after_chunks",
                    "usage_mode",
                    "fail_before_first_chunk",
                    "text_if_rejected",
                )
                if key in self.model_fields_set
            ]
            if extra:
                raise ValueError(f"a turn with http_status cannot also give {', '.join(extra)}")
        elif self.error_message is not None:
            raise ValueError("error_message needs http_status")
        elif self.text is None and not self.tool_calls:
            raise ValueError("a turn needs text, tool_calls or http_status")
        elif self.text_if_rejected is not None and self.text is None:
            raise ValueError("text_if_rejected replaces text: the turn needs text too")
        return self

    def played(self, *, rejected: bool) -> Turn:
        """The turn as played: with ``text_if_rejected`` as its text when
        ``rejected`` (a tool result of the request is a rejection) and the
        turn has one; else the turn itself."""
        if rejected and self.text_if_rejected is not None:
            return self.model_copy(update={"text": self.text_if_rejected})
        return self

    @property
    def finish_reason(self) -> str:
        """``"tool_calls"`` when the turn declares tool calls, else ``"stop"``."""
        return "tool_calls" if self.tool_calls else "stop"


REJECTION_PREFIX = "User rejected the tool call"
"""How the content of the tool result a rejected call gets begins: the
wording of LangChain's ``HumanInTheLoopMiddleware`` for a ``reject``
decision, with or without a reason (R-TA-5). An OpenAI tool message has
no status, so the text is all the server can tell a rejection by."""


SUBAGENT_SEPARATOR = "/"
"""Joins a scenario name and a subagent name into the model name the
subagent's requests carry (``researcher_fact_check/fact_checker``)."""


RunStatus = Literal["pending", "running", "cancel_requested", "completed", "failed", "cancelled", "interrupted"]
"""``AgentRun.status`` as a scenario records it (:class:`Recorded`)."""

ExecutionStatus = Literal["running", "completed", "failed", "interrupted", "abandoned", "rejected"]
"""``Message.execution_status`` of a recorded tool row (:class:`RecordedToolResult`)."""


class RecordedToolResult(_Strict):
    """What one tool call returned in the audited turn: the tool row's
    ``content`` (the ToolMessage text the model read next), its ``status``
    and, for a tool whose exception ended the run, the exception's class
    (``error_type``; empty otherwise)."""

    content: str
    status: ExecutionStatus
    error_type: str = ""


class RecordedResume(_Strict):
    """One resume run of the audited turn (R-TA-5): its ``run_id`` and the
    ``decisions`` it carried, as submitted (``[{type, args?, message?}]``)."""

    run_id: str = Field(min_length=1)
    decisions: tuple[dict[str, Any], ...] = Field(strict=False)


class Recorded(_Strict):
    """Facts of an audited turn that the model server does not play, kept
    by a scenario exported from the audit (R-REPLAY-1) for a replay to
    compare with (R-REPLAY-2): the agent, the turn's runs (first run, then
    each resume, in order), the resumes' decisions, every tool call's
    result by tool call id, how the last run ended (``status``,
    ``error_type``); what the turn started from: the user's ``input`` and
    the thread's ``history`` before it (the memory messages the agent
    runtime would rebuild: ``{type, id, content, tool_calls, tool_call_id,
    name, status}``, oldest first); and the fingerprint of each model
    request (``requests``, one per turn in order, ``subagent_requests`` per
    subagent; None where the row has none). The replay server ignores it."""

    agent_id: str = Field(min_length=1)
    run_ids: tuple[str, ...] = Field(min_length=1, strict=False)
    status: RunStatus
    error_type: str = ""
    resumes: tuple[RecordedResume, ...] = Field(default=(), strict=False)
    tool_results: dict[str, RecordedToolResult] = Field(default_factory=dict)
    input: str = ""
    history: tuple[dict[str, Any], ...] = Field(default=(), strict=False)
    requests: tuple[dict[str, Any] | None, ...] = Field(default=(), strict=False)
    subagent_requests: dict[str, Annotated[tuple[dict[str, Any] | None, ...], Field(strict=False)]] = Field(
        default_factory=dict
    )


class Scenario(_Strict):
    """A named, ordered list of assistant turns (at least one), and, for an
    agent with subagents, each subagent's own turns (``subagents``: name →
    turns, at least one each). Tool call ids are unique across the whole
    scenario, subagents included, so the audit can tell the calls apart.
    ``recorded`` is set on a scenario exported from an audited run
    (:class:`Recorded`, R-REPLAY-1); the server does not read it. ``chat``
    true offers the scenario in the chat page's model select
    (:func:`audit.catalogue.chat_models`, R-UI-1); the server ignores it."""

    name: str = Field(min_length=1)
    description: str = ""
    chat: bool = False
    turns: tuple[Turn, ...] = Field(min_length=1, strict=False)
    subagents: dict[str, Annotated[tuple[Turn, ...], Field(strict=False)]] = Field(default_factory=dict)
    recorded: Recorded | None = None

    @model_validator(mode="after")
    def _check_tool_call_ids(self) -> Scenario:
        seen: set[str] = set()
        for turn in (*self.turns, *(t for turns in self.subagents.values() for t in turns)):
            for call in turn.tool_calls:
                if call.id in seen:
                    raise ValueError(f"tool call id {call.id!r} is used twice")
                seen.add(call.id)
        for subagent, turns in self.subagents.items():
            if not subagent or SUBAGENT_SEPARATOR in subagent:
                raise ValueError(f"subagent name {subagent!r} must be non-empty without {SUBAGENT_SEPARATOR!r}")
            if not turns:
                raise ValueError(f"subagent {subagent!r} needs at least one turn")
        return self


def subagent_model_name(scenario: str, subagent: str) -> str:
    """The model name a subagent's requests carry: ``<scenario>/<subagent>``
    (R-SUB-1)."""
    return f"{scenario}{SUBAGENT_SEPARATOR}{subagent}"


def scenario_turns(scenarios: dict[str, Scenario], model: str) -> tuple[Scenario, tuple[Turn, ...]] | None:
    """The scenario and the turns a request for ``model`` plays: a scenario
    name gives its main turns, ``<scenario>/<subagent>`` that subagent's
    turns; None when either is unknown."""
    name, _, subagent = model.partition(SUBAGENT_SEPARATOR)
    scenario = scenarios.get(name)
    if scenario is None:
        return None
    if not subagent:
        return scenario, scenario.turns
    turns = scenario.subagents.get(subagent)
    return (scenario, turns) if turns else None


def _describe(error: ValidationError) -> str:
    problems = []
    for item in error.errors():
        where = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in item["loc"])
        where = where.lstrip(".") or "scenario"
        message = item["msg"].removeprefix("Value error, ")
        problems.append(f"{where}: {message}")
    return "; ".join(problems)


def load_scenario(path: Path) -> Scenario:
    """Read and validate one scenario file; its name is the file stem.

    Raises :class:`ScenarioError` (naming the file) when the file cannot be
    read, is not JSON, or does not follow the format.
    """
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ScenarioError(path, f"cannot read the file: {exc.strerror or exc}") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ScenarioError(path, f"not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ScenarioError(path, "the top level must be a JSON object")
    if "name" in data:
        # The name must be what clients ask for, so it has one source.
        raise ScenarioError(path, "'name' is not allowed; the scenario name is the file stem")
    try:
        return Scenario.model_validate({"name": path.stem, **data})
    except ValidationError as exc:
        raise ScenarioError(path, _describe(exc)) from exc


def load_scenarios(directory: Path | None = None) -> dict[str, Scenario]:
    """Load every ``*.json`` file of ``directory`` (default: the bundled
    ``audit/replay/scenarios/``) into ``{scenario name: Scenario}``, sorted
    by name.

    Raises :class:`ScenarioError` for the first malformed file and
    :class:`NotADirectoryError` when ``directory`` is not a directory.
    """
    directory = BUNDLED_DIR if directory is None else Path(directory)
    if not directory.is_dir():
        raise NotADirectoryError(f"scenario directory not found: {directory}")
    return {path.stem: load_scenario(path) for path in sorted(directory.glob("*.json"))}
