"""Usage that cannot be proven is unknown, never wrong (R-MA-12).

- A ``replay:<scenario>`` model folds usage by the mode of the turn the
  replay server actually plays, which the server names in the
  ``x-yuxi-usage-mode`` header of its stream: a server playing a scenario
  directory of its own (``--scenario-dir``, not the bundled scenarios)
  gives rows with the provider's exact bill, turn by turn.
- Reports that contradict the model's declared mode (several under
  ``final``, a running total that decreases under ``cumulative``) store the
  row's usage null with ``usage_cause = "usage_mode_conflict"``; the run's
  usage and cost count the call unknown.
"""

from __future__ import annotations

import asyncio
import hashlib
import json

import httpx
import pytest
from django.db import IntegrityError, transaction
from langchain_core.messages import AIMessage, HumanMessage

from audit.agents.models import chat_model
from audit.agents.usage import USAGE_MODE_CONFLICT, UsageFold
from audit.execution.runner import run_execute
from audit.models import AgentRun
from audit.reads.selectors import timeline_item
from audit.replay.scenarios import load_scenarios
from conversations.models import Conversation, Message
from core.config import get_config
from costs.selectors import run_cost
from governance.seal import FACT_FIELDS, V1_FACT_FIELDS, row_digest
from tests.conftest import make_run, replay_server_in_thread

# Scenarios that are not bundled: the worker can only learn their modes
# from the server that plays them.
SERVED = {
    # 500 in / 76 out = 576, reported as increments on every chunk.
    "served_delta": {
        "description": "delta usage from a scenario directory of its own (R-MA-12)",
        "turns": [
            {
                "text": "Every chunk of this answer carries a usage increment.",
                "chunk_chars": 4,
                "usage_mode": "delta",
                "usage": {"prompt_tokens": 500, "completion_tokens": 76},
            }
        ],
    },
    # One run, two calls, two modes: a final report, then increments.
    "served_modes_per_turn": {
        "description": "the usage mode changes from one turn to the next (R-MA-12)",
        "turns": [
            {
                "text": "Let me check the weather in Paris.",
                "tool_calls": [{"id": "call_weather_paris", "name": "get_weather", "arguments": {"city": "Paris"}}],
                "usage_mode": "final",
                "usage": {"prompt_tokens": 52, "completion_tokens": 14},
            },
            {
                "text": "It is 18°C and sunny in Paris right now.",
                "chunk_chars": 3,
                "usage_mode": "delta",
                "usage": {"prompt_tokens": 90, "completion_tokens": 23},
            },
        ],
    },
}


@pytest.fixture(scope="module")
def scenario_dir_server(tmp_path_factory):
    """A replay server playing a scenario directory written here (what
    ``replay_model_server --scenario-dir DIR`` loads), not the bundled one."""
    directory = tmp_path_factory.mktemp("scenarios")
    for name, scenario in SERVED.items():
        (directory / f"{name}.json").write_text(json.dumps(scenario), encoding="utf-8")
    with replay_server_in_thread(load_scenarios(directory), "replay-scenario-dir") as url:
        yield url


@pytest.fixture
def served_models(scenario_dir_server, monkeypatch):
    """``replay:<scenario>`` models of this process go to that server."""
    monkeypatch.setattr(get_config(), "REPLAY_MODEL_URL", scenario_dir_server)
    monkeypatch.setattr(get_config(), "MODEL_USAGE_MODES", {})
    return scenario_dir_server


def _tokens(prompt: int, completion: int) -> dict:
    return {"input_tokens": prompt, "output_tokens": completion, "total_tokens": prompt + completion}


def _execute(user, model: str) -> AgentRun:
    thread = Conversation.objects.create(user=user, agent_id="assistant", model=model)
    run = make_run(thread)
    assert run_execute(run_id=run.id) == "completed"
    return AgentRun.objects.get(pk=run.pk)


def _model_rows(run: AgentRun) -> list[Message]:
    return list(Message.objects.model_calls().filter(run=run).order_by("sequence"))


# --- the mode of the scenario the server plays --------------------------------------------


def test_a_replay_model_folds_by_the_mode_the_server_declares_and_keeps_no_headers_R_MA_12(served_models):
    async def call(messages):
        async with httpx.AsyncClient() as client:
            return await chat_model("replay:served_modes_per_turn", http_async_client=client).ainvoke(messages)

    first = asyncio.run(call([HumanMessage("weather in Paris?")]))
    second = asyncio.run(call([HumanMessage("weather in Paris?"), AIMessage("checking")]))
    assert (first.usage_metadata, second.usage_metadata) == (_tokens(52, 14), _tokens(90, 23))
    for message in (first, second):
        assert "headers" not in message.response_metadata, "response headers are read, then dropped"
        assert "usage_cause" not in message.response_metadata


