"""What the admin screenshots of issue 37 showed, each as a test: the
model filter lists the models the audit used, not every bundled scenario;
every time of the admin takes one form, with its zone; a thread's owner
and users' feedback cannot be changed; only feedback on an audit row is
marked in the feedback list."""

from __future__ import annotations

import re

import pytest
from django.urls import reverse

from audit.catalogue import available_models
from audit.models import AgentRun
from conversations.models import ApiToken, Conversation, Message, MessageFeedback
from costs.models import Budget
from dashboard import selectors
from dashboard.rollups import run_roll_up

from .builders import big_run

pytestmark = pytest.mark.django_db


def _model_filter_choices(html: str) -> list[str]:
    """The option labels of the run list's model filter."""
    section = re.search(r'<details data-filter-title="model".*?</details>', html, re.S).group(0)
    return [label.strip() for label in re.findall(r"<a [^>]*>([^<]*)</a>", section) if label.strip() != "All"]


def test_models_used_lists_the_models_of_rolled_up_and_active_runs_not_replays_issue_37(user):
    done = Conversation.objects.create(user=user, agent_id="assistant", model="replay:tool_then_answer")
    active = Conversation.objects.create(user=user, agent_id="assistant", model="replay:slow_answer")
    replayed = Conversation.objects.create(user=user, agent_id="assistant", model="replay:replay-0123456789ab")
    finished = big_run(done, rows=2)
    assert run_roll_up(run_id=finished.pk)
    big_run(done, rows=2)  # terminal, not rolled up yet: still listed, once
    big_run(active, rows=2, status=AgentRun.Status.RUNNING)
    replay = big_run(replayed, rows=2)
    AgentRun.objects.filter(pk=replay.pk).update(replay_of="scenario.json")

    assert selectors.models_used() == ["replay:slow_answer", "replay:tool_then_answer"]


def test_the_model_filter_lists_only_models_the_audit_used_issue_37(client, staff_user, user):
    assert len(available_models()) > 30  # every bundled scenario
    thread = Conversation.objects.create(user=user, agent_id="assistant", model="replay:plain_answer")
    run = big_run(thread, rows=2)
    assert run_roll_up(run_id=run.pk)
    client.force_login(staff_user)
    url = reverse("admin:audit_agentrun_changelist")

    assert _model_filter_choices(client.get(url).content.decode()) == ["replay:plain_answer"]
    # A model asked for in the URL stays selectable though no run used it.
    html = client.get(url, {"model": "replay:slow_answer"}).content.decode()
    assert _model_filter_choices(html) == ["replay:plain_answer", "replay:slow_answer"]


# One form for every time, with its zone: "2026-11-30 06:23:41.517 UTC".
ONE_FORM = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} UTC$")
# Django's own forms ("Dec. 4, 2026, 1:05 p.m.", "Nov. 30, 2026").
DJANGO_FORM = re.compile(
    r"\b(a\.m\.|p\.m\.|midnight|noon)|\b(Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]*\.? \d{1,2}, \d{4}"
)


def _times(html: str) -> list[str]:
    return re.findall(r"<time [^>]*>([^<]*)</time>", html)


def test_every_admin_list_and_page_shows_times_in_one_form_with_the_zone_issue_37(client, staff_user, user):
    thread = Conversation.objects.create(user=user, agent_id="assistant", model="replay:plain_answer")
    run = big_run(thread, rows=4)
    answer = Message.objects.filter(run=run).order_by("id").first()
    ordinary = Message.objects.create(thread=thread, role="assistant", content="hello", run=run)
    feedback = MessageFeedback.objects.create(message=ordinary, user=user, rating="like")
    token, _ = ApiToken.objects.issue(user=user, name="t")
    ApiToken.objects.filter(pk=token.pk).update(last_used_at=run.started_at)
    budget = Budget.objects.create(user=user, limit_usd=5, period="day")
    client.force_login(staff_user)

    pages = {
        "run list": reverse("admin:audit_agentrun_changelist"),
        "run page": reverse("admin:audit_agentrun_change", args=[run.pk]),
        "thread list": reverse("admin:conversations_conversation_changelist"),
        "thread page": reverse("admin:conversations_conversation_change", args=[thread.pk]),
        "thread timeline": reverse("admin:conversations_conversation_timeline", args=[thread.pk]),
        "message list": reverse("admin:conversations_message_changelist"),
        "audit row page": reverse("admin:conversations_message_change", args=[answer.pk]),
        "message page": reverse("admin:conversations_message_change", args=[ordinary.pk]),
        "feedback list": reverse("admin:conversations_messagefeedback_changelist"),
        "token list": reverse("admin:conversations_apitoken_changelist"),
        "budget list": reverse("admin:costs_budget_changelist"),
        "dashboard": reverse("admin-dashboard") + f"?from={run.created_at.date()}&to={run.created_at.date()}",
    }
    expected_times = {
        "run list": 1,
        "run page": 3,
        "thread list": 1,
        "thread page": 1,
        "thread timeline": 4,
        "message list": 5,
        "audit row page": 4,
        "message page": 2,
        "feedback list": 1,
        "token list": 2,
        "budget list": 1,
        "dashboard": 1,
    }
    for name, url in pages.items():
        response = client.get(url)
        assert response.status_code == 200, name
        html = response.content.decode()
        times = _times(html)
        assert len(times) >= expected_times[name], (name, times)
        assert all(ONE_FORM.match(t) for t in times), (name, times)
        assert not DJANGO_FORM.search(html), (name, DJANGO_FORM.search(html).group(0))
    assert feedback.pk and budget.pk


