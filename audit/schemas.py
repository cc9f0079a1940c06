from __future__ import annotations

import uuid
from datetime import datetime
from decimal import Decimal
from typing import Annotated, Any, Literal, get_args

from ninja import Field, Schema
from pydantic import WithJsonSchema

from webhooks.targets import MAX_URL_LENGTH, URL_PATTERN
from yuxi_project.api_types import USD_AMOUNT_SCHEMA, Cursor, IsoDateTime, comma_list_pattern, explained

REQUEST_ID_PATTERN = explained(r"^[A-Za-z0-9._:\-]+$", "may hold only letters A-Z a-z, digits and . _ : -")
NOT_ONLY_WHITE_SPACE = r"[^\t\n\v\f\r \x1c-\x1f\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]"


class TurnInput(Schema):
    text: str = Field(
        ...,
        min_length=1,
        max_length=100_000,
        description="The user's message: not only white space.",
        # Documents the service's check (``input.text must not be empty``,
        # Python's ``str.strip``): a character that is not white space as
        # Python counts it. Not ``\S``: JavaScript's white space leaves out
        # U+0085 and U+001C-U+001F, which Python strips, and adds U+FEFF.
        json_schema_extra={"pattern": NOT_ONLY_WHITE_SPACE},
    )


WEBHOOK_FIELD = Field(
    None,
    min_length=1,
    max_length=MAX_URL_LENGTH,
    pattern=explained(URL_PATTERN, "must be an http:// or https:// URL: a host, an optional port, no user name"),
    description="A URL the run's end is POSTed to (R-API-3): the body of `GET /api/runs/{run_id}` as it ended, "
    "signed (`X-Yuxi-Signature: sha256=<hex>`, HMAC-SHA256 of the body with the server's `WEBHOOK_SECRET`), "
    "with `X-Yuxi-Delivery` (the same id in every retry); retried until the receiver answers 2xx. Its host "
    "must be in the server's `WEBHOOK_ALLOWED_HOSTS`, else 403 `webhook_not_allowed`.",
)


class RunIn(Schema):
    request_id: str = Field(..., min_length=1, max_length=200, pattern=REQUEST_ID_PATTERN)
    input: TurnInput
    multitask_strategy: Literal["enqueue", "reject", "interrupt", "rollback"] = Field(
        "enqueue",
        description="What this turn does to the thread's runs still pending or running (R-API-2): `enqueue` runs "
        "after them; `reject` answers 409 `thread_busy` while there is one; `interrupt` cancels them (a running "
        "run stops at its next event boundary) and runs next; `rollback` as `interrupt`, and their turns leave "
        "the history and the agent's memory (their audit rows stay, the runs show `rolled_back_by`).",
    )
    webhook: str | None = WEBHOOK_FIELD


class DecisionIn(Schema):
    """One reviewer decision for one pending action request (R-TA-5): its
    type is one of the request's ``allowed_decisions`` (``retry`` and
    ``skip`` answer an "outcome unknown" request, R-RUN-15)."""

    type: Literal["approve", "edit", "reject", "retry", "skip"]
    args: dict[str, Any] | None = Field(None, description="edit: the arguments the tool runs with instead.")
    message: str | None = Field(None, max_length=10_000, description="reject: the reason given to the model.")


class RunResumeIn(Schema):
    request_id: str = Field(..., min_length=1, max_length=200, pattern=REQUEST_ID_PATTERN)
    decisions: list[DecisionIn] = Field(..., min_length=1, max_length=100)
    webhook: str | None = WEBHOOK_FIELD


class UsageOut(Schema):
    input_tokens: int = 0
    output_tokens: int = 0
    total_tokens: int = 0
    # Model calls cut off before the provider reported usage: their tokens
    # are unknown, not zero.
    unknown_calls: int = 0


class RunCostOut(Schema):
    """Summed from the run's model rows (R-COST-2)."""

    total_usd: str | None = Field(None, description="USD, decimal string; null only when no call has a known cost.")
    unknown_cost_calls: int = Field(0, description="Finished model calls whose cost is unknown (never counted as 0).")


class ActionRequestOut(Schema):
    kind: Literal["approval", "outcome_unknown"] = Field(
        "approval",
        description=(
            "`approval`: a tool call that needs approval (approve, edit, reject). `outcome_unknown`: a tool "
            "call cut off when its worker stopped, whose effect may or may not have happened (retry, skip; "
            "R-RUN-15)."
        ),
    )
    name: str | None
    args: Any = None
    description: str | None = None
    allowed_decisions: list[str]


