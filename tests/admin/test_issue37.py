"""What the admin screenshots of issue 37 showed, each as a test: the
model filter lists the models the audit used, not every bundled scenario."""

from __future__ import annotations

import re

import pytest
from django.urls import reverse

from audit.catalogue import available_models
from audit.models import AgentRun
from conversations.models import Conversation
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
