"""Provider faults (R-RUN-12), with the worker in process and the replay
model server playing each fault: requests that fail before their first
chunk are retried with bounded exponential backoff, honouring Retry-After,
each attempt visible on the call's one audit row; the run's error type says
what happened (``model_unreachable`` only when no attempt connected,
``model_stream_broken`` for a stream that broke after its first chunk)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from audit.agents.provider import AttemptFailure, failed_request_error_type, retry_after_seconds
from audit.execution.runner import run_execute
from audit.replay.scenarios import Scenario, load_scenarios
from audit.replay.server import make_server
from conversations.models import Conversation, Message
from core.config import get_config
from tests.conftest import make_run
from tests.waiting import WAIT_SECONDS

pytestmark = pytest.mark.django_db(transaction=True)

EXTRA_SCENARIOS = {
    "unavailable": {"turns": [{"text": "never", "fail_before_first_chunk": {"status": 503, "times": 100}}]},
    "retry_after_too_long": {
        "turns": [{"text": "never", "fail_before_first_chunk": {"status": 429, "retry_after": 30}}]
    },
    "refused_then_unavailable": {
        "turns": [{"text": "never", "connect_error_times": 2, "fail_before_first_chunk": {"status": 502, "times": 100}}]
    },
    "unavailable_once": {
        "turns": [{"text": "Second time lucky.", "fail_before_first_chunk": {"status": 500, "times": 1}}]
    },
}


@pytest.fixture(scope="module")
def fault_server():
    scenarios = dict(load_scenarios())
    scenarios.update({name: Scenario.model_validate({"name": name, **spec}) for name, spec in EXTRA_SCENARIOS.items()})
    server = make_server(scenarios, "127.0.0.1", 0)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + WAIT_SECONDS
    while server.base_url is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    yield server.base_url
    server.should_exit = True
    thread.join(timeout=5)


@pytest.fixture
def fast_retries(fault_server, monkeypatch):
    """The fault server, and backoff of 50 ms doubling, without jitter."""
    config = get_config()
    monkeypatch.setattr(config, "REPLAY_MODEL_URL", fault_server)
    monkeypatch.setattr(config, "MODEL_RETRY_ATTEMPTS", 6)
    monkeypatch.setattr(config, "MODEL_RETRY_INITIAL_DELAY_SECONDS", 0.05)
    monkeypatch.setattr(config, "MODEL_RETRY_MAX_DELAY_SECONDS", 8.0)
    monkeypatch.setattr(config, "MODEL_RETRY_JITTER_SECONDS", 0.0)
    return config


def _run(user, scenario: str):
    thread = Conversation.objects.create(user=user, agent_id="assistant", model=f"replay:{scenario}")
    run = make_run(thread, text=f"{scenario} {time.monotonic_ns()}")
    status = run_execute(run_id=run.id)
    run.refresh_from_db()
    (row,) = Message.objects.model_calls().filter(run=run)
    return status, run, row


@pytest.mark.parametrize(
    ("scenario", "attempts", "connected"),
    [("flaky_connect", 3, [False, False]), ("rate_limited", 3, [True, True]), ("unavailable_once", 2, [True])],
)
def test_a_request_failing_before_its_first_chunk_is_retried_and_each_attempt_is_on_the_row_R_RUN_12(
    user, fast_retries, scenario, attempts, connected
):
    status, run, row = _run(user, scenario)
    assert status == "completed" and run.error_type == ""
    assert row.execution_status == "completed" and row.usage and row.content
    assert row.metadata["attempts"] == attempts
    errors = row.metadata["attempt_errors"]
    assert [e["attempt"] for e in errors] == list(range(1, attempts))
    assert [e["connected"] for e in errors] == connected
    assert run.usage["unknown_calls"] == 0


def test_retry_after_is_honoured_R_RUN_12(user, fast_retries):
    started = time.monotonic()
    status, _, row = _run(user, "rate_limited")
    assert status == "completed"
    errors = row.metadata["attempt_errors"]
    assert [(e["status"], e["retry_after"]) for e in errors] == [(429, 0.3), (429, 0.3)]
    assert all(e["retry_in_ms"] >= 300 for e in errors), "the provider's wait, not the 50 ms backoff"
    assert time.monotonic() - started >= 0.6


def test_the_backoff_doubles_and_the_attempts_are_bounded_then_model_unreachable_R_RUN_12(user, fast_retries):
    status, run, row = _run(user, "model_unreachable")
    assert (status, run.error_type) == ("failed", "model_unreachable")
    assert "after 6 attempts" in run.error_message
    assert row.metadata["attempts"] == 6
    errors = row.metadata["attempt_errors"]
    assert [e["retry_in_ms"] for e in errors] == [50, 100, 200, 400, 800]
    assert not any(e["connected"] for e in errors)
    assert row.execution_status == "failed" and row.usage is None and row.metadata["usage_unknown"] is True
    assert row.metadata["error"].startswith("model_unreachable:")
    assert row.metadata["awaiting_first_chunk"] is True
    assert run.usage["unknown_calls"] == 1


@pytest.mark.parametrize(
    ("scenario", "error_type", "attempts"),
    [
        ("unavailable", "model_http_error", 6),  # the provider answered every time
        ("refused_then_unavailable", "model_http_error", 6),  # it did connect, later
        ("retry_after_too_long", "model_http_error", 1),  # a wait above the cap ends the retries
        ("model_http_error", "model_http_error", 1),  # 400: not retried
    ],
)
def test_a_provider_that_answered_is_never_called_unreachable_R_RUN_12(
    user, fast_retries, scenario, error_type, attempts
):
    status, run, row = _run(user, scenario)
    assert (status, run.error_type) == ("failed", error_type)
    assert row.metadata["attempts"] == attempts
    assert row.execution_status == "failed" and row.metadata["error"].startswith(f"{error_type}:")
    assert len(row.metadata.get("attempt_errors") or []) == attempts - 1


def test_a_stream_broken_after_its_first_chunk_is_model_stream_broken_and_keeps_what_streamed_R_RUN_12(
    user, fast_retries
):
    status, run, row = _run(user, "model_error_midstream")
    assert (status, run.error_type) == ("failed", "model_stream_broken")
    assert row.metadata["attempts"] == 1 and "attempt_errors" not in row.metadata, "never retried"
    full = load_scenarios()["model_error_midstream"].turns[0].text
    assert row.content and full.startswith(row.content) and row.metadata["content_partial"] is True
    assert row.execution_status == "failed" and row.usage is None


def test_the_error_type_says_whether_any_attempt_connected_R_RUN_12():
    refused = AttemptFailure(1, "refused", connected=False, retryable=True)
    answered = AttemptFailure(2, "503", connected=True, retryable=True, status=503)
    broken = AttemptFailure(3, "reset after headers", connected=True, retryable=True)
    assert failed_request_error_type([refused, refused]) == "model_unreachable"
    assert failed_request_error_type([refused, answered]) == "model_http_error"
    assert failed_request_error_type([answered, refused]) == "model_request_failed"
    assert failed_request_error_type([broken]) == "model_request_failed"


def test_retry_after_headers_are_read_as_ms_seconds_or_a_date():
    assert retry_after_seconds(httpx.Headers({"retry-after-ms": "250", "retry-after": "9"})) == 0.25
    assert retry_after_seconds(httpx.Headers({"retry-after": "2"})) == 2.0
    assert 0 <= retry_after_seconds(httpx.Headers({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"})) < 1
    assert retry_after_seconds(httpx.Headers({"retry-after": "soon"})) is None
    assert retry_after_seconds(httpx.Headers({})) is None
