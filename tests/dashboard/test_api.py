"""Dashboard API over HTTP (R-DASH-1): staff only (R-READ-5), bad input is a
machine-readable 422 (R-READ-6), figures as in the selector tests."""

from __future__ import annotations

import pytest

from tests.conftest import bearer

from .world import MODEL_A, MODEL_B, D, build_world

pytestmark = pytest.mark.django_db

ENDPOINTS = ["overview", "models", "tools", "timeseries", "feedback"]


@pytest.fixture
def world(user, other_user):
    return build_world(user, other_user)


@pytest.mark.parametrize("name", ENDPOINTS)
def test_dashboard_needs_staff_R_READ_5(client, user, name):
    assert client.get(f"/api/dashboard/{name}").status_code == 401
    response = client.get(f"/api/dashboard/{name}", headers=bearer(user))
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "permission_denied"


@pytest.mark.parametrize("query", ["tz=Nowhere/Land", "from=2026-03-10&to=2026-03-01", "from=yesterday"])
def test_bad_parameters_are_422_R_READ_6(client, staff_user, query):
    response = client.get(f"/api/dashboard/overview?{query}", headers=bearer(staff_user))
    assert response.status_code == 422
    assert response.json()["error"]["code"] == "invalid_input"


def test_overview_tools_and_feedback_over_http_R_DASH_1(client, staff_user, world):
    headers = bearer(staff_user)
    q = f"from={D}&to={D}&tz=UTC"
    overview = client.get(f"/api/dashboard/overview?{q}", headers=headers).json()
    assert overview["messages"] == 3 and overview["conversations"] == 2
    assert overview["runs_by_status"]["completed"] == 1
    assert overview["window"] == {"from_day": str(D), "to_day": str(D), "tz": "UTC"}

    tools = client.get(f"/api/dashboard/tools?{q}", headers=headers).json()
    assert sum(t["executions"] for t in tools["by_tool"]) == 3
    assert sum(t["successes"] for t in tools["by_tool"]) == 1
    assert sum(t["failures"] for t in tools["by_tool"]) == 1

    models = client.get(f"/api/dashboard/models?{q}", headers=headers).json()
    assert {(r["model"], r["total_tokens"]) for r in models["tokens_by_model_day"]} == {
        (MODEL_A, 45),
        (MODEL_B, 3),
    }
    assert {r["model"]: r["p95_ms"] for r in models["latency"]}[MODEL_A] == pytest.approx(290.0)

    series = client.get(f"/api/dashboard/timeseries?{q}", headers=headers).json()
    assert series["days"] == [
        {"day": str(D), "conversations": 2, "messages": 3, "runs": 2, "total_tokens": 48, "tool_executions": 3}
    ]

    feedback = client.get(f"/api/dashboard/feedback?{q}", headers=headers).json()
    assert (feedback["likes"], feedback["dislikes"], feedback["satisfaction_rate"]) == (1, 1, 0.5)
    assert feedback["count"] == 2
    assert [i["rating"] for i in feedback["items"]] == ["dislike", "like"]
    assert all(i["message_id"] == world.answer.id for i in feedback["items"])

    liked = client.get(f"/api/dashboard/feedback?{q}&rating=like&limit=1", headers=headers).json()
    assert [i["reason"] for i in liked["items"]] == ["clear"]
    bad = client.get(f"/api/dashboard/feedback?{q}&rating=meh", headers=headers)
    assert bad.status_code == 422


def test_time_zone_moves_day_buckets_R_DASH_1(client, staff_user, world):
    body = client.get(
        f"/api/dashboard/timeseries?from={D}&to=2026-03-11&tz=Asia/Shanghai", headers=bearer(staff_user)
    ).json()
    assert [(d["day"], d["messages"]) for d in body["days"]] == [(str(D), 2), ("2026-03-11", 1)]
