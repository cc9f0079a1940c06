"""The effect ledger's facts (R-EFF-1, first step): every tool execution
carries its effect key — the turn id, the tool call id and the spawning
``task`` call, the same in every run of the turn — and the attempt that
wrote it; the run and the timeline show them over the API; every tool of
every built-in agent declares whether it is idempotent.

Runs go through the real runner, the built-in agents and the replay model
server, in process."""

from __future__ import annotations

import pytest
from django.test import Client

from audit import export, ledger
from audit.agents.assistant import build_agent
from audit.agents.researcher import FACT_CHECKER_TOOLS
from audit.agents.tools import send_email, tool_is_idempotent
from audit.catalogue import AGENTS
from audit.execution.runner import run_execute
from audit.ledger.tool_audit import effect_key
from audit.models import AgentRun
from conversations.models import Conversation, Message
from tests.conftest import bearer, make_run

TASK_CALL = "call_task_fact_check"
SUBAGENT_TOOL_CALLS = {"call_lookup_retention", "call_lookup_exports"}


def _turn(thread: Conversation, scenario: str, text: str) -> tuple[AgentRun, str]:
    """One turn of ``thread`` played by ``replay:<scenario>``."""
    Conversation.objects.filter(pk=thread.pk).update(model=f"replay:{scenario}")
    thread.refresh_from_db()
    run = make_run(thread, text=text)
    status = run_execute(run_id=run.id, owner="in-process")
    run.refresh_from_db()
    return run, status


def _timeline(run: AgentRun, staff_user) -> list[dict]:
    response = Client().get(f"/api/audit/runs/{run.id}/timeline", headers=bearer(staff_user))
    assert response.status_code == 200
    return response.json()["items"]


@pytest.mark.django_db(transaction=True)
def test_each_tool_row_carries_its_effect_key_and_attempt_over_the_api_R_EFF_1(user, staff_user, replay_models):
    thread = Conversation.objects.create(user=user, agent_id="assistant", model="replay:plain_answer")
    run, status = _turn(thread, "two_tools_then_answer", "weather in Paris and Berlin?")
    assert status == "completed"

    body = Client().get(f"/api/runs/{run.id}", headers=bearer(user)).json()
    assert body["attempt"] == 1

    items = _timeline(run, staff_user)
    tools = [item for item in items if item["kind"] == "tool"]
    models = [item for item in items if item["kind"] == "model"]
    assert len(tools) == 2 and models
    for item in tools:
        assert item["effect_key"] == effect_key(run.turn_id, item["operation_id"], None)
        assert item["attempt"] == 1 and item["replayed_from"] is None
    assert len({item["effect_key"] for item in tools}) == 2
    for item in models:
        assert item["effect_key"] is None and item["attempt"] == 1 and item["replayed_from"] is None
    # The stored rows and the export agree with what the API shows.
    stored = Message.objects.filter(run=run, role=Message.Role.TOOL).values_list("operation_id", "effect_key")
    assert {op: key for op, key in stored} == {item["operation_id"]: item["effect_key"] for item in tools}
    exported = list(export.records(export.run_rows(run.id)))
    fields = ("id", "attempt", "effect_key", "replayed_from")
    assert [{f: r[f] for f in fields} for r in exported] == [{f: item[f] for f in fields} for item in items]