@pytest.mark.django_db(transaction=True)
def test_a_scenario_dir_server_gives_rows_the_providers_exact_bill_R_MA_12(user, served_models):
    """The reported failure: a ``delta`` scenario outside the bundled folder
    was folded as ``final`` and stored 0/0/0 where the provider sent 576."""
    run = _execute(user, "replay:served_delta")
    (row,) = _model_rows(run)
    assert row.usage == _tokens(500, 76)
    assert row.usage_cause is None
    assert "headers" not in row.metadata
    assert run.usage == {**_tokens(500, 76), "unknown_calls": 0}


@pytest.mark.django_db(transaction=True)
def test_each_call_takes_the_mode_of_its_own_turn_R_MA_12(user, served_models):
    """The reported failure: a scenario whose mode changes per turn stored 0
    for its second call."""
    run = _execute(user, "replay:served_modes_per_turn")
    rows = _model_rows(run)
    assert [row.usage for row in rows] == [_tokens(52, 14), _tokens(90, 23)]
    assert run.usage == {**_tokens(142, 37), "unknown_calls": 0}


# --- reports that contradict the declared mode -------------------------------------------


def test_several_reports_under_final_prove_no_bill_R_MA_12():
    fold = UsageFold("final")
    fold.add(_tokens(100, 0))
    fold.add(_tokens(0, 12))
    assert fold.total() is None
    assert fold.cause == USAGE_MODE_CONFLICT == "usage_mode_conflict"


@pytest.mark.parametrize(
    "decreasing",
    [
        _tokens(90, 12),  # a total goes down
        {**_tokens(100, 12), "input_token_details": {"cache_read": 10}},  # a detail goes down
    ],
)
def test_a_decreasing_running_total_proves_no_bill_R_MA_12(decreasing):
    fold = UsageFold("cumulative")
    fold.add({**_tokens(100, 5), "input_token_details": {"cache_read": 64}})
    fold.add(decreasing)
    fold.add({**_tokens(100, 20), "input_token_details": {"cache_read": 64}})
    assert fold.total() is None
    assert fold.cause == USAGE_MODE_CONFLICT


def test_consistent_streams_keep_their_bill_and_no_cause_R_MA_12():
    final = UsageFold("final")
    final.add(_tokens(100, 12))
    cumulative = UsageFold("cumulative")
    for report in (_tokens(100, 0), _tokens(100, 0), _tokens(100, 7), _tokens(100, 12)):
        cumulative.add(report)
    delta = UsageFold("delta")
    for report in (_tokens(100, 0), _tokens(0, 5), _tokens(0, 0), _tokens(0, 7)):
        delta.add(report)  # increments may be zero, never a conflict
    for fold in (final, cumulative, delta):
        assert fold.total() == _tokens(100, 12) and fold.cause is None, fold.mode
    silent = UsageFold("final")
    assert silent.total() is None and silent.cause is None, "nothing reported: unknown, no conflict"


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("declared", ["final", "cumulative"])
def test_a_stream_that_contradicts_its_declared_mode_stores_usage_unknown_with_its_cause_R_MA_12(
    user, served_models, monkeypatch, declared
):
    """A ``delta`` stream declared ``final`` (many reports) or
    ``cumulative`` (the prompt figure drops to 0 after the first chunk):
    no number the provider did not bill, the cause named in the row, and
    the run's usage and cost count the call unknown."""
    monkeypatch.setattr(get_config(), "MODEL_USAGE_MODES", {"replay:served_delta": declared})
    run = _execute(user, "replay:served_delta")
    (row,) = _model_rows(run)
    assert row.usage is None
    assert row.usage_cause == "usage_mode_conflict"
    assert row.cost_usd is None
    assert run.usage == {**_tokens(0, 0), "unknown_calls": 1}
    assert run_cost(run.id) == {"total_usd": None, "unknown_cost_calls": 1}
    item = timeline_item(row, include_raw_output=False)
    assert item["usage"] is None and item["usage_cause"] == "usage_mode_conflict"
    with pytest.raises(IntegrityError, match="append-only"), transaction.atomic():
        Message.objects.filter(pk=row.pk).update(usage_cause=None)  # a closed row's fact (R-GOV-3)


def test_the_seal_covers_the_cause_and_keeps_the_digests_of_rows_sealed_before_it_R_MA_12():
    """Under seal version 1, a row without a cause hashes as under that
    version's first encoding (which had no such field), so seals made before
    it still verify; a cause, once set, is sealed (under version 2 too,
    R-GOV-4)."""
    facts = {name: None for name in FACT_FIELDS} | {"id": 7, "role": "assistant", "operation_id": "op", "metadata": {}}
    first_encoding = {name: facts[name] for name in V1_FACT_FIELDS if name != "usage_cause"}
    before = hashlib.sha256(
        json.dumps(first_encoding, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    ).hexdigest()
    assert row_digest(facts, version=1) == before
    assert row_digest({**facts, "usage_cause": "usage_mode_conflict"}, version=1) != before
    assert row_digest({**facts, "usage_cause": "usage_mode_conflict"}) != row_digest(facts)
