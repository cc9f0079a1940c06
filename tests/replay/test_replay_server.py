"""The replay model server (SPEC §5): scenario files, the OpenAI wire
format (streaming and not), stateless turn selection, and the error paths,
driven through the real `openai` and `langchain-openai` clients against a
real uvicorn server on a free local port."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI
from starlette.testclient import TestClient

from audit.catalogue import bundled_scenario_names
from audit.replay.scenarios import Scenario, ScenarioError, load_scenario, load_scenarios
from audit.replay.server import build_app, serving_in_thread, turn_index

REPO_ROOT = Path(__file__).resolve().parents[2]
USER = {"role": "user", "content": "What is the weather in Paris?"}


@pytest.fixture(scope="module")
def base_url(replay_server_url):
    """``http://127.0.0.1:PORT/v1`` of the session's replay server playing the
    bundled scenarios (``tests/conftest.py``)."""
    return replay_server_url


@pytest.fixture
def client(base_url):
    with openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=10) as client:
        yield client


def _tool_call_history(scenario_turn_calls):
    """The assistant message and tool results a client would re-send."""
    assistant = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": "{}"}}
            for call_id, name in scenario_turn_calls
        ],
    }
    results = [{"role": "tool", "tool_call_id": call_id, "content": "ok"} for call_id, _ in scenario_turn_calls]
    return [assistant, *results]


# --- scenario files -----------------------------------------------------------


def test_every_bundled_scenario_loads():
    scenarios = load_scenarios()
    assert sorted(scenarios) == bundled_scenario_names()
    assert set(bundled_scenario_names()) >= {
        "plain_answer",
        "tool_then_answer",
        "two_tools_then_answer",
        "parallel_tools_then_answer",
        "slow_answer",
        "slow_tool_then_answer",
        "model_error_midstream",
        "model_http_error",
        "tool_error_handled",
        "tool_error_unhandled",
        "approval_send_email",
        "approval_then_large_lookup",
        "large_lookup",
    }
    for name, scenario in scenarios.items():
        assert scenario.name == name and scenario.description


def test_bundled_scenarios_say_what_the_other_tests_rely_on():
    scenarios = load_scenarios()
    first, second = scenarios["tool_then_answer"].turns
    assert [(c.id, c.name, c.arguments) for c in first.tool_calls] == [
        ("call_weather_paris", "get_weather", {"city": "Paris"})
    ]
    assert len(second.text) / second.chunk_chars >= 20
    assert (first.usage.prompt_tokens, first.usage.completion_tokens) != (
        second.usage.prompt_tokens,
        second.usage.completion_tokens,
    )
    slow = scenarios["slow_answer"].turns[0]
    assert slow.chunk_delay_ms == 100 and 55 <= len(slow.text) / slow.chunk_chars <= 65
    assert scenarios["model_error_midstream"].turns[0].fail_after_chunks == 3
    assert scenarios["model_http_error"].turns[0].http_status == 400
    email = scenarios["approval_send_email"].turns[0].tool_calls[0]
    assert (email.name, email.arguments) == (
        "send_email",
        {"to": "ops@example.com", "subject": "Report", "body": "All good"},
    )
    assert scenarios["approval_send_email"].turns[1].text == "The email was sent."
    assert scenarios["approval_send_email"].turns[1].text_if_rejected.startswith("The email was not sent")
    assert scenarios["approval_then_large_lookup"].turns[2].text_if_rejected.startswith("The email was not sent")
    lookup = scenarios["large_lookup"].turns[0].tool_calls[0]
    assert lookup.arguments == {"query": "retention policy", "size": 20000}


GOOD_TURN = {"text": "hi"}


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("{not json", "not valid JSON"),
        ("[]", "top level must be a JSON object"),
        (json.dumps({"turns": []}), "turns"),
        (json.dumps({"description": "x"}), "turns: Field required"),
        (json.dumps({"turns": [{"usage": {"prompt_tokens": 1, "completion_tokens": 1}}]}), "needs text, tool_calls"),
        (json.dumps({"turns": [{"text": "hi", "colour": "red"}]}), "turns[0].colour"),
        (json.dumps({"turns": [{"text": "hi", "chunk_chars": "8"}]}), "turns[0].chunk_chars"),
        (json.dumps({"turns": [{"text": "hi", "chunk_delay_ms": True}]}), "turns[0].chunk_delay_ms"),
        (json.dumps({"turns": [{"text": "hi", "chunk_chars": 0}]}), "turns[0].chunk_chars"),
        (json.dumps({"turns": [{"text": "hi", "usage": {"prompt_tokens": 1}}]}), "completion_tokens"),
        (json.dumps({"turns": [{"tool_calls": [{"id": "a", "name": "f", "arguments": "{}"}]}]}), "arguments"),
        (json.dumps({"turns": [{"http_status": 200}]}), "http_status"),
        (json.dumps({"turns": [{"http_status": 500, "text": "x"}]}), "cannot also give text"),
        (json.dumps({"turns": [{"text": "x", "error_message": "boom"}]}), "error_message needs http_status"),
        (json.dumps({"name": "other", "turns": [GOOD_TURN]}), "'name' is not allowed"),
        (json.dumps({"turns": [{"text": "hi", "usage_mode": "sum"}]}), "turns[0].usage_mode"),
        (json.dumps({"chat": "yes", "turns": [GOOD_TURN]}), "chat: Input should be a valid boolean"),
        (
            json.dumps(
                {
                    "turns": [
                        {
                            "text": "hi",
                            "usage": {
                                "prompt_tokens": 10,
                                "completion_tokens": 1,
                                "prompt_tokens_details": {"cached_tokens": 11},
                            },
                        }
                    ]
                }
            ),
            "exceed prompt_tokens",
        ),
        (
            json.dumps(
                {
                    "turns": [
                        {
                            "text": "hi",
                            "usage": {
                                "prompt_tokens": 1,
                                "completion_tokens": 1,
                                "completion_tokens_details": {"reasoning_tokens": 2},
                            },
                        }
                    ]
                }
            ),
            "reasoning_tokens exceed completion_tokens",
        ),
        (json.dumps({"turns": [{"text": "hi", "connect_error_times": -1}]}), "turns[0].connect_error_times"),
        (json.dumps({"turns": [{"text": "hi", "fail_before_first_chunk": {"status": 200}}]}), "status"),
        (json.dumps({"turns": [{"text": "hi", "fail_before_first_chunk": {"status": 503, "times": 0}}]}), "times"),
        (
            json.dumps({"turns": [{"http_status": 500, "fail_before_first_chunk": {"status": 503}}]}),
            "cannot also give fail_before_first_chunk",
        ),
        (
            json.dumps(
                {
                    "turns": [
                        {"tool_calls": [{"id": "call_1", "name": "f", "arguments": {}}]},
                        {"tool_calls": [{"id": "call_1", "name": "g", "arguments": {}}]},
                    ]
                }
            ),
            "'call_1' is used twice",
        ),
    ],
)
def test_a_malformed_scenario_file_raises_scenario_error_naming_the_file(tmp_path, content, problem):
    (tmp_path / "fine.json").write_text(json.dumps({"turns": [GOOD_TURN]}))
    (tmp_path / "broken_one.json").write_text(content)
    with pytest.raises(ScenarioError) as excinfo:
        load_scenarios(tmp_path)
    assert isinstance(excinfo.value, ValueError)
    assert str(excinfo.value).startswith("broken_one.json: ")
    assert problem in str(excinfo.value)
    assert excinfo.value.path == tmp_path / "broken_one.json"


def test_a_scenario_directory_loads_by_file_stem(tmp_path):
    (tmp_path / "hello.json").write_text(json.dumps({"turns": [{"text": "héllo", "chunk_chars": 2}]}))
    (tmp_path / "notes.txt").write_text("ignored")
    scenarios = load_scenarios(tmp_path)
    assert list(scenarios) == ["hello"]
    assert scenarios["hello"] == load_scenario(tmp_path / "hello.json")
    assert scenarios["hello"].turns[0].usage is None
    with pytest.raises(NotADirectoryError):
        load_scenarios(tmp_path / "missing")


def test_turn_index_counts_assistant_messages_after_the_last_user_message():
    assistant = {"role": "assistant", "content": "x"}
    tool = {"role": "tool", "tool_call_id": "c", "content": "r"}
    system = {"role": "system", "content": "s"}
    assert turn_index([]) == 0
    assert turn_index([system, USER]) == 0
    assert turn_index([system, USER, assistant, tool]) == 1
    assert turn_index([USER, assistant, tool, assistant, tool]) == 2
    assert turn_index([USER, assistant, tool, assistant, USER]) == 0
    assert turn_index([USER, assistant, USER, assistant]) == 1


# --- openai client, non-streaming ------------------------------------------------


def test_non_streaming_plays_each_turn_with_its_tool_calls_and_usage(client):
    first = client.chat.completions.create(model="tool_then_answer", messages=[USER])
    choice = first.choices[0]
    assert first.object == "chat.completion" and first.model == "tool_then_answer"
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check the weather in Paris."
    [call] = choice.message.tool_calls
    assert (call.id, call.type, call.function.name) == ("call_weather_paris", "function", "get_weather")
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert (first.usage.prompt_tokens, first.usage.completion_tokens, first.usage.total_tokens) == (52, 14, 66)

    history = [USER, *_tool_call_history([("call_weather_paris", "get_weather")])]
    second = client.chat.completions.create(model="tool_then_answer", messages=history)
    assert second.choices[0].finish_reason == "stop"
    assert second.choices[0].message.content.startswith("It is 18°C and sunny in Paris")
    assert second.choices[0].message.tool_calls is None
    assert (second.usage.prompt_tokens, second.usage.completion_tokens, second.usage.total_tokens) == (90, 23, 113)

    # The same request is answered identically (ids included): deterministic.
    again = client.chat.completions.create(model="tool_then_answer", messages=history)
    assert again.model_dump() == second.model_dump()
    assert again.id != first.id


def test_a_tool_only_turn_has_null_content(client):
    answer = client.chat.completions.create(model="large_lookup", messages=[USER])
    assert answer.choices[0].message.content is None
    [call] = answer.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == {"query": "retention policy", "size": 20000}


def test_turn_selection_restarts_after_a_new_user_message(client):
    history = [
        USER,
        *_tool_call_history([("call_weather_paris", "get_weather")]),
        {"role": "assistant", "content": "It is 18°C."},
        {"role": "user", "content": "And again?"},
    ]
    answer = client.chat.completions.create(model="tool_then_answer", messages=history)
    assert answer.choices[0].message.tool_calls[0].id == "call_weather_paris"


def test_three_turn_scenario_follows_the_assistant_messages(client):
    history = [USER]
    answers = []
    for _ in range(3):
        answer = client.chat.completions.create(model="two_tools_then_answer", messages=history)
        message = answer.choices[0].message
        answers.append(message)
        if message.tool_calls:
            history += _tool_call_history([(c.id, c.function.name) for c in message.tool_calls])
    assert answers[0].tool_calls[0].function.name == "get_weather"
    assert json.loads(answers[1].tool_calls[0].function.arguments) == {"expression": "18*9/5+32"}
    assert "64.4°F" in answers[2].content


# --- openai client, streaming ---------------------------------------------------


def _collect(stream):
    text, calls, finish, usage, chunks = "", {}, None, None, []
    for chunk in stream:
        chunks.append(chunk)
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = delta.id or call["id"]
                if delta.function:
                    call["name"] += delta.function.name or ""
                    call["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    return text, calls, finish, usage, chunks


def test_streaming_sends_role_text_chunks_tool_call_deltas_finish_and_usage(client):
    stream = client.chat.completions.create(
        model="tool_then_answer", messages=[USER], stream=True, stream_options={"include_usage": True}
    )
    text, calls, finish, usage, chunks = _collect(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({chunk.id for chunk in chunks}) == 1
    assert text == "Let me check the weather in Paris."
    assert calls == {0: {"id": "call_weather_paris", "name": "get_weather", "arguments": '{"city": "Paris"}'}}
    assert finish == "tool_calls"
    assert chunks[-1].choices == [] and (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        52,
        14,
        66,
    )

    history = [USER, *_tool_call_history([("call_weather_paris", "get_weather")])]
    stream = client.chat.completions.create(
        model="tool_then_answer", messages=history, stream=True, stream_options={"include_usage": True}
    )
    text, calls, finish, usage, chunks = _collect(stream)
    text_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(text_chunks) >= 20
    assert text.startswith("It is 18°C and sunny in Paris") and calls == {} and finish == "stop"
    assert (usage.prompt_tokens, usage.completion_tokens) == (90, 23)


def test_streaming_without_include_usage_sends_no_usage_chunk(client):
    stream = client.chat.completions.create(model="plain_answer", messages=[USER], stream=True)
    text, _, finish, usage, chunks = _collect(stream)
    assert text.startswith("Hello!") and finish == "stop" and usage is None
    assert all(chunk.choices for chunk in chunks)


def test_streaming_parallel_tool_calls_are_indexed(client):
    stream = client.chat.completions.create(model="parallel_tools_then_answer", messages=[USER], stream=True)
    _, calls, finish, _, _ = _collect(stream)
    assert finish == "tool_calls"
    assert [(calls[i]["id"], json.loads(calls[i]["arguments"])) for i in sorted(calls)] == [
        ("call_weather_paris", {"city": "Paris"}),
        ("call_weather_tokyo", {"city": "Tokyo"}),
    ]


def test_fail_after_chunks_breaks_the_stream_with_no_finish_and_no_usage(client):
    stream = client.chat.completions.create(
        model="model_error_midstream", messages=[USER], stream=True, stream_options={"include_usage": True}
    )
    received = []
    with pytest.raises((httpx.HTTPError, openai.APIError)):
        for chunk in stream:
            received.append(chunk)
    assert len(received) == 3
    assert all(chunk.usage is None for chunk in received)
    assert all(choice.finish_reason is None for chunk in received for choice in chunk.choices)

    with pytest.raises(openai.InternalServerError) as excinfo:
        client.chat.completions.create(model="model_error_midstream", messages=[USER])
    assert excinfo.value.code == "replay_stream_failed"


def test_stall_after_chunks_sends_the_chunks_then_nothing_until_the_client_goes_R_REPLAY_2():
    scenario = Scenario.model_validate({"name": "stalled", "turns": [{"text": "abcdefgh", "stall_after_chunks": 3}]})
    with serving_in_thread({"stalled": scenario}) as url:
        received = []
        with httpx.Client(timeout=httpx.Timeout(10, read=1.0)) as http:
            with http.stream(
                "POST", f"{url}/chat/completions", json={"model": "stalled", "messages": [USER], "stream": True}
            ) as response:
                with pytest.raises(httpx.ReadTimeout):
                    for line in response.iter_lines():
                        if line.startswith("data: "):
                            received.append(json.loads(line.removeprefix("data: ")))
    # The role chunk and two text chunks of the default four characters;
    # no finish, no [DONE]: the model hangs mid-answer.
    assert [c["choices"][0]["delta"].get("content") for c in received] == ["", "abcd", "efgh"][: len(received)]
    assert len(received) == 3
    assert all(c["choices"][0]["finish_reason"] is None for c in received)


@pytest.mark.parametrize(
    "turn, problem",
    [
        ({"text": "hi", "stall_after_chunks": 0}, "stall_after_chunks"),
        ({"text": "hi", "stall_after_chunks": 2, "fail_after_chunks": 2}, "both stall_after_chunks"),
        ({"http_status": 500, "stall_after_chunks": 2}, "cannot also give stall_after_chunks"),
    ],
)
def test_a_stalling_turn_is_validated_R_REPLAY_2(turn, problem):
    with pytest.raises(ValueError) as excinfo:
        Scenario.model_validate({"name": "x", "turns": [turn]})
    assert problem in str(excinfo.value)


# --- error answers ---------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_an_http_status_turn_answers_that_error(client, stream):
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.chat.completions.create(model="model_http_error", messages=[USER], stream=stream)
    assert excinfo.value.status_code == 400
    assert excinfo.value.type == "invalid_request_error"
    assert "rejected by the model provider" in excinfo.value.message


def test_an_unknown_scenario_is_404(client):
    with pytest.raises(openai.NotFoundError) as excinfo:
        client.chat.completions.create(model="no_such_scenario", messages=[USER])
    assert excinfo.value.code == "model_not_found"
    assert "no_such_scenario" in excinfo.value.message


def test_an_exhausted_scenario_is_400(client):
    history = [USER, {"role": "assistant", "content": "Hello!"}]
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.chat.completions.create(model="plain_answer", messages=history, stream=True)
    assert excinfo.value.code == "scenario_exhausted"


def test_a_malformed_request_is_400(base_url):
    response = httpx.post(f"{base_url}/chat/completions", content=b"{oops")
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_request"
    response = httpx.post(f"{base_url}/chat/completions", json={"model": "plain_answer"})
    assert response.status_code == 400 and "messages" in response.json()["error"]["message"]


def test_models_and_healthz(client, base_url):
    assert [model.id for model in client.models.list()] == bundled_scenario_names()
    assert client.models.retrieve("slow_answer").owned_by == "replay"
    health = httpx.get(base_url.removesuffix("/v1") + "/healthz")
    assert health.status_code == 200 and health.json()["status"] == "ok"


# --- langchain-openai -------------------------------------------------------------


def _aggregate(chunks):
    message = None
    for chunk in chunks:
        message = chunk if message is None else message + chunk
    return message


def test_langchain_stream_aggregates_the_tool_call_and_usage(base_url):
    model = ChatOpenAI(model="tool_then_answer", base_url=base_url, api_key="x", stream_usage=True, max_retries=0)
    message = _aggregate(model.stream([HumanMessage("What is the weather in Paris?")]))
    assert message.tool_calls == [
        {"name": "get_weather", "args": {"city": "Paris"}, "id": "call_weather_paris", "type": "tool_call"}
    ]
    assert message.usage_metadata["input_tokens"] == 52
    assert message.usage_metadata["output_tokens"] == 14
    assert message.usage_metadata["total_tokens"] == 66
    assert message.response_metadata["finish_reason"] == "tool_calls"


def test_langchain_astream_plays_the_turn_after_the_tool_result(base_url):
    history = [
        HumanMessage("What is the weather in Paris?"),
        AIMessage(
            "Let me check the weather in Paris.",
            tool_calls=[{"name": "get_weather", "args": {"city": "Paris"}, "id": "call_weather_paris"}],
        ),
        ToolMessage("18°C, sunny", tool_call_id="call_weather_paris"),
    ]

    async def collect():
        # A client of this event loop: langchain-openai's shared default
        # async client stays bound to the loop of whichever test used the
        # same base URL first, and that loop is closed by now.
        async with httpx.AsyncClient() as http:
            model = ChatOpenAI(
                model="tool_then_answer",
                base_url=base_url,
                api_key="x",
                stream_usage=True,
                max_retries=0,
                http_async_client=http,
            )
            return [chunk async for chunk in model.astream(history)]

    chunks = asyncio.run(collect())
    message = _aggregate(chunks)
    assert len(chunks) >= 20
    assert message.content.startswith("It is 18°C and sunny in Paris") and message.tool_calls == []
    assert {key: message.usage_metadata[key] for key in ("input_tokens", "output_tokens", "total_tokens")} == {
        "input_tokens": 90,
        "output_tokens": 23,
        "total_tokens": 113,
    }


def test_langchain_sees_the_midstream_failure(base_url):
    model = ChatOpenAI(model="model_error_midstream", base_url=base_url, api_key="x", stream_usage=True, max_retries=0)
    received = []
    with pytest.raises((httpx.HTTPError, openai.APIError)):
        for chunk in model.stream([HumanMessage("hi")]):
            received.append(chunk)
    assert received and all(chunk.usage_metadata is None for chunk in received)


# --- chunk delay (in-process ASGI client: timing only) ------------------------------


def test_chunk_delay_ms_paces_the_stream_and_the_non_streaming_answer():
    scenario = Scenario.model_validate(
        {"name": "paced", "turns": [{"text": "abcdefgh", "chunk_chars": 2, "chunk_delay_ms": 20}]}
    )
    body = {"model": "paced", "messages": [USER]}
    with TestClient(build_app({"paced": scenario})) as test_client:
        started = time.monotonic()
        with test_client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
            events = [line for line in response.iter_lines() if line.startswith("data: ")]
        streamed = time.monotonic() - started
        started = time.monotonic()
        assert test_client.post("/v1/chat/completions", json=body).status_code == 200
        non_streamed = time.monotonic() - started
    # role + 4 text chunks + finish = 6 chunks, 20 ms before each; then [DONE].
    assert len(events) == 7 and events[-1] == "data: [DONE]"
    assert streamed >= 0.12 and non_streamed >= 0.12


# --- the management command ----------------------------------------------------------


@pytest.mark.e2e
def test_the_management_command_announces_the_url_once_listening():
    process = subprocess.Popen(
        [sys.executable, "manage.py", "replay_model_server", "--port", "0"],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        line = process.stdout.readline().strip()
        assert line.startswith("replay model server listening on http://127.0.0.1:")
        url = line.rsplit(" ", 1)[1]
        assert url.endswith("/v1")
        assert httpx.get(url.removesuffix("/v1") + "/healthz", timeout=5).status_code == 200
    finally:
        process.terminate()
        process.wait(timeout=10)


# --- usage modes and provider faults (R-MA-11, R-RUN-12) -----------------------------------


def _unique_user() -> dict:
    """A user message no other test sends: the fault counters are per
    distinct request."""
    return {"role": "user", "content": f"question {time.monotonic_ns()}"}


def _raw_chunks(client, model: str) -> list:
    stream = client.chat.completions.create(
        model=model, messages=[USER], stream=True, stream_options={"include_usage": True}
    )
    return list(stream)


def test_final_usage_comes_once_in_a_last_chunk_with_empty_choices_and_details_R_MA_11(client):
    chunks = _raw_chunks(client, "usage_final_details")
    assert all(chunk.usage is None for chunk in chunks[:-1])
    last = chunks[-1]
    assert last.choices == []
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.total_tokens) == (100, 7, 107)
    assert last.usage.prompt_tokens_details.cached_tokens == 64
    assert last.usage.completion_tokens_details.reasoning_tokens == 2


def test_cumulative_usage_sends_running_totals_on_every_chunk_R_MA_11(client):
    chunks = _raw_chunks(client, "usage_cumulative")
    assert len(chunks) == 15 and all(chunk.usage is not None for chunk in chunks)
    assert all(chunk.usage.prompt_tokens == 100 for chunk in chunks)
    completions = [chunk.usage.completion_tokens for chunk in chunks]
    assert completions == sorted(completions) and completions[-1] == 12
    assert chunks[-1].choices == []
    # What adding them up would give (issue 10 finding 2).
    assert sum(c.usage.prompt_tokens for c in chunks) == 1500 and sum(completions) == 102


def test_delta_usage_sends_increments_that_add_up_to_the_bill_R_MA_11(client):
    chunks = _raw_chunks(client, "usage_delta")
    assert all(chunk.choices for chunk in chunks), "no extra usage chunk"
    usages = [chunk.usage for chunk in chunks]
    assert sum(u.prompt_tokens for u in usages) == 120 and sum(u.completion_tokens for u in usages) == 30
    assert sum(u.total_tokens for u in usages) == 150
    assert sum(u.prompt_tokens_details.cached_tokens for u in usages) == 64
    assert sum(u.prompt_tokens_details.cache_write_tokens for u in usages) == 16
    assert sum(u.completion_tokens_details.reasoning_tokens for u in usages) == 8
    assert sum(1 for u in usages if u.completion_tokens) > 5, "spread over the chunks"


def test_every_mode_reports_the_same_totals_without_streaming_R_MA_11(client):
    for model, figures in (("usage_cumulative", (100, 12)), ("usage_delta", (120, 30))):
        usage = client.chat.completions.create(model=model, messages=[USER]).usage
        assert (usage.prompt_tokens, usage.completion_tokens) == figures


@pytest.mark.parametrize("stream", [True, False])
def test_connect_error_times_closes_the_first_requests_without_a_response_R_RUN_12(client, stream):
    messages = [_unique_user()]
    for _ in range(2):
        with pytest.raises(openai.APIConnectionError):
            response = client.chat.completions.create(model="flaky_connect", messages=messages, stream=stream)
            list(response) if stream else None
    # Another request is counted on its own; the third of these is answered.
    with pytest.raises(openai.APIConnectionError):
        client.chat.completions.create(model="flaky_connect", messages=[_unique_user()], stream=stream)
    answer = client.chat.completions.create(model="flaky_connect", messages=messages, stream=stream)
    text = (
        "".join(c.choices[0].delta.content or "" for c in answer if c.choices)
        if stream
        else answer.choices[0].message.content
    )
    assert text == "Answered on the third attempt."


def test_fail_before_first_chunk_answers_its_status_with_retry_after_then_plays_R_RUN_12(base_url):
    messages = [_unique_user()]
    body = {"model": "rate_limited", "messages": messages, "stream": True}
    for _ in range(2):
        response = httpx.post(f"{base_url}/chat/completions", json=body)
        assert response.status_code == 429
        assert response.headers["retry-after"] == "1" and response.headers["retry-after-ms"] == "300"
        assert response.json()["error"]["type"] == "rate_limit_error"
    with httpx.stream("POST", f"{base_url}/chat/completions", json=body) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    assert json.loads(lines[0].removeprefix("data: "))["choices"][0]["delta"]["role"] == "assistant"
    assert lines[-1] == "data: [DONE]"


# --- a turn that answers a rejection differently (R-TA-5, issue 37) -----------------


def _approval_history(tool_content: str) -> list[dict]:
    return [
        {"role": "user", "content": "Email the ops team that all is good."},
        {
            "role": "assistant",
            "content": "I will send the report.",
            "tool_calls": [
                {"id": "call_email_1", "type": "function", "function": {"name": "send_email", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_email_1", "content": tool_content},
    ]


@pytest.mark.parametrize("stream", [False, True])
def test_a_rejected_call_gets_the_turns_text_if_rejected_R_TA_5(client, stream):
    def answer(tool_content):
        messages = _approval_history(tool_content)
        if not stream:
            return (
                client.chat.completions.create(model="approval_send_email", messages=messages)
                .choices[0]
                .message.content
            )
        chunks = client.chat.completions.create(model="approval_send_email", messages=messages, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    rejected = "The email was not sent: the request to send it was rejected."
    assert answer("Email queued for ops@example.com") == "The email was sent."
    assert answer("User rejected the tool call for `send_email` with reason: not today") == rejected
    assert (
        answer("User rejected the tool call for `send_email` with id call_email_1. The tool was not executed.")
        == rejected
    )


def _lookup_after_approval_history(tool_content: str) -> list[dict]:
    """``approval_then_large_lookup`` up to its answer: the email call and
    its result (sent or rejected), then the lookup and its result."""
    lookup_call = {"id": "call_lookup_1", "type": "function", "function": {"name": "lookup_docs", "arguments": "{}"}}
    return [
        *_approval_history(tool_content),
        {"role": "assistant", "content": "", "tool_calls": [lookup_call]},
        {"role": "tool", "tool_call_id": "call_lookup_1", "content": "Retention: seven years. " + "x" * 100},
    ]


@pytest.mark.parametrize("stream", [False, True])
def test_a_rejection_earlier_in_the_turn_gets_the_answers_text_if_rejected_R_TA_5(client, stream):
    """``approval_then_large_lookup`` looks up after the email call either
    way; its answer says whether the email was sent, though the rejection
    is not the last tool result (issue 37)."""

    def answer(messages):
        model = "approval_then_large_lookup"
        if not stream:
            return client.chat.completions.create(model=model, messages=messages).choices[0].message.content
        chunks = client.chat.completions.create(model=model, messages=messages, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    sent = "The email was sent, and the retention policy keeps records for seven years."
    not_sent = (
        "The email was not sent: the request to send it was rejected. "
        "The retention policy keeps records for seven years."
    )
    assert answer(_lookup_after_approval_history("Email queued for ops@example.com")) == sent
    rejected = "User rejected the tool call for `send_email` with id call_email_1. The tool was not executed."
    assert answer(_lookup_after_approval_history(rejected)) == not_sent
    # A rejection in an earlier turn of the thread does not count in this one.
    earlier = [
        *_approval_history(rejected),
        {"role": "assistant", "content": "The email was not sent."},
        {"role": "user", "content": "Send it now, then look up retention."},
        *_lookup_after_approval_history("Email queued for ops@example.com")[1:],
    ]
    assert answer(earlier) == sent


def test_the_demo_scenario_says_the_email_was_not_sent_after_a_rejection_through_langchain_R_TA_5(base_url):
    """The approval demo's agent shape (LangChain's human-in-the-loop
    middleware, whose wording the server recognises) against the bundled
    scenario: approve says sent, reject says not sent."""
    from langchain.agents import create_agent
    from langchain.agents.middleware import HumanInTheLoopMiddleware
    from langchain_core.tools import tool
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.types import Command

    @tool
    def send_email(to: str, subject: str, body: str) -> str:
        """Send an email."""
        return f"sent to {to}"

    def final_answer(decision: dict) -> str:
        with httpx.Client() as http:
            model = ChatOpenAI(
                model="approval_send_email", base_url=base_url, api_key="x", max_retries=0, http_client=http
            )
            agent = create_agent(
                model,
                tools=[send_email],
                middleware=[HumanInTheLoopMiddleware(interrupt_on={"send_email": True})],
                checkpointer=InMemorySaver(),
            )
            config = {"configurable": {"thread_id": "t"}}
            first = agent.invoke({"messages": [HumanMessage("Email the ops team that all is good.")]}, config)
            assert first["__interrupt__"], first
            done = agent.invoke(Command(resume={"decisions": [decision]}), config)
        return done["messages"][-1].content

    assert final_answer({"type": "approve"}) == "The email was sent."
    assert final_answer({"type": "reject", "message": "not today"}) == (
        "The email was not sent: the request to send it was rejected."
    )
    assert final_answer({"type": "reject"}) == "The email was not sent: the request to send it was rejected."


@pytest.mark.parametrize(
    ("turn", "problem"),
    [
        ({"tool_calls": [{"id": "c", "name": "t"}], "text_if_rejected": "no"}, "needs text too"),
        ({"http_status": 500, "text_if_rejected": "no"}, "cannot also give text_if_rejected"),
    ],
)
def test_text_if_rejected_is_validated(turn, problem):
    with pytest.raises(ValueError, match=problem):
        Scenario.model_validate({"name": "x", "turns": [turn]})
