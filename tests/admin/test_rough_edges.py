"""What a new user following the README tripped on (issue 17), each as a
test: an answered approval shows as answered; a model row that asks for
approval is no final answer in the API or the admin and takes no feedback;
a rejected row sits at the decision; the run page shows the pending
approval, refreshes its header while live and gives times to the
millisecond; unknown API paths answer JSON; the quick start never resets a
password; commands say which database to set."""

from __future__ import annotations

import datetime as dt
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from django.urls import reverse

from audit import ledger
from audit.demo import DEMO_TOKEN_NAME, ensure_demo_user
from audit.ledger import StateMessage
from audit.models import AgentRun
from conversations.models import ApiToken, Message
from governance.bypass import audited_bypass
from tests.conftest import bearer
from tests.read.builders import RunDriver

from .builders import big_run

pytestmark = pytest.mark.django_db

REPO = Path(__file__).resolve().parents[2]
EMAIL_ARGS = {"to": "ops@example.com", "subject": "status", "body": "all good"}
INTERRUPT = [
    {
        "id": "intr-1",
        "value": {
            "action_requests": [{"name": "send_email", "args": EMAIL_ARGS, "description": "Send an email"}],
            "review_configs": [{"action_name": "send_email", "allowed_decisions": ["approve", "reject"]}],
        },
    }
]


def interrupted_run(thread) -> AgentRun:
    """A run that stopped for approval of send_email, as the worker leaves it."""
    d = RunDriver(thread, text="email ops")
    d.model("lc_run--ask", tool_calls=[{"id": "call_email_1", "name": "send_email", "args": EMAIL_ARGS}])
    return d.finish("interrupted", interrupts=INTERRUPT)


def rejected_resume(interrupted: AgentRun) -> AgentRun:
    """Resume with a rejection and let the worker finish it: the approval
    middleware's error ToolMessage, then the model's answer."""
    resume, _ = ledger.run_resume(
        user=interrupted.user,
        run_id=interrupted.pk,
        request_id="reject-1",
        decisions=[{"type": "reject", "message": "not today"}],
    )
    d = RunDriver(interrupted.thread, run=resume)
    d.state.append(
        StateMessage(
            kind="tool",
            id="tm-rejected",
            content="User rejected: not today",
            tool_call_id="call_email_1",
            status="error",
        )
    )
    d.model("lc_run--answer", content="I did not send the email.")
    return d.finish()


def test_get_run_says_the_approval_was_answered_by_which_run_and_decision_R_TA_5(client, thread):
    headers = bearer(thread.user)
    run = interrupted_run(thread)
    pending = client.get(f"/api/runs/{run.pk}", headers=headers).json()
    assert pending["status"] == "interrupted"
    assert pending["pending_approval"] == INTERRUPT
    assert pending["approval"] == {
        "status": "pending",
        "action_requests": [
            {
                "kind": "approval",
                "name": "send_email",
                "args": EMAIL_ARGS,
                "description": "Send an email",
                "allowed_decisions": ["approve", "reject"],
            }
        ],
        "resume_run_id": None,
        "resume_run_status": None,
        "decisions": None,
    }
    resume = rejected_resume(run)
    answered = client.get(f"/api/runs/{run.pk}", headers=headers).json()
    assert answered["status"] == "interrupted"  # the run itself ended interrupted
    assert answered["pending_approval"] is None  # but nothing waits any more
    assert answered["approval"]["status"] == "answered"
    assert answered["approval"]["resume_run_id"] == str(resume.pk)
    assert answered["approval"]["resume_run_status"] == "completed"
    assert answered["approval"]["decisions"] == [{"type": "reject", "message": "not today"}]
    assert client.get(f"/api/runs/{resume.pk}", headers=headers).json()["approval"] is None


def test_a_row_asking_for_approval_is_no_final_answer_and_takes_no_feedback_R_TA_5(client, staff_user, thread):
    run = interrupted_run(thread)
    ask = Message.objects.get(run=run, operation_id="lc_run--ask")
    assert run.output_message_id == ask.pk  # bound as the State's last AIMessage (R-MA-8)
    headers = bearer(thread.user)
    refused = client.post(
        f"/api/messages/{ask.pk}/feedback", {"rating": "like"}, content_type="application/json", headers=headers
    )
    assert refused.status_code == 422 and refused.json()["error"]["reason"] == "not_a_final_answer"
    items = client.get(f"/api/audit/runs/{run.pk}/timeline", headers=bearer(staff_user)).json()["items"]
    assert [i["is_final_answer"] for i in items] == [False]
    client.force_login(staff_user)
    html = client.get(reverse("admin:audit_agentrun_change", args=[run.pk])).content.decode()
    assert "final answer" not in html and "tool call for approval" in html
    # The resume's answer is a final answer: it takes feedback, and the admin says so.
    resume = rejected_resume(run)
    answer = resume.output_message
    ok = client.post(
        f"/api/messages/{answer.pk}/feedback", {"rating": "like"}, content_type="application/json", headers=headers
    )
    assert ok.status_code == 201
    assert (
        'class="yx-final">final answer'
        in client.get(reverse("admin:audit_agentrun_change", args=[resume.pk])).content.decode()
    )


