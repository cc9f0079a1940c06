"""Cost end to end (R-COST-1..3): a turn on a replay model over HTTP, run
by a real Celery worker, leaves the exact cost on its model rows, the run
API, the timeline and the dashboard; a run cancelled before usage has an
unknown cost (never 0); a turn and a resume over budget answer 402 and
create nothing."""

from __future__ import annotations

import datetime as dt
import uuid
from decimal import Decimal

import pytest
from django.db.models import Sum
from django.utils import timezone

from audit.models import AgentRun
from audit.replay.scenarios import load_scenarios
from conversations.models import Message
from costs.pricing import REPLAY_DEFAULT_PRICES
from costs.services import budget_remove, budget_set
from tests.conftest import bearer

from .stack import TERMINAL_STATUSES, create_thread, wait_for_status
from .test_model_audit_paths import _wait_for_first_text_chunk

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def _replay_cost(turn) -> Decimal:
    p = REPLAY_DEFAULT_PRICES
    return (turn.usage.prompt_tokens * p.input + turn.usage.completion_tokens * p.output) / Decimal(1_000_000)


def _submit(client, thread_id: str, text: str = "hello"):
    return client.post(
        f"/api/threads/{thread_id}/runs", json={"request_id": f"c-{uuid.uuid4().hex}", "input": {"text": text}}
    )


def test_a_replay_run_has_its_exact_cost_on_rows_run_timeline_and_dashboard_R_COST_1_R_COST_2(stack, user, staff_user):
    turns = load_scenarios()["tool_then_answer"].turns
    expected = [_replay_cost(turn) for turn in turns]
    assert expected == [Decimal("0.000108"), Decimal("0.000182")]
    with stack.client(bearer(user)) as client:
        thread_id = create_thread(client, "replay:tool_then_answer")
        submitted = _submit(client, thread_id, "Weather in Paris?")
        assert submitted.status_code == 202, submitted.text
        assert submitted.json()["cost"] == {"total_usd": None, "unknown_cost_calls": 0}
        run_id = submitted.json()["run_id"]
        body = wait_for_status(client, run_id, TERMINAL_STATUSES)
    assert body["status"] == "completed", body

    rows = list(Message.objects.model_calls().filter(run_id=run_id).order_by("sequence"))
    assert [row.cost_usd for row in rows] == expected
    assert {(row.price_source, row.price_version) for row in rows} == {("replay-default", "1")}
    assert body["cost"] == {"total_usd": "0.00029", "unknown_cost_calls": 0}

    with stack.client(bearer(staff_user)) as staff:
        timeline = staff.get(f"/api/audit/runs/{run_id}/timeline").json()["items"]
        assert [i["cost_usd"] for i in timeline if i["kind"] == "model"] == ["0.000108", "0.000182"]
        assert [i["cost_usd"] for i in timeline if i["kind"] == "tool"] == [None]

        today = timezone.now().date()
        window = f"from={today - dt.timedelta(days=1)}&to={today + dt.timedelta(days=1)}&tz=UTC"
        by_user = staff.get(f"/api/dashboard/costs?{window}&group_by=user&limit=1000").json()
        mine = [i for i in by_user["items"] if i["key"] == user.username]
        assert mine == [
            {"key": user.username, "user_id": user.pk, "total_usd": "0.00029", "calls": 2, "unknown_cost_calls": 0}
        ]
        # The dashboard's total is the sum of the rows' costs in the window.
        rows_in_window = Message.objects.model_calls().filter(
            finished_at__date__gte=today - dt.timedelta(days=1), finished_at__date__lte=today + dt.timedelta(days=1)
        )
        assert Decimal(by_user["total_usd"]) == rows_in_window.aggregate(s=Sum("cost_usd"))["s"]


def test_a_run_cancelled_before_usage_has_unknown_cost_never_zero_R_COST_1(stack, user):
    with stack.client(bearer(user)) as client:
        thread_id = create_thread(client, "replay:slow_answer")
        run_id = _submit(client, thread_id).json()["run_id"]
        _wait_for_first_text_chunk(run_id)
        assert client.post(f"/api/runs/{run_id}/cancel").status_code == 202
        body = wait_for_status(client, run_id, TERMINAL_STATUSES)
    assert body["status"] == "cancelled", body
    assert body["cost"] == {"total_usd": None, "unknown_cost_calls": 1}
    (row,) = Message.objects.model_calls().filter(run_id=run_id)
    assert (row.execution_status, row.usage, row.cost_usd) == ("interrupted", None, None)


def test_submit_and_resume_over_budget_answer_402_and_create_nothing_R_COST_3(stack, user):
    with stack.client(bearer(user)) as client:
        thread_id = create_thread(client, "replay:approval_send_email")
        run_id = _submit(client, thread_id, "Mail the report").json()["run_id"]
        assert wait_for_status(client, run_id, TERMINAL_STATUSES)["status"] == "interrupted"
        spent = Message.objects.model_calls().filter(run__user=user).aggregate(s=Sum("cost_usd"))["s"]
        assert spent == Decimal("0.000184")  # 64 in, 30 out at the replay prices

        budget_set(user=user, limit_usd="0.0001", period="month")
        runs, messages = AgentRun.objects.count(), Message.objects.count()
        resume = client.post(
            f"/api/runs/{run_id}/resume", json={"request_id": "resume-over", "decisions": [{"type": "approve"}]}
        )
        assert resume.status_code == 402, resume.text
        assert {k: resume.json()[k] for k in ("error", "limit_usd", "spent_usd", "period")} == {
            "error": "budget_exceeded",
            "limit_usd": "0.0001",
            "spent_usd": "0.000184",
            "period": "month",
        }
        other_thread = create_thread(client, "replay:plain_answer")
        refused = _submit(client, other_thread)
        assert refused.status_code == 402 and refused.json()["error"] == "budget_exceeded"
        assert (AgentRun.objects.count(), Message.objects.count()) == (runs, messages)
        assert client.get(f"/api/runs/{run_id}").json()["status"] == "interrupted"

        budget_remove(user=user)
        resumed = client.post(
            f"/api/runs/{run_id}/resume", json={"request_id": "resume-over", "decisions": [{"type": "approve"}]}
        )
        assert resumed.status_code == 202, resumed.text
        done = wait_for_status(client, resumed.json()["run_id"], TERMINAL_STATUSES)
    assert done["status"] == "completed" and done["cost"]["total_usd"] == "0.000136"  # 112 in, 6 out
