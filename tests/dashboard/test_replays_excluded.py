"""Replayed runs are audit runs like any other, kept out of the dashboard's
figures and of the users' statistics, and marked as replays in the admin
(R-REPLAY-2, R-DASH-1, issue 34): every figure — from the rollups, from the
rows, after a rebuild, over HTTP — is the same before and after a replay."""

from __future__ import annotations

import pytest
from django.core.management import call_command
from django.db import IntegrityError
from django.urls import reverse
from django.utils import timezone

from audit.execution.rerun import REPLAY_USERNAME, load_source, replay
from audit.models import AgentRun
from costs import selectors as cost_selectors
from dashboard import selectors
from tests.audit.test_scenario_export import execute
from tests.conftest import bearer
from tests.dashboard.test_rollups import _rows_only, figures, figures_from_rows, rollup_state
from tests.dashboard.test_rollups import _rows_window_is_not_rolled_up as _rows_window_is_not_rolled_up  # noqa: F401 (autouse)

# The replay executes its runs here while its model server answers from a
# thread: committed transactions, as in tests/audit/test_replay_run.py.
pytestmark = pytest.mark.django_db(transaction=True)


def _today():
    return selectors.dashboard_window(first_day=timezone.localdate(), last_day=timezone.localdate(), tz="UTC")


def _everything(window) -> dict:
    return {"rollups": rollup_state(), "figures": figures(window), "rows": figures_from_rows(window)}


def _replayed(user) -> tuple[AgentRun, AgentRun]:
    run = execute(user, "plain_answer", "hello")
    report = replay(load_source(str(run.id)), source=str(run.id))
    assert report.identical, report.text()
    return run, AgentRun.objects.get(pk=report.run_ids[-1])


def test_a_replay_changes_no_dashboard_figure_rolled_up_live_or_rebuilt_R_REPLAY_2_R_DASH_1(user, replay_models):
    window = _today()
    run = execute(user, "plain_answer", "hello")
    before = _everything(window)
    assert before["figures"]["overview"]["runs"] == 1

    report = replay(load_source(str(run.id)), source=str(run.id))
    assert report.identical, report.text()
    replayed = AgentRun.objects.get(pk=report.run_ids[-1])
    # An audit run like any other: leased, recorded, sealed, rolled up
    # (marked, adding nothing) — and marked as the replay of the run.
    assert (replayed.replay_of, run.replay_of) == (str(run.id), "")
    assert replayed.sealed_at is not None and replayed.rolled_up_at is not None
    assert replayed.status == AgentRun.Status.COMPLETED

    assert _everything(window) == before
    call_command("rebuild_rollups", verbosity=0)
    assert _everything(window) == before


def test_a_replay_not_rolled_up_yet_is_not_counted_live_either_R_DASH_1(user, replay_models):
    window = _today()
    run, replayed = _replayed(user)
    AgentRun.objects.filter(pk=replayed.pk).update(rolled_up_at=None)  # a run the terminal path left unmarked
    assert figures(window)["overview"]["runs"] == 1
    assert selectors.overview(window)["conversations"] == 1


def test_the_replay_user_has_no_statistics_on_the_dashboard_R_REPLAY_2_R_DASH_1(
    client, user, staff_user, replay_models
):
    _replayed(user)
    window = _today()
    day = timezone.localdate()
    for read in (window, _rows_only(window)):
        assert [row["key"] for row in cost_selectors.costs_by(read, group_by="user")] == [user.username]
        assert REPLAY_USERNAME not in {row["username"] for row in cost_selectors.costliest_runs(read)}
    overview = client.get(f"/api/dashboard/overview?from={day}&to={day}&tz=UTC", headers=bearer(staff_user)).json()
    assert (overview["runs"], overview["active_users"], overview["conversations"]) == (1, 1, 1)
    costs = client.get(f"/api/dashboard/costs?from={day}&to={day}&tz=UTC&group_by=user", headers=bearer(staff_user))
    assert REPLAY_USERNAME not in costs.content.decode()


def test_the_admin_marks_replays_and_links_the_recorded_run_R_REPLAY_2(client, user, staff_user, replay_models):
    run, replayed = _replayed(user)
    client.force_login(staff_user)
    changelist = reverse("admin:audit_agentrun_changelist")

    page = client.get(changelist).content.decode()
    assert page.count('class="yx-badge yx-replay"') == 1
    run_link, replay_link = (
        f'href="{reverse("admin:audit_agentrun_change", args=[pk])}' for pk in (run.pk, replayed.pk)
    )
    replays = client.get(changelist, {"replay": "yes"}).content.decode()
    assert replay_link in replays and run_link not in replays
    others = client.get(changelist, {"replay": "no"}).content.decode()
    assert run_link in others and replay_link not in others

    detail = client.get(reverse("admin:audit_agentrun_change", args=[replayed.pk])).content.decode()
    recorded_url = reverse("admin:audit_agentrun_change", args=[run.pk])
    assert f'Replay of run <a href="{recorded_url}">{str(run.id)[:8]}</a>' in detail


def test_a_sealed_run_cannot_be_marked_or_unmarked_as_a_replay_R_GOV_3(user, replay_models):
    run, replayed = _replayed(user)
    for pk, mark in ((replayed.pk, ""), (run.pk, str(replayed.id))):
        with pytest.raises(IntegrityError, match="replay mark"):
            AgentRun.objects.filter(pk=pk).update(replay_of=mark)