def test_rejected_row_sits_at_the_decision_in_api_and_admin_R_TA_5(client, staff_user, thread):
    run = interrupted_run(thread)
    resume = rejected_resume(run)
    rejected = Message.objects.get(run=resume, execution_status="rejected")
    assert rejected.sequence == 0 and rejected.started_at is None
    items = client.get(f"/api/audit/threads/{thread.pk}/timeline", headers=bearer(staff_user)).json()["items"]
    assert [(i["run_id"], i["status"], i["operation_id"]) for i in items] == [
        (str(run.pk), "completed", "lc_run--ask"),
        (str(resume.pk), "rejected", "call_email_1"),
        (str(resume.pk), "completed", "lc_run--answer"),
    ]
    assert items[-1]["is_final_answer"] is True
    client.force_login(staff_user)
    html = client.get(reverse("admin:audit_agentrun_change", args=[resume.pk])).content.decode()
    assert re.findall(r'data-status="(\w+)"', html) == ["rejected", "completed"]


def test_run_page_shows_the_pending_approval_prominently_R_TA_5(client, staff_user, thread):
    run = interrupted_run(thread)
    client.force_login(staff_user)
    html = client.get(reverse("admin:audit_agentrun_change", args=[run.pk])).content.decode()
    panel = html[html.index('class="yx-approval') : html.index("</section>", html.index('class="yx-approval'))]
    assert "Waiting for approval" in panel and "send_email" in panel
    assert "&quot;to&quot;: &quot;ops@example.com&quot;" in panel  # indented JSON arguments
    assert "approve, reject" in panel
    # Above the fields, not inside the collapsed details.
    assert html.index('class="yx-approval') < html.index('<fieldset class="module aligned')
    resume = rejected_resume(run)
    html = client.get(reverse("admin:audit_agentrun_change", args=[run.pk])).content.decode()
    assert "Approval answered" in html and reverse("admin:audit_agentrun_change", args=[resume.pk]) in html
    assert 'class="yx-approval-decision">reject: not today' in html


def test_live_run_header_is_refreshed_with_status_usage_and_duration_R_ADM_1(client, staff_user, thread):
    run = big_run(thread, rows=4, status=AgentRun.Status.RUNNING)
    AgentRun.objects.filter(pk=run.pk).update(usage=None)
    client.force_login(staff_user)
    page = client.get(reverse("admin:audit_agentrun_change", args=[run.pk])).content.decode()
    for name in ("status", "usage", "duration", "finished"):
        assert f'data-yx-live="{name}"' in page, name
    fragment_url = reverse("admin:audit_agentrun_timeline", args=[run.pk])
    live = client.get(fragment_url).content.decode()
    hidden = live[live.index('class="yx-run-live"') : live.index("</div>", live.index('class="yx-run-live"'))]
    # While running: usage of the calls finished so far, duration running.
    assert "yx-status-running" in hidden and "so far" in hidden and "(running)" in hidden
    finished_at = run.started_at + dt.timedelta(seconds=3)
    AgentRun.objects.filter(pk=run.pk).update(
        status="completed",
        finished_at=finished_at,
        usage={"input_tokens": 7, "output_tokens": 3, "total_tokens": 10, "unknown_calls": 0},
    )
    done = client.get(fragment_url).content.decode()
    hidden = done[done.index('class="yx-run-live"') : done.index("</div>", done.index('class="yx-run-live"'))]
    assert "yx-status-completed" in hidden and "7 in / 3 out = 10" in hidden and "3.0 s" in hidden
    assert finished_at.isoformat(timespec="microseconds") in hidden
    assert 'data-live="0"' in done  # and the refresh stops


def test_times_show_milliseconds_with_iso_8601_to_copy_R_ADM_1(client, staff_user, thread):
    run = big_run(thread, rows=2)
    started = dt.datetime(2026, 11, 30, 6, 23, 41, 517_250, tzinfo=dt.UTC)
    AgentRun.objects.filter(pk=run.pk).update(started_at=started)
    # A closed row's start is a fact (R-GOV-3): set through the recorded bypass.
    with audited_bypass(reason="test: a row that started at a chosen time"):
        Message.objects.filter(run=run, sequence=1).update(started_at=started)
    client.force_login(staff_user)
    html = client.get(reverse("admin:audit_agentrun_change", args=[run.pk])).content.decode()
    iso = started.isoformat(timespec="microseconds")
    # One form everywhere, with its zone (issue 37): run field and timeline row.
    shown = f'<time datetime="{iso}" title="{iso}">2026-11-30 06:23:41.517 UTC</time>'
    assert html.count(shown) >= 2
    assert f'<td class="yx-num yx-started">{shown}</td>' in html  # timeline row
    assert "a.m." not in html and "p.m." not in html
    listing = client.get(reverse("admin:audit_agentrun_changelist")).content.decode()
    assert re.search(r'<time datetime="[^"]+" title="[^"]+">\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} UTC</time>', listing)


