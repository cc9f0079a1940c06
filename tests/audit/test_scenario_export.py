"""An audited turn exports as a replay scenario (R-REPLAY-1): real runs of
the bundled scenarios, executed in process against the replay model
server, export back to the turns they played, on the facts the audit
records: text, tool call ids, names and arguments, usage, failures.

Round trip (:func:`test_every_bundled_single_turn_scenario_exports_as_it_played_R_REPLAY_1`):
every bundled scenario that one turn of its agent plays to the end without
human input — ``researcher`` for ``researcher_*``, else ``assistant``. Not
in it, because a single turn cannot play them to the end (they stop
``interrupted`` for a human's approval of ``send_email``):
``approval_send_email``, ``approval_send_email_slow_confirmation``,
``approval_then_large_lookup``, ``reused_call_id_email_alpha``,
``reused_call_id_email_beta``; an approval and its resume exported as one
turn is tested on ``approval_send_email`` below.

What the comparison leaves out, and why: ``chunk_delay_ms`` and
``chunk_chars`` (timing, never audited; the round trip serves the bundled
scenarios without delays so that it takes seconds, not minutes) and
``usage_mode`` (the worker stores the folded total, not how the provider
reported it). What a provider never delivered is not expected back: a
stream broken after N chunks exports the text of those chunks and no
usage; a model never reached exports no text and the attempts the worker
made; a turn after a tool error that fails the run is never asked for.
"""

from __future__ import annotations

import json
import uuid

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client

from audit import ledger
from audit.execution.runner import run_execute
from audit.models import AgentRun
from audit.replay.export import RunNotFound, export_scenario, scenario_json, validate
from audit.replay.scenarios import Turn, load_scenarios
from conversations.models import Conversation
from core.config import get_config
from tests.conftest import bearer, make_run, replay_server_in_thread

pytestmark = pytest.mark.django_db(transaction=True)

BUNDLED = load_scenarios()
NEEDS_APPROVAL = {
    "approval_send_email",
    "approval_send_email_slow_confirmation",
    "approval_then_large_lookup",
    "reused_call_id_email_alpha",
    "reused_call_id_email_beta",
}
SINGLE_TURN = sorted(set(BUNDLED) - NEEDS_APPROVAL)
# Scenarios whose run fails before the model is asked for every turn:
# name -> the number of turns it reaches.
REACHED = {"tool_error_unhandled": 1}
RETRY_ATTEMPTS = 3


def agent_of(scenario: str) -> str:
    return "researcher" if scenario.startswith("researcher_") else "assistant"


@pytest.fixture(scope="module")
def undelayed_server():
    """The bundled scenarios without their chunk delays (timing is not an
    audit fact), served in this process for the round trip."""
    fast = {
        name: scenario.model_copy(
            update={
                "turns": tuple(t.model_copy(update={"chunk_delay_ms": 0}) for t in scenario.turns),
                "subagents": {
                    sub: tuple(t.model_copy(update={"chunk_delay_ms": 0}) for t in turns)
                    for sub, turns in scenario.subagents.items()
                },
            }
        )
        for name, scenario in BUNDLED.items()
    }
    with replay_server_in_thread(fast, name="undelayed-replay-server") as url:
        yield url


@pytest.fixture
def fast_retries(monkeypatch):
    config = get_config()
    monkeypatch.setattr(config, "MODEL_RETRY_ATTEMPTS", RETRY_ATTEMPTS)
    monkeypatch.setattr(config, "MODEL_RETRY_INITIAL_DELAY_SECONDS", 0.02)
    monkeypatch.setattr(config, "MODEL_RETRY_JITTER_SECONDS", 0.0)


def execute(user, scenario: str, text: str = "hello") -> AgentRun:
    thread = Conversation.objects.create(user=user, agent_id=agent_of(scenario), model=f"replay:{scenario}")
    run = make_run(thread, text=text)
    run_execute(run_id=run.id, owner="in-process")
    run.refresh_from_db()
    return run


def facts(turn: Turn) -> dict:
    """What the audit can know of a turn the server played."""
    return turn.model_dump(exclude={"chunk_delay_ms", "chunk_chars", "usage_mode"})


def played(turn: Turn) -> Turn:
    """``turn`` reduced to what the worker received of it (of a turn that
    answers a rejection differently, the answer to an approval: these runs
    approve)."""
    if turn.text_if_rejected is not None:
        turn = turn.model_copy(update={"text_if_rejected": None})
    if turn.connect_error_times >= RETRY_ATTEMPTS:
        return Turn(text="", connect_error_times=RETRY_ATTEMPTS)
    if turn.fail_after_chunks is not None:
        streamed = (turn.text or "")[: max(turn.fail_after_chunks - 1, 0) * turn.chunk_chars]
        return Turn(text=streamed, fail_after_chunks=turn.fail_after_chunks)
    return turn


def expected_turns(turns, reached: int | None = None) -> list[dict]:
    return [facts(played(t)) for t in turns[:reached]]


def exported_turns(turns: list[dict]) -> list[dict]:
    return [facts(Turn.model_validate(t)) for t in turns]


