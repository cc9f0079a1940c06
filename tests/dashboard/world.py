"""A hand-built set of threads, runs, audit rows and feedback with known
dashboard answers (R-DASH-1, R-READ-4). Rows are created through the ORM
with explicit timestamps so that day buckets and time zones are exact.

Day D = 2026-03-10. All rows fall on D in UTC; run 2's rows are at 20:00
UTC, which is already D + 1 in Asia/Shanghai (UTC+8).

Known answers for the window D..D in UTC:
- conversations 2, active users 2, runs 2 (completed 1, failed 1);
- messages 3: user 1, answer of run 1, user 2. The 7 audit rows (model
  calls and tool rows) are not counted;
- tokens: input 31, output 17, total 48;
- tokens by model — the configured model of the call's run, never the
  provider's name (``gpt-a``/``gpt-b`` in the rows' metadata), and the
  call cut off before usage counts under its run's model too:
  MODEL_A (replay:tool_then_answer) 2 calls 45 tokens, MODEL_B
  (replay:plain_answer) 2 calls 3 tokens (one cut off, 0 tokens);
- latency of completed calls: MODEL_A p50 200 ms, p95 290 ms (100 and
  300); MODEL_B 200 ms;
- tools: 3 executions (get_weather 2: 1 success, 1 failure; calculator 1
  interrupted), the rejected send_email is no execution;
- feedback: 1 like, 1 dislike (rate 0.5); the like on an audit row is
  excluded.
"""

from __future__ import annotations

import datetime as dt
import uuid
from dataclasses import dataclass

from audit.models import AgentRun
from conversations.models import Conversation, Message, MessageFeedback

MODEL_A = "replay:tool_then_answer"
MODEL_B = "replay:plain_answer"

D = dt.date(2026, 3, 10)
UTC = dt.UTC


def at(hour: int, minute: int = 0, second: int = 0, *, day: dt.date = D) -> dt.datetime:
    return dt.datetime(day.year, day.month, day.day, hour, minute, second, tzinfo=UTC)


@dataclass
class World:
    thread_a: Conversation
    thread_b: Conversation
    run_1: AgentRun
    run_2: AgentRun
    answer: Message
    audit_model_row: Message


def _message(*, when: dt.datetime, **fields) -> Message:
    row = Message.objects.create(**fields)
    Message.objects.filter(pk=row.pk).update(created_at=when)
    return row


def _audit(run, *, role, message_type, op, seq, started, duration_ms=None, status="completed", **fields) -> Message:
    finished = started + dt.timedelta(milliseconds=duration_ms) if (started and duration_ms is not None) else None
    return _message(
        when=started or run.created_at,
        thread=run.thread,
        run=run,
        role=role,
        message_type=message_type,
        operation_id=op,
        sequence=seq,
        started_at=started,
        finished_at=finished,
        duration_ms=duration_ms,
        execution_status=status,
        **fields,
    )