@pytest.mark.django_db(transaction=True)
def test_a_subagents_tool_rows_carry_the_spawning_call_in_their_key_R_EFF_1_R_SUB_1(user, staff_user, replay_models):
    thread = Conversation.objects.create(user=user, agent_id="researcher", model="replay:researcher_fact_check")
    run = make_run(thread, text="Check the retention policy")
    assert run_execute(run_id=run.id, owner="in-process") == "completed"
    run.refresh_from_db()

    tools = {item["operation_id"]: item for item in _timeline(run, staff_user) if item["kind"] == "tool"}
    assert set(tools) == {TASK_CALL, *SUBAGENT_TOOL_CALLS}
    assert tools[TASK_CALL]["effect_key"] == effect_key(run.turn_id, TASK_CALL, None)
    for call in SUBAGENT_TOOL_CALLS:
        assert tools[call]["parent_operation_id"] == TASK_CALL
        assert tools[call]["effect_key"] == effect_key(run.turn_id, call, TASK_CALL)
        # A root call with the same tool call id in this turn has another key.
        assert tools[call]["effect_key"] != effect_key(run.turn_id, call, None)
        assert tools[call]["attempt"] == 1 and tools[call]["replayed_from"] is None


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(("decision", "row_status"), [("approve", "completed"), ("reject", "rejected")])
def test_a_resume_run_keys_the_decided_call_by_its_turn_R_EFF_1(user, staff_user, replay_models, decision, row_status):
    """Approved, the resume run executes the call; rejected, its terminal
    transaction records the call's row: the same turn's key either way."""
    thread = Conversation.objects.create(user=user, agent_id="assistant", model="replay:approval_send_email")
    run, status = _turn(thread, "approval_send_email", "Mail the report")
    assert status == "interrupted"
    resume, _ = ledger.run_resume(user=user, run_id=run.id, request_id="decide-1", decisions=[{"type": decision}])
    assert run_execute(run_id=resume.id, owner="in-process") == "completed"
    resume.refresh_from_db()

    assert resume.turn_id == run.turn_id and resume.pk != run.pk
    (email,) = [item for item in _timeline(resume, staff_user) if item["kind"] == "tool"]
    assert email["tool_name"] == "send_email" and email["status"] == row_status
    # The key is the turn's, whichever run of the turn executes the call.
    assert email["effect_key"] == effect_key(run.turn_id, "call_email_1", None)
    assert email["attempt"] == 1 and email["replayed_from"] is None
    assert Client().get(f"/api/runs/{resume.id}", headers=bearer(user)).json()["attempt"] == 1


@pytest.mark.django_db(transaction=True)
def test_two_turns_reusing_a_tool_call_id_get_different_keys_R_EFF_1(user, staff_user, replay_models):
    thread = Conversation.objects.create(user=user, agent_id="assistant", model="replay:plain_answer")
    run_a, status_a = _turn(thread, "reused_call_id_lookup_alpha", "look up alpha")
    run_b, status_b = _turn(thread, "reused_call_id_lookup_beta", "look up beta")
    assert (status_a, status_b) == ("completed", "completed")
    assert run_a.turn_id != run_b.turn_id

    keys = []
    for run in (run_a, run_b):
        (tool,) = [item for item in _timeline(run, staff_user) if item["kind"] == "tool"]
        assert tool["operation_id"] == "call_0"
        assert tool["effect_key"] == effect_key(run.turn_id, "call_0", None)
        keys.append(tool["effect_key"])
    assert keys[0] != keys[1]


def test_the_effect_key_tells_every_part_apart_R_EFF_1():
    turn = "6f1c2a44-0000-4000-8000-000000000001"
    key = effect_key(turn, "call_a", None)
    assert key == effect_key(turn, "call_a", "") and len(key) == 64
    assert len({key, effect_key(turn, "call_b"), effect_key(turn, "call_a", "call_task")}) == 3
    assert effect_key(turn, "b/c", "a") != effect_key(turn, "c", "a/b")
    assert effect_key("6f1c2a44-0000-4000-8000-000000000002", "call_a") != key
    # Any tool call id makes a key of the same storable form (R-RUN-11).
    assert len(effect_key(turn, "call\x00\ud800")) == 64


def _agent_tools(agent_id: str) -> list:
    graph = build_agent(agent_id, model="replay:plain_answer", checkpointer=None)
    tools = list(graph.nodes["tools"].bound.tools_by_name.values())
    if agent_id == "researcher":
        tools += FACT_CHECKER_TOOLS
    return tools


@pytest.mark.parametrize("agent_id", AGENTS)
def test_every_tool_of_every_built_in_agent_declares_its_idempotency_R_EFF_1(agent_id):
    tools = _agent_tools(agent_id)
    assert tools
    for tool in tools:
        assert isinstance((tool.metadata or {}).get("idempotent"), bool), tool.name
    if agent_id == "assistant":
        assert {tool.name for tool in tools if not tool_is_idempotent(tool)} == {"send_email"}
    else:
        assert {tool.name for tool in tools} == {"task", "lookup_docs"}
        assert all(tool_is_idempotent(tool) for tool in tools)


def test_send_email_is_not_idempotent_and_a_tool_that_declares_nothing_is_not_either_R_EFF_1():
    from langchain_core.tools import tool

    @tool
    def undeclared(x: str) -> str:
        """Echo."""
        return x

    assert send_email.metadata == {"idempotent": False}
    assert not tool_is_idempotent(send_email)
    assert not tool_is_idempotent(undeclared)
    assert not tool_is_idempotent(object())