@pytest.mark.parametrize("name", SINGLE_TURN)
def test_every_bundled_single_turn_scenario_exports_as_it_played_R_REPLAY_1(
    name, user, undelayed_server, fast_retries, monkeypatch
):
    monkeypatch.setattr(get_config(), "REPLAY_MODEL_URL", undelayed_server)
    run = execute(user, name)
    assert run.is_terminal and run.status != AgentRun.Status.INTERRUPTED, (run.status, run.error_type)

    scenario = export_scenario(run.id)
    bundled = BUNDLED[name]
    assert exported_turns(scenario["turns"]) == expected_turns(bundled.turns, REACHED.get(name))
    assert {sub: exported_turns(turns) for sub, turns in scenario.get("subagents", {}).items()} == {
        sub: expected_turns(turns) for sub, turns in bundled.subagents.items()
    }
    recorded = scenario["recorded"]
    assert (recorded["status"], recorded["error_type"]) == (run.status, run.error_type)
    assert recorded["run_ids"] == [str(run.id)] and recorded["resumes"] == []
    declared = {
        c.id for t in (*bundled.turns, *(t for ts in bundled.subagents.values() for t in ts)) for c in t.tool_calls
    }
    assert set(recorded["tool_results"]) <= declared
    validate(scenario, name)


def test_an_approval_and_its_resume_export_as_one_turn_with_the_decision_R_REPLAY_1(user, replay_models):
    first = execute(user, "approval_send_email", "Mail the report")
    assert first.status == AgentRun.Status.INTERRUPTED
    alone = export_scenario(first.id)
    assert exported_turns(alone["turns"]) == expected_turns(BUNDLED["approval_send_email"].turns, 1)
    assert alone["recorded"]["status"] == "interrupted" and alone["recorded"]["resumes"] == []

    resume, _ = ledger.run_resume(
        user=user, run_id=first.id, request_id=uuid.uuid4().hex, decisions=[{"type": "approve"}]
    )
    run_execute(run_id=resume.id, owner="in-process")
    resume.refresh_from_db()
    assert resume.status == AgentRun.Status.COMPLETED

    scenario = export_scenario(resume.id)
    assert exported_turns(scenario["turns"]) == expected_turns(BUNDLED["approval_send_email"].turns)
    recorded = scenario["recorded"]
    assert recorded["run_ids"] == [str(first.id), str(resume.id)]
    assert recorded["resumes"] == [{"run_id": str(resume.id), "decisions": [{"type": "approve"}]}]
    assert recorded["status"] == "completed" and recorded["error_type"] == ""
    result = recorded["tool_results"]["call_email_1"]
    assert result["status"] == "completed" and result["content"].startswith("Email to ops@example.com")


@pytest.mark.parametrize("name", ["unstorable_surrogates", "unstorable_tool_args", "researcher_fact_check"])
def test_the_export_validates_and_loads_from_a_scenario_directory_exactly_R_REPLAY_1(
    name, user, replay_models, tmp_path
):
    run = execute(user, name)
    scenario = export_scenario(run.id)
    validated = validate(scenario, "exported")
    (tmp_path / "exported.json").write_text(scenario_json(scenario), encoding="utf-8")

    loaded = load_scenarios(tmp_path)["exported"]
    assert loaded == validated
    # Text PostgreSQL cannot store as given comes back character for character.
    assert [t.text for t in loaded.turns] == [t.text for t in BUNDLED[name].turns]
    assert [c.arguments for t in loaded.turns for c in t.tool_calls] == [
        c.arguments for t in BUNDLED[name].turns for c in t.tool_calls
    ]


def test_the_command_writes_the_scenario_and_refuses_a_bad_run_id_R_REPLAY_1(user, replay_models, tmp_path, capsys):
    run = execute(user, "tool_then_answer")
    path = tmp_path / "incident.json"
    call_command("export_scenario", str(run.id), "-o", str(path))
    assert json.loads(path.read_text(encoding="utf-8")) == json.loads(scenario_json(export_scenario(run.id)))
    assert load_scenarios(tmp_path)["incident"].turns[0].tool_calls[0].id == "call_weather_paris"

    capsys.readouterr()
    call_command("export_scenario", str(run.id))
    assert json.loads(capsys.readouterr().out) == json.loads(path.read_text(encoding="utf-8"))

    for bad in ("not-a-run", str(uuid.uuid4())):
        with pytest.raises(CommandError, match=f"^no run {bad}$"):
            call_command("export_scenario", bad)
    with pytest.raises(RunNotFound):
        export_scenario("not-a-run")


def test_the_api_gives_staff_the_scenario_and_refuses_others_R_REPLAY_1(user, staff_user, replay_models):
    run = execute(user, "parallel_tools_then_answer")
    url = f"/api/audit/runs/{run.id}/scenario"

    response = Client().get(url, headers=bearer(staff_user))
    assert response.status_code == 200
    assert response.json() == json.loads(scenario_json(export_scenario(run.id)))

    refused = Client().get(url, headers=bearer(user))
    assert refused.status_code == 403 and refused.json()["error"]["code"]

    missing = Client().get(f"/api/audit/runs/{uuid.uuid4()}/scenario", headers=bearer(staff_user))
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"

    # A turn that made no model call has nothing to export: refused by its
    # state (409), not called malformed (422; found by schemathesis).
    thread = Conversation.objects.create(user=user, agent_id="assistant", model="replay:plain_answer")
    pending = make_run(thread)
    empty = Client().get(f"/api/audit/runs/{pending.id}/scenario", headers=bearer(staff_user))
    assert empty.status_code == 409, empty.content
    assert empty.json()["error"]["code"] == "conflict" and empty.json()["error"]["reason"] == "nothing_to_export"
