"""The quick start's demo client: submits a few turns over the real HTTP API
(the same endpoint, task and service code a frontend uses), waits for them to
end and prints what the audit recorded."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import httpx
from django.contrib.auth import get_user_model
from django.db import transaction

from conversations.models import ApiToken, Message

from .models import AgentRun

DEMO_TURNS = (
    ("replay:plain_answer", "Hello! What can you do?"),
    ("replay:tool_then_answer", "What is the weather in Paris?"),
    ("replay:two_tools_then_answer", "Weather in Paris, in Fahrenheit please."),
    ("replay:approval_send_email", "Email the ops team that all is good."),
)


@dataclass
class DemoRun:
    model: str
    run_id: str
    thread_id: str
    status: str
    model_calls: int
    tool_calls: int
    total_tokens: int | None
    cost_usd: str | None = None  # the run API's cost.total_usd (R-COST-2)


DEMO_TOKEN_NAME = "quickstart"


@dataclass
class DemoUser:
    username: str
    token: str
    # True when this call created the user (with the given password);
    # an existing user is never changed.
    created: bool
    is_staff: bool


@transaction.atomic
def ensure_demo_user(*, username: str, password: str) -> DemoUser:
    """The quick start's admin user and a fresh API token for the demo.

    The user is created as a staff superuser with ``password`` only when no
    user of that name exists; an existing user keeps its password and its
    flags. The demo token is rotated: earlier ``quickstart`` tokens of the
    user are deleted, so running the quick start again never piles up
    never-expiring tokens and only the newest printed one works.
    """
    users = get_user_model()
    user = users.objects.filter(username=username).first()
    created = user is None
    if created:
        user = users.objects.create_superuser(username=username, password=password, email="")
    ApiToken.objects.filter(user=user, name=DEMO_TOKEN_NAME).delete()
    _, plaintext = ApiToken.objects.issue(user=user, name=DEMO_TOKEN_NAME)
    return DemoUser(username=username, token=plaintext, created=created, is_staff=user.is_staff)


def run_demo(*, base_url: str, token: str, timeout: float = 60.0, say: Callable[[str], None] = print) -> list[DemoRun]:
    """Submit :data:`DEMO_TURNS` over HTTP and wait until each run ends.

    Raises ``httpx.HTTPError`` when the API is unreachable or answers an
    error, ``TimeoutError`` when a run does not end within ``timeout`` s.
    """
    results = []
    with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as client:
        for model, text in DEMO_TURNS:
            thread = client.post("/api/threads", json={"agent_id": "assistant", "model": model, "title": text[:60]})
            thread.raise_for_status()
            thread_id = thread.json()["thread_id"]
            submitted = client.post(
                f"/api/threads/{thread_id}/runs", json={"request_id": f"demo-{uuid.uuid4()}", "input": {"text": text}}
            )
            submitted.raise_for_status()
            run_id = submitted.json()["run_id"]
            body = _wait(client, run_id, timeout)
            run = AgentRun.objects.get(pk=run_id)
            result = DemoRun(
                model=model,
                run_id=run_id,
                thread_id=thread_id,
                status=body["status"],
                model_calls=Message.objects.model_calls().filter(run=run).count(),
                tool_calls=Message.objects.tool_executions().filter(run=run).count(),
                total_tokens=(run.usage or {}).get("total_tokens"),
                cost_usd=(body.get("cost") or {}).get("total_usd"),
            )
            say(
                f"  {model:<32} run {run_id}  {result.status:<12} model calls {result.model_calls}"
                f"  tool calls {result.tool_calls}  tokens {result.total_tokens}  cost ${result.cost_usd}"
            )
            results.append(result)
    return results


def _wait(client: httpx.Client, run_id: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        body = client.get(f"/api/runs/{run_id}").raise_for_status().json()
        if body["status"] in AgentRun.TERMINAL_STATUSES:
            return body
        if time.monotonic() > deadline:
            raise TimeoutError(f"run {run_id} still {body['status']} after {timeout:.0f}s")
        time.sleep(0.2)