class ApprovalOut(Schema):
    """A human approval an interrupted run asked for (R-TA-5)."""

    status: Literal["pending", "answered"] = Field(..., description="`answered` once a resume run exists.")
    action_requests: list[ActionRequestOut]
    resume_run_id: uuid.UUID | None = Field(None, description="The resume run that answered it.")
    resume_run_status: str | None = None
    decisions: list[dict[str, Any]] | None = Field(None, description="The decisions, one per action request.")


class RunOut(Schema):
    run_id: uuid.UUID
    thread_id: uuid.UUID
    turn_id: uuid.UUID
    resumed_from: uuid.UUID | None
    request_id: str
    agent_id: str
    model: str
    status: Literal["pending", "running", "cancel_requested", "completed", "failed", "cancelled", "interrupted"]
    attempt: int = Field(
        ..., ge=1, description="Which execution of the run: 1 for a run never recovered from a dead worker (R-RUN-15)."
    )
    error_type: str
    error_message: str
    output_message_id: int | None
    pending_approval: list[dict[str, Any]] | None = Field(
        None,
        description="The interrupt payloads (action requests and review configs) while the approval is open: "
        "null once a resume run answered it.",
    )
    approval: ApprovalOut | None = Field(
        None, description="The approval the run asked for and, once answered, by which resume run and decisions."
    )
    usage: UsageOut | None
    cost: RunCostOut
    rolled_back_by: uuid.UUID | None = Field(
        None,
        description="The run of the turn that rolled this run's turn back (`multitask_strategy: rollback`, "
        "R-API-2): the turn left the history and the memory, its audit rows stay.",
    )
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None

    @staticmethod
    def from_run(run, *, cost: dict[str, Any] | None = None, resumes: dict[uuid.UUID, Any] | None = None) -> RunOut:
        """The body of ``run``; ``cost`` is its :func:`costs.selectors.run_cost`
        and ``resumes`` the :func:`audit.reads.selectors.resumes_of` of runs
        including it, when the caller read them already (a page of runs:
        ``run_costs`` and ``resumes_of``, one query each; R-API-1)."""
        from costs.selectors import run_cost, usd_text

        from .reads.selectors import approval_of, rolled_back_by

        cost = cost if cost is not None else run_cost(run.id)
        approval = approval_of(run, resumes=resumes)
        return RunOut(
            run_id=run.id,
            thread_id=run.thread_id,
            turn_id=run.turn_id,
            resumed_from=run.resumed_from_id,
            request_id=run.request_id,
            agent_id=run.agent_id,
            model=run.model,
            status=run.status,
            attempt=run.attempt,
            error_type=run.error_type,
            error_message=run.error_message,
            output_message_id=run.output_message_id,
            pending_approval=run.interrupts if approval and approval["status"] == "pending" else None,
            approval=approval,
            usage=run.usage,
            cost=RunCostOut(total_usd=usd_text(cost["total_usd"]), unknown_cost_calls=cost["unknown_cost_calls"]),
            rolled_back_by=rolled_back_by(run),
            created_at=run.created_at,
            started_at=run.started_at,
            finished_at=run.finished_at,
        )


class ThreadRunListQuery(Schema):
    limit: int = Field(20, ge=1, le=100, description="At most 100 runs per page.")
    before: Cursor | None = Field(None, description="`next_before` of the newer page.")


class ThreadRunListOut(Schema):
    items: list[RunOut] = Field(..., description="Newest first, each the body of `GET /api/runs/{run_id}`.")
    has_more: bool = Field(..., description="Older runs exist; page with `before=next_before`.")
    next_before: str | None


class TimelineQuery(Schema):
    limit: int = Field(500, ge=1, le=500, description="At most 500 rows per page.")
    before: Cursor | None = Field(None, description="`next_before` of the newer page.")


