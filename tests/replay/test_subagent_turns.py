"""A replay scenario gives each subagent its own turns, asked for as
``<scenario>/<subagent>`` (R-SUB-1): the subagent's conversation starts
from the task description, so it counts its turns from zero."""

from __future__ import annotations

import json

import pytest
from starlette.testclient import TestClient

from audit.replay.scenarios import Scenario, ScenarioError, load_scenario, load_scenarios, scenario_turns
from audit.replay.server import build_app

USER = {"role": "user", "content": "Check the retention period."}


@pytest.fixture(scope="module")
def app_client():
    with TestClient(build_app(load_scenarios())) as client:
        yield client


def _ask(client, model: str, messages: list[dict]) -> dict:
    response = client.post("/v1/chat/completions", json={"model": model, "messages": messages})
    return {"status": response.status_code, **response.json()}


def test_the_main_agent_and_its_subagent_play_their_own_turns_R_SUB_1(app_client):
    main = _ask(app_client, "researcher_fact_check", [USER])
    assert main["status"] == 200
    (task,) = main["choices"][0]["message"]["tool_calls"]
    assert task["function"]["name"] == "task"
    assert json.loads(task["function"]["arguments"])["subagent_type"] == "fact_checker"

    first = _ask(app_client, "researcher_fact_check/fact_checker", [USER])
    calls = first["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["lookup_docs", "lookup_docs"], "a parallel pair"
    assert {c["id"] for c in calls} == {"call_lookup_retention", "call_lookup_exports"}
    history = [
        USER,
        {"role": "assistant", "content": None, "tool_calls": calls},
        *({"role": "tool", "tool_call_id": c["id"], "content": "ok"} for c in calls),
    ]
    answer = _ask(app_client, "researcher_fact_check/fact_checker", history)
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert answer["choices"][0]["message"]["content"].startswith("The documentation says")


def test_an_unknown_subagent_or_a_subagent_past_its_turns_is_a_clear_error_R_SUB_1(app_client):
    unknown = _ask(app_client, "researcher_fact_check/nobody", [USER])
    assert unknown["status"] == 404 and unknown["error"]["code"] == "model_not_found"
    assert _ask(app_client, "plain_answer/fact_checker", [USER])["status"] == 404
    done = [USER, {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]
    exhausted = _ask(app_client, "researcher_fact_check/fact_checker", done)
    assert exhausted["status"] == 400 and exhausted["error"]["code"] == "scenario_exhausted"


def test_scenario_turns_resolves_main_and_subagent_turns_R_SUB_1():
    scenarios = load_scenarios()
    scenario, turns = scenario_turns(scenarios, "researcher_fact_check")
    assert turns == scenario.turns
    _, sub = scenario_turns(scenarios, "researcher_fact_check/fact_checker")
    assert sub == scenario.subagents["fact_checker"]
    assert scenario_turns(scenarios, "nope/fact_checker") is None


@pytest.mark.parametrize(
    ("subagents", "problem"),
    [
        ({"fact_checker": []}, "at least one turn"),
        ({"a/b": [{"text": "x"}]}, "must be non-empty without '/'"),
        ({"fact_checker": [{"text": "x", "tool_calls": [{"id": "call_1", "name": "t"}]}]}, "used twice"),
        ({"fact_checker": [{"txt": "x"}]}, "Extra inputs are not permitted"),
    ],
)
def test_malformed_subagent_turns_are_refused_naming_the_file_R_SUB_1(tmp_path, subagents, problem):
    path = tmp_path / "bad_researcher.json"
    main = {"text": "go", "tool_calls": [{"id": "call_1", "name": "task"}]}
    path.write_text(json.dumps({"turns": [main], "subagents": subagents}))
    with pytest.raises(ScenarioError, match=problem) as raised:
        load_scenario(path)
    assert raised.value.path == path


def test_a_subagent_model_takes_the_usage_mode_of_its_own_turn_R_SUB_1_R_MA_11_R_MA_12():
    # The subagent's second turn reports usage cumulatively; its main
    # agent's second turn, at the same index, reports it once at the end.
    # The server names the mode of the turn it plays in the stream's header.
    scenario = Scenario.model_validate(
        {
            "name": "modes",
            "turns": [{"text": "a"}, {"text": "b"}],
            "subagents": {"fact_checker": [{"text": "x"}, {"text": "y", "usage_mode": "cumulative"}]},
        }
    )
    second_turn = [USER, {"role": "assistant", "content": "y"}]

    def served_mode(client: TestClient, model: str) -> str | None:
        body = {"model": model, "messages": second_turn, "stream": True}
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200
        return response.headers.get("x-yuxi-usage-mode")

    with TestClient(build_app({"modes": scenario})) as client:
        assert served_mode(client, "modes/fact_checker") == "cumulative"
        assert served_mode(client, "modes") == "final"
