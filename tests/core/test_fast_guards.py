"""Fast guards for faults that only the slow end-to-end tests used to catch
(issue: each planted defect survived the fast suite): the events endpoint
honours ``Last-Event-ID`` (R-EVT-1), and a handled tool error is recorded
``failed``, never ``completed`` (R-TA-3). The repeated ``request_id`` guard
lives with the idempotency tests (tests/core/test_idempotency.py)."""

from __future__ import annotations

import asyncio

import pytest
from asgiref.sync import async_to_sync
from django.conf import settings
from django.test import AsyncClient

from audit.execution.events import RunEventPublisher
from audit.execution.runner import run_execute
from audit.models import AgentRun
from conversations.models import Conversation, Message
from tests.conftest import bearer, make_run
from tests.read.builders import tool_turn


def _publish(run_id, events):
    async def go():
        publisher = RunEventPublisher(run_id, settings.CONFIG.REDIS_URL)
        for kind, data in events:
            await publisher.publish(kind, data)
        await publisher.close()

    asyncio.run(go())


def _event_ids(user, run_id, headers=None) -> list[int] | None:
    """The event ids the real endpoint streams (Django's async test client:
    the endpoint is an async view with an async event stream); None when it
    answers 204 (the client holds the terminal event, R-EVT-3)."""
    auth = bearer(user)

    async def collect() -> str | None:
        response = await AsyncClient().get(f"/api/runs/{run_id}/events", headers={**auth, **(headers or {})})
        if response.status_code == 204:
            return None
        assert response.status_code == 200
        return b"".join([chunk async for chunk in response.streaming_content]).decode()

    body = async_to_sync(collect)()
    return None if body is None else [int(line[4:]) for line in body.splitlines() if line.startswith("id: ")]


@pytest.mark.django_db
def test_the_events_endpoint_resumes_after_last_event_id_R_EVT_1(user, thread):
    run = tool_turn(thread)
    _publish(
        run.id,
        [
            ("run.status", {"status": "running"}),
            ("model.started", {}),
            ("model.delta", {"text": "a"}),
            ("run.finished", {"status": "completed"}),
        ],
    )
    assert _event_ids(user, run.id) == [1, 2, 3, 4]
    assert _event_ids(user, run.id, {"Last-Event-ID": "2"}) == [3, 4]
    assert _event_ids(user, run.id, {"Last-Event-ID": "4"}) is None, "204: it holds run.finished (R-EVT-3)"


@pytest.mark.django_db(transaction=True)
def test_a_handled_tool_error_is_recorded_failed_and_the_run_goes_on_R_TA_3(user, replay_models):
    thread = Conversation.objects.create(user=user, agent_id="assistant", model="replay:tool_error_handled")
    run = make_run(thread, text="weather in Atlantis?")
    assert run_execute(run_id=run.id, owner="in-process") == "completed"
    row = Message.objects.get(run=run, role=Message.Role.TOOL)
    assert row.operation_id == "call_weather_atlantis"
    assert row.execution_status == "failed"
    assert "unknown city: Atlantis" in row.content
    assert row.metadata["raw_output"]["status"] == "error"
    assert "state_reconciled" not in row.metadata
    assert AgentRun.objects.get(pk=run.id).output_message.content.startswith("Sorry")