def test_unknown_api_paths_and_methods_answer_json_R_READ_6(client, user, other_user, thread):
    headers = bearer(user)
    for path in ("/api/nope", "/api/threads/x/y/z", f"/api/threads/{thread.pk}/nope", "/api/"):
        response = client.get(path, headers=headers)
        assert response.status_code == 404, path
        assert response["Content-Type"] == "application/json"
        assert response.json()["error"]["code"] == "not_found", path
    not_allowed = client.delete("/api/threads", headers=headers)
    assert not_allowed.status_code == 405 and not_allowed["Content-Type"] == "application/json"
    error = not_allowed.json()["error"]
    assert error["code"] == "method_not_allowed" and "GET" in error["allowed"] and "POST" in error["allowed"]
    assert "GET" in not_allowed["Allow"]
    assert client.put(f"/api/runs/{thread.pk}/cancel", headers=headers).json()["error"]["code"] == "method_not_allowed"
    # The admin keeps its HTML pages.
    assert "application/json" not in client.get("/admin/nope/")["Content-Type"]


def test_get_thread_for_its_owner_only_R_READ_5(client, user, other_user, thread):
    body = client.get(f"/api/threads/{thread.pk}", headers=bearer(user)).json()
    assert body["thread_id"] == str(thread.pk) and body["model"] == thread.model
    stranger = client.get(f"/api/threads/{thread.pk}", headers=bearer(other_user))
    assert stranger.status_code == 404 and stranger.json()["error"]["code"] == "not_found"
    assert client.get("/api/threads/not-a-uuid", headers=bearer(user)).status_code == 422
    assert client.get(f"/api/threads/{thread.pk}").status_code == 401


def test_quickstart_user_keeps_its_password_and_rotates_the_demo_token(client):
    first = ensure_demo_user(username="admin", password="admin")
    assert first.created and first.is_staff
    admin = get_user_model().objects.get(username="admin")
    assert admin.check_password("admin") and admin.is_superuser
    admin.set_password("my-own-secret-1")
    admin.save()
    ApiToken.objects.issue(user=admin, name="ci")  # a token of the user's own
    second = ensure_demo_user(username="admin", password="admin")
    admin.refresh_from_db()
    assert not second.created and admin.check_password("my-own-secret-1")
    assert ApiToken.objects.filter(user=admin, name=DEMO_TOKEN_NAME).count() == 1
    assert ApiToken.objects.filter(user=admin, name="ci").count() == 1
    assert client.get("/api/threads", headers={"Authorization": f"Bearer {first.token}"}).status_code == 401
    assert client.get("/api/threads", headers={"Authorization": f"Bearer {second.token}"}).status_code == 200


def test_an_existing_non_staff_admin_user_is_left_as_it_is(django_user_model):
    user = django_user_model.objects.create_user(username="admin", password="pw-12345678")
    demo = ensure_demo_user(username="admin", password="admin")
    user.refresh_from_db()
    assert not demo.created and not demo.is_staff and not user.is_staff and user.check_password("pw-12345678")


def _manage(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=REPO,
        env={**os.environ, "PYTHONWARNINGS": "ignore", **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_create_api_token_without_a_database_says_what_to_set_and_creates_no_file(tmp_path):
    missing = tmp_path / "nowhere" / "yuxi.sqlite3"
    missing.parent.mkdir()
    done = _manage("create_api_token", "admin", env={"DATABASE_URL": f"sqlite:///{missing}"})
    assert done.returncode == 1
    assert "Traceback" not in done.stderr and "no such table" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "DATABASE_URL" in done.stderr, done.stderr
    assert not missing.exists()
    embedded = REPO / "var" / "yuxi.sqlite3"
    if not embedded.exists():  # a fresh clone: DATABASE_URL unset means the embedded file
        done = _manage("create_api_token", "admin", env={"DATABASE_URL": "", "REDIS_URL": ""})
        assert done.returncode == 1 and "DATABASE_URL is not set" in done.stderr, done.stderr
        # The quick start's embedded mode is a PostgreSQL server: the hint says how to reach it.
        assert "bin/pg_embedded.py start var/pgdata yuxi" in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1 and not embedded.exists()
    # An existing but unmigrated database: one line too.
    empty = tmp_path / "empty.sqlite3"
    empty.touch()
    done = _manage("create_api_token", "admin", env={"DATABASE_URL": f"sqlite:///{empty}"})
    assert done.returncode == 1 and "manage.py migrate" in done.stderr and "Traceback" not in done.stderr
