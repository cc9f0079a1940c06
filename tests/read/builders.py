"""Drive the worker-side services to leave runs in every state, the way the
runner does (lease, model and tool lifecycles, terminal transaction), so the
readers are tested against rows the real write path makes."""

from __future__ import annotations

import datetime as dt
import uuid

from audit import ledger
from audit.ledger import StateMessage
from audit.models import AgentRun
from tests.conftest import acquire, make_run


class RunDriver:
    """One run of a thread, leased by a test 'worker'."""

    def __init__(self, thread, *, text: str = "weather in Paris?", run: AgentRun | None = None):
        self.run = run or make_run(thread, text=text)
        self.lease = acquire(self.run, owner=f"worker-{uuid.uuid4().hex[:6]}")
        self.seq = 0
        self.state: list[StateMessage] = [StateMessage(kind="human", id=f"human-{self.run.id}", content=text)]

    def _next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def model(
        self,
        op: str,
        *,
        content: str = "",
        tool_calls: list[dict] | None = None,
        finish: bool = True,
        in_state: bool = True,
        usage: dict | None = None,
    ):
        now = dt.datetime.now(dt.UTC)
        ledger.model_call_start(
            lease=self.lease,
            operation_id=op,
            sequence=self._next_seq(),
            started_at=now,
            metadata={"namespace": [], "model_run_id": op},
        )
        if finish:
            ledger.model_call_finish(
                lease=self.lease,
                operation_id=op,
                content=content,
                tool_calls=tool_calls or [],
                usage=usage or {"input_tokens": 10, "output_tokens": 5, "total_tokens": 15},
                finished_at=now,
                duration_ms=12,
                metadata={"model_name": "replay", "finish_reason": "stop"},
            )
        if in_state:
            self.state.append(StateMessage(kind="ai", id=op, content=content, tool_calls=tool_calls or []))
        return self

    def tool(
        self,
        call_id: str,
        name: str = "get_weather",
        *,
        declared_by: str | None = None,
        content: str = '{"conditions": "sunny"}',
        status: str = "completed",
        finish: bool = True,
    ):
        now = dt.datetime.now(dt.UTC)
        ledger.tool_call_start(
            lease=self.lease,
            tool_call_id=call_id,
            tool_name=name,
            tool_input={"city": "Paris"},
            sequence=self._next_seq(),
            started_at=now,
            declared_by_operation_id=declared_by,
            metadata={"namespace": []},
        )
        if finish:
            ledger.tool_call_finish(
                lease=self.lease,
                tool_call_id=call_id,
                status=status,
                content=content,
                raw_output={"type": "tool", "tool_call_id": call_id, "content": content, "secret": "raw-envelope"},
                finished_at=now,
                duration_ms=3,
            )
            self.state.append(
                StateMessage(
                    kind="tool",
                    id=f"tm-{call_id}",
                    content=content,
                    tool_call_id=call_id,
                    status="error" if status == "failed" else "success",
                )
            )
        return self

    def finish(self, status: str = "completed", *, interrupts: list[dict] | None = None, error_type: str = ""):
        run = ledger.run_finish(
            lease=self.lease, status=status, final_state=self.state, interrupts=interrupts, error_type=error_type
        )
        self.run = run
        return run


def tool_turn(thread, *, prefix: str = "a", text: str = "weather in Paris?") -> AgentRun:
    """A completed run: model call with a tool call, the tool, the answer."""
    call = f"call_{prefix}"
    d = RunDriver(thread, text=text)
    d.model(f"lc_run--{prefix}1", tool_calls=[{"id": call, "name": "get_weather", "args": {"city": "Paris"}}])
    d.tool(call, declared_by=f"lc_run--{prefix}1")
    d.model(f"lc_run--{prefix}2", content=f"It is sunny ({prefix}).")
    return d.finish()


def resume_run_of(run: AgentRun, *, decisions: list[dict]) -> AgentRun:
    """A pending resume run of an interrupted run (same turn), as the resume
    endpoint makes it."""
    return AgentRun.objects.create(
        request_id=f"resume-{uuid.uuid4().hex}",
        thread=run.thread,
        turn_id=run.turn_id,
        resumed_from=run,
        user=run.user,
        agent_id=run.agent_id,
        model=run.model,
        input={"decisions": decisions},
    )


def caller_headers(case, world) -> dict:
    """The case's headers with the token of whom its path is for."""
    staff_only = case.path.startswith(("/api/audit/", "/api/dashboard/"))
    return {**(case.headers or {}), **(world["staff"] if staff_only else world["owner"])}