def test_waterfall_bar_tooltips_show_times_in_the_one_form_with_the_zone_issue_37(client, staff_user, user):
    thread = Conversation.objects.create(user=user, agent_id="assistant", model="replay:plain_answer")
    run = big_run(thread, rows=4)
    client.force_login(staff_user)
    html = client.get(reverse("admin:audit_agentrun_change", args=[run.pk])).content.decode()

    tooltips = re.findall(r'<div class="yx-bar [^"]*" style="[^"]*" title="([^"]*)"', html)
    started = [r for r in Message.objects.filter(run=run).order_by("sequence") if r.started_at]
    assert len(tooltips) == len(started) >= 3
    for tooltip, row in zip(tooltips, started, strict=True):
        start, end = tooltip.split(" → ")
        assert ONE_FORM.match(start), tooltip
        assert start == row.started_at.isoformat(" ", "milliseconds")[:23] + " UTC"
        # A call still running has no end yet.
        assert ONE_FORM.match(end) if row.finished_at else end == "…", tooltip
        if row.finished_at:
            assert end == row.finished_at.isoformat(" ", "milliseconds")[:23] + " UTC"


def test_a_post_cannot_change_a_threads_owner_agent_or_model_issue_37(client, staff_user, user, other_user):
    thread = Conversation.objects.create(user=user, agent_id="assistant", model="replay:plain_answer", title="a")
    client.force_login(staff_user)
    url = reverse("admin:conversations_conversation_change", args=[thread.pk])
    page = client.get(url).content.decode()
    assert 'name="user"' not in page and 'name="model"' not in page and 'name="agent_id"' not in page
    response = client.post(
        url,
        {
            "user": other_user.pk,
            "agent_id": "researcher",
            "model": "replay:slow_answer",
            "title": "renamed",
            "status": "archived",
        },
    )
    assert response.status_code == 302, response.content.decode()[:2000]
    thread.refresh_from_db()
    assert (thread.user_id, thread.agent_id, thread.model) == (user.pk, "assistant", "replay:plain_answer")
    assert (thread.title, thread.status) == ("renamed", "archived")


def test_feedback_is_read_only_in_the_admin_issue_37(client, staff_user, user, other_user):
    thread = Conversation.objects.create(user=user, agent_id="assistant", model="replay:plain_answer")
    answer = Message.objects.create(thread=thread, role="assistant", content="hello")
    feedback = MessageFeedback.objects.create(message=answer, user=user, rating="like", reason="good")
    client.force_login(staff_user)
    url = reverse("admin:conversations_messagefeedback_change", args=[feedback.pk])
    page = client.get(url)
    assert page.status_code == 200
    html = page.content.decode()
    assert 'name="rating"' not in html and 'name="user"' not in html and 'name="reason"' not in html
    changed = client.post(url, {"message": answer.pk, "user": other_user.pk, "rating": "dislike", "reason": "x"})
    assert changed.status_code == 403
    deleted = client.post(reverse("admin:conversations_messagefeedback_delete", args=[feedback.pk]), {"post": "yes"})
    assert deleted.status_code == 403
    bulk = client.post(
        reverse("admin:conversations_messagefeedback_changelist"),
        {"action": "delete_selected", "_selected_action": [feedback.pk], "post": "yes"},
    )
    assert bulk.status_code in (200, 302)
    feedback.refresh_from_db()
    assert (feedback.user_id, feedback.rating, feedback.reason) == (user.pk, "like", "good")


def test_only_feedback_on_an_audit_row_is_marked_in_the_feedback_list_issue_37(client, staff_user, user):
    thread = Conversation.objects.create(user=user, agent_id="assistant", model="replay:plain_answer")
    run = big_run(thread, rows=2)
    audit_row = Message.objects.filter(run=run).order_by("id").first()
    answer = Message.objects.create(thread=thread, role="assistant", content="hello")
    normal = MessageFeedback.objects.create(message=answer, user=user, rating="like")
    on_audit = MessageFeedback.objects.create(message=audit_row, user=user, rating="dislike")
    client.force_login(staff_user)
    html = client.get(reverse("admin:conversations_messagefeedback_changelist")).content.decode()

    def cell(feedback):
        [row] = [r for r in re.findall(r"<tr>.*?</tr>", html, re.S) if f"/{feedback.pk}/change/" in r]
        return re.search(r'<td class="field-on_audit_row">(.*?)</td>', row, re.S).group(1)

    assert cell(normal) == "—"
    assert "audit row" in cell(on_audit) and "yx-on-audit-row" in cell(on_audit)
    assert "icon-no.svg" not in html and "icon-yes.svg" not in html
