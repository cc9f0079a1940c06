"""Cost totals derive from the model rows (R-COST-2): run, user, model and
day totals, the dashboard API and the costliest runs all equal sums of
``cost_usd`` over the same rows; unknown costs are counted, never 0; tool
rows, chat messages and running calls never count (audit-row isolation as
everywhere else, R-READ-4)."""

from __future__ import annotations

import datetime as dt
import uuid
from decimal import Decimal

import pytest
from django.db.models import Sum

from audit.models import AgentRun
from conversations.models import Conversation, Message
from costs import selectors
from dashboard.selectors import dashboard_window
from tests.conftest import bearer

pytestmark = pytest.mark.django_db

D = dt.date(2026, 3, 10)


def at(hour: int) -> dt.datetime:
    return dt.datetime(D.year, D.month, D.day, hour, tzinfo=dt.UTC)


def _run(user, model):
    thread = Conversation.objects.create(user=user, agent_id="assistant", model=model)
    return AgentRun.objects.create(
        request_id=uuid.uuid4().hex, thread=thread, user=user, agent_id="assistant", model=model, status="completed"
    )


def _row(run, *, cost, finished, status="completed", role="assistant", message_type="model_audit", op=True):
    return Message.objects.create(
        thread=run.thread,
        run=run,
        role=role,
        message_type=message_type,
        operation_id=uuid.uuid4().hex if op else None,
        execution_status=status if op else None,
        finished_at=finished,
        cost_usd=None if cost is None else Decimal(cost),
    )


@pytest.fixture
def world(user, other_user):
    run_1 = _run(user, "replay:a")
    run_2 = _run(other_user, "openai:gpt-b")
    _row(run_1, cost="0.1", finished=at(10))
    _row(run_1, cost="0.2", finished=at(20))  # already D + 1 in Asia/Shanghai
    _row(run_1, cost=None, finished=at(11), status="interrupted")  # cut off before usage
    _row(run_1, cost=None, finished=None, status="running")  # neither known nor unknown yet
    _row(run_1, cost="0.05", finished=at(12), message_type="text")  # the final answer's call
    _row(run_1, cost="9", finished=at(12), role="tool", message_type="tool_audit")  # never a cost
    _row(run_1, cost="9", finished=at(12), role="user", message_type="text", op=False)  # chat message
    _row(run_2, cost="1.0", finished=at(9))
    _row(run_2, cost="5", finished=at(9) - dt.timedelta(days=1))  # outside the window
    return run_1, run_2


def test_run_cost_is_the_sum_of_its_model_rows_R_COST_2(world):
    run_1, run_2 = world
    assert selectors.run_cost(run_1.id) == {"total_usd": Decimal("0.35"), "unknown_cost_calls": 1}
    assert selectors.run_cost(run_2.id)["total_usd"] == Decimal("6")
    empty = _run(run_1.user, "replay:a")
    _row(empty, cost=None, finished=at(10), status="interrupted")
    assert selectors.run_cost(empty.id) == {"total_usd": None, "unknown_cost_calls": 1}


def test_dashboard_groups_equal_the_sum_of_row_costs_in_the_window_R_COST_2(world, user, other_user):
    window = dashboard_window(first_day=D, last_day=D, tz="UTC")
    summary = selectors.cost_summary(window)
    rows = Message.objects.model_calls().filter(finished_at__gte=window.start, finished_at__lt=window.end)
    assert summary["total_usd"] == rows.aggregate(s=Sum("cost_usd"))["s"] == Decimal("1.35")
    assert (summary["calls"], summary["unknown_cost_calls"]) == (5, 1)

    by_model = {
        r["key"]: (r["total_usd"], r["calls"], r["unknown_cost_calls"])
        for r in selectors.costs_by(window, group_by="model")
    }
    assert by_model == {"openai:gpt-b": (Decimal("1"), 1, 0), "replay:a": (Decimal("0.35"), 4, 1)}
    by_user = [(r["key"], r["total_usd"]) for r in selectors.costs_by(window, group_by="user")]
    assert by_user == [(other_user.username, Decimal("1")), (user.username, Decimal("0.35"))]
    assert [(r["key"], r["total_usd"]) for r in selectors.costs_by(window, group_by="day")] == [(D, Decimal("1.35"))]
    for group in ("model", "user", "day"):
        assert sum(r["total_usd"] or 0 for r in selectors.costs_by(window, group_by=group)) == summary["total_usd"]
    assert [(r["run_id"], r["total_usd"]) for r in selectors.costliest_runs(window)] == [
        (world[1].id, Decimal("1")),
        (world[0].id, Decimal("0.35")),
    ]


def test_days_follow_the_window_time_zone_R_COST_2(world):
    window = dashboard_window(first_day=D, last_day=D + dt.timedelta(days=1), tz="Asia/Shanghai")
    days = [(r["key"], r["total_usd"], r["calls"]) for r in selectors.costs_by(window, group_by="day")]
    assert days == [(D, Decimal("1.15"), 4), (D + dt.timedelta(days=1), Decimal("0.2"), 1)]
    stacked = {(r["model"], r["day"]): r["total_usd"] for r in selectors.cost_by_model_day(window)}
    assert stacked == {
        ("openai:gpt-b", D): Decimal("1"),
        ("replay:a", D): Decimal("0.15"),
        ("replay:a", D + dt.timedelta(days=1)): Decimal("0.2"),
    }


def test_costs_api_R_COST_2(client, world, user, staff_user):
    q = f"from={D}&to={D}&tz=UTC"
    assert client.get(f"/api/dashboard/costs?{q}").status_code == 401
    assert client.get(f"/api/dashboard/costs?{q}", headers=bearer(user)).status_code == 403
    headers = bearer(staff_user)
    for bad in ("group_by=week", "group_by=", "limit=0", "limit=100000", "tz=Mars/Base"):
        response = client.get(f"/api/dashboard/costs?{q}&{bad}", headers=headers)
        assert response.status_code == 422, (bad, response.content)
        assert response.json()["error"]["code"] == "invalid_input"
    body = client.get(f"/api/dashboard/costs?{q}&group_by=model", headers=headers).json()
    assert (body["total_usd"], body["calls"], body["unknown_cost_calls"], body["group_by"]) == ("1.35", 5, 1, "model")
    assert [(i["key"], i["total_usd"]) for i in body["items"]] == [("openai:gpt-b", "1"), ("replay:a", "0.35")]
    by_day = client.get(f"/api/dashboard/costs?{q}&group_by=day", headers=headers).json()
    assert [(i["key"], i["total_usd"]) for i in by_day["items"]] == [(str(D), "1.35")]
    top = client.get(f"/api/dashboard/costs?{q}&group_by=user&limit=1", headers=headers).json()
    assert len(top["items"]) == 1 and top["items"][0]["total_usd"] == "1"
    empty = client.get("/api/dashboard/costs?from=2001-01-01&to=2001-01-02&group_by=day", headers=headers).json()
    assert empty["total_usd"] is None and [i["total_usd"] for i in empty["items"]] == [None, None]


def test_usd_text():
    assert selectors.usd_text(Decimal("0.000108000000")) == "0.000108"
    assert selectors.usd_text(Decimal("0E-12")) == "0"
    assert selectors.usd_text(Decimal("100.000000000000")) == "100"
    assert selectors.usd_text(None) is None
