"""Cost in the admin (R-COST-2, R-COST-3): run and thread lists show cost
summed from the rows and sort by it, the run page and its timeline show it,
the dashboard page charts cost and links the costliest runs, and budgets
are edited in the admin with the same validation as ``set_budget``."""

from __future__ import annotations

import json
import uuid
from decimal import Decimal

import pytest
from django.urls import reverse
from django.utils import timezone

from audit.models import AgentRun
from conversations.models import Conversation, Message
from costs.models import Budget

pytestmark = pytest.mark.django_db


def _costed_run(user, *costs):
    thread = Conversation.objects.create(user=user, agent_id="assistant", model="replay:plain_answer")
    run = AgentRun.objects.create(
        request_id=uuid.uuid4().hex,
        thread=thread,
        user=user,
        agent_id="assistant",
        model=thread.model,
        status="completed",
    )
    for i, cost in enumerate(costs, start=1):
        Message.objects.create(
            thread=thread,
            run=run,
            role="assistant",
            message_type="model_audit",
            operation_id=f"op-{i}",
            sequence=i,
            execution_status="completed" if cost is not None else "interrupted",
            started_at=timezone.now(),
            finished_at=timezone.now(),
            cost_usd=None if cost is None else Decimal(cost),
            price_source="replay-default" if cost else "",
        )
    return run


def _cost_column(client, admin_name: str) -> int:
    """The changelist's ``o`` index of its cost column (descending order
    is ``-index``), read from the changelist itself: the action checkbox
    column counts too."""
    page = client.get(reverse(f"admin:{admin_name}_changelist"))
    return page.context["cl"].list_display.index("cost")


def test_run_and_thread_lists_show_and_sort_by_cost_R_COST_2(client, staff_user, user):
    # Created after the dear one: newest-first order alone would list it first.
    dear = _costed_run(user, "0.5", "0.25")
    cheap = _costed_run(user, "0.001")
    unknown = _costed_run(user, None)
    client.force_login(staff_user)
    page = client.get(reverse("admin:audit_agentrun_changelist"), {"o": f"-{_cost_column(client, 'audit_agentrun')}"})
    assert page.status_code == 200
    ids = [r.pk for r in page.context["cl"].result_list]
    assert ids.index(dear.pk) < ids.index(cheap.pk)
    html = page.content.decode()
    assert "$0.75" in html and "$0.001" in html and unknown.pk in ids

    threads = client.get(
        reverse("admin:conversations_conversation_changelist"),
        {"o": f"-{_cost_column(client, 'conversations_conversation')}"},
    )
    assert threads.status_code == 200
    listed = [t.pk for t in threads.context["cl"].result_list]
    assert listed.index(dear.thread_id) < listed.index(cheap.thread_id)
    assert "$0.75" in threads.content.decode()


def test_run_page_shows_cost_with_unknown_calls_R_COST_2(client, staff_user, user):
    run = _costed_run(user, "0.5", None)
    client.force_login(staff_user)
    html = client.get(reverse("admin:audit_agentrun_change", args=[run.pk])).content.decode()
    assert "$0.5 (+ 1 call(s) of unknown cost)" in html
    assert 'class="yx-num yx-cost"' in html


def test_dashboard_page_charts_cost_and_links_the_costliest_runs_R_COST_2(client, staff_user, user):
    run = _costed_run(user, "1.25")
    client.force_login(staff_user)
    response = client.get(reverse("admin-dashboard"))
    html = response.content.decode()
    assert 'id="chart-cost"' in html and 'id="chart-cost-users"' in html
    assert reverse("admin:audit_agentrun_change", args=[run.pk]) in html
    data = json.loads(html.split('id="yx-dashboard-data" type="application/json">')[1].split("</script>")[0])
    assert data["costs"]["summary"]["total_usd"] == "1.25"
    assert data["costs"]["by_user"][0]["key"] == user.username


def test_budget_admin_validates_like_the_command_R_COST_3(client, staff_user, user):
    client.force_login(staff_user)
    url = reverse("admin:costs_budget_add")
    refused = client.post(url, {"user": user.pk, "limit_usd": "-1", "period": "day"})
    assert refused.status_code == 200 and not Budget.objects.exists()
    refused = client.post(url, {"user": user.pk, "limit_usd": "1", "period": "week"})
    assert refused.status_code == 200 and not Budget.objects.exists()
    assert client.post(url, {"user": user.pk, "limit_usd": "1.5", "period": "day"}).status_code == 302
    assert client.post(url, {"user": "", "limit_usd": "3", "period": "month"}).status_code == 302
    second_default = client.post(url, {"user": "", "limit_usd": "4", "period": "month"})
    assert second_default.status_code == 200 and Budget.objects.count() == 2
    listing = client.get(reverse("admin:costs_budget_changelist")).content.decode()
    assert "(default for every user without one)" in listing


def test_budget_admin_picks_the_user_by_name_not_by_raw_id_issue_37(client, staff_user, user, other_user):
    client.force_login(staff_user)
    page = client.get(reverse("admin:costs_budget_add")).content.decode()
    assert "vForeignKeyRawIdAdminField" not in page
    assert 'class="admin-autocomplete' in page and 'name="user"' in page
    found = client.get(
        reverse("admin:autocomplete"),
        {"term": user.username, "app_label": "costs", "model_name": "budget", "field_name": "user"},
    )
    assert found.status_code == 200
    assert [r["text"] for r in found.json()["results"]] == [user.username]
    assert (
        client.post(reverse("admin:costs_budget_add"), {"user": user.pk, "limit_usd": "2", "period": "day"}).status_code
        == 302
    )
    assert Budget.objects.get().user == user