class TimelineItemOut(Schema):
    """One model call or tool execution of the audit (staff only)."""

    id: int
    kind: Literal["model", "tool"]
    run_id: uuid.UUID
    operation_id: str
    sequence: int | None
    status: Literal["running", "completed", "failed", "interrupted", "abandoned", "rejected"] | None
    started_at: datetime | None
    finished_at: datetime | None
    duration_ms: int | None = Field(None, description="Monotonic duration in ms.")
    usage: dict[str, Any] | None = Field(None, description="Tokens as the provider reported them.")
    usage_cause: str | None = Field(
        None,
        description="Why `usage` is null, when known: `usage_mode_conflict` (the stream's reports contradict "
        "the model's usage mode, R-MA-12); null otherwise.",
    )
    cost_usd: str | None = Field(
        None, description="Model calls: USD, decimal string; null while running or when unknown (R-COST-1)."
    )
    price_source: str = Field("", description="Where the price came from (genai-prices, MODEL_PRICES, ...).")
    price_version: str = Field("", description="Version of that price.")
    content: str
    tool_calls: list[dict[str, Any]] | None = Field(None, description="Tool calls the model declared.")
    tool_name: str | None
    tool_input: Any = None
    declared_by_id: int | None
    namespace: list[str] = Field(
        default_factory=list,
        description="Stream namespace of the call: [] at the root, the subagent's inside one (R-SUB-1).",
    )
    parent_operation_id: str | None = Field(
        None, description="Tool call id of the `task` call whose subagent made this call; null at the root (R-SUB-1)."
    )
    attempt: int = Field(..., ge=1, description="The run attempt that wrote the row (R-RUN-15).")
    effect_key: str | None = Field(
        None,
        description="Tool rows: the execution's effect key, the same in every run of the turn (turn id, tool call id "
        "and the spawning `task` call; R-EFF-1); null for model rows.",
    )
    replayed_from: int | None = Field(
        None,
        description="`id` of the original tool row whose recorded result this row returned instead of executing "
        "the tool again (R-EFF-1); null otherwise.",
    )
    rolled_back: bool = Field(
        False,
        description="The row's run was rolled back by a later turn (`multitask_strategy: rollback`, R-API-2): the "
        "row stays, out of the history and the memory.",
    )
    is_final_answer: bool
    metadata: dict[str, Any]
    raw_output: Any = Field(None, description="The tool's raw output envelope.")
    workspace_path: str | None = Field(
        None, description="Workspace file of a large tool result (per execution, R-TA-7), else null."
    )
    payload_note: str | None = Field(
        None, description='"payload purged on <date>" or "payload erased on <date>" (R-GOV-1, R-GOV-2), else null.'
    )


class TimelineOut(Schema):
    items: list[TimelineItemOut] = Field(..., description="Runs in creation order, then sequence.")
    truncated: bool = Field(..., description="Older rows exist; page back with `next_before`.")
    next_before: str | None


# --------------------------------------------------------------------------
# Finding and exporting runs (R-ADM-2, staff)
# --------------------------------------------------------------------------

RunStatus = Literal["pending", "running", "cancel_requested", "completed", "failed", "cancelled", "interrupted"]
ExecutionStatus = Literal["running", "completed", "failed", "interrupted", "abandoned", "rejected"]

#: ``failed,cancelled``: the schema names the statuses; the server's own
#: check answers an unknown one with the allowed list (``parse_statuses``).
RunStatusList = Annotated[
    str,
    Field(max_length=200),
    WithJsonSchema(
        {"type": "string", "maxLength": 200, "pattern": comma_list_pattern(get_args(RunStatus), empty=True)}
    ),
]


class RunFilterQuery(Schema):
    """Run filters of the staff run list and export (R-ADM-2). Every filter
    is optional; given ones must all match."""

    status: RunStatusList | None = Field(
        None, description="A run status, or several separated by commas (`failed,cancelled`); blank: any."
    )
    error_type: str | None = Field(None, max_length=100, description="Exact error type (`model_error`, …).")
    model: str | None = Field(None, max_length=200, description="Configured model name (`replay:plain_answer`).")
    agent: str | None = Field(None, max_length=100, description="Agent id.")
    user: str | None = Field(None, max_length=150, description="Username, or numeric user id.")
    from_: IsoDateTime | None = Field(None, alias="from", description="Created at or after (ISO 8601; naive = UTC).")
    to: IsoDateTime | None = Field(
        None,
        description="Created before (ISO 8601; naive = UTC); at or after `from` (else 422, `field: from`; "
        "equal: an empty window).",
    )
    tool: str | None = Field(None, max_length=200, description="A tool row of this tool name.")
    tool_status: ExecutionStatus | None = Field(
        None, description="A tool row in this status (with `tool`: the same row)."
    )
    rejected: bool | None = Field(None, description="true: has a rejected approval; false: has none.")
    min_duration_ms: int | None = Field(None, ge=0, le=10**12, description="Run duration at least this, in ms.")
    min_cost_usd: Annotated[Decimal, WithJsonSchema(USD_AMOUNT_SCHEMA)] | None = Field(
        None,
        ge=0,
        max_digits=18,
        decimal_places=9,
        description="Run cost at least this, in USD (a decimal string, where recorded).",
    )
    q: str | None = Field(
        None,
        max_length=500,
        description="A run/thread/turn id or its first 8+ hex digits, a request id, an operation id, "
        'or words of one of the run\'s messages or audit rows (`websearch_to_tsquery`: `"a phrase"`, `or`, `-word`).',
    )

    def as_filters(self):
        from .reads.search import filters_from

        return filters_from({**self.model_dump(exclude={"from_"}), "from": self.from_})


class RunListQuery(RunFilterQuery):
    limit: int = Field(50, ge=1, le=200, description="At most 200 runs per page.")
    before: Cursor | None = Field(None, description="`next_before` of the previous page.")