def build_world(user_a, user_b, *, day: dt.date = D) -> World:
    """The world of this module's docstring, on ``day`` (default D)."""

    def at_(*args):
        return at(*args, day=day)

    thread_a = Conversation.objects.create(user=user_a, agent_id="assistant", model=MODEL_A)
    thread_b = Conversation.objects.create(user=user_b, agent_id="assistant", model=MODEL_B)
    Conversation.objects.filter(pk=thread_a.pk).update(created_at=at_(8))
    Conversation.objects.filter(pk=thread_b.pk).update(created_at=at_(19))

    run_1 = AgentRun.objects.create(
        request_id=uuid.uuid4().hex,
        thread=thread_a,
        user=user_a,
        agent_id="assistant",
        model=thread_a.model,
        status=AgentRun.Status.COMPLETED,
        started_at=at_(9),
        finished_at=at_(9, 0, 6),
    )
    run_2 = AgentRun.objects.create(
        request_id=uuid.uuid4().hex,
        thread=thread_b,
        user=user_b,
        agent_id="assistant",
        model=thread_b.model,
        status=AgentRun.Status.FAILED,
        started_at=at_(20),
        finished_at=at_(20, 0, 3),
    )
    AgentRun.objects.filter(pk=run_1.pk).update(created_at=at_(9))
    AgentRun.objects.filter(pk=run_2.pk).update(created_at=at_(20))

    A, M, T = Message.Role.ASSISTANT, Message.Type.MODEL_AUDIT, Message.Type.TOOL_AUDIT
    _message(when=at_(9), thread=thread_a, run=run_1, role=Message.Role.USER, content="weather?")
    declarations = [
        {"id": "t1", "name": "get_weather", "args": {"city": "Paris"}},
        {"id": "t2", "name": "get_weather", "args": {"city": "Atlantis"}},
        {"id": "t3", "name": "calculator", "args": {"expression": "1/0"}},
        {"id": "t4", "name": "send_email", "args": {"to": "x@example.com"}},
    ]
    model_row = _audit(
        run_1,
        role=A,
        message_type=M,
        op="call-1",
        seq=1,
        started=at_(9, 0, 1),
        duration_ms=100,
        usage={"input_tokens": 10, "output_tokens": 5, "total_tokens": 15},
        metadata={"model_name": "gpt-a"},
        tool_calls=declarations,
    )
    tool = dict(role=Message.Role.TOOL, message_type=T, declared_by=model_row)
    _audit(
        run_1,
        op="t1",
        seq=2,
        started=at_(9, 0, 2),
        duration_ms=5,
        tool_name="get_weather",
        content="sunny",
        metadata={"raw_output": {"content": "sunny"}},
        **tool,
    )
    _audit(
        run_1,
        op="t2",
        seq=3,
        started=at_(9, 0, 2),
        duration_ms=5,
        status="failed",
        tool_name="get_weather",
        content="unknown city",
        **tool,
    )
    _audit(run_1, op="t3", seq=4, started=at_(9, 0, 3), status="interrupted", tool_name="calculator", **tool)
    _audit(
        run_1,
        op="t4",
        seq=5,
        started=None,
        status="rejected",
        tool_name="send_email",
        metadata={"source": "approval_rejected"},
        **tool,
    )
    answer = _audit(
        run_1,
        role=A,
        message_type=Message.Type.TEXT,
        op="call-2",
        seq=6,
        started=at_(9, 0, 5),
        duration_ms=300,
        content="It is sunny in Paris.",
        usage={"input_tokens": 20, "output_tokens": 10, "total_tokens": 30},
        metadata={"model_name": "gpt-a", "state_reconciled": True},
    )
    AgentRun.objects.filter(pk=run_1.pk).update(output_message=answer)

    _message(when=at_(20), thread=thread_b, run=run_2, role=Message.Role.USER, content="hello")
    # Same operation id as in run 1: another run, another row.
    _audit(
        run_2,
        role=A,
        message_type=M,
        op="call-1",
        seq=1,
        started=at_(20, 0, 1),
        duration_ms=200,
        usage={"input_tokens": 1, "output_tokens": 2, "total_tokens": 3},
        metadata={"model_name": "gpt-b"},
    )
    _audit(run_2, role=A, message_type=M, op="call-2", seq=2, started=at_(20, 0, 2), status="abandoned")

    like = MessageFeedback.objects.create(message=answer, user=user_a, rating="like", reason="clear")
    dislike = MessageFeedback.objects.create(message=answer, user=user_b, rating="dislike", reason="too short")
    on_audit = MessageFeedback.objects.create(message=model_row, user=user_a, rating="like")
    MessageFeedback.objects.filter(pk=like.pk).update(created_at=at_(10))
    MessageFeedback.objects.filter(pk=dislike.pk).update(created_at=at_(21))
    MessageFeedback.objects.filter(pk=on_audit.pk).update(created_at=at_(11))
    return World(thread_a, thread_b, run_1, run_2, answer, model_row)
