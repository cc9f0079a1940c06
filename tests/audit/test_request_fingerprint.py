"""Every audited model call keeps the fingerprint of the request it sent
(``metadata.request``), so a replay of a run can tell at which step the
agent's request changed (R-REPLAY-2): real runs of the bundled scenarios
against the replay model server, and :func:`request_fingerprint` on
requests built by hand."""

from __future__ import annotations

import hashlib

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage

from audit.agents.assistant import SYSTEM_PROMPT
from audit.agents.tools import ASSISTANT_TOOLS
from audit.execution import model_requests
from audit.execution.fingerprint import request_fingerprint
from audit.execution.runner import run_execute
from audit.models import AgentRun
from conversations.models import Conversation, Message
from tests.conftest import make_run

pytestmark = pytest.mark.django_db(transaction=True)

KEYS = {"digest", "system", "tools", "tool_names", "tool_digests", "messages", "message_count"}


def requests_of(user, scenario: str, text: str = "weather in Paris?") -> list[dict]:
    """The fingerprints of a run of ``scenario`` on a new thread, in call order."""
    thread = Conversation.objects.create(user=user, agent_id="assistant", model=f"replay:{scenario}")
    run = make_run(thread, text=text)
    run_execute(run_id=run.id, owner="in-process")
    run.refresh_from_db()
    assert run.status == AgentRun.Status.COMPLETED, (run.status, run.error_type)
    rows = Message.objects.model_calls().filter(run=run).order_by("sequence")
    return [row.metadata.get("request") for row in rows]


def test_each_model_call_row_keeps_the_fingerprint_of_its_request_R_REPLAY_2(user, replay_models):
    first, second = requests_of(user, "tool_then_answer")

    assert set(first) == set(second) == KEYS
    # The answer's request adds the AI message with its tool call and the
    # tool's result to the same system prompt and tools.
    assert second["message_count"] == first["message_count"] + 2
    assert (second["system"], second["tools"]) == (first["system"], first["tools"])
    assert second["messages"] != first["messages"] and second["digest"] != first["digest"]
    assert first["system"] == hashlib.sha256(SYSTEM_PROMPT.encode()).hexdigest()
    assert first["tool_names"] == sorted(tool.name for tool in ASSISTANT_TOOLS)
    assert all(len(first[key]) == 64 for key in ("digest", "system", "tools", "messages"))


def test_the_same_turn_on_two_threads_fingerprints_the_same_step_by_step_R_REPLAY_2(user, replay_models):
    # The message ids (the human message's, each AI message's lc_run--…,
    # each tool message's) differ between the two runs; what was sent does not.
    one = requests_of(user, "two_tools_then_answer", text="weather and a sum")
    other = requests_of(user, "two_tools_then_answer", text="weather and a sum")
    assert len(one) >= 2 and None not in one
    assert one == other

    changed = requests_of(user, "two_tools_then_answer", text="weather and a product")
    assert [r["digest"] for r in changed] != [r["digest"] for r in one]
    assert [r["system"] for r in changed] == [r["system"] for r in one]


def test_a_fingerprint_that_fails_leaves_the_call_and_its_row_as_they_were_R_REPLAY_2(user, replay_models, monkeypatch):
    def broken(messages, invocation_params):
        raise ValueError("unreadable message")

    monkeypatch.setattr(model_requests, "request_fingerprint", broken)
    assert requests_of(user, "tool_then_answer") == [None, None]


# --- request_fingerprint on requests built by hand -----------------------------


def schema(name: str, description: str = "A tool.") -> dict:
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": {"type": "object", "properties": {}}},
    }


def request(
    *, system: str = "Be brief.", result: str = '{"temperature_c": 18}', ids: str = "a", metadata: dict | None = None
) -> list:
    return [
        SystemMessage(system),
        HumanMessage("weather in Paris?", id=f"human-{ids}"),
        AIMessage(
            "",
            id=f"lc_run--{ids}",
            tool_calls=[{"id": "call_1", "name": "get_weather", "args": {"city": "Paris"}}],
            response_metadata=metadata or {},
            usage_metadata={"input_tokens": 10, "output_tokens": 2, "total_tokens": 12},
            additional_kwargs={"refusal": None} if metadata else {},
        ),
        ToolMessage(result, tool_call_id="call_1", name="get_weather", id=f"tool-{ids}"),
    ]


TOOLS = {"tools": [schema("get_weather"), schema("calculator")], "model": "gpt-x", "temperature": 0.2}


def differing(a: dict, b: dict) -> set[str]:
    return {key for key in a if a[key] != b[key]}


def test_the_fingerprint_changes_with_what_was_sent_and_only_there_R_REPLAY_2():
    base = request_fingerprint(request(), TOOLS)
    assert set(base) == KEYS and base["message_count"] == 3
    assert base["tool_names"] == ["calculator", "get_weather"]

    assert differing(base, request_fingerprint(request(system="Be thorough."), TOOLS)) == {"system", "digest"}
    renamed = {**TOOLS, "tools": [schema("get_weather", "Weather now."), schema("calculator")]}
    changed = request_fingerprint(request(), renamed)
    assert differing(base, changed) == {"tools", "tool_digests", "digest"}
    # Which tool's definition changed, by name.
    assert {n for n in base["tool_digests"] if base["tool_digests"][n] != changed["tool_digests"][n]} == {"get_weather"}
    added = {**TOOLS, "tools": [*TOOLS["tools"], schema("send_email")]}
    assert differing(base, request_fingerprint(request(), added)) == {"tools", "tool_names", "tool_digests", "digest"}
    assert differing(base, request_fingerprint(request(result='{"temperature_c": 19}'), TOOLS)) == {
        "messages",
        "digest",
    }
    # Nothing of the run that sent it: ids, provider metadata, usage, the
    # model's own parameters.
    other_run = request(ids="b", metadata={"model_name": "gpt-x", "response_id": "chatcmpl-1"})
    assert request_fingerprint(other_run, {**TOOLS, "model": "gpt-y", "temperature": 1.0}) == base


def test_a_request_without_system_prompt_or_tools_and_with_lone_surrogates_R_REPLAY_2():
    fingerprint = request_fingerprint([HumanMessage("half a pair: \ud83d"), AIMessage("ok")], {})
    assert (fingerprint["system"], fingerprint["tools"], fingerprint["tool_names"]) == ("", "", [])
    assert fingerprint["message_count"] == 2
    assert request_fingerprint([HumanMessage("half a pair: \ud83d")], None) != request_fingerprint(
        [HumanMessage("half a pair: \ud83e")], None
    )
