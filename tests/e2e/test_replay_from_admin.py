"""The admin's *Replay* over HTTP, run by a real Celery worker (R-REPLAY-2):
a staff member signs in, asks for the replay of a turn the worker ran,
and the run page shows the worker's report once it is done.

Real processes: uvicorn (ASGI), a Celery worker (prefork), the replay
model server, PostgreSQL and Redis; the replay starts its own replay model
server inside the worker."""

from __future__ import annotations

import re
import time

import pytest

from audit.models import AgentRun, RunReplay
from tests.conftest import bearer

from .stack import create_thread, wait_for_status

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

CSRF = re.compile(r'name="csrfmiddlewaretoken" value="([^"]+)"')


def test_staff_replay_a_turn_from_the_run_page_and_read_the_workers_report_R_REPLAY_2(stack, user, staff_user):
    with stack.client(bearer(user)) as api:
        thread_id = create_thread(api, "replay:tool_then_answer")
        submitted = api.post(
            f"/api/threads/{thread_id}/runs", json={"request_id": "replay-e2e-1", "input": {"text": "Weather?"}}
        )
        assert submitted.status_code == 202, submitted.text
        run_id = submitted.json()["run_id"]
        assert (
            wait_for_status(api, run_id, {"completed", "failed", "cancelled", "interrupted"})["status"] == "completed"
        )

    with stack.client() as browser:
        login = browser.get("/admin/login/")
        signed_in = browser.post(
            "/admin/login/?next=/admin/",
            data={
                "csrfmiddlewaretoken": CSRF.search(login.text).group(1),
                "username": staff_user.username,
                "password": "pw-12345678",
                "next": "/admin/",
            },
            headers={"Referer": f"{stack.base_url}/admin/login/"},
        )
        assert signed_in.status_code == 302, signed_in.text[:500]
        page = f"/admin/audit/agentrun/{run_id}/change/"
        run_page = browser.get(page)
        assert run_page.status_code == 200 and "Replay</button>" in run_page.text

        asked = browser.post(
            f"/admin/audit/agentrun/{run_id}/replay/",
            data={"csrfmiddlewaretoken": CSRF.search(run_page.text).group(1)},
            headers={"Referer": f"{stack.base_url}{page}"},
        )
        assert asked.status_code == 302, asked.text[:500]

        deadline = time.monotonic() + 120
        while True:
            replay = RunReplay.objects.filter(run_id=run_id).first()
            if replay is not None and replay.status not in (RunReplay.Status.PENDING, RunReplay.Status.RUNNING):
                break
            assert time.monotonic() < deadline, f"the worker did not finish the replay: {replay and replay.status}"
            time.sleep(0.2)
        assert replay.status == RunReplay.Status.IDENTICAL, (replay.first_divergence, replay.report)
        html = browser.get(page).text
        assert "IDENTICAL" in html and replay.replay_run_ids[0][:8] in html
    replayed = AgentRun.objects.get(pk=replay.replay_run_ids[0])
    assert (replayed.status, replayed.replay_of) == ("completed", run_id)