class ExportQuery(Schema):
    format: Literal["jsonl", "csv"] = Field("jsonl", description="JSON lines or CSV.")


class RunListExportQuery(RunFilterQuery):
    format: Literal["jsonl", "csv"] = Field("jsonl", description="JSON lines or CSV.")


class RunSummaryOut(Schema):
    """One run of the staff run list."""

    run_id: uuid.UUID
    thread_id: uuid.UUID
    turn_id: uuid.UUID
    resumed_from: uuid.UUID | None
    request_id: str
    user: str
    agent_id: str
    model: str
    status: RunStatus
    error_type: str
    model_calls: int
    tool_executions: int
    usage: UsageOut | None
    duration_ms: int | None = Field(None, description="Finished minus started, in ms (null while not finished).")
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None

    @staticmethod
    def from_run(run) -> RunSummaryOut:
        duration = (
            round((run.finished_at - run.started_at).total_seconds() * 1000)
            if run.started_at and run.finished_at
            else None
        )
        return RunSummaryOut(
            run_id=run.id,
            thread_id=run.thread_id,
            turn_id=run.turn_id,
            resumed_from=run.resumed_from_id,
            request_id=run.request_id,
            user=run.user.get_username(),
            agent_id=run.agent_id,
            model=run.model,
            status=run.status,
            error_type=run.error_type,
            model_calls=run.model_call_count,
            tool_executions=run.tool_execution_count,
            usage=run.usage,
            duration_ms=duration,
            created_at=run.created_at,
            started_at=run.started_at,
            finished_at=run.finished_at,
        )


class RunListOut(Schema):
    items: list[RunSummaryOut] = Field(..., description="Newest first.")
    has_more: bool = Field(..., description="Older matching runs exist; page with `before=next_before`.")
    next_before: str | None


# --------------------------------------------------------------------------
# A run's turn as a replay scenario (R-REPLAY-1, staff)
# --------------------------------------------------------------------------


class ScenarioToolCallOut(Schema):
    id: str
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict, description="The decoded arguments object.")


class ScenarioUsageOut(Schema):
    prompt_tokens: int
    completion_tokens: int
    prompt_tokens_details: dict[str, int] | None = Field(
        None, description="`cached_tokens` (cache read) and `cache_write_tokens`, parts of `prompt_tokens`."
    )
    completion_tokens_details: dict[str, int] | None = Field(
        None, description="`reasoning_tokens`, part of `completion_tokens`."
    )


class ScenarioFailBeforeFirstChunkOut(Schema):
    status: int
    times: int
    retry_after: float | None = Field(None, description="Seconds the provider asked to wait.")
    error_message: str | None = None


class ScenarioTurnOut(Schema):
    """One model call as the replay server plays it (``audit.replay.scenarios.Turn``);
    absent keys take the server's defaults."""

    text: str | None = None
    tool_calls: list[ScenarioToolCallOut] | None = None
    usage: ScenarioUsageOut | None = Field(None, description="Tokens as the provider reported them; absent: unknown.")
    http_status: int | None = Field(None, description="The call failed with this HTTP status (`model_http_error`).")
    error_message: str | None = None
    fail_after_chunks: int | None = Field(None, description="The stream broke after this many chunks.")
    connect_error_times: int | None = Field(None, description="Attempts that failed to connect first (R-RUN-12).")
    fail_before_first_chunk: ScenarioFailBeforeFirstChunkOut | None = None


class ScenarioToolResultOut(Schema):
    content: str
    status: ExecutionStatus


class ScenarioResumeOut(Schema):
    run_id: uuid.UUID
    decisions: list[dict[str, Any]] = Field(..., description="The resume's decisions as submitted (R-TA-5).")


class ScenarioRecordedOut(Schema):
    """Facts the replay server does not play, for a replay to compare with."""

    agent_id: str
    run_ids: list[uuid.UUID] = Field(..., description="The turn's runs: the first, then each resume, in order.")
    status: RunStatus = Field(..., description="How the last run ended.")
    error_type: str
    resumes: list[ScenarioResumeOut]
    tool_results: dict[str, ScenarioToolResultOut] = Field(..., description="Tool call id → what the tool returned.")


class ScenarioOut(Schema):
    """A run's turn as a replay scenario file without its name (the file
    stem names it): ``Scenario.model_validate({"name": ..., **body})``
    accepts it (R-REPLAY-1)."""

    description: str
    turns: list[ScenarioTurnOut] = Field(..., description="The root agent's model calls, in order.")
    subagents: dict[str, list[ScenarioTurnOut]] | None = Field(
        None, description="Each subagent's model calls, by subagent name (R-SUB-1)."
    )
    recorded: ScenarioRecordedOut
