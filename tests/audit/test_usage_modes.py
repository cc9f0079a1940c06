"""Stored usage equals what the provider billed, whatever its usage mode
(R-MA-11): ``final`` (one report in a last chunk), ``cumulative`` (running
totals on every chunk), ``delta`` (increments on every chunk), with cache
and reasoning details under the stable names, never double counted.

The property tests generate usage, details and chunkings; the end-to-end
one plays them through the replay model server, the worker's chat model,
LangChain's v3 bridge, the recorder and PostgreSQL."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from langchain_core.messages import HumanMessage
from langchain_openai import ChatOpenAI
from langgraph.graph import MessagesState, StateGraph

from audit.agents.models import chat_model
from audit.agents.provider import AuditedChatOpenAI
from audit.agents.usage import UsageFold, normalize_usage, usage_mode_for
from audit.execution.model_requests import ModelRequestAudit
from audit.execution.recorder import LifecycleRecorder
from audit.replay.scenarios import Scenario, load_scenarios
from audit.replay.server import make_server
from conversations.models import Conversation, Message
from core.config import get_config
from tests.conftest import acquire, make_run
from tests.waiting import WAIT_SECONDS

# --- the fold, on generated report sequences ----------------------------------------------


@st.composite
def billed(draw):
    """Provider totals with optional details (parts of the totals)."""
    prompt = draw(st.integers(0, 5000))
    completion = draw(st.integers(0, 2000))
    usage = {"input_tokens": prompt, "output_tokens": completion, "total_tokens": prompt + completion}
    if draw(st.booleans()):
        cache_read = draw(st.integers(0, prompt))
        usage["input_token_details"] = {"cache_read": cache_read}
        if draw(st.booleans()):
            usage["input_token_details"]["cache_creation"] = draw(st.integers(0, prompt - cache_read))
    if draw(st.booleans()):
        usage["output_token_details"] = {"reasoning": draw(st.integers(0, completion))}
    return usage


def _split(draw, total: int, parts: int) -> list[int]:
    cuts = sorted(draw(st.lists(st.integers(0, total), min_size=parts - 1, max_size=parts - 1)))
    return [b - a for a, b in itertools.pairwise([0, *cuts, total])]


def _scaled(usage: dict, numbers: dict) -> dict:
    """``usage``'s shape with the figures in ``numbers`` (flat keys)."""
    out = {k: numbers[k] for k in ("input_tokens", "output_tokens", "total_tokens")}
    for group in ("input_token_details", "output_token_details"):
        if group in usage:
            out[group] = {k: numbers[f"{group}.{k}"] for k in usage[group]}
    return out


def _flat(usage: dict) -> dict[str, int]:
    flat = {k: usage[k] for k in ("input_tokens", "output_tokens", "total_tokens")}
    for group in ("input_token_details", "output_token_details"):
        for k, v in (usage.get(group) or {}).items():
            flat[f"{group}.{k}"] = v
    return flat


@st.composite
def report_streams(draw):
    """(mode, billed totals, the per-chunk reports a provider of that mode
    sends: None for a chunk without usage)."""
    mode = draw(st.sampled_from(["final", "cumulative", "delta"]))
    total = draw(billed())
    chunks = draw(st.integers(1, 30))
    flat = _flat(total)
    if mode == "final":
        reports = [None] * (chunks - 1) + [total]
    elif mode == "cumulative":
        # Running totals: non-decreasing per figure, the last one the bill.
        columns = {
            k: sorted(draw(st.lists(st.integers(0, v), min_size=chunks - 1, max_size=chunks - 1)))
            for k, v in flat.items()
        }
        reports = [_scaled(total, {k: columns[k][i] for k in flat}) for i in range(chunks - 1)] + [total]
    else:
        columns = {k: _split(draw, v, chunks) for k, v in flat.items()}
        reports = [_scaled(total, {k: columns[k][i] for k in flat}) for i in range(chunks)]
        # total_tokens increments add up to input + output increments' sums
    holes = draw(st.sets(st.integers(0, chunks - 2), max_size=chunks - 1)) if mode != "final" and chunks > 1 else set()
    if mode == "cumulative":
        reports = [None if i in holes else r for i, r in enumerate(reports)]  # a chunk may carry none
    return mode, total, reports


