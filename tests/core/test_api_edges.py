"""Where the API's answers to bad input were looser than its contract
(issue 37): a non-staff caller is refused (403) before a staff endpoint
reads its parameters, and a number is never read as a date."""

from __future__ import annotations

import pytest

from tests.conftest import bearer

pytestmark = pytest.mark.django_db

STAFF_ENDPOINTS = [
    ("/api/audit/runs", {"limit": "0", "from": "soon"}),
    ("/api/audit/runs/export", {"format": "xls"}),
    ("/api/audit/runs/not-a-uuid/timeline", {}),
    ("/api/dashboard/overview", {"from": "soon"}),
    ("/api/dashboard/costs", {"tz": "Mars/Olympus"}),
]


@pytest.mark.parametrize(("path", "bad"), STAFF_ENDPOINTS)
def test_a_non_staff_user_is_refused_before_the_query_is_read_R_READ_5(client, user, staff_user, path, bad):
    assert client.get(path, bad).status_code == 401
    refused = client.get(path, bad, headers=bearer(user))
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "permission_denied", refused.content
    client.force_login(user)
    assert client.get(path, bad).status_code == 403, "the session too"
    assert client.get(path, bad, headers=bearer(staff_user)).status_code == 422


@pytest.mark.parametrize(
    ("path", "param", "number"),
    [
        ("/api/audit/runs", "to", "0"),
        ("/api/audit/runs", "from", "1700000000"),
        ("/api/audit/runs", "from", "-5"),
        ("/api/dashboard/overview", "to", "0"),
        ("/api/dashboard/overview", "from", "20260101"),
        ("/api/dashboard/timeseries", "from", "1.5"),
    ],
)
def test_a_number_is_not_read_as_a_date_R_ADM_2_R_DASH_1(client, staff_user, path, param, number):
    refused = client.get(path, {param: number}, headers=bearer(staff_user))
    assert refused.status_code == 422, refused.content
    assert "ISO 8601" in refused.content.decode()


def test_iso_dates_and_times_are_still_read_R_ADM_2_R_DASH_1(client, staff_user):
    headers = bearer(staff_user)
    runs = client.get("/api/audit/runs", {"from": "2026-01-01", "to": "2026-12-31T23:00:00+01:00"}, headers=headers)
    assert runs.status_code == 200, runs.content
    overview = client.get("/api/dashboard/overview", {"from": "2026-11-01", "to": "2026-11-30"}, headers=headers)
    assert overview.status_code == 200 and overview.json()["window"]["from_day"] == "2026-11-01"
