"""A thread's audit timeline in the admin, one group per run (R-ADM-1,
issue 37): on one axis for the whole thread a 40-turn thread was 15,000 px
of 1-2 px bars; each run now has its own axis and older runs are
collapsed."""

from __future__ import annotations

import datetime as dt
import re

import pytest
from django.urls import reverse

from audit.admin import RUN_GROUPS_OPEN

from .builders import big_run

pytestmark = pytest.mark.django_db

RUNS = 40
ROWS = 12


def groups_of(html: str) -> list[str]:
    """The HTML of each run group, in page order."""
    return html.split('<details class="yx-run-group"')[1:]


def test_thread_of_40_runs_is_one_group_per_run_on_its_own_axis_R_ADM_1(
    client, staff_user, thread, django_assert_max_num_queries
):
    base = dt.datetime(2026, 11, 30, 6, 0, tzinfo=dt.UTC)
    # A turn an hour: on one thread-wide axis a 6 s run is 0.1% wide.
    runs = [big_run(thread, rows=ROWS, start=base + dt.timedelta(hours=k)) for k in range(RUNS)]
    client.force_login(staff_user)
    # session, user, thread, timeline page, the page's runs (+ savepoints)
    with django_assert_max_num_queries(8):
        html = client.get(reverse("admin:conversations_conversation_timeline", args=[thread.pk])).content.decode()
    groups = groups_of(html)
    assert len(groups) == RUNS
    # The newest runs open, older ones collapsed and without their rows:
    # the page weighs what it shows.
    opened = [group.split(">", 1)[0].endswith(" open") for group in groups]
    assert opened == [False] * (RUNS - RUN_GROUPS_OPEN) + [True] * RUN_GROUPS_OPEN
    assert html.count('<tr class="yx-row ') == RUN_GROUPS_OPEN * ROWS
    assert len(html.encode()) < 150_000
    for run, group, is_open in zip(runs, groups, opened, strict=True):
        assert group.startswith(f' data-run-id="{run.pk}"')
        assert reverse("admin:audit_agentrun_change", args=[run.pk]) in group
        assert f"{ROWS} calls" in group
        if is_open:
            rows = group
        else:
            # Loaded when opened: the run's own timeline fragment.
            fragment_url = reverse("admin:audit_agentrun_timeline", args=[run.pk])
            assert f'data-yx-rows-url="{fragment_url}"' in group
            assert '<tr class="yx-row ' not in group
            rows = client.get(fragment_url).content.decode()
        assert rows.count('<tr class="yx-row ') == ROWS
        bars = [(float(a), float(b)) for a, b in re.findall(r"margin-left:([\d.]+)%;width:([\d.]+)%", rows)]
        assert len(bars) == ROWS - 1  # the rejected tool call never started
        # The run's own span: its first call at the left edge, its last
        # one ending at the right edge.
        assert min(left for left, _ in bars) == 0.0
        assert max(left + width for left, width in bars) == pytest.approx(100.0, abs=0.01)
        # A 400 ms model call of a 6.4 s run is 6% wide; on the thread's
        # 39-hour axis it was the minimum bar.
        assert max(width for _, width in bars) > 5.0