@settings(max_examples=300, deadline=None)
@given(report_streams())
def test_the_fold_of_any_report_stream_is_the_billed_total_R_MA_11(generated):
    mode, total, reports = generated
    fold = UsageFold(mode)
    for report in reports:
        if report is not None:
            fold.add(report)
    assert fold.total() == normalize_usage(total)


def test_normalize_keeps_stable_names_and_never_adds_details_to_totals_R_MA_11():
    tiered = {
        "input_tokens": 100,
        "output_tokens": 10,
        "total_tokens": 110,
        "input_token_details": {"priority_cache_read": 64, "priority": 36, "audio": None},
        "output_token_details": {"priority_reasoning": 4, "priority": 6},
    }
    assert normalize_usage(tiered) == {
        "input_tokens": 100,
        "output_tokens": 10,
        "total_tokens": 110,
        "input_token_details": {"cache_read": 64, "priority": 36},
        "output_token_details": {"reasoning": 4, "priority": 6},
    }
    assert normalize_usage({"input_tokens": 3, "output_tokens": 4, "input_token_details": {}}) == {
        "input_tokens": 3,
        "output_tokens": 4,
        "total_tokens": 7,
    }
    with pytest.raises(ValueError):
        UsageFold("sum")


def test_the_usage_mode_comes_from_the_setting_then_the_replay_server_R_MA_11_R_MA_12(monkeypatch):
    # served: the mode the replay server names for the turn it plays.
    assert usage_mode_for("replay:usage_cumulative", "cumulative") == "cumulative"
    assert usage_mode_for("replay:anything", "delta") == "delta"
    assert usage_mode_for("replay:tool_then_answer", None) == "final"
    assert usage_mode_for("replay:anything", "sum") == "final", "an unknown mode is not trusted"
    assert usage_mode_for("openai:gpt-4o-mini", "delta") == "final", "only the replay server is asked"
    monkeypatch.setattr(
        get_config(), "MODEL_USAGE_MODES", {"openai:vllm-model": "cumulative", "replay:usage_cumulative": "final"}
    )
    assert usage_mode_for("openai:vllm-model") == "cumulative"
    assert usage_mode_for("replay:usage_cumulative", "cumulative") == "final", "the setting wins"


def test_the_setting_is_validated_R_MA_11(monkeypatch):
    from core.config import Config, ConfigError

    monkeypatch.setenv("MODEL_USAGE_MODES", '{"openai:x": "delta"}')
    assert Config().MODEL_USAGE_MODES == {"openai:x": "delta"}
    monkeypatch.setenv("MODEL_USAGE_MODES", '{"openai:x": "sum"}')
    with pytest.raises(ConfigError, match="MODEL_USAGE_MODES"):
        get_config.__wrapped__()
    monkeypatch.setenv("MODEL_USAGE_MODES", "{not json")
    with pytest.raises(ConfigError, match="MODEL_USAGE_MODES"):
        get_config.__wrapped__()


# --- through the wire, LangChain and PostgreSQL ----------------------------------------------


@pytest.fixture(scope="module")
def generated_server():
    """A replay server whose scenario table the tests add to."""
    scenarios = dict(load_scenarios())
    server = make_server(scenarios, "127.0.0.1", 0)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + WAIT_SECONDS
    while server.base_url is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    yield scenarios, server.base_url
    server.should_exit = True
    thread.join(timeout=5)


def _stored_usage(make_model, thread) -> dict | None:
    """Run one model call in a v3 graph with the worker's recorder and
    callbacks, on a fresh thread of ``thread``'s user (the run is left
    running); returns the usage stored on its audit row."""
    run = make_run(Conversation.objects.create(user=thread.user, agent_id="assistant", model=thread.model))
    lease = acquire(run)
    recorder = LifecycleRecorder(lease)

    async def drive():
        # A client per event loop (``make_model(client)``): langchain-openai's
        # cached default client is bound to the first loop.
        async with httpx.AsyncClient() as client:
            model = make_model(client)
            graph = StateGraph(MessagesState)

            async def call_model(state):
                return {"messages": [await model.ainvoke(state["messages"])]}

            graph.add_node("model", call_model)
            graph.set_entry_point("model")
            compiled = graph.compile()
            stream = await compiled.astream_events(
                {"messages": [HumanMessage("hello")]}, {"callbacks": [ModelRequestAudit(recorder)]}, version="v3"
            )
            async for event in stream:
                await recorder.handle(event)

    asyncio.run(drive())
    (row,) = Message.objects.model_calls().filter(run=run)
    assert row.execution_status == "completed"
    return row.usage


def _configured(name: str):
    """The model the worker builds for ``name``, on the given client."""
    return lambda client: chat_model(name, http_async_client=client)


_names = itertools.count()


@st.composite
def usage_turns(draw):
    usage: dict = {"prompt_tokens": draw(st.integers(0, 3000)), "completion_tokens": draw(st.integers(0, 500))}
    if draw(st.booleans()):
        cached = draw(st.integers(0, usage["prompt_tokens"]))
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
        if draw(st.booleans()):
            usage["prompt_tokens_details"]["cache_write_tokens"] = draw(st.integers(0, usage["prompt_tokens"] - cached))
    if draw(st.booleans()):
        usage["completion_tokens_details"] = {"reasoning_tokens": draw(st.integers(0, usage["completion_tokens"]))}
    return {
        "text": draw(st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=60)),
        "chunk_chars": draw(st.integers(1, 12)),
        "usage_mode": draw(st.sampled_from(["final", "cumulative", "delta"])),
        "usage": usage,
    }


def _billed(usage: dict) -> dict:
    """What langchain-openai makes of the provider's totals, under the
    stable names."""
    expected: dict = {
        "input_tokens": usage["prompt_tokens"],
        "output_tokens": usage["completion_tokens"],
        "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"],
    }
    prompt = usage.get("prompt_tokens_details") or {}
    details = {
        name: prompt[key]
        for key, name in (("cached_tokens", "cache_read"), ("cache_write_tokens", "cache_creation"))
        if key in prompt
    }
    if details:
        expected["input_token_details"] = details
    if "reasoning_tokens" in (usage.get("completion_tokens_details") or {}):
        expected["output_token_details"] = {"reasoning": usage["completion_tokens_details"]["reasoning_tokens"]}
    return expected


@pytest.mark.django_db(transaction=True)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(turn=usage_turns())
def test_stored_usage_equals_the_providers_totals_in_every_mode_and_chunking_R_MA_11(generated_server, thread, turn):
    scenarios, base_url = generated_server
    name = f"generated-usage-{next(_names)}"
    scenarios[name] = Scenario.model_validate({"name": name, "turns": [turn]})

    def model(client):
        return AuditedChatOpenAI(
            configured_name=f"replay:{name}",
            model=name,
            usage_mode=turn["usage_mode"],
            base_url=base_url,
            api_key="replay",
            stream_usage=True,
            streaming=True,
            max_retries=0,
            http_async_client=client,
        )

    assert _stored_usage(model, thread) == _billed(turn["usage"])


@pytest.mark.django_db(transaction=True)
def test_the_fifteen_chunk_cumulative_stream_is_stored_as_its_final_totals_R_MA_11(replay_models, thread):
    """Issue 10 finding 2: 15 chunks of running totals, final 100 / 12 / 112.
    LangChain's bridge alone adds them up (1500 / 102 / 1602); the worker's
    model stores the bill."""

    def plain(client):
        return ChatOpenAI(
            model="usage_cumulative", base_url=replay_models, api_key="x", stream_usage=True, http_async_client=client
        )

    assert _stored_usage(plain, thread) == {"input_tokens": 1500, "output_tokens": 102, "total_tokens": 1602}
    assert _stored_usage(_configured("replay:usage_cumulative"), thread) == {
        "input_tokens": 100,
        "output_tokens": 12,
        "total_tokens": 112,
    }


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("scenario", "expected"),
    [
        (
            "usage_delta",
            {
                "input_tokens": 120,
                "output_tokens": 30,
                "total_tokens": 150,
                "input_token_details": {"cache_read": 64, "cache_creation": 16},
                "output_token_details": {"reasoning": 8},
            },
        ),
        (
            "usage_final_details",
            {
                "input_tokens": 100,
                "output_tokens": 7,
                "total_tokens": 107,
                "input_token_details": {"cache_read": 64},
                "output_token_details": {"reasoning": 2},
            },
        ),
    ],
)
def test_bundled_usage_scenarios_store_their_bill_with_details_R_MA_11(replay_models, thread, scenario, expected):
    assert _stored_usage(_configured(f"replay:{scenario}"), thread) == expected


@pytest.fixture
def thread(django_user_model):
    import uuid

    user = django_user_model.objects.create_user(username=f"u-{uuid.uuid4().hex[:10]}")
    return Conversation.objects.create(user=user, agent_id="assistant", model="replay:plain_answer")
